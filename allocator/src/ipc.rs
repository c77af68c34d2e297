//! Memory shared with other processes: what a block is made of ([`Shared`]), and its encoding
//! as PyTorch's CUDA allocators write it, so that a tensor of cistern's can be sent with
//! `torch.multiprocessing` to a process running PyTorch's own allocator, and back.
//!
//! [`DevicePool::share`](crate::DevicePool::share) describes a live block;
//! [`DevicePool::open_shared`](crate::DevicePool::open_shared) maps such a description in
//! the receiving process (see Note [Sharing] in `pool/share.rs`).
//!
//! # PyTorch's format (`shareIpcHandle` / `getIpcDevPtr`, torch 2.5 onward)
//!
//! A handle is `[version: u8][type: u8][payload]`, with the block's offset from the start of
//! the shared range carried beside it (`ShareableHandle::offset`), all integers native
//! (little-endian here):
//!
//! * type `'c'` (`cudaMalloc` memory): the 64-byte `cudaIpcMemHandle_t` of the allocation's
//!   base. The same for every version; a bare 64-byte string (torch before 2.5) is read as one.
//! * type `'e'` (expandable segments, VMM): a header, then one `int` per physical handle: the
//!   file descriptor of the handle *in the sending process*, which the receiver takes with
//!   `pidfd_open` + `pidfd_getfd`. Every handle has the header's `segment_size`, and the
//!   receiver maps handle `i` at `i × segment_size`. Versions 1 and 2 (torch 2.5 to 2.12) use
//!   a 24-byte header `{pid: i32, pad: 4, segment_size: u64, num_handles: u64}`; version 3
//!   (torch 2.13 on) adds `{handle_type: i32, pad: 4}` (1: POSIX file descriptors, 2: fabric
//!   handles, which cistern neither sends nor reads). Torch's reader of each version reads only
//!   its own header, so the writer must know the reader's version: [`TorchFormat`].
//! * type `'v'` (cistern's own): physical handles of *different* sizes, which `'e'` cannot
//!   describe: `{pid: i32, pad: 4, num_handles: u64}`, then `{size: u64, fd: i32, pad: 4}` per
//!   handle. cistern writes it only where `'e'` cannot say it (a block stitched from handles of
//!   several sizes); PyTorch's own allocator refuses it ("unexpected or illformed shareable
//!   handle type"), so such a block reaches only receivers that run cistern.
//!
//! Padding is written as zeros and ignored when read.

use std::fmt;

/// `'c'`: a `cudaMalloc` allocation's IPC handle.
pub const TYPE_CUDA_MALLOC: u8 = b'c';
/// `'e'`: uniform physical handles (PyTorch's expandable segments).
pub const TYPE_EXPANDABLE: u8 = b'e';
/// `'v'`: physical handles of several sizes (cistern only).
pub const TYPE_VARIABLE: u8 = b'v';
/// The size of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// The memory of a shared range, as the sending process describes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Shared {
    /// Physical handles of process `pid`, exported there as file descriptors, mapped one after
    /// another from the start of the range: `(fd in pid, size in bytes)` each.
    Handles {
        /// The sending process.
        pid: u32,
        /// Each handle's descriptor (in `pid`) and size, in address order.
        handles: Vec<(i32, u64)>,
    },
    /// A `cuMemAlloc` allocation, by its CUDA IPC handle.
    Ipc {
        /// The `cuIpcGetMemHandle` handle of the allocation's base.
        handle: [u8; IPC_HANDLE_BYTES],
    },
}

impl Shared {
    /// Bytes of the range (0 for [`Shared::Ipc`], whose size the driver knows).
    pub fn len(&self) -> u64 {
        match self {
            Shared::Handles { handles, .. } => handles.iter().map(|h| h.1).sum(),
            Shared::Ipc { .. } => 0,
        }
    }

    /// Whether the range has no bytes (a [`Shared::Handles`] without handles).
    pub fn is_empty(&self) -> bool {
        matches!(self, Shared::Handles { handles, .. } if handles.is_empty())
    }
}

/// A live block, shared: its range's memory, and where the block starts in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    /// The range's memory.
    pub memory: Shared,
    /// The block's offset from the range's start (PyTorch's `ShareableHandle::offset`).
    pub offset: u64,
}

/// Which of PyTorch's handle formats to write: the *receiver's* torch decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchFormat {
    /// Version 1, the 24-byte `'e'` header: read by torch 2.5 to 2.12.
    V1,
    /// Version 3, the 32-byte `'e'` header with its handle type: torch 2.13 onward.
    V3,
}

impl TorchFormat {
    /// The format torch `major.minor` reads.
    pub fn for_torch(major: u32, minor: u32) -> TorchFormat {
        if (major, minor) >= (2, 13) {
            TorchFormat::V3
        } else {
            TorchFormat::V1
        }
    }

    fn version(self) -> u8 {
        match self {
            TorchFormat::V1 => 1,
            TorchFormat::V3 => 3,
        }
    }
}

