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
//!   2 MiB, 20 MiB and 64 MiB: the table's `per_call_us` is the 2 MiB figure and `per_mib_us`
//!   the slope from 2 to 64 MiB (when positive);
//! * `set_access` over ten 2 MiB mappings in one call against one call per mapping, which says
//!   whether the driver's cost is per call or per mapping (the table prices it per mapping; the
//!   ratio is printed);
//! * `mem_alloc` / `mem_free` at 2, 20 and 64 MiB (per call and per MiB), `reserve_va` /
//!   `free_va` of 64 GiB, `mem_info`, events (create, record, query, synchronize, destroy),
//!   `stream_wait_event`, `device_synchronize` on an idle device, `capabilities`,
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
            let (r, us) = timed(|| d.set_access(dev, va, size));
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

    /// `set_access` over `n` consecutive 2 MiB mappings: one call for all of them, then one
    /// call per mapping (the figures pushed are per call).
    fn access_batch(&mut self, n: u64) -> DriverResult<()> {
        let (d, dev, g) = (self.d.clone(), self.dev, self.g);
        let len = n * g;
        let va = d.reserve_va(dev, len, g)?;
        let mut handles = Vec::new();
        for i in 0..n {
            let h = d.create_physical(dev, g)?;
            d.map(dev, va + i * g, g, h)?;
            handles.push(h);
        }
        let (mut one, mut each) = (Vec::new(), Vec::new());
        for _ in 0..self.reps {
            let (r, us) = timed(|| d.set_access(dev, va, len));
            r?;
            one.push(us);
            let (r, us) = timed(|| (0..n).try_for_each(|i| d.set_access(dev, va + i * g, g)));
            r?;
            each.push(us);
        }
        for (i, h) in handles.into_iter().enumerate() {
            d.unmap(dev, va + i as u64 * g, g)?;
            d.release_physical(dev, h)?;
        }
        d.free_va(dev, va, len)?;
        self.push(DriverCall::SetAccess, len, n, one);
        self.push(
            DriverCall::SetAccess,
            len,
            n,
            each.into_iter().map(|u| u / n as f64).collect(),
        );
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

    fn small_calls(&mut self) -> DriverResult<()> {
        let (d, dev, reps) = (self.d.clone(), self.dev, self.reps);
        let s = StreamId::DEFAULT;
        let mut t = [(); 10].map(|_| Vec::with_capacity(reps));
        let va_len = 64 << 30;
        for _ in 0..reps {
            t[0].push(timed(|| d.mem_info(dev)).1);
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
            let (va, us) = timed(|| d.reserve_va(dev, va_len, self.g));
            let va = va?;
            t[8].push(us);
            let (r, us) = timed(|| d.free_va(dev, va, va_len));
            r?;
            t[9].push(us);
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

    /// The cost table: per call at the smallest size, and a per-MiB slope where the figures
    /// grow with the size.
    fn table(&self) -> CostTable {
        let mut t = CostTable::zero();
        for call in DriverCall::ALL {
            let v = self.by_size(call);
            let Some(&(b0, u0)) = v.first() else { continue };
            let mut cost = CallCost::flat(u0);
            if let (Some(&(b1, u1)), true) = (v.last(), v.len() > 1) {
                let slope = (u1 - u0) / ((b1 - b0) as f64 / MIB as f64);
                // Only sized calls get a per-MiB part, and only when it is clearly there.
                if b1 > b0 && slope > 0.0 && u1 > 1.5 * u0 {
                    let round = |x: f64| (x * 1000.0).round() / 1000.0;
                    cost.per_mib_us = Some(round(slope));
                    cost.per_call_us = round((u0 - slope * b0 as f64 / MIB as f64).max(0.0));
                }
            }
            t = t.with(call, cost);
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
            "set_access over {} mappings: one call {:.1} us, per mapping when called one by one \
             {:.1} us: one call costs {:.2}x one per-mapping call",
            one.mappings,
            one.us,
            each.us,
            one.us / each.us.max(1e-9)
        );
    }
    let mut table = b.table().to_json_value();
    if let Some(m) = table.as_object_mut() {
        m.insert(
            "_comment".into(),
            format!(
                "measured by driver_costs on device {} ({}), median of {} calls per kind; \
                 per_call_us at the smallest size, per_mib_us the slope to 64 MiB where the \
                 cost grows with the size",
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
