//! Sharing blocks with other processes, on the simulator (which shares within itself): what
//! `share` describes (the chunks under a block, in order, and the block's offset) is checked
//! by importing each exported descriptor and reading the block's bytes through it. Between two
//! processes, over the fake libcuda: `tests/fakecuda/tests/end_to_end.rs`.

use std::os::fd::BorrowedFd;

use cistern::driver::{Driver, DriverCall};
use cistern::ipc::{self, Shared, TorchFormat};
use cistern::{Error, SimConfig, StreamId};

use crate::common::*;

/// Reads `len` bytes at `offset` of the range `memory` describes, by importing its handles
/// into a fresh reservation of the same simulator (what a receiver does), then undoes it all.
fn read_through(sim: &cistern::SimDriver, memory: &Shared, offset: u64, len: usize) -> Vec<u8> {
    let Shared::Handles { pid, handles } = memory else {
        panic!("expected handles, got {memory:?}");
    };
    assert_eq!(*pid, std::process::id());
    let total: u64 = handles.iter().map(|h| h.1).sum();
    let base = sim.reserve_va(0, total, PAGE).unwrap();
    let mut at = base;
    let mut mapped = Vec::new();
    for &(fd, size) in handles {
        // SAFETY: the pool keeps the descriptor open while the chunk lives, and the block
        // (so its chunks) is live for the whole test.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let h = sim.import_handle(0, fd).unwrap();
        sim.map(0, at, size, h).unwrap();
        mapped.push((at, size, h));
        at += size;
    }
    sim.set_access(0, base, total, &[]).unwrap();
    let data = sim.read(0, base + offset, len).unwrap();
    for (a, s, h) in mapped {
        sim.unmap(0, a, s).unwrap();
        sim.release_physical(0, h).unwrap();
    }
    sim.free_va(0, base, total).unwrap();
    data
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn a_shared_block_is_its_chunks_and_its_offset() {
    for conf in ["grow_whole_chunks:off", "", "grow_whole_chunks:on"] {
        let sim_conf = SimConfig::default().capacity(4 * GIB).backing(true);
        let (sim, pool) = pool_with(sim_conf, true, conf);
        let mut live = Vec::new();
        for (i, size) in [4 * KIB, 30 * MIB, 700 * KIB, 3 * MIB, 90 * MIB, 1]
            .into_iter()
            .enumerate()
        {
            let p = alloc(&pool, size, 1 + i as u64 % 2);
            let data = pattern(i as u8, size.min(64 * KIB) as usize);
            sim.write(0, p, &data).unwrap();
            // The block's last bytes too, which may lie on another chunk.
            let tail = if size > 128 * KIB {
                pattern(!(i as u8), 4 * KIB as usize)
            } else {
                Vec::new()
            };
            sim.write(0, p + size - tail.len() as u64, &tail).unwrap();
            live.push((p, size, data, tail));
        }
        for (p, size, data, tail) in &live {
            let (dev, share) = pool.share(*p).unwrap();
            assert_eq!(dev, 0);
            assert!(
                share.offset + size <= share.memory.len(),
                "{conf}: {share:?}"
            );
            // Through PyTorch's bytes and back.
            for f in [TorchFormat::V1, TorchFormat::V3] {
                assert_eq!(
                    ipc::decode(&ipc::encode(&share.memory, f)).unwrap(),
                    share.memory
                );
            }
            assert_eq!(
                &read_through(&sim, &share.memory, share.offset, data.len()),
                data,
                "{conf}: block {p:#x}"
            );
            let tail_at = share.offset + size - tail.len() as u64;
            assert_eq!(
                &read_through(&sim, &share.memory, tail_at, tail.len()),
                tail,
                "{conf}: the end of block {p:#x}"
            );
            // An interior pointer shares the same range, offset by as much.
            let (_, inner) = pool.share(p + size / 2).unwrap();
            assert_eq!(inner.memory, share.memory);
            assert_eq!(inner.offset, share.offset + size / 2);
        }
        // Each chunk is exported once however often it is shared.
        let exports = sim.calls(DriverCall::ExportHandle);
        for (p, ..) in &live {
            pool.share(*p).unwrap();
        }
        assert_eq!(sim.calls(DriverCall::ExportHandle), exports, "{conf}");
        for (p, ..) in live.drain(..) {
            free(&pool, p, 1);
        }
        pool.empty_cache();
        check(&pool);
        assert_no_leak(&sim, pool);
    }
}

#[test]
fn sharing_refuses_what_is_not_a_live_block() {
    both(|vmm| {
        let (sim, pool) = pool(GIB, vmm);
        let p = alloc(&pool, 5 * MIB, 1);
        free(&pool, p, 1);
        for bad in [p, 0x10, u64::MAX - 5] {
            let e = pool.share(bad).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(ref m) if m.contains("share")),
                "{e}"
            );
        }
        assert_no_leak(&sim, pool);
    });
}

