//! What each driver call costs the host: [`CostTable`], microseconds per call kind (per handle
//! or mapping for the VMM calls, plus a per-MiB term where a source shows one), with published
//! figures as the default and loadable from a JSON file so that a table measured on a real GPU
//! replaces it. The simulator adds a call's price to its *modelled host time* on entry
//! ([`SimDriver::modelled_time_us`](super::SimDriver::modelled_time_us)); `cistern replay`
//! reports it per allocator as `driver_time_us`.
//!
//! # Default figures and their sources
//!
//! Published per-call latencies, measured on an A100, are per *handle* and nearly independent of
//! the handle's size:
//!
//! | key | µs | source |
//! |---|---|---|
//! | `create_physical` (`cuMemCreate`) | 195 | kvcached's `bench_vmm` (7.6 µs on another GPU) |
//! | `map` (`cuMemMap`) | 1.5 | kvcached's `bench_vmm` |
//! | `set_access` (`cuMemSetAccess`) | 36 per mapping | kvcached's `bench_vmm`; PyTorch's note that mapping ten 2 MiB handles costs 10× one 20 MiB handle |
//! | `unmap` (`cuMemUnmap`) | 26 | kvcached's `bench_vmm` |
//! | `reserve_va` (`cuMemAddressReserve`) | 19 | kvcached's `bench_vmm` |
//! | `mem_info` (`cuMemGetInfo`) | 10 | sglang's measurements |
//! | `event_record` (`cuEventRecord`) | 0.5 | kvcached's `bench_vmm` |
//! | `event_query` (`cuEventQuery`) | 0.3 | kvcached's `bench_vmm` |
//!
//! **Estimates** (no published figure; replace them with measurements): `device_count` 0.1,
//! `capabilities` 1 (a few `cuDeviceGetAttribute`s), `free_va` 10 (about half a reserve),
//! `release_physical` 20 (an order below a create), `mem_alloc` 20 + 0.17 per MiB (`cuMemAlloc`
//! is in the range of `cuMemCreate` + `cuMemMap` for large sizes and has a size-dependent part:
//! these give ≈194 µs for 1 GiB, ≈23 µs for 20 MiB), `mem_free` 30 (the call itself; its
//! implicit device synchronisation is a host wait, below), `event_create` 1, `event_destroy` 1,
//! `event_synchronize` 1, `stream_synchronize` 1 and `device_synchronize` 5 (the calls' own
//! overhead, not the wait), `stream_wait_event` 0.5 (like a record); sharing, which only a
//! process sending or receiving memory pays, once per handle: `export_handle` 10 and
//! `import_handle` 10 (a file descriptor made or resolved in the kernel driver, about a
//! `cuMemGetInfo`), `ipc_get_handle` 5, `ipc_open` 100 (it maps the allocation, as a
//! `cuMemAlloc` does) and `ipc_close` 30 (like a free).
//!
//! # Units
//!
//! A call is priced `per_call_us × units + per_mib_us × MiB`. `units` is 1 for every call except
//! `set_access`, which counts the mappings its range spans (the driver's cost is per mapping:
//! one call over ten handles costs ten). The MiB are those the call names as an argument
//! (`create_physical`, `map`, `unmap`, `set_access`, `reserve_va`, `free_va`, `mem_alloc`);
//! calls that name no size (`release_physical`, `mem_free`, events) have no per-MiB term.
//!
//! # Host waits
//!
//! A *host wait* is a call that blocks the host on GPU work ([`DriverCall::blocks_host`]:
//! `event_synchronize`, `device_synchronize`, and `mem_free`, whose implicit device
//! synchronisation PyTorch's `cudaFree` pays). What a wait costs is GPU idle time, which a
//! replay cannot know (a trace has no kernels), so the simulator counts waits apart
//! ([`SimDriver::host_waits`](super::SimDriver::host_waits)) and the default table puts no
//! duration on them. [`CostTable::host_wait_us`] (default 0) adds a fixed figure per wait to the
//! waiting call's price for whoever has measured one.
//!
//! # File format
//!
//! A JSON object keyed by [`DriverCall::key`]; each value is a number (`per_call_us`) or an
//! object `{"per_call_us": N, "per_mib_us": M, "source": "..."}` (`per_mib_us` and the
//! documentary `source` optional). `host_wait_us` is a number. Keys starting with `_` are
//! comments. Kinds missing from a file keep their default figure; unknown keys are errors that
//! list the known ones. `replay/costs/a100-published.json` is the default table.

use std::path::Path;

