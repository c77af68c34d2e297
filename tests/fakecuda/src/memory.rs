//! Memory: `cuMemGetInfo_v2`, `cuMemGetAllocationGranularity`, the VMM calls
//! (`cuMemAddressReserve`, `cuMemAddressFree`, `cuMemCreate`, `cuMemRelease`, `cuMemMap`,
//! `cuMemUnmap`, `cuMemSetAccess`), linear memory (`cuMemAlloc_v2`, `cuMemFree_v2`) and
//! `cuDeviceCanAccessPeer`.
//!
//! * **One address space**: reservations of all devices come from one process-wide budget,
//!   [`knobs::VA_LIMIT`](crate::knobs::VA_LIMIT) lowered to `getrlimit(RLIMIT_AS)` when that is
//!   set (the driver's reservations are mappings of the process); they never overlap (each
//!   device's simulator has its own region).
//! * **The driver's reserve** ([`knobs::RESERVE`](crate::knobs::RESERVE)): `cuMemGetInfo`
//!   reports it as used, and `cuMemCreate` and `cuMemAlloc` cannot use it.
//! * **Peer access**: `cuMemSetAccess` grants another device read-write access when
//!   `cuDeviceCanAccessPeer` says it can (else `CUDA_ERROR_INVALID_DEVICE`); a peer's simulated
//!   work touching memory without access is `CUDA_ERROR_ILLEGAL_ADDRESS` (see
//!   [`hooks`](crate::hooks)).
//! * **Deferred release**: `cuMemRelease` of a mapped handle succeeds; the memory is freed at
//!   its last `cuMemUnmap`.
//!
//! Which calls need a current context: `cuMemGetInfo` and `cuMemAlloc`/`cuMemFree` do (the
//! driver API acts on "the current context"); `cuMemCreate`, `cuMemMap`, `cuMemUnmap`,
//! `cuMemSetAccess`, `cuMemRelease` and `cuMemAddressFree` name their device or object and
//! work without one, as the real driver's (their documented results include no
//! `CUDA_ERROR_INVALID_CONTEXT`). `cuMemAddressReserve` is the exception: the real driver
//! reserves process-wide without a context, but the fake must pick the simulator device that
//! holds the reservation, and refuses with `CUDA_ERROR_INVALID_CONTEXT` rather than guess.
//!
//! Limits: a handle can only be mapped into a reservation made under its own device's context
//! (`CUDA_ERROR_NOT_SUPPORTED` otherwise); read-only protection and revoking the owner's access
//! are `CUDA_ERROR_NOT_SUPPORTED`; a peer's touch also needs the owning device's access (the
//! simulator tracks the owner's).

use std::ffi::{c_int, c_uint, c_ulonglong};

use cistern::driver::{Driver, PhysHandle};

use crate::CUresult::{self, *};
use crate::{
    capture, code, entry, fake, get, put, size, CUdevice, CUdeviceptr, CUmemAccessDesc,
    CUmemAllocationProp, CUmemGenericAllocationHandle, Fake, Handle, Mapping, State,
    CU_MEM_ACCESS_FLAGS_PROT_NONE, CU_MEM_ACCESS_FLAGS_PROT_READ,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE,
};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, `_WIN32`, `_WIN32_KMT`, `_FABRIC`.
pub(crate) const HANDLE_POSIX_FD: c_uint = 0x1;
const HANDLE_WIN32: c_uint = 0x2;
const HANDLE_WIN32_KMT: c_uint = 0x4;
const HANDLE_FABRIC: c_uint = 0x8;
/// `CU_MEM_ALLOCATION_COMP_GENERIC`.
const COMP_GENERIC: u8 = 0x1;
/// `CU_MEM_CREATE_USAGE_TILE_POOL`.
const USAGE_TILE_POOL: u16 = 0x1;

impl State {
    /// The reservation containing `addr`: (start, size, device).
    pub(crate) fn reservation(&self, addr: u64) -> Option<(u64, u64, usize)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|(&start, &(size, _))| addr - start < size)
            .map(|(&s, &(size, dev))| (s, size, dev))
    }

    /// The starts of the mappings covering every byte of `[ptr, ptr + len)`, or `None` when a
    /// byte is unmapped.
    pub(crate) fn covering(&self, ptr: u64, len: u64) -> Option<Vec<u64>> {
        let end = ptr.checked_add(len)?;
        let mut out = Vec::new();
        let mut cur = ptr;
        while cur < end {
            let (&s, m) = self
                .mappings
                .range(..=cur)
                .next_back()
                .filter(|(&s, m)| cur < s + m.size)?;
            out.push(s);
            cur = s + m.size;
        }
        Some(out)
    }
}

