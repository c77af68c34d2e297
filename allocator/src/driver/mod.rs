//! The driver seam: the few device operations the pool needs, and nothing else.
//!
//! The pool never calls CUDA directly. Everything it asks of a device goes through [`Driver`],
//! whose contract is stated here, once. Two implementations exist:
//!
//! * [`SimDriver`](sim::SimDriver): a simulated GPU, public and first-class: tests, benches and
//!   `cistern replay` run on it.
//! * [`CudaDriver`](cuda::CudaDriver): the CUDA driver API through `cudarc`, on each device's
//!   primary context (the one the CUDA runtime and PyTorch use).
//!
//! # Contract (every implementation)
//!
//! * **Devices** are ordinals `0..device_count()`. Every call names its device; an
//!   implementation binds whatever context it needs. Calls are thread-safe (`Send + Sync`).
//! * **Addresses** are plain `u64` device virtual addresses. `0` is never a valid allocation.
//! * **Virtual memory (VMM)**, only when [`DeviceCaps::vmm`] is true:
//!   - `reserve_va(dev, size, align)` reserves `size` bytes of address space (`size` and `align`
//!     multiples of [`DeviceCaps::granularity`]); no physical memory is committed.
//!   - `free_va` releases a whole reservation; every mapping inside it must be unmapped first.
//!   - `create_physical(dev, size)` commits `size` bytes (a multiple of the granularity) of device
//!     memory as a handle. Failure for lack of memory is [`DriverErrorKind::OutOfMemory`].
//!   - `map(dev, addr, size, handle)` maps the *whole* handle at `addr` (inside a reservation,
//!     granularity-aligned). `unmap(dev, addr, size)` undoes exactly one earlier `map` (CUDA cannot
//!     unmap part of a mapping). The caller must ensure that no queued work still touches the range
//!     before unmapping (CUDA does not synchronise for us).
//!   - `set_access(dev, addr, size, peers)` grants read/write access to device `dev`, and to
//!     each device of `peers`, over mapped memory of `dev`; it may span several mappings. A
//!     mapping is unusable until access is set, and a peer device may touch it only once access
//!     is set for that peer too (`cuCtxEnablePeerAccess` does not cover VMM mappings). A peer
//!     must be one that `can_access_peer(dev, peer)` allows.
//!   - `release_physical` frees a handle; it must no longer be mapped anywhere.
//!   - Sharing with other processes: where [`DeviceCaps::posix_fd_handles`] is true, handles
//!     are created exportable; `export_handle` gives a POSIX file descriptor of one and
//!     `import_handle` makes a handle of this process from such a descriptor (another
//!     process's, obtained with `pidfd_getfd`). Linear memory is shared with `ipc_get_handle`
//!     (on an allocation's base) and `ipc_open` / `ipc_close` in the receiving process.
//! * **Linear fallback**: `mem_alloc` / `mem_free` (`cuMemAlloc` / `cuMemFree`). `mem_free` may
//!   synchronise the device: slow path only.
//! * **Streams** are opaque `u64` values ([`StreamId`]), the raw `CUstream`; `0` is the legacy
//!   default stream, [`StreamId::LEGACY`] (`CU_STREAM_LEGACY`) the same stream, and
//!   [`StreamId::PER_THREAD`] (`CU_STREAM_PER_THREAD`) a different stream on every thread. The
//!   driver never creates or destroys streams for the pool. A handle is not an identity: the
//!   special ones name different streams on different threads or devices, and a destroyed
//!   stream's handle may come back as a new stream. [`Driver::stream_info`] gives what does
//!   identify a stream (its device and an id unique among the process's live streams); the pool
//!   keys its arenas by it.
//! * **Events**: `event_create` (timing disabled), `event_record` on a stream, `event_query`
//!   (`Ok(true)` when all work before the record has completed; never blocks),
//!   `event_synchronize` (blocks the host: slow paths only), `event_destroy`, and
//!   `stream_wait_event` (the stream waits on the device; the host never blocks).
//! * **Errors** are [`DriverError`]s naming the call and the driver's code. No method panics.
//! * **Hazard hook**: `note_handout` is called by the pool each time it hands a range to a user on
//!   a stream. Real drivers ignore it; the simulator uses it to detect reuse races. It must cost
//!   next to nothing when nothing is being checked.

