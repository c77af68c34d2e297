//! Reading a parsed pickle's values into the snapshot's types: segments, events and
//! `allocator_settings`, with a shape error naming the place of anything unexpected, and the
//! budget that bounds how much a hostile pickle may expand.

use super::*;

/// How many more segments, blocks and events may be read.
pub(super) struct Budget(pub(super) usize);

impl Budget {
    pub(super) fn spend(&mut self, n: usize, path: &str) -> Result<(), SnapshotError> {
        match self.0.checked_sub(n) {
            Some(left) => {
                self.0 = left;
                Ok(())
            }
            None => Err(shape(
                path,
                "fewer segments, blocks and events than input bytes",
                "more (shared objects referenced over and over)",
            )),
        }
    }
}

pub(super) fn shape(path: &str, expected: &str, found: &str) -> SnapshotError {
    SnapshotError::Shape {
        path: path.to_string(),
        expected: expected.to_string(),
        found: found.to_string(),
    }
}

pub(super) fn seq<'v>(v: &'v Value, path: &str) -> Result<&'v [Value], SnapshotError> {
    v.as_seq()
        .ok_or_else(|| shape(path, "a list", v.type_name()))
}

fn dict_check(v: &Value, path: &str) -> Result<(), SnapshotError> {
    match v {
        Value::Dict(_) => Ok(()),
        other => Err(shape(path, "a dict", other.type_name())),
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Int(i) => format!("int {i}"),
        Value::BigInt(i) => format!("int {i}"),
        Value::Str(s) => format!("str {s:?}"),
        other => other.type_name().to_string(),
    }
}

fn opt_u64(d: &Value, key: &str, path: &str) -> Result<Option<u64>, SnapshotError> {
    match d.get(key) {
        None | Some(Value::None) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            shape(
                &format!("{path}.{key}"),
                "a non-negative int below 2^64",
                &describe(v),
            )
        }),
    }
}

fn opt_bool(d: &Value, key: &str, path: &str) -> Result<Option<bool>, SnapshotError> {
    match d.get(key) {
        None | Some(Value::None) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(Value::Int(i)) => Ok(Some(*i != 0)),
        Some(v) => Err(shape(&format!("{path}.{key}"), "a bool", &describe(v))),
    }
}

fn req_u64(d: &Value, key: &str, path: &str) -> Result<u64, SnapshotError> {
    opt_u64(d, key, path)?.ok_or_else(|| shape(path, &format!("a `{key}` key"), "none"))
}

fn opt_str<'v>(d: &'v Value, key: &str, path: &str) -> Result<Option<&'v str>, SnapshotError> {
    match d.get(key) {
        None | Some(Value::None) => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| shape(&format!("{path}.{key}"), "a str", &describe(v))),
    }
}

pub(super) fn parse_segment(s: &Value, path: &str) -> Result<Segment, SnapshotError> {
    dict_check(s, path)?;
    let address = req_u64(s, "address", path)?;
    let mut blocks = Vec::new();
    if let Some(bv) = s.get("blocks") {
        let bpath = format!("{path}.blocks");
        let mut offset = address;
        for (i, b) in seq(bv, &bpath)?.iter().enumerate() {
            let p = format!("{bpath}[{i}]");
            dict_check(b, &p)?;
            let size = req_u64(b, "size", &p)?;
            let state =
                opt_str(b, "state", &p)?.ok_or_else(|| shape(&p, "a `state` key", "none"))?;
            let addr = opt_u64(b, "address", &p)?.unwrap_or(offset);
            offset = addr.saturating_add(size);
            blocks.push(Block {
                address: addr,
                size,
                requested_size: opt_u64(b, "requested_size", &p)?,
                state: BlockState::parse(state),
            });
        }
    }
    Ok(Segment {
        device: opt_u64(s, "device", path)?.unwrap_or(0),
        address,
        total_size: req_u64(s, "total_size", path)?,
        stream: opt_u64(s, "stream", path)?.unwrap_or(0),
        segment_type: opt_str(s, "segment_type", path)?.map(str::to_string),
        allocated_size: opt_u64(s, "allocated_size", path)?,
        active_size: opt_u64(s, "active_size", path)?,
        is_expandable: opt_bool(s, "is_expandable", path)?,
        blocks,
    })
}

pub(super) fn parse_event(
    e: &Value,
    device: usize,
    index: usize,
) -> Result<TraceEvent, SnapshotError> {
    let path = format!("device_traces[{device}][{index}]");
    dict_check(e, &path)?;
    let action =
        opt_str(e, "action", &path)?.ok_or_else(|| shape(&path, "an `action` key", "none"))?;
    let time_us = match e.get("time_us") {
        None | Some(Value::None) => None,
        Some(v) => Some(
            v.as_i128()
                .and_then(|t| i64::try_from(t).ok())
                .ok_or_else(|| shape(&format!("{path}.time_us"), "an int", &describe(v)))?,
        ),
    };
    let action = Action::parse(action);
    let device_free = if action == Action::Oom {
        opt_u64(e, "device_free", &path)?
    } else {
        None
    };
    let addr = opt_u64(e, "addr", &path)?;
    Ok(TraceEvent {
        addr: device_free.or(addr).unwrap_or(0),
        action,
        size: opt_u64(e, "size", &path)?.unwrap_or(0),
        stream: opt_u64(e, "stream", &path)?.unwrap_or(0),
        time_us,
        top_frame: e.get("frames").and_then(top_python_frame),
        device_free,
    })
}

