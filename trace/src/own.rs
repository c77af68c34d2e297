//! cistern's own trace format: a versioned, line-oriented text format that cistern records from
//! a running process and that any tool can write by hand; plus an export to RMM's CSV.
//!
//! ```text
//! # cistern-trace v1
//! # Lines starting with `#` after the first are comments; blank lines are ignored.
//! name gpt-medium step 3          (optional, before the first op: the trace's name)
//! device 0                        (optional, before the first op: the CUDA device index)
//! i 0 4096 0                      (a block live before the trace began: id size stream)
//! t 1500                          (timestamp in ns for the ops that follow; non-decreasing)
//! r 20971520                      (recorded reserved bytes from the next op on: a baseline)
//! a 1 512 0                       (allocate: id, requested size in bytes, stream)
//! f 1                             (free: id)
//! ```
//!
//! The first line must be exactly `# cistern-trace v1` (a later `v2` is rejected with a
//! message naming the version). Fields are decimal `u64`, separated by single or repeated
//! spaces. `i` lines must all come before the first `a` or `f`. Ids are unique for the whole
//! trace (never reused after a free); the sequence must satisfy [`AllocSequence`]'s invariants,
//! and a violation is reported with the line of the offending op. Ops without a preceding `t`
//! have time 0.
//!
//! [`Line`] is the one encoder of these lines: [`write_with`] and the allocator's recorder
//! (`cistern::trace_writer`) both write through it.

use std::fmt;
use std::io::{self, Write};
use std::path::Path;

use crate::line_error::{read_text, LineError};
use crate::sequence::{AllocSequence, Op, SequenceError};

/// The first line of every v1 trace.
pub const HEADER: &str = "# cistern-trace v1";

/// One line of a v1 trace, as every writer spells it. `Display` gives the line without its
/// newline; [`Line::write_to`] writes it with one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line<'a> {
    /// The first line, [`HEADER`].
    Header,
    /// `# <text>`, a comment (never the first line).
    Comment(&'a str),
    /// `name <name>`; newlines in the name become spaces (a name is one line).
    Name(&'a str),
    /// `device <index>`.
    Device(u64),
    /// `a <id> <size> <stream>` for an [`Op::Alloc`], `f <id>` for an [`Op::Free`].
    Op(Op),
    /// `i <id> <size> <stream>`: the [`Op::Alloc`] of a block live before the trace began (the
    /// leading ops of a sequence, [`AllocSequence::initially_live`]; a free is an `f` line).
    Initial(Op),
    /// `t <ns>`: the time of the ops that follow.
    Time(u64),
    /// `r <bytes>`: recorded reserved bytes from the next op on.
    Reserved(u64),
}

impl fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Line::Header => f.write_str(HEADER),
            Line::Comment(text) => write!(f, "# {text}"),
            Line::Name(name) => write!(f, "name {}", name.replace(['\n', '\r'], " ")),
            Line::Device(d) => write!(f, "device {d}"),
            Line::Initial(Op::Alloc { id, size, stream }) => write!(f, "i {id} {size} {stream}"),
            Line::Op(Op::Alloc { id, size, stream }) => write!(f, "a {id} {size} {stream}"),
            Line::Op(Op::Free { id }) | Line::Initial(Op::Free { id }) => write!(f, "f {id}"),
            Line::Time(ns) => write!(f, "t {ns}"),
            Line::Reserved(bytes) => write!(f, "r {bytes}"),
        }
    }
}

impl Line<'_> {
    /// Writes the line and its newline.
    pub fn write_to(&self, mut w: impl Write) -> io::Result<()> {
        writeln!(w, "{self}")
    }
}

/// Error reading an own-format trace.
pub type OwnError = LineError;