use serde_json::{Map, Number, Value};

use super::NCALLS;
use crate::driver::DriverCall;

const MIB: f64 = (1u64 << 20) as f64;

/// The key of [`CostTable::host_wait_us`] in a cost file.
pub const HOST_WAIT_KEY: &str = "host_wait_us";

/// The price of one call kind.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CallCost {
    /// Microseconds per call (per mapping for `set_access`).
    pub per_call_us: f64,
    /// Microseconds per MiB the call names, if the kind has a size-dependent part.
    pub per_mib_us: Option<f64>,
}

impl CallCost {
    /// A flat price per call.
    pub const fn flat(per_call_us: f64) -> Self {
        CallCost {
            per_call_us,
            per_mib_us: None,
        }
    }
}

/// Microseconds of host time per driver call kind: see the [module documentation](self).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CostTable {
    /// Per call kind, indexed by `DriverCall as usize`.
    per_kind: [CallCost; NCALLS],
    /// A fixed price per host wait, added to the waiting call (default 0: unknown).
    pub host_wait_us: f64,
}

impl Default for CostTable {
    /// The published A100 figures and the documented estimates.
    fn default() -> Self {
        let mut t = CostTable {
            per_kind: [CallCost::flat(0.0); NCALLS],
            host_wait_us: 0.0,
        };
        for call in DriverCall::ALL {
            t.per_kind[call as usize] = default_cost(call);
        }
        t
    }
}

/// The default price of `call` (module documentation: published figures and estimates).
fn default_cost(call: DriverCall) -> CallCost {
    use DriverCall::*;
    match call {
        // Published (A100).
        CreatePhysical => CallCost::flat(195.0),
        Map => CallCost::flat(1.5),
        SetAccess => CallCost::flat(36.0),
        Unmap => CallCost::flat(26.0),
        ReserveVa => CallCost::flat(19.0),
        MemInfo => CallCost::flat(10.0),
        EventRecord => CallCost::flat(0.5),
        EventQuery => CallCost::flat(0.3),
        // Estimates.
        DeviceCount => CallCost::flat(0.1),
        Capabilities => CallCost::flat(1.0),
        FreeVa => CallCost::flat(10.0),
        ReleasePhysical => CallCost::flat(20.0),
        MemAlloc => CallCost {
            per_call_us: 20.0,
            per_mib_us: Some(0.17),
        },
        MemFree => CallCost::flat(30.0),
        EventCreate => CallCost::flat(1.0),
        EventDestroy => CallCost::flat(1.0),
        EventSynchronize => CallCost::flat(1.0),
        DeviceSynchronize => CallCost::flat(5.0),
        StreamWaitEvent => CallCost::flat(0.5),
        StreamSynchronize => CallCost::flat(1.0),
        ExportHandle => CallCost::flat(10.0),
        ImportHandle => CallCost::flat(10.0),
        IpcGetHandle => CallCost::flat(5.0),
        IpcOpen => CallCost::flat(100.0),
        IpcClose => CallCost::flat(30.0),
    }
}

impl CostTable {
    /// A table where every call costs nothing.
    pub fn zero() -> Self {
        CostTable {
            per_kind: [CallCost::flat(0.0); NCALLS],
            host_wait_us: 0.0,
        }
    }

    /// The price of one call kind.
    pub fn get(&self, call: DriverCall) -> CallCost {
        self.per_kind[call as usize]
    }

    /// Sets the price of one call kind (builder style).
    pub fn with(mut self, call: DriverCall, cost: CallCost) -> Self {
        self.per_kind[call as usize] = cost;
        self
    }

    /// Sets the price of one host wait (builder style).
    pub fn with_host_wait_us(mut self, us: f64) -> Self {
        self.host_wait_us = us;
        self
    }

    /// Microseconds for one call of `call` spanning `units` handles or mappings and naming
    /// `bytes` bytes, host-wait figure included.
    pub fn price(&self, call: DriverCall, units: u64, bytes: u64) -> f64 {
        let c = self.get(call);
        let mut us = c.per_call_us * units as f64;
        if let Some(m) = c.per_mib_us {
            us += m * bytes as f64 / MIB;
        }
        if call.blocks_host() {
            us += self.host_wait_us;
        }
        us
    }

    /// The table as a JSON value in the file format (every kind, as an object).
    pub fn to_json_value(&self) -> Value {
        let mut m = Map::new();
        for call in DriverCall::ALL {
            let c = self.get(call);
            let mut e = Map::new();
            e.insert("per_call_us".into(), num(c.per_call_us));
            if let Some(p) = c.per_mib_us {
                e.insert("per_mib_us".into(), num(p));
            }
            m.insert(call.key().into(), Value::Object(e));
        }
        m.insert(HOST_WAIT_KEY.into(), num(self.host_wait_us));
        Value::Object(m)
    }