use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

pub mod cuda;
pub mod sim;

/// A device ordinal.
pub type DeviceId = usize;

/// A raw stream handle (`CUstream` / `cudaStream_t`); `0` is the legacy default stream.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The legacy default stream.
    pub const DEFAULT: StreamId = StreamId(0);
    /// `CU_STREAM_LEGACY`: the legacy default stream of the current context, as `0`.
    pub const LEGACY: StreamId = StreamId(1);
    /// `CU_STREAM_PER_THREAD`: the calling thread's own default stream of the current context.
    pub const PER_THREAD: StreamId = StreamId(2);

    /// Whether this is one of the three special handles (`0`, `CU_STREAM_LEGACY`,
    /// `CU_STREAM_PER_THREAD`), which the driver resolves through the calling thread's context.
    pub fn is_special(self) -> bool {
        self.0 <= 2
    }

    /// The handle with the null handle spelled as `CU_STREAM_LEGACY`: the two name one stream
    /// (the driver API cistern calls is not the per-thread-default one). Where streams are
    /// matched by handle (while capturing, when the driver gives no id), compare these.
    pub fn canonical(self) -> StreamId {
        if self == StreamId::DEFAULT {
            StreamId::LEGACY
        } else {
            self
        }
    }
}

/// What identifies a stream, as [`Driver::stream_info`] resolves a handle.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct StreamInfo {
    /// The device whose context the stream belongs to.
    pub device: DeviceId,
    /// An id no other live stream of the process has (`cuStreamGetId`).
    pub id: u64,
    /// Whether the handle names a different stream on every thread (`CU_STREAM_PER_THREAD`): it
    /// can only be used for this stream on the thread that resolved it.
    pub per_thread: bool,
    /// Whether the stream was capturing a CUDA graph when it was resolved. The driver refuses
    /// to name a capturing stream (`cuStreamGetId` fails and invalidates the capture), so `id`
    /// is then [`CAPTURING_ID`] with the handle's bits: unique among live streams (a capturing
    /// stream cannot be destroyed), but not the id the same stream has outside the capture.
    pub capturing: bool,
}