/// A parsed own-format trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnTrace {
    /// From the `name` line, if any.
    pub name: Option<String>,
    /// From the `device` line (0 if absent).
    pub device: usize,
    /// The ops.
    pub sequence: AllocSequence,
    /// Time of each op in ns (from the last `t` line before it; 0 before any).
    pub times_ns: Vec<u64>,
    /// `(op index, bytes)` from `r` lines: recorded reserved bytes from that op on.
    pub recorded_reserved: Vec<(usize, u64)>,
}

/// Read an own-format trace file.
pub fn read(path: impl AsRef<Path>) -> Result<OwnTrace, OwnError> {
    parse(&read_text(path.as_ref())?)
}

fn err(line: usize, message: impl Into<String>) -> OwnError {
    LineError::at(line, message)
}

/// Parse an own-format trace.
pub fn parse(text: &str) -> Result<OwnTrace, OwnError> {
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, l)) if l.trim_end() == HEADER => {}
        Some((_, l)) if l.starts_with("# cistern-trace ") => {
            return Err(err(
                1,
                format!(
                    "expected version v1, found {:?} (written by a newer cistern?)",
                    l.trim_end()
                ),
            ))
        }
        Some((_, l)) => return Err(err(1, format!("expected {HEADER:?}, found {l:?}"))),
        None => return Err(err(1, format!("expected {HEADER:?}, found an empty file"))),
    }
    let mut out = OwnTrace::default();
    let mut ops: Vec<Op> = Vec::new();
    let mut op_lines: Vec<usize> = Vec::new();
    let mut time = 0u64;
    let mut initially_live = 0usize;
    for (n, raw) in lines {
        let line_no = n + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        let rest = rest.trim();
        let nums = |want: usize, what: &str| -> Result<Vec<u64>, OwnError> {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() != want {
                return Err(err(
                    line_no,
                    format!("expected `{kind} {what}`, found {line:?}"),
                ));
            }
            f.iter()
                .map(|x| {
                    x.parse::<u64>().map_err(|_| {
                        err(
                            line_no,
                            format!(
                                "expected a non-negative integer in `{kind} {what}`, found {x:?}"
                            ),
                        )
                    })
                })
                .collect()
        };
        match kind {
            "name" | "device" if !ops.is_empty() => {
                return Err(err(
                    line_no,
                    format!("expected `{kind}` before the first op"),
                ))
            }
            "name" => out.name = Some(rest.to_string()),
            "device" => {
                let d = nums(1, "<index>")?[0];
                out.device = usize::try_from(d)
                    .map_err(|_| err(line_no, format!("device {d} is too large")))?;
            }
            "i" | "a" => {
                let v = nums(3, "<id> <size> <stream>")?;
                if kind == "i" {
                    if ops.len() != initially_live {
                        return Err(err(
                            line_no,
                            "expected `i` lines only before the first `a` or `f`",
                        ));
                    }
                    initially_live += 1;
                }
                ops.push(Op::Alloc {
                    id: v[0],
                    size: v[1],
                    stream: v[2],
                });
                op_lines.push(line_no);
                out.times_ns.push(time);
            }
            "f" => {
                let v = nums(1, "<id>")?;
                ops.push(Op::Free { id: v[0] });
                op_lines.push(line_no);
                out.times_ns.push(time);
            }
            "t" => {
                let t = nums(1, "<time_ns>")?[0];
                if t < time {
                    return Err(err(
                        line_no,
                        format!("expected a time >= {time} ns (times never go back), found {t}"),
                    ));
                }
                time = t;
            }
            "r" => {
                let r = nums(1, "<bytes>")?[0];
                out.recorded_reserved.push((ops.len(), r));
            }
            other => {
                return Err(err(
                    line_no,
                    format!(
                    "expected an op `a`, `f`, `i`, `t`, `r`, `name` or `device`, found {other:?}"
                ),
                ))
            }
        }
    }
    // An `r` after the last op applies to no op; keep only points inside the sequence.
    out.recorded_reserved.retain(|&(k, _)| k < ops.len());
    out.sequence = AllocSequence::new(ops, initially_live).map_err(|e| {
        let (op, what) = match e {
            SequenceError::DuplicateId { op_index, id } => (
                op_index,
                format!("expected a new id, found {id} (already used)"),
            ),
            SequenceError::FreeOfDead { op_index, id } => (
                op_index,
                format!("expected the id of a live allocation, found {id}"),
            ),
            SequenceError::Overflow { op_index } => {
                (op_index, "live bytes overflow u64".to_string())
            }
        };
        err(op_lines.get(op).copied().unwrap_or(0), what)
    })?;
    Ok(out)
}

