//! PyTorch profiler traces (Kineto's Chrome trace JSON, gzipped or not): the `[memory]` instant
//! events that `torch.profiler.profile(profile_memory=True)` records, one sequence per CUDA device.
//!
//! Each event's `args` hold `Addr`, `Bytes` (negative for a free), `Total Allocated`,
//! `Total Reserved`, `Device Type` (1 = CUDA; others are skipped) and `Device Id`. The sizes are
//! the caching allocator's *rounded block sizes*, not the requested sizes, so a replay of these
//! sequences starts from sizes that already carry PyTorch's 512 B rounding.
//!
//! Events are ordered by timestamp (`ts`), ties in file order: Kineto writes the events of each
//! thread together, so file order interleaves threads wrongly (on the HTA trace, file order gives
//! 1,264 allocations over live blocks; timestamp order gives none and matches every
//! `Total Allocated`). Blocks allocated before the profiler started and freed while it ran become
//! initial allocations (see [`crate::addrmap`]). Bytes that `Total Allocated` counts at the first
//! event but that no free explains (parameters, optimizer state: live throughout) become one
//! more initial allocation when [`KinetoOptions::untracked_as_block`] is set.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::addrmap::{AddrAnomaly, AddrSequencer};
use crate::sequence::AllocSequence;

/// Largest decompressed size accepted (a gzip bomb is an error, not an abort).
pub const MAX_JSON_BYTES: u64 = 4 << 30;

/// Error reading a profiler trace.
#[derive(Debug, thiserror::Error)]
pub enum KinetoError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The gzip stream is corrupt or too large.
    #[error("gzip, at decompressed byte {offset}: {message}")]
    Gzip {
        /// Decompressed bytes read before the failure.
        offset: u64,
        /// What went wrong.
        message: String,
    },
    /// The text is not the JSON of a Chrome trace.
    #[error("line {line}, column {column}: {message}")]
    Json {
        /// 1-based line (of the decompressed text).
        line: usize,
        /// 1-based column.
        column: usize,
        /// serde_json's description (what was expected).
        message: String,
    },
    /// A `[memory]` event lacks a field or has one of the wrong type.
    #[error("{path}: expected {expected}, found {found}")]
    Shape {
        /// Where, e.g. `traceEvents[12].args.Bytes`.
        path: String,
        /// What was expected.
        expected: String,
        /// What was there.
        found: String,
    },
}

/// Options of [`from_bytes_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KinetoOptions {
    /// Add one initial allocation for the bytes `Total Allocated` counts before the first event
    /// that no later free explains (default: true).
    pub untracked_as_block: bool,
}

impl Default for KinetoOptions {
    fn default() -> Self {
        KinetoOptions {
            untracked_as_block: true,
        }
    }
}

/// One CUDA device's memory events as a sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KinetoDevice {
    /// The `Device Id`.
    pub device: usize,
    /// The replayable sequence (sizes are rounded block sizes).
    pub sequence: AllocSequence,
    /// For each op, the index among this device's `[memory]` events in timestamp order (`None`
    /// for initial allocations).
    pub op_events: Vec<Option<usize>>,
    /// `[memory]` events of this device.
    pub events: usize,
    /// `(op index, Total Reserved)` at the first op and wherever the value changes: PyTorch's
    /// recorded reserved bytes, constant between points.
    pub reserved: Vec<(usize, u64)>,
    /// Largest `Total Reserved`.
    pub peak_reserved: u64,
    /// Bytes live before the first event that no free in the trace explains.
    pub untracked_bytes: u64,
    /// Initial allocations that came from frees of blocks never allocated in the trace.
    pub initial_from_frees: usize,
    /// Inconsistencies worked around.
    pub anomalies: Vec<AddrAnomaly>,
}

#[derive(Deserialize)]
struct RawTrace {
    #[serde(rename = "traceEvents")]
    trace_events: Vec<RawEvent>,
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(default)]
    name: Option<Box<RawValue>>,
    #[serde(default)]
    ts: Option<Box<RawValue>>,
    #[serde(default)]
    args: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
struct MemArgs {
    #[serde(rename = "Addr")]
    addr: Option<u64>,
    #[serde(rename = "Bytes")]
    bytes: Option<i64>,
    #[serde(rename = "Total Allocated")]
    total_allocated: Option<i64>,
    #[serde(rename = "Total Reserved")]
    total_reserved: Option<i64>,
    #[serde(rename = "Device Type")]
    device_type: Option<i64>,
    #[serde(rename = "Device Id")]
    device_id: Option<i64>,
}

/// Read a profiler trace file (gzip detected by its magic bytes).
pub fn read(path: impl AsRef<Path>) -> Result<Vec<KinetoDevice>, KinetoError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| KinetoError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    from_bytes(&bytes)
}

/// [`from_bytes_with`] with the default options.
pub fn from_bytes(bytes: &[u8]) -> Result<Vec<KinetoDevice>, KinetoError> {
    from_bytes_with(bytes, &KinetoOptions::default())
}