impl Fake {
    /// Checks an allocation property as `cuMemCreate` does and returns the device it names.
    /// `CUmemAllocationProp`'s documentation: `requestedHandleTypes` is a bitmask of
    /// `CUmemAllocationHandleType`s (POSIX fd 0x1, Win32 0x2, Win32 KMT 0x4, fabric 0x8);
    /// `allocFlags.compressionType`, `gpuDirectRDMACapable` and `usage` need device support;
    /// `reserved` "must be zero".
    fn checked_prop(&self, prop: &CUmemAllocationProp) -> Result<usize, CUresult> {
        let d = self.prop_device(prop)?;
        let ht = prop.requestedHandleTypes;
        if ht & !(HANDLE_POSIX_FD | HANDLE_WIN32 | HANDLE_WIN32_KMT | HANDLE_FABRIC) != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if ht & (HANDLE_WIN32 | HANDLE_WIN32_KMT) != 0
            || (ht & HANDLE_FABRIC != 0 && !self.knobs.fabric)
        {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if ht & HANDLE_POSIX_FD != 0 && self.knobs.fd_refused {
            return Err(CUDA_ERROR_NOT_PERMITTED);
        }
        let [compression, rdma, u0, u1, reserved @ ..] = prop.allocFlags;
        let usage = u16::from_ne_bytes([u0, u1]);
        if reserved != [0; 4] || compression > COMP_GENERIC || rdma > 1 || usage > USAGE_TILE_POOL {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if compression != 0 || usage != 0 || (rdma == 1 && !self.knobs.rdma) {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        Ok(d)
    }

    /// The type and location of an allocation property, and the device it names.
    fn prop_device(&self, prop: &CUmemAllocationProp) -> Result<usize, CUresult> {
        if prop.type_ != CU_MEM_ALLOCATION_TYPE_PINNED
            || prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.device(prop.location.id)
    }

    /// Frees handle `h` in the simulator once it is released and no longer mapped.
    fn release_if_done(&self, st: &mut State, h: u64) -> Result<(), CUresult> {
        let Some(hd) = st.handles.get(&h) else {
            return Ok(());
        };
        if hd.maps > 0 || !hd.released {
            return Ok(());
        }
        let d = hd.dev;
        self.sim
            .release_physical(d, PhysHandle(h))
            .map_err(|e| code(&e))?;
        st.handles.remove(&h);
        Ok(())
    }
}

/// `cuMemGetInfo_v2`: free and total memory of the current context's device; the driver's
/// reserve counts as used. Needs a current context.
///
/// # Safety
///
/// `free` and `total` are null or valid for writing a `usize`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry("cuMemGetInfo_v2", || {
        let f = fake()?;
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.current(&f.state())?;
        let info = f.sim.mem_info(d).map_err(|e| code(&e))?;
        // SAFETY: both pointers are non-null and writable (contract).
        unsafe {
            put(free, info.free as usize)?;
            put(total, info.total as usize)
        }
    })
}

/// `cuMemGetAllocationGranularity`: `CU_MEM_ALLOC_GRANULARITY_MINIMUM` (0) is the simulator's
/// granularity, `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` (1, "Recommended granularity for
/// allocation for best performance") the larger
/// [`knobs::RECOMMENDED_GRANULARITY`](crate::knobs::RECOMMENDED_GRANULARITY).
///
/// # Safety
///
/// `granularity` is null or valid for writing a `usize`; `prop` is null or points to a
/// `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_uint,
) -> CUresult {
    entry("cuMemGetAllocationGranularity", || {
        let f = fake()?;
        // SAFETY: `prop` is null or readable (contract); `get` refuses null.
        let prop = unsafe { get(prop) }?;
        if granularity.is_null() || option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.prop_device(&prop)?;
        f.vmm()?;
        let g = if option == 1 {
            f.knobs.recommended_granularity
        } else {
            f.caps[d].granularity
        };
        // SAFETY: `granularity` is non-null and writable (contract).
        unsafe { put(granularity, g as usize) }
    })
}

/// `cuMemAddressReserve`: reserves virtual address space, held by the simulator of the current
/// context's device (a current context is needed: see the module documentation). `alignment` 0
/// means the granularity; the `addr` hint is ignored, as the real driver may ("addr - Fixed
/// starting address range requested", a hint). Beyond the address-space limit, all devices
/// together: `CUDA_ERROR_OUT_OF_MEMORY`. The documentation lists no code for an exhausted
/// address space; the real driver returns `CUDA_ERROR_OUT_OF_MEMORY` there (as users see when
/// their reservations pass the process's virtual address space), not `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
///
/// `ptr` is null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    let _ = addr;
    entry("cuMemAddressReserve", || {
        let f = fake()?;
        if ptr.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        f.vmm()?;
        let mut st = f.state();
        let d = f.current(&st)?;
        let bytes = self::size(size);
        if st.reserved.saturating_add(bytes) > f.va_limit {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let align = if alignment == 0 {
            f.knobs.granularity
        } else {
            self::size(alignment)
        };
        let va = f.sim.reserve_va(d, bytes, align).map_err(|e| code(&e))?;
        st.reservations.insert(va, (bytes, d));
        st.reserved += bytes;
        // SAFETY: `ptr` is non-null and writable (contract).
        unsafe { put(ptr, va) }
    })
}

