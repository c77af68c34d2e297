//! The catalog of allocator models: the names reports list ([`ALLOCATORS`], and the
//! [`RECORDED`] row that is not a model) and the factory that builds a model from its name
//! ([`make`]), which the CLI and the benches pick models by. A new model is added here (and in
//! its own module); [`crate::model`] knows none of them.

use cistern::{Config, CostTable};
use cistern_trace::snapshot::AllocatorSettings;

use crate::model::AllocatorModel;
use crate::pytorch::{PytorchConfig, PytorchModel};
use crate::simple::{CisternModel, CudaMallocModel, IdealModel};

/// Every allocator [`make`] knows, in the order reports list them.
pub const ALLOCATORS: &[&str] = &[
    "cistern",
    "cistern-novmm",
    "pytorch",
    "pytorch-expandable",
    "cudamalloc",
    "ideal",
];

/// The suffix that replays a cistern model on a GPU running behind the host:
/// `cistern@lag=2` launches a kernel over each block on its stream, and a stream's kernels
/// finish only once two later ones were launched there
/// ([`CisternModel::with_gpu_lag`](crate::simple::CisternModel::with_gpu_lag)).
pub const GPU_LAG: &str = "@lag=";

/// Whether the model `spec` names runs GPU work in the replay, so takes a [`GPU_LAG`]:
/// cistern's models (`cistern`, `cistern:KEY:VALUE,...`, `cistern-novmm`).
pub fn runs_gpu_work(spec: &str) -> bool {
    matches!(spec.split(':').next(), Some("cistern" | "cistern-novmm"))
}

/// Name of the row built from a snapshot's own `segment_*` events (not a model; see
/// [`crate::recorded()`]).
pub const RECORDED: &str = "pytorch-recorded";

/// The PyTorch model with the settings a snapshot recorded in its `allocator_settings`
/// ([`as_recorded`]): what a trace's own run is compared with like for like, where
/// `pytorch` and `pytorch-expandable` stay PyTorch's two defaults.
pub const AS_RECORDED: &str = "pytorch-as-recorded";

/// Values of an `allocator_settings` key that mean "off" (as Python prints them).
const OFF_VALUES: &[&str] = &["False", "0", "0.0", "", "''", "\"\"", "None", "[]", "{}"];

/// PyTorch's defaults for keys whose default is not "off".
const KEY_DEFAULTS: &[(&str, &str)] = &[("pinned_num_register_threads", "1")];

/// Whether a recorded key other than the typed ones could change where device memory goes:
/// the `pinned_*` keys configure the host's pinned-memory allocator, and a key at PyTorch's
/// default (or off) changes nothing.
fn matters(key: &str, value: &str) -> bool {
    let v = value.trim();
    !key.starts_with("pinned_")
        && !OFF_VALUES.contains(&v)
        && !KEY_DEFAULTS.iter().any(|&(k, d)| k == key && d == v)
}

/// What [`AS_RECORDED`] runs for a trace whose recording allocator had `settings`: the spec of
/// the PyTorch model with every recorded setting the model simulates (`expandable_segments`,
/// `max_split_size`), and a note naming the recorded ones it does not (`roundup_power2_divisions`,
/// `garbage_collection_threshold`, and any other device-memory key away from PyTorch's
/// default), or
/// saying that none were recorded (PyTorch's defaults are then assumed).
pub fn as_recorded(settings: Option<&AllocatorSettings>) -> (String, String) {
    let Some(a) = settings else {
        return (
            "pytorch".into(),
            "the trace records no allocator settings: PyTorch's defaults assumed".into(),
        );
    };
    let s = crate::whatif::PytorchSettings::recorded(Some(a)).unwrap_or_default();
    let base = if s.expandable_segments {
        "pytorch-expandable"
    } else {
        "pytorch"
    };
    // The model takes max_split_size_mb above 20 MiB only (as PyTorch does).
    let split = s.max_split_size.filter(|&b| b >> 20 > 20);
    let spec = match split {
        Some(b) => format!("{base}:max_split_size_mb:{}", b >> 20),
        None => base.to_string(),
    };
    let mut unsimulated = Vec::new();
    if !s.roundup_power2_divisions.is_empty() {
        unsimulated.push("roundup_power2_divisions".to_string());
    }
    if s.garbage_collection_threshold.is_some() {
        unsimulated.push("garbage_collection_threshold".to_string());
    }
    for (k, v) in &a.other {
        if matters(k, v) {
            unsimulated.push(format!("{k}={v}"));
        }
    }
    let mut note = format!("recorded settings: {spec}");
    if !unsimulated.is_empty() {
        note.push_str(&format!("; not simulated: {}", unsimulated.join(", ")));
    }
    (spec, note)
}

