//! cudarc interop: pooled buffers as cudarc device memory (kernel arguments, copies).
//!
//! This module owns the seam between cistern's [`Buffer`] and cudarc's safe driver API
//! (`cudarc::driver`). It has three parts:
//!
//! * [`stream_id`] / [`stream_id_from_raw`] / [`raw_stream`]: a cudarc [`CudaStream`] is a
//!   `CUstream`, and so is a [`StreamId`]; these convert between them.
//! * [`TypedBuffer<T, D>`]: a [`Buffer`] seen as `len` elements of `T` (pure bookkeeping: element
//!   count, byte size, alignment; usable with any [`Driver`], the simulator included).
//! * [`CudaBuffer<T, D>`]: a typed buffer bound to the cudarc stream it was allocated on. It
//!   implements cudarc's [`DeviceSlice`], [`DevicePtr`] and [`DevicePtrMut`], so it works with
//!   `CudaStream::memcpy_htod` / `memcpy_dtoh` / `clone_dtoh` / `memcpy_dtod`, and as a kernel
//!   argument through its device pointer:
//!
//! ```ignore
//! let (x, _read_x) = x.device_ptr(&stream);
//! let (y, _write_y) = y.device_ptr_mut(&stream);
//! unsafe { stream.launch_builder(&f).arg(&a).arg(&x).arg(&y).arg(&n).launch(cfg) }?;
//! // the guards drop here, after the launch was queued
//! ```
//!
//! cudarc's `PushKernelArg` cannot be implemented for `&CudaBuffer` with the same event tracking
//! as `&CudaSlice`: `LaunchArgs`' event lists are private to cudarc. Taking the pointer through
//! [`DevicePtr`] / [`DevicePtrMut`] does the same synchronisation, and the guard it returns must
//! live until the launch is queued (as above).
//!
//! # Note [Stream ordering of pooled buffers]
//!
//! A pooled block is valid on its allocation stream `S` as soon as it is handed out, but it may
//! have been freed on `S` a moment ago with the previous owner's work still queued there. Using
//! it on another stream `T` therefore needs two things:
//!
//! 1. `T` must wait for the work queued on `S` (the previous owner's, and any copy into the new
//!    buffer). [`CudaBuffer`] keeps cudarc's two events (last read, last write), exactly as
//!    `CudaSlice` does, and records its *write* event on `S` when it is created; every
//!    `device_ptr` on `T` waits for the write event, every `device_ptr_mut` for both.
//! 2. The pool must not reuse the block until `T`'s work on it has finished. The first time the
//!    buffer is used on `T`, and every time after, it calls [`Buffer::record_stream`] with `T`:
//!    when the buffer is dropped (freed on `S`), the pool waits on an event recorded on `T`
//!    before it hands the block out again. Nothing blocks the host, and `S` never waits for `T`.
//!
//! The events follow cudarc's policy: they exist when the context tracks events (the default)
//! and are waited on and recorded only while it manages stream synchronisation (once a second
//! stream exists, see `CudaContext::is_managing_stream_synchronization`). With tracking
//! disabled, ordering `T` after `S` is the caller's job, as with `CudaSlice`; the
//! `record_stream` of point 2 happens regardless, so the pool never reuses a block early.
//!
//! A stream of *another* context (another device) cannot be waited on by the pool's events;
//! for such a stream `device_ptr` makes it wait for `S`, skips `record_stream`, and returns a
//! guard that synchronises the stream when dropped (cudarc's `SyncOnDrop::Sync`), so the block
//! cannot be freed while that work runs. This is slow and meant for rare peer access only.
//!
//! # Contexts
//!
//! The pool's [`CudaDriver`](crate::CudaDriver) works in each device's *primary* context, the
//! one `CudaContext::new(ordinal)` retains, so pooled pointers are valid in cudarc's context for
//! the same device. A [`CudaBuffer`] must be created with a stream of that device
//! ([`CudaBuffer::new`] checks the ordinal).
//!
//! This module needs no `unsafe`: the conversions are plain integer/pointer casts, and the
//! cudarc calls it makes are safe functions.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError as CudaError,
    SyncOnDrop,
};

use crate::driver::{DeviceId, Driver, StreamId};
use crate::error::Error;
use crate::pool::{Buffer, Pool};

/// The [`StreamId`] of a cudarc stream: its raw `CUstream` (`0` for cudarc's default stream,
/// `2` for its per-thread stream).
pub fn stream_id(stream: &CudaStream) -> StreamId {
    stream_id_from_raw(stream.cu_stream())
}

/// The [`StreamId`] of a raw `CUstream` handle.
pub fn stream_id_from_raw(raw: CUstream) -> StreamId {
    StreamId(raw as usize as u64)
}

