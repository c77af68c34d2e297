//! The GPU driver's own errors: `NVRM: Xid` lines of the kernel log, parsed (the PCI device,
//! the code, the pid and process name when the driver names them), given a one-line meaning and
//! a severity for the common codes (after NVIDIA's Xid catalog), and joined to NVML's GPUs by
//! PCI bus id. `doctor` reports them as findings, `ps` in a short section, both in `--json`;
//! [`recent`] is the entry point (the exporter's too).
//!
//! # Where the lines come from
//!
//! `/dev/kmsg` (non-blocking, read record by record until `EAGAIN`), else the `dmesg` command;
//! both need `CAP_SYSLOG` when `kernel.dmesg_restrict` is 1, and the report says so when the log
//! cannot be read. Lines may carry `/dev/kmsg`'s `prio,seq,usec,flags;` prefix or `dmesg`'s
//! `[ 123.456789]` one; the time since boot in either dates the event.
//!
//! # Test hook
//!
//! `CISTERN_FAKE_KMSG=<file>` reads kernel-log lines (either prefix, or none) from a file
//! instead; "now" is then the newest line's time, so that recorded lines stay recent.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::gpu::GpuInfo;

/// At most this many events are kept (the newest).
pub const MAX_EVENTS: usize = 64;
/// A message is cut to this many characters.
const MAX_MESSAGE_CHARS: usize = 300;
/// At most this many kernel-log records are read.
const MAX_RECORDS: usize = 200_000;

/// How much an Xid says about the node's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum XidSeverity {
    /// The GPU (or its memory, link or firmware) failed: the GPU needs a reset, a drain, or
    /// service; memory it held may stay held until then.
    Fatal,
    /// Most often the application's own error (a bad kernel, an illegal access), or a recorded
    /// event to watch; the GPU itself is usually fine.
    Application,
}

impl XidSeverity {
    /// The name used in JSON and in the exporter's `severity` label.
    pub fn name(self) -> &'static str {
        match self {
            XidSeverity::Fatal => "fatal",
            XidSeverity::Application => "application",
        }
    }
}

/// What the common codes mean: `(code, severity, meaning)`, after NVIDIA's Xid catalog
/// (docs.nvidia.com/deploy/xid-errors).
const CODES: &[(u32, XidSeverity, &str)] = &[
    (13, XidSeverity::Application, "Graphics engine exception: usually the application's bug (an illegal instruction or out-of-range access in a kernel)"),
    (31, XidSeverity::Application, "GPU memory page fault: the application accessed memory it does not own (an illegal address)"),
    (43, XidSeverity::Application, "GPU stopped processing: a channel was aborted after the application's error; the GPU is usually fine"),
    (45, XidSeverity::Application, "Preemptive cleanup after earlier errors: the driver tore down a channel, most often because its process was killed or exited"),
    (48, XidSeverity::Fatal, "Double-bit ECC error: an uncorrectable memory error; processes using the GPU are affected and the GPU needs a reset"),
    (61, XidSeverity::Fatal, "Internal micro-controller breakpoint/warning: GPU firmware fault; reset the GPU"),
    (62, XidSeverity::Fatal, "Internal micro-controller halt: GPU firmware stopped; reset the GPU"),
    (63, XidSeverity::Application, "ECC page retirement or row remapping recorded: a memory row was retired or remapped (takes effect at the next GPU reset); watch the rate"),
    (64, XidSeverity::Fatal, "ECC page retirement or row remapping failed: failing memory; drain the GPU and have it checked"),
    (68, XidSeverity::Application, "Video decoder (NVDEC) exception: usually the application's or the stream's error"),
    (69, XidSeverity::Application, "Graphics engine class error: usually the application's error"),
    (74, XidSeverity::Fatal, "NVLink error: a link between GPUs failed; jobs using it are affected; reset the GPUs, check the links"),
    (79, XidSeverity::Fatal, "GPU has fallen off the bus: the GPU no longer answers on PCIe; drain the node, reset or reboot, check power and seating"),
    (92, XidSeverity::Application, "High single-bit ECC error rate: corrected errors above the threshold; watch it, a rising rate precedes failures"),
    (94, XidSeverity::Fatal, "Contained ECC error: an uncorrectable error, contained to the processes using that memory (they were stopped); reset the GPU when it is free"),
    (95, XidSeverity::Fatal, "Uncontained ECC error: an uncorrectable error affecting every process on the GPU; reset the GPU"),
    (119, XidSeverity::Fatal, "GSP RPC timeout: the GPU's system processor stopped answering the driver; reset the GPU (or reload the driver)"),
    (120, XidSeverity::Fatal, "GSP error: the GPU's system processor reported a fault; reset the GPU"),
];

