//! RAPIDS RMM `logging_resource_adaptor` CSV logs: `Thread,Time,Action,Pointer,Size,Stream`.
//!
//! RMM writes the header line, then one line per call with the spdlog pattern
//! `%t,%H:%M:%S.%f,%v`: the thread id, the wall-clock time of day with microseconds, then
//! `allocate,<ptr>,<bytes>,<stream>` (also `allocate failure,(nil),<bytes>,<stream>`) or
//! `free,<ptr>,<bytes>,<stream>`. Pointers are `%p` (hex `0x...`, `(nil)` for null); streams
//! are printed with `std::hex` (`0x...`, or `0` for the default stream). This reader also takes
//! the older docs' form (time as seconds since the epoch, `deallocate`), and decimal streams.
//!
//! Log order is call order; sizes are the requested sizes. Frees of pointers never allocated in
//! the log become initial allocations, as for the other address-keyed readers
//! ([`crate::addrmap`]); `allocate failure` rows are counted and otherwise skipped. Streams keep
//! their numeric value (the `cudaStream_t` pointer) as the op's stream.

use std::path::Path;

use crate::addrmap::{AddrAnomaly, AddrSequencer};
use crate::line_error::{read_text, LineError};
use crate::sequence::AllocSequence;

/// The header RMM writes.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// Error reading an RMM log.
pub type RmmError = LineError;

/// A parsed RMM log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RmmLog {
    /// The replayable sequence.
    pub sequence: AllocSequence,
    /// For each op, the 0-based data row it came from (`None` for initial allocations).
    pub op_rows: Vec<Option<usize>>,
    /// Time of each data row in nanoseconds (time of day, or since the epoch).
    pub row_times_ns: Vec<u64>,
    /// `allocate failure` rows.
    pub failures: usize,
    /// Initial allocations from frees of pointers never allocated in the log.
    pub initial_from_frees: usize,
    /// Inconsistencies worked around (event = data row).
    pub anomalies: Vec<AddrAnomaly>,
}

/// Read an RMM log file.
pub fn read(path: impl AsRef<Path>) -> Result<RmmLog, RmmError> {
    parse(&read_text(path.as_ref())?)
}

fn err(line: usize, message: impl Into<String>) -> RmmError {
    LineError::at(line, message)
}

/// Whether `line` is RMM's header (ignoring spaces and case).
pub fn is_header(line: &str) -> bool {
    let norm: String = line.trim().chars().filter(|c| !c.is_whitespace()).collect();
    norm.eq_ignore_ascii_case(HEADER)
}

