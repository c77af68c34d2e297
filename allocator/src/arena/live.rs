//! The arena's map of live pointers, hashed by address (see Note [An address-ordered hash]).

use super::HeapKind;
use crate::heap::SpanId;

/// Live pointers to their spans.
///
/// # Note [An address-ordered hash]
///
/// The map is a hash table whose bucket index is the block's address in 512 B units (the low
/// bits of the hash), with mixed bits only in the top seven bits that hashbrown uses as tags.
/// Blocks that are neighbours in memory are neighbours in the table, so a program that frees
/// in allocation order (queues of activations, KV caches) walks the table sequentially instead
/// of missing the cache on every free; random frees cost the same as with a mixing hash.
pub(crate) type LiveMap = std::collections::HashMap<u64, LiveRef, AddressHash>;

/// The hasher of [`LiveMap`] (see the note there).
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct AddressHash;

impl std::hash::BuildHasher for AddressHash {
    type Hasher = AddressHasher;
    #[inline]
    fn build_hasher(&self) -> AddressHasher {
        AddressHasher(0)
    }
}

/// Hashes one `u64` address as described in [`LiveMap`].
#[derive(Default, Debug)]
pub(crate) struct AddressHasher(u64);

impl std::hash::Hasher for AddressHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed; this path exists for completeness.
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ b as u64);
        }
    }
    #[inline]
    fn write_u64(&mut self, addr: u64) {
        let tag = addr.wrapping_mul(0x9E37_79B9_7F4A_7C15) & (0x7F << 57);
        self.0 = (addr >> 9) & !(0x7F << 57) | tag;
    }
}

/// Where a live block is: heap kind and span.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveRef {
    pub kind: HeapKind,
    pub span: SpanId,
}
