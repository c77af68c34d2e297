//! The common entry point: [`load`] detects a trace file's format and returns one [`Trace`] per
//! device, each with its replayable sequence and, where the file records it, the allocator's own
//! reserved-bytes curve as a baseline.

use std::path::{Path, PathBuf};

use crate::kineto::{self, KinetoOptions};
use crate::sequence::AllocSequence;
use crate::snapshot::Snapshot;
use crate::{minimalloc, own, rmm};

/// A trace ready to replay.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// A short name for tables: the file name, with the device when a file has several.
    pub name: String,
    /// CUDA device index.
    pub device: usize,
    /// The operations.
    pub sequence: AllocSequence,
    /// The reserved bytes the recording allocator had, as `(op index, bytes)` points: the value
    /// holds from that op (inclusive) until the next point. The first point is at op 0. `None`
    /// when the file does not record it.
    pub recorded_reserved: Option<Vec<(usize, u64)>>,
    /// The largest recorded reserved value over the trace (which may exceed every point's value
    /// when it was reached between two ops, e.g. in a segment event followed by a segment free).
    pub recorded_peak_reserved: Option<u64>,
}

/// The formats [`load`] recognises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A PyTorch memory snapshot pickle (starts with the pickle PROTO opcode `0x80`).
    Snapshot,
    /// A PyTorch profiler trace (JSON object, possibly gzipped).
    Kineto,
    /// An RMM `logging_resource_adaptor` CSV (its header line).
    Rmm,
    /// cistern's own format (`# cistern-trace v1`).
    Own,
    /// A google/minimalloc CSV (`id,lower,upper,size`).
    MiniMalloc,
}

impl Format {
    /// A lower-case name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Format::Snapshot => "pytorch snapshot",
            Format::Kineto => "pytorch profiler trace",
            Format::Rmm => "rmm log",
            Format::Own => "cistern trace",
            Format::MiniMalloc => "minimalloc csv",
        }
    }
}

/// Options of [`load_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Multiply MiniMalloc sizes by this (default 64: the 1 MiB instances become 64 MiB, well
    /// above a 2 MiB granule).
    pub minimalloc_scale: u64,
    /// Options of the profiler-trace reader.
    pub kineto: KinetoOptions,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            minimalloc_scale: 64,
            kineto: KinetoOptions::default(),
        }
    }
}

/// A trace file that could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("{}: {}{message}", path.display(), format.map(|f| format!("{}: ", f.name())).unwrap_or_default())]
pub struct LoadError {
    /// The file.
    pub path: PathBuf,
    /// The detected format, if detection got that far.
    pub format: Option<Format>,
    /// What went wrong, with the position (line, byte, or path inside the document) and what
    /// was expected.
    pub message: String,
}

/// [`load_with`] with the default options.
pub fn load(path: &Path) -> Result<Vec<Trace>, LoadError> {
    load_with(path, &LoadOptions::default())
}

/// Read `path`, detect its format and return one [`Trace`] per device that has operations.
pub fn load_with(path: &Path, opts: &LoadOptions) -> Result<Vec<Trace>, LoadError> {
    load_file(path, opts).map(|(_, traces)| traces)
}

