//! The fake's settings, read from environment variables once, at the first successful `cuInit`.
//!
//! A value the fake cannot use is reported (one line on stderr each) and replaced by the
//! default: a typo in a test's environment must not abort the process under test.

use cistern::config::parse_size;
use cistern::driver::DriverCall;

/// Must be `1` for `cuInit` to succeed (a guard against a deployment picking the fake up).
pub const ENABLE: &str = "CISTERN_FAKECUDA";
/// Memory per device, a size such as `8GiB` (default 16 GiB).
pub const CAPACITY: &str = "CISTERN_FAKECUDA_CAPACITY";
/// Number of devices, 1 to [`MAX_DEVICES`] (default 1).
pub const DEVICES: &str = "CISTERN_FAKECUDA_DEVICES";
/// `0` disables the VMM calls, `1` enables them (default 1).
pub const VMM: &str = "CISTERN_FAKECUDA_VMM";
/// Fault injection: `cuMemCreate:3,cuMemMap:5+` (see [`Fault`]).
pub const FAIL: &str = "CISTERN_FAKECUDA_FAIL";
/// Allocation granularity, a power-of-two size such as `2MiB` (default 2 MiB).
pub const GRANULARITY: &str = "CISTERN_FAKECUDA_GRANULARITY";
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`: a power-of-two multiple of the minimum granularity
/// (default twice the minimum).
pub const RECOMMENDED_GRANULARITY: &str = "CISTERN_FAKECUDA_RECOMMENDED_GRANULARITY";
/// Memory of each device held by the driver and its primary context, never free for
/// `cuMemCreate` or `cuMemAlloc` (default [`DEFAULT_RESERVE`], at most an eighth of the
/// capacity).
pub const RESERVE: &str = "CISTERN_FAKECUDA_RESERVE";
/// The process's virtual address space available to reservations, all devices together
/// (default [`DEFAULT_VA_LIMIT`]; `getrlimit(RLIMIT_AS)` lowers it further).
pub const VA_LIMIT: &str = "CISTERN_FAKECUDA_VA_LIMIT";
/// `1`: every pair of distinct devices can access each other's memory; `0`: none can
/// (default 1).
pub const PEERS: &str = "CISTERN_FAKECUDA_PEERS";
/// `1`: the devices support fabric handles (`CU_MEM_HANDLE_TYPE_FABRIC`) (default 0).
pub const FABRIC: &str = "CISTERN_FAKECUDA_FABRIC";
/// `1`: the devices support GPUDirect RDMA allocations (`gpuDirectRDMACapable`) (default 0).
pub const RDMA: &str = "CISTERN_FAKECUDA_RDMA";
/// `1`: the devices report POSIX file-descriptor handles (attribute 103) but `cuMemCreate`
/// refuses to make them (`CUDA_ERROR_NOT_PERMITTED`), as some containers do (default 0).
pub const FD_REFUSED: &str = "CISTERN_FAKECUDA_FD_REFUSED";

/// Every knob, for tests that must start from a clean environment.
pub const ALL: [&str; 13] = [
    ENABLE,
    CAPACITY,
    DEVICES,
    VMM,
    FAIL,
    GRANULARITY,
    RECOMMENDED_GRANULARITY,
    RESERVE,
    VA_LIMIT,
    PEERS,
    FABRIC,
    RDMA,
    FD_REFUSED,
];

/// The most devices the fake simulates.
pub const MAX_DEVICES: usize = 16;
/// The default memory per device.
pub const DEFAULT_CAPACITY: u64 = 16 << 30;
/// The default allocation granularity.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;
/// The default driver reserve per device: what a CUDA 12 primary context typically holds on a
/// data-centre GPU (its own allocations, the local-memory and printf heaps, the module images).
pub const DEFAULT_RESERVE: u64 = 512 << 20;
/// The default address-space limit: 64 TiB, half of the 128 TiB (47-bit) user address space of
/// x86-64 Linux, the other half left to the host's own mappings.
pub const DEFAULT_VA_LIMIT: u64 = 64 << 40;

/// One injected failure with an explicit result code, counted by the fake itself over any
/// exported CUDA function: `cuEventQuery:3=700` makes the third `cuEventQuery` return 700
/// (`CUDA_ERROR_ILLEGAL_ADDRESS`, a sticky error: every later call on the context returns it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodedFault {
    /// The exported function, as the library names it (`cuMemAlloc_v2`).
    pub function: &'static str,
    /// Which call fails first (1: the very next).
    pub nth: u64,
    /// Whether every call after it fails too.
    pub and_after: bool,
    /// The `CUresult` returned (a code the fake describes in `cuGetErrorString`).
    pub code: u32,
}

/// One injected fault: the `nth` next call of `call` fails (and, with `and_after`, every later
/// one too). Written `cuName:N` or `cuName:N+`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The simulator call kind that fails.
    pub call: DriverCall,
    /// Which call fails first (1: the very next).
    pub nth: u64,
    /// Whether every call after it fails too.
    pub and_after: bool,
}

/// The settings in effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Knobs {
    /// Memory per device in bytes.
    pub capacity: u64,
    /// Number of devices.
    pub devices: usize,
    /// Whether the VMM calls are supported.
    pub vmm: bool,
    /// Allocation granularity in bytes (a power of two).
    pub granularity: u64,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` in bytes.
    pub recommended_granularity: u64,
    /// The driver's reserve per device in bytes.
    pub reserve: u64,
    /// The address-space limit in bytes, before `RLIMIT_AS`.
    pub va_limit: u64,
    /// Whether distinct devices can access each other's memory.
    pub peers: bool,
    /// Whether fabric handles are supported.
    pub fabric: bool,
    /// Whether GPUDirect RDMA allocations are supported.
    pub rdma: bool,
    /// Whether `cuMemCreate` refuses POSIX file-descriptor handles the device reports.
    pub fd_refused: bool,
    /// Injected faults (the simulator's).
    pub faults: Vec<Fault>,
    /// Injected faults with an explicit code (the fake's).
    pub coded_faults: Vec<CodedFault>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            capacity: DEFAULT_CAPACITY,
            devices: 1,
            vmm: true,
            granularity: DEFAULT_GRANULARITY,
            recommended_granularity: 2 * DEFAULT_GRANULARITY,
            reserve: DEFAULT_RESERVE.min(DEFAULT_CAPACITY / 8),
            va_limit: DEFAULT_VA_LIMIT,
            peers: true,
            fabric: false,
            rdma: false,
            fd_refused: false,
            faults: Vec::new(),
            coded_faults: Vec::new(),
        }
    }
}