fn parse_hex(s: &str) -> Option<u64> {
    let s = s.trim();
    if s == "(nil)" {
        return Some(0);
    }
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

fn parse_stream(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.starts_with("0x") || s.starts_with("0X") {
        parse_hex(s)
    } else {
        s.parse().ok()
    }
}

/// `HH:MM:SS.ffffff` (also `:` before the fraction) or decimal seconds, to nanoseconds.
fn parse_time(s: &str) -> Option<u64> {
    let s = s.trim();
    let frac_ns = |f: &str| -> Option<u64> {
        if f.is_empty() || f.len() > 9 || !f.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let v: u64 = f.parse().ok()?;
        Some(v * 10u64.pow(9 - f.len() as u32))
    };
    let parts: Vec<&str> = s.split(':').collect();
    match parts.as_slice() {
        [h, m, rest] | [h, m, rest, _] => {
            let (sec, frac) = if parts.len() == 4 {
                (*rest, parts[3])
            } else {
                rest.split_once('.').unwrap_or((rest, "0"))
            };
            let (h, m, sec): (u64, u64, u64) =
                (h.parse().ok()?, m.parse().ok()?, sec.parse().ok()?);
            let secs = h
                .checked_mul(3600)?
                .checked_add(m.checked_mul(60)?)?
                .checked_add(sec)?;
            secs.checked_mul(1_000_000_000)?.checked_add(frac_ns(frac)?)
        }
        [secs] => {
            let (whole, frac) = secs.split_once('.').unwrap_or((secs, "0"));
            let whole: u64 = whole.parse().ok()?;
            whole
                .checked_mul(1_000_000_000)?
                .checked_add(frac_ns(frac)?)
        }
        _ => None,
    }
}

/// Parse an RMM log. The header is required (it is how the format is recognised); its columns
/// must be RMM's six, in RMM's order.
pub fn parse(text: &str) -> Result<RmmLog, RmmError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    match lines.next() {
        Some((_, l)) if is_header(l) => {}
        Some((n, l)) => {
            return Err(err(
                n + 1,
                format!("expected the header {HEADER:?}, found {l:?}"),
            ))
        }
        None => {
            return Err(err(
                1,
                format!("expected the header {HEADER:?}, found nothing"),
            ))
        }
    }
    let mut seq = AddrSequencer::default();
    let mut row_times_ns = Vec::new();
    let mut failures = 0;
    let mut row_lines = Vec::new();
    for (row, (n, line)) in lines.enumerate() {
        let line_no = n + 1;
        row_lines.push(line_no);
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() != 6 {
            return Err(err(
                line_no,
                format!("expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found {}: {line:?}", f.len()),
            ));
        }
        if f[0].parse::<u64>().is_err() && parse_hex(f[0]).is_none() {
            return Err(err(
                line_no,
                format!("expected a thread id, found {:?}", f[0]),
            ));
        }
        let time = parse_time(f[1]).ok_or_else(|| {
            err(
                line_no,
                format!(
                    "expected a time HH:MM:SS.ffffff or seconds, found {:?}",
                    f[1]
                ),
            )
        })?;
        row_times_ns.push(time);
        let ptr = parse_hex(f[3])
            .ok_or_else(|| err(line_no, format!("expected a hex pointer, found {:?}", f[3])))?;
        let size: u64 = f[4].parse().map_err(|_| {
            err(
                line_no,
                format!("expected a size in bytes, found {:?}", f[4]),
            )
        })?;
        let stream = parse_stream(f[5]).ok_or_else(|| {
            err(
                line_no,
                format!("expected a stream (hex 0x... or decimal), found {:?}", f[5]),
            )
        })?;
        match f[2] {
            "allocate" => seq.alloc(row, ptr, size, stream),
            "free" | "deallocate" => seq.free(row, ptr, size, stream),
            "allocate failure" => failures += 1,
            other => {
                return Err(err(
                    line_no,
                    format!(
                        "expected an action allocate, free or allocate failure, found {other:?}"
                    ),
                ))
            }
        }
    }
    let from_frees = seq.initial_count();
    // Only absurd sizes (live bytes beyond u64) make the sequence unreplayable: report the
    // row that did it rather than hand on an unreplayable trace.
    let r = seq.finish(from_frees).map_err(|e| {
        let line = e
            .event
            .and_then(|row| row_lines.get(row).copied())
            .unwrap_or(1);
        err(
            line,
            format!(
                "live bytes exceed 2^64 here: the sizes are not plausible ({})",
                e.error
            ),
        )
    })?;
    Ok(RmmLog {
        sequence: r.sequence,
        op_rows: r.op_events,
        row_times_ns,
        failures,
        initial_from_frees: r.initial_from_frees,
        anomalies: r.anomalies,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Op;

    /// What `logging_resource_adaptor` writes: header, then `%t,%H:%M:%S.%f,` and the message.
    const LOG: &str = "Thread,Time,Action,Pointer,Size,Stream
140573312345856,10:21:03.123456,allocate,0x7f8a40000000,1024,0
140573312345856,10:21:03.123501,allocate,0x7f8a40000400,2048,0x55d0c1a2b3c0
140573312345856,10:21:03.123560,free,0x7f8a40000000,1024,0
140573312345857,10:21:03.123600,allocate failure,(nil),1099511627776,0x55d0c1a2b3c0
140573312345857,10:21:03.123700,free,0x7f8a3f000000,512,0
140573312345856,10:21:03.124000,allocate,0x7f8a40000000,256,0
";

    #[test]
    fn reads_rmm_format() {
        let log = parse(LOG).unwrap();
        assert_eq!(log.failures, 1);
        assert_eq!(log.initial_from_frees, 1);
        assert!(log.anomalies.is_empty());
        assert_eq!(
            log.sequence.ops,
            vec![
                Op::Alloc {
                    id: 0,
                    size: 512,
                    stream: 0
                },
                Op::Alloc {
                    id: 1,
                    size: 1024,
                    stream: 0
                },
                Op::Alloc {
                    id: 2,
                    size: 2048,
                    stream: 0x55d0c1a2b3c0
                },
                Op::Free { id: 1 },
                Op::Free { id: 0 },
                Op::Alloc {
                    id: 3,
                    size: 256,
                    stream: 0
                },
            ]
        );
        assert_eq!(log.sequence.peak_live_requested, 512 + 1024 + 2048);
        assert_eq!(
            log.row_times_ns[0],
            (10 * 3600 + 21 * 60 + 3) * 1_000_000_000 + 123_456_000
        );
        assert_eq!(log.op_rows[0], None);
        assert_eq!(log.op_rows[1], Some(0));
    }

    #[test]
    fn older_time_and_action_forms() {
        let log = parse(
            "Thread,Time,Action,Pointer,Size,Stream\n1,1634567890.5,allocate,7f00,8,1\n1,1634567890.6,deallocate,0x7f00,8,1\n",
        )
        .unwrap();
        assert_eq!(log.sequence.ops.len(), 2);
        assert_eq!(log.row_times_ns[0], 1_634_567_890_500_000_000);
    }

    #[test]
    fn absurd_sizes_are_an_error_not_an_unreplayable_trace() {
        // Found by the fuzz test: two live blocks whose sizes overflow u64.
        let text = format!(
            "{HEADER}\n0,0,allocate,0x20,1625276992759607659,0\n\
             0,0,allocate,(nil),16821467080949943957,0\n"
        );
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("plausible"), "{e}");
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse("Thread,Time\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 1: expected the header \"Thread,Time,Action,Pointer,Size,Stream\", found \"Thread,Time\""
        );
        let e = parse(&format!(
            "{HEADER}\n1,00:00:01.0,allocate,0x10,8,0\n1,00:00:01.0,alloc,0x10,8,0\n"
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 3: expected an action allocate, free or allocate failure, found \"alloc\""
        );
        let e = parse(&format!("{HEADER}\n1,00:00:01.0,allocate,0xzz,8,0\n")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 2: expected a hex pointer, found \"0xzz\""
        );
        let e = parse(&format!("{HEADER}\n1,noon,allocate,0x10,8,0\n")).unwrap_err();
        assert!(e.to_string().starts_with("line 2: expected a time"), "{e}");
        let e = parse(&format!("{HEADER}\n1,00:00:01.0,allocate,0x10,8\n")).unwrap_err();
        assert!(
            e.to_string().starts_with("line 2: expected 6 fields"),
            "{e}"
        );
        let e = parse(&format!("{HEADER}\n1,00:00:01.0,allocate,0x10,-8,0\n")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 2: expected a size in bytes, found \"-8\""
        );
    }
}