/// The raw `CUstream` handle of a [`StreamId`] (for `CudaContext::wrap_borrowed_stream`, whose
/// safety conditions the caller must meet).
pub fn raw_stream(id: StreamId) -> CUstream {
    id.0 as usize as CUstream
}

/// The size in bytes of `len` elements of `T`.
///
/// Fails for zero-sized `T` (a device buffer of them has no meaning) and on overflow.
pub fn byte_len<T>(len: usize) -> Result<u64, Error> {
    let size = std::mem::size_of::<T>();
    if size == 0 {
        return Err(Error::InvalidArgument(format!(
            "{} is zero-sized: it cannot be a device buffer element",
            std::any::type_name::<T>()
        )));
    }
    len.checked_mul(size)
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{len} elements of {} ({size} B each) overflow the address space",
                std::any::type_name::<T>()
            ))
        })
}

/// How many elements of `T` fit exactly in `bytes`; fails when `bytes` is not a whole number of
/// elements (or `T` is zero-sized).
pub fn elem_len<T>(bytes: u64) -> Result<usize, Error> {
    let size = std::mem::size_of::<T>() as u64;
    if size == 0 {
        return byte_len::<T>(0).map(|_| 0);
    }
    if !bytes.is_multiple_of(size) {
        return Err(Error::InvalidArgument(format!(
            "{bytes} B is not a whole number of {} ({size} B each)",
            std::any::type_name::<T>()
        )));
    }
    usize::try_from(bytes / size).map_err(|_| {
        Error::InvalidArgument(format!("{bytes} B is too large for this host's usize"))
    })
}

/// A pooled [`Buffer`] seen as `len()` elements of `T`. Returns its memory to the pool on drop.
///
/// This is bookkeeping only (no device access), so it works with any [`Driver`]; bind it to a
/// cudarc stream with [`CudaBuffer::new`] to use it with cudarc.
pub struct TypedBuffer<T, D: Driver> {
    buf: Buffer<D>,
    len: usize,
    // `fn() -> T`: the buffer holds no `T` on the host, so it is Send + Sync whatever `T` is.
    _elem: PhantomData<fn() -> T>,
}

impl<T, D: Driver> TypedBuffer<T, D> {
    /// Allocates `len` elements of `T` on device `dev` for use on `stream`.
    pub fn alloc(
        pool: &Pool<D>,
        dev: DeviceId,
        len: usize,
        stream: StreamId,
    ) -> Result<Self, Error> {
        let bytes = byte_len::<T>(len)?;
        let buf = pool.try_alloc(dev, bytes, stream)?;
        Self::from_buffer(buf)
    }

    /// Views `buf` as elements of `T`. Fails (and frees `buf`) when its size is not a whole
    /// number of elements or its address is not aligned for `T`.
    pub fn from_buffer(buf: Buffer<D>) -> Result<Self, Error> {
        let len = elem_len::<T>(buf.len())?;
        let align = std::mem::align_of::<T>() as u64;
        if !buf.ptr().is_multiple_of(align) {
            return Err(Error::InvalidArgument(format!(
                "buffer at {:#x} is not aligned for {} (alignment {align})",
                buf.ptr(),
                std::any::type_name::<T>()
            )));
        }
        Ok(TypedBuffer {
            buf,
            len,
            _elem: PhantomData,
        })
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes (`len() * size_of::<T>()`).
    pub fn num_bytes(&self) -> u64 {
        self.buf.len()
    }

    /// The device address of the first element (0 when empty).
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }

    /// The stream the memory was allocated on.
    pub fn stream(&self) -> StreamId {
        self.buf.stream()
    }

    /// The device the memory lives on.
    pub fn device(&self) -> DeviceId {
        self.buf.device()
    }

    /// The untyped buffer.
    pub fn buffer(&self) -> &Buffer<D> {
        &self.buf
    }

    /// Gives back the untyped buffer.
    pub fn into_buffer(self) -> Buffer<D> {
        self.buf
    }
}

impl<T, D: Driver> std::fmt::Debug for TypedBuffer<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TypedBuffer")
            .field("elem", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("buf", &self.buf)
            .finish()
    }
}

