//! The C ABI's entry points with arbitrary arguments, in-process on the simulated GPU: sizes up
//! to 2^64, any device index, any stream handle, pointers it never handed out, interior and
//! already-freed pointers, any tag bytes, any buffer size for the JSON exports, any memory
//! fraction (NaN included). No call may panic (the guard would turn it into `num_abi_panics`),
//! abort, or corrupt the pool: the allocation gauges must match the blocks the program holds,
//! live blocks never overlap, and the JSON exports stay valid JSON.
#![no_main]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Once;

use arbitrary::{Result, Unstructured};
use cistern_capi::*;
use libfuzzer_sys::fuzz_target;

const MIB: u64 = 1 << 20;
const DEVICES: i32 = 2;

static SETUP: Once = Once::new();

fn setup() {
    SETUP.call_once(|| {
        // Before the first call creates the global pool.
        std::env::set_var("CISTERN_DRIVER", "sim");
        std::env::set_var("CISTERN_SIM", format!("capacity:1GiB,devices:{DEVICES}"));
        std::env::set_var("CISTERN_CONF", "registry:off,provenance:tags");
        cistern_log_errors(0);
    });
}

fn stats(device: i32) -> serde_json::Value {
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` has `buf.len()` writable bytes.
    let n = unsafe { cistern_stats_json(device, buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n < buf.len(), "stats larger than 64 KiB");
    serde_json::from_slice(&buf[..n]).expect("cistern_stats_json writes JSON")
}

fn stat(v: &serde_json::Value, key: &str) -> i64 {
    v[key].as_i64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

fn stream(u: &mut Unstructured) -> Result<*mut c_void> {
    Ok(match u.int_in_range(0u8..=3)? {
        0 => std::ptr::null_mut(),
        1 => 2 as *mut c_void, // the per-thread default stream
        2 => (0x100 + u.int_in_range(0u64..=3)? as usize) as *mut c_void,
        _ => u.arbitrary::<usize>()? as *mut c_void,
    })
}

fn size(u: &mut Unstructured) -> Result<usize> {
    Ok(match u.int_in_range(0u8..=3)? {
        0 => u.int_in_range(0..=4096)?,
        1 => u.int_in_range(0..=(64 * MIB) as usize)?,
        2 => 1usize << u.int_in_range(0..=63)?,
        _ => u.arbitrary()?,
    })
}

fuzz_target!(|data: &[u8]| {
    setup();
    let mut u = Unstructured::new(data);
    // ptr -> (size, device): what this program holds.
    let mut live: BTreeMap<usize, (usize, i32)> = BTreeMap::new();
    let before: Vec<(i64, i64)> = (0..DEVICES)
        .map(|d| {
            let s = stats(d);
            (
                stat(&s, "allocation.all.current"),
                stat(&s, "num_abi_panics"),
            )
        })
        .collect();
    let mut steps = 0;
    while steps < 100 && !u.is_empty() {
        steps += 1;
        let Ok(which) = u.int_in_range(0u8..=13) else {
            break;
        };
        let r: Result<()> = (|| {
            match which {
                0..=3 => {
                    let (n, dev, s) = (
                        size(&mut u)?,
                        u.int_in_range(-1..=DEVICES)?,
                        stream(&mut u)?,
                    );
                    let p = cistern_malloc(n, dev, s);
                    if !p.is_null() {
                        assert!(
                            n > 0 && (0..DEVICES).contains(&dev),
                            "{n} bytes on device {dev}"
                        );
                        assert_eq!(p as usize % 512, 0, "alignment");
                        let prev = live.insert(p as usize, (n, dev));
                        assert!(prev.is_none(), "{p:?} handed out twice");
                    }
                }
                4..=5 => {
                    // Free one of ours (with any size and stream), or any pointer at all.
                    let (p, dev) = if !live.is_empty() && u.arbitrary::<bool>()? {
                        let k = u.choose_index(live.len())?;
                        let (&p, &(_, d)) = live.iter().nth(k).unwrap();
                        let interior = u.int_in_range(0usize..=1)? * 512;
                        (
                            p + interior,
                            if u.arbitrary::<bool>()? {
                                d
                            } else {
                                u.int_in_range(-1..=DEVICES)?
                            },
                        )
                    } else {
                        (u.arbitrary::<usize>()?, u.int_in_range(-1..=DEVICES)?)
                    };
                    cistern_free(p as *mut c_void, size(&mut u)?, dev, stream(&mut u)?);
                    if let Some(&(_, d)) = live.get(&p) {
                        if d == dev {
                            live.remove(&p);
                        }
                    }
                }
                6 => {
                    let p = if !live.is_empty() && u.arbitrary::<bool>()? {
                        let k = u.choose_index(live.len())?;
                        *live.keys().nth(k).unwrap() + u.int_in_range(0usize..=4096)?
                    } else {
                        u.arbitrary::<usize>()?
                    };
                    cistern_record_stream(p as *mut c_void, stream(&mut u)?);
                }
                7 => cistern_forget_stream(stream(&mut u)?),
                8 => {
                    let p = u.arbitrary::<usize>()?;
                    let mut n = 0usize;
                    // SAFETY: `n` is a valid place for the size.
                    let base = unsafe { cistern_base_alloc(p as *mut c_void, &mut n) };
                    if !base.is_null() {
                        let (sz, _) = live
                            .get(&(base as usize))
                            .unwrap_or_else(|| panic!("base {base:?} of {p:#x} is not ours"));
                        assert!(n >= *sz && (base as usize) <= p && p < base as usize + n);
                    }
                }
                9 => {
                    let cap = u.int_in_range(0usize..=300)?;
                    let mut buf = vec![0x55u8; cap + 8];
                    let dev = u.int_in_range(-1..=DEVICES)?;
                    // SAFETY: `buf` has more than `cap` writable bytes.
                    let n = unsafe {
                        if u.arbitrary::<bool>()? {
                            cistern_stats_json(dev, buf.as_mut_ptr().cast(), cap)
                        } else {
                            cistern_snapshot_json(buf.as_mut_ptr().cast(), cap)
                        }
                    };
                    if cap > 0 {
                        let end = n.min(cap - 1);
                        assert_eq!(buf[end], 0, "no NUL at {end} for cap {cap}");
                    }
                    assert!(
                        buf[cap..].iter().all(|&b| b == 0x55),
                        "wrote past cap {cap}"
                    );
                }
                10 => {
                    let bytes: Vec<u8> = u.arbitrary()?;
                    let tag =
                        CString::new(bytes.into_iter().filter(|&b| b != 0).collect::<Vec<u8>>())
                            .unwrap();
                    // SAFETY: `tag` is a NUL-terminated string.
                    unsafe { cistern_tag_push(tag.as_ptr()) };
                }
                11 => cistern_tag_pop(),
                12 => {
                    let f: f64 = match u.int_in_range(0u8..=2)? {
                        0 => u.int_in_range(0u32..=100)? as f64 / 100.0,
                        1 => f64::NAN,
                        _ => u.arbitrary()?,
                    };
                    cistern_set_memory_fraction(f, u.int_in_range(-1..=DEVICES)?);
                }
                _ => match u.int_in_range(0u8..=2)? {
                    0 => cistern_empty_cache(),
                    1 => cistern_reset_peak_stats(u.int_in_range(-1..=DEVICES)?),
                    _ => {
                        let e: *const c_char = cistern_last_error();
                        // SAFETY: the library returns a NUL-terminated string it keeps alive.
                        let _ = unsafe { CStr::from_ptr(e) }.to_str().expect("UTF-8 error");
                    }
                },
            }
            Ok(())
        })();
        if r.is_err() {
            break;
        }
    }
    // Live blocks never overlap.
    let mut end = 0usize;
    for (&p, &(n, _)) in &live {
        assert!(p >= end, "overlap at {p:#x}");
        end = p + n;
    }
    for d in 0..DEVICES {
        let s = stats(d);
        let held = live.values().filter(|(_, dev)| *dev == d).count() as i64;
        assert_eq!(
            stat(&s, "allocation.all.current"),
            before[d as usize].0 + held,
            "device {d}: the pool's count of live blocks"
        );
        assert_eq!(
            stat(&s, "num_abi_panics"),
            before[d as usize].1,
            "a call panicked: {:?}",
            // SAFETY: as above.
            unsafe { CStr::from_ptr(cistern_last_error()) }
        );
    }
    // Leave nothing for the next input.
    for (&p, &(n, d)) in &live {
        cistern_free(p as *mut c_void, n, d, std::ptr::null_mut());
    }
    // Tags pushed and not popped stay on this thread's stack; pop them all. Limits go back.
    for _ in 0..steps {
        cistern_tag_pop();
    }
    for d in 0..DEVICES {
        cistern_set_memory_fraction(1.0, d);
    }
});
