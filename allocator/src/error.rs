//! The library's error type and the out-of-memory report.
//!
//! Reports are plain data with `Display` (for people) and serde (for tools).

use std::fmt;

use crate::config::ConfigError;
use crate::driver::{DeviceId, DriverError, DriverErrorKind, StreamId};

/// Everything that can go wrong when asking the pool for something.
#[derive(Debug, Clone)]
pub enum Error {
    /// The device has no memory left for the request, after the whole OOM protocol ran.
    OutOfMemory(Box<OomReport>),
    /// The request would take reserved memory above the configured per-process limit.
    LimitExceeded(Box<OomReport>),
    /// A driver call failed in a way the pool could not recover from.
    Driver(DriverError),
    /// No CUDA driver could be used; the message says what to do.
    NoDriver(String),
    /// The device ordinal does not exist.
    InvalidDevice {
        /// The ordinal asked for.
        device: DeviceId,
        /// How many devices exist.
        count: usize,
        /// The driver's name ([`crate::Driver::name`]): what sets the device count, and so
        /// what the message tells the user to check.
        driver: &'static str,
    },
    /// An argument was rejected (the message says which and why).
    InvalidArgument(String),
    /// The configuration was rejected.
    Config(ConfigError),
}

impl Error {
    /// Whether this is an out-of-memory or limit error (the ones a caller can recover from by
    /// freeing memory).
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::OutOfMemory(_) | Error::LimitExceeded(_))
    }

    /// The OOM report, when there is one.
    pub fn oom_report(&self) -> Option<&OomReport> {
        match self {
            Error::OutOfMemory(r) | Error::LimitExceeded(r) => Some(r),
            _ => None,
        }
    }
}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        if e.kind == DriverErrorKind::NoDriver {
            Error::NoDriver(e.message)
        } else {
            Error::Driver(e)
        }
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::Config(e)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory(r) => write!(f, "out of memory: {r}"),
            Error::LimitExceeded(r) => write!(f, "memory limit exceeded: {r}"),
            Error::Driver(e) => write!(f, "driver error: {e}"),
            Error::NoDriver(m) => f.write_str(m),
            Error::InvalidDevice {
                device,
                count,
                driver,
            } => write!(
                f,
                "invalid device {device}: {count} device(s) visible ({})",
                device_hint(driver, *device)
            ),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::Config(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {}

/// What sets the number of devices `driver` shows, for a message about device `wanted`: the
/// simulator's is `CISTERN_SIM`'s `devices:N`; a real GPU's, `CUDA_VISIBLE_DEVICES`.
fn device_hint(driver: &str, wanted: DeviceId) -> String {
    match driver {
        "sim" => format!(
            "the simulated GPU: set CISTERN_SIM=devices:{} or more for device {wanted}",
            wanted.saturating_add(1)
        ),
        _ => "check CUDA_VISIBLE_DEVICES".to_string(),
    }
}

/// Shorthand for the library's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Bytes attributed to one tag or call site, for reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Attribution {
    /// The tag or symbolised site.
    pub name: String,
    /// Live bytes.
    pub bytes: u64,
    /// Live blocks.
    pub blocks: u64,
}

/// Another process's use of the device, when known (filled by the registry/NVML layer).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OtherProcess {
    /// Process id.
    pub pid: u32,
    /// Bytes it holds on the device: what its pools reserve (a cistern process, from its
    /// record), or what NVML counts for it (`nvml_only`; 0 when NVML cannot say).
    pub bytes: u64,
    /// Its command line, when known.
    pub command: String,
    /// Known from NVML only: a process without a cistern record this process can read (one
    /// not using cistern, most often).
    #[serde(default)]
    pub nvml_only: bool,
}

/// What the pool knew when a request failed: enough to tell who holds the memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OomReport {
    /// The device.
    pub device: DeviceId,
    /// The stream of the request.
    pub stream: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes after rounding.
    pub rounded: u64,
    /// The per-process limit on reserved bytes.
    pub limit: u64,
    /// Device memory free (all processes), from the driver.
    pub device_free: u64,
    /// Device memory in total.
    pub device_total: u64,
    /// Bytes this pool holds from the driver.
    pub reserved: u64,
    /// Bytes in live blocks.
    pub live: u64,
    /// Bytes freed but waiting on other streams' work.
    pub pending: u64,
    /// Reserved bytes in no live or pending block.
    pub cached: u64,
    /// The largest free range in any arena.
    pub largest_free: u64,
    /// Live bytes by tag, largest first (empty until provenance is on).
    pub top_tags: Vec<Attribution>,
    /// Live bytes by call site, largest first (empty until sampling is on).
    pub top_sites: Vec<Attribution>,
    /// Other processes holding memory on the device, when known (filled once the device lock
    /// is released; empty on the simulated GPU): those using cistern, from their registry
    /// records (not with `registry:off`), and the others NVML lists, when NVML is at hand and
    /// sees this process's pids (not from inside most containers). At most 8, largest first.
    pub other_processes: Vec<OtherProcess>,
    /// What NVML counts for this process on the device (its pools, its CUDA context and any
    /// other allocator's memory), when known, as for `other_processes`.
    #[serde(default)]
    pub process_nvml_bytes: Option<u64>,
    /// Why the request failed, in words.
    pub reason: String,
}

