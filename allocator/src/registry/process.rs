//! Process identity and liveness from `/proc`: who a process is (pid, start time, boot id, uid,
//! command line) and whether the process that wrote a record still runs.

use std::fs;
use std::io;

use serde::{Deserialize, Serialize};

use super::container::Placement;
use super::record::MAX_CMDLINE_BYTES;
use super::RegistryError;

/// The effective user id.
pub fn euid() -> u32 {
    crate::sys::euid()
}

/// This boot's id, from `/proc/sys/kernel/random/boot_id`.
pub fn boot_id() -> io::Result<String> {
    Ok(fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string())
}

/// Parses the fields after the command name of a `/proc/<pid>/stat` line: the state character
/// (field 3) and the start time (field 22). The command name may hold spaces and parentheses, so
/// the fields start after the last `)`.
pub fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was consumed; field 22 is 18 further.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

fn read_stat(pid: u32) -> io::Result<(char, u64)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected /proc/{pid}/stat"),
        )
    })
}

/// The start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot) of a process.
pub fn process_start_time(pid: u32) -> io::Result<u64> {
    read_stat(pid).map(|s| s.1)
}

/// Whether the process that published a record still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Liveness {
    /// The pid runs and started when the record says: the same process.
    Alive,
    /// The process has exited but its parent has not reaped it (its GPU context may still be
    /// held while the driver cleans up).
    Zombie,
    /// No process has the pid.
    Dead,
    /// A process has the pid but started at another time: the recorded one is dead.
    PidReused,
    /// The record is from an earlier boot: the process is long gone.
    OtherBoot,
    /// The process ran in a pid namespace this reader cannot see into (a container, read from
    /// another container or without the host's pid namespace), and no visible process is it:
    /// it may be dead, or running out of sight. Never taken for dead: its record is neither
    /// expired nor matched to NVML's pids (which are the host's).
    Unseen,
}

/// Whether process `(pid, start_time)` is alive, from `/proc/<pid>/stat`.
pub fn is_alive(pid: u32, start_time: u64) -> Liveness {
    if pid == 0 || pid > i32::MAX as u32 {
        return Liveness::Dead;
    }
    match read_stat(pid) {
        Ok((_, st)) if st != start_time => Liveness::PidReused,
        Ok(('Z' | 'X' | 'x', _)) => Liveness::Zombie,
        Ok(_) => Liveness::Alive,
        // Unreadable stat: ask the kernel whether the pid exists at all.
        Err(_) if pid_exists(pid) => Liveness::Alive,
        Err(_) => Liveness::Dead,
    }
}

/// Who a process is: what identifies its record, and what does not change while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Process id.
    pub pid: u32,
    /// Start time (clock ticks since boot).
    pub start_time: u64,
    /// Boot id.
    pub boot_id: String,
    /// Effective user id.
    pub uid: u32,
    /// Command line, cut to [`MAX_CMDLINE_BYTES`].
    pub cmdline: Vec<String>,
    /// Whether it was cut.
    pub cmdline_truncated: bool,
    /// Where it runs: cgroup, container, pod, pids in each pid namespace.
    pub placement: Placement,
}

/// Splits a `/proc/<pid>/cmdline` blob into arguments, at most `limit` bytes in all; returns
/// whether it cut anything.
pub fn split_cmdline(raw: &[u8], limit: usize) -> (Vec<String>, bool) {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    let mut out = Vec::new();
    let mut used = 0;
    if raw.is_empty() {
        return (out, false);
    }
    for arg in raw.split(|&b| b == 0) {
        let s = String::from_utf8_lossy(arg);
        if used + s.len() > limit {
            let mut cut = limit - used;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            out.push(s[..cut].to_string());
            return (out, true);
        }
        used += s.len();
        out.push(s.into_owned());
    }
    (out, false)
}

impl Identity {
    /// This process's identity, from `/proc/self`.
    pub fn current() -> Result<Identity, RegistryError> {
        let pid = std::process::id();
        let start_time = process_start_time(pid)
            .map_err(|e| RegistryError::Identity(format!("reading /proc/{pid}/stat: {e}")))?;
        let boot_id =
            boot_id().map_err(|e| RegistryError::Identity(format!("reading boot_id: {e}")))?;
        let raw = fs::read("/proc/self/cmdline").unwrap_or_default();
        let (cmdline, cmdline_truncated) = split_cmdline(&raw, MAX_CMDLINE_BYTES);
        Ok(Identity {
            pid,
            start_time,
            boot_id,
            uid: euid(),
            cmdline,
            cmdline_truncated,
            placement: Placement::current(),
        })
    }
}

pub(super) fn pid_exists(pid: u32) -> bool {
    crate::sys::pid_exists(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields() {
        let line = "1234 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20";
        assert_eq!(parse_stat(line), Some(('S', 987654)));
        assert_eq!(parse_stat("1 (x) S 1 2"), None);
        let me = std::process::id();
        // The test binary's name has no spaces, so a naive split finds field 22 too.
        let stat = fs::read_to_string("/proc/self/stat").unwrap();
        let naive: u64 = stat.split_whitespace().nth(21).unwrap().parse().unwrap();
        assert_eq!(process_start_time(me).unwrap(), naive);
        assert_eq!(
            is_alive(me, process_start_time(me).unwrap()),
            Liveness::Alive
        );
    }

    #[test]
    fn cmdline_is_cut() {
        assert_eq!(
            split_cmdline(b"python\0train.py\0", 100),
            (vec!["python".to_string(), "train.py".to_string()], false)
        );
        let (args, cut) = split_cmdline("ab\0cdé\0".as_bytes(), 4);
        assert!(cut);
        assert_eq!(args, vec!["ab".to_string(), "cd".to_string()]);
        assert_eq!(split_cmdline(b"", 10), (vec![], false));
    }
}
