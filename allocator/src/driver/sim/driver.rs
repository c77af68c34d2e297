//! [`Driver`] for [`SimDriver`]: each driver call checked as the CUDA driver checks it (device,
//! VMM support, granularity, sizes, handles, overlaps) and applied to the simulated memory and
//! work model, with its hazards recorded.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::codes::CUDA_ERROR_INVALID_DEVICE;
use super::memory::{
    round_up, LinearAlloc, Mapping, MemKey, PhysAlloc, Piece, Store, LINEAR_ALIGN,
};
use super::work::{merge_pos, Pos};
use super::{err, invalid, invalid_handle, oom, DevState, Hazard, HazardKind, SimDriver, WorkId};
use crate::driver::{
    DeviceCaps, DeviceId, Driver, DriverCall, DriverErrorKind, DriverResult, EventId, MemInfo,
    PhysHandle, StreamId, StreamInfo,
};

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> DriverResult<usize> {
        self.enter(DriverCall::DeviceCount)?;
        Ok(self.devices.len())
    }

    fn capabilities(&self, dev: DeviceId) -> DriverResult<DeviceCaps> {
        let call = DriverCall::Capabilities;
        self.enter(call)?;
        self.device(call, dev)?;
        Ok(DeviceCaps {
            total_memory: self.config.capacity,
            vmm: self.config.vmm,
            granularity: self.config.granularity,
            name: "cistern-sim".to_string(),
            uuid: Some(format!("GPU-5157a1d0-0000-4000-8000-{dev:012x}")),
            posix_fd_handles: self.config.vmm,
        })
    }

    fn mem_info(&self, dev: DeviceId) -> DriverResult<MemInfo> {
        let call = DriverCall::MemInfo;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let committed = d.state.lock().committed;
        let total = self.config.capacity;
        let free = total
            .saturating_sub(self.other_process_bytes.load(Ordering::Relaxed))
            .saturating_sub(committed);
        Ok(MemInfo { free, total })
    }

    fn reserve_va(&self, dev: DeviceId, size: u64, align: u64) -> DriverResult<u64> {
        let call = DriverCall::ReserveVa;
        let d = self.vmm_device_sized(call, dev, size)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        self.granularity_check(call, "size", size)?;
        self.granularity_check(call, "alignment", align)?;
        let align = align.max(self.config.granularity);
        let mut st = d.state.lock();
        let addr = st.va_free.alloc(size, align).ok_or_else(|| {
            oom(
                call,
                format!("no free virtual range of {size:#x} bytes aligned to {align:#x}"),
            )
        })?;
        st.reservations.insert(addr, size);
        st.reserved_bytes += size;
        Ok(addr)
    }

    fn free_va(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::FreeVa;
        let d = self.vmm_device_sized(call, dev, size)?;
        let mut st = d.state.lock();
        match st.reservations.get(&addr) {
            Some(&s) if s == size => {}
            Some(&s) => {
                return Err(invalid(
                    call,
                    format!("reservation at {addr:#x} has size {s:#x}, not {size:#x}"),
                ))
            }
            None => return Err(invalid(call, format!("no reservation starts at {addr:#x}"))),
        }
        if let Some((&m, _)) = st.mappings.range(addr..addr + size).next() {
            return Err(invalid(
                call,
                format!("reservation at {addr:#x} still has a mapping at {m:#x}"),
            ));
        }
        st.reservations.remove(&addr);
        st.reserved_bytes -= size;
        st.va_free.insert(addr, addr + size);
        Ok(())
    }

    fn create_physical(&self, dev: DeviceId, size: u64) -> DriverResult<PhysHandle> {
        let call = DriverCall::CreatePhysical;
        let d = self.vmm_device_sized(call, dev, size)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        self.granularity_check(call, "size", size)?;
        let mut st = d.state.lock();
        self.check_commit(call, &st, size)?;
        let id = self.new_id();
        st.handles.insert(
            id,
            PhysAlloc {
                size,
                map_count: 0,
                refs: 1,
                data: Store::default(),
            },
        );
        st.commit(size);
        Ok(PhysHandle(id))
    }

    fn release_physical(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<()> {
        let call = DriverCall::ReleasePhysical;
        let d = self.vmm_device(call, dev)?;
        let mut st = d.state.lock();
        let Some(p) = st.handles.get_mut(&handle.0) else {
            return Err(invalid_handle(
                call,
                format!("unknown physical handle {}", handle.0),
            ));
        };
        if p.refs > 1 {
            // Another handle of the memory (an import) keeps it, and may be mapped.
            p.refs -= 1;
            return Ok(());
        }
        if p.map_count > 0 {
            return Err(invalid(
                call,
                format!(
                    "physical handle {} is still mapped {} time(s)",
                    handle.0, p.map_count
                ),
            ));
        }
        let size = p.size;
        let touching = st.work_touching(&[Piece {
            key: MemKey::Phys(handle.0),
            off: 0,
            len: size,
        }]);
        st.handles.remove(&handle.0);
        st.committed -= size;
        drop(st);
        self.record_hazards(
            touching
                .into_iter()
                .map(|(sid, w)| Hazard {
                    dev,
                    kind: HazardKind::ReleaseWhileInUse,
                    ptr: 0,
                    size,
                    stream: None,
                    handle: Some(handle),
                    other_stream: StreamId(sid),
                    work: WorkId(w),
                })
                .collect(),
        );
        Ok(())
    }

    fn map(&self, dev: DeviceId, addr: u64, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let call = DriverCall::Map;
        let d = self.vmm_device_sized(call, dev, size)?;
        self.granularity_check(call, "address", addr)?;
        let mut st = d.state.lock();
        let Some(p) = st.handles.get(&handle.0) else {
            return Err(invalid_handle(
                call,
                format!("unknown physical handle {}", handle.0),
            ));
        };
        if p.size != size {
            return Err(invalid(
                call,
                format!(
                    "size {size:#x} differs from the size {:#x} of handle {}",
                    p.size, handle.0
                ),
            ));
        }
        let end = addr
            .checked_add(size)
            .ok_or_else(|| invalid(call, "range overflows"))?;
        let inside = st
            .reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&s, &len)| end <= s + len);
        if !inside {
            return Err(invalid(
                call,
                format!("[{addr:#x}, {end:#x}) is not inside one reservation"),
            ));
        }
        let before = st
            .mappings
            .range(..addr)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size > addr);
        if before || st.mappings.range(addr..end).next().is_some() {
            return Err(invalid(
                call,
                format!("[{addr:#x}, {end:#x}) overlaps an existing mapping"),
            ));
        }
        if let Some(p) = st.handles.get_mut(&handle.0) {
            p.map_count += 1;
        }
        st.mappings.insert(
            addr,
            Mapping {
                size,
                handle: handle.0,
            },
        );
        st.mapped_bytes += size;
        Ok(())
    }

    fn unmap(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        let call = DriverCall::Unmap;
        let d = self.vmm_device_sized(call, dev, size)?;
        let mut st = d.state.lock();
        let handle = match st.mappings.get(&addr) {
            Some(m) if m.size == size => m.handle,
            Some(m) => {
                return Err(invalid(
                    call,
                    format!("mapping at {addr:#x} has size {:#x}, not {size:#x}", m.size),
                ))
            }
            None => return Err(invalid(call, format!("no mapping starts at {addr:#x}"))),
        };
        // Only work launched over this address: the memory may stay mapped elsewhere (a
        // move maps it at its new address before the old one is unmapped), and work that
        // reaches it there is not disturbed.
        let touching = st.work_through(
            addr,
            addr + size,
            &[Piece {
                key: MemKey::Phys(handle),
                off: 0,
                len: size,
            }],
        );
        st.mappings.remove(&addr);
        st.mapped_bytes -= size;
        st.access.remove(addr, addr + size);
        for set in st.peer_access.values_mut() {
            set.remove(addr, addr + size);
        }
        if let Some(p) = st.handles.get_mut(&handle) {
            p.map_count -= 1;
        }
        drop(st);
        self.record_hazards(
            touching
                .into_iter()
                .map(|(sid, w)| Hazard {
                    dev,
                    kind: HazardKind::UnmapWhileInUse,
                    ptr: addr,
                    size,
                    stream: None,
                    handle: None,
                    other_stream: StreamId(sid),
                    work: WorkId(w),
                })
                .collect(),
        );
        Ok(())
    }

    fn set_access(
        &self,
        dev: DeviceId,
        addr: u64,
        size: u64,
        peers: &[DeviceId],
    ) -> DriverResult<()> {
        let call = DriverCall::SetAccess;
        let d = self.vmm_device_sized(call, dev, size)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        let peers: Vec<DeviceId> = peers.iter().copied().filter(|&p| p != dev).collect();
        if let Some(&p) = peers
            .iter()
            .find(|&&p| p >= self.devices.len() || !self.config.peers)
        {
            return Err(err(
                call,
                DriverErrorKind::InvalidDevice,
                CUDA_ERROR_INVALID_DEVICE,
                format!("device {p} cannot be granted access to device {dev}'s memory"),
            ));
        }
        let mut st = d.state.lock();
        let pieces = st
            .translate(addr, size, false)
            .map_err(|m| invalid(call, m))?;
        st.access.insert(addr, addr + size);
        for &p in &peers {
            st.peer_access
                .entry(p)
                .or_default()
                .insert(addr, addr + size);
        }
        drop(st);
        // cuMemSetAccess costs per mapping and per device: price each (mapping, device) pair
        // past the first, which entry priced.
        let units = pieces.len() as u64 * (1 + peers.len() as u64);
        self.charge(call, units.saturating_sub(1), 0);
        Ok(())
    }

    fn can_access_peer(&self, dev: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        let call = DriverCall::Capabilities;
        self.enter(call)?;
        self.device(call, dev)?;
        self.device(call, peer)?;
        Ok(self.config.peers && dev != peer)
    }

    fn export_handle(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<OwnedFd> {
        self.export(dev, handle)
    }

    fn import_handle(&self, dev: DeviceId, fd: BorrowedFd<'_>) -> DriverResult<PhysHandle> {
        self.import(dev, fd)
    }

    fn ipc_get_handle(&self, dev: DeviceId, ptr: u64) -> DriverResult<[u8; 64]> {
        self.ipc_handle(dev, ptr)
    }

    fn ipc_open(&self, dev: DeviceId, handle: &[u8; 64]) -> DriverResult<u64> {
        self.ipc_open_handle(dev, handle)
    }

    fn ipc_close(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        let call = DriverCall::IpcClose;
        self.enter(call)?;
        self.device(call, dev)?;
        Err(invalid(
            call,
            format!("{ptr:#x} was not opened with cuIpcOpenMemHandle"),
        ))
    }

    fn mem_alloc(&self, dev: DeviceId, size: u64) -> DriverResult<u64> {
        let call = DriverCall::MemAlloc;
        self.enter_sized(call, size)?;
        let d = self.device(call, dev)?;
        if size == 0 {
            return Err(invalid(call, "size is 0"));
        }
        let mut st = d.state.lock();
        self.check_commit(call, &st, size)?;
        let span = round_up(size, LINEAR_ALIGN).ok_or_else(|| oom(call, "size overflows"))?;
        let base = st
            .linear_free
            .alloc(span, LINEAR_ALIGN)
            .ok_or_else(|| oom(call, "linear address space exhausted"))?;
        let id = self.new_id();
        st.linear.insert(
            base,
            LinearAlloc {
                id,
                size,
                data: Store::default(),
            },
        );
        st.linear_ids.insert(id, base);
        st.commit(size);
        Ok(base)
    }

    fn mem_free(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        let call = DriverCall::MemFree;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, None)?;
        let mut st = d.state.lock();
        if !st.linear.contains_key(&ptr) {
            return Err(invalid(
                call,
                format!("{ptr:#x} is not the base of a live mem_alloc allocation"),
            ));
        }
        // Like cuMemFree, synchronise the device first.
        let n = st.complete_all();
        if n > 0 {
            d.unfinished.fetch_sub(n, Ordering::Relaxed);
        }
        if let Some(l) = st.linear.remove(&ptr) {
            st.linear_ids.remove(&l.id);
            st.committed -= l.size;
            let span = round_up(l.size, LINEAR_ALIGN).unwrap_or(l.size);
            st.linear_free.insert(ptr, ptr + span);
        }
        Ok(())
    }

    fn event_create(&self, dev: DeviceId) -> DriverResult<EventId> {
        let call = DriverCall::EventCreate;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        let id = self.new_id();
        d.state.lock().events.insert(id, Vec::new());
        Ok(EventId(id))
    }

    fn event_record(&self, dev: DeviceId, event: EventId, stream: StreamId) -> DriverResult<()> {
        let call = DriverCall::EventRecord;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, Some(stream))?;
        let mut st = d.state.lock();
        if !st.events.contains_key(&event.0) {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        }
        let positions = st.capture(stream.0);
        st.events.insert(event.0, positions);
        Ok(())
    }

    fn event_query(&self, dev: DeviceId, event: EventId) -> DriverResult<bool> {
        let call = DriverCall::EventQuery;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, None)?;
        let st = d.state.lock();
        let Some(positions) = st.events.get(&event.0) else {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        };
        Ok(positions.iter().all(|&p| st.is_complete(p)))
    }

    fn event_synchronize(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        let call = DriverCall::EventSynchronize;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, None)?;
        let mut st = d.state.lock();
        let Some(positions) = st.events.get(&event.0).cloned() else {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        };
        let n: usize = positions.into_iter().map(|p| st.complete_through(p)).sum();
        if n > 0 {
            d.unfinished.fetch_sub(n, Ordering::Relaxed);
        }
        Ok(())
    }

    fn stream_synchronize(&self, dev: DeviceId, stream: StreamId) -> DriverResult<()> {
        let call = DriverCall::StreamSynchronize;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, None)?;
        let mut st = d.state.lock();
        // What an event recorded now would capture, completed now.
        let positions = st.capture(stream.0);
        let n: usize = positions.into_iter().map(|p| st.complete_through(p)).sum();
        if n > 0 {
            d.unfinished.fetch_sub(n, Ordering::Relaxed);
        }
        Ok(())
    }

    fn event_destroy(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        let call = DriverCall::EventDestroy;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        match d.state.lock().events.remove(&event.0) {
            Some(_) => Ok(()),
            None => Err(invalid_handle(call, format!("unknown event {}", event.0))),
        }
    }

    fn stream_wait_event(
        &self,
        dev: DeviceId,
        stream: StreamId,
        event: EventId,
    ) -> DriverResult<()> {
        let call = DriverCall::StreamWaitEvent;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, Some(stream))?;
        let mut st = d.state.lock();
        let Some(positions) = st.events.get(&event.0).cloned() else {
            return Err(invalid_handle(call, format!("unknown event {}", event.0)));
        };
        // Everything ordered before the captured positions becomes ordered before this stream's
        // later work: each position covers its stream up to it, and what its work item was
        // ordered after when launched (a completed item needs nothing: its dependencies are
        // complete too).
        let mut covered: Vec<Pos> = Vec::new();
        for &p in &positions {
            merge_pos(&mut covered, p);
            if let Some(w) = st.work_item(p) {
                for (&stream, &work) in w.ordered_after.iter() {
                    merge_pos(&mut covered, Pos { stream, work });
                }
            }
        }
        let pending: Vec<Pos> = positions
            .into_iter()
            .filter(|&p| p.stream != stream.0 && !st.is_complete(p))
            .collect();
        let ss = st.streams.entry(stream.0).or_default();
        let news: Vec<Pos> = covered
            .into_iter()
            .filter(|p| p.stream != stream.0 && ss.waited.get(&p.stream) < Some(&p.work))
            .collect();
        if !news.is_empty() {
            let waited = Arc::make_mut(&mut ss.waited);
            for p in news {
                waited.insert(p.stream, p.work);
            }
        }
        for p in pending {
            merge_pos(&mut ss.pending_waits, p);
        }
        Ok(())
    }

    fn device_synchronize(&self, dev: DeviceId) -> DriverResult<()> {
        let call = DriverCall::DeviceSynchronize;
        self.enter(call)?;
        let d = self.device(call, dev)?;
        self.capture_check(call, dev, None)?;
        self.complete_with(d, DevState::complete_all);
        Ok(())
    }

    #[inline]
    fn stream_info(&self, dev: DeviceId, stream: StreamId) -> DriverResult<StreamInfo> {
        // A recreated handle's n-th stream gets an id from the top of the id space. (Asked on
        // a thread's first use of a handle and on growth, never on the hot path.)
        let generation = self
            .stream_generations
            .lock()
            .get(&stream.0)
            .copied()
            .unwrap_or(0);
        let id = match generation {
            0 => stream.0,
            n => u64::MAX - (stream.0 << 16 | n),
        };
        Ok(StreamInfo {
            device: dev,
            id,
            per_thread: false,
            capturing: false,
        })
    }

    fn note_handout(&self, dev: DeviceId, ptr: u64, size: u64, stream: StreamId) {
        let Some(d) = self.devices.get(dev) else {
            return;
        };
        if d.unfinished.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.check_handout(dev, d, ptr, size, stream);
    }
}