fn mib(b: u64) -> String {
    crate::format_bytes(b)
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "tried to allocate {} (rounded to {}) on device {} stream {}: {}",
            mib(self.requested),
            mib(self.rounded),
            self.device,
            StreamId(self.stream),
            self.reason
        )?;
        writeln!(
            f,
            "  device: {} free of {}; limit for this process: {}",
            mib(self.device_free),
            mib(self.device_total),
            mib(self.limit)
        )?;
        writeln!(
            f,
            "  this process: {} reserved = {} live + {} pending other streams + {} cached \
             (largest free range {})",
            mib(self.reserved),
            mib(self.live),
            mib(self.pending),
            mib(self.cached),
            mib(self.largest_free)
        )?;
        // What the device's free memory leaves unexplained by this process's pools (unknown
        // when the driver could not say what is free: 0 then).
        let outside = self
            .device_total
            .saturating_sub(self.device_free)
            .saturating_sub(self.reserved);
        if outside > 0 && self.device_free > 0 {
            writeln!(
                f,
                "  held outside this process's pools: {} (other processes, CUDA contexts and \
                 the driver; `cistern ps` names them)",
                mib(outside)
            )?;
        }
        for (title, list) in [("tags", &self.top_tags), ("call sites", &self.top_sites)] {
            if !list.is_empty() {
                writeln!(f, "  top {title} by live bytes:")?;
                for a in list {
                    writeln!(
                        f,
                        "    {:>12}  {:>6} blocks  {}",
                        mib(a.bytes),
                        a.blocks,
                        a.name
                    )?;
                }
            }
        }
        if let Some(b) = self.process_nvml_bytes {
            writeln!(
                f,
                "  this process, as NVML counts it: {} (its pools, its CUDA context and any other \
                 allocator's memory)",
                mib(b)
            )?;
        }
        if !self.other_processes.is_empty() {
            writeln!(f, "  other processes on this device:")?;
            for p in &self.other_processes {
                let bytes = if p.nvml_only && p.bytes == 0 {
                    "?".to_string()
                } else {
                    mib(p.bytes)
                };
                let command = if p.command.is_empty() {
                    "(command line not visible here)"
                } else {
                    &p.command
                };
                let note = if p.nvml_only {
                    "  [NVML; no cistern record]"
                } else {
                    ""
                };
                writeln!(f, "    pid {:>7}  {bytes:>12}  {command}{note}", p.pid)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad device on the simulator names what sets its device count there (`CISTERN_SIM`),
    /// not `CUDA_VISIBLE_DEVICES`, which the simulator ignores.
    #[test]
    fn a_bad_device_names_what_sets_the_device_count() {
        let sim = Error::InvalidDevice {
            device: 3,
            count: 2,
            driver: "sim",
        }
        .to_string();
        assert_eq!(
            sim,
            "invalid device 3: 2 device(s) visible (the simulated GPU: set \
             CISTERN_SIM=devices:4 or more for device 3)"
        );
        let cuda = Error::InvalidDevice {
            device: 3,
            count: 2,
            driver: "cuda",
        }
        .to_string();
        assert_eq!(
            cuda,
            "invalid device 3: 2 device(s) visible (check CUDA_VISIBLE_DEVICES)"
        );
    }

    /// An OOM report says how much of the device is held outside the process (what its free
    /// memory leaves unexplained), and names the other processes it knows of.
    #[test]
    fn an_oom_report_says_what_is_held_outside_the_process() {
        const GIB: u64 = 1 << 30;
        let mut r = OomReport {
            device: 0,
            stream: 0,
            requested: 8 * GIB,
            rounded: 8 * GIB,
            limit: 80 * GIB,
            device_free: 2 * GIB,
            device_total: 80 * GIB,
            reserved: 10 * GIB,
            live: 9 * GIB,
            pending: 0,
            cached: GIB,
            largest_free: GIB,
            top_tags: vec![],
            top_sites: vec![],
            other_processes: vec![
                OtherProcess {
                    pid: 4242,
                    bytes: 60 * GIB,
                    command: "python train.py".into(),
                    nvml_only: false,
                },
                OtherProcess {
                    pid: 77,
                    bytes: 3 * GIB,
                    command: "./solver --big".into(),
                    nvml_only: true,
                },
                OtherProcess {
                    pid: 78,
                    bytes: 0,
                    command: String::new(),
                    nvml_only: true,
                },
            ],
            process_nvml_bytes: Some(10 * GIB + 500 * (1 << 20)),
            reason: "the device has too little free memory for it".into(),
        };
        let text = r.to_string();
        assert!(
            text.contains("  held outside this process's pools: 68.0 GiB (other processes, CUDA"),
            "{text}"
        );
        assert!(
            text.contains("other processes on this device:\n    pid    4242"),
            "{text}"
        );
        assert!(text.contains("python train.py\n"), "{text}");
        // Processes NVML alone knows of are marked so, and what it cannot say is not made up.
        assert!(
            text.contains(
                "    pid      77       3.0 GiB  ./solver --big  [NVML; no cistern record]"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "    pid      78             ?  (command line not visible here)  [NVML; no \
                 cistern record]"
            ),
            "{text}"
        );
        assert!(
            text.contains("  this process, as NVML counts it: 10.5 GiB (its pools, its CUDA"),
            "{text}"
        );
        // Free memory unknown (the driver did not say): no such line.
        r.device_free = 0;
        assert!(!r.to_string().contains("held outside"));
        // Nothing held outside: no such line.
        r.device_free = 70 * GIB;
        r.other_processes.clear();
        r.process_nvml_bytes = None;
        let text = r.to_string();
        assert!(!text.contains("held outside"), "{text}");
        assert!(!text.contains("other processes"), "{text}");
        assert!(!text.contains("NVML"), "{text}");
    }
}