/// A Python value as `repr` would print it, for settings kept by name.
fn python_repr(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Int(i) => i.to_string(),
        Value::BigInt(i) => i.to_string(),
        Value::Float(f) => format!("{f:?}"),
        Value::Str(s) => format!("{s:?}"),
        Value::Bytes(b) => format!("<{} bytes>", b.len()),
        Value::List(items) | Value::Tuple(items) | Value::Set(items) => {
            let inner: Vec<String> = items.iter().map(python_repr).collect();
            format!("[{}]", inner.join(", "))
        }
        Value::Dict(items) => {
            let inner: Vec<String> = items
                .iter()
                .map(|(k, v)| format!("{}: {}", python_repr(k), python_repr(v)))
                .collect();
            format!("{{{}}}", inner.join(", "))
        }
    }
}

/// `allocator_settings`: PyTorch writes `PYTORCH_CUDA_ALLOC_CONF` (the string the program set),
/// `max_split_size` (bytes, -1 for unlimited), `garbage_collection_threshold` (a float),
/// `expandable_segments` (a bool), `roundup_power2_divisions` (a dict from the interval start
/// in MiB, `"1"`, `"2"`, ..., to its divisions) and pinned-memory keys.
pub(super) fn parse_settings(a: &Value) -> Result<AllocatorSettings, SnapshotError> {
    const PATH: &str = "allocator_settings";
    let items = a
        .as_dict()
        .ok_or_else(|| shape(PATH, "a dict", a.type_name()))?;
    let mut out = AllocatorSettings::default();
    for (k, v) in items.iter() {
        let Some(key) = k.as_str() else {
            out.other.push((python_repr(k), python_repr(v)));
            continue;
        };
        let path = format!("{PATH}.{key}");
        match key {
            "PYTORCH_CUDA_ALLOC_CONF" => {
                out.conf = match v {
                    Value::None => None,
                    Value::Str(s) => Some(s.to_string()),
                    other => return Err(shape(&path, "a str", &describe(other))),
                }
            }
            "expandable_segments" => {
                out.expandable_segments = match v {
                    Value::Bool(b) => Some(*b),
                    Value::Int(i) => Some(*i != 0),
                    Value::None => None,
                    other => return Err(shape(&path, "a bool", &describe(other))),
                }
            }
            "max_split_size" => {
                let n = v
                    .as_i128()
                    .ok_or_else(|| shape(&path, "an int", &describe(v)))?;
                // SIZE_MAX (unlimited) is written as an int64: -1.
                out.max_split_size = u64::try_from(n)
                    .ok()
                    .filter(|&n| n < u64::MAX && i64::try_from(n).is_ok());
            }
            "garbage_collection_threshold" => {
                out.garbage_collection_threshold = match v {
                    Value::Float(f) => Some(*f),
                    Value::Int(i) => Some(*i as f64),
                    Value::None => None,
                    other => return Err(shape(&path, "a float", &describe(other))),
                }
            }
            "roundup_power2_divisions" => {
                let mut pairs = Vec::new();
                match v {
                    Value::Dict(d) => {
                        for (ik, iv) in d.iter() {
                            let mb = ik
                                .as_str()
                                .and_then(|t| t.trim().parse::<u64>().ok())
                                .or_else(|| ik.as_u64())
                                .ok_or_else(|| {
                                    shape(&path, "interval keys in MiB", &describe(ik))
                                })?;
                            let div = iv.as_u64().ok_or_else(|| {
                                shape(&format!("{path}[{mb}]"), "an int", &describe(iv))
                            })?;
                            pairs.push((mb, div));
                        }
                    }
                    // Older PyTorch: one number for every size.
                    Value::Int(_) | Value::BigInt(_) => {
                        let div = v
                            .as_u64()
                            .ok_or_else(|| shape(&path, "a non-negative int", &describe(v)))?;
                        pairs.push((1, div));
                    }
                    Value::None => {}
                    other => return Err(shape(&path, "a dict", &describe(other))),
                }
                pairs.sort_unstable();
                out.roundup_power2_divisions = pairs;
            }
            _ => out.other.push((key.to_string(), python_repr(v))),
        }
    }
    Ok(out)
}

/// The first frame whose file is a Python source, as `file:line name`.
fn top_python_frame(frames: &Value) -> Option<Arc<str>> {
    frames.as_seq()?.iter().find_map(|f| {
        let file = f.get("filename")?.as_str()?;
        if !file.ends_with(".py") {
            return None;
        }
        let line = f.get("line").and_then(Value::as_i128).unwrap_or(0);
        let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
        Some(Arc::from(format!("{file}:{line} {name}")))
    })
}
