//! Sharing blocks with other processes: the sender's side ([`DevicePool::share`]) and the
//! receiver's ([`DevicePool::open_shared`], [`DevicePool::close_shared`]). The wire format is
//! `crate::ipc`'s.
//!
//! # Note [Sharing]
//!
//! **VMM memory.** A block lies on one or more chunks (physical handles, each mapped whole, see
//! Note [Chunks] in `vmm.rs`). Sharing exports each chunk under the block as a POSIX file
//! descriptor (`cuMemExportToShareableHandle`; the driver creates every handle exportable where
//! the device supports it, as PyTorch's expandable segments do) and describes the range those
//! chunks span: this process's id, each chunk's descriptor and size, and the block's offset in
//! the range. The descriptors stay open in this process for as long as their chunk lives (a
//! receiver takes its own copy with `pidfd_getfd` whenever it unpickles the handle), and are
//! closed when the chunk goes back to the driver ([`ShareState::release_chunk`]). Exporting is
//! once per chunk, however often its blocks are shared.
//!
//! Chunks move: once free, their pages may be unmapped and mapped again elsewhere (another
//! stream's arena, another address). That is invisible to a receiver, whose mapping names the
//! physical memory, not this process's addresses; and a chunk holding a live block never moves.
//! The block must stay live until every receiver is done with it, which is the sender's
//! contract in CUDA IPC (torch.multiprocessing keeps the storage alive through its shared
//! reference count).
//!
//! **Linear memory** (`vmm:false`): the block's segment is one `cuMemAlloc` allocation; its
//! CUDA IPC handle (`cuIpcGetMemHandle` of the allocation's base) and the block's offset in it
//! describe it.
//!
//! **Who may receive.** A receiver takes each descriptor from the sender with `pidfd_getfd`,
//! which needs ptrace permission over it, as PyTorch's receiver does. Under Yama's
//! `ptrace_scope` 1 (Ubuntu's default) only the sender's ancestors have it, so workers that a
//! trainer starts could not receive from it; at its first VMM share the pool lets the process's
//! own descendants attach (`prctl(PR_SET_PTRACER, getpid())`, a grant as narrow as Yama allows:
//! they run the same program). Others (siblings, unrelated processes) need scope 0.
//!
//! **Receiving.** `open_shared` takes each descriptor from the sender (`pidfd_getfd`; the
//! sender may be this process, as when a tensor comes back through a queue: the import then
//! maps the same memory at a second address, as PyTorch's receiver does), imports it
//! (`cuMemImportFromShareableHandle`), maps the handles one after another in a fresh
//! reservation and grants access to the device and its peers in one `cuMemSetAccess`; a CUDA
//! IPC handle is opened with `cuIpcOpenMemHandle`. Opened ranges are cached by their
//! description (and the sender's start time: a later process given a dead sender's pid may
//! name the same descriptor numbers for other memory) with a count of opens, as PyTorch's
//! `getIpcDevPtr` caches by handle bytes (a process may open one allocation once only), and
//! `close_shared` unmaps and releases at the last close. Opened memory is not the pool's: it
//! is neither counted in its statistics nor handed out, and the pool's teardown unmaps
//! whatever is still open.

use std::collections::hash_map::Entry;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::Relaxed;

use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};

use super::device::DevicePool;
use crate::arena::{Backing, DeviceCore};
use crate::driver::{Driver, DriverResult, PhysHandle};
use crate::error::{Error, Result};
use crate::fork::check as fork_check;
use crate::ipc::{Share, Shared};

/// What a device's pool has exported and opened. `exported` is a leaf lock. `opened` is taken
/// before the device state lock (`open_shared` reads the peers under it), never after: so
/// nothing may call `open_shared`, `close_all` or `grant_peer` with the device lock held.
#[derive(Debug, Default)]
pub(crate) struct ShareState {
    /// Chunk handle -> its exported descriptor, open while the chunk lives.
    exported: Mutex<FxHashMap<u64, OwnedFd>>,
    /// Ranges opened from other processes, by description and the sender's start time (a
    /// later process given a dead sender's pid may name the same descriptors: other memory).
    opened: Mutex<FxHashMap<(Shared, Option<u64>), Opened>>,
}