/// `cuMemAddressFree`: releases a whole reservation (nothing may be mapped in it). No context
/// needed.
///
/// # Safety
///
/// None beyond the C API's: the arguments are plain values.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry("cuMemAddressFree", || {
        let f = fake()?;
        f.vmm()?;
        let mut st = f.state();
        let (bytes, d) = st
            .reservations
            .get(&ptr)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.alive(d)?;
        f.sim
            .free_va(d, ptr, self::size(size))
            .map_err(|e| code(&e))?;
        st.reservations.remove(&ptr);
        st.reserved -= bytes;
        Ok(())
    })
}

/// `cuMemCreate`: commits physical memory on the device `prop` names (no context needed),
/// never from the driver's reserve. The property is checked as its documentation says (see
/// `Fake::checked_prop`): handle types 0 or POSIX fd (fabric with
/// [`knobs::FABRIC`](crate::knobs::FABRIC)), Windows handle types `CUDA_ERROR_NOT_SUPPORTED`,
/// no compression or usage, RDMA only with [`knobs::RDMA`](crate::knobs::RDMA), zero reserved
/// bytes.
///
/// # Safety
///
/// `handle` is null or valid for writing a handle; `prop` is null or points to a
/// `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    entry("cuMemCreate", || {
        let f = fake()?;
        // SAFETY: `prop` is null or readable (contract); `get` refuses null.
        let prop = unsafe { get(prop) }?;
        if handle.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = f.checked_prop(&prop)?;
        f.vmm()?;
        let mut st = f.state();
        st.alive(d)?;
        let h = f
            .sim
            .create_physical(d, self::size(size))
            .map_err(|e| code(&e))?;
        st.handles.insert(
            h.0,
            Handle {
                dev: d,
                maps: 0,
                released: false,
                size: self::size(size),
                types: prop.requestedHandleTypes,
                origin: None,
            },
        );
        // SAFETY: `handle` is non-null and writable (contract).
        unsafe { put(handle, h.0) }
    })
}

/// `cuMemRelease`: "The memory allocation will be freed when all outstanding mappings to the
/// memory are unmapped ... The generic memory handle can be freed when there are still
/// outstanding mappings made with this handle": a mapped handle is released at once and its
/// memory freed at its last `cuMemUnmap`. The handle is invalid afterwards either way.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    entry("cuMemRelease", || {
        let f = fake()?;
        f.vmm()?;
        let mut st = f.state();
        let d = st
            .handles
            .get(&handle)
            .filter(|h| !h.released)
            .map(|h| h.dev)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.alive(d)?;
        if let Some(h) = st.handles.get_mut(&handle) {
            h.released = true;
        }
        if let Err(r) = f.release_if_done(&mut st, handle) {
            if let Some(h) = st.handles.get_mut(&handle) {
                h.released = false;
            }
            return Err(r);
        }
        Ok(())
    })
}

/// `cuMemMap`: maps a whole handle at `ptr` (offset and flags must be 0). No context needed.
///
/// # Safety
///
/// None beyond the C API's: the arguments are plain values.
#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    entry("cuMemMap", || {
        let f = fake()?;
        f.vmm()?;
        if offset != 0 || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let d = st
            .handles
            .get(&handle)
            .filter(|h| !h.released)
            .map(|h| h.dev)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.alive(d)?;
        if st.reservation(ptr).is_some_and(|(_, _, rd)| rd != d) {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        f.sim
            .map(d, ptr, self::size(size), PhysHandle(handle))
            .map_err(|e| code(&e))?;
        if let Some(h) = st.handles.get_mut(&handle) {
            h.maps += 1;
        }
        st.mappings.insert(
            ptr,
            Mapping {
                size: self::size(size),
                handle,
                dev: d,
                access: 0,
            },
        );
        Ok(())
    })
}