impl Knobs {
    /// Reads the knobs through `get` (the environment, in the library). Returns the settings
    /// and one message per value that was not understood (its default is used instead).
    pub fn read(get: impl Fn(&str) -> Option<String>) -> (Knobs, Vec<String>) {
        let mut k = Knobs::default();
        let mut warnings = Vec::new();
        let mut warn = |name: &str, value: &str, why: String, default: &str| {
            warnings.push(format!(
                "cistern-fakecuda: {name}={value:?} is not usable ({why}); using {default}"
            ));
        };
        if let Some(v) = get(CAPACITY) {
            match parse_size(&v) {
                Ok(n) if n > 0 => k.capacity = n,
                Ok(_) => warn(CAPACITY, &v, "it is 0".into(), "16 GiB"),
                Err(e) => warn(CAPACITY, &v, e, "16 GiB"),
            }
        }
        if let Some(v) = get(DEVICES) {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_DEVICES).contains(&n) => k.devices = n,
                _ => warn(
                    DEVICES,
                    &v,
                    format!("expected a number from 1 to {MAX_DEVICES}"),
                    "1 device",
                ),
            }
        }
        if let Some(v) = get(VMM) {
            match v.trim() {
                "0" => k.vmm = false,
                "1" => k.vmm = true,
                _ => warn(VMM, &v, "expected 0 or 1".into(), "1 (VMM supported)"),
            }
        }
        if let Some(v) = get(GRANULARITY) {
            match parse_size(&v) {
                Ok(n) if n.is_power_of_two() => k.granularity = n,
                Ok(n) => warn(
                    GRANULARITY,
                    &v,
                    format!("{n} is not a power of two"),
                    "2 MiB",
                ),
                Err(e) => warn(GRANULARITY, &v, e, "2 MiB"),
            }
        }
        let recommended = get(RECOMMENDED_GRANULARITY);
        k.recommended_granularity = 2 * k.granularity;
        if let Some(v) = recommended {
            match parse_size(&v) {
                Ok(n) if n.is_power_of_two() && n >= k.granularity => k.recommended_granularity = n,
                Ok(n) => warn(
                    RECOMMENDED_GRANULARITY,
                    &v,
                    format!(
                        "{n} is not a power of two at least the granularity {}",
                        k.granularity
                    ),
                    "twice the granularity",
                ),
                Err(e) => warn(RECOMMENDED_GRANULARITY, &v, e, "twice the granularity"),
            }
        }
        k.reserve = DEFAULT_RESERVE.min(k.capacity / 8);
        if let Some(v) = get(RESERVE) {
            match parse_size(&v) {
                Ok(n) if n < k.capacity => k.reserve = n,
                Ok(n) => warn(
                    RESERVE,
                    &v,
                    format!("{n} is not below the capacity {}", k.capacity),
                    "512 MiB, at most an eighth of the capacity",
                ),
                Err(e) => warn(RESERVE, &v, e, "512 MiB, at most an eighth of the capacity"),
            }
        }
        if let Some(v) = get(VA_LIMIT) {
            match parse_size(&v) {
                Ok(n) if n > 0 => k.va_limit = n,
                Ok(_) => warn(VA_LIMIT, &v, "it is 0".into(), "64 TiB"),
                Err(e) => warn(VA_LIMIT, &v, e, "64 TiB"),
            }
        }
        for (name, slot, default) in [
            (PEERS, &mut k.peers, "1"),
            (FABRIC, &mut k.fabric, "0"),
            (RDMA, &mut k.rdma, "0"),
            (FD_REFUSED, &mut k.fd_refused, "0"),
        ] {
            if let Some(v) = get(name) {
                match v.trim() {
                    "0" => *slot = false,
                    "1" => *slot = true,
                    _ => warn(name, &v, "expected 0 or 1".into(), default),
                }
            }
        }
        if let Some(v) = get(FAIL) {
            for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                if let Some((head, code)) = item.split_once('=') {
                    match parse_coded_fault(head, code) {
                        Ok(f) => k.coded_faults.push(f),
                        Err(why) => warnings.push(format!(
                            "cistern-fakecuda: {FAIL}: ignoring {item:?} ({why}); expected \
                             `cuName:N=CODE` (the Nth call returns CODE)"
                        )),
                    }
                    continue;
                }
                match parse_fault(item) {
                    Ok(f) => k.faults.push(f),
                    Err(why) => warnings.push(format!(
                        "cistern-fakecuda: {FAIL}: ignoring {item:?} ({why}); expected \
                         `cuName:N` (fail the Nth call) or `cuName:N+` (and every later one)"
                    )),
                }
            }
        }
        (k, warnings)
    }
}

