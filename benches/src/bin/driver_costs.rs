//! driver_costs: measures the host time of every driver call cistern makes, on the device the
//! `Driver` seam opens, and writes it as a cost table that `cistern replay --costs FILE.json`
//! reads (the format of `replay/costs/a100-published.json`).
//!
//! ```text
//! cargo run --release -p cistern-benches --bin driver_costs -- [--device N] [--reps N]
//!     [--out FILE.json] [--jsonl]
//! ```
//!
//! The driver is `CISTERN_DRIVER` (default: CUDA, never the simulator unless asked, so a missing
//! driver is an error, not a silent measurement of the simulator). Each figure is the median of
//! `--reps` timed calls (default 20) on the device's primary context, measured through the same
//! `CudaDriver` the pool uses, so the context binding it does per call is included.
//!
//! What it measures, per call kind (the table's keys):
//! * `create_physical`, `map`, `set_access`, `unmap`, `release_physical` for one handle of
//!   2 MiB, 20 MiB and 64 MiB: for the kinds the simulator prices by size, a least-squares
//!   line (per call, per MiB) when it fits, else the mean; the others get the mean;
//! * `set_access` over ten fresh 2 MiB mappings in one call against one call per mapping, which
//!   says whether the driver's cost is per call or per mapping; the table takes the
//!   per-mapping figure inside one call (how cistern and PyTorch call it), and the ratio is
//!   printed;
//! * `mem_alloc` / `mem_free` at 2, 20 and 64 MiB (per call and per MiB), `reserve_va` /
//!   `free_va` of 64 GiB, `mem_info`, events (create, record, query, synchronize, destroy),
//!   `stream_wait_event`, `stream_synchronize` and `device_synchronize` on an idle device,
//!   `capabilities`,
//!   `device_count`.
//!
//! A host wait's real price is GPU idle time, which depends on the work queued; the table keeps
//! `host_wait_us` at 0 (the waits are counted apart, see the cost table's docs).
//!
//! With `--jsonl` every measurement is printed as one JSON object per line as well; the table
//! goes to `--out` (default: stdout). Memory used at once: at most about 200 MiB of the device.

use std::sync::Arc;
use std::time::Instant;

use cistern::driver::sim::{CallCost, CostTable};
use cistern::driver::{DeviceId, Driver, DriverCall, DriverResult, StreamId};
use cistern::{open_driver, DriverChoice};

const MIB: u64 = 1 << 20;
const USAGE: &str =
    "usage: driver_costs [--device N] [--reps N] [--out FILE.json] [--jsonl] (driver: CISTERN_DRIVER)";

struct Options {
    device: DeviceId,
    reps: usize,
    out: Option<std::path::PathBuf>,
    jsonl: bool,
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        device: 0,
        reps: 20,
        out: None,
        jsonl: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--device" => {
                o.device = value("--device")?
                    .parse()
                    .map_err(|_| "--device takes a device ordinal (0, 1, ...)".to_string())?
            }
            "--reps" => {
                o.reps = value("--reps")?
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n > 0)
                    .ok_or("--reps takes a positive count")?
            }
            "--out" => o.out = Some(value("--out")?.into()),
            "--jsonl" => o.jsonl = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    Ok(o)
}

/// Median of a set of durations in microseconds.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let m = if v.is_empty() { 0.0 } else { v[v.len() / 2] };
    // Three decimals (nanoseconds) are all a timer gives.
    (m * 1000.0).round() / 1000.0
}

/// Times `f` once, in microseconds.
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64() * 1e6)
}

/// One measurement: a call kind, a size, its median.
struct Sample {
    call: DriverCall,
    bytes: u64,
    mappings: u64,
    us: f64,
}

struct Bench {
    d: Arc<dyn Driver>,
    dev: DeviceId,
    reps: usize,
    g: u64,
    samples: Vec<Sample>,
}

impl Bench {
    fn push(&mut self, call: DriverCall, bytes: u64, mappings: u64, times: Vec<f64>) {
        self.samples.push(Sample {
            call,
            bytes,
            mappings,
            us: median(times),
        });
    }

