//! The few libc calls the allocator makes outside the CUDA driver, each behind a safe function.
//! With `driver::cuda` (the driver's FFI), this is the only module allowed `unsafe` code
//! (`#![deny(unsafe_code)]` at the crate root).
#![allow(unsafe_code)]

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds (Linux: the vDSO, no system call).
#[cfg(target_os = "linux")]
#[inline]
pub(crate) fn monotonic_coarse_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC_COARSE always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The effective user id.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether a process with id `pid` exists (it may belong to another user).
pub(crate) fn pid_exists(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Registers `f` to run at process exit; whether it was registered.
pub(crate) fn atexit(f: extern "C" fn()) -> bool {
    // SAFETY: registering a function with no captured state. The caller's function must never
    // unwind across the C boundary (a panic in an `extern "C"` fn aborts).
    unsafe { libc::atexit(f) == 0 }
}

/// Registers `child` to run in the child process after every `fork()`; whether it was.
pub(crate) fn at_fork_child(child: extern "C" fn()) -> bool {
    // SAFETY: registering a function with no captured state; the caller's function must only
    // do what is safe in a child of a multithreaded process (it stores an atomic).
    unsafe { libc::pthread_atfork(None, None, Some(child)) == 0 }
}