/// The meaning and severity of an Xid code, when it is one of the common ones.
pub fn meaning(code: u32) -> Option<(XidSeverity, &'static str)> {
    CODES
        .iter()
        .find(|c| c.0 == code)
        .map(|&(_, sev, text)| (sev, text))
}

/// One Xid event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct XidEvent {
    /// The Xid code.
    pub xid: u32,
    /// The device as the driver logged it (`0000:3b:00`: domain, bus, device).
    pub pci: Option<String>,
    /// NVML's index of that GPU, when NVML lists one at that bus id.
    pub gpu_index: Option<u32>,
    /// NVML's UUID of that GPU.
    pub gpu_uuid: Option<String>,
    /// The pid the driver names (drivers since about R470), in the host's pid namespace.
    pub pid: Option<u32>,
    /// The process name the driver names.
    pub process_name: Option<String>,
    /// Seconds since boot, when the line is dated.
    pub since_boot_s: Option<f64>,
    /// Seconds before now, when dated.
    pub age_s: Option<f64>,
    /// The severity: `fatal` or `application` (unknown codes: `application`).
    pub severity: XidSeverity,
    /// The common codes' meaning in a line.
    pub meaning: Option<&'static str>,
    /// The driver's text after the code (cut to 300 characters).
    pub message: String,
}

/// The recent Xid events, or why the kernel log could not be read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct XidReport {
    /// Where the lines came from (`/dev/kmsg`, `dmesg`, or `CISTERN_FAKE_KMSG=<file>`).
    pub source: Option<String>,
    /// Why the kernel log could not be read, and what to do (events are then empty).
    pub unavailable: Option<String>,
    /// The window asked for (seconds).
    pub window_s: f64,
    /// The events in the window, oldest first (at most [`MAX_EVENTS`], the newest).
    pub events: Vec<XidEvent>,
    /// Events in the window left out to keep [`MAX_EVENTS`].
    pub left_out: usize,
}

/// Strips `/dev/kmsg`'s `prio,seq,usec,flags;` or `dmesg`'s `[ 123.456]` prefix (and a syslog
/// `kernel:` tag): the message and its time since boot, when given.
fn strip_prefix(line: &str) -> (&str, Option<f64>) {
    let line = line.trim_start();
    // /dev/kmsg: the header has no spaces and ends at the first ';'.
    if let Some((head, msg)) = line.split_once(';') {
        let f: Vec<&str> = head.split(',').collect();
        if f.len() >= 3
            && f[..3]
                .iter()
                .all(|x| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit()))
        {
            let usec: Option<f64> = f[2].parse::<u64>().ok().map(|u| u as f64 / 1e6);
            return (msg, usec);
        }
    }
    // dmesg: `[ 123.456789] message`, possibly after a syslog prefix.
    if let Some(open) = line.find('[') {
        if let Some(close) = line[open..].find(']') {
            let inside = line[open + 1..open + close].trim();
            if let Ok(secs) = inside.parse::<f64>() {
                if secs.is_finite() && secs >= 0.0 {
                    return (&line[open + close + 1..], Some(secs));
                }
            }
        }
    }
    (line, None)
}