    /// The VMM cycle for one handle of `size`: create, map, access, unmap, release.
    fn vmm_cycle(&mut self, size: u64) -> DriverResult<()> {
        let (d, dev) = (self.d.clone(), self.dev);
        let va = d.reserve_va(dev, size, self.g)?;
        let mut t = [(); 5].map(|_| Vec::with_capacity(self.reps));
        for _ in 0..self.reps {
            let (h, us) = timed(|| d.create_physical(dev, size));
            let h = h?;
            t[0].push(us);
            let (r, us) = timed(|| d.map(dev, va, size, h));
            r?;
            t[1].push(us);
            let (r, us) = timed(|| d.set_access(dev, va, size, &[]));
            r?;
            t[2].push(us);
            let (r, us) = timed(|| d.unmap(dev, va, size));
            r?;
            t[3].push(us);
            let (r, us) = timed(|| d.release_physical(dev, h));
            r?;
            t[4].push(us);
        }
        d.free_va(dev, va, size)?;
        let [c, m, a, u, r] = t;
        self.push(DriverCall::CreatePhysical, size, 1, c);
        self.push(DriverCall::Map, size, 1, m);
        self.push(DriverCall::SetAccess, size, 1, a);
        self.push(DriverCall::Unmap, size, 1, u);
        self.push(DriverCall::ReleasePhysical, size, 1, r);
        Ok(())
    }

    /// `set_access` over `n` consecutive fresh 2 MiB mappings: one call for all of them, and
    /// one call per mapping, each on mappings made just before (as growth does: access is set
    /// once, on new mappings). The figures pushed are per mapping.
    fn access_batch(&mut self, n: u64) -> DriverResult<()> {
        let (d, dev, g) = (self.d.clone(), self.dev, self.g);
        let len = n * g;
        let va = d.reserve_va(dev, len, g)?;
        let mut handles = Vec::new();
        for _ in 0..n {
            handles.push(d.create_physical(dev, g)?);
        }
        let map_all = || -> DriverResult<()> {
            for (i, &h) in handles.iter().enumerate() {
                d.map(dev, va + i as u64 * g, g, h)?;
            }
            Ok(())
        };
        let unmap_all = || -> DriverResult<()> {
            for i in 0..n {
                d.unmap(dev, va + i * g, g)?;
            }
            Ok(())
        };
        let (mut one, mut each) = (Vec::new(), Vec::new());
        for rep in 0..self.reps {
            // Alternate which goes first, so that neither always runs on a warmer driver.
            for batched in [rep % 2 == 0, rep % 2 != 0] {
                map_all()?;
                if batched {
                    let (r, us) = timed(|| d.set_access(dev, va, len, &[]));
                    r?;
                    one.push(us / n as f64);
                } else {
                    let (r, us) =
                        timed(|| (0..n).try_for_each(|i| d.set_access(dev, va + i * g, g, &[])));
                    r?;
                    each.push(us / n as f64);
                }
                unmap_all()?;
            }
        }
        for h in handles {
            d.release_physical(dev, h)?;
        }
        d.free_va(dev, va, len)?;
        self.push(DriverCall::SetAccess, len, n, one);
        self.push(DriverCall::SetAccess, len, n, each);
        Ok(())
    }

    fn linear(&mut self, size: u64) -> DriverResult<()> {
        let (d, dev) = (self.d.clone(), self.dev);
        let (mut a, mut f) = (Vec::new(), Vec::new());
        for _ in 0..self.reps {
            let (p, us) = timed(|| d.mem_alloc(dev, size));
            let p = p?;
            a.push(us);
            let (r, us) = timed(|| d.mem_free(dev, p));
            r?;
            f.push(us);
        }
        self.push(DriverCall::MemAlloc, size, 1, a);
        self.push(DriverCall::MemFree, size, 1, f);
        Ok(())
    }

    /// Sharing, once per handle: export as a file descriptor, import it back (this process
    /// stands in for the receiver), and the IPC handle of a `cuMemAlloc` allocation. Opening an
    /// IPC handle needs a second process: `ipc_open` and `ipc_close` keep their estimates.
    fn sharing(&mut self, posix_fd: bool) -> DriverResult<()> {
        let (d, dev, size) = (self.d.clone(), self.dev, self.g);
        let mut t = [(); 3].map(|_| Vec::with_capacity(self.reps));
        let lin = d.mem_alloc(dev, size)?;
        for _ in 0..self.reps {
            if posix_fd {
                let h = d.create_physical(dev, size)?;
                let (fd, us) = timed(|| d.export_handle(dev, h));
                let fd = fd?;
                t[0].push(us);
                let (h2, us) = timed(|| d.import_handle(dev, std::os::fd::AsFd::as_fd(&fd)));
                let h2 = h2?;
                t[1].push(us);
                d.release_physical(dev, h2)?;
                d.release_physical(dev, h)?;
            }
            let (r, us) = timed(|| d.ipc_get_handle(dev, lin));
            r?;
            t[2].push(us);
        }
        d.mem_free(dev, lin)?;
        let [e, i, g] = t;
        if posix_fd {
            self.push(DriverCall::ExportHandle, size, 1, e);
            self.push(DriverCall::ImportHandle, size, 1, i);
        }
        self.push(DriverCall::IpcGetHandle, 0, 1, g);
        Ok(())
    }