/// Decompress `bytes` if they start with the gzip magic, else take them as JSON text.
pub fn decompress(bytes: &[u8]) -> Result<std::borrow::Cow<'_, [u8]>, KinetoError> {
    decompress_limited(bytes, MAX_JSON_BYTES)
}

/// [`decompress`], stopping with an error past `limit` decompressed bytes (having taken at most
/// `limit + 1` of them).
pub fn decompress_limited(
    bytes: &[u8],
    limit: u64,
) -> Result<std::borrow::Cow<'_, [u8]>, KinetoError> {
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return Ok(std::borrow::Cow::Borrowed(bytes));
    }
    let mut out = Vec::new();
    let mut dec = flate2::read::MultiGzDecoder::new(bytes).take(limit.saturating_add(1));
    dec.read_to_end(&mut out).map_err(|e| KinetoError::Gzip {
        offset: out.len() as u64,
        message: e.to_string(),
    })?;
    if out.len() as u64 > limit {
        return Err(KinetoError::Gzip {
            offset: limit,
            message: format!("expected at most {limit} decompressed bytes"),
        });
    }
    Ok(std::borrow::Cow::Owned(out))
}

fn json_err(e: serde_json::Error) -> KinetoError {
    KinetoError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    }
}

/// Parse a profiler trace (gzipped or plain JSON) into one [`KinetoDevice`] per CUDA device
/// with `[memory]` events, in device order.
pub fn from_bytes_with(
    bytes: &[u8],
    opts: &KinetoOptions,
) -> Result<Vec<KinetoDevice>, KinetoError> {
    let text = decompress(bytes)?;
    let raw: RawTrace = serde_json::from_slice(&text).map_err(json_err)?;

    struct MemEvent {
        ts: f64,
        file_index: usize,
        addr: u64,
        bytes: i64,
        total_allocated: Option<i64>,
        total_reserved: Option<i64>,
    }
    let mut per_device: std::collections::BTreeMap<usize, Vec<MemEvent>> = Default::default();
    for (i, ev) in raw.trace_events.iter().enumerate() {
        let Some(name) = &ev.name else { continue };
        if name.get() != "\"[memory]\"" {
            continue;
        }
        let path = format!("traceEvents[{i}]");
        let args_raw = ev
            .args
            .as_ref()
            .ok_or_else(|| shape(&format!("{path}.args"), "an object", "none"))?;
        let args: MemArgs = serde_json::from_str(args_raw.get()).map_err(|e| {
            shape(
                &format!("{path}.args"),
                "`[memory]` args with integer Addr, Bytes, Total Allocated, Total Reserved",
                &e.to_string(),
            )
        })?;
        // Kineto's DeviceType: 0 = CPU, 1 = CUDA. Events without the field are taken as CUDA.
        if args.device_type.is_some_and(|t| t != 1) {
            continue;
        }
        let device = match args.device_id {
            None => 0,
            Some(d) => usize::try_from(d).map_err(|_| {
                shape(
                    &format!("{path}.args.Device Id"),
                    "a device index >= 0 for a CUDA event",
                    &d.to_string(),
                )
            })?,
        };
        let ts_raw = ev
            .ts
            .as_ref()
            .ok_or_else(|| shape(&format!("{path}.ts"), "a timestamp", "none"))?;
        let ts: f64 = serde_json::from_str(ts_raw.get())
            .map_err(|_| shape(&format!("{path}.ts"), "a number", ts_raw.get()))?;
        let addr = args
            .addr
            .ok_or_else(|| shape(&format!("{path}.args"), "an `Addr`", "none"))?;
        let bytes = args
            .bytes
            .ok_or_else(|| shape(&format!("{path}.args"), "a `Bytes`", "none"))?;
        per_device.entry(device).or_default().push(MemEvent {
            ts,
            file_index: i,
            addr,
            bytes,
            total_allocated: args.total_allocated,
            total_reserved: args.total_reserved,
        });
    }

    let mut out = Vec::with_capacity(per_device.len());
    for (device, mut evs) in per_device {
        evs.sort_by(|a, b| a.ts.total_cmp(&b.ts).then(a.file_index.cmp(&b.file_index)));
        let mut seq = AddrSequencer::default();
        for (k, e) in evs.iter().enumerate() {
            let size = e.bytes.unsigned_abs();
            if e.bytes >= 0 {
                seq.alloc(k, e.addr, size, 0);
            } else {
                seq.free(k, e.addr, size, 0);
            }
        }
        let from_frees = seq.initial_count();
        // Bytes allocated before the first event: its Total Allocated minus its own change.
        let before = evs
            .first()
            .and_then(|e| {
                e.total_allocated
                    .map(|t| i128::from(t) - i128::from(e.bytes))
            })
            .unwrap_or(0);
        let explained = i128::from(seq.initial_bytes());
        let untracked = u64::try_from((before - explained).max(0)).unwrap_or(u64::MAX);
        if opts.untracked_as_block && untracked > 0 {
            seq.add_initial(untracked, 0);
        }
        // Only absurd sizes (live bytes beyond u64) make the sequence unreplayable.
        let r = seq.finish(from_frees).map_err(|e| KinetoError::Shape {
            path: format!("traceEvents (device {device})"),
            expected: "sizes whose live total fits in 64 bits".into(),
            found: e.error.to_string(),
        })?;
        let reserved_at = |k: usize| -> Option<u64> {
            evs.get(k)
                .and_then(|e| e.total_reserved)
                .and_then(|v| u64::try_from(v).ok())
        };
        let mut reserved: Vec<(usize, u64)> = Vec::new();
        let first = reserved_at(0);
        for (op, ev) in r.op_events.iter().enumerate() {
            let v = match ev {
                None => first,
                Some(k) => reserved_at(*k),
            };
            if let Some(v) = v {
                if reserved.last().map_or(true, |&(_, last)| last != v) {
                    reserved.push((op, v));
                }
            }
        }
        let peak_reserved = evs
            .iter()
            .filter_map(|e| e.total_reserved)
            .filter_map(|v| u64::try_from(v).ok())
            .max()
            .unwrap_or(0);
        out.push(KinetoDevice {
            device,
            events: evs.len(),
            sequence: r.sequence,
            op_events: r.op_events,
            reserved,
            peak_reserved,
            untracked_bytes: untracked,
            initial_from_frees: r.initial_from_frees,
            anomalies: r.anomalies,
        });
    }
    Ok(out)
}