/// Parses one kernel-log line: an event when it is an `NVRM: Xid` line, in either form:
///
/// - `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.`
/// - `NVRM: Xid (0000:01:00): 13, Graphics Exception: ...` (older drivers: no pid, no name,
///   and sometimes no `PCI:`).
pub fn parse_line(line: &str) -> Option<XidEvent> {
    let (msg, since_boot_s) = strip_prefix(line);
    let at = msg.find("NVRM: Xid")?;
    let rest = msg[at + "NVRM: Xid".len()..].trim_start();
    let (pci, rest) = match rest.strip_prefix('(') {
        Some(r) => {
            let close = r.find(')')?;
            let inside = r[..close].trim();
            let pci = inside.strip_prefix("PCI:").unwrap_or(inside).trim();
            let rest = r[close + 1..].trim_start().strip_prefix(':')?.trim_start();
            ((!pci.is_empty()).then(|| pci.to_ascii_lowercase()), rest)
        }
        None => (None, rest.strip_prefix(':').unwrap_or(rest).trim_start()),
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let xid: u32 = rest[..digits].parse().ok()?;
    let mut tail = rest[digits..]
        .trim_start()
        .strip_prefix(',')
        .unwrap_or(&rest[digits..])
        .trim_start();
    let mut pid = None;
    let mut process_name = None;
    // The newer form: `pid=1234, name=python, ` (`pid='<unknown>'` when none).
    for _ in 0..2 {
        if let Some(v) = tail.strip_prefix("pid=") {
            let end = v.find(',').unwrap_or(v.len());
            pid = v[..end].trim().parse().ok();
            tail = v[end..].strip_prefix(',').unwrap_or(&v[end..]).trim_start();
        } else if let Some(v) = tail.strip_prefix("name=") {
            let end = v.find(',').unwrap_or(v.len());
            let name = v[..end].trim();
            if !name.is_empty() && name != "<unknown>" && name != "'<unknown>'" {
                process_name = Some(name.chars().take(64).collect());
            }
            tail = v[end..].strip_prefix(',').unwrap_or(&v[end..]).trim_start();
        }
    }
    let (severity, meaning) = match meaning(xid) {
        Some((s, m)) => (s, Some(m)),
        None => (XidSeverity::Application, None),
    };
    Some(XidEvent {
        xid,
        pci,
        gpu_index: None,
        gpu_uuid: None,
        pid,
        process_name,
        since_boot_s,
        age_s: None,
        severity,
        meaning,
        message: tail.trim_end().chars().take(MAX_MESSAGE_CHARS).collect(),
    })
}

/// `(domain, bus, device)` of a PCI address: `0000:3b:00`, `00000000:3B:00.0`, `3b:00.0`.
fn pci_key(s: &str) -> Option<(u32, u32, u32)> {
    let s = s.trim();
    let s = s.split('.').next()?;
    let parts: Vec<&str> = s.split(':').collect();
    let hex = |x: &str| u32::from_str_radix(x, 16).ok();
    match parts.as_slice() {
        [d, b, dev] => Some((hex(d)?, hex(b)?, hex(dev)?)),
        [b, dev] => Some((0, hex(b)?, hex(dev)?)),
        _ => None,
    }
}

/// Parses kernel-log text (one record per line), keeps the Xid events of the last `window`
/// before `now_s` (seconds since boot; undated events are kept), and names their GPUs.
pub fn from_lines(text: &str, gpus: &[GpuInfo], window: Duration, now_s: Option<f64>) -> XidReport {
    let mut events: Vec<XidEvent> = text.lines().filter_map(parse_line).collect();
    let now_s = now_s.or_else(|| {
        events
            .iter()
            .filter_map(|e| e.since_boot_s)
            .reduce(f64::max)
    });
    let win = window.as_secs_f64();
    for e in &mut events {
        e.age_s = match (now_s, e.since_boot_s) {
            (Some(now), Some(t)) => Some((now - t).max(0.0)),
            _ => None,
        };
        if let Some(key) = e.pci.as_deref().and_then(pci_key) {
            if let Some(g) = gpus
                .iter()
                .find(|g| g.pci_bus_id.as_deref().and_then(pci_key) == Some(key))
            {
                e.gpu_index = Some(g.index);
                e.gpu_uuid = Some(g.uuid.clone());
            }
        }
    }
    events.retain(|e| e.age_s.is_none_or(|a| a <= win));
    let left_out = events.len().saturating_sub(MAX_EVENTS);
    events.drain(..left_out);
    XidReport {
        source: None,
        unavailable: None,
        window_s: win,
        events,
        left_out,
    }
}

fn uptime_s() -> Option<f64> {
    fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn needs_privilege(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
}

const PRIVILEGE_FIX: &str = "reading the kernel log needs CAP_SYSLOG while \
     kernel.dmesg_restrict is 1: run as root (or in a container with CAP_SYSLOG), or set \
     `sysctl kernel.dmesg_restrict=0`";

/// Reads `/dev/kmsg` from its oldest record until `EAGAIN` (it never blocks).
fn read_kmsg() -> io::Result<String> {
    let mut f: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/kmsg")?;
    let mut out = String::new();
    // One read returns one record; a record is at most about 8 KiB (the kernel's limit, less
    // than this buffer: a smaller one gets EINVAL).
    let mut buf = vec![0u8; 16 * 1024];
    for _ in 0..MAX_RECORDS {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                // Continuation lines (` KEY=value`) are dictionary entries, not messages.
                if let Some(first) = rec.lines().next() {
                    out.push_str(first);
                    out.push('\n');
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            // Records overwritten while reading: the next read goes on from the oldest left.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

fn read_dmesg() -> Result<String, String> {
    let out = std::process::Command::new("dmesg")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("running dmesg: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let err = err.trim();
        if err.contains("Operation not permitted") || err.contains("ermission denied") {
            return Err(format!("dmesg: {err}: {PRIVILEGE_FIX}"));
        }
        return Err(format!("dmesg failed ({}): {err}", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The Xid events of the last `window`, from the kernel log (or `CISTERN_FAKE_KMSG`), with
/// their GPUs named from `gpus` (NVML's, matched by PCI bus id). Never fails: when the log
/// cannot be read, [`XidReport::unavailable`] says why and what would let it.
pub fn recent(gpus: &[GpuInfo], window: Duration) -> XidReport {
    if let Some(path) = std::env::var_os("CISTERN_FAKE_KMSG").filter(|v| !v.is_empty()) {
        let path = Path::new(&path);
        let source = Some(format!("CISTERN_FAKE_KMSG={}", path.display()));
        return match fs::read(path) {
            Ok(bytes) => XidReport {
                source,
                ..from_lines(&String::from_utf8_lossy(&bytes), gpus, window, None)
            },
            Err(e) => XidReport {
                source,
                unavailable: Some(format!(
                    "CISTERN_FAKE_KMSG: reading {}: {e}",
                    path.display()
                )),
                window_s: window.as_secs_f64(),
                ..XidReport::default()
            },
        };
    }
    let now = uptime_s();
    let kmsg_err = match read_kmsg() {
        Ok(text) => {
            return XidReport {
                source: Some("/dev/kmsg".into()),
                ..from_lines(&text, gpus, window, now)
            }
        }
        Err(e) if needs_privilege(&e) => format!("/dev/kmsg: {e}: {PRIVILEGE_FIX}"),
        Err(e) => format!("/dev/kmsg: {e}"),
    };
    match read_dmesg() {
        Ok(text) => XidReport {
            source: Some("dmesg".into()),
            ..from_lines(&text, gpus, window, now)
        },
        Err(dmesg_err) => XidReport {
            source: None,
            unavailable: Some(format!(
                "the kernel log cannot be read: {kmsg_err}; {dmesg_err}"
            )),
            window_s: window.as_secs_f64(),
            ..XidReport::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str, bus: Option<&str>) -> GpuInfo {
        GpuInfo {
            index,
            uuid: uuid.into(),
            name: String::new(),
            total: 0,
            used: 0,
            free: 0,
            reserved: None,
            compute_mode: "default".into(),
            mps: false,
            mig: None,
            pci_bus_id: bus.map(str::to_string),
        }
    }

    /// Recorded lines: a current driver's Xid 79 (as in an open-gpu-kernel-modules report), an
    /// older one's (no pid, no `PCI:`, in `dmesg` form), Xid 63 with a pid, and `/dev/kmsg`
    /// records with their header.
    #[test]
    fn both_forms_and_both_prefixes() {
        let e = parse_line("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.").unwrap();
        assert_eq!(
            (e.xid, e.pci.as_deref(), e.pid),
            (79, Some("0000:2b:00"), None)
        );
        assert_eq!(e.severity, XidSeverity::Fatal);
        assert_eq!(e.message, "GPU has fallen off the bus.");
        assert!(e.meaning.unwrap().contains("fallen off the bus"));

        let e = parse_line(
            "[  269.517039] NVRM: Xid (0000:01:00): 13, Graphics Exception: ESR 0x404600=0x80000002",
        )
        .unwrap();
        assert_eq!(
            (e.xid, e.pci.as_deref(), e.since_boot_s),
            (13, Some("0000:01:00"), Some(269.517039))
        );
        assert_eq!(e.severity, XidSeverity::Application);
        assert!(e.message.starts_with("Graphics Exception"));

        let e = parse_line(
            "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
        )
        .unwrap();
        assert_eq!(
            (e.xid, e.pid, e.process_name.as_deref()),
            (63, Some(1896), None)
        );
        assert!(e.message.starts_with("Row Remapper"));

        let e = parse_line(
            "3,1234,5000123,-;NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python, Ch 00000008, intr 00000000. MMU Fault",
        )
        .unwrap();
        assert_eq!(
            (e.xid, e.pid, e.process_name.as_deref(), e.since_boot_s),
            (31, Some(4242), Some("python"), Some(5.000123))
        );
        assert!(e.message.starts_with("Ch 00000008"));

        let e = parse_line(
            "4,99,7,c;NVRM: Xid (PCI:0000:3b:00): 43, pid='<unknown>', name=<unknown>, Ch 00000010",
        )
        .unwrap();
        assert_eq!((e.xid, e.pid, e.process_name), (43, None, None));
        // A syslog line around the dmesg form.
        let e = parse_line("May 13 17:18:47 host kernel: [ 12.5] NVRM: Xid (PCI:0000:08:00): 69, Class Error: ChId 003b").unwrap();
        assert_eq!((e.xid, e.since_boot_s), (69, Some(12.5)));
        // Unknown codes parse, with no meaning.
        let e = parse_line("NVRM: Xid (PCI:0000:08:00): 154, GPU recovery action changed").unwrap();
        assert_eq!((e.xid, e.meaning), (154, None));
        for not in [
            "",
            "NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014",
            "NVRM: Xid (PCI:0000:2b:00",
            "NVRM: Xid (PCI:0000:2b:00): x",
            "6,1,2,-;usb 1-1: new device",
            "[abc] NVRM: Xid",
        ] {
            assert_eq!(parse_line(not), None, "{not:?}");
        }
    }

    #[test]
    fn every_listed_code_has_a_meaning() {
        for code in [
            13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120,
        ] {
            assert!(meaning(code).is_some(), "{code}");
        }
        for fatal in [48, 79, 95, 74, 64] {
            assert_eq!(meaning(fatal).unwrap().0, XidSeverity::Fatal, "{fatal}");
        }
        for app in [13, 31, 43] {
            assert_eq!(meaning(app).unwrap().0, XidSeverity::Application, "{app}");
        }
    }

    #[test]
    fn events_are_matched_to_gpus_and_windowed() {
        let gpus = [
            gpu(0, "GPU-aaaa", Some("00000000:3B:00.0")),
            gpu(1, "GPU-bbbb", Some("00000000:86:00.0")),
            gpu(2, "GPU-cccc", None),
        ];
        let text = "[ 100.0] NVRM: Xid (PCI:0000:86:00): 48, pid=7, name=a, DBE\n\
                    [ 9000.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=8, name=b, Graphics Exception\n\
                    [ 9500.0] NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off the bus.\n\
                    some other line\n";
        let r = from_lines(text, &gpus, Duration::from_secs(3600), Some(10_000.0));
        let got: Vec<(u32, Option<u32>)> = r.events.iter().map(|e| (e.xid, e.gpu_index)).collect();
        // The one at 100 s is 2.7 h old: outside the hour.
        assert_eq!(got, [(13, Some(0)), (79, None)]);
        assert_eq!(r.events[0].gpu_uuid.as_deref(), Some("GPU-aaaa"));
        assert_eq!(r.events[0].age_s, Some(1000.0));
        // Without a clock, the newest line is now.
        let r = from_lines(text, &gpus, Duration::from_secs(86_400), None);
        assert_eq!(r.events.len(), 3);
        assert_eq!(r.events[0].gpu_uuid.as_deref(), Some("GPU-bbbb"));
        assert_eq!(r.events[2].age_s, Some(0.0));
        // Bounded: the newest are kept.
        let many: String = (0..200)
            .map(|i| format!("[ {i}.0] NVRM: Xid (PCI:0000:3b:00): 13, n{i}\n"))
            .collect();
        let r = from_lines(&many, &gpus, Duration::from_secs(86_400), None);
        assert_eq!((r.events.len(), r.left_out), (MAX_EVENTS, 200 - MAX_EVENTS));
        assert_eq!(r.events.last().unwrap().message, "n199");
    }

    #[test]
    fn the_kernel_log_is_read_or_the_report_says_why_not() {
        // Whatever this machine allows: never a panic, never a hang, and a reason when empty.
        let r = recent(&[], Duration::from_secs(60));
        assert!(r.source.is_some() || r.unavailable.is_some(), "{r:?}");
    }
}
