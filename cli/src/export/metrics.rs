//! The exporter's metric families: the one table of every name `cistern export` can emit (its
//! type, unit and help), the per-scrape samples, and their encoding in the Prometheus text
//! format (0.0.4) or OpenMetrics 1.0.0, both through `prometheus-client`'s encoders (which
//! escape label values and help text, and write `_total`, `# UNIT` and `# EOF` as each format
//! wants).
//!
//! Names are given here as PromQL sees them (`cistern_process_live_bytes`,
//! `cistern_exporter_scrapes_total`); the unit suffix and `_total` are split off for the
//! encoders, which add them back.

use std::collections::HashSet;
use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

/// A metric's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

/// One metric family, as listed in [`METRICS`].
#[derive(Debug, Clone, Copy)]
pub struct Desc {
    /// The name as PromQL sees it (with `_bytes`, `_seconds`, `_total`).
    pub name: &'static str,
    pub kind: Kind,
    /// The labels its samples carry (those marked `?` only when known).
    pub labels: &'static str,
    pub help: &'static str,
}

/// Labels of a process: `pid`, `command` (at most [`super::collect::MAX_COMMAND_CHARS`]
/// characters), `uid`, and where it runs, when the node knows: `container_id` and `pod_uid`
/// from the record's cgroup, and `container`, `pod` and `namespace` names from the kubelet's
/// log folder ([`super::kube`]).
const PROC: &str =
    "pid, command, uid?, container?, pod?, namespace?, container_id?, pod_uid?, simulated?";
/// A process's labels and the GPU: `gpu` (NVML's index) and `UUID`, spelt as dcgm-exporter
/// does, so the two join in PromQL.
const PROC_GPU: &str = "pid, command, uid?, container?, pod?, namespace?, container_id?, pod_uid?, simulated?, gpu?, UUID?";
/// A GPU's labels, as dcgm-exporter's: `gpu`, `UUID`, `device` (`nvidia<index>`),
/// `Hostname`. Its `modelName` is the one label left out: `promtool check metrics` refuses
/// camelCase label names, so the model is in `cistern_gpu_info{model_name}`.
const GPU: &str = "gpu, UUID, device, Hostname";

macro_rules! desc {
    ($name:literal, $kind:ident, $labels:expr, $help:literal) => {
        Desc {
            name: $name,
            kind: Kind::$kind,
            labels: $labels,
            help: $help,
        }
    };
}

