//! google/minimalloc benchmark CSVs: static lifetimes `id,lower,upper,size`, half open
//! `[lower, upper)`.

use std::path::Path;

use crate::line_error::{read_text, LineError};
use crate::sequence::{AllocSequence, Op};

/// Error reading a minimalloc CSV.
pub type CsvError = LineError;

fn parse_err(line: usize, message: impl Into<String>) -> CsvError {
    LineError::at(line, message)
}

/// Read a minimalloc CSV file; see [`parse_csv`].
pub fn read_csv(path: impl AsRef<Path>, scale: u64) -> Result<AllocSequence, CsvError> {
    parse_csv(&read_text(path.as_ref())?, scale)
}

/// Turn minimalloc rows into an allocation sequence: each buffer is allocated at `lower` and
/// freed at `upper`; events are ordered by time, frees before allocations at the same time, then
/// by row order. Sizes are multiplied by `scale`. The header line (starting with `id`) is
/// optional; columns are found by name when it is present. Rows with `lower >= upper` are an
/// error (they would be freed before they were allocated).
pub fn parse_csv(text: &str, scale: u64) -> Result<AllocSequence, CsvError> {
    let mut cols = [0usize, 1, 2, 3]; // id, lower, upper, size
    let mut rows: Vec<(u64, u64, u64, u64)> = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (n, raw) in text.lines().enumerate() {
        let line_no = n + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if rows.is_empty() && fields.first().is_some_and(|f| f.parse::<u64>().is_err()) {
            for (k, name) in ["id", "lower", "upper", "size"].iter().enumerate() {
                cols[k] = fields.iter().position(|f| f == name).ok_or_else(|| {
                    parse_err(
                        line_no,
                        format!("expected a header with `{name}`, found {line:?}"),
                    )
                })?;
            }
            continue;
        }
        let get = |k: usize, name: &str| -> Result<u64, CsvError> {
            let f = fields.get(cols[k]).ok_or_else(|| {
                parse_err(
                    line_no,
                    format!("expected a `{name}` column, found {line:?}"),
                )
            })?;
            f.parse::<u64>().map_err(|_| {
                parse_err(
                    line_no,
                    format!("expected a non-negative integer `{name}`, found {f:?}"),
                )
            })
        };
        let (id, lower, upper, size) = (
            get(0, "id")?,
            get(1, "lower")?,
            get(2, "upper")?,
            get(3, "size")?,
        );
        if lower >= upper {
            return Err(parse_err(
                line_no,
                format!("expected lower < upper, found [{lower}, {upper})"),
            ));
        }
        if !ids.insert(id) {
            return Err(parse_err(line_no, format!("id {id} appears twice")));
        }
        let size = size
            .checked_mul(scale)
            .ok_or_else(|| parse_err(line_no, format!("size {size} x scale {scale} overflows")))?;
        rows.push((id, lower, upper, size));
    }
    // (time, 0 = free / 1 = alloc, row) keeps frees first at equal times.
    let mut events: Vec<(u64, u8, usize)> = Vec::with_capacity(rows.len() * 2);
    for (i, &(_, lower, upper, _)) in rows.iter().enumerate() {
        events.push((lower, 1, i));
        events.push((upper, 0, i));
    }
    events.sort_unstable();
    let ops = events
        .into_iter()
        .map(|(_, kind, i)| {
            let (id, _, _, size) = rows[i];
            if kind == 1 {
                Op::Alloc {
                    id,
                    size,
                    stream: 0,
                }
            } else {
                Op::Free { id }
            }
        })
        .collect();
    // Ids are unique and every free follows its alloc (lower < upper), so this cannot fail
    // except by overflowing u64 live bytes, which is reported as a parse error.
    AllocSequence::new(ops, 0).map_err(|e| parse_err(0, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_before_allocs_at_equal_times() {
        let s = parse_csv("id,lower,upper,size\n0,0,10,4\n1,10,20,4\n2,5,10,1\n", 2).unwrap();
        assert_eq!(
            s.ops,
            vec![
                Op::Alloc {
                    id: 0,
                    size: 8,
                    stream: 0
                },
                Op::Alloc {
                    id: 2,
                    size: 2,
                    stream: 0
                },
                Op::Free { id: 0 },
                Op::Free { id: 2 },
                Op::Alloc {
                    id: 1,
                    size: 8,
                    stream: 0
                },
                Op::Free { id: 1 },
            ]
        );
        assert_eq!(s.peak_live_requested, 10);
    }

    #[test]
    fn errors_name_the_line() {
        let e = parse_csv("id,lower,upper,size\n0,0,10,4\n1,3,3,4\n", 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 3: expected lower < upper, found [3, 3)"
        );
        let e = parse_csv("id,lower,upper,size\n0,0,x,4\n", 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 2: expected a non-negative integer `upper`, found \"x\""
        );
        let e = parse_csv("0,0,1,4\n0,1,2,4\n", 1).unwrap_err();
        assert_eq!(e.to_string(), "line 2: id 0 appears twice");
        assert!(parse_csv("0,0,1,4\n", u64::MAX).is_err());
        assert!(parse_csv("size,lower,upper\n", 1).is_err());
    }

    #[test]
    fn columns_by_header_name() {
        let s = parse_csv("lower,upper,size,id\n0,1,7,42\n", 1).unwrap();
        assert_eq!(
            s.ops[0],
            Op::Alloc {
                id: 42,
                size: 7,
                stream: 0
            }
        );
    }
}