    fn small_calls(&mut self) -> DriverResult<()> {
        let (d, dev, reps) = (self.d.clone(), self.dev, self.reps);
        let s = StreamId::DEFAULT;
        let mut t = [(); 11].map(|_| Vec::with_capacity(reps));
        let va_len = 64 << 30;
        for _ in 0..reps {
            let (r, us) = timed(|| d.mem_info(dev));
            r?;
            t[0].push(us);
            let (ev, us) = timed(|| d.event_create(dev));
            let ev = ev?;
            t[1].push(us);
            let (r, us) = timed(|| d.event_record(dev, ev, s));
            r?;
            t[2].push(us);
            let (r, us) = timed(|| d.event_query(dev, ev));
            r?;
            t[3].push(us);
            let (r, us) = timed(|| d.event_synchronize(dev, ev));
            r?;
            t[4].push(us);
            let (r, us) = timed(|| d.stream_wait_event(dev, s, ev));
            r?;
            t[5].push(us);
            let (r, us) = timed(|| d.event_destroy(dev, ev));
            r?;
            t[6].push(us);
            let (r, us) = timed(|| d.device_synchronize(dev));
            r?;
            t[7].push(us);
            let (r, us) = timed(|| d.stream_synchronize(dev, s));
            r?;
            t[10].push(us);
            // A 64 GiB reservation may be refused (small address space, MIG): then those two
            // kinds keep no figure rather than losing every measurement.
            let (va, us) = timed(|| d.reserve_va(dev, va_len, self.g));
            if let Ok(va) = va {
                t[8].push(us);
                let (r, us) = timed(|| d.free_va(dev, va, va_len));
                r?;
                t[9].push(us);
            }
        }
        let calls = [
            DriverCall::MemInfo,
            DriverCall::EventCreate,
            DriverCall::EventRecord,
            DriverCall::EventQuery,
            DriverCall::EventSynchronize,
            DriverCall::StreamWaitEvent,
            DriverCall::EventDestroy,
            DriverCall::DeviceSynchronize,
            DriverCall::ReserveVa,
            DriverCall::FreeVa,
            DriverCall::StreamSynchronize,
        ];
        for (call, times) in calls.into_iter().zip(t) {
            let bytes = if matches!(call, DriverCall::ReserveVa | DriverCall::FreeVa) {
                va_len
            } else {
                0
            };
            self.push(call, bytes, 1, times);
        }
        let mut caps = Vec::new();
        let mut count = Vec::new();
        for _ in 0..reps {
            let (r, us) = timed(|| d.capabilities(dev));
            r?;
            caps.push(us);
            let (r, us) = timed(|| d.device_count());
            r?;
            count.push(us);
        }
        self.push(DriverCall::Capabilities, 0, 1, caps);
        self.push(DriverCall::DeviceCount, 0, 1, count);
        Ok(())
    }

    /// The samples of `call` with one mapping, by size.
    fn by_size(&self, call: DriverCall) -> Vec<(u64, f64)> {
        let mut v: Vec<_> = self
            .samples
            .iter()
            .filter(|s| s.call == call && s.mappings == 1)
            .map(|s| (s.bytes, s.us))
            .collect();
        v.sort_by_key(|s| s.0);
        v
    }

    /// The cost table. Kinds the simulator prices by size (`SIZED`) get a least-squares line
    /// over the sizes measured (intercept per call, slope per MiB) when the slope is positive
    /// and the line fits every point within 25%; otherwise, and for the other kinds, the mean
    /// of their figures. `set_access` is priced per mapping inside one call over many
    /// mappings, as both cistern and PyTorch's expandable segments call it.
    fn table(&self) -> CostTable {
        const SIZED: [DriverCall; 5] = [
            DriverCall::CreatePhysical,
            DriverCall::Map,
            DriverCall::Unmap,
            DriverCall::MemAlloc,
            DriverCall::SetAccess,
        ];
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        let mut t = CostTable::zero();
        for call in DriverCall::ALL {
            let v = self.by_size(call);
            if v.is_empty() {
                // Not measurable here (opening an IPC handle needs a second process; export
                // and import need exportable handles): the estimate stays, as the note says.
                t = t.with(call, CostTable::default().get(call));
                continue;
            }
            let n = v.len() as f64;
            let mean = v.iter().map(|p| p.1).sum::<f64>() / n;
            let mut cost = CallCost::flat(round(mean));
            if SIZED.contains(&call) && v.len() > 1 {
                let xs: Vec<f64> = v.iter().map(|p| p.0 as f64 / MIB as f64).collect();
                let mx = xs.iter().sum::<f64>() / n;
                let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
                let sxy: f64 = xs
                    .iter()
                    .zip(&v)
                    .map(|(x, p)| (x - mx) * (p.1 - mean))
                    .sum();
                if sxx > 0.0 {
                    let slope = sxy / sxx;
                    let icpt = (mean - slope * mx).max(0.0);
                    let fits = xs
                        .iter()
                        .zip(&v)
                        .all(|(x, p)| (icpt + slope * x - p.1).abs() <= 0.25 * p.1.max(1e-3));
                    if slope > 0.0 && fits && slope * xs[xs.len() - 1] > 0.1 * icpt {
                        cost = CallCost {
                            per_call_us: round(icpt),
                            per_mib_us: Some(round(slope)),
                        };
                    }
                }
            }
            t = t.with(call, cost);
        }
        if let Some(batched) = self
            .samples
            .iter()
            .find(|s| s.call == DriverCall::SetAccess && s.mappings > 1)
        {
            t = t.with(DriverCall::SetAccess, CallCost::flat(batched.us));
        }
        t
    }
}

