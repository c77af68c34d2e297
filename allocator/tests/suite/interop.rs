//! cudarc interop: the typed view of pooled buffers and the stream conversions run everywhere
//! (on the simulated GPU); binding to cudarc and running on it need a GPU and skip without one.

use std::sync::Arc;

use cistern::interop::{
    byte_len, elem_len, raw_stream, stream_id, stream_id_from_raw, CudaBuffer, InteropError,
    TypedBuffer,
};
use cistern::{Config, CudaDriver, Error, Pool, SimConfig, SimDriver, StreamId};
use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut, DeviceSlice};

fn sim_pool() -> Pool<SimDriver> {
    Pool::new(SimDriver::new(SimConfig::default()), Config::default()).unwrap()
}

#[test]
fn byte_and_element_lengths() {
    assert_eq!(byte_len::<f32>(0).unwrap(), 0);
    assert_eq!(byte_len::<f32>(3).unwrap(), 12);
    assert_eq!(byte_len::<u8>(5).unwrap(), 5);
    assert_eq!(byte_len::<[f64; 3]>(2).unwrap(), 48);
    assert!(matches!(
        byte_len::<u64>(usize::MAX),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(byte_len::<()>(1), Err(Error::InvalidArgument(_))));

    assert_eq!(elem_len::<f32>(12).unwrap(), 3);
    assert_eq!(elem_len::<f32>(0).unwrap(), 0);
    assert_eq!(elem_len::<[u16; 3]>(12).unwrap(), 2);
    let e = elem_len::<f32>(10).unwrap_err();
    assert!(e.to_string().contains("whole number"), "{e}");
    assert!(elem_len::<()>(4).is_err());
}

#[test]
fn stream_ids_round_trip_through_raw_handles() {
    assert_eq!(stream_id_from_raw(std::ptr::null_mut()), StreamId::DEFAULT);
    // cudarc's per-thread stream is the handle 0x2.
    assert_eq!(stream_id_from_raw(2usize as CUstream), StreamId(2));
    for id in [0u64, 2, 0x7f12_3456_7000, u64::from(u32::MAX) + 1] {
        let s = StreamId(id);
        assert_eq!(raw_stream(s) as usize as u64, id);
        assert_eq!(stream_id_from_raw(raw_stream(s)), s);
    }
}

#[test]
fn typed_buffers_count_elements_and_bytes() {
    let pool = sim_pool();
    let s = StreamId(7);
    let b = TypedBuffer::<f32, _>::alloc(&pool, 0, 1000, s).unwrap();
    assert_eq!(b.len(), 1000);
    assert!(!b.is_empty());
    assert_eq!(b.num_bytes(), 4000);
    assert_eq!(b.buffer().len(), 4000);
    assert_eq!(b.stream(), s);
    assert_eq!(b.device(), 0);
    assert_ne!(b.ptr(), 0);
    assert_eq!(b.ptr() % std::mem::align_of::<f32>() as u64, 0);
    assert_eq!(
        pool.stats(0).unwrap().get("allocated_bytes.all.current"),
        4096
    );

    let raw = b.into_buffer();
    assert_eq!(raw.len(), 4000);
    // The same bytes as u16 or [f32; 4]; not as [u8; 3] (4000 is no multiple of 3).
    let as_u16 = TypedBuffer::<u16, _>::from_buffer(raw).unwrap();
    assert_eq!(as_u16.len(), 2000);
    let as_vec4 = TypedBuffer::<[f32; 4], _>::from_buffer(as_u16.into_buffer()).unwrap();
    assert_eq!(as_vec4.len(), 250);
    let err = TypedBuffer::<[u8; 3], _>::from_buffer(as_vec4.into_buffer()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // The rejected buffer was freed.
    assert_eq!(pool.stats(0).unwrap().get("allocated_bytes.all.current"), 0);

    let empty = TypedBuffer::<f64, _>::alloc(&pool, 0, 0, s).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.num_bytes(), 0);
    assert_eq!(empty.ptr(), 0);

    assert!(TypedBuffer::<f32, _>::alloc(&pool, 0, usize::MAX, s).is_err());
    assert!(TypedBuffer::<f32, _>::alloc(&pool, 99, 1, s).is_err());
    pool.check_invariants().unwrap();
}

#[test]
fn buffers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    // Element types that are neither Send nor Sync on the host do not matter: no T is held.
    check::<TypedBuffer<*const u8, SimDriver>>();
    check::<CudaBuffer<*const u8, CudaDriver>>();
}

/// A pool and a cudarc context on device 0, or `None` (with a visible note) without a GPU.
fn gpu(test: &str) -> Option<(Pool<CudaDriver>, Arc<CudaContext>)> {
    let driver = match CudaDriver::new() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: {test}: no usable CUDA driver here ({e})");
            return None;
        }
    };
    let ctx = CudaContext::new(0).expect("cistern found a GPU but cudarc cannot open device 0");
    Some((Pool::new(driver, Config::default()).unwrap(), ctx))
}

#[test]
fn cuda_buffers_copy_and_track_streams() {
    let Some((pool, ctx)) = gpu("cuda_buffers_copy_and_track_streams") else {
        return;
    };
    let s = ctx.new_stream().unwrap();
    let t = ctx.new_stream().unwrap();
    let mut b = CudaBuffer::<u32, _>::alloc(&pool, &s, 4096).unwrap();
    assert_eq!(DeviceSlice::len(&b), 4096);
    assert_eq!(b.num_bytes(), 4096 * 4);
    assert_eq!(b.typed().stream(), stream_id(&s));
    assert_eq!(stream_id(b.cuda_stream()), stream_id(&s));

    let host: Vec<u32> = (0..4096).collect();
    s.memcpy_htod(&host, &mut b).unwrap();
    // Read back on the other stream: it must wait for the copy on `s` (write event) and the
    // pool must learn that `t` uses the block.
    let before = pool.stats(0).unwrap().get("num_record_streams");
    assert_eq!(t.clone_dtoh(&b).unwrap(), host);
    assert!(pool.stats(0).unwrap().get("num_record_streams") > before);
    let ptr = b.typed().ptr();
    {
        let (p, _g) = b.device_ptr_mut(&s);
        assert_eq!(p, ptr);
    }
    {
        let (p, _g) = b.device_ptr(&t);
        assert_eq!(p, ptr);
    }
    drop(b);
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    ctx.check_err().unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn cuda_buffer_rejects_a_foreign_stream() {
    let Some((pool, ctx)) = gpu("cuda_buffer_rejects_a_foreign_stream") else {
        return;
    };
    let s = ctx.new_stream().unwrap();
    let t = ctx.new_stream().unwrap();
    let typed = TypedBuffer::<f32, _>::alloc(&pool, 0, 16, stream_id(&s)).unwrap();
    match CudaBuffer::new(typed, t) {
        Err(InteropError::Mismatch(m)) => assert!(m.contains("stream"), "{m}"),
        other => panic!("expected a stream mismatch, got {other:?}"),
    }
}
