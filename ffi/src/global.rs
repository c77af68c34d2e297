//! The process's one pool: which driver it runs on, created on first use.
//!
//! This module owns the global [`AnyPool`] and the choice of its driver; it never reports errors
//! itself (the exports in `lib.rs` do, through [`crate::guard`]).
//!
//! # How the driver is picked
//!
//! `CISTERN_DRIVER` is read once, when the pool is created (the first export called, or
//! `cistern_init`):
//!
//! * unset, empty, `auto` or `cuda`: the CUDA driver (`libcuda.so`, each device's primary
//!   context). Without a driver, creation fails with a message that names the fix (install the
//!   driver, or set `CISTERN_DRIVER=sim`). The C ABI never falls back to the simulator on its
//!   own: a program that believes it allocates GPU memory must not silently get simulated
//!   addresses.
//! * `sim`: the simulated GPU ([`SimDriver`]), sized by `CISTERN_SIM`
//!   (`capacity:80GiB,devices:1,granularity:2MiB,vmm:true`). Its addresses are not backed by
//!   memory: for tests and dry runs of the bookkeeping only.
//!
//! The pool's settings come from `CISTERN_CONF` ([`Config::from_env`]). A failure (no driver, a
//! bad setting) is remembered: every later call fails fast with the same message, so a process
//! that started without a driver keeps saying why.
//!
//! The pool is an enum over the two concrete pool types rather than a pool over
//! `Arc<dyn Driver>`: the hot path then dispatches once per call, on a predictable branch,
//! instead of through a vtable inside the pool (the driver's hazard hook runs on every
//! allocation).

use std::sync::{Arc, OnceLock};

use cistern_alloc::open::{choice_from_env, sim_config_from_env, DriverChoice};
use cistern_alloc::{Config, CudaDriver, DevicePool, Driver, Error, Pool, SimDriver};

/// The global pool, on whichever driver `CISTERN_DRIVER` chose.
pub(crate) enum AnyPool {
    /// On the CUDA driver.
    Cuda(Pool<CudaDriver>),
    /// On the simulated GPU.
    Sim(Pool<SimDriver>),
}

/// Runs `$body` with `$p` bound to the concrete pool inside an [`AnyPool`].
macro_rules! with_pool {
    ($any:expr, |$p:ident| $body:expr) => {
        match $any {
            $crate::global::AnyPool::Cuda($p) => $body,
            $crate::global::AnyPool::Sim($p) => $body,
        }
    };
}
pub(crate) use with_pool;

static POOL: OnceLock<Result<AnyPool, String>> = OnceLock::new();

/// The global pool, created on first use; `Err` with the remembered reason when it could not
/// be created.
#[inline]
pub(crate) fn pool() -> Result<&'static AnyPool, &'static str> {
    match POOL.get_or_init(open) {
        Ok(p) => Ok(p),
        Err(e) => Err(e),
    }
}

/// Creates the pool from the environment.
#[cold]
fn open() -> Result<AnyPool, String> {
    let inner = || -> cistern_alloc::Result<AnyPool> {
        let config = Config::from_env()?;
        Ok(match choice_from_env()? {
            DriverChoice::Sim => {
                AnyPool::Sim(Pool::new(SimDriver::new(sim_config_from_env()?), config)?)
            }
            DriverChoice::Cuda | DriverChoice::Auto => {
                AnyPool::Cuda(Pool::new(CudaDriver::new()?, config)?)
            }
        })
    };
    inner().map_err(|e| format!("cannot start: {e}"))
}

/// The pool of device `device` (a C `int`), created on first use.
#[inline]
pub(crate) fn device<D: Driver>(
    pool: &Pool<D>,
    device: std::ffi::c_int,
) -> cistern_alloc::Result<&Arc<DevicePool<D>>> {
    match usize::try_from(device) {
        Ok(d) => pool.device(d),
        Err(_) => Err(Error::InvalidArgument(format!(
            "device {device} is negative ({} device(s) visible)",
            pool.device_count()
        ))),
    }
}
