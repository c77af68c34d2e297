//! Recording a running process's allocations as a cistern trace (`record:PATH` in
//! `CISTERN_CONF`), for `cistern replay` to replay later against any allocator.
//!
//! The file is cistern's own text format (`# cistern-trace v1`, read and encoded by
//! `cistern-trace`'s `own` module, whose [`Line`] writes every line here): `a <id> <size> <stream>` per allocation (requested bytes), `f <id>` per free,
//! `t <ns>` stamps (time since the pool started), and `r <bytes>` whenever the pool's reserved
//! memory changes, so the trace carries cistern's own reserved curve as a baseline. Ids number
//! allocations in order; pointers are not recorded (they mean nothing on another run). Device `d`
//! records to `PATH` when `d` is 0 and to `PATH.dev<d>` otherwise.
//!
//! Recording takes a lock per operation; it is off by default and costs one branch then. A
//! write error stops the recording with one message; the pool goes on.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cistern_trace::own::Line;
use cistern_trace::Op;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::driver::{DeviceId, StreamId};

/// Writes one device's operations to a trace file.
#[derive(Debug)]
pub struct Recorder {
    inner: Mutex<State>,
}

#[derive(Debug)]
struct State {
    out: Option<BufWriter<File>>,
    path: PathBuf,
    next_id: u64,
    ids: FxHashMap<u64, u64>,
    start: Instant,
    last_t: u64,
    last_reserved: Option<u64>,
    since_flush: u32,
}

impl Recorder {
    /// The path device `dev` records to, for the configured `path`.
    pub fn path_for(path: &Path, dev: DeviceId) -> PathBuf {
        if dev == 0 {
            path.to_path_buf()
        } else {
            let mut p = path.as_os_str().to_owned();
            p.push(format!(".dev{dev}"));
            PathBuf::from(p)
        }
    }

    /// Checks that a recording to `path` can start: `path` is a regular file that opens for
    /// writing (left as it is), or a file that can be created there (created and removed
    /// again). For a pool to refuse a bad `record:PATH` when it starts, before any device pool
    /// is created (each creates its file then, and fails on the first allocation). The error
    /// says what is wrong with which path, and the fix.
    pub fn check_path(path: &Path) -> Result<(), String> {
        use std::os::unix::fs::OpenOptionsExt;
        let fix = "use a writable path, or record:none";
        let shown = path.display();
        let open = |new: bool| {
            let mut o = std::fs::OpenOptions::new();
            o.write(true).mode(0o600).custom_flags(libc::O_NOFOLLOW);
            if new {
                o.create_new(true);
            }
            o.open(path)
        };
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => Err(format!(
                "cannot record to {shown}: it is a symbolic link, which recording never follows; \
                 {fix}"
            )),
            Ok(m) if !m.is_file() => Err(format!(
                "cannot record to {shown}: it is not a regular file; {fix}"
            )),
            Ok(_) => open(false)
                .map(drop)
                .map_err(|e| format!("cannot record to {shown}: {e}; {fix}")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match open(true) {
                Ok(_) => {
                    let _ = std::fs::remove_file(path);
                    Ok(())
                }
                Err(e) => {
                    let dir = match path.parent() {
                        Some(d) if !d.as_os_str().is_empty() => d,
                        _ => Path::new("."),
                    };
                    let why = match std::fs::metadata(dir) {
                        Ok(m) if !m.is_dir() => format!("{} is not a directory", dir.display()),
                        Ok(_) => format!("cannot create files in {}: {e}", dir.display()),
                        Err(d) => format!("its directory {}: {d}", dir.display()),
                    };
                    Err(format!("cannot record to {shown}: {why}; {fix}"))
                }
            },
            Err(e) => Err(format!("cannot record to {shown}: {e}; {fix}")),
        }
    }

    /// Creates (truncates) the file for device `dev` and writes the header.
    pub fn create(path: &Path, dev: DeviceId) -> std::io::Result<Recorder> {
        let path = Self::path_for(path, dev);
        // Never follow a symlink planted at the (predictable) path.
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        let mut out = BufWriter::new(file);
        Line::Header.write_to(&mut out)?;
        Line::Comment(concat!("recorded by cistern ", env!("CARGO_PKG_VERSION")))
            .write_to(&mut out)?;
        Line::Device(dev as u64).write_to(&mut out)?;
        out.flush()?;
        Ok(Recorder {
            inner: Mutex::new(State {
                out: Some(out),
                path,
                next_id: 1,
                ids: FxHashMap::default(),
                start: Instant::now(),
                last_t: 0,
                last_reserved: None,
                since_flush: 0,
            }),
        })
    }