/// `cuMemUnmap`: undoes exactly one earlier mapping; "Any backing memory allocations will be
/// freed if there are no existing mappings and there are no unreleased memory handles". No
/// context needed.
///
/// # Safety
///
/// None beyond the C API's: the arguments are plain values.
#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    entry("cuMemUnmap", || {
        let f = fake()?;
        f.vmm()?;
        let mut st = f.state();
        let (_, _, d) = st.reservation(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.alive(d)?;
        f.sim
            .unmap(d, ptr, self::size(size))
            .map_err(|e| code(&e))?;
        if let Some(m) = st.mappings.remove(&ptr) {
            if let Some(h) = st.handles.get_mut(&m.handle) {
                h.maps -= 1;
            }
            if let Err(r) = f.release_if_done(&mut st, m.handle) {
                eprintln!(
                    "cistern-fakecuda: freeing released handle {} at its last unmap failed \
                     ({r:?}); it stays allocated",
                    m.handle
                );
            }
        }
        Ok(())
    })
}

/// `cuMemSetAccess`: grants read-write access to mapped memory, to the owning device (in the
/// simulator) or to a peer device that `cuDeviceCanAccessPeer` allows (else
/// `CUDA_ERROR_INVALID_DEVICE`); `CU_MEM_ACCESS_FLAGS_PROT_NONE` revokes a peer's access. Every
/// byte of the range must be mapped. No context needed.
///
/// # Safety
///
/// `desc` is null or points to `count` access descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    entry("cuMemSetAccess", || {
        let f = fake()?;
        f.vmm()?;
        if desc.is_null() || count == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let (_, _, owner) = st.reservation(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.alive(owner)?;
        let maps = st
            .covering(ptr, self::size(size))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (mut owner_rw, mut grant, mut revoke) = (false, 0u32, 0u32);
        for i in 0..count {
            // SAFETY: `desc` points to `count` descriptors (contract) and `i < count`.
            let d = unsafe { get(desc.add(i)) }?;
            if d.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let dev = f.device(d.location.id)?;
            match d.flags {
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE if dev == owner => owner_rw = true,
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE if f.can_access_peer(dev, owner) => {
                    grant |= 1 << dev
                }
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE => return Err(CUDA_ERROR_INVALID_DEVICE),
                CU_MEM_ACCESS_FLAGS_PROT_NONE if dev != owner => revoke |= 1 << dev,
                CU_MEM_ACCESS_FLAGS_PROT_NONE | CU_MEM_ACCESS_FLAGS_PROT_READ => {
                    return Err(CUDA_ERROR_NOT_SUPPORTED)
                }
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        if owner_rw {
            f.sim
                .set_access(owner, ptr, self::size(size), &[])
                .map_err(|e| code(&e))?;
        }
        for s in maps {
            if let Some(m) = st.mappings.get_mut(&s) {
                m.access = (m.access | grant) & !revoke;
                if owner_rw {
                    m.access |= 1 << m.dev;
                }
            }
        }
        Ok(())
    })
}

/// `cuMemAlloc_v2`: linear memory on the current context's device. Needs a current context;
/// potentially unsafe during stream capture.
///
/// # Safety
///
/// `dptr` is null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    entry("cuMemAlloc_v2", || {
        let f = fake()?;
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = f.state();
        let d = f.current(&st)?;
        capture::unsafe_call(&mut st)?;
        let p = f.sim.mem_alloc(d, size(bytesize)).map_err(|e| code(&e))?;
        st.linear.insert(p, (size(bytesize), d));
        // SAFETY: `dptr` is non-null and writable (contract).
        unsafe { put(dptr, p) }
    })
}

/// `cuMemFree_v2`: frees memory from `cuMemAlloc_v2` (completing the device's work first, as
/// the real call synchronises). Needs a current context; potentially unsafe during stream
/// capture.
///
/// # Safety
///
/// None beyond the C API's: the argument is a plain value.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    entry("cuMemFree_v2", || {
        let f = fake()?;
        let mut st = f.state();
        f.current(&st)?;
        capture::unsafe_call(&mut st)?;
        let (_, d) = st
            .linear
            .get(&dptr)
            .copied()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.alive(d)?;
        f.sim.mem_free(d, dptr).map_err(|e| code(&e))?;
        st.linear.remove(&dptr);
        Ok(())
    })
}

/// `cuDeviceCanAccessPeer`: "Returns in *canAccessPeer a value of 1 if contexts on dev are
/// capable of directly accessing memory from contexts on peerDev and 0 otherwise": 1 for two
/// distinct devices unless [`knobs::PEERS`](crate::knobs::PEERS) is 0, 0 for a device and
/// itself.
///
/// # Safety
///
/// `canAccessPeer` is null or valid for writing a `c_int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    canAccessPeer: *mut c_int,
    dev: CUdevice,
    peerDev: CUdevice,
) -> CUresult {
    entry("cuDeviceCanAccessPeer", || {
        let f = fake()?;
        if canAccessPeer.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (d, p) = (f.device(dev)?, f.device(peerDev)?);
        // SAFETY: `canAccessPeer` is non-null and writable (contract).
        unsafe { put(canAccessPeer, c_int::from(f.can_access_peer(d, p))) }
    })
}
