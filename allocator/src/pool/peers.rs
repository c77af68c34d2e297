//! Peer access: which other devices may read and write this device's memory.
//!
//! `cuCtxEnablePeerAccess` (`cudaDeviceEnablePeerAccess`) covers memory from `cuMemAlloc`, not
//! memory mapped with `cuMemMap`: a VMM mapping is accessible to a device only once
//! `cuMemSetAccess` names that device. PyTorch's expandable segments grant each peer on every
//! segment (`addPeerAccess`); cistern does the same for its mappings:
//!
//! * the device's peers (`DeviceState::peers`, under the device lock) get a descriptor in every
//!   `cuMemSetAccess` growth makes (`map_pages`): future mappings, including pages stitched in
//!   from other streams;
//! * [`DevicePool::enable_peer_access`] adds a peer and grants it every present mapping, one
//!   `cuMemSetAccess` per run of mapped pages of each segment;
//! * `peer_access:all` (see [`PeerAccess`]) makes every device that `cuDeviceCanAccessPeer`
//!   allows a peer when the pool is created.
//!
//! Without VMM the pool's memory is `cuMemAlloc` segments, which a peer reaches through its
//! context's peer access (`cudaDeviceEnablePeerAccess`, the caller's to enable, as with
//! PyTorch's allocator): the peer is recorded, and nothing else is needed.
//!
//! Access is never revoked: a mapping keeps its peers until it is unmapped, and the pool never
//! forgets a peer.

use std::sync::atomic::Ordering::Relaxed;

use crate::arena::Backing;
use crate::config::PeerAccess;
use crate::driver::{DeviceId, Driver};
use crate::error::{Error, Result};

use super::DevicePool;

/// The peers `peer_access` gives a new pool of device `dev`.
pub(super) fn initial_peers<D: Driver>(
    driver: &D,
    dev: DeviceId,
    mode: PeerAccess,
) -> Result<Vec<DeviceId>> {
    match mode {
        PeerAccess::None => Ok(Vec::new()),
        PeerAccess::All => {
            let n = driver.device_count()?;
            let mut peers = Vec::new();
            for p in (0..n).filter(|&p| p != dev) {
                if driver.can_access_peer(dev, p)? {
                    peers.push(p);
                }
            }
            Ok(peers)
        }
    }
}

impl<D: Driver> DevicePool<D> {
    /// The devices granted access to this device's memory, in the order they were added.
    pub fn peers(&self) -> Vec<DeviceId> {
        self.state.lock().peers.clone()
    }

    /// Grants device `peer` read/write access to every mapping of this pool, present and
    /// future (see the [module documentation](self)). Granting a peer twice is a no-op.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `peer` is this device, does not exist, or cannot access
    /// this device's memory (`cuDeviceCanAccessPeer`); [`Error::Driver`] when a
    /// `cuMemSetAccess` fails. On an error the peer is not added; mappings granted before the
    /// failure keep the grant (harmless: access is only ever widened).
    pub fn enable_peer_access(&self, peer: DeviceId) -> Result<()> {
        let c = &*self.core;
        let d = &*c.driver;
        if peer == c.dev {
            return Err(Error::InvalidArgument(format!(
                "enable_peer_access: device {peer} is the pool's own device: it always has \
                 access; name another device"
            )));
        }
        let count = d.device_count()?;
        if peer >= count {
            return Err(Error::InvalidDevice {
                device: peer,
                count,
                driver: d.name(),
            });
        }
        if !d.can_access_peer(c.dev, peer)? {
            return Err(Error::InvalidArgument(format!(
                "enable_peer_access: device {peer} cannot access device {}'s memory \
                 (cuDeviceCanAccessPeer says no: the devices are not connected by NVLink or a \
                 common PCIe root); copy through the host or use another device",
                c.dev
            )));
        }
        let mut dev = self.state.lock();
        if dev.peers.contains(&peer) {
            return Ok(());
        }
        if c.vmm {
            let g = c.granularity;
            for arena in self.all_arenas() {
                let a = arena.state.lock();
                for (_, kh) in a.kinds.iter() {
                    for seg in kh.segments.iter().flatten() {
                        let Backing::Vmm { pages } = &seg.backing else {
                            continue;
                        };
                        for (lo, hi) in mapped_runs(pages) {
                            let (addr, len) = (seg.base + lo as u64 * g, (hi - lo) as u64 * g);
                            if let Err(e) = d.set_access(c.dev, addr, len, &[peer]) {
                                c.counters.num_driver_errors.fetch_add(1, Relaxed);
                                return Err(e.into());
                            }
                        }
                    }
                }
            }
        }
        dev.peers.push(peer);
        drop(dev);
        // Ranges opened from other processes, after the device lock (`share.rs` takes the
        // device lock inside its own): one opened meanwhile saw the peer already.
        let r = c.share.grant_peer(c, peer);
        if r.is_err() {
            // As documented: on an error the peer is not added (a retry grants everything).
            self.state.lock().peers.retain(|&p| p != peer);
        }
        r
    }
}

/// The runs `[lo, hi)` of consecutive mapped granules in a page table.
fn mapped_runs<T>(pages: &[Option<T>]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, p) in pages.iter().enumerate() {
        match (p.is_some(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                runs.push((s, i));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        runs.push((s, pages.len()));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::mapped_runs;

    #[test]
    fn mapped_runs_are_maximal() {
        let p = |s: &str| {
            s.chars()
                .map(|c| (c == 'x').then_some(()))
                .collect::<Vec<_>>()
        };
        assert_eq!(mapped_runs(&p("")), vec![]);
        assert_eq!(mapped_runs(&p("...")), vec![]);
        assert_eq!(mapped_runs(&p("xx.x")), vec![(0, 2), (3, 4)]);
        assert_eq!(mapped_runs(&p(".xxx")), vec![(1, 4)]);
    }
}
