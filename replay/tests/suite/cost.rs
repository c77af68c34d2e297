//! What the models' driver calls cost: the committed sample cost file is the default table,
//! modelled time and host waits reach the results, the PyTorch models make the calls the real
//! allocator makes (cudaFree's device synchronisation, expandable segments' 20 MiB and 2 MiB
//! handles, access per mapping, a stream synchronisation before unmapping), and
//! `steady_driver_calls` counts what happens after the peak.

use cistern::driver::DriverCall;
use cistern_replay::{
    evaluate, run, run_with, AllocatorModel, CallCost, CostTable, EvalOptions, PytorchConfig,
    PytorchModel,
};
use cistern_trace::{AllocSequence, Op};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn a(id: u64, size: u64) -> Op {
    Op::Alloc {
        id,
        size,
        stream: 0,
    }
}

fn expandable(capacity: u64) -> PytorchModel {
    PytorchModel::new(
        "pytorch-expandable",
        PytorchConfig {
            expandable_segments: true,
            ..PytorchConfig::default()
        },
        capacity,
    )
}

#[test]
fn sample_cost_file_is_the_default_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/costs/a100-published.json");
    let t = CostTable::from_json_file(path).unwrap();
    assert_eq!(
        t,
        CostTable::default(),
        "{path} drifted from CostTable::default()"
    );
}

/// The table measured on an H200 (`scripts/gpu-check.sh`, step `driver_costs`) loads, and
/// says what the published A100 one does not: a handle is cheap there.
#[test]
fn measured_h200_cost_file_loads() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/costs/h200-measured.json");
    let t = CostTable::from_json_file(path).unwrap();
    let create = t.get(DriverCall::CreatePhysical).per_call_us;
    assert!(create > 0.0 && create < 50.0, "{create}");
    assert!(t.get(DriverCall::SetAccess).per_call_us > 0.0);
    assert_ne!(t, CostTable::default());
}

#[test]
fn expandable_grows_by_20_mib_large_and_2_mib_small_handles() {
    let mut m = expandable(GIB);
    m.alloc(0, 30 * MIB, 0).unwrap(); // two 20 MiB handles
    let sim = m.driver();
    assert_eq!(sim.calls(DriverCall::CreatePhysical), 2);
    assert_eq!((sim.live_handles(0), sim.committed_bytes(0)), (2, 40 * MIB));
    // Both mapped, then access set once over the new range, priced per mapping (two).
    assert_eq!(sim.calls(DriverCall::Map), 2);
    assert_eq!(sim.calls(DriverCall::SetAccess), 1);
    let per_mapping = CostTable::default().get(DriverCall::SetAccess).per_call_us;
    assert!((sim.modelled_time_us_of(DriverCall::SetAccess) - 2.0 * per_mapping).abs() < 1e-9);
    m.alloc(1, 1000, 0).unwrap(); // the small pool: one 2 MiB handle
    let sim = m.driver();
    assert_eq!((sim.live_handles(0), sim.committed_bytes(0)), (3, 42 * MIB));
    assert_eq!(m.cost().host_waits, 0, "growth never waits");
    assert_eq!(m.cost().pages_moved, 0);
}

#[test]
fn expandable_synchronises_the_stream_before_each_unmap() {
    let mut m = expandable(60 * MIB);
    m.alloc(0, 50 * MIB, 0).unwrap(); // three 20 MiB pages: the whole device
    m.free(0);
    m.alloc(1, 30 * MIB, 1).unwrap(); // the OOM retry unmaps stream 0's free pages
    let sim = m.driver();
    assert_eq!(sim.calls(DriverCall::Unmap), 3);
    // One unmapHandles range, one cudaStreamSynchronize, and no event.
    assert_eq!(sim.calls(DriverCall::StreamSynchronize), 1);
    assert_eq!(sim.calls(DriverCall::EventRecord), 0);
    assert_eq!(sim.calls(DriverCall::EventSynchronize), 0);
    assert_eq!(m.cost().host_waits, 1);
    assert_eq!(m.counters().num_device_free, 1);
}