/// A range opened from another process.
#[derive(Debug)]
struct Opened {
    base: u64,
    opens: u64,
    kind: OpenedKind,
    /// The sender's start time, read when the range was opened (`None`: unknown), so that
    /// readers of the registry tell the sender from a later process given its pid.
    sender_start: Option<u64>,
}

/// Memory this process maps from one other process's pool ([`DevicePool::imported`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imported {
    /// The sender's pid, as this process sees it.
    pub from_pid: u32,
    /// The sender's start time (clock ticks since boot), when it could be read at the open.
    pub from_start_time: Option<u64>,
    /// Bytes mapped.
    pub bytes: u64,
}

#[derive(Debug)]
enum OpenedKind {
    /// Imported handles mapped in a reservation of `len` bytes: (address, size, handle).
    Mapped {
        len: u64,
        maps: Vec<(u64, u64, PhysHandle)>,
    },
    /// Opened with `cuIpcOpenMemHandle`.
    Ipc,
}

impl ShareState {
    /// Gives chunk `handle` back to the driver, first closing its exported descriptor (the
    /// driver may reuse the handle's value).
    pub(crate) fn release_chunk<D: Driver>(
        &self,
        core: &DeviceCore<D>,
        handle: PhysHandle,
    ) -> DriverResult<()> {
        let fd = self.exported.lock().remove(&handle.0);
        drop(fd);
        core.driver.release_physical(core.dev, handle)
    }

