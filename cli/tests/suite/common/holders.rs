//! Real processes that use `libcistern.so` over the fake libcuda (the C holder program of
//! `cli/tests/c/holder.c`), children that are killed when dropped, free loopback ports, and a
//! minimal HTTP GET, for the end-to-end tests of the exporter.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// `target/<profile>`, from this test binary's path.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Builds libcistern.so and the fake libcuda in this test's profile (a no-op when fresh).
pub fn build_libraries() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let profile = profile_dir();
    let mut cmd = Command::new(cargo);
    cmd.current_dir(env!("CARGO_MANIFEST_DIR")).args([
        "build",
        "--quiet",
        "-p",
        "cistern-ffi",
        "-p",
        "cistern-fakecuda",
    ]);
    match profile.file_name().and_then(|n| n.to_str()) {
        Some("release") => {
            cmd.arg("--release");
        }
        Some("debug") | None => {}
        Some(other) => {
            cmd.args(["--profile", other]);
        }
    }
    let out = cmd.output().expect("run cargo");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Where the holders run: the holder program, and a library path with the fake driver under
/// libcuda's names (in a private directory, never in target/) and libcistern.so.
pub struct HolderKit {
    pub exe: PathBuf,
    pub libs: String,
}

impl HolderKit {
    /// Builds the libraries and compiles the holder in `work`; `None` (with the reason printed)
    /// when there is no C compiler.
    pub fn new(work: &Path) -> Option<HolderKit> {
        if Command::new("cc").arg("--version").output().is_err() {
            eprintln!("skipping: no C compiler (cc) to build the holder program");
            return None;
        }
        build_libraries();
        let fake = work.join("fake");
        std::fs::create_dir_all(&fake).unwrap();
        std::fs::copy(
            profile_dir().join("libcistern_fakecuda.so"),
            fake.join("libcuda.so"),
        )
        .unwrap();
        std::os::unix::fs::symlink("libcuda.so", fake.join("libcuda.so.1")).unwrap();
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let exe = work.join("holder");
        let out = Command::new("cc")
            .arg("-std=c11")
            .arg("-D_POSIX_C_SOURCE=200809L")
            .arg("-o")
            .arg(&exe)
            .arg(root.join("cli/tests/c/holder.c"))
            .arg("-I")
            .arg(root.join("ffi/include"))
            .arg("-L")
            .arg(profile_dir())
            .arg("-lcistern")
            .output()
            .ok()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(HolderKit {
            exe,
            libs: format!("{}:{}", fake.display(), profile_dir().display()),
        })
    }

    /// The holder of `mib` MiB under `tag` (`mode`: `exit` or `wait`), publishing in
    /// `registry`, on the fake driver (a 4 GiB device), not started.
    pub fn command(&self, registry: &Path, tag: &str, mib: u64, mode: &str) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.args([tag, &mib.to_string(), mode])
            .env("LD_LIBRARY_PATH", &self.libs)
            .env("CISTERN_FAKECUDA", "1")
            .env("CISTERN_FAKECUDA_CAPACITY", "4GiB")
            .env("CISTERN_DRIVER", "cuda")
            .env(
                "CISTERN_CONF",
                format!("registry_dir:{}", registry.display()),
            );
        cmd
    }

    /// Starts [`Self::command`]; returns once it has allocated.
    pub fn spawn(&self, registry: &Path, tag: &str, mib: u64, mode: &str) -> Killed {
        let mut child = self
            .command(registry, tag, mib, mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn holder");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "holder {tag} did not start");
        Killed(child)
    }
}

/// A child process killed (and reaped) when dropped, so that a failing test leaves nothing
/// running.
pub struct Killed(pub Child);

impl Killed {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port that was free a moment ago (for servers that cannot be told to pick one).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An HTTP answer: the status, the headers (names in lower case) and the body.
pub type Answer = (u16, Vec<(String, String)>, String);

/// An HTTP/1.0 GET; `None` when nothing answers.
pub fn http_get(addr: &str, path_and_query: &str, accept: Option<&str>) -> Option<Answer> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut req = format!("GET {path_and_query} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(a) = accept {
        req.push_str(&format!("Accept: {a}\r\n"));
    }
    req.push_str("Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some((status, headers, body.to_string()))
}

/// Percent-encodes a query parameter.
pub fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A program on `PATH`, if there is one.
pub fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}