/// Write `seq` in the own format (header, `i` lines for the initially live blocks, then `a`/`f`).
pub fn write(seq: &AllocSequence, w: impl Write) -> io::Result<()> {
    write_with(seq, None, 0, &[], w)
}

/// Write `seq` with a name, a device and a recorded reserved curve (`(op index, bytes)`).
pub fn write_with(
    seq: &AllocSequence,
    name: Option<&str>,
    device: usize,
    reserved: &[(usize, u64)],
    w: impl Write,
) -> io::Result<()> {
    let mut w = io::BufWriter::new(w);
    Line::Header.write_to(&mut w)?;
    if let Some(name) = name {
        Line::Name(name).write_to(&mut w)?;
    }
    if device != 0 {
        Line::Device(device as u64).write_to(&mut w)?;
    }
    let mut r = reserved.iter().peekable();
    for (k, op) in seq.ops.iter().enumerate() {
        while let Some(&&(at, bytes)) = r.peek() {
            if at > k {
                break;
            }
            Line::Reserved(bytes).write_to(&mut w)?;
            r.next();
        }
        let line = if k < seq.initially_live {
            Line::Initial(*op)
        } else {
            Line::Op(*op)
        };
        line.write_to(&mut w)?;
    }
    w.flush()
}

/// Export `seq` as an RMM `logging_resource_adaptor` CSV, with synthetic pointers (a bump
/// allocator from `0x7f0000000000`, 256-byte aligned, never reused, so no two live blocks
/// overlap), one microsecond per op as the time, thread 1, and the op's stream in hex.
/// Initially live blocks are exported as the first allocations.
pub fn export_rmm_csv(seq: &AllocSequence, w: impl Write) -> io::Result<()> {
    let mut w = io::BufWriter::new(w);
    writeln!(w, "{}", crate::rmm::HEADER)?;
    let mut ptrs: std::collections::HashMap<u64, (u64, u64, u64)> = Default::default();
    let mut next = 0x7f00_0000_0000u64;
    for (k, op) in seq.ops.iter().enumerate() {
        let us = k as u64;
        let (h, m, s, f) = (
            us / 3_600_000_000 % 24,
            us / 60_000_000 % 60,
            us / 1_000_000 % 60,
            us % 1_000_000,
        );
        let time = format!("{h:02}:{m:02}:{s:02}.{f:06}");
        let stream_str = |s: u64| {
            if s == 0 {
                "0".to_string()
            } else {
                format!("{s:#x}")
            }
        };
        match *op {
            Op::Alloc { id, size, stream } => {
                let ptr = next;
                next = next.saturating_add(size.div_ceil(256).max(1).saturating_mul(256));
                ptrs.insert(id, (ptr, size, stream));
                writeln!(
                    w,
                    "1,{time},allocate,{ptr:#x},{size},{}",
                    stream_str(stream)
                )?;
            }
            Op::Free { id } => {
                let (ptr, size, stream) = ptrs.remove(&id).ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("op {k}: free of id {id}, which is not live"),
                    )
                })?;
                writeln!(w, "1,{time},free,{ptr:#x},{size},{}", stream_str(stream))?;
            }
        }
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AllocSequence {
        AllocSequence::new(
            vec![
                Op::Alloc {
                    id: 7,
                    size: 100,
                    stream: 0,
                },
                Op::Alloc {
                    id: 1,
                    size: 512,
                    stream: 3,
                },
                Op::Alloc {
                    id: 2,
                    size: 4096,
                    stream: 0,
                },
                Op::Free { id: 7 },
                Op::Free { id: 1 },
                Op::Alloc {
                    id: 9,
                    size: 1,
                    stream: 0x55d0c1a2b3c0,
                },
            ],
            1,
        )
        .unwrap()
    }

    #[test]
    fn round_trip() {
        let seq = sample();
        let mut buf = Vec::new();
        write_with(&seq, Some("x\ny"), 2, &[(0, 10), (3, 20)], &mut buf).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(
            text.starts_with("# cistern-trace v1\nname x y\ndevice 2\nr 10\ni 7 100 0\na 1"),
            "{text}"
        );
        let back = parse(&text).unwrap();
        assert_eq!(back.sequence, seq);
        assert_eq!(back.name.as_deref(), Some("x y"));
        assert_eq!(back.device, 2);
        assert_eq!(back.recorded_reserved, vec![(0, 10), (3, 20)]);
        let mut plain = Vec::new();
        write(&seq, &mut plain).unwrap();
        assert_eq!(
            parse(std::str::from_utf8(&plain).unwrap())
                .unwrap()
                .sequence,
            seq
        );
    }

    #[test]
    fn times_and_comments() {
        let t = parse("# cistern-trace v1\n# hi\n\na 0 8 0\nt 5\na 1 8 0\nt  7\nf 0\n").unwrap();
        assert_eq!(t.times_ns, vec![0, 5, 7]);
        assert_eq!(t.sequence.peak_live_requested, 16);
    }

    #[test]
    fn rmm_export_reads_back() {
        let seq = sample();
        let mut buf = Vec::new();
        export_rmm_csv(&seq, &mut buf).unwrap();
        let text = String::from_utf8(buf).unwrap();
        let log = crate::rmm::parse(&text).unwrap();
        assert!(log.anomalies.is_empty());
        // Same ops up to renaming ids in allocation order.
        let rename = |s: &AllocSequence| -> Vec<Op> {
            let mut ids = std::collections::HashMap::new();
            s.ops
                .iter()
                .map(|op| match *op {
                    Op::Alloc { id, size, stream } => {
                        let n = ids.len() as u64;
                        ids.insert(id, n);
                        Op::Alloc {
                            id: n,
                            size,
                            stream,
                        }
                    }
                    Op::Free { id } => Op::Free { id: ids[&id] },
                })
                .collect()
        };
        assert_eq!(rename(&log.sequence), rename(&seq));
        assert_eq!(log.sequence.peak_live_requested, seq.peak_live_requested);
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("", "line 1: expected \"# cistern-trace v1\", found an empty file"),
            ("# cistern-trace v2\n", "line 1: expected version v1, found \"# cistern-trace v2\" (written by a newer cistern?)"),
            ("# cistern-trace v1\na 1 2\n", "line 2: expected `a <id> <size> <stream>`, found \"a 1 2\""),
            ("# cistern-trace v1\na 1 2 x\n", "line 2: expected a non-negative integer in `a <id> <size> <stream>`, found \"x\""),
            ("# cistern-trace v1\na 1 2 0\n\nf 2\n", "line 4: expected the id of a live allocation, found 2"),
            ("# cistern-trace v1\na 1 2 0\nf 1\na 1 2 0\n", "line 4: expected a new id, found 1 (already used)"),
            ("# cistern-trace v1\na 1 2 0\ni 2 2 0\n", "line 3: expected `i` lines only before the first `a` or `f`"),
            ("# cistern-trace v1\nt 5\nt 4\n", "line 3: expected a time >= 5 ns (times never go back), found 4"),
            ("# cistern-trace v1\nx\n", "line 2: expected an op `a`, `f`, `i`, `t`, `r`, `name` or `device`, found \"x\""),
            ("# cistern-trace v1\na 0 8 0\nname late\n", "line 3: expected `name` before the first op"),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input).unwrap_err().to_string(), want, "{input:?}");
        }
    }
}
