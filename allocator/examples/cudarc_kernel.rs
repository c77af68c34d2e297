//! Pooled buffers as cudarc kernel arguments: `y = a*x + y` on two streams.
//!
//! Allocates `x` and `y` from a cistern pool on one cudarc stream, fills them with cudarc
//! copies, runs a SAXPY kernel on that stream and then again on a second stream (which exercises
//! the cross-stream path: waits on the buffers' events and `record_stream` in the pool), copies
//! `y` back, checks it, frees the buffers and prints the pool's report.
//!
//! Run with `cargo run -p cistern --example cudarc_kernel`. Without a GPU it prints why and
//! exits successfully.

use std::error::Error;
use std::sync::Arc;

use cistern::interop::CudaBuffer;
use cistern::{Config, CudaDriver, Pool};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

/// `saxpy(float a, float *x, float *y, unsigned n)`: `y[i] = fma(a, x[i], y[i])` for `i < n`.
///
/// PTX ISA 4.1 for sm_52, so any driver and any GPU from Maxwell on can JIT it. Emitted by
/// LLVM 14's NVPTX backend (`llc -march=nvptx64 -mcpu=sm_52`) from the obvious IR, plus the
/// `cvta.to.global` conversions nvcc emits for kernel pointer arguments.
const SAXPY_PTX: &str = r#"
.version 4.1
.target sm_52
.address_size 64

.visible .entry saxpy(
	.param .f32 saxpy_param_0,
	.param .u64 saxpy_param_1,
	.param .u64 saxpy_param_2,
	.param .u32 saxpy_param_3
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<6>;
	.reg .f32 	%f<5>;
	.reg .b64 	%rd<8>;

	mov.u32 	%r1, %tid.x;
	mov.u32 	%r2, %ntid.x;
	ld.param.u32 	%r3, [saxpy_param_3];
	mov.u32 	%r4, %ctaid.x;
	mad.lo.s32 	%r5, %r4, %r2, %r1;
	setp.ge.u32 	%p1, %r5, %r3;
	@%p1 bra 	LBB0_2;
	ld.param.f32 	%f1, [saxpy_param_0];
	ld.param.u64 	%rd6, [saxpy_param_1];
	ld.param.u64 	%rd7, [saxpy_param_2];
	cvta.to.global.u64 	%rd3, %rd6;
	cvta.to.global.u64 	%rd4, %rd7;
	mul.wide.u32 	%rd5, %r5, 4;
	add.s64 	%rd1, %rd3, %rd5;
	add.s64 	%rd2, %rd4, %rd5;
	ld.global.f32 	%f2, [%rd1];
	ld.global.f32 	%f3, [%rd2];
	fma.rn.f32 	%f4, %f1, %f2, %f3;
	st.global.f32 	[%rd2], %f4;
LBB0_2:
	ret;
}
"#;

/// Elements per buffer: 4 MiB of `f32` each, so the results below are exact in `f32`.
const N: usize = 1 << 20;

fn main() -> Result<(), Box<dyn Error>> {
    let driver = match CudaDriver::new() {
        Ok(d) => d,
        Err(e) => {
            println!("cudarc_kernel: {e}");
            println!("cudarc_kernel: this example needs a CUDA GPU; nothing to do here");
            return Ok(());
        }
    };
    // The pool uses device 0's primary context; CudaContext::new(0) retains the same one, so
    // pooled pointers are valid in cudarc's kernels and copies.
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let other = ctx.new_stream()?;
    let pool = Pool::new(driver, Config::default())?;
    println!(
        "device 0: {} (cudarc stream {:?}, second stream {:?})",
        ctx.name()?,
        cistern::interop::stream_id(&stream),
        cistern::interop::stream_id(&other)
    );

    let module = ctx.load_module(Ptx::from_src(SAXPY_PTX))?;
    let saxpy = module.load_function("saxpy")?;

    {
        let mut x = CudaBuffer::<f32, _>::alloc(&pool, &stream, N)?;
        let mut y = CudaBuffer::<f32, _>::alloc(&pool, &stream, N)?;
        println!("x: {:?}", x.typed());
        println!("y: {:?}", y.typed());

        let hx: Vec<f32> = (0..N).map(|i| i as f32).collect();
        let hy = vec![1.0f32; N];
        stream.memcpy_htod(&hx, &mut x)?;
        stream.memcpy_htod(&hy, &mut y)?;

        // y = 2x + 1 on the allocation stream: plain stream order.
        launch_saxpy(&stream, &saxpy, 2.0, &x, &mut y)?;
        // y = 2x + y = 4x + 1 on a second stream: it waits for the first launch through the
        // buffers' events, and the pool learns (record_stream) that `other` uses them.
        launch_saxpy(&other, &saxpy, 2.0, &x, &mut y)?;

        // Copy back on the allocation stream, which waits for `other`'s write.
        let out = stream.clone_dtoh(&y)?;
        let bad = (0..N)
            .filter(|&i| out[i] != 4.0 * i as f32 + 1.0)
            .take(5)
            .collect::<Vec<_>>();
        if !bad.is_empty() {
            let shown: Vec<_> = bad.iter().map(|&i| (i, out[i])).collect();
            return Err(format!("wrong results (index, value): {shown:?}").into());
        }
        println!("y = 2x + (2x + 1): all {N} elements correct");
        // x and y drop here: freed on `stream`, not reused until `other`'s work is done.
    }
    ctx.check_err()?;
    pool.check_invariants()?;
    println!("{}", pool.report());
    Ok(())
}

/// Queues `y = a*x + y` on `stream`.
fn launch_saxpy(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    a: f32,
    x: &CudaBuffer<f32, CudaDriver>,
    y: &mut CudaBuffer<f32, CudaDriver>,
) -> Result<(), Box<dyn Error>> {
    let n = u32::try_from(N)?;
    // The guards must live until the launch is queued: they record the read and the write.
    let (xp, _read_x) = x.device_ptr(stream);
    let (yp, _write_y) = y.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(f);
    launch.arg(&a).arg(&xp).arg(&yp).arg(&n);
    // SAFETY: `saxpy` takes (f32, f32*, f32*, u32), the arguments pushed above in that order;
    // x and y hold N = n f32 each and live until after the launch is ordered (the guards above
    // and the pool's record_stream), and the kernel touches only indices below n.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    Ok(())
}