#[test]
fn linear_blocks_share_their_allocations_ipc_handle() {
    let (sim, pool) = pool(GIB, false);
    let a = alloc(&pool, 3 * MIB, 1);
    let b = alloc(&pool, 3 * MIB, 1);
    let (_, sa) = pool.share(a).unwrap();
    let (_, sb) = pool.share(b).unwrap();
    let (Shared::Ipc { handle: ha }, Shared::Ipc { handle: hb }) = (&sa.memory, &sb.memory) else {
        panic!("linear memory shares IPC handles: {sa:?} {sb:?}");
    };
    // The offsets are from the allocation's base, which the IPC handle names.
    if ha == hb {
        assert_ne!(sa.offset, sb.offset);
        assert_eq!(b.abs_diff(a), sa.offset.abs_diff(sb.offset));
    }
    assert_eq!(sim.calls(DriverCall::IpcGetHandle), 2);
    // The simulator, like the driver, refuses to open a handle of its own process.
    assert!(pool.open_shared(0, &sa.memory).is_err());
    free(&pool, a, 1);
    free(&pool, b, 1);
    assert_no_leak(&sim, pool);
}

#[test]
fn this_processs_own_memory_opens_at_a_second_address() {
    let sim_conf = SimConfig::default().capacity(GIB).backing(true);
    let (sim, pool) = pool_with(sim_conf, true, "");
    let p = alloc(&pool, 5 * MIB, 1);
    let data = pattern(7, 4096);
    sim.write(0, p, &data).unwrap();
    let (_, share) = pool.share(p).unwrap();
    let base = pool.open_shared(0, &share.memory).unwrap();
    assert_ne!(base + share.offset, p);
    assert_eq!(sim.read(0, base + share.offset, data.len()).unwrap(), data);
    // Opened again: the same range, counted; each open is closed once.
    assert_eq!(pool.open_shared(0, &share.memory).unwrap(), base);
    pool.close_shared(0, base).unwrap();
    pool.close_shared(0, base).unwrap();
    assert!(pool.close_shared(0, base).is_err());
    // The block's memory is still the pool's, and intact.
    assert_eq!(sim.read(0, p, data.len()).unwrap(), data);
    check(&pool);
    // A description naming another process whose descriptor cannot be taken (pid 1 is not
    // ours to trace, or has no such descriptor) is a clear error, and nothing is left mapped.
    let other = Shared::Handles {
        pid: 1,
        handles: vec![(987_654, 2 * MIB)],
    };
    let e = pool.open_shared(0, &other).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("cannot take descriptor")),
        "{e}"
    );
    assert!(pool.close_shared(0, 0x1234).is_err());
    free(&pool, p, StreamId(1).0);
    assert_no_leak(&sim, pool);
}

#[test]
fn a_freed_chunk_closes_its_descriptor() {
    let (sim, pool) = pool_with(
        SimConfig::default().capacity(GIB),
        true,
        "grow_whole_chunks:off",
    );
    let p = alloc(&pool, 30 * MIB, 1);
    let (_, share) = pool.share(p).unwrap();
    let Shared::Handles { handles, .. } = &share.memory else {
        panic!("{share:?}");
    };
    // Which file each descriptor is (other tests of this binary open descriptors meanwhile, so
    // a number alone proves nothing).
    use std::os::unix::fs::MetadataExt;
    let file = |fd: i32| {
        std::fs::metadata(format!("/proc/self/fd/{fd}"))
            .ok()
            .map(|m| m.ino())
    };
    let before: Vec<_> = handles.iter().map(|h| (h.0, file(h.0))).collect();
    assert!(before.iter().all(|(_, f)| f.is_some()));
    free(&pool, p, 1);
    pool.empty_cache();
    for (fd, f) in before {
        assert_ne!(file(fd), f, "a released chunk keeps descriptor {fd} open");
    }
    assert_no_leak(&sim, pool);
}