/// The largest `max_split_size_mb` whose size in bytes a `u64` holds (PyTorch clamps larger
/// values to `SIZE_MAX / 1 MiB`; a spec here refuses them rather than run another setting).
pub const MAX_SPLIT_SIZE_MB_MAX: u64 = u64::MAX >> 20;

/// `PYTORCH_CUDA_ALLOC_CONF` settings the PyTorch model does not simulate: a spec naming one is
/// refused (rather than replayed as if it were set).
const NOT_SIMULATED: &[&str] = &[
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "backend",
];

/// `max_split_size_mb:N` of the spec `name` (`base:conf`) in bytes: N must be above 20
/// (PyTorch's own bound: `max_split_size_mb too small, must be > 20`) and at most
/// [`MAX_SPLIT_SIZE_MB_MAX`], so that N MiB is a number of bytes.
fn max_split_size(name: &str, base: &str, conf: &str) -> Result<u64, String> {
    let expected = || {
        format!(
            "`{name}`: expected `{base}:max_split_size_mb:N` with N > 20 (PyTorch's own lower \
             bound) and N <= {MAX_SPLIT_SIZE_MB_MAX} (N MiB in bytes fits in 64 bits)"
        )
    };
    let Some(v) = conf.strip_prefix("max_split_size_mb:") else {
        let key = conf.split(':').next().unwrap_or(conf).trim();
        if NOT_SIMULATED.contains(&key) {
            return Err(format!(
                "`{name}`: `{key}` is a PyTorch setting the model does not simulate; the one \
                 it takes is max_split_size_mb (and expandable_segments is \
                 `pytorch-expandable`)"
            ));
        }
        return Err(expected());
    };
    let v = v.trim();
    let mb: u64 = v.parse().map_err(|_| {
        if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
            format!("{}; {v} is too large", expected())
        } else {
            format!("{}; `{v}` is not a whole number", expected())
        }
    })?;
    if mb <= 20 {
        return Err(format!("{}; {mb} is too small", expected()));
    }
    mb.checked_mul(1 << 20)
        .ok_or_else(|| format!("{}; {mb} is too large", expected()))
}

/// Builds the model `name` on a simulated device of `capacity` bytes, pricing driver calls with
/// the default [`CostTable`] (the published figures).
pub fn make(name: &str, capacity: u64) -> Result<Box<dyn AllocatorModel>, String> {
    make_with(name, capacity, &CostTable::default())
}

