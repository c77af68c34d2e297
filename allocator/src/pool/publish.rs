//! The pool's side of the cross-process registry ([`crate::registry`]): the pool as a
//! [`RecordSource`] (device records from its reports and ledgers, the last OOM report, the
//! live blocks as leaks) and [`Pool::start_registry`]. The registry itself knows nothing of the
//! pool; the dependency runs from here to it only.

use std::sync::{Arc, Mutex};

use crate::driver::Driver;
use crate::error::{Attribution, OomReport, OtherProcess};
use crate::pool::{DeviceReport, Pool};
use crate::registry::{
    self, AttributionRecord, DeviceRecord, ImportRecord, LeakEntry, OomRecord, OtherProcessRecord,
    ProcessSnapshot, RecordSource, Registry, RegistryError, RegistryHandle, MAX_TOP, NO_TAG,
};

impl<D: Driver> Pool<D> {
    /// Publishes this pool in the cross-process registry ([`crate::registry`]), when the
    /// configuration's `registry` setting is on (the default): opens the directory
    /// ([`crate::registry::dir_for`]: `registry_dir`, else the per-user default), writes a first
    /// record, starts the background thread that republishes it at most once a second when it
    /// changed (removing, on that thread, the expired records of clean exits first:
    /// `registry_expire`), and
    /// installs the `atexit` hook that writes the final record (state `exited`,
    /// with the blocks still live) when the process exits normally
    /// ([`crate::registry::install_exit_hook`]).
    ///
    /// Returns `Ok(None)` with `registry:off`, and the error when the directory is unsafe or
    /// cannot be written: the pool works the same either way, and the caller decides whether
    /// to log it. Nothing is added to the allocation path. The registry's thread and the exit
    /// hook hold a clone of the `Arc`, so the pool lives until the process exits. Call it once
    /// per process: every call publishes this process's one record.
    pub fn start_registry(self: &Arc<Self>) -> Result<Option<RegistryHandle>, RegistryError> {
        let Some(dir) = registry::dir_for(&self.config) else {
            return Ok(None);
        };
        let source: Arc<dyn RecordSource + Send + Sync> = self.clone();
        let registry = Registry::open(dir)?.expire_from(self.config.registry_expire);
        let handle = registry.spawn(source, registry::DEFAULT_INTERVAL)?;
        registry::install_exit_hook(handle.clone());
        Ok(Some(handle))
    }
}

impl DeviceRecord {
    /// The record of a device from its pool's report and its UUID (`DevicePool::caps().uuid`);
    /// tags and sites are left empty for the caller to fill.
    pub fn from_report(r: &DeviceReport, uuid: Option<String>) -> DeviceRecord {
        DeviceRecord {
            index: r.device as u32,
            uuid,
            name: r.name.clone(),
            total_memory: r.total_memory,
            limit: r.limit,
            reserved: r.reserved,
            live: r.live,
            cached: r.reserved.saturating_sub(r.live).saturating_sub(r.pending),
            pending: r.pending,
            peak_reserved: r.peak_reserved,
            peak_live: r.peak_live,
            allocations: r.allocations,
            ooms: r.ooms,
            top_tags: Vec::new(),
            top_sites: Vec::new(),
            imported: Vec::new(),
            imported_other: 0,
        }
    }
}

/// The published form of an OOM report. Destructured field by field, so that a field added to
/// [`OomReport`] does not compile until it is given (or refused) a place in the record format.
impl From<&OomReport> for OomRecord {
    fn from(r: &OomReport) -> OomRecord {
        let OomReport {
            device,
            stream,
            requested,
            rounded,
            limit,
            device_free,
            device_total,
            reserved,
            live,
            pending,
            cached,
            largest_free,
            top_tags,
            top_sites,
            other_processes,
            process_nvml_bytes,
            reason,
        } = r;
        OomRecord {
            device: *device,
            stream: *stream,
            requested: *requested,
            rounded: *rounded,
            limit: *limit,
            device_free: *device_free,
            device_total: *device_total,
            reserved: *reserved,
            live: *live,
            pending: *pending,
            cached: *cached,
            largest_free: *largest_free,
            top_tags: top_tags.iter().map(AttributionRecord::from).collect(),
            top_sites: top_sites.iter().map(AttributionRecord::from).collect(),
            other_processes: other_processes
                .iter()
                .map(OtherProcessRecord::from)
                .collect(),
            process_nvml_bytes: *process_nvml_bytes,
            reason: reason.clone(),
        }
    }
}