/// Why a handle could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatError(pub String);

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FormatError {}

/// Encodes `memory` as PyTorch's handle bytes in `format`.
pub fn encode(memory: &Shared, format: TorchFormat) -> Vec<u8> {
    let mut out = vec![format.version()];
    match memory {
        Shared::Ipc { handle } => {
            out.push(TYPE_CUDA_MALLOC);
            out.extend_from_slice(handle);
        }
        Shared::Handles { pid, handles } => {
            let uniform = handles.first().map(|h| h.1);
            if let Some(size) = uniform.filter(|&s| handles.iter().all(|h| h.1 == s)) {
                out.push(TYPE_EXPANDABLE);
                out.extend_from_slice(&(*pid as i32).to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&(handles.len() as u64).to_le_bytes());
                if format == TorchFormat::V3 {
                    out.extend_from_slice(&1i32.to_le_bytes());
                    out.extend_from_slice(&[0; 4]);
                }
                for &(fd, _) in handles {
                    out.extend_from_slice(&fd.to_le_bytes());
                }
            } else {
                out.push(TYPE_VARIABLE);
                out.extend_from_slice(&(*pid as i32).to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&(handles.len() as u64).to_le_bytes());
                for &(fd, size) in handles {
                    out.extend_from_slice(&size.to_le_bytes());
                    out.extend_from_slice(&fd.to_le_bytes());
                    out.extend_from_slice(&[0; 4]);
                }
            }
        }
    }
    out
}