/// Splits `cuName:N` or `cuName:N+` into the name, N and whether later calls fail too.
fn parse_count(item: &str) -> Result<(&str, u64, bool), String> {
    let (name, n) = item.split_once(':').ok_or("no `:`")?;
    let (n, and_after) = match n.trim().strip_suffix('+') {
        Some(n) => (n, true),
        None => (n.trim(), false),
    };
    let nth = n
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{n:?} is not a call number (1 is the next call)"))?;
    Ok((name.trim(), nth, and_after))
}

/// Parses one `cuName:N=CODE` or `cuName:N+=CODE` item (`head` is before the `=`).
fn parse_coded_fault(head: &str, code: &str) -> Result<CodedFault, String> {
    let (name, nth, and_after) = parse_count(head)?;
    let function = crate::exported_function(name)
        .ok_or_else(|| format!("the fake exports no CUDA function named {name:?}"))?;
    let code = code
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|&c| c != 0 && crate::described(c))
        .ok_or_else(|| format!("{code:?} is not a non-zero CUresult code the fake describes"))?;
    Ok(CodedFault {
        function,
        nth,
        and_after,
        code,
    })
}

/// Parses one `cuName:N` or `cuName:N+` item.
fn parse_fault(item: &str) -> Result<Fault, String> {
    let (name, nth, and_after) = parse_count(item)?;
    let call = call_named(name).ok_or_else(|| {
        let names: Vec<&str> = DriverCall::ALL.iter().map(|c| c.cuda_name()).collect();
        format!(
            "no simulated call is named {name:?}; known: {}",
            names.join(", ")
        )
    })?;
    Ok(Fault {
        call,
        nth,
        and_after,
    })
}