/// The bit that marks the id of a stream resolved while it was capturing ([`StreamInfo`]):
/// `cuStreamGetId`'s ids count up from 1 and never reach it.
pub const CAPTURING_ID: u64 = 1 << 63;

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An event handle created by [`Driver::event_create`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// A physical memory handle created by [`Driver::create_physical`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// What a device can do, read once when its pool is created.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceCaps {
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Whether the virtual memory management API (`cuMemCreate`, `cuMemMap`, ...) is usable.
    pub vmm: bool,
    /// The minimum granularity of physical allocations and mappings, in bytes (a power of two).
    pub granularity: u64,
    /// A human-readable device name.
    pub name: String,
    /// The device UUID (`GPU-xxxxxxxx-...`), when the driver knows it.
    pub uuid: Option<String>,
    /// Whether physical handles can be exported to other processes as POSIX file descriptors
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`): the driver then
    /// creates every handle exportable, and [`Driver::export_handle`] works.
    pub posix_fd_handles: bool,
}

/// Free and total device memory, as `cuMemGetInfo` reports them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemInfo {
    /// Bytes free on the device (for all processes).
    pub free: u64,
    /// Bytes of device memory in total.
    pub total: u64,
}

/// Every kind of driver call, for counters, fault injection and error reports.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[allow(missing_docs)]
pub enum DriverCall {
    DeviceCount,
    Capabilities,
    MemInfo,
    ReserveVa,
    FreeVa,
    CreatePhysical,
    ReleasePhysical,
    Map,
    Unmap,
    SetAccess,
    MemAlloc,
    MemFree,
    EventCreate,
    EventRecord,
    EventQuery,
    EventSynchronize,
    EventDestroy,
    StreamWaitEvent,
    DeviceSynchronize,
    StreamSynchronize,
    ExportHandle,
    ImportHandle,
    IpcGetHandle,
    IpcOpen,
    IpcClose,
}

impl DriverCall {
    /// Every call kind, in declaration order.
    pub const ALL: [DriverCall; 25] = [
        DriverCall::DeviceCount,
        DriverCall::Capabilities,
        DriverCall::MemInfo,
        DriverCall::ReserveVa,
        DriverCall::FreeVa,
        DriverCall::CreatePhysical,
        DriverCall::ReleasePhysical,
        DriverCall::Map,
        DriverCall::Unmap,
        DriverCall::SetAccess,
        DriverCall::MemAlloc,
        DriverCall::MemFree,
        DriverCall::EventCreate,
        DriverCall::EventRecord,
        DriverCall::EventQuery,
        DriverCall::EventSynchronize,
        DriverCall::EventDestroy,
        DriverCall::StreamWaitEvent,
        DriverCall::DeviceSynchronize,
        DriverCall::StreamSynchronize,
        DriverCall::ExportHandle,
        DriverCall::ImportHandle,
        DriverCall::IpcGetHandle,
        DriverCall::IpcOpen,
        DriverCall::IpcClose,
    ];

    /// The CUDA driver function this call kind corresponds to.
    pub fn cuda_name(self) -> &'static str {
        match self {
            DriverCall::DeviceCount => "cuDeviceGetCount",
            DriverCall::Capabilities => "cuDeviceGetAttribute",
            DriverCall::MemInfo => "cuMemGetInfo",
            DriverCall::ReserveVa => "cuMemAddressReserve",
            DriverCall::FreeVa => "cuMemAddressFree",
            DriverCall::CreatePhysical => "cuMemCreate",
            DriverCall::ReleasePhysical => "cuMemRelease",
            DriverCall::Map => "cuMemMap",
            DriverCall::Unmap => "cuMemUnmap",
            DriverCall::SetAccess => "cuMemSetAccess",
            DriverCall::MemAlloc => "cuMemAlloc",
            DriverCall::MemFree => "cuMemFree",
            DriverCall::EventCreate => "cuEventCreate",
            DriverCall::EventRecord => "cuEventRecord",
            DriverCall::EventQuery => "cuEventQuery",
            DriverCall::EventSynchronize => "cuEventSynchronize",
            DriverCall::EventDestroy => "cuEventDestroy",
            DriverCall::StreamWaitEvent => "cuStreamWaitEvent",
            DriverCall::DeviceSynchronize => "cuCtxSynchronize",
            DriverCall::StreamSynchronize => "cuStreamSynchronize",
            DriverCall::ExportHandle => "cuMemExportToShareableHandle",
            DriverCall::ImportHandle => "cuMemImportFromShareableHandle",
            DriverCall::IpcGetHandle => "cuIpcGetMemHandle",
            DriverCall::IpcOpen => "cuIpcOpenMemHandle",
            DriverCall::IpcClose => "cuIpcCloseMemHandle",
        }
    }

    /// A short snake_case name, used as a stats key (`num_driver_calls.<name>`).
    pub fn key(self) -> &'static str {
        match self {
            DriverCall::DeviceCount => "device_count",
            DriverCall::Capabilities => "capabilities",
            DriverCall::MemInfo => "mem_info",
            DriverCall::ReserveVa => "reserve_va",
            DriverCall::FreeVa => "free_va",
            DriverCall::CreatePhysical => "create_physical",
            DriverCall::ReleasePhysical => "release_physical",
            DriverCall::Map => "map",
            DriverCall::Unmap => "unmap",
            DriverCall::SetAccess => "set_access",
            DriverCall::MemAlloc => "mem_alloc",
            DriverCall::MemFree => "mem_free",
            DriverCall::EventCreate => "event_create",
            DriverCall::EventRecord => "event_record",
            DriverCall::EventQuery => "event_query",
            DriverCall::EventSynchronize => "event_synchronize",
            DriverCall::EventDestroy => "event_destroy",
            DriverCall::StreamWaitEvent => "stream_wait_event",
            DriverCall::DeviceSynchronize => "device_synchronize",
            DriverCall::StreamSynchronize => "stream_synchronize",
            DriverCall::ExportHandle => "export_handle",
            DriverCall::ImportHandle => "import_handle",
            DriverCall::IpcGetHandle => "ipc_get_handle",
            DriverCall::IpcOpen => "ipc_open",
            DriverCall::IpcClose => "ipc_close",
        }
    }

    /// The call kind whose [`DriverCall::key`] is `key`.
    pub fn from_key(key: &str) -> Option<DriverCall> {
        DriverCall::ALL.iter().copied().find(|c| c.key() == key)
    }

    /// Whether the call blocks the host until GPU work has finished (a *host wait*):
    /// `cuEventSynchronize`, `cuStreamSynchronize`, `cuCtxSynchronize`, and `cuMemFree`, which
    /// synchronises the device before freeing.
    pub fn blocks_host(self) -> bool {
        matches!(
            self,
            DriverCall::EventSynchronize
                | DriverCall::StreamSynchronize
                | DriverCall::DeviceSynchronize
                | DriverCall::MemFree
        )
    }
}

impl fmt::Display for DriverCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.cuda_name())
    }
}

/// The broad class of a driver failure; the pool's recovery depends on it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum DriverErrorKind {
    /// The device has no memory for the request (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// The operation is not supported on this device or driver.
    NotSupported,
    /// An argument was rejected.
    InvalidValue,
    /// No CUDA driver library could be loaded, or it failed to initialise.
    NoDriver,
    /// The device ordinal does not exist.
    InvalidDevice,
    /// Any other driver error.
    Other,
}

/// A failed driver call: which call, the driver's numeric code, and a message.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DriverError {
    /// The call that failed.
    pub call: DriverCall,
    /// The broad class of the failure.
    pub kind: DriverErrorKind,
    /// The driver's result code (`CUresult` value; the simulator uses the same codes).
    pub code: i32,
    /// What went wrong, for humans.
    pub message: String,
}

impl DriverError {
    /// A new error.
    pub fn new(
        call: DriverCall,
        kind: DriverErrorKind,
        code: i32,
        message: impl Into<String>,
    ) -> Self {
        DriverError {
            call,
            kind,
            code,
            message: message.into(),
        }
    }

    /// Whether the call failed for lack of device memory.
    pub fn is_oom(&self) -> bool {
        self.kind == DriverErrorKind::OutOfMemory
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed with code {} ({:?}): {}",
            self.call, self.code, self.kind, self.message
        )
    }
}

impl std::error::Error for DriverError {}

/// The error of a call that driver `name` does not offer.
fn unsupported(call: DriverCall, name: &str) -> DriverError {
    DriverError::new(
        call,
        DriverErrorKind::NotSupported,
        801, // CUDA_ERROR_NOT_SUPPORTED
        format!("the {name} driver cannot share memory between processes"),
    )
}

/// Shorthand for results of driver calls.
pub type DriverResult<T> = Result<T, DriverError>;

/// The device operations the pool needs. See the module documentation for the contract.
pub trait Driver: Send + Sync + 'static {
    /// A short name for reports (`"cuda"`, `"sim"`).
    fn name(&self) -> &'static str;
    /// How many devices exist.
    fn device_count(&self) -> DriverResult<usize>;
    /// What device `dev` can do.
    fn capabilities(&self, dev: DeviceId) -> DriverResult<DeviceCaps>;
    /// Free and total memory of device `dev`.
    fn mem_info(&self, dev: DeviceId) -> DriverResult<MemInfo>;

    /// Reserves `size` bytes of virtual address space aligned to `align`.
    fn reserve_va(&self, dev: DeviceId, size: u64, align: u64) -> DriverResult<u64>;
    /// Releases a reservation made by [`Driver::reserve_va`] (all of it).
    fn free_va(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()>;
    /// Commits `size` bytes of physical device memory.
    fn create_physical(&self, dev: DeviceId, size: u64) -> DriverResult<PhysHandle>;
    /// Frees a physical handle that is no longer mapped.
    fn release_physical(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<()>;
    /// Maps the whole of `handle` (of `size` bytes) at `addr`.
    fn map(&self, dev: DeviceId, addr: u64, size: u64, handle: PhysHandle) -> DriverResult<()>;
    /// Unmaps exactly one earlier mapping `[addr, addr + size)`.
    fn unmap(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()>;
    /// Grants device `dev`, and each device of `peers`, read/write access to mapped memory
    /// `[addr, addr + size)` of device `dev` (one `cuMemSetAccess` with a descriptor per device).
    fn set_access(
        &self,
        dev: DeviceId,
        addr: u64,
        size: u64,
        peers: &[DeviceId],
    ) -> DriverResult<()>;
    /// Whether device `peer` can be granted access to memory of device `dev`
    /// (`cuDeviceCanAccessPeer(peer, dev)`; counted as a [`DriverCall::Capabilities`] query).
    /// `Ok(false)` for `peer == dev` and for drivers without peers.
    fn can_access_peer(&self, dev: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        let _ = (dev, peer);
        Ok(false)
    }

    /// Exports physical `handle` as a POSIX file descriptor that another process can import
    /// (`cuMemExportToShareableHandle`, `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). The handle
    /// must have been created exportable ([`DeviceCaps::posix_fd_handles`]). The caller owns the
    /// descriptor, and the memory lives while any process holds a handle of it.
    fn export_handle(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<OwnedFd> {
        let _ = (dev, handle);
        Err(unsupported(DriverCall::ExportHandle, self.name()))
    }
    /// Imports the memory behind `fd`, a descriptor from [`Driver::export_handle`] in this or
    /// another process (`cuMemImportFromShareableHandle`), as a new handle of device `dev`:
    /// mapped, given access and released as one this process created. `fd` stays the caller's.
    fn import_handle(&self, dev: DeviceId, fd: BorrowedFd<'_>) -> DriverResult<PhysHandle> {
        let _ = (dev, fd);
        Err(unsupported(DriverCall::ImportHandle, self.name()))
    }
    /// The CUDA IPC handle (`cuIpcGetMemHandle`) of `ptr`, the base of a [`Driver::mem_alloc`]
    /// allocation: 64 bytes another process opens with [`Driver::ipc_open`].
    fn ipc_get_handle(&self, dev: DeviceId, ptr: u64) -> DriverResult<[u8; 64]> {
        let _ = (dev, ptr);
        Err(unsupported(DriverCall::IpcGetHandle, self.name()))
    }
    /// Maps the allocation behind an IPC handle of another process into this one
    /// (`cuIpcOpenMemHandle`, with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`); returns its base.
    fn ipc_open(&self, dev: DeviceId, handle: &[u8; 64]) -> DriverResult<u64> {
        let _ = (dev, handle);
        Err(unsupported(DriverCall::IpcOpen, self.name()))
    }
    /// Unmaps memory opened with [`Driver::ipc_open`] (`cuIpcCloseMemHandle`).
    fn ipc_close(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        let _ = (dev, ptr);
        Err(unsupported(DriverCall::IpcClose, self.name()))
    }

    /// Allocates linear device memory (`cuMemAlloc`), for devices without VMM.
    fn mem_alloc(&self, dev: DeviceId, size: u64) -> DriverResult<u64>;
    /// Frees memory from [`Driver::mem_alloc`]; may synchronise the device.
    fn mem_free(&self, dev: DeviceId, ptr: u64) -> DriverResult<()>;

    /// Creates an event with timing disabled.
    fn event_create(&self, dev: DeviceId) -> DriverResult<EventId>;
    /// Records `event` on `stream`.
    fn event_record(&self, dev: DeviceId, event: EventId, stream: StreamId) -> DriverResult<()>;
    /// Whether all work captured by the last record of `event` has completed. Never blocks.
    fn event_query(&self, dev: DeviceId, event: EventId) -> DriverResult<bool>;
    /// Blocks the host until `event` has completed.
    fn event_synchronize(&self, dev: DeviceId, event: EventId) -> DriverResult<()>;
    /// Destroys an event.
    fn event_destroy(&self, dev: DeviceId, event: EventId) -> DriverResult<()>;
    /// Makes `stream` wait (on the device) until `event` has completed.
    fn stream_wait_event(
        &self,
        dev: DeviceId,
        stream: StreamId,
        event: EventId,
    ) -> DriverResult<()>;
    /// Whether `stream` is capturing a CUDA graph now (`cuStreamIsCapturing`), or, for the
    /// legacy stream, may not be used because a blocking stream of its context is capturing
    /// (an implicit dependency). A capturing stream may not wait on an event recorded outside
    /// its capture, and an event recorded on it may not be queried while the capture lasts
    /// (either breaks the capture). An error (a destroyed stream, say) is the caller's to weigh: where a
    /// wrong "no" could break a capture it counts as capturing; where a wrong "yes" would keep
    /// a block pending for ever, it falls through to the path that handles a stream that
    /// cannot be used. The default is for drivers without graphs: never.
    fn stream_capturing(&self, dev: DeviceId, stream: StreamId) -> DriverResult<bool> {
        let _ = (dev, stream);
        Ok(false)
    }
    /// Says that `stream` is about to be destroyed (or just was), or that its handle now names
    /// another stream: the driver forgets what it knew of it and does not ask of the handle
    /// unprompted (the CUDA backend asks streams it found capturing whether they still are
    /// before a device synchronisation). The default keeps nothing: nothing to do.
    fn forget_stream(&self, stream: StreamId) {
        let _ = stream;
    }
    /// Blocks the host until all work on device `dev` has completed. A driver may refuse while
    /// a graph capture it can see is under way, which the call would break (the CUDA backend:
    /// "Stream capture" in its module docs); callers treat that as any failed synchronisation.
    fn device_synchronize(&self, dev: DeviceId) -> DriverResult<()>;
    /// Blocks the host until all work queued on `stream` so far has completed
    /// (`cuStreamSynchronize`). The default records a fresh event there and waits for it.
    fn stream_synchronize(&self, dev: DeviceId, stream: StreamId) -> DriverResult<()> {
        let ev = self.event_create(dev)?;
        let r = self
            .event_record(dev, ev, stream)
            .and_then(|()| self.event_synchronize(dev, ev));
        let _ = self.event_destroy(dev, ev);
        r
    }

    /// What `stream` names on the calling thread: its device and its id (see [`StreamInfo`]).
    /// The special handles (`0`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) are resolved on
    /// device `dev`. The default is for drivers where any value is a stream of device `dev`
    /// (the simulator, whose caller's streams no driver created): the handle is the id, and
    /// no handle is special.
    fn stream_info(&self, dev: DeviceId, stream: StreamId) -> DriverResult<StreamInfo> {
        Ok(StreamInfo {
            device: dev,
            id: stream.0,
            per_thread: false,
            capturing: false,
        })
    }

    /// The device of the calling thread's current context, when it is one of this driver's
    /// (`None`: no current context, or a driver without the notion).
    fn current_device(&self) -> Option<DeviceId> {
        None
    }

    /// Called when the pool hands `[ptr, ptr + size)` to a user on `stream`. Real drivers ignore
    /// it; the simulator records a hazard if unfinished work on another stream touches the range.
    #[inline]
    fn note_handout(&self, dev: DeviceId, ptr: u64, size: u64, stream: StreamId) {
        let _ = (dev, ptr, size, stream);
    }
}