    /// Grants `peer` access to every range opened from other processes (VMM mappings; CUDA
    /// IPC memory was opened with lazy peer access).
    pub(crate) fn grant_peer<D: Driver>(&self, core: &DeviceCore<D>, peer: usize) -> Result<()> {
        let opened = self.opened.lock();
        for o in opened.values() {
            if let OpenedKind::Mapped { len, .. } = o.kind {
                if let Err(e) = core.driver.set_access(core.dev, o.base, len, &[peer]) {
                    core.counters.num_driver_errors.fetch_add(1, Relaxed);
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// Bytes mapped from each other process (VMM imports; this process's own memory opened
    /// again is not counted, and CUDA IPC opens name no process), by sender (its pid and start
    /// time), most bytes first. A physical handle under two opened ranges (two blocks on one
    /// chunk, shared apart) is one memory: each (sender, descriptor, size) counts once.
    pub(crate) fn imported(&self) -> Vec<Imported> {
        let me = std::process::id();
        let mut seen: FxHashSet<(u32, Option<u64>, i32, u64)> = FxHashSet::default();
        let mut by_sender: FxHashMap<(u32, Option<u64>), u64> = FxHashMap::default();
        for ((k, _), o) in self.opened.lock().iter() {
            if let (Shared::Handles { pid, handles }, OpenedKind::Mapped { .. }) = (k, &o.kind) {
                if *pid == me {
                    continue;
                }
                for &(fd, size) in handles {
                    if seen.insert((*pid, o.sender_start, fd, size)) {
                        let e = by_sender.entry((*pid, o.sender_start)).or_default();
                        *e = e.saturating_add(size);
                    }
                }
            }
        }
        let mut v: Vec<Imported> = by_sender
            .into_iter()
            .map(|((from_pid, from_start_time), bytes)| Imported {
                from_pid,
                from_start_time,
                bytes,
            })
            .collect();
        v.sort_unstable_by(|a, b| {
            b.bytes
                .cmp(&a.bytes)
                .then(a.from_pid.cmp(&b.from_pid))
                .then(a.from_start_time.cmp(&b.from_start_time))
        });
        v
    }

    /// Unmaps and releases everything still opened from other processes (pool teardown).
    pub(crate) fn close_all<D: Driver>(&self, core: &DeviceCore<D>) {
        let opened: Vec<Opened> = self.opened.lock().drain().map(|(_, o)| o).collect();
        for o in opened {
            unmap_opened(core, o);
        }
    }
}

/// Undoes an open: unmaps and releases imported handles and frees the reservation, or closes
/// the IPC mapping. Failures are counted, not returned: nothing else can be done with them.
fn unmap_opened<D: Driver>(c: &DeviceCore<D>, o: Opened) {
    let d = &c.driver;
    let mut failed = 0;
    match o.kind {
        OpenedKind::Mapped { len, maps } => {
            for (addr, size, h) in maps {
                failed += d.unmap(c.dev, addr, size).is_err() as u64;
                failed += d.release_physical(c.dev, h).is_err() as u64;
            }
            failed += d.free_va(c.dev, o.base, len).is_err() as u64;
        }
        OpenedKind::Ipc => failed += d.ipc_close(c.dev, o.base).is_err() as u64,
    }
    c.counters.num_driver_errors.fetch_add(failed, Relaxed);
}

impl<D: Driver> DevicePool<D> {
    /// Describes the live block containing `ptr` for another process (see Note [Sharing]):
    /// the memory of the range it lies in, and its offset there. With VMM the chunks under the
    /// block are exported (once each); without, the allocation's CUDA IPC handle is taken.
    ///
    /// Errors: [`Error::InvalidArgument`] for an address that is not inside a live block of
    /// this pool; [`Error::Driver`] when the driver cannot share (a device or container without
    /// exportable handles says so, with the fix).
    pub fn share(&self, ptr: u64) -> Result<Share> {
        fork_check()?;
        let c = &*self.core;
        let not_live = || {
            Error::InvalidArgument(format!(
                "share: {ptr:#x} is not inside a live block of device {}'s pool",
                c.dev
            ))
        };
        let arena = self.arena_of(ptr).ok_or_else(not_live)?;
        let st = arena.state.lock();
        let base = st.block_containing(ptr).ok_or_else(not_live)?;
        let r = st.live.get(&base).ok_or_else(not_live)?;
        let kh = &st.kinds[r.kind];
        let span = kh.heap.span(r.span);
        let seg = kh.segment(span.seg);
        match &seg.backing {
            Backing::Linear => {
                let handle = c.driver.ipc_get_handle(c.dev, seg.base)?;
                Ok(Share {
                    memory: Shared::Ipc { handle },
                    offset: ptr - seg.base,
                })
            }
            Backing::Vmm { pages } => {
                let g = c.granularity;
                let first = ((span.start - seg.base) / g) as usize;
                let page = pages[first].ok_or_else(not_live)?;
                let start_idx = first - page.index as usize;
                let start = seg.base + start_idx as u64 * g;
                let end = span.start + span.len;
                let mut chunks = Vec::new();
                let mut at = start_idx;
                while seg.base + (at as u64) * g < end {
                    let p = pages.get(at).copied().flatten().ok_or_else(not_live)?;
                    chunks.push(p.chunk());
                    at += p.len as usize;
                }
                drop(st);
                if !c.caps.posix_fd_handles {
                    return Err(Error::InvalidArgument(format!(
                        "share: device {} cannot export memory to other processes (the driver \
                         reports no POSIX file-descriptor handles); allocate the memory to \
                         share with CISTERN_CONF=vmm:false, which shares through CUDA IPC",
                        c.dev
                    )));
                }
                static ATTACH: std::sync::Once = std::sync::Once::new();
                ATTACH.call_once(crate::sys::allow_descendants_to_attach);
                let mut handles = Vec::with_capacity(chunks.len());
                let mut exported = c.share.exported.lock();
                for ch in chunks {
                    let fd = match exported.entry(ch.handle.0) {
                        Entry::Occupied(e) => e.get().as_raw_fd(),
                        Entry::Vacant(v) => match c.driver.export_handle(c.dev, ch.handle) {
                            Ok(fd) => v.insert(fd).as_raw_fd(),
                            Err(e) => {
                                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                                return Err(Error::InvalidArgument(format!(
                                    "share: device {} cannot export the memory under {ptr:#x} \
                                     ({e}); the driver may have refused exportable handles \
                                     when it was created (containers and WSL can: cistern then \
                                     creates plain ones), and CISTERN_CONF=vmm:false shares \
                                     through CUDA IPC instead",
                                    c.dev
                                )));
                            }
                        },
                    };
                    handles.push((fd, ch.pages as u64 * g));
                }
                Ok(Share {
                    memory: Shared::Handles {
                        pid: std::process::id(),
                        handles,
                    },
                    offset: ptr - start,
                })
            }
        }
    }

    /// Maps memory another process shared ([`DevicePool::share`] there, or PyTorch's own
    /// allocator) into this one, on this pool's device, and returns the range's base (add the
    /// share's offset for the block). Opening the same description again returns the same base
    /// and counts one more open (see Note [Sharing]).
    ///
    /// Errors: [`Error::InvalidArgument`] naming the fix when the sender's descriptors cannot
    /// be taken (ptrace permission, a process that exited); [`Error::Driver`] when the driver
    /// refuses (a CUDA IPC handle of this process's own memory, which CUDA cannot open).
    pub fn open_shared(&self, memory: &Shared) -> Result<u64> {
        fork_check()?;
        let c = &*self.core;
        // Read before the descriptors are taken: a sender that exits after this is still the
        // one whose memory is mapped.
        let sender_start = match memory {
            Shared::Handles { pid, .. } => crate::sys::start_time_of(*pid),
            Shared::Ipc { .. } => None,
        };
        let key = (memory.clone(), sender_start);
        let mut opened = c.share.opened.lock();
        if let Some(o) = opened.get_mut(&key) {
            o.opens += 1;
            return Ok(o.base);
        }
        let o = match memory {
            Shared::Ipc { handle } => Opened {
                base: c.driver.ipc_open(c.dev, handle)?,
                opens: 1,
                kind: OpenedKind::Ipc,
                sender_start: None,
            },
            Shared::Handles { pid, handles } => self.import_range(*pid, handles, sender_start)?,
        };
        let base = o.base;
        opened.insert(key, o);
        Ok(base)
    }

    /// Imports `handles` of process `pid` (which started at `sender_start`) and maps them one
    /// after another.
    fn import_range(
        &self,
        pid: u32,
        handles: &[(i32, u64)],
        sender_start: Option<u64>,
    ) -> Result<Opened> {
        let c = &*self.core;
        // The device's support, not the pool's setting: a `vmm:false` pool on a VMM device
        // still receives VMM memory, as PyTorch's receiver does whatever its own setting.
        if !c.caps.vmm {
            return Err(Error::InvalidArgument(format!(
                "open_shared: device {} has no virtual memory management, which mapping \
                 another process's physical handles needs",
                c.dev
            )));
        }
        let g = c.granularity;
        if let Some(&(_, s)) = handles.iter().find(|h| h.1 == 0 || h.1 % g != 0) {
            return Err(Error::InvalidArgument(format!(
                "open_shared: a shared handle of {s} bytes is not a multiple of device {}'s \
                 granularity ({g} bytes)",
                c.dev
            )));
        }
        let len = handles
            .iter()
            .try_fold(0u64, |sum, h| sum.checked_add(h.1))
            .filter(|&l| l <= c.caps.total_memory.max(g))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "open_shared: the shared handles add up to more than device {}'s memory",
                    c.dev
                ))
            })?;
        let mut imported: Vec<(PhysHandle, u64)> = Vec::with_capacity(handles.len());
        let undo_imports = |imported: &[(PhysHandle, u64)]| {
            for &(h, _) in imported {
                let _ = c.driver.release_physical(c.dev, h);
            }
        };
        for &(fd, size) in handles {
            let mine = match crate::sys::fd_of_process(pid, fd) {
                Ok(f) => f,
                Err(e) => {
                    undo_imports(&imported);
                    return Err(Error::InvalidArgument(pidfd_error(pid, fd, &e)));
                }
            };
            match c.driver.import_handle(c.dev, mine.as_fd()) {
                Ok(h) => imported.push((h, size)),
                Err(e) => {
                    undo_imports(&imported);
                    return Err(e.into());
                }
            }
        }
        let base = match c.driver.reserve_va(c.dev, len, g) {
            Ok(b) => b,
            Err(e) => {
                undo_imports(&imported);
                return Err(e.into());
            }
        };
        let mut maps = Vec::with_capacity(imported.len());
        let mut at = base;
        let mut failure = None;
        for &(h, size) in &imported {
            match c.driver.map(c.dev, at, size, h) {
                Ok(()) => maps.push((at, size, h)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
            at += size;
        }
        if failure.is_none() {
            // The device lock inside the opened ranges' lock: `enable_peer_access` adds a peer
            // under the device lock and grants opened ranges after releasing it, so a range
            // opened meanwhile is granted by one or the other.
            let peers = self.state.lock().peers.clone();
            failure = c.driver.set_access(c.dev, base, len, &peers).err();
        }
        if let Some(e) = failure {
            // The first `maps.len()` imports are mapped (in order); release the rest by
            // position (importing one memory twice may give the same handle value).
            let rest = imported.split_off(maps.len());
            unmap_opened(
                c,
                Opened {
                    base,
                    opens: 0,
                    kind: OpenedKind::Mapped { len, maps },
                    sender_start,
                },
            );
            undo_imports(&rest);
            return Err(e.into());
        }
        Ok(Opened {
            base,
            opens: 1,
            kind: OpenedKind::Mapped { len, maps },
            sender_start,
        })
    }

    /// The memory this device maps from other processes' pools, by sender, most bytes first:
    /// what [`DevicePool::open_shared`] opened and is not closed yet (VMM memory; CUDA IPC opens
    /// of `vmm:false` senders name no process and are left out). The registry
    /// publishes it, so that `cistern ps` and `doctor` can say who keeps a sender's memory
    /// alive after it exited.
    pub fn imported(&self) -> Vec<Imported> {
        self.core.share.imported()
    }

    /// Drops one open of the range at `base` (from [`DevicePool::open_shared`]); the last one
    /// unmaps it and gives its handles back. [`Error::InvalidArgument`] when nothing opened is
    /// there.
    pub fn close_shared(&self, base: u64) -> Result<()> {
        let c = &*self.core;
        let mut opened = c.share.opened.lock();
        let key = opened
            .iter()
            .find(|(_, o)| o.base == base)
            .map(|(k, _)| k.clone())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "close_shared: nothing opened from another process starts at {base:#x}"
                ))
            })?;
        let o = opened.get_mut(&key).expect("found above");
        o.opens -= 1;
        if o.opens == 0 {
            let o = opened.remove(&key).expect("found above");
            drop(opened);
            unmap_opened(c, o);
        }
        Ok(())
    }
}

/// The message for a descriptor that could not be taken from the sender.
fn pidfd_error(pid: u32, fd: i32, e: &std::io::Error) -> String {
    let why = match e.raw_os_error() {
        Some(libc::ENOSYS) => {
            "this kernel has no pidfd_getfd (Linux 5.6 or later is needed to receive VMM \
             memory); share it from a process using CISTERN_CONF=vmm:false instead"
                .to_string()
        }
        Some(libc::EPERM) => {
            "no ptrace permission over the sender: run both as the same user; where \
             /proc/sys/kernel/yama/ptrace_scope is 1 the receiver must be the sender's ancestor \
             or descendant (a sender running cistern allows its descendants), else lower the \
             scope to 0 (at 2 and 3 it needs CAP_SYS_PTRACE, which containers may also need)"
                .to_string()
        }
        Some(libc::ESRCH) => "the sending process has exited".to_string(),
        Some(libc::EBADF) => {
            "the sender no longer has that descriptor (the block was freed before it was \
             received)"
                .to_string()
        }
        _ => e.to_string(),
    };
    format!("open_shared: cannot take descriptor {fd} of process {pid}: {why}")
}