impl From<&Attribution> for AttributionRecord {
    fn from(a: &Attribution) -> AttributionRecord {
        let Attribution {
            name,
            bytes,
            blocks,
        } = a;
        AttributionRecord {
            name: name.clone(),
            bytes: *bytes,
            blocks: *blocks,
        }
    }
}

impl From<&OtherProcess> for OtherProcessRecord {
    fn from(p: &OtherProcess) -> OtherProcessRecord {
        let OtherProcess {
            pid,
            bytes,
            command,
            nvml_only,
        } = p;
        OtherProcessRecord {
            pid: *pid,
            bytes: *bytes,
            command: command.clone(),
            nvml_only: *nvml_only,
        }
    }
}

/// The one-line label of call site `id` ([`crate::provenance::site_label`]), symbolised once per
/// process and then remembered: site ids are interned for the life of the process, and
/// symbolising takes milliseconds, too slow to repeat on every snapshot.
fn cached_site_label(id: u32) -> String {
    static LABELS: Mutex<Option<std::collections::HashMap<u32, String>>> = Mutex::new(None);
    if let Some(l) = LABELS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&id))
    {
        return l.clone();
    }
    // Symbolised without the lock held (two threads may both do it once; they agree).
    let label = crate::provenance::site_label(id);
    LABELS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(Default::default)
        .insert(id, label.clone());
    label
}

/// Live bytes and blocks of `ledger` summed by `key` (entries with a `None` key left out), as
/// attributions: largest first, ties by key, at most [`MAX_TOP`]. Entries with nothing live
/// are left out.
fn top_by<K: std::hash::Hash + Ord>(
    ledger: &[crate::provenance::LedgerEntry],
    key: impl Fn(&crate::provenance::LedgerEntry) -> Option<K>,
    name: impl Fn(&K) -> String,
) -> Vec<AttributionRecord> {
    let mut sums: std::collections::HashMap<K, (u64, u64)> = std::collections::HashMap::new();
    for e in ledger {
        if e.live_bytes == 0 && e.live_blocks == 0 {
            continue;
        }
        if let Some(k) = key(e) {
            let s = sums.entry(k).or_default();
            s.0 += e.live_bytes;
            s.1 += e.live_blocks;
        }
    }
    // A total order (ties by key), so that equal states give equal snapshots; only the entries
    // kept are named (site names are costly).
    let mut v: Vec<(K, (u64, u64))> = sums.into_iter().collect();
    v.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(&b.0)));
    v.truncate(MAX_TOP);
    v.into_iter()
        .map(|(k, (bytes, blocks))| AttributionRecord {
            name: name(&k),
            bytes,
            blocks,
        })
        .collect()
}

/// The pool's devices (those created so far), with provenance:
///
/// - each [`DeviceRecord`] has the numbers of the device's report, and live bytes by tag and by
///   call site from its ledger ([`crate::DevicePool::ledger`]; empty with `provenance:off`);
///   untagged bytes are named [`NO_TAG`], sites by their symbolised label (sampled stacks
///   only; each site is symbolised once per process);
/// - `last_oom` is the most recent of the devices' last OOM reports
///   ([`crate::DevicePool::last_oom`]);
/// - `leaks` are the live blocks of every device grouped by (tag, site), with the age of the
///   oldest (when provenance is on), largest first.
///
/// A snapshot takes each device's locks briefly (its report, then its ledger: each arena's
/// lock, no block is walked); it runs on the registry's thread, at most once per interval.
/// Marks are not published.
impl<D: Driver> RecordSource for Pool<D> {
    fn snapshot(&self) -> ProcessSnapshot {
        let mut devices = Vec::new();
        let mut last_oom: Option<OomRecord> = None;
        for d in self.devices() {
            let mut rec = DeviceRecord::from_report(&d.report(), d.caps().uuid.clone());
            let ledger = d.ledger();
            rec.top_tags = top_by(
                &ledger,
                |e| Some(e.tag.clone()),
                |t| {
                    if t.is_empty() {
                        NO_TAG.to_string()
                    } else {
                        t.clone()
                    }
                },
            );
            rec.top_sites = top_by(&ledger, |e| e.site, |&id| cached_site_label(id));
            let imported = d.imported();
            rec.imported_other = imported
                .iter()
                .skip(MAX_TOP)
                .fold(0u64, |sum, i| sum.saturating_add(i.bytes));
            rec.imported = imported
                .into_iter()
                .take(MAX_TOP)
                .map(|i| ImportRecord {
                    from_pid: i.from_pid,
                    from_start_time: i.from_start_time.unwrap_or(0),
                    bytes: i.bytes,
                })
                .collect();
            devices.push(rec);
            // Several devices may have failed: the record keeps one, the last device's.
            if let Some(o) = d.last_oom() {
                last_oom = Some(OomRecord::from(&o));
            }
        }
        ProcessSnapshot {
            devices,
            last_oom,
            marks: Vec::new(),
            driver: Some(self.driver().name().to_string()),
        }
    }