/// A failure to bind a pooled buffer to cudarc.
#[derive(Debug, thiserror::Error)]
pub enum InteropError {
    /// The pool refused the allocation, or the buffer does not fit the element type.
    #[error(transparent)]
    Pool(#[from] Error),
    /// A cudarc call (event creation or record) failed.
    #[error("cudarc: {0}")]
    Cuda(#[from] CudaError),
    /// The buffer and the cudarc stream do not belong together.
    #[error("buffer and stream do not match: {0}")]
    Mismatch(String),
}

/// A pooled buffer of `T` bound to the cudarc stream it was allocated on: cudarc device memory.
///
/// Implements [`DevicePtr<T>`] and [`DevicePtrMut<T>`] with the stream ordering described in
/// [Note \[Stream ordering of pooled buffers\]](self#note-stream-ordering-of-pooled-buffers).
/// Returns its memory to the pool on drop (on its allocation stream, without blocking).
pub struct CudaBuffer<T, D: Driver> {
    inner: TypedBuffer<T, D>,
    stream: Arc<CudaStream>,
    read: Option<CudaEvent>,
    write: Option<CudaEvent>,
}

impl<T, D: Driver> CudaBuffer<T, D> {
    /// Allocates `len` elements of `T` from `pool` on `stream`'s device, for use on `stream`.
    pub fn alloc(
        pool: &Pool<D>,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Self, InteropError> {
        let dev = stream.context().ordinal();
        let inner = TypedBuffer::alloc(pool, dev, len, stream_id(stream))?;
        Self::new(inner, stream.clone())
    }

    /// Binds `inner` to `stream`, which must be the stream it was allocated on, on its device.
    pub fn new(inner: TypedBuffer<T, D>, stream: Arc<CudaStream>) -> Result<Self, InteropError> {
        if stream_id(&stream) != inner.stream() {
            return Err(InteropError::Mismatch(format!(
                "buffer allocated on stream {}, cudarc stream is {}",
                inner.stream(),
                stream_id(&stream)
            )));
        }
        let ctx = stream.context();
        if ctx.ordinal() != inner.device() {
            return Err(InteropError::Mismatch(format!(
                "buffer on device {}, cudarc stream on device {}",
                inner.device(),
                ctx.ordinal()
            )));
        }
        let (read, write) = if ctx.is_event_tracking() {
            (Some(ctx.new_event(None)?), Some(ctx.new_event(None)?))
        } else {
            (None, None)
        };
        if ctx.is_managing_stream_synchronization() {
            if let Some(w) = &write {
                // The allocation itself is the first "write": another stream must wait for the
                // work already queued on the allocation stream (see the module note).
                w.record(&stream)?;
            }
        }
        Ok(CudaBuffer {
            inner,
            stream,
            read,
            write,
        })
    }

    /// The typed buffer.
    pub fn typed(&self) -> &TypedBuffer<T, D> {
        &self.inner
    }

    /// The allocation stream.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Unbinds from cudarc. The caller takes over ordering other streams after the allocation
    /// stream (cudarc's events are dropped).
    pub fn into_typed(self) -> TypedBuffer<T, D> {
        self.inner
    }

    /// Prepares use on `stream`. Returns `false` when `stream` is of another context, where the
    /// events and the pool cannot follow it.
    fn prepare(&self, stream: &CudaStream) -> bool {
        if stream.context() != self.stream.context() {
            // Order the foreign stream after everything queued on the allocation stream. An
            // event can be waited on from any context.
            let r = self
                .stream
                .record_event(None)
                .and_then(|ev| stream.wait(&ev));
            stream.context().record_err(r);
            return false;
        }
        let id = stream_id(stream);
        if id != self.inner.stream() {
            if let Err(e) = self.inner.buf.record_stream(id) {
                // The pool cannot follow the stream: order it after the allocation stream
                // instead, as for a stream of another context.
                crate::log_rate_limited(&format!("cistern: {e}"));
                let r = self
                    .stream
                    .record_event(None)
                    .and_then(|ev| stream.wait(&ev));
                stream.context().record_err(r);
                return false;
            }
        }
        true
    }
}

impl<T, D: Driver> DeviceSlice<T> for CudaBuffer<T, D> {
    fn len(&self) -> usize {
        self.inner.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T, D: Driver> DevicePtr<T> for CudaBuffer<T, D> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        if !self.prepare(stream) {
            return (self.inner.ptr(), SyncOnDrop::sync_stream(stream));
        }
        let ctx = self.stream.context();
        if ctx.is_managing_stream_synchronization() {
            if let Some(w) = &self.write {
                ctx.record_err(stream.wait(w));
            }
        }
        (
            self.inner.ptr(),
            SyncOnDrop::record_event(&self.read, stream),
        )
    }
}

impl<T, D: Driver> DevicePtrMut<T> for CudaBuffer<T, D> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        if !self.prepare(stream) {
            return (self.inner.ptr(), SyncOnDrop::sync_stream(stream));
        }
        let ctx = self.stream.context();
        if ctx.is_managing_stream_synchronization() {
            if let Some(r) = &self.read {
                ctx.record_err(stream.wait(r));
            }
            if let Some(w) = &self.write {
                ctx.record_err(stream.wait(w));
            }
        }
        (
            self.inner.ptr(),
            SyncOnDrop::record_event(&self.write, stream),
        )
    }
}

impl<T, D: Driver> std::fmt::Debug for CudaBuffer<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("inner", &self.inner)
            .field("stream", &stream_id(&self.stream))
            .field("tracked", &self.write.is_some())
            .finish()
    }
}