impl<D: Driver + ?Sized> Driver for Arc<D> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn device_count(&self) -> DriverResult<usize> {
        (**self).device_count()
    }
    fn capabilities(&self, dev: DeviceId) -> DriverResult<DeviceCaps> {
        (**self).capabilities(dev)
    }
    fn mem_info(&self, dev: DeviceId) -> DriverResult<MemInfo> {
        (**self).mem_info(dev)
    }
    fn reserve_va(&self, dev: DeviceId, size: u64, align: u64) -> DriverResult<u64> {
        (**self).reserve_va(dev, size, align)
    }
    fn free_va(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        (**self).free_va(dev, addr, size)
    }
    fn create_physical(&self, dev: DeviceId, size: u64) -> DriverResult<PhysHandle> {
        (**self).create_physical(dev, size)
    }
    fn release_physical(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<()> {
        (**self).release_physical(dev, handle)
    }
    fn map(&self, dev: DeviceId, addr: u64, size: u64, handle: PhysHandle) -> DriverResult<()> {
        (**self).map(dev, addr, size, handle)
    }
    fn unmap(&self, dev: DeviceId, addr: u64, size: u64) -> DriverResult<()> {
        (**self).unmap(dev, addr, size)
    }
    fn set_access(
        &self,
        dev: DeviceId,
        addr: u64,
        size: u64,
        peers: &[DeviceId],
    ) -> DriverResult<()> {
        (**self).set_access(dev, addr, size, peers)
    }
    fn can_access_peer(&self, dev: DeviceId, peer: DeviceId) -> DriverResult<bool> {
        (**self).can_access_peer(dev, peer)
    }
    fn export_handle(&self, dev: DeviceId, handle: PhysHandle) -> DriverResult<OwnedFd> {
        (**self).export_handle(dev, handle)
    }
    fn import_handle(&self, dev: DeviceId, fd: BorrowedFd<'_>) -> DriverResult<PhysHandle> {
        (**self).import_handle(dev, fd)
    }
    fn ipc_get_handle(&self, dev: DeviceId, ptr: u64) -> DriverResult<[u8; 64]> {
        (**self).ipc_get_handle(dev, ptr)
    }
    fn ipc_open(&self, dev: DeviceId, handle: &[u8; 64]) -> DriverResult<u64> {
        (**self).ipc_open(dev, handle)
    }
    fn ipc_close(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        (**self).ipc_close(dev, ptr)
    }
    fn mem_alloc(&self, dev: DeviceId, size: u64) -> DriverResult<u64> {
        (**self).mem_alloc(dev, size)
    }
    fn mem_free(&self, dev: DeviceId, ptr: u64) -> DriverResult<()> {
        (**self).mem_free(dev, ptr)
    }
    fn event_create(&self, dev: DeviceId) -> DriverResult<EventId> {
        (**self).event_create(dev)
    }
    fn event_record(&self, dev: DeviceId, event: EventId, stream: StreamId) -> DriverResult<()> {
        (**self).event_record(dev, event, stream)
    }
    fn event_query(&self, dev: DeviceId, event: EventId) -> DriverResult<bool> {
        (**self).event_query(dev, event)
    }
    fn event_synchronize(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        (**self).event_synchronize(dev, event)
    }
    fn event_destroy(&self, dev: DeviceId, event: EventId) -> DriverResult<()> {
        (**self).event_destroy(dev, event)
    }
    fn stream_wait_event(
        &self,
        dev: DeviceId,
        stream: StreamId,
        event: EventId,
    ) -> DriverResult<()> {
        (**self).stream_wait_event(dev, stream, event)
    }
    fn stream_capturing(&self, dev: DeviceId, stream: StreamId) -> DriverResult<bool> {
        (**self).stream_capturing(dev, stream)
    }
    fn forget_stream(&self, stream: StreamId) {
        (**self).forget_stream(stream)
    }
    fn device_synchronize(&self, dev: DeviceId) -> DriverResult<()> {
        (**self).device_synchronize(dev)
    }
    fn stream_synchronize(&self, dev: DeviceId, stream: StreamId) -> DriverResult<()> {
        (**self).stream_synchronize(dev, stream)
    }
    fn stream_info(&self, dev: DeviceId, stream: StreamId) -> DriverResult<StreamInfo> {
        (**self).stream_info(dev, stream)
    }
    fn current_device(&self) -> Option<DeviceId> {
        (**self).current_device()
    }
    #[inline]
    fn note_handout(&self, dev: DeviceId, ptr: u64, size: u64, stream: StreamId) {
        (**self).note_handout(dev, ptr, size, stream)
    }
}