/// Every family the exporter emits, in the order it emits them.
pub const METRICS: &[Desc] = &[
    // Per process and GPU, from its record (what its allocator sees), for processes that may
    // still hold that memory: running, zombies, dead while NVML lists their memory. A process
    // whose memory went with it is in cistern_process_state only.
    desc!("cistern_process_reserved_bytes", Gauge, PROC_GPU,
        "Bytes the process's allocator holds from the driver on the GPU (live + cached + pending), from its record."),
    desc!("cistern_process_live_bytes", Gauge, PROC_GPU,
        "Bytes in live blocks, from the process's record."),
    desc!("cistern_process_cached_bytes", Gauge, PROC_GPU,
        "Reserved bytes in no live or pending block (what the allocator could give back), from the process's record."),
    desc!("cistern_process_pending_bytes", Gauge, PROC_GPU,
        "Bytes freed but waiting on other streams' work, from the process's record."),
    desc!("cistern_process_peak_reserved_bytes", Gauge, PROC_GPU,
        "Highest reserved bytes since the process started, from its record."),
    desc!("cistern_process_peak_live_bytes", Gauge, PROC_GPU,
        "Highest live bytes since the process started, from its record."),
    desc!("cistern_process_limit_bytes", Gauge, PROC_GPU,
        "The process's limit on reserved bytes, from its record."),
    // Per process and GPU, from NVML.
    desc!("cistern_process_gpu_used_bytes", Gauge, PROC_GPU,
        "Device memory NVML says the pid uses on the GPU (for a dead process: what it still holds)."),
    desc!("cistern_process_overhead_bytes", Gauge, PROC_GPU,
        "NVML's used memory minus the record's reserved bytes: context, kernels, libraries, other allocators (negative when the two disagree)."),
    // Per process, tag and GPU.
    desc!("cistern_process_tag_live_bytes", Gauge, "pid, command, uid?, container?, pod?, namespace?, container_id?, pod_uid?, simulated?, gpu?, UUID?, tag",
        "Live bytes by tag: the process's largest tags (--top-tags), the rest summed as tag=\"other\"."),
    // Per process, GPU and sender.
    desc!("cistern_process_imported_bytes", Gauge, "pid, command, uid?, container?, pod?, namespace?, container_id?, pod_uid?, simulated?, gpu?, UUID?, from_pid",
        "Bytes the process maps from another process's pool (CUDA tensors it received), by the sender's pid as the receiver saw it: the sender's memory, not in the receiver's reserved bytes, kept alive by the receiver even after the sender exits."),
    // Per process.
    desc!("cistern_process_state", Gauge, "pid, command, uid?, container?, pod?, namespace?, container_id?, pod_uid?, simulated?, state",
        "1 for the process's state: running, zombie, exited (clean exit), dead-but-memory-held, dead-record-only (killed or crashed), pid-reused, no-record (NVML lists it, it publishes no record), not-visible (its pid namespace is out of the exporter's sight)."),
    desc!("cistern_process_allocations_total", Counter, PROC_GPU,
        "Allocations the process made on the GPU since it started, from its record (0 in records of older cistern versions)."),
    desc!("cistern_process_ooms_total", Counter, PROC_GPU,
        "Requests on the GPU that ran out of memory since the process started, from its record."),
    desc!("cistern_process_oom_reported", Gauge, PROC,
        "1 when the process's record holds an out-of-memory report (records keep the last one, with no count), else 0."),
    desc!("cistern_process_last_oom_requested_bytes", Gauge, PROC,
        "The request that failed in the process's last out-of-memory report."),
    desc!("cistern_process_record_updated_timestamp_seconds", Gauge, PROC,
        "When the process last rewrote its record (Unix time): the time of its last change."),
    // Per GPU, from NVML and the records.
    desc!("cistern_gpu_info", Gauge, "gpu, UUID, device, Hostname, model_name",
        "1 for each GPU NVML lists, labelled with its model (dcgm-exporter's modelName)."),
    desc!("cistern_gpu_memory_total_bytes", Gauge, GPU,
        "Device memory in total, from NVML."),
    desc!("cistern_gpu_memory_used_bytes", Gauge, GPU,
        "Device memory in use (total - free), from NVML."),
    desc!("cistern_gpu_memory_driver_reserved_bytes", Gauge, GPU,
        "Device memory the driver sets aside, from NVML (0 when unknown)."),
    desc!("cistern_gpu_memory_processes_bytes", Gauge, GPU,
        "The sum of NVML's per-process used memory on the GPU."),
    desc!("cistern_gpu_memory_unattributed_bytes", Gauge, GPU,
        "Used - per-process used - driver reserved: memory no listed process accounts for, e.g. still held after its process died (negative when NVML's numbers disagree)."),
    desc!("cistern_gpu_memory_dead_held_bytes", Gauge, GPU,
        "Device memory NVML lists for processes that are dead (state dead-but-memory-held)."),
    desc!("cistern_gpu_cistern_reserved_bytes", Gauge, GPU,
        "Of the processes' memory, what running cistern processes' allocators hold from the driver."),
    desc!("cistern_gpu_cistern_live_bytes", Gauge, GPU,
        "Live bytes of running cistern processes on the GPU."),
    desc!("cistern_gpu_cistern_cached_bytes", Gauge, GPU,
        "Cached bytes of running cistern processes on the GPU."),
    // The driver's own errors, from the kernel log.
    desc!("cistern_gpu_xid_errors", Gauge, "gpu?, UUID?, device?, Hostname, pci?, xid, severity",
        "Xid errors the NVIDIA driver logged for the GPU within the last 24 hours, by code (severity fatal: the GPU needs a reset or service, and memory may stay held until then; application: a program's fault)."),
    // The exporter itself.
    desc!("cistern_exporter_build_info", Gauge, "version",
        "1, labelled with the version of cistern serving these metrics."),
    desc!("cistern_exporter_nvml_up", Gauge, "",
        "1 when NVML answered this scrape, 0 when it could not be used (the registry alone is exported)."),
    desc!("cistern_exporter_registry_dir_up", Gauge, "dir",
        "1 when the registry directory could be read this scrape, 0 when it could not (see the exporter's log)."),
    desc!("cistern_exporter_kernel_log_up", Gauge, "",
        "1 when the kernel log could be read for Xid errors this scrape, 0 when not (the exporter needs CAP_SYSLOG or kernel.dmesg_restrict=0)."),
    desc!("cistern_exporter_registry_dirs_refused", Gauge, "",
        "Registry directories found this scrape but not read: refused (wrong owner, open mode, a symlink) or unreadable; `cistern ps --all-users` names them."),
    desc!("cistern_exporter_xid_events_left_out", Gauge, "",
        "Xid errors in the window beyond the newest the exporter counts (so cistern_gpu_xid_errors undercounts by this much)."),
    desc!("cistern_exporter_records", Gauge, "",
        "Records read this scrape."),
    desc!("cistern_exporter_records_refused", Gauge, "",
        "Record files refused this scrape (not a record, too large, a symlink, another version)."),
    desc!("cistern_exporter_series_dropped", Gauge, "",
        "Series left out this scrape because another with the same labels was kept (several records of one pid: the live or newest one is kept)."),
    desc!("cistern_exporter_scrape_duration_seconds", Gauge, "",
        "Time this scrape took to read the registry and NVML and build its samples."),
    desc!("cistern_exporter_scrapes_total", Counter, "",
        "Scrapes of /metrics served since the exporter started."),
];