    /// Parses a table from JSON text; `origin` (a file name) starts every error message.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            format!(
                "{origin}: not valid JSON ({e}); a cost table is an object such as \
                 {{\"map\": {{\"per_call_us\": 1.5}}, \"set_access\": 36}}"
            )
        })?;
        Self::from_json_value(&v).map_err(|e| format!("{origin}: {e}"))
    }

    /// Reads a table from a JSON file; errors name the file, the key and the fix.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self, String> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read the cost table: {e}", path.display()))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses a table from a JSON value in the file format (kinds it omits keep the default).
    pub fn from_json_value(v: &Value) -> Result<Self, String> {
        let Value::Object(m) = v else {
            return Err(format!(
                "expected a JSON object keyed by call kind, got {}",
                kind_of(v)
            ));
        };
        let mut t = CostTable::default();
        for (key, val) in m {
            if key.starts_with('_') {
                continue;
            }
            if key == HOST_WAIT_KEY {
                t.host_wait_us = micros(val, key)?;
                continue;
            }
            let Some(call) = DriverCall::from_key(key) else {
                return Err(format!(
                    "unknown key `{key}`: rename it to one of the known keys ({}, \
                     {HOST_WAIT_KEY}; keys starting with `_` are comments) or remove it",
                    known_keys()
                ));
            };
            t.per_kind[call as usize] = match val {
                Value::Number(_) => CallCost::flat(micros(val, key)?),
                Value::Object(e) => {
                    let mut c = CallCost::flat(0.0);
                    let mut has_per_call = false;
                    for (f, fv) in e {
                        let name = format!("{key}.{f}");
                        match f.as_str() {
                            "per_call_us" => {
                                c.per_call_us = micros(fv, &name)?;
                                has_per_call = true;
                            }
                            "per_mib_us" => {
                                c.per_mib_us = match fv {
                                    Value::Null => None,
                                    _ if !names_a_size(call) => {
                                        return Err(format!(
                                            "`{name}`: {key} names no size, so a per-MiB term \
                                             would be ignored: fold it into per_call_us or \
                                             remove it"
                                        ))
                                    }
                                    _ => Some(micros(fv, &name)?),
                                }
                            }
                            "source" => {}
                            _ => {
                                return Err(format!(
                                    "unknown field `{name}`: the fields of a call kind are \
                                     per_call_us, per_mib_us and source"
                                ))
                            }
                        }
                    }
                    if !has_per_call {
                        return Err(format!(
                            "`{key}` has no `per_call_us`: add it (microseconds per call)"
                        ));
                    }
                    c
                }
                other => {
                    return Err(format!(
                        "`{key}`: expected a number of microseconds or {{\"per_call_us\": N, \
                         \"per_mib_us\": M}}, got {}",
                        kind_of(other)
                    ))
                }
            };
        }
        Ok(t)
    }
}

impl serde::Serialize for CostTable {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json_value().serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for CostTable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        CostTable::from_json_value(&v).map_err(serde::de::Error::custom)
    }
}

fn known_keys() -> String {
    DriverCall::ALL
        .iter()
        .map(|c| c.key())
        .collect::<Vec<_>>()
        .join(", ")
}

fn num(x: f64) -> Value {
    Number::from_f64(x).map_or(Value::Null, Value::Number)
}

fn kind_of(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// A non-negative finite number of microseconds.
/// Whether calls of this kind name a size that the simulator prices per MiB (see "Units").
fn names_a_size(call: DriverCall) -> bool {
    matches!(
        call,
        DriverCall::CreatePhysical
            | DriverCall::Map
            | DriverCall::Unmap
            | DriverCall::SetAccess
            | DriverCall::ReserveVa
            | DriverCall::FreeVa
            | DriverCall::MemAlloc
    )
}

fn micros(v: &Value, name: &str) -> Result<f64, String> {
    match v.as_f64() {
        Some(x) if x.is_finite() && (0.0..=1e9).contains(&x) => Ok(x),
        Some(x) => Err(format!(
            "`{name}` must be a number of microseconds >= 0 and at most 1e9 (1000 s), got {x}"
        )),
        None => Err(format!(
            "`{name}` must be a number of microseconds >= 0, got {}",
            kind_of(v)
        )),
    }
}