#[test]
fn pytorch_pays_cuda_free_and_its_device_synchronisation_on_the_oom_retry() {
    let s =
        AllocSequence::new(vec![a(0, 40 * MIB), Op::Free { id: 0 }, a(1, 50 * MIB)], 0).unwrap();
    let r = run(&s, "pytorch", 64 * MIB).unwrap();
    assert!(r.oom.is_none());
    assert_eq!(r.driver_calls.get("mem_free"), Some(&1));
    assert_eq!(r.host_waits, 1);
    let t = CostTable::default();
    let alloc = |mib: f64| {
        let c = t.get(DriverCall::MemAlloc);
        c.per_call_us + c.per_mib_us.unwrap() * mib
    };
    // The failed cudaMalloc before the retry is priced too.
    assert_eq!(r.driver_calls.get("mem_alloc"), Some(&3));
    let expected = alloc(40.0) + 2.0 * alloc(50.0) + t.get(DriverCall::MemFree).per_call_us;
    assert!(
        (r.driver_time_us - expected).abs() < 1e-6,
        "{}",
        r.driver_time_us
    );
    // A measured table replaces the default.
    let zero = CostTable::zero().with(DriverCall::MemFree, CallCost::flat(1000.0));
    let r = run_with(&s, "pytorch", 64 * MIB, &zero).unwrap();
    assert!((r.driver_time_us - 1000.0).abs() < 1e-9);
    let opts = EvalOptions {
        capacity: 64 * MIB,
        min_capacity: false,
        costs: zero,
    };
    let rows = evaluate(&s, &["pytorch", "ideal"], opts).unwrap();
    assert!((rows[0].driver_time_us - 1000.0).abs() < 1e-9);
    assert_eq!((rows[1].driver_time_us, rows[1].host_waits), (0.0, 0));
}

#[test]
fn cudamalloc_waits_at_every_free() {
    let s = AllocSequence::new(
        vec![a(0, MIB), Op::Free { id: 0 }, a(1, MIB), Op::Free { id: 1 }],
        0,
    )
    .unwrap();
    let r = run(&s, "cudamalloc", GIB).unwrap();
    assert_eq!(r.host_waits, 2);
    // The peak is first reached at op 0: the free, alloc and free after it are steady churn.
    assert_eq!(r.steady_driver_calls, 3);
}

#[test]
fn steady_calls_are_the_calls_after_the_peak() {
    // Warm-up grows to 24 MiB; then the same 12 MiB pair repeats: PyTorch's cache serves it.
    let mut ops = vec![
        a(0, 12 * MIB),
        a(1, 12 * MIB),
        Op::Free { id: 0 },
        Op::Free { id: 1 },
    ];
    for i in 1..10u64 {
        ops.extend([
            a(2 * i, 12 * MIB),
            a(2 * i + 1, 12 * MIB),
            Op::Free { id: 2 * i },
            Op::Free { id: 2 * i + 1 },
        ]);
    }
    let s = AllocSequence::new(ops, 0).unwrap();
    for name in ["pytorch", "pytorch-expandable", "cistern"] {
        let r = run(&s, name, GIB).unwrap();
        assert_eq!(r.steady_driver_calls, 0, "{name}: {:?}", r.driver_calls);
        assert!(r.driver_time_us > 0.0, "{name}");
    }
    let r = run(&s, "cudamalloc", GIB).unwrap();
    assert!(r.steady_driver_calls > 0);
}

#[test]
fn pytorch_stops_calling_the_driver_once_training_is_warm() {
    for name in ["training:iters=5,seq=512", "training"] {
        let t = cistern_trace::workloads::generate(name, 42).unwrap();
        let r = run(&t.sequence, "pytorch", 16 * GIB).unwrap();
        assert!(r.oom.is_none(), "{name}");
        assert!(
            r.driver_calls.get("mem_alloc").copied().unwrap_or(0) > 0,
            "{name}"
        );
        assert_eq!(r.steady_driver_calls, 0, "{name}: PyTorch's cache is warm");
        assert_eq!(
            r.host_waits, 0,
            "{name}: nothing is freed without memory pressure"
        );
    }
    // With a fixed length the steps repeat exactly: more steps make no more calls.
    let calls = |iters: usize| {
        let t = cistern_trace::workloads::generate(&format!("training:iters={iters},seq=512"), 42)
            .unwrap();
        let r = run(&t.sequence, "pytorch", 16 * GIB).unwrap();
        r.driver_calls.values().sum::<u64>()
    };
    assert_eq!(calls(3), calls(6));
}

