//! The process's one pool: which driver it runs on, created on first use.
//!
//! This module owns the global [`AnyPool`] and the choice of its driver; it never reports errors
//! itself (the exports in `lib.rs` do, through [`crate::guard`]), except the one line that says
//! the registry could not be used.
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
//! The pool's settings come from `CISTERN_CONF` ([`Config::from_env`]); a `record:PATH` that
//! cannot be written is refused then, not on the first allocation. A failure (no driver, a
//! bad setting) is remembered: every later call fails fast with the same message, so a process
//! that started without a driver keeps saying why.
//!
//! # The registry
//!
//! When the pool is created, it is published in the cross-process registry (unless
//! `CISTERN_CONF=registry:off`; `registry_dir:PATH` moves it), so that `cistern ps / leaks /
//! doctor` see this process: a background thread republishes its record at most once a second,
//! and an `atexit` hook writes the final record (with the blocks never freed) when the process
//! exits normally. A registry that cannot be used (an unsafe directory, say) is logged in one
//! line on stderr and the pool works without it. None of this is on the allocation path: the
//! registry is started once, by the thread that created the pool, after it was created.
//!
//! The pool is an enum over the two concrete pool types rather than a pool over
//! `Arc<dyn Driver>`: the hot path then dispatches once per call, on a predictable branch,
//! instead of through a vtable inside the pool (the driver's hazard hook runs on every
//! allocation).

use std::sync::{Arc, OnceLock};

use cistern_alloc::config::ConfigError;
use cistern_alloc::open::{choice_from_env, sim_config_from_env, DriverChoice};
use cistern_alloc::registry::{self, LeakEntry, ProcessSnapshot, RecordSource, Registry};
use cistern_alloc::trace_writer::Recorder;
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
    // Before anything that could take a lock a parent's thread held at fork().
    if cistern_alloc::fork::is_fork_child() {
        return Err(cistern_alloc::fork::CHILD_ERROR);
    }
    let created = match POOL.get() {
        Some(r) => r,
        None => create(),
    };
    match created {
        Ok(p) => Ok(p),
        Err(e) => Err(e),
    }
}

/// Creates the pool (once: a thread that loses the race waits for the winner's pool), then
/// publishes it in the registry from the thread that created it.
#[cold]
#[inline(never)]
fn create() -> &'static Result<AnyPool, String> {
    let mut opened = false;
    let r = POOL.get_or_init(|| {
        opened = true;
        if !cistern_alloc::fork::watch() {
            eprintln!(
                "cistern: pthread_atfork failed: a fork() child of this process may hang if it \
                 allocates"
            );
        }
        open()
    });
    if let (true, Ok(p)) = (opened, r) {
        publish(p);
    }
    r
}

/// The global pool as the registry's record source.
struct Published(&'static AnyPool);

impl RecordSource for Published {
    fn snapshot(&self) -> ProcessSnapshot {
        with_pool!(self.0, |p| p.snapshot())
    }
    fn leaks(&self) -> Vec<LeakEntry> {
        with_pool!(self.0, |p| p.leaks())
    }
}

/// Starts publishing `pool` in the registry (see the module docs); logs one line when the
/// registry cannot be used.
fn publish(pool: &'static AnyPool) {
    let config = with_pool!(pool, |p| p.config());
    let Some(dir) = registry::dir_for(config) else {
        return;
    };
    let started = Registry::open(dir).and_then(|r| {
        r.expire_from(config.registry_expire)
            .spawn(Arc::new(Published(pool)), registry::DEFAULT_INTERVAL)
    });
    match started {
        Ok(handle) => {
            registry::install_exit_hook(handle);
        }
        Err(e) => stderr_line!(
"cistern: this process is not published for `cistern ps` (the pool works without it): {e}"
        ),
    }
}

/// Creates the pool from the environment.
#[cold]
fn open() -> Result<AnyPool, String> {
    let inner = || -> cistern_alloc::Result<AnyPool> {
        let config = Config::from_env()?;
        // Each device pool creates its `record:PATH` file when it is created, on the first
        // allocation: a bad path is refused here, so `cistern_init` says so up front.
        if let Some(path) = &config.record {
            Recorder::check_path(path).map_err(|message| {
                Error::Config(ConfigError {
                    key: "record".into(),
                    message,
                })
            })?;
        }
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
