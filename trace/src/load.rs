//! The common entry point: [`load`] detects a trace file's format and returns one [`Trace`] per
//! device, each with its replayable sequence and, where the file records it, the allocator's own
//! reserved-bytes curve as a baseline.
//!
//! Inputs are untrusted and may be pipes: each is read once, and what a reader takes is capped
//! (see [`LoadOptions::max_input_bytes`]): at most [`DEFAULT_MAX_INPUT_BYTES`] read, and a gzipped
//! input decompressed to at most [`GZIP_MAX_RATIO`] times its size (at least
//! [`GZIP_MIN_LIMIT`]), so `/dev/zero` or a gzip bomb is a prompt error naming the limit.

use std::borrow::Cow;
use std::fs::File;
use std::io::Read;
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
    /// The recording allocator's settings, when the file records them (a PyTorch snapshot's
    /// `allocator_settings`); `None` otherwise.
    pub allocator_settings: Option<crate::snapshot::AllocatorSettings>,
    /// A snapshot's allocator state when its window opened (segments and their live blocks),
    /// for the models that can start from it; `None` for other formats and for snapshots
    /// without history (whose ops all start live and reconstruct no window).
    pub window_start: Option<crate::snapshot::WindowStart>,
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
    /// The most bytes taken from one input, read and decompressed alike (`cistern replay
    /// --max-input`). `None`: [`DEFAULT_MAX_INPUT_BYTES`] read, and a gzipped input expanded
    /// to at most [`GZIP_MAX_RATIO`] times its size (at least [`GZIP_MIN_LIMIT`], at most
    /// [`DEFAULT_MAX_INPUT_BYTES`]).
    pub max_input_bytes: Option<u64>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            minimalloc_scale: 64,
            kineto: KinetoOptions::default(),
            max_input_bytes: None,
        }
    }
}

/// The most bytes read from one input by default (4 GiB), and the most a gzipped one expands to.
pub const DEFAULT_MAX_INPUT_BYTES: u64 = 4 << 30;

/// By default a gzipped input may expand to at most this many times its compressed size:
/// profiler traces compress 5 to 20 times, a gzip bomb about 1000 times.
pub const GZIP_MAX_RATIO: u64 = 100;

/// ... or to this many bytes (256 MiB), whichever is more.
pub const GZIP_MIN_LIMIT: u64 = 256 << 20;

/// How to raise the limits, for messages.
const RAISE: &str = "pass --max-input SIZE (e.g. --max-input 16GiB) to allow more";

/// The first bytes read of an input: enough to tell its format, so that what is no trace at
/// all (`/dev/zero`) is refused without reading the rest.
const SNIFF_BYTES: u64 = 64 << 10;

impl LoadOptions {
    /// The most bytes read from one input.
    pub fn input_limit(&self) -> u64 {
        self.max_input_bytes.unwrap_or(DEFAULT_MAX_INPUT_BYTES)
    }

    /// The most bytes an input of `compressed` gzipped bytes may expand to.
    pub fn decompressed_limit(&self, compressed: u64) -> u64 {
        self.max_input_bytes.unwrap_or_else(|| {
            compressed
                .saturating_mul(GZIP_MAX_RATIO)
                .clamp(GZIP_MIN_LIMIT, DEFAULT_MAX_INPUT_BYTES)
        })
    }
}

/// `n` bytes for messages: in GiB, MiB or KiB when it is a whole number of them.
fn size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} bytes")
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

const UNKNOWN_FORMAT: &str = "byte 0: expected a PyTorch snapshot pickle (0x80), a profiler \
     trace (JSON `{`, maybe gzipped), an RMM log header `Thread,Time,Action,Pointer,Size,Stream`, \
     `# cistern-trace v1`, or a MiniMalloc header `id,lower,upper,size`";

