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

/// A new anonymous memory file (`memfd_create`, close-on-exec) named `name`.
pub(crate) fn memfd(name: &std::ffi::CStr) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: a valid NUL-terminated name and documented flags; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// A pidfd of process `pid` (`pidfd_open`, Linux 5.3): it names that process, never a later
/// owner of its pid.
fn pidfd_open(pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: the pidfd_open system call with a pid and flags 0; the result is checked.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `pidfd` was just opened and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd as i32) })
}

/// A duplicate, in this process, of file descriptor `fd` of process `pid` (`pidfd_open` and
/// `pidfd_getfd`, Linux 5.6). It needs ptrace-attach permission over `pid`: the same user and,
/// under Yama's `ptrace_scope` 1, that `pid` be a descendant of this process or have allowed it
/// (`prctl(PR_SET_PTRACER)`).
pub(crate) fn fd_of_process(pid: u32, fd: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let pidfd = pidfd_open(pid)?;
    // SAFETY: pidfd_getfd with a live pidfd, a descriptor number of that process and flags 0.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `got` is a new descriptor of this process that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

/// The start time (clock ticks since boot, as registry records carry it) of process `pid`,
/// read so that a reused pid cannot answer for it: `/proc/<pid>/stat` is read while a pidfd
/// holds the process, and believed only if that process is still there afterwards (a pidfd
/// names one process, never its pid's next owner). `None` when it cannot be told.
pub(crate) fn start_time_of(pid: u32) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let pidfd = pidfd_open(pid).ok()?;
    let start = crate::registry::process_start_time(pid).ok()?;
    // SAFETY: pidfd_send_signal with a live pidfd, signal 0 (a check only, nothing is sent),
    // no siginfo and flags 0.
    let sent = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    // EPERM: it is there, but this process may not signal it (ptrace rights without kill's).
    let alive = sent == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    alive.then_some(start)
}

/// Under Yama's `ptrace_scope` 1, lets this process's descendants attach to it, so that they
/// may take its file descriptors with `pidfd_getfd` (`prctl(PR_SET_PTRACER, getpid())`: the
/// declared process and its descendants may attach). Nothing is done at other scopes (0 needs
/// nothing; 2 and 3 cannot be relaxed by a process) or without Yama. Replaces an earlier
/// `PR_SET_PTRACER` of the process (a crash handler's, say), which cannot be read back.
pub(crate) fn allow_descendants_to_attach() {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok();
    if scope.as_deref().map(str::trim) != Some("1") {
        return;
    }
    // SAFETY: getpid has no preconditions; prctl with PR_SET_PTRACER and a pid only sets the
    // process's Yama exception; its result is checked.
    let ok = unsafe {
        let me = libc::getpid() as libc::c_ulong;
        libc::prctl(libc::PR_SET_PTRACER, me, 0, 0, 0) == 0
    };
    // Said once: the process's ptrace policy changed (a crash handler's own exception, if it
    // had one, is replaced).
    crate::log_rate_limited(if ok {
        "cistern: sharing memory with other processes: this process's descendants may now take \
         its descriptors (Yama ptrace_scope 1; prctl PR_SET_PTRACER)"
    } else {
        "cistern: sharing memory with other processes: prctl(PR_SET_PTRACER) failed, so under \
         Yama ptrace_scope 1 only this process's ancestors can receive its memory"
    });
}