/// Builds the model `name` on a simulated device of `capacity` bytes whose driver calls are
/// priced with `costs`.
///
/// The PyTorch models accept PyTorch's `max_split_size_mb` setting as a suffix, in
/// `PYTORCH_CUDA_ALLOC_CONF` syntax: `pytorch:max_split_size_mb:256`; `cistern` accepts a
/// configuration in `CISTERN_CONF` syntax: `cistern:chunk_size:2MiB,stream_sync:always`.
pub fn make_with(
    name: &str,
    capacity: u64,
    costs: &CostTable,
) -> Result<Box<dyn AllocatorModel>, String> {
    if let Some((base, lag)) = name.rsplit_once(GPU_LAG) {
        // `SPEC@lag=N`: cistern on a GPU that runs N kernels behind the host, per stream.
        let lag: u32 = lag
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| lag.parse().ok())
            .flatten()
            .ok_or_else(|| {
                format!(
                    "`{name}`: `{GPU_LAG}` takes a number of kernels and ends the spec (e.g. \
                     `cistern{GPU_LAG}2`, `cistern:stream_sync:always{GPU_LAG}2`)"
                )
            })?;
        let config = match base.split_once(':') {
            Some(("cistern", conf)) => Config::parse(conf).map_err(|e| {
                format!("`{name}`: {e} (expected `cistern:KEY:VALUE,...{GPU_LAG}N`)")
            })?,
            None if base == "cistern" => Config::default(),
            None if base == "cistern-novmm" => Config {
                vmm: false,
                ..Config::default()
            },
            _ if base.contains(GPU_LAG) => {
                return Err(format!("`{name}`: `{GPU_LAG}` may be given once"))
            }
            _ => {
                return Err(format!(
                    "`{name}`: only cistern's models run GPU work in the replay; the other \
                     models never move a page, so a GPU that runs behind the host does not \
                     change them (use `{GPU_LAG}` on `cistern`, `cistern:...` or \
                     `cistern-novmm`)"
                ))
            }
        };
        return Ok(Box::new(
            CisternModel::new(name, config, capacity, costs)?.with_gpu_lag(lag),
        ));
    }
    if let Some((base, conf)) = name.split_once(':') {
        if base == "cistern" {
            // `cistern:KEY:VALUE,...`: cistern with a configuration in CISTERN_CONF syntax.
            let config = Config::parse(conf).map_err(|e| {
                format!("`{name}`: {e} (expected `cistern:KEY:VALUE,...`, as in CISTERN_CONF)")
            })?;
            return Ok(Box::new(CisternModel::new(name, config, capacity, costs)?));
        }
        if base == "pytorch" || base == "pytorch-expandable" {
            let max_split_size = max_split_size(name, base, conf)?;
            return Ok(Box::new(PytorchModel::with_costs(
                name,
                PytorchConfig {
                    max_split_size,
                    expandable_segments: base == "pytorch-expandable",
                },
                capacity,
                costs,
            )));
        }
    }
    Ok(match name {
        "cistern" => Box::new(CisternModel::new(name, Config::default(), capacity, costs)?),
        "cistern-novmm" => Box::new(CisternModel::new(
            name,
            Config {
                vmm: false,
                ..Config::default()
            },
            capacity,
            costs,
        )?),
        "pytorch" => Box::new(PytorchModel::with_costs(
            name,
            PytorchConfig::default(),
            capacity,
            costs,
        )),
        "pytorch-expandable" => Box::new(PytorchModel::with_costs(
            name,
            PytorchConfig {
                expandable_segments: true,
                ..PytorchConfig::default()
            },
            capacity,
            costs,
        )),
        "cudamalloc" => Box::new(CudaMallocModel::new(capacity, costs)),
        "ideal" => Box::new(IdealModel::new(capacity)),
        AS_RECORDED => {
            return Err(format!(
                "`{AS_RECORDED}` is resolved per trace, from the settings it recorded: build the \
                 spec cistern_replay::as_recorded returns"
            ))
        }
        RECORDED => {
            return Err(format!(
                "`{RECORDED}` is not a model: it is read from a snapshot's segment events \
                 (cistern_replay::recorded); models: {}",
                ALLOCATORS.join(", ")
            ))
        }
        other => {
            return Err(format!(
                "unknown allocator `{other}`; valid names: {} (and \
                 pytorch:max_split_size_mb:N)",
                ALLOCATORS.join(", ")
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_settings_become_the_model_s_spec_and_the_rest_a_note() {
        let (spec, note) = as_recorded(None);
        assert_eq!(spec, "pytorch");
        assert!(note.contains("defaults assumed"), "{note}");
        let a = AllocatorSettings {
            expandable_segments: Some(true),
            max_split_size: Some(256 << 20),
            roundup_power2_divisions: vec![(1, 4)],
            garbage_collection_threshold: Some(0.8),
            other: vec![
                ("release_lock_on_cudamalloc".into(), "True".into()),
                // Host pinned memory, and a key at its default: not named.
                ("pinned_num_register_threads".into(), "8".into()),
                ("graph_capture_record_stream_reuse".into(), "False".into()),
            ],
            ..AllocatorSettings::default()
        };
        let (spec, note) = as_recorded(Some(&a));
        assert_eq!(spec, "pytorch-expandable:max_split_size_mb:256");
        assert_eq!(
            note,
            "recorded settings: pytorch-expandable:max_split_size_mb:256; not simulated: \
             roundup_power2_divisions, garbage_collection_threshold, \
             release_lock_on_cudamalloc=True"
        );
        // Every spec it gives is one the catalog builds.
        make(&spec, 1 << 30).unwrap();
        // PyTorch's defaults, recorded.
        let (spec, note) = as_recorded(Some(&AllocatorSettings::default()));
        assert_eq!(
            (spec.as_str(), note.as_str()),
            ("pytorch", "recorded settings: pytorch")
        );
        assert!(make(AS_RECORDED, 1 << 30).is_err());
    }
}