/// Reads `path` once, to its end or to the input limit: an error past the limit, and as soon
/// as the first bytes show it is no trace.
fn read_input(path: &Path, opts: &LoadOptions) -> Result<Vec<u8>, String> {
    let limit = opts.input_limit();
    let too_large = |what: String| {
        format!(
            "{what}, more than the input limit of {}: {RAISE}",
            size(limit)
        )
    };
    let mut f = File::open(path).map_err(|e| e.to_string())?;
    if let Ok(md) = f.metadata() {
        if md.is_file() && md.len() > limit {
            return Err(too_large(format!("{} bytes", md.len())));
        }
    }
    let mut bytes = Vec::new();
    (&mut f)
        .take(SNIFF_BYTES.min(limit.saturating_add(1)))
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    let full = bytes.len() as u64 == SNIFF_BYTES;
    if full
        && !bytes.starts_with(&GZIP_MAGIC)
        && bytes.iter().any(|b| !b.is_ascii_whitespace())
        && detect(&bytes).is_none()
    {
        return Err(UNKNOWN_FORMAT.to_string());
    }
    let rest = limit.saturating_add(1).saturating_sub(bytes.len() as u64);
    f.take(rest)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(too_large(format!("read {}", size(limit))));
    }
    Ok(bytes)
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
    let bytes = read_input(path, opts).map_err(|message| LoadError {
        path: path.to_path_buf(),
        format: None,
        message,
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

/// What [`load_any`] read: a PyTorch snapshot is kept whole beside its traces, for tools that
/// need more than the sequences (its `oom` events, its allocator settings).
#[derive(Debug, Clone)]
pub enum Loaded {
    /// A PyTorch memory snapshot and one trace per device that has operations.
    Snapshot(Box<Snapshot>, Vec<Trace>),
    /// Any other format, its traces, and the allocations it records as failed.
    Other(Format, Vec<Trace>, Vec<FailedAlloc>),
}

/// An allocation a trace records as failed (an RMM log's `allocate failure` row). Such a
/// record has no capacity: what the device held then is not in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedAlloc {
    /// CUDA device (the trace's).
    pub device: usize,
    /// The 0-based data row (RMM) it came from.
    pub row: usize,
    /// Operations of the trace's sequence before it.
    pub ops_before: usize,
    /// Bytes asked.
    pub size: u64,
    /// The stream asked on.
    pub stream: u64,
    /// Time in nanoseconds, when recorded.
    pub time_ns: Option<u64>,
}

/// The `allocate failure` rows of an RMM log that [`rmm::parse`] read into `log` (rows as it
/// counts them: the non-blank lines after the header), placed among `log`'s operations.
fn rmm_failures(text: &str, log: &rmm::RmmLog) -> Vec<FailedAlloc> {
    let stream = |s: &str| {
        let s = s.trim();
        match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => s.parse().ok(),
        }
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .skip(1)
        .enumerate()
        .filter_map(|(row, line)| {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            if f.get(2) != Some(&"allocate failure") {
                return None;
            }
            Some(FailedAlloc {
                device: 0,
                row,
                ops_before: log.op_rows.partition_point(|r| r.map_or(true, |r| r < row)),
                size: f.get(4)?.parse().ok()?,
                stream: stream(f.get(5)?)?,
                time_ns: log.row_times_ns.get(row).copied(),
            })
        })
        .collect()
}

/// [`load_file`], keeping a snapshot whole ([`Loaded::Snapshot`]); read once, gzipped or not.
pub fn load_any(path: &Path, opts: &LoadOptions) -> Result<Loaded, LoadError> {
    let fail = |format, message| LoadError {
        path: path.to_path_buf(),
        format,
        message,
    };
    let bytes = read_input(path, opts).map_err(|m| fail(None, m))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let plain = gunzip(&bytes, opts).map_err(|m| fail(None, m))?;
    if detect(&plain) == Some(Format::Snapshot) {
        let snap = Snapshot::from_bytes(&plain)
            .map_err(|e| fail(Some(Format::Snapshot), e.to_string()))?;
        let traces = snapshot_traces(&name, &snap);
        return Ok(Loaded::Snapshot(Box::new(snap), traces));
    }
    if detect(&plain) == Some(Format::Rmm) {
        let fail_rmm = |m: String| fail(Some(Format::Rmm), m);
        let text = text(&plain, Format::Rmm).map_err(|(_, m)| fail_rmm(m))?;
        let log = rmm::parse(text).map_err(|e| fail_rmm(e.to_string()))?;
        let failures = rmm_failures(text, &log);
        let traces = if log.sequence.ops.is_empty() {
            Vec::new()
        } else {
            vec![Trace {
                name,
                device: 0,
                sequence: log.sequence,
                recorded_reserved: None,
                recorded_peak_reserved: None,
                allocator_settings: None,
                window_start: None,
            }]
        };
        return Ok(Loaded::Other(Format::Rmm, traces, failures));
    }
    let (format, traces) = load_bytes_detected(&name, &plain, opts).map_err(|(f, m)| fail(f, m))?;
    Ok(Loaded::Other(format, traces, Vec::new()))
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
    let plain = gunzip(bytes, opts).map_err(|m| (None, m))?;
    let bytes: &[u8] = &plain;
    let format = detect(bytes).ok_or_else(|| (None, UNKNOWN_FORMAT.to_string()))?;
    let fail = |m: String| (Some(format), m);
    let single = |sequence: AllocSequence, device: usize, reserved: Vec<(usize, u64)>| {
        let peak = reserved.iter().map(|&(_, r)| r).max();
        Trace {
            name: name.to_string(),
            device,
            sequence,
            recorded_peak_reserved: peak,
            recorded_reserved: (!reserved.is_empty()).then_some(reserved),
            allocator_settings: None,
            window_start: None,
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
                    allocator_settings: None,
                    window_start: None,
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

/// `bytes` decompressed when they start with the gzip magic, to at most the decompressed limit.
fn gunzip<'a>(bytes: &'a [u8], opts: &LoadOptions) -> Result<Cow<'a, [u8]>, String> {
    let limit = opts.decompressed_limit(bytes.len() as u64);
    kineto::decompress_limited(bytes, limit).map_err(|e| match e {
        kineto::KinetoError::Gzip { offset, .. } if offset >= limit => {
            let why = if opts.max_input_bytes.is_some() {
                "the input limit".to_string()
            } else {
                format!(
                    "the default limit: {GZIP_MAX_RATIO} times the {} compressed bytes, at \
                     least {}, at most {}; a gzip bomb?",
                    bytes.len(),
                    size(GZIP_MIN_LIMIT),
                    size(DEFAULT_MAX_INPUT_BYTES)
                )
            };
            format!(
                "gzip: expands to more than {} ({why}): {RAISE}",
                size(limit)
            )
        }
        e => e.to_string(),
    })
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
        let (recorded_reserved, recorded_peak_reserved, window_start) =
            if snap.events(device).is_empty() {
                (None, None, None)
            } else {
                let curve = snap.reserved_curve(device);
                let start = snap.window_start(device, &r);
                (
                    Some(map_reserved(&r.op_events, &curve)),
                    Some(curve.peak()),
                    Some(start),
                )
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
            allocator_settings: snap.allocator_settings.clone(),
            window_start,
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

    /// `n` bytes of `byte`, gzipped.
    fn gzip_of(byte: u8, n: usize) -> Vec<u8> {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(&vec![byte; n]).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn a_gzip_bomb_stops_at_the_limit_naming_it() {
        // The default: 100 times the compressed size, from 256 MiB to 4 GiB.
        let o = LoadOptions::default();
        assert_eq!(o.decompressed_limit(1000), GZIP_MIN_LIMIT);
        assert_eq!(o.decompressed_limit(3_000_000), 300_000_000);
        assert_eq!(o.decompressed_limit(1 << 40), DEFAULT_MAX_INPUT_BYTES);
        assert_eq!(o.input_limit(), DEFAULT_MAX_INPUT_BYTES);
        // A bomb: 8 MiB of spaces (a JSON prefix would be whitespace) from a few KiB.
        let bomb = gzip_of(b' ', 8 << 20);
        assert!(bomb.len() < 64 << 10);
        let capped = LoadOptions {
            max_input_bytes: Some(1 << 20),
            ..LoadOptions::default()
        };
        let e = load_bytes("bomb", &bomb, &capped).unwrap_err();
        assert_eq!(e.0, None);
        assert!(
            e.1.contains("expands to more than 1 MiB (the input limit)")
                && e.1.contains("--max-input"),
            "{}",
            e.1
        );
        // Within the default limit it decompresses (and is then no trace).
        let e = load_bytes("spaces", &bomb, &o).unwrap_err();
        assert!(e.1.starts_with("byte 0: expected"), "{}", e.1);
    }

    #[test]
    fn reading_stops_at_the_input_limit() {
        let dir = std::env::temp_dir().join(format!("cistern-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.trace");
        let mut text = String::from("# cistern-trace v1\n");
        for i in 0..20_000 {
            text.push_str(&format!("a {i} 8 0\n"));
        }
        std::fs::write(&path, &text).unwrap();
        let capped = |n| LoadOptions {
            max_input_bytes: Some(n),
            ..LoadOptions::default()
        };
        let e = load_with(&path, &capped(64 << 10)).unwrap_err();
        assert!(
            e.to_string()
                .contains("more than the input limit of 64 KiB"),
            "{e}"
        );
        let (format, traces) = load_file(&path, &capped(1 << 20)).unwrap();
        assert_eq!(format, Format::Own);
        assert_eq!(traces[0].sequence.ops.len(), 20_000);
        // Not a trace: refused from the first bytes (this would read forever).
        let e = load(Path::new("/dev/zero")).unwrap_err();
        assert!(e.to_string().contains("byte 0: expected"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rmm_failures_are_placed_among_the_ops() {
        let dir = std::env::temp_dir().join(format!("cistern-load-rmm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("log.csv");
        std::fs::write(
            &path,
            "Thread,Time,Action,Pointer,Size,Stream\n\
             1,10:00:00.000001,allocate,0x10,1024,0x0\n\
             \n\
             1,10:00:00.000002,allocate failure,(nil),4096,0x7f\n\
             1,10:00:00.000003,free,0x10,1024,0x0\n\
             1,10:00:00.000004,allocate failure,(nil),8192,3\n",
        )
        .unwrap();
        let Loaded::Other(format, traces, failures) =
            load_any(&path, &LoadOptions::default()).unwrap()
        else {
            panic!("not Other");
        };
        assert_eq!(format, Format::Rmm);
        assert_eq!(traces[0].sequence.ops.len(), 2);
        let got: Vec<(usize, usize, u64, u64)> = failures
            .iter()
            .map(|f| (f.row, f.ops_before, f.size, f.stream))
            .collect();
        assert_eq!(got, vec![(1, 1, 4096, 0x7f), (3, 2, 8192, 3)]);
        assert_eq!(failures[0].time_ns, Some(36_000_000_002_000));
        std::fs::remove_dir_all(&dir).unwrap();
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