    fn leaks(&self) -> Vec<LeakEntry> {
        let ages = self.config().provenance != crate::provenance::Mode::Off;
        let mut out: Vec<LeakEntry> = self
            .devices()
            .flat_map(|d| {
                let device = d.device() as u32;
                crate::provenance::group_live(&d.live_blocks_detailed())
                    .into_iter()
                    .map(move |g| LeakEntry {
                        tag: g.tag,
                        site: g.site.map(cached_site_label),
                        device,
                        bytes: g.bytes,
                        blocks: g.blocks,
                        oldest_age_ms: ages.then_some(g.oldest.as_millis() as u64),
                    })
            })
            .collect();
        out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.tag.cmp(&b.tag)));
        out
    }
}

/// How many other processes an OOM report names.
const OTHER_PROCESSES: usize = 8;

/// The other processes using cistern, as their registry records say ([`crate::registry`]):
/// the live processes of this boot (pid and start time checked against `/proc`) on the same
/// driver (`cuda`; a simulated GPU holds no device memory, so there are none on it).
#[derive(Debug, Default)]
pub(super) struct Recorded {
    /// Those with bytes reserved on the GPU asked for, largest first (all of them).
    pub on_gpu: Vec<crate::error::OtherProcess>,
    /// The pids of all of them, on any GPU or none: processes NVML lists with one of these
    /// pids have a record, whatever they hold on this GPU.
    pub pids: Vec<u32>,
}

/// The other processes using cistern on the GPU `uuid` ([`Recorded`]). What an OOM report
/// names (see [`DevicePool::name_other_processes`]), with NVML's others ([`with_nvml`]).
/// Empty when the registry is off, the directory cannot be read, or the GPU has no UUID.
///
/// [`DevicePool::name_other_processes`]: crate::DevicePool
pub(super) fn other_processes_on(
    config: &crate::Config,
    driver: &str,
    uuid: Option<&str>,
) -> Recorded {
    let (Some(dir), Some(uuid)) = (registry::dir_for(config), uuid) else {
        return Recorded::default();
    };
    if driver != "cuda" {
        return Recorded::default();
    }
    let Ok(files) = registry::read_all(&dir) else {
        return Recorded::default();
    };
    let me = std::process::id();
    let boot = registry::boot_id().ok();
    let mut found = Recorded::default();
    for r in files
        .into_iter()
        .filter_map(|(_, r)| r.ok())
        .filter(|r| r.pid != me && r.state == registry::State::Running)
        .filter(|r| r.driver.as_deref().is_none_or(|d| d == "cuda"))
        .filter(|r| boot.as_deref().is_none_or(|b| b == r.boot_id))
        .filter(|r| registry::is_alive(r.pid, r.start_time) == registry::Liveness::Alive)
    {
        found.pids.push(r.pid);
        let bytes: u64 = r
            .devices
            .iter()
            .filter(|d| d.uuid.as_deref() == Some(uuid))
            .map(|d| d.reserved)
            .sum();
        if bytes > 0 {
            found.on_gpu.push(crate::error::OtherProcess {
                pid: r.pid,
                bytes,
                command: printable(r.cmdline.iter().map(String::as_str)),
                nvml_only: false,
            });
        }
    }
    found
        .on_gpu
        .sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
    found
}