/// Memory first where memory is short: on built-in workloads of each kind (a training loop,
/// two servers, random sizes, a static packing), cistern runs on the smallest device the
/// `pytorch` model runs on, and on one a quarter larger, without running out; and on a roomy
/// device the repeating training loop makes no driver call once warm. (Host waits are not
/// checked here: the replay launches no GPU work, so no stream is ever busy; the pool's
/// stitching tests check that a busy donor costs no wait while memory lasts.)
#[test]
fn cistern_runs_wherever_pytorch_does() {
    for name in [
        "training",
        "llm-serving",
        "llm-serving-mooncake",
        "rmm-random",
        "packed-C",
    ] {
        let t = cistern_trace::workloads::generate(name, 42).unwrap();
        let least = cistern_replay::engine::min_capacity(&t.sequence, "pytorch").unwrap();
        for cap in [least, least / 4 * 5] {
            let cap = cap.div_ceil(2 * MIB) * 2 * MIB;
            let r = run(&t.sequence, "cistern", cap).unwrap();
            assert!(r.oom.is_none(), "{name} on {cap} B: {:?}", r.oom);
        }
    }
    let t = cistern_trace::workloads::generate("training", 42).unwrap();
    let r = run(&t.sequence, "cistern", 80 * GIB).unwrap();
    assert_eq!(r.steady_driver_calls, 0, "{:?}", r.driver_calls);
}

/// On a GPU that runs behind the host (`@lag=N`), pages freed moments ago are still busy:
/// cistern must move them with the order kept on the device, leave them (and buy more memory)
/// or wait for them, and never unmap or hand out a page under pending work (the simulator's
/// hazard check, reported as `hazards`). The default (`stream_sync:device`) moves them without
/// a wait and reserves no more than when nothing is busy; `pressure` leaves them while memory
/// lasts; `always` waits for them, again and again (the GPU falls behind again after each
/// wait). With no lag nothing is ever busy.
#[test]
fn a_gpu_running_behind_makes_cistern_meet_busy_pages() {
    use cistern_replay::simple::CisternModel;
    let t = cistern_trace::workloads::generate("packed-A", 42).unwrap();
    let seq = &t.sequence;
    let replay = |spec: &str| {
        let r = run(seq, spec, 8 * GIB).unwrap();
        assert!(r.oom.is_none(), "{spec}: {:?}", r.oom);
        assert_eq!(r.hazards, 0, "{spec}");
        assert_eq!(r.allocator, spec);
        r
    };
    let (eager, behind) = (replay("cistern"), replay("cistern@lag=2"));
    assert_eq!((eager.host_waits, behind.host_waits), (0, 0));
    assert!(
        behind.peak_reserved <= eager.peak_reserved,
        "busy pages were left: {} > {}",
        behind.peak_reserved,
        eager.peak_reserved
    );
    let left = replay("cistern:stream_sync:pressure@lag=2");
    assert_eq!(left.host_waits, 0);
    assert!(
        left.peak_reserved > eager.peak_reserved,
        "busy pages were moved: {} <= {}",
        left.peak_reserved,
        eager.peak_reserved
    );
    assert_eq!(replay("cistern:stream_sync:always").host_waits, 0);
    let waits = replay("cistern:stream_sync:always@lag=2").host_waits;
    assert!(waits > 1, "{waits} waits: the GPU stopped running behind");
    // The lag holds to the end, waits or not: two kernels still in flight.
    let config = cistern::Config::parse("stream_sync:always").unwrap();
    let mut m = CisternModel::new("cistern", config, 8 * GIB, &CostTable::default())
        .unwrap()
        .with_gpu_lag(2);
    let r = cistern_replay::engine::replay(seq, &mut m);
    assert!(r.oom.is_none() && r.host_waits > 1);
    assert_eq!(m.in_flight(0), 2);
    assert!(m.hazards().is_empty());
    // The PyTorch models have no GPU work to lag; the lag is a number and ends the spec.
    for bad in [
        "pytorch@lag=2",
        "cistern@lag=two",
        "cistern@lag=+2",
        "cistern@lag=2,stream_sync:always",
        "cistern@lag=2@lag=3",
    ] {
        let e = cistern_replay::make(bad, GIB).err().unwrap();
        assert!(e.contains("@lag="), "{bad}: {e}");
    }
}