/// The simulator call behind a CUDA function name (`cuMemAlloc` or `cuMemAlloc_v2`).
pub fn call_named(name: &str) -> Option<DriverCall> {
    let base = name.strip_suffix("_v2").unwrap_or(name);
    DriverCall::ALL
        .iter()
        .copied()
        .find(|c| c.cuda_name() == base)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(pairs: &[(&str, &str)]) -> (Knobs, Vec<String>) {
        let env: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Knobs::read(|k| env.get(k).cloned())
    }

    #[test]
    fn defaults_without_any_knob() {
        let (k, w) = read(&[]);
        assert_eq!(k, Knobs::default());
        assert_eq!(k.capacity, 16 << 30);
        assert!(k.vmm);
        assert_eq!(k.devices, 1);
        assert!(w.is_empty());
    }

    #[test]
    fn every_knob_is_read() {
        let (k, w) = read(&[
            (CAPACITY, "8GiB"),
            (DEVICES, "3"),
            (VMM, "0"),
            (GRANULARITY, "64KiB"),
            (FAIL, "cuMemCreate:3, cuMemMap:5+,cuMemAlloc_v2:1"),
        ]);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(k.capacity, 8 << 30);
        assert_eq!(k.devices, 3);
        assert!(!k.vmm);
        assert_eq!(k.granularity, 64 << 10);
        assert_eq!(
            k.faults,
            vec![
                Fault {
                    call: DriverCall::CreatePhysical,
                    nth: 3,
                    and_after: false
                },
                Fault {
                    call: DriverCall::Map,
                    nth: 5,
                    and_after: true
                },
                Fault {
                    call: DriverCall::MemAlloc,
                    nth: 1,
                    and_after: false
                },
            ]
        );
    }

    #[test]
    fn bad_values_warn_and_keep_the_default() {
        let (k, w) = read(&[
            (CAPACITY, "lots"),
            (DEVICES, "0"),
            (VMM, "yes"),
            (GRANULARITY, "3MiB"),
            (
                FAIL,
                "cuMemCreate:x,cuNothing:1,cuMemMap,cuMemUnmap:0,cuMemRelease:2",
            ),
        ]);
        let mut expected = Knobs::default();
        expected.faults.push(Fault {
            call: DriverCall::ReleasePhysical,
            nth: 2,
            and_after: false,
        });
        assert_eq!(k, expected);
        assert_eq!(w.len(), 8, "{w:#?}");
        assert!(
            w[0].contains(CAPACITY) && w[0].contains("16 GiB"),
            "{}",
            w[0]
        );
        assert!(w.iter().any(|m| m.contains("cuNothing")), "{w:#?}");
        assert!(w.iter().all(|m| m.starts_with("cistern-fakecuda: ")));
    }

    #[test]
    fn the_strict_driver_knobs_are_read() {
        let (k, w) = read(&[
            (CAPACITY, "8GiB"),
            (GRANULARITY, "64KiB"),
            (RECOMMENDED_GRANULARITY, "1MiB"),
            (RESERVE, "300MiB"),
            (VA_LIMIT, "2TiB"),
            (PEERS, "0"),
            (FABRIC, "1"),
            (RDMA, "1"),
            (FD_REFUSED, "1"),
            (
                FAIL,
                "cuEventQuery:3=700,cuStreamSynchronize:1+=719,cuMemAlloc:2=2",
            ),
        ]);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(k.recommended_granularity, 1 << 20);
        assert_eq!(k.reserve, 300 << 20);
        assert_eq!(k.va_limit, 2 << 40);
        assert!(!k.peers && k.fabric && k.rdma && k.fd_refused);
        assert!(k.faults.is_empty());
        assert_eq!(
            k.coded_faults,
            vec![
                CodedFault {
                    function: "cuEventQuery",
                    nth: 3,
                    and_after: false,
                    code: 700
                },
                CodedFault {
                    function: "cuStreamSynchronize",
                    nth: 1,
                    and_after: true,
                    code: 719
                },
                CodedFault {
                    function: "cuMemAlloc_v2",
                    nth: 2,
                    and_after: false,
                    code: 2
                },
            ]
        );
    }

    #[test]
    fn strict_driver_defaults_follow_the_other_knobs() {
        let (k, w) = read(&[(CAPACITY, "1GiB"), (GRANULARITY, "4MiB")]);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(k.recommended_granularity, 8 << 20, "twice the minimum");
        assert_eq!(k.reserve, 128 << 20, "at most an eighth of the capacity");
        assert_eq!(k.va_limit, DEFAULT_VA_LIMIT);
        assert!(k.peers && !k.fabric && !k.rdma && !k.fd_refused);
        let (k, _) = read(&[]);
        assert_eq!(k.reserve, DEFAULT_RESERVE);
    }

    #[test]
    fn bad_strict_driver_knobs_warn_and_keep_the_default() {
        let (k, w) = read(&[
            (CAPACITY, "1GiB"),
            (RECOMMENDED_GRANULARITY, "1MiB"),
            (RESERVE, "2GiB"),
            (VA_LIMIT, "0"),
            (PEERS, "yes"),
            (FABRIC, "2"),
            (RDMA, ""),
            (
                FAIL,
                "cuNothing:1=700,cuEventQuery:1=12345,cuEventQuery:1=0,cuEventQuery:x=700",
            ),
        ]);
        assert_eq!(w.len(), 10, "{w:#?}");
        assert_eq!(k.recommended_granularity, 4 << 20);
        assert_eq!(k.reserve, 128 << 20);
        assert_eq!(k.va_limit, DEFAULT_VA_LIMIT);
        assert!(k.peers && !k.fabric && !k.rdma);
        assert!(k.coded_faults.is_empty());
        assert!(w.iter().any(|m| m.contains("cuNothing")), "{w:#?}");
        assert!(w.iter().any(|m| m.contains("12345")), "{w:#?}");
    }

    #[test]
    fn every_simulated_call_can_be_named() {
        for c in DriverCall::ALL {
            assert_eq!(call_named(c.cuda_name()), Some(c));
        }
        assert_eq!(call_named("cuMemFree_v2"), Some(DriverCall::MemFree));
        assert_eq!(
            call_named("cuEventDestroy_v2"),
            Some(DriverCall::EventDestroy)
        );
        assert_eq!(call_named("cuMemGetInfo_v2"), Some(DriverCall::MemInfo));
        assert_eq!(call_named("cuLaunchKernel"), None);
    }
}