    fn write(st: &mut State, f: impl FnOnce(&mut BufWriter<File>, u64) -> std::io::Result<()>) {
        // Microsecond stamps: finer would double the file for no use.
        let t = st.start.elapsed().as_micros() as u64 * 1000;
        let stamp = t.max(st.last_t);
        let Some(out) = st.out.as_mut() else { return };
        let mut r = Ok(());
        if stamp != st.last_t {
            r = Line::Time(stamp).write_to(&mut *out);
        }
        let r = r.and_then(|()| f(out, stamp));
        st.last_t = stamp;
        st.since_flush += 1;
        // Flush now and then, so a killed process leaves most of its trace behind.
        let r = if st.since_flush >= 4096 {
            st.since_flush = 0;
            r.and_then(|()| out.flush())
        } else {
            r
        };
        if let Err(e) = r {
            crate::log_rate_limited(&format!(
                "cistern: recording to {} stopped: {e}",
                st.path.display()
            ));
            st.out = None;
        }
    }

    /// Records an allocation of `size` requested bytes at `ptr` on `stream`.
    pub fn alloc(&self, ptr: u64, size: u64, stream: StreamId) {
        let mut st = self.inner.lock();
        let id = st.next_id;
        st.next_id += 1;
        st.ids.insert(ptr, id);
        Self::write(&mut st, |out, _| {
            Line::Op(Op::Alloc {
                id,
                size,
                stream: stream.0,
            })
            .write_to(out)
        });
    }

    /// Records the free of the block at `ptr` (ignored when it was allocated before recording
    /// began).
    pub fn free(&self, ptr: u64) {
        let mut st = self.inner.lock();
        if let Some(id) = st.ids.remove(&ptr) {
            Self::write(&mut st, |out, _| Line::Op(Op::Free { id }).write_to(out));
        }
    }

    /// Records the pool's reserved bytes, when they changed, and flushes (a slow-path event).
    pub fn reserved(&self, bytes: u64) {
        let mut st = self.inner.lock();
        if st.last_reserved != Some(bytes) {
            st.last_reserved = Some(bytes);
            Self::write(&mut st, |out, _| Line::Reserved(bytes).write_to(out));
        }
        self.flush_locked(&mut st);
    }

    fn flush_locked(&self, st: &mut State) {
        if let Some(out) = st.out.as_mut() {
            if let Err(e) = out.flush() {
                crate::log_rate_limited(&format!(
                    "cistern: recording to {} stopped: {e}",
                    st.path.display()
                ));
                st.out = None;
            }
        }
    }

    /// Writes everything buffered.
    pub fn flush(&self) {
        let mut st = self.inner.lock();
        self.flush_locked(&mut st);
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_path_names_what_is_wrong() {
        let dir = std::env::temp_dir().join(format!("cistern-rec-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A new file in a writable directory, and an existing regular file, are fine; the
        // check leaves nothing behind.
        let new = dir.join("new.trace");
        Recorder::check_path(&new).unwrap();
        assert!(!new.exists());
        std::fs::write(&new, "").unwrap();
        Recorder::check_path(&new).unwrap();
        for (path, says) in [
            (dir.join("no-such-dir/t.trace"), "No such file"),
            (new.join("t.trace"), "ot a directory"),
            (dir.clone(), "not a regular file"),
        ] {
            let e = Recorder::check_path(&path).unwrap_err();
            assert!(
                e.contains(says) && e.contains(&path.display().to_string()),
                "{e}"
            );
            assert!(e.contains("record:none"), "{e}");
        }
        let link = dir.join("link.trace");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&new, &link).unwrap();
        let e = Recorder::check_path(&link).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writes_the_own_format() {
        let dir = std::env::temp_dir().join(format!("cistern-rec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.trace");
        {
            let r = Recorder::create(&path, 0).unwrap();
            r.reserved(2 << 20);
            r.alloc(0x1000, 100, StreamId(0));
            r.alloc(0x2000, 200, StreamId(7));
            r.free(0x1000);
            r.free(0x9999); // unknown: ignored
            r.alloc(0x1000, 300, StreamId(0));
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let ops: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with('t'))
            .collect();
        assert_eq!(
            ops,
            [
                "device 0",
                "r 2097152",
                "a 1 100 0",
                "a 2 200 7",
                "f 1",
                "a 3 300 0"
            ]
        );
        assert!(text.starts_with("# cistern-trace v1\n"));
        assert_eq!(
            Recorder::path_for(&path, 2).file_name().unwrap(),
            "t.trace.dev2"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