/// [`load_with`], also returning the detected format. The file is read once, from start to
/// end, so a pipe or a process substitution (`/dev/stdin`, `<(zcat t.gz)`) works.
pub fn load_file(path: &Path, opts: &LoadOptions) -> Result<(Format, Vec<Trace>), LoadError> {
    let bytes = std::fs::read(path).map_err(|e| LoadError {
        path: path.to_path_buf(),
        format: None,
        message: e.to_string(),
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    load_bytes_detected(&name, &bytes, opts).map_err(|(format, message)| LoadError {
        path: path.to_path_buf(),
        format,
        message,
    })
}

/// Detect the format of `bytes` (after gzip decompression when they start with the gzip magic).
pub fn detect(bytes: &[u8]) -> Option<Format> {
    if bytes.first() == Some(&0x80) {
        return Some(Format::Snapshot);
    }
    let text_start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map(|i| &bytes[i..])
        .unwrap_or(&[]);
    if text_start.first() == Some(&b'{') {
        return Some(Format::Kineto);
    }
    if bytes.starts_with(b"# cistern-trace") {
        return Some(Format::Own);
    }
    let first_line = text_start
        .split(|&b| b == b'\n')
        .next()
        .map(|l| String::from_utf8_lossy(l).into_owned())
        .unwrap_or_default();
    if rmm::is_header(&first_line) {
        return Some(Format::Rmm);
    }
    let cols: Vec<&str> = first_line.trim().split(',').map(str::trim).collect();
    if ["id", "lower", "upper", "size"]
        .iter()
        .all(|c| cols.contains(c))
    {
        return Some(Format::MiniMalloc);
    }
    None
}

fn text(bytes: &[u8], format: Format) -> Result<&str, (Option<Format>, String)> {
    std::str::from_utf8(bytes).map_err(|e| {
        (
            Some(format),
            format!("byte {}: expected UTF-8 text", e.valid_up_to()),
        )
    })
}

/// [`load_with`] on bytes already read; `name` names the traces. Errors are the detected format
/// and a message with the position.
pub fn load_bytes(
    name: &str,
    bytes: &[u8],
    opts: &LoadOptions,
) -> Result<Vec<Trace>, (Option<Format>, String)> {
    load_bytes_detected(name, bytes, opts).map(|(_, traces)| traces)
}

/// [`load_bytes`], also returning the detected format.
pub fn load_bytes_detected(
    name: &str,
    bytes: &[u8],
    opts: &LoadOptions,
) -> Result<(Format, Vec<Trace>), (Option<Format>, String)> {
    let plain = kineto::decompress(bytes).map_err(|e| (None, e.to_string()))?;
    let bytes: &[u8] = &plain;
    let format = detect(bytes).ok_or_else(|| {
        (
            None,
            "byte 0: expected a PyTorch snapshot pickle (0x80), a profiler trace (JSON `{`, \
             maybe gzipped), an RMM log header `Thread,Time,Action,Pointer,Size,Stream`, \
             `# cistern-trace v1`, or a MiniMalloc header `id,lower,upper,size`"
                .to_string(),
        )
    })?;
    let fail = |m: String| (Some(format), m);
    let single = |sequence: AllocSequence, device: usize, reserved: Vec<(usize, u64)>| {
        let peak = reserved.iter().map(|&(_, r)| r).max();
        Trace {
            name: name.to_string(),
            device,
            sequence,
            recorded_peak_reserved: peak,
            recorded_reserved: (!reserved.is_empty()).then_some(reserved),
        }
    };
    let traces = match format {
        Format::Snapshot => {
            let snap = Snapshot::from_bytes(bytes).map_err(|e| fail(e.to_string()))?;
            snapshot_traces(name, &snap)
        }
        Format::Kineto => {
            let devs =
                kineto::from_bytes_with(bytes, &opts.kineto).map_err(|e| fail(e.to_string()))?;
            let many = devs.len() > 1;
            devs.into_iter()
                .filter(|d| !d.sequence.ops.is_empty())
                .map(|d| Trace {
                    name: if many {
                        format!("{name} (cuda:{})", d.device)
                    } else {
                        name.to_string()
                    },
                    device: d.device,
                    sequence: d.sequence,
                    recorded_peak_reserved: (!d.reserved.is_empty()).then_some(d.peak_reserved),
                    recorded_reserved: (!d.reserved.is_empty()).then_some(d.reserved),
                })
                .collect()
        }
        Format::Rmm => {
            let log = rmm::parse(text(bytes, format)?).map_err(|e| fail(e.to_string()))?;
            vec![single(log.sequence, 0, Vec::new())]
        }
        Format::Own => {
            let t = own::parse(text(bytes, format)?).map_err(|e| fail(e.to_string()))?;
            let mut tr = single(t.sequence, t.device, t.recorded_reserved);
            if let Some(n) = t.name {
                tr.name = n;
            }
            vec![tr]
        }
        Format::MiniMalloc => {
            let seq = minimalloc::parse_csv(text(bytes, format)?, opts.minimalloc_scale)
                .map_err(|e| fail(e.to_string()))?;
            vec![single(seq, 0, Vec::new())]
        }
    };
    Ok((
        format,
        traces
            .into_iter()
            .filter(|t| !t.sequence.ops.is_empty())
            .collect(),
    ))
}

/// One trace per device of a snapshot, with PyTorch's reserved curve mapped onto the ops.
pub fn snapshot_traces(name: &str, snap: &Snapshot) -> Vec<Trace> {
    let mut devices: Vec<usize> = (0..snap.device_traces.len()).collect();
    for s in &snap.segments {
        if let Ok(d) = usize::try_from(s.device) {
            if !devices.contains(&d) {
                devices.push(d);
            }
        }
    }
    devices.sort_unstable();
    let many = devices.len() > 1;
    let mut out = Vec::new();
    for device in devices {
        let r = snap.reconstruct(device);
        if r.sequence.ops.is_empty() {
            continue;
        }
        let (recorded_reserved, recorded_peak_reserved) = if snap.events(device).is_empty() {
            (None, None)
        } else {
            let curve = snap.reserved_curve(device);
            (Some(map_reserved(&r.op_events, &curve)), Some(curve.peak()))
        };
        out.push(Trace {
            name: if many {
                format!("{name} (cuda:{device})")
            } else {
                name.to_string()
            },
            device,
            sequence: r.sequence,
            recorded_reserved,
            recorded_peak_reserved,
        });
    }
    out
}

/// For each op, the reserved bytes after its event (the curve's start for reconstructed ops);
/// points where the value changes.
fn map_reserved(op_events: &[Option<usize>], curve: &crate::ReservedCurve) -> Vec<(usize, u64)> {
    let mut out: Vec<(usize, u64)> = Vec::new();
    let mut reserved = curve.start;
    let mut points = curve.points.iter().peekable();
    for (k, ev) in op_events.iter().enumerate() {
        if let Some(ev) = ev {
            while let Some(&&(i, v)) = points.peek() {
                if i > *ev {
                    break;
                }
                reserved = v;
                points.next();
            }
        }
        if out.last().map_or(true, |&(_, last)| last != reserved) {
            out.push((k, reserved));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_formats() {
        assert_eq!(detect(b"\x80\x04"), Some(Format::Snapshot));
        assert_eq!(detect(b"  \n{\"traceEvents\":[]}"), Some(Format::Kineto));
        assert_eq!(detect(b"# cistern-trace v1\n"), Some(Format::Own));
        assert_eq!(
            detect(b"Thread,Time,Action,Pointer,Size,Stream\n"),
            Some(Format::Rmm)
        );
        assert_eq!(detect(b"id,lower,upper,size\r\n"), Some(Format::MiniMalloc));
        assert_eq!(detect(b"hello"), None);
    }

    #[test]
    fn errors_name_file_format_and_position() {
        let e = load_bytes("x", b"# cistern-trace v1\nf 3\n", &LoadOptions::default()).unwrap_err();
        assert_eq!(e.0, Some(Format::Own));
        assert_eq!(e.1, "line 2: expected the id of a live allocation, found 3");
        let e = LoadError {
            path: "a/b.trace".into(),
            format: e.0,
            message: e.1,
        };
        assert_eq!(
            e.to_string(),
            "a/b.trace: cistern trace: line 2: expected the id of a live allocation, found 3"
        );
        let e = load_bytes("x", b"garbage", &LoadOptions::default()).unwrap_err();
        assert!(
            e.1.starts_with("byte 0: expected a PyTorch snapshot"),
            "{}",
            e.1
        );
        let e = load(Path::new("/nonexistent/file")).unwrap_err();
        assert!(e.to_string().starts_with("/nonexistent/file: "), "{e}");
    }

    #[test]
    fn own_and_minimalloc_through_load() {
        let t = load_bytes(
            "f",
            b"# cistern-trace v1\nname demo\nr 100\na 0 8 0\nr 200\na 1 8 0\n",
            &LoadOptions::default(),
        )
        .unwrap();
        assert_eq!(t[0].name, "demo");
        assert_eq!(t[0].recorded_reserved, Some(vec![(0, 100), (1, 200)]));
        assert_eq!(t[0].recorded_peak_reserved, Some(200));
        let m = load_bytes(
            "m",
            b"id,lower,upper,size\n0,0,2,3\n",
            &LoadOptions {
                minimalloc_scale: 2,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        assert_eq!(m[0].sequence.peak_live_requested, 6);
    }
}