fn run(o: &Options) -> Result<(), String> {
    let choice = cistern::open::choice_from_env().map_err(|e| e.to_string())?;
    let choice = if choice == DriverChoice::Auto {
        DriverChoice::Cuda
    } else {
        choice
    };
    let (d, _) = open_driver(choice, false).map_err(|e| {
        format!(
            "{e}\n(driver_costs measures a real driver; CISTERN_DRIVER=sim measures the simulator)"
        )
    })?;
    let caps = d.capabilities(o.device).map_err(|e| e.to_string())?;
    if !caps.vmm {
        return Err(format!(
            "device {} ({}) has no VMM support: the VMM calls cannot be measured",
            o.device, caps.name
        ));
    }
    let mut b = Bench {
        d,
        dev: o.device,
        reps: o.reps,
        g: caps.granularity,
        samples: Vec::new(),
    };
    fn err(what: &'static str) -> impl Fn(cistern::driver::DriverError) -> String {
        move |e| format!("{what}: {e}")
    }
    for size in [2 * MIB, 20 * MIB, 64 * MIB] {
        let size = size.div_ceil(b.g) * b.g;
        b.vmm_cycle(size).map_err(err("VMM cycle"))?;
        b.linear(size).map_err(err("cuMemAlloc/cuMemFree"))?;
    }
    b.access_batch(10)
        .map_err(err("cuMemSetAccess over ten mappings"))?;
    b.small_calls().map_err(err("events and small calls"))?;
    b.sharing(caps.posix_fd_handles)
        .map_err(err("export, import and IPC handles"))?;
    eprintln!(
        "driver_costs: ipc_open and ipc_close keep their estimates (they need a second process){}",
        if caps.posix_fd_handles {
            ""
        } else {
            "; so do export_handle and import_handle (the device has no POSIX fd handles)"
        }
    );

    if o.jsonl {
        for s in &b.samples {
            println!(
                "{}",
                serde_json::json!({
                    "call": s.call.key(), "bytes": s.bytes, "mappings": s.mappings,
                    "median_us": s.us, "reps": o.reps,
                })
            );
        }
    }
    let batch: Vec<_> = b
        .samples
        .iter()
        .filter(|s| s.call == DriverCall::SetAccess && s.mappings > 1)
        .collect();
    if let [one, each] = batch.as_slice() {
        eprintln!(
            "set_access over {} fresh mappings: {:.2} us per mapping in one call, {:.2} us per \
             call one mapping at a time (one call over them costs {:.2}x one single call; 1.0 \
             would mean the driver prices per call, {} per mapping)",
            one.mappings,
            one.us,
            each.us,
            one.us * one.mappings as f64 / each.us.max(1e-9),
            one.mappings
        );
    }
    let mut table = b.table().to_json_value();
    if let Some(m) = table.as_object_mut() {
        m.insert(
            "_comment".into(),
            format!(
                "measured by driver_costs on device {} ({}), median of {} calls per kind \
                 and size; sized kinds fitted per call + per MiB where a line fits, others \
                 the mean over sizes; capabilities and device_count are cache reads in \
                 CudaDriver",
                o.device, caps.name, o.reps
            )
            .into(),
        );
    }
    let text = serde_json::to_string_pretty(&table).map_err(|e| e.to_string())? + "\n";
    match &o.out {
        Some(p) => std::fs::write(p, text).map_err(|e| format!("{}: {e}", p.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&o) {
        eprintln!("driver_costs: {e}");
        std::process::exit(1);
    }
}