/// A cursor over handle bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], FormatError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(FormatError(format!(
                "the handle is {} bytes, too short for its {what}",
                self.bytes.len()
            )));
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn i32(&mut self, what: &str) -> Result<i32, FormatError> {
        Ok(i32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
}

/// The most handles one description may name (a range of 16 TiB of 2 MiB handles): a bound
/// that keeps a corrupt count from allocating without limit.
const MAX_HANDLES: u64 = 1 << 23;

/// Reads PyTorch's (or cistern's `'v'`) handle bytes.
pub fn decode(bytes: &[u8]) -> Result<Shared, FormatError> {
    if bytes.len() == IPC_HANDLE_BYTES {
        // torch before 2.5: the bare cudaIpcMemHandle_t.
        return Ok(Shared::Ipc {
            handle: bytes.try_into().unwrap(),
        });
    }
    let mut r = Reader { bytes, at: 0 };
    let version = r.take(1, "version")?[0];
    if !(1..=3).contains(&version) {
        return Err(FormatError(format!(
            "handle version {version} is not one cistern reads (1 to 3: torch 2.5 to 2.15's); \
             was it written by a newer torch?"
        )));
    }
    let kind = r.take(1, "type")?[0];
    let pid_of = |v: i32| {
        u32::try_from(v)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| FormatError(format!("the handle names process {v}")))
    };
    let count = |n: u64| {
        if n == 0 || n > MAX_HANDLES {
            Err(FormatError(format!(
                "the handle names {n} physical handles (1 to {MAX_HANDLES} expected)"
            )))
        } else {
            Ok(n as usize)
        }
    };
    let shared = match kind {
        TYPE_CUDA_MALLOC => Shared::Ipc {
            handle: r
                .take(IPC_HANDLE_BYTES, "CUDA IPC handle")?
                .try_into()
                .unwrap(),
        },
        TYPE_EXPANDABLE => {
            let pid = pid_of(r.i32("header")?)?;
            r.take(4, "header")?;
            let size = r.u64("header")?;
            let n = count(r.u64("header")?)?;
            if version >= 3 {
                let ty = r.i32("header")?;
                r.take(4, "header")?;
                if ty == 2 {
                    return Err(FormatError(
                        "the handle shares fabric handles (torch's \
                         expandable_segments_handle_type:fabric); cistern reads POSIX file \
                         descriptors only: set expandable_segments_handle_type:posix_fd in the \
                         sender's PYTORCH_CUDA_ALLOC_CONF"
                            .into(),
                    ));
                }
                if !(0..=1).contains(&ty) {
                    return Err(FormatError(format!(
                        "unknown handle type {ty} in the header"
                    )));
                }
            }
            if size == 0 {
                return Err(FormatError("the header's segment size is 0".into()));
            }
            if version < 3 && bytes.len() - r.at == n.saturating_mul(64) {
                // Versions 1 and 2 carry no handle type: 64 bytes a handle are fabric handles
                // (torch's expandable_segments_handle_type:fabric), not descriptors.
                return Err(FormatError(
                    "the handle shares fabric handles (64 bytes each); cistern reads POSIX file \
                     descriptors only: set expandable_segments_handle_type:posix_fd in the \
                     sender's PYTORCH_CUDA_ALLOC_CONF"
                        .into(),
                ));
            }
            let mut handles = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                handles.push((r.i32("file descriptors")?, size));
            }
            Shared::Handles { pid, handles }
        }
        TYPE_VARIABLE => {
            let pid = pid_of(r.i32("header")?)?;
            r.take(4, "header")?;
            let n = count(r.u64("header")?)?;
            let mut handles = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                let size = r.u64("handles")?;
                let fd = r.i32("handles")?;
                r.take(4, "handles")?;
                if size == 0 {
                    return Err(FormatError("a handle of 0 bytes".into()));
                }
                handles.push((fd, size));
            }
            Shared::Handles { pid, handles }
        }
        other => {
            return Err(FormatError(format!(
                "unknown handle type {:?} (cistern reads 'c', 'e' and 'v')",
                other as char
            )))
        }
    };
    if r.at != bytes.len() {
        return Err(FormatError(format!(
            "{} bytes follow the handle's end",
            bytes.len() - r.at
        )));
    }
    Ok(shared)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn uniform_handles_are_torchs_expandable_format() {
        let m = Shared::Handles {
            pid: 4242,
            handles: vec![(7, 20 * MIB), (9, 20 * MIB)],
        };
        let v1 = encode(&m, TorchFormat::V1);
        assert_eq!(&v1[..2], &[1, b'e']);
        assert_eq!(v1.len(), 2 + 24 + 8);
        assert_eq!(i32::from_le_bytes(v1[2..6].try_into().unwrap()), 4242);
        assert_eq!(&v1[6..10], &[0; 4]);
        assert_eq!(u64::from_le_bytes(v1[10..18].try_into().unwrap()), 20 * MIB);
        assert_eq!(u64::from_le_bytes(v1[18..26].try_into().unwrap()), 2);
        assert_eq!(i32::from_le_bytes(v1[26..30].try_into().unwrap()), 7);
        assert_eq!(decode(&v1).unwrap(), m);
        let v3 = encode(&m, TorchFormat::V3);
        assert_eq!(&v3[..2], &[3, b'e']);
        assert_eq!(v3.len(), 2 + 32 + 8);
        assert_eq!(i32::from_le_bytes(v3[26..30].try_into().unwrap()), 1);
        assert_eq!(decode(&v3).unwrap(), m);
    }

    #[test]
    fn mixed_handles_use_cisterns_format() {
        let m = Shared::Handles {
            pid: 17,
            handles: vec![(3, 20 * MIB), (4, 2 * MIB), (5, 2 * MIB)],
        };
        let b = encode(&m, TorchFormat::V1);
        assert_eq!(b[1], b'v');
        assert_eq!(b.len(), 2 + 16 + 3 * 16);
        assert_eq!(decode(&b).unwrap(), m);
        assert_eq!(m.len(), 24 * MIB);
    }

    #[test]
    fn cuda_malloc_handles_and_torch_2_4s_bare_handles() {
        let mut h = [0u8; 64];
        h[0] = 0xab;
        h[63] = 0xcd;
        let m = Shared::Ipc { handle: h };
        for f in [TorchFormat::V1, TorchFormat::V3] {
            let b = encode(&m, f);
            assert_eq!(b.len(), 66);
            assert_eq!(b[1], b'c');
            assert_eq!(decode(&b).unwrap(), m);
        }
        assert_eq!(decode(&h).unwrap(), m);
    }

    #[test]
    fn the_torch_version_picks_the_header() {
        assert_eq!(TorchFormat::for_torch(2, 5), TorchFormat::V1);
        assert_eq!(TorchFormat::for_torch(2, 12), TorchFormat::V1);
        assert_eq!(TorchFormat::for_torch(2, 13), TorchFormat::V3);
        assert_eq!(TorchFormat::for_torch(3, 0), TorchFormat::V3);
    }

    #[test]
    fn bad_handles_are_clear_errors() {
        let err = |b: &[u8]| decode(b).unwrap_err().0;
        assert!(err(&[]).contains("too short"));
        assert!(err(&[9, b'e']).contains("version 9"));
        assert!(err(&[1, b'x']).contains("unknown handle type 'x'"));
        assert!(err(&[1, b'e', 1, 0]).contains("too short"));
        let m = Shared::Handles {
            pid: 5,
            handles: vec![(3, 2 * MIB)],
        };
        let mut b = encode(&m, TorchFormat::V3);
        b[26] = 2; // fabric
        assert!(err(&b).contains("posix_fd"));
        let mut b = encode(&m, TorchFormat::V1);
        b.push(0);
        assert!(err(&b).contains("follow"));
        // Version 1 or 2 with a 64-byte fabric handle where a descriptor would be.
        let mut b = encode(&m, TorchFormat::V1);
        b.truncate(26);
        b.extend_from_slice(&[7; 64]);
        assert!(err(&b).contains("fabric"));
        let mut b = encode(&m, TorchFormat::V1);
        b[18..26].copy_from_slice(&0u64.to_le_bytes());
        assert!(err(&b).contains("0 physical handles"));
        let mut b = encode(&m, TorchFormat::V1);
        b[2..6].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(err(&b).contains("process -1"));
    }
}
