//! Writing a [`Snapshot`] back as a pickle in PyTorch's layout ([`Snapshot::to_pickle`]),
//! with the minimal pickle writer it needs.

use super::*;

/// A minimal pickle writer (protocol 2: dicts, lists, ints, floats, bools, strs), enough for
/// the layout PyTorch's snapshots use and that [`Snapshot::from_bytes`] reads back.
struct PickleWriter(Vec<u8>);

impl PickleWriter {
    fn int(&mut self, v: i128) {
        if let Ok(i) = i32::try_from(v) {
            self.0.push(b'J'); // BININT
            self.0.extend_from_slice(&i.to_le_bytes());
        } else {
            // LONG1: little-endian two's complement, minimal length.
            let bytes = v.to_le_bytes();
            let mut n = bytes.len();
            while n > 1 {
                let top = bytes[n - 1];
                let next_sign = bytes[n - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.0.push(0x8a);
            self.0.push(n as u8);
            self.0.extend_from_slice(&bytes[..n]);
        }
    }

    fn str(&mut self, s: &str) {
        self.0.push(b'X'); // BINUNICODE
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }

    fn float(&mut self, f: f64) {
        self.0.push(b'G'); // BINFLOAT, big-endian
        self.0.extend_from_slice(&f.to_be_bytes());
    }

    fn bool(&mut self, b: bool) {
        self.0.push(if b { 0x88 } else { 0x89 });
    }

    /// A dict: `items` writes each key and value in turn.
    fn dict(&mut self, items: impl FnOnce(&mut Self)) {
        self.0.extend_from_slice(b"}("); // EMPTY_DICT MARK
        items(self);
        self.0.push(b'u'); // SETITEMS
    }

    /// A list: `items` writes each item.
    fn list(&mut self, items: impl FnOnce(&mut Self)) {
        self.0.extend_from_slice(b"]("); // EMPTY_LIST MARK
        items(self);
        self.0.push(b'e'); // APPENDS
    }

    fn key_int(&mut self, k: &str, v: i128) {
        self.str(k);
        self.int(v);
    }

    fn key_str(&mut self, k: &str, v: &str) {
        self.str(k);
        self.str(v);
    }
}

impl Action {
    /// The action string PyTorch writes.
    pub fn as_str(&self) -> &str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::Other(s) => s,
        }
    }
}

impl BlockState {
    /// The state string PyTorch writes.
    pub fn as_str(&self) -> &str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
            BlockState::Other(s) => s,
        }
    }
}

impl Snapshot {
    /// The snapshot as a pickle in PyTorch's layout (`segments` with `blocks`, `device_traces`
    /// whose `oom` events carry `device_free` instead of `addr`, `allocator_settings` when
    /// present), which [`Snapshot::from_bytes`] reads back to an equal snapshot. Settings kept
    /// by name ([`AllocatorSettings::other`]) are written as strings. Frames are not kept by
    /// the reader and are written as a one-frame stack when an event has a top frame.
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut w = PickleWriter(vec![0x80, 2]);
        w.dict(|w| {
            w.str("segments");
            w.list(|w| {
                for seg in &self.segments {
                    w.dict(|w| {
                        w.key_int("device", seg.device.into());
                        w.key_int("address", seg.address.into());
                        w.key_int("total_size", seg.total_size.into());
                        w.key_int("stream", seg.stream.into());
                        if let Some(t) = &seg.segment_type {
                            w.key_str("segment_type", t);
                        }
                        if let Some(a) = seg.allocated_size {
                            w.key_int("allocated_size", a.into());
                        }
                        if let Some(a) = seg.active_size {
                            w.key_int("active_size", a.into());
                        }
                        if let Some(e) = seg.is_expandable {
                            w.str("is_expandable");
                            w.bool(e);
                        }
                        w.str("blocks");
                        w.list(|w| {
                            for b in &seg.blocks {
                                w.dict(|w| {
                                    w.key_int("address", b.address.into());
                                    w.key_int("size", b.size.into());
                                    if let Some(r) = b.requested_size {
                                        w.key_int("requested_size", r.into());
                                    }
                                    w.key_str("state", b.state.as_str());
                                });
                            }
                        });
                    });
                }
            });
            w.str("device_traces");
            w.list(|w| {
                for trace in &self.device_traces {
                    w.list(|w| {
                        for e in trace {
                            w.dict(|w| {
                                w.key_str("action", e.action.as_str());
                                if e.action == Action::Oom {
                                    if let Some(f) = e.device_free {
                                        w.key_int("device_free", f.into());
                                    }
                                } else {
                                    w.key_int("addr", e.addr.into());
                                }
                                w.key_int("size", e.size.into());
                                w.key_int("stream", e.stream.into());
                                if let Some(t) = e.time_us {
                                    w.key_int("time_us", t.into());
                                }
                                if let Some(f) = &e.top_frame {
                                    write_frame(w, f);
                                }
                            });
                        }
                    });
                }
            });
            if let Some(a) = &self.allocator_settings {
                w.str("allocator_settings");
                w.dict(|w| {
                    if let Some(c) = &a.conf {
                        w.key_str("PYTORCH_CUDA_ALLOC_CONF", c);
                    }
                    if let Some(e) = a.expandable_segments {
                        w.str("expandable_segments");
                        w.bool(e);
                    }
                    w.key_int("max_split_size", a.max_split_size.map_or(-1, i128::from));
                    if let Some(g) = a.garbage_collection_threshold {
                        w.str("garbage_collection_threshold");
                        w.float(g);
                    }
                    if !a.roundup_power2_divisions.is_empty() {
                        w.str("roundup_power2_divisions");
                        w.dict(|w| {
                            for &(mb, d) in &a.roundup_power2_divisions {
                                w.key_int(&mb.to_string(), d.into());
                            }
                        });
                    }
                    for (k, v) in &a.other {
                        w.key_str(k, v);
                    }
                });
            }
        });
        w.0.push(b'.');
        w.0
    }
}

/// `frames: [{"filename", "line", "name"}]` from a `file:line name` top frame.
fn write_frame(w: &mut PickleWriter, top: &str) {
    let (loc, name) = top.split_once(' ').unwrap_or((top, "?"));
    let (file, line) = loc.rsplit_once(':').unwrap_or((loc, "0"));
    w.str("frames");
    w.list(|w| {
        w.dict(|w| {
            w.key_str("filename", file);
            w.key_int("line", line.parse::<i128>().unwrap_or(0));
            w.key_str("name", name);
        })
    });
}