fn shape(path: &str, expected: &str, found: &str) -> KinetoError {
    KinetoError::Shape {
        path: path.to_string(),
        expected: expected.to_string(),
        found: found.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence::alloc;
    use crate::Op;

    fn mem(ts: u64, addr: u64, bytes: i64, total: i64, reserved: i64) -> String {
        format!(
            r#"{{"ph":"i","name":"[memory]","ts":{ts},"args":{{"Addr":{addr},"Bytes":{bytes},"Total Allocated":{total},"Total Reserved":{reserved},"Device Id":0,"Device Type":1}}}}"#
        )
    }

    #[test]
    fn timestamp_order_initial_blocks_and_reserved() {
        // 100 bytes live before the trace; 16 of them at 0x10 are freed in it.
        let evs = [
            mem(3, 0x20, -8, 100, 2048),
            mem(1, 0x20, 8, 108, 1024),
            mem(2, 0x10, -16, 92, 2048),
            r#"{"ph":"X","name":"aten::add","ts":0,"args":{"Bytes":"x"}}"#.to_string(),
            r#"{"ph":"i","name":"[memory]","ts":1,"args":{"Addr":1,"Bytes":4,"Device Type":0,"Device Id":-1}}"#.to_string(),
        ];
        let json = format!(r#"{{"traceEvents":[{}]}}"#, evs.join(","));
        let d = from_bytes(json.as_bytes()).unwrap();
        assert_eq!(d.len(), 1);
        let d = &d[0];
        assert_eq!(d.events, 3);
        assert_eq!(d.untracked_bytes, 84);
        assert_eq!(
            d.sequence.ops,
            vec![
                alloc(0, 16, 0),
                alloc(1, 84, 0),
                alloc(2, 8, 0),
                Op::Free { id: 0 },
                Op::Free { id: 2 },
            ]
        );
        assert_eq!(d.reserved, vec![(0, 1024), (3, 2048)]);
        assert_eq!(d.peak_reserved, 2048);
        assert_eq!(d.sequence.peak_live_requested, 108);
        let no_block = from_bytes_with(
            json.as_bytes(),
            &KinetoOptions {
                untracked_as_block: false,
            },
        )
        .unwrap();
        assert_eq!(no_block[0].sequence.ops.len(), 4);
    }

    #[test]
    fn gzip_and_errors_with_positions() {
        use std::io::Write;
        let json = format!(r#"{{"traceEvents":[{}]}}"#, mem(1, 16, 8, 8, 8));
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(json.as_bytes()).unwrap();
        let gz = enc.finish().unwrap();
        assert_eq!(from_bytes(&gz).unwrap()[0].sequence.ops.len(), 1);
        let e = from_bytes(&gz[..gz.len() / 2]).unwrap_err();
        assert!(matches!(e, KinetoError::Gzip { .. }), "{e}");

        let e = from_bytes(b"{\"traceEvents\":\n[1,]}").unwrap_err();
        assert!(e.to_string().starts_with("line 2, column "), "{e}");
        let e = from_bytes(br#"{"traceEvents":[{"name":"[memory]","ts":1,"args":{"Addr":1}}]}"#)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "traceEvents[0].args: expected a `Bytes`, found none"
        );
        let e = from_bytes(
            br#"{"traceEvents":[{"name":"[memory]","ts":1,"args":{"Addr":"x","Bytes":1}}]}"#,
        )
        .unwrap_err();
        assert!(
            e.to_string().starts_with("traceEvents[0].args: expected"),
            "{e}"
        );
    }
}
