//! Choosing a driver at run time: `CISTERN_DRIVER=cuda|sim|auto`.
//!
//! Programs that do not care which backend they run on (the C ABI, the CLI, examples) open the
//! driver through here. `cuda` requires a CUDA driver; `sim` uses the simulated GPU, sized by
//! `CISTERN_SIM` (the same `key:value` syntax as `CISTERN_CONF`: `capacity`, `devices`,
//! `granularity`, `vmm`); `auto` (the default) uses CUDA when a driver is present and otherwise
//! says so and fails, naming the fix, unless the caller asked for a fallback.

use std::sync::Arc;

use crate::config::parse_size;
use crate::driver::cuda::CudaDriver;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::driver::Driver;
use crate::error::{Error, Result};

/// Which backend to use.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DriverChoice {
    /// The CUDA driver (`libcuda.so`).
    Cuda,
    /// The simulated GPU.
    Sim,
    /// CUDA when present.
    Auto,
}

/// Reads `CISTERN_DRIVER` (unset: `Auto`).
pub fn choice_from_env() -> Result<DriverChoice> {
    match std::env::var("CISTERN_DRIVER").as_deref() {
        Err(_) | Ok("") | Ok("auto") => Ok(DriverChoice::Auto),
        Ok("cuda") => Ok(DriverChoice::Cuda),
        Ok("sim") => Ok(DriverChoice::Sim),
        Ok(other) => Err(Error::InvalidArgument(format!(
            "CISTERN_DRIVER=`{other}` is not a driver: use cuda, sim or auto"
        ))),
    }
}

/// Reads the simulator's settings from `CISTERN_SIM` (`capacity:80GiB,devices:1,...`).
pub fn sim_config_from_env() -> Result<SimConfig> {
    let text = std::env::var("CISTERN_SIM").unwrap_or_default();
    sim_config_from_str(&text)
}

/// Parses the simulator's settings (`capacity`, `devices`, `granularity`, `vmm`) and checks
/// their bounds ([`SimConfig::check`]: 1 to 64 devices, a power-of-two granularity of at least
/// 64 KiB, a capacity of one granule to 16 TiB in at most 2^23 granules).
pub fn sim_config_from_str(text: &str) -> Result<SimConfig> {
    let mut c = SimConfig::default();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let bad = |m: String| Error::InvalidArgument(format!("CISTERN_SIM: `{entry}`: {m}"));
        let (k, v) = entry
            .split_once(':')
            .ok_or_else(|| bad("expected `key:value`".into()))?;
        match k.trim() {
            "capacity" => c.capacity = parse_size(v).map_err(bad)?,
            "granularity" => c.granularity = parse_size(v).map_err(bad)?,
            "devices" => {
                c.devices = v
                    .trim()
                    .parse()
                    .map_err(|_| bad("devices must be a whole number".into()))?
            }
            "vmm" => {
                c.vmm = match v.trim() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad("vmm must be true or false".into())),
                }
            }
            _ => {
                return Err(bad(
                    "unknown key; valid keys are capacity, devices, granularity, vmm".into(),
                ))
            }
        }
    }
    c.check()
        .map_err(|m| Error::InvalidArgument(format!("CISTERN_SIM=`{text}`: {m}")))?;
    Ok(c)
}

/// Opens the driver `choice` names. With `Auto` and `fallback_to_sim`, a missing CUDA driver
/// gives the simulator (and `true` in the second field, so the caller can say so).
pub fn open_driver(choice: DriverChoice, fallback_to_sim: bool) -> Result<(Arc<dyn Driver>, bool)> {
    match choice {
        DriverChoice::Sim => Ok((Arc::new(SimDriver::new(sim_config_from_env()?)), false)),
        DriverChoice::Cuda => Ok((Arc::new(CudaDriver::new()?), false)),
        DriverChoice::Auto => match CudaDriver::new() {
            Ok(d) => Ok((Arc::new(d), false)),
            Err(e) if fallback_to_sim => {
                let _ = e;
                Ok((Arc::new(SimDriver::new(sim_config_from_env()?)), true))
            }
            Err(e) => Err(e.into()),
        },
    }
}

/// Opens the driver `CISTERN_DRIVER` names ([`choice_from_env`], then [`open_driver`]).
///
/// With `fallback_to_sim`, `auto` (the default) gives the simulator on a machine without a CUDA
/// driver, and `true` in the second field so the caller can say so; `cuda` never falls back.
pub fn open_driver_from_env(fallback_to_sim: bool) -> Result<(Arc<dyn Driver>, bool)> {
    open_driver(choice_from_env()?, fallback_to_sim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_settings_parse_and_reject() {
        let c = sim_config_from_str("capacity:8GiB, devices:2,vmm:false").unwrap();
        assert_eq!(c.capacity, 8 << 30);
        assert_eq!(c.devices, 2);
        assert!(!c.vmm);
        let e = sim_config_from_str("capacty:1GiB").unwrap_err().to_string();
        assert!(e.contains("valid keys"), "{e}");
        assert!(sim_config_from_str("devices:two").is_err());
    }

    /// Values that made `SimDriver::new` allocate without bound (4 billion devices aborted the
    /// process; a 512 B granularity took gigabytes of page tables) are refused, naming the range.
    #[test]
    fn sim_settings_out_of_bounds_are_refused() {
        for (text, says) in [
            ("devices:4294967295", "use 1 to 64"),
            ("devices:65", "use 1 to 64"),
            ("devices:0", "use 1 to 64"),
            ("granularity:512", "power of two of at least 65536"),
            ("granularity:3MiB", "power of two"),
            ("granularity:0", "power of two"),
            ("capacity:0", "out of range"),
            ("capacity:1MiB", "at least the granularity"),
            ("capacity:17TiB", "at most 17592186044416"),
            (
                "capacity:16TiB,granularity:64KiB",
                "use a larger granularity",
            ),
        ] {
            let e = sim_config_from_str(text).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("CISTERN_SIM"), "{text}: {e}");
        }
        for ok in [
            "devices:64",
            "granularity:64KiB",
            "capacity:16TiB",
            "capacity:512GiB,granularity:64KiB",
            "capacity:2MiB",
        ] {
            sim_config_from_str(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    #[test]
    fn sim_and_auto_open() {
        let (d, fell_back) = open_driver(DriverChoice::Sim, false).unwrap();
        assert_eq!(d.name(), "sim");
        assert!(!fell_back);
        // On a machine without libcuda, Auto without fallback names the fix; with fallback it
        // gives the simulator.
        if CudaDriver::new().is_err() {
            let e = open_driver(DriverChoice::Auto, false)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("CISTERN_DRIVER=sim"), "{e}");
            let (d, fell_back) = open_driver(DriverChoice::Auto, true).unwrap();
            assert_eq!(d.name(), "sim");
            assert!(fell_back);
        }
    }
}