/// Another process's command line, printed in this one's error: its words joined by spaces,
/// without control characters.
fn printable<'a>(words: impl Iterator<Item = &'a str>) -> String {
    words
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// Other processes on a GPU, and what NVML counts for this one ([`others_on`]).
pub(super) type Others = (Vec<crate::error::OtherProcess>, Option<u64>);

/// Who else holds memory on the GPU `uuid`, for an OOM report: the processes using cistern
/// there ([`other_processes_on`]) and the others NVML lists ([`with_nvml`]); and what NVML
/// counts for this process, which holds `reserved` bytes there in its pools. Nothing on the
/// simulator.
pub(super) fn others_on(
    config: &crate::Config,
    driver: &str,
    uuid: Option<&str>,
    reserved: u64,
) -> Others {
    let (Some(uuid), "cuda") = (uuid, driver) else {
        return (Vec::new(), None);
    };
    let recorded = other_processes_on(config, driver, Some(uuid));
    let nvml = crate::nvml::processes_on(uuid);
    let me = Me {
        pid: std::process::id(),
        reserved,
    };
    with_nvml(recorded, nvml.as_deref(), me, |pid| {
        let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let (words, _) = registry::split_cmdline(&raw, registry::MAX_CMDLINE_BYTES);
        Some(printable(words.iter().map(String::as_str)))
    })
}

/// This process, as [`with_nvml`] looks for it in NVML's list.
#[derive(Debug, Clone, Copy)]
pub(super) struct Me {
    /// Its pid.
    pub pid: u32,
    /// The bytes its pools hold on the GPU: NVML, which counts its CUDA context too, cannot
    /// count less for it.
    pub reserved: u64,
}

/// Adds to the processes using cistern (`recorded`) those NVML lists on the GPU (`nvml`)
/// without a record, with the memory NVML counts for them and their command line (`command`,
/// from `/proc`); returns them, largest first, at most [`OTHER_PROCESSES`], and what NVML
/// counts for this process (`me`). Only when NVML lists `me`, with at least its pools' bytes
/// where it can say: otherwise its pids are another pid namespace's (this process in a
/// container, most often; or under MPS, where NVML lists the server), which this process
/// cannot tell from its own, and nothing of NVML's is used. A process with a record keeps its
/// record's bytes (what its pools reserve, not its CUDA context), and one with a record but
/// nothing reserved on this GPU is not named.
pub(super) fn with_nvml(
    recorded: Recorded,
    nvml: Option<&[crate::nvml::GpuProcess]>,
    me: Me,
    command: impl Fn(u32) -> Option<String>,
) -> Others {
    let Recorded {
        on_gpu: mut others,
        pids,
    } = recorded;
    let mine = nvml.and_then(|l| l.iter().find(|p| p.pid == me.pid));
    let (list, mine) = match mine {
        Some(m) if m.used.is_none_or(|used| used >= me.reserved) => (nvml.unwrap_or(&[]), m.used),
        _ => (&[][..], None),
    };
    for p in list {
        if p.pid == me.pid || pids.contains(&p.pid) || others.iter().any(|o| o.pid == p.pid) {
            continue;
        }
        others.push(crate::error::OtherProcess {
            pid: p.pid,
            bytes: p.used.unwrap_or(0),
            command: command(p.pid).unwrap_or_default(),
            nvml_only: true,
        });
    }
    others.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
    others.truncate(OTHER_PROCESSES);
    (others, mine)
}

#[cfg(test)]
mod tests {
    use std::process::{Child, Command};

    use super::{other_processes_on, with_nvml, Me, Recorded};
    use crate::error::OtherProcess;
    use crate::nvml::GpuProcess;
    use crate::registry::{self, DeviceRecord, Identity, ProcessSnapshot, Registry, State};

    const GPU: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const GIB: u64 = 1 << 30;

    /// A process that stays alive until dropped.
    struct Sleeper(Child);

    impl Sleeper {
        fn new() -> Sleeper {
            Sleeper(
                Command::new("sleep")
                    .arg("60")
                    .spawn()
                    .expect("spawn sleep"),
            )
        }
        fn identity(&self, command: &str) -> Identity {
            let pid = self.0.id();
            Identity {
                pid,
                start_time: registry::process_start_time(pid).expect("its start time"),
                boot_id: registry::boot_id().unwrap(),
                uid: registry::euid(),
                cmdline: command.split(' ').map(str::to_owned).collect(),
                cmdline_truncated: false,
                placement: Default::default(),
            }
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn device(uuid: &str, reserved: u64) -> DeviceRecord {
        DeviceRecord {
            index: 0,
            uuid: Some(uuid.into()),
            name: "GPU".into(),
            total_memory: 80 * GIB,
            limit: 80 * GIB,
            reserved,
            live: reserved,
            cached: 0,
            pending: 0,
            peak_reserved: reserved,
            peak_live: reserved,
            top_tags: vec![],
            top_sites: vec![],
            allocations: 0,
            ooms: 0,
            imported: vec![],
            imported_other: 0,
        }
    }

    fn publish(dir: &std::path::Path, id: Identity, dev: DeviceRecord, driver: &str, state: State) {
        let snap = ProcessSnapshot {
            devices: vec![dev],
            last_oom: None,
            marks: vec![],
            driver: Some(driver.into()),
        };
        Registry::with_identity(dir, id)
            .unwrap()
            .publish(&snap, state, vec![])
            .unwrap();
    }

    /// An OOM names the live processes of this boot that hold memory on the same GPU through
    /// cistern on the real driver, largest first; not the dead, the exited, those on another
    /// GPU or on the simulator, nor this process.
    #[test]
    fn an_oom_names_the_live_processes_on_the_same_gpu() {
        let dir = std::env::temp_dir().join(format!("cistern-oom-others-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = crate::Config {
            registry_dir: Some(dir.clone()),
            ..Default::default()
        };
        let (big, small, sim, other_gpu, exited) = (
            Sleeper::new(),
            Sleeper::new(),
            Sleeper::new(),
            Sleeper::new(),
            Sleeper::new(),
        );
        publish(
            &dir,
            big.identity("python train.py --big"),
            device(GPU, 30 * GIB),
            "cuda",
            State::Running,
        );
        publish(
            &dir,
            small.identity("python serve.py\x1b[2J"),
            device(GPU, 2 * GIB),
            "cuda",
            State::Running,
        );
        publish(
            &dir,
            sim.identity("sim"),
            device(GPU, 50 * GIB),
            "sim",
            State::Running,
        );
        publish(
            &dir,
            other_gpu.identity("elsewhere"),
            device("GPU-other", 50 * GIB),
            "cuda",
            State::Running,
        );
        publish(
            &dir,
            exited.identity("done"),
            device(GPU, 50 * GIB),
            "cuda",
            State::Exited,
        );
        // A killed process's last record, and this process's own.
        let dead = {
            let mut c = Command::new("true").spawn().unwrap();
            let pid = c.id();
            let start = registry::process_start_time(pid).unwrap_or(1);
            c.wait().unwrap();
            Identity {
                pid,
                start_time: start,
                ..big.identity("dead")
            }
        };
        publish(&dir, dead, device(GPU, 50 * GIB), "cuda", State::Running);
        publish(
            &dir,
            Identity::current().unwrap(),
            device(GPU, 50 * GIB),
            "cuda",
            State::Running,
        );

        let named = other_processes_on(&config, "cuda", Some(GPU));
        // Every live record of the driver has a pid here, the other GPU's too.
        let mut pids = named.pids.clone();
        pids.sort_unstable();
        let mut want = vec![big.0.id(), small.0.id(), other_gpu.0.id()];
        want.sort_unstable();
        assert_eq!(pids, want);
        let got: Vec<(u32, u64, &str)> = named
            .on_gpu
            .iter()
            .map(|p| (p.pid, p.bytes, p.command.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (big.0.id(), 30 * GIB, "python train.py --big"),
                // Another process's words reach this one's error without control characters.
                (small.0.id(), 2 * GIB, "python serve.py?[2J"),
            ]
        );
        // On the simulator, or for a GPU without a UUID, or with the registry off: nobody.
        assert!(other_processes_on(&config, "sim", Some(GPU))
            .pids
            .is_empty());
        assert!(other_processes_on(&config, "cuda", None).pids.is_empty());
        let off = crate::Config {
            registry: false,
            ..config.clone()
        };
        assert!(other_processes_on(&off, "cuda", Some(GPU)).pids.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn cistern(pid: u32, bytes: u64) -> OtherProcess {
        OtherProcess {
            pid,
            bytes,
            command: format!("cistern user {pid}"),
            nvml_only: false,
        }
    }

    fn nvml(pid: u32, used: Option<u64>) -> GpuProcess {
        GpuProcess { pid, used }
    }

    fn recorded(on_gpu: Vec<OtherProcess>, also: &[u32]) -> Recorded {
        let pids = on_gpu
            .iter()
            .map(|p| p.pid)
            .chain(also.iter().copied())
            .collect();
        Recorded { on_gpu, pids }
    }

    /// NVML's processes join the records': those without one are added with NVML's bytes and
    /// their command line, marked; one with a record keeps its record's bytes, and one with a
    /// record but nothing here is not named; this process is not among them, and what NVML
    /// counts for it is returned; largest first, at most eight.
    #[test]
    fn nvml_names_the_processes_without_a_record() {
        const ME: Me = Me {
            pid: 100,
            reserved: 5 * GIB,
        };
        let command = |pid: u32| (pid != 5).then(|| format!("prog{pid} --flag"));
        let list = [
            nvml(3, Some(4 * GIB)),
            nvml(ME.pid, Some(6 * GIB)),
            nvml(1, Some(9 * GIB)),
            nvml(5, None),
            // A cistern process holding nothing on this GPU: its context only.
            nvml(9, Some(GIB / 2)),
            // Listed twice (as NVML may, once per MIG instance): named once.
            nvml(3, Some(4 * GIB)),
        ];
        let (others, mine) = with_nvml(
            recorded(vec![cistern(1, 8 * GIB)], &[9]),
            Some(&list),
            ME,
            command,
        );
        assert_eq!(mine, Some(6 * GIB));
        let got: Vec<(u32, u64, &str, bool)> = others
            .iter()
            .map(|p| (p.pid, p.bytes, p.command.as_str(), p.nvml_only))
            .collect();
        assert_eq!(
            got,
            [
                (1, 8 * GIB, "cistern user 1", false),
                (3, 4 * GIB, "prog3 --flag", true),
                (5, 0, "", true),
            ]
        );

        // NVML does not list this process: its pids are another namespace's, and unused.
        let elsewhere = [nvml(3, Some(4 * GIB)), nvml(7, Some(GIB))];
        let one = || recorded(vec![cistern(1, GIB)], &[]);
        let (others, mine) = with_nvml(one(), Some(&elsewhere), ME, command);
        assert_eq!((others, mine), (vec![cistern(1, GIB)], None));
        // Nor when it lists this pid with less than this process's pools hold: another
        // namespace's process with the same pid.
        let collide = [nvml(3, Some(4 * GIB)), nvml(ME.pid, Some(GIB))];
        let (others, mine) = with_nvml(one(), Some(&collide), ME, command);
        assert_eq!((others, mine), (vec![cistern(1, GIB)], None));
        // No NVML: the records alone.
        let (others, mine) = with_nvml(one(), None, ME, command);
        assert_eq!((others, mine), (vec![cistern(1, GIB)], None));

        // Many records, more than NVML's own: every one with a record keeps its record's
        // bytes, never NVML's (the cut comes after the join); the eight largest.
        let records: Vec<OtherProcess> = (1..=9).map(|p| cistern(p, u64::from(p) * GIB)).collect();
        let many: Vec<GpuProcess> = (1..=12)
            .map(|p| nvml(p, Some(u64::from(p) * GIB + 4 * GIB)))
            .chain([nvml(ME.pid, None)])
            .collect();
        let (others, mine) = with_nvml(recorded(records, &[]), Some(&many), ME, command);
        assert_eq!(mine, None);
        let got: Vec<(u32, bool)> = others.iter().map(|p| (p.pid, p.nvml_only)).collect();
        assert_eq!(
            got,
            [
                (12, true),
                (11, true),
                (10, true),
                (9, false),
                (8, false),
                (7, false),
                (6, false),
                (5, false)
            ]
        );
        assert_eq!(others[3].bytes, 9 * GIB);
    }
}