/// The description of `name`; panics on a name not in [`METRICS`] (a programming error, caught
/// by the unit tests).
pub fn desc(name: &str) -> &'static Desc {
    METRICS
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("metric {name} is not in METRICS"))
}

/// A sample's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Count(u64),
}

/// A sample's labels, in the order they are written.
pub type Labels = Vec<(&'static str, String)>;

/// One family's samples.
#[derive(Debug)]
pub struct Family {
    pub desc: &'static Desc,
    pub samples: Vec<(Labels, Value)>,
}

/// One scrape's samples, family by family (each family once, each label set once in it).
#[derive(Debug, Default)]
pub struct Exposition {
    families: Vec<Family>,
    seen: HashSet<(&'static str, Labels)>,
    /// Samples refused because their family already had their label set.
    pub dropped: usize,
}

impl Exposition {
    /// Adds a sample to the family `name` (a name from [`METRICS`]). A second sample with the
    /// same labels in the same family is left out and counted in `dropped` (a family must not
    /// hold two series with one label set, or the scrape is refused whole).
    pub fn add(&mut self, name: &str, labels: Labels, value: Value) {
        let d = desc(name);
        if !self.seen.insert((d.name, labels.clone())) {
            self.dropped += 1;
            return;
        }
        match self.families.iter_mut().find(|f| f.desc.name == d.name) {
            Some(f) => f.samples.push((labels, value)),
            None => self.families.push(Family {
                desc: d,
                samples: vec![(labels, value)],
            }),
        }
    }

    /// Adds a byte count (saturating at `i64::MAX`).
    pub fn bytes(&mut self, name: &str, labels: Labels, v: u64) {
        self.add(
            name,
            labels,
            Value::Int(i64::try_from(v).unwrap_or(i64::MAX)),
        );
    }

    /// The families, in [`METRICS`] order.
    pub fn families(&self) -> Vec<&Family> {
        let mut out: Vec<&Family> = self.families.iter().collect();
        out.sort_by_key(|f| METRICS.iter().position(|d| d.name == f.desc.name));
        out
    }

    /// The value of the sample of `name` whose labels include all of `want` (for tests).
    #[cfg(test)]
    pub fn get(&self, name: &str, want: &[(&str, &str)]) -> Option<Value> {
        let f = self.families.iter().find(|f| f.desc.name == name)?;
        f.samples
            .iter()
            .find(|(l, _)| {
                want.iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, v)| *v)
    }

    /// Every sample of `name` (for tests).
    #[cfg(test)]
    pub fn samples(&self, name: &str) -> Vec<&(Labels, Value)> {
        self.families
            .iter()
            .filter(|f| f.desc.name == name)
            .flat_map(|f| f.samples.iter())
            .collect()
    }
}

/// An exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format, version 0.0.4.
    Prometheus,
    /// OpenMetrics text, version 1.0.0.
    OpenMetrics,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// The base name, unit and type the encoders want for a PromQL name.
fn split_name(d: &Desc) -> (&'static str, Option<Unit>, MetricType) {
    match d.kind {
        Kind::Counter => (
            d.name
                .strip_suffix("_total")
                .expect("counter names end in _total"),
            None,
            MetricType::Counter,
        ),
        Kind::Gauge => {
            if let Some(base) = d.name.strip_suffix("_bytes") {
                (base, Some(Unit::Bytes), MetricType::Gauge)
            } else if let Some(base) = d.name.strip_suffix("_seconds") {
                (base, Some(Unit::Seconds), MetricType::Gauge)
            } else {
                (d.name, None, MetricType::Gauge)
            }
        }
    }
}

/// One scrape's families as a `prometheus-client` collector (the registry wants it owned).
#[derive(Debug)]
struct Families(Vec<Family>);

impl Collector for Families {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        for fam in &self.0 {
            let (base, unit, ty) = split_name(fam.desc);
            let mut fe = encoder.encode_descriptor(base, fam.desc.help, unit.as_ref(), ty)?;
            for (labels, value) in &fam.samples {
                let me = fe.encode_family(labels)?;
                match *value {
                    Value::Int(v) => ConstGauge::new(v).encode(me)?,
                    Value::Float(v) => ConstGauge::new(v).encode(me)?,
                    Value::Count(v) => ConstCounter::new(v).encode(me)?,
                }
            }
        }
        Ok(())
    }
}

/// Encodes the exposition in `format`.
pub fn encode(x: &Exposition, format: Format) -> String {
    // A scrape holds a few thousand samples: copying them into the collector costs far less
    // than reading the records did.
    let owned: Vec<Family> = x
        .families()
        .into_iter()
        .map(|f| Family {
            desc: f.desc,
            samples: f.samples.clone(),
        })
        .collect();
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Families(owned)));
    let mut out = String::new();
    let r = match format {
        Format::Prometheus => {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        }
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry),
    };
    // Writing to a String fails only if an encoder refuses a value, which ours never are.
    r.expect("encoding metrics into a String");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_follow_prometheus_conventions() {
        let mut names = HashSet::new();
        for d in METRICS {
            assert!(names.insert(d.name), "{} twice", d.name);
            assert!(d.name.starts_with("cistern_"), "{}", d.name);
            assert!(
                d.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{}",
                d.name
            );
            assert_eq!(
                d.kind == Kind::Counter,
                d.name.ends_with("_total"),
                "{}",
                d.name
            );
            assert!(!d.help.is_empty());
        }
    }

    fn sample() -> Exposition {
        let mut x = Exposition::default();
        let cmd = "python -c \"print('a\\b')\"\nsecond line";
        x.bytes(
            "cistern_process_live_bytes",
            vec![("pid", "7".into()), ("command", cmd.into())],
            5 << 20,
        );
        x.add("cistern_exporter_scrapes_total", vec![], Value::Count(3));
        x.add(
            "cistern_exporter_scrape_duration_seconds",
            vec![],
            Value::Float(0.25),
        );
        x
    }

    #[test]
    fn prometheus_text_escapes_and_names() {
        let text = encode(&sample(), Format::Prometheus);
        assert!(
            text.contains(
                r#"cistern_process_live_bytes{pid="7",command="python -c \"print('a\\b')\"\nsecond line"} 5242880"#
            ),
            "{text}"
        );
        // 0.0.4: the counter's family is named with _total; no UNIT, no EOF.
        assert!(
            text.contains("# TYPE cistern_exporter_scrapes_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("\ncistern_exporter_scrapes_total 3\n"),
            "{text}"
        );
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(
            text.contains("cistern_exporter_scrape_duration_seconds 0.25\n"),
            "{text}"
        );
        // One line per sample: the newline in the command is escaped.
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("cistern_process_live"))
                .count(),
            1
        );
    }

    #[test]
    fn openmetrics_has_units_total_and_eof() {
        let text = encode(&sample(), Format::OpenMetrics);
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            text.contains("# TYPE cistern_exporter_scrapes counter\n"),
            "{text}"
        );
        assert!(
            text.contains("\ncistern_exporter_scrapes_total 3\n"),
            "{text}"
        );
        assert!(
            text.contains("# UNIT cistern_process_live_bytes bytes\n"),
            "{text}"
        );
        assert!(
            text.contains(r#"command="python -c \"print('a\\b')\"\nsecond line""#),
            "{text}"
        );
    }

    #[test]
    fn a_label_set_is_kept_once_per_family() {
        let mut x = Exposition::default();
        let l = || vec![("pid", "1".to_string())];
        x.bytes("cistern_process_live_bytes", l(), 1);
        x.bytes("cistern_process_live_bytes", l(), 2);
        x.bytes("cistern_process_cached_bytes", l(), 3);
        assert_eq!(x.dropped, 1);
        assert_eq!(
            x.get("cistern_process_live_bytes", &[("pid", "1")]),
            Some(Value::Int(1))
        );
        let text = encode(&x, Format::Prometheus);
        assert_eq!(
            text.matches("cistern_process_live_bytes{").count(),
            1,
            "{text}"
        );
        // Families come out in table order, whatever the order they were filled in.
        assert!(
            text.find("cistern_process_live_bytes{").unwrap()
                < text.find("cistern_process_cached").unwrap()
        );
    }
}
