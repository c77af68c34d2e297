//! A tour of cistern at work: a training-like loop on two streams, a trace replayed (the
//! built-in GPT-medium training workload, or the PyTorch snapshot given as the argument), and an
//! out-of-memory report.
//!
//! Runs on the GPU when a CUDA driver is present, otherwise on the simulated GPU (and says so).
//! `CISTERN_DRIVER=sim` forces the simulator; `CISTERN_CONF` configures the pool.
//!
//! ```text
//! cargo run --release -p cistern --example tour
//! cargo run --release -p cistern --example tour -- snapshot.pickle   # a PyTorch snapshot
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cistern::driver::Driver;
use cistern::open::{choice_from_env, open_driver};
use cistern::{format_bytes, Config, Pool, StreamId};

const MIB: u64 = 1 << 20;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (driver, fell_back) = open_driver(choice_from_env()?, true)?;
    if fell_back {
        println!("No CUDA driver found: running on the simulated GPU (CISTERN_DRIVER=sim).\n");
    }
    let config = Config::from_env()?;
    let pool = Pool::new(driver.clone(), config)?;
    let dev = pool.device(0)?.clone();
    println!(
        "device 0: {} ({} driver), {} of memory, {}, page size {}\n",
        dev.caps().name,
        driver.name(),
        format_bytes(dev.caps().total_memory),
        if dev.uses_vmm() {
            "virtual memory management"
        } else {
            "cuMemAlloc segments"
        },
        format_bytes(dev.caps().granularity)
    );

    training_loop(&pool)?;
    replay_trace(&driver)?;
    out_of_memory(&pool);

    println!("\n== final state ==\n{}", pool.report());
    pool.check_invariants()?;
    Ok(())
}

/// Five steps of a model's forward and backward pass on a compute stream, with gradients handed
/// to a communication stream (record_stream), the way data-parallel training uses memory.
fn training_loop(pool: &Pool<Arc<dyn Driver>>) -> Result<(), Box<dyn std::error::Error>> {
    println!("== a training loop: 5 steps, 12 layers, 2 streams ==");
    let dev = pool.device(0)?;
    let compute = StreamId(0x10);
    let comm = StreamId(0x20);
    let weights: Vec<_> = (0..12)
        .map(|i| dev.try_alloc((24 + i) * MIB, compute))
        .collect::<Result<_, _>>()?;
    for step in 0..5 {
        let before = dev.stats();
        let t = Instant::now();
        // Forward: activations grow with the sequence length, which varies per step.
        let seq = [512u64, 384, 512, 448, 512][step];
        let mut acts = Vec::new();
        for layer in 0..12u64 {
            acts.push(dev.try_alloc(seq * 3 * 1024 * (4 + layer % 3), compute)?);
            acts.push(dev.try_alloc(seq * 1024 * 16, compute)?);
            acts.push(dev.try_alloc(4096 + layer * 512, compute)?);
        }
        // Backward: gradients, reduced on the communication stream; activations freed in
        // reverse order.
        let mut grads = Vec::new();
        while let Some(a) = acts.pop() {
            drop(a);
            if acts.len() % 3 == 0 {
                let g = dev.try_alloc((24 + grads.len() as u64) * MIB, compute)?;
                g.record_stream(comm)?;
                grads.push(g);
            }
        }
        drop(grads);
        let after = dev.stats();
        println!(
            "  step {step}: {:>6.0} us, {:>3} allocations, reserved {:>9}, live {:>9}, new pages \
             from the driver: {}",
            t.elapsed().as_secs_f64() * 1e6,
            after.get("allocation.all.allocated") - before.get("allocation.all.allocated"),
            format_bytes(after.get("reserved_bytes.all.current") as u64),
            format_bytes(after.get("allocated_bytes.all.current") as u64),
            after.get("num_device_alloc") - before.get("num_device_alloc"),
        );
    }
    drop(weights);
    let s = dev.stats();
    println!(
        "  peak live {} / peak reserved {}; {} pages stitched, {} frees waited on the \
         communication stream",
        format_bytes(s.get("allocated_bytes.all.peak") as u64),
        format_bytes(s.get("reserved_bytes.all.peak") as u64),
        s.get("num_stitched_pages"),
        s.get("num_pending_frees"),
    );
    Ok(())
}

/// Replays a trace on a fresh pool: the snapshot given as the first argument (compared with
/// what PyTorch reserved), else the built-in training workload (two steps).
fn replay_trace(driver: &Arc<dyn Driver>) -> Result<(), Box<dyn std::error::Error>> {
    use cistern_trace::sequence::Op;
    use cistern_trace::snapshot::Snapshot;
    let (name, seq, recorded) = match std::env::args_os().nth(1).map(PathBuf::from) {
        Some(path) => {
            println!("\n== replaying a PyTorch snapshot ==");
            let snap = Snapshot::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            (
                name,
                snap.alloc_free_sequence(0),
                Some(snap.reserved_curve(0).peak()),
            )
        }
        None => {
            println!("\n== replaying a trace (give a PyTorch snapshot as the argument to replay yours) ==");
            let t = cistern_trace::workloads::generate("training:iters=2", 1)?;
            (t.name, t.sequence, None)
        }
    };
    // A fresh pool on the same driver: the trace's memory must fit next to the tour's.
    let pool = Pool::new(driver.clone(), Config::default())?;
    let dev = pool.device(0)?;
    if seq.peak_live_requested > dev.caps().total_memory / 2 {
        println!("  skipped: the trace needs more memory than this device offers");
        return Ok(());
    }
    let mut live = std::collections::HashMap::new();
    let t = Instant::now();
    for op in &seq.ops {
        match *op {
            Op::Alloc { id, size, stream } => {
                live.insert(id, dev.try_alloc(size, StreamId(stream))?);
            }
            Op::Free { id } => {
                live.remove(&id);
            }
        }
    }
    let el = t.elapsed();
    let s = dev.stats();
    let peak_reserved = s.get("reserved_bytes.all.peak") as u64;
    println!(
        "  {name}: {} operations in {:.1} ms",
        seq.ops.len(),
        el.as_secs_f64() * 1e3
    );
    let live_peak = seq.peak_live_requested.max(1) as f64;
    println!(
        "  peak live (requested) {:>10}\n  cistern peak reserved  {:>10}  ({:.3}x live)",
        format_bytes(seq.peak_live_requested),
        format_bytes(peak_reserved),
        peak_reserved as f64 / live_peak,
    );
    if let Some(recorded) = recorded {
        println!(
            "  PyTorch peak reserved  {:>10}  ({:.3}x live, recorded)",
            format_bytes(recorded),
            recorded as f64 / live_peak,
        );
    }
    drop(live);
    Ok(())
}

/// Asks for more than the device has: the error carries a report of who holds what.
fn out_of_memory(pool: &Pool<Arc<dyn Driver>>) {
    println!("\n== an impossible request ==");
    let total = pool
        .device(0)
        .map(|d| d.caps().total_memory)
        .unwrap_or(u64::MAX / 4);
    let hold = pool.try_alloc(0, total / 3, StreamId(0x10));
    match pool.try_alloc(0, total, StreamId(0x10)) {
        Ok(_) => println!("  unexpectedly succeeded"),
        Err(e) => println!("  {e}"),
    }
    drop(hold);
}
