//! Provenance: who allocated each live block, and the ledger of live bytes per (tag, site).
//!
//! Every allocation of a pool with `provenance:tags` (the default) or `provenance:stacks`
//! records in the block's `BlockMeta` (`crate::heap`), beside its span:
//!
//! - the **tag**: the innermost entry of the allocating thread's tag stack ([`tag_push`],
//!   [`tag_pop`], [`TagGuard`], [`with_tag`]; `cistern_tag_push` from C), interned to a small
//!   id ([`tag_name`] turns it back into text);
//! - the **thread**: a small id from a global counter, cached per thread ([`thread_id`]);
//! - the **time**: a monotonic clock in nanoseconds since the process first asked for it
//!   ([`now_ns`]; the coarse clock on Linux: a few nanoseconds to read, millisecond steps);
//! - a per-arena **sequence number**, which [`Mark`]s compare exactly (times could tie);
//! - with `provenance:stacks`, every `stack_sample_rate`-th allocation of each thread (the first
//!   one included) carries a **call site**: the return addresses of a native backtrace,
//!   interned by their hash. Sites are symbolised only when a report asks ([`site_frames`]).
//!   A client running an interpreter can give the frames of its own language instead
//!   ([`set_site_provider`]; `libcistern.so` gives Python's, see Note [Foreign frames]).
//!
//! # Note [Provenance on the hot path]
//!
//! The hot path reads the thread-locals once before taking the arena lock (`origin`); under
//! the lock it writes the block's meta and bumps one slot of the arena's `Ledger` (the slot of
//! the previous allocation is remembered, so a run of allocations under one tag skips the hash
//! lookup). The ledger is per arena, like the gauges of Note [Sharded gauges] in
//! [`crate::stats`]: no shared write; [`crate::DevicePool::ledger`] sums the arenas when read.
//! A free finds its slot in the block's meta (no lookup). With `provenance:off` the pool skips
//! all of it on one branch, and the meta table stays empty. Stack capture (microseconds) happens
//! before the lock, never under it.
//!
//! Peaks are kept per arena and summed when read: exact when a (tag, site) lives on one stream,
//! an upper bound when several streams hold it at once.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::RwLock;
use rustc_hash::FxHashMap;

/// Distinct tags kept; later new names all become [`OVERFLOW_TAG`] (a tag per step in a loop
/// must not grow memory without bound).
pub const MAX_TAGS: usize = 1 << 16;
/// The name that tags beyond [`MAX_TAGS`] share.
pub const OVERFLOW_TAG: &str = "(too many tags)";
/// Distinct call sites kept; later new stacks are not recorded (their blocks have no site).
pub const MAX_SITES: usize = 1 << 16;
/// Frames kept per captured stack.
pub const MAX_FRAMES: usize = 32;

// ---------------------------------------------------------------------------------------------
// Tags.

struct Interner {
    ids: FxHashMap<Box<str>, u32>,
    names: Vec<Box<str>>,
}

fn tags() -> &'static RwLock<Interner> {
    static TAGS: OnceLock<RwLock<Interner>> = OnceLock::new();
    TAGS.get_or_init(|| {
        RwLock::new(Interner {
            ids: FxHashMap::default(),
            // Id 0 is "no tag".
            names: vec!["".into()],
        })
    })
}

/// The longest tag name kept, in bytes; longer names are cut at a character boundary.
pub const MAX_TAG_BYTES: usize = 256;

fn truncate_tag(name: &str) -> &str {
    if name.len() <= MAX_TAG_BYTES {
        return name;
    }
    let mut end = MAX_TAG_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// The id of tag `name` (interned once; never 0).
pub fn intern_tag(name: &str) -> u32 {
    // Names are kept for the life of the process and published in registry records (capped
    // at 1 MiB): a tag is a label, so only its first MAX_TAG_BYTES bytes count.
    let name = truncate_tag(name);
    if let Some(&id) = tags().read().ids.get(name) {
        return id;
    }
    let mut t = tags().write();
    if let Some(&id) = t.ids.get(name) {
        return id;
    }
    let name = if t.names.len() >= MAX_TAGS {
        if let Some(&id) = t.ids.get(OVERFLOW_TAG) {
            return id;
        }
        OVERFLOW_TAG
    } else {
        name
    };
    let id = t.names.len() as u32;
    t.names.push(name.into());
    t.ids.insert(name.into(), id);
    id
}

/// The name of tag `id`; `None` for 0 (no tag) and unknown ids.
pub fn tag_name(id: u32) -> Option<String> {
    if id == 0 {
        return None;
    }
    tags().read().names.get(id as usize).map(|s| s.to_string())
}

thread_local! {
    /// The innermost tag of this thread (0: none): the one value the hot path reads.
    static CURRENT_TAG: Cell<u32> = const { Cell::new(0) };
    /// This thread's small id (0: not assigned yet).
    static THREAD_ID: Cell<u32> = const { Cell::new(0) };
    /// Allocations until this thread's next stack sample (0: sample the next one).
    static COUNTDOWN: Cell<u32> = const { Cell::new(0) };
    /// This thread's tag stack (ids), innermost last.
    static STACK: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Pushes `name` on this thread's tag stack: allocations of this thread are tagged with it until
/// it is popped (or a deeper tag is pushed). Returns the tag's id.
pub fn tag_push(name: &str) -> u32 {
    let id = intern_tag(name);
    let _ = STACK.try_with(|s| s.borrow_mut().push(id));
    let _ = CURRENT_TAG.try_with(|c| c.set(id));
    id
}

/// Pops the innermost tag of this thread. Returns `false` when the stack was empty.
pub fn tag_pop() -> bool {
    STACK
        .try_with(|s| {
            let mut s = s.borrow_mut();
            let popped = s.pop().is_some();
            let cur = s.last().copied().unwrap_or(0);
            let _ = CURRENT_TAG.try_with(|c| c.set(cur));
            popped
        })
        .unwrap_or(false)
}

/// How many tags this thread has pushed and not popped.
pub fn tag_depth() -> usize {
    STACK.try_with(|s| s.borrow().len()).unwrap_or(0)
}

/// The id of this thread's innermost tag (0: none).
#[inline]
pub fn current_tag_id() -> u32 {
    CURRENT_TAG.try_with(Cell::get).unwrap_or(0)
}

/// The name of this thread's innermost tag.
pub fn current_tag() -> Option<String> {
    tag_name(current_tag_id())
}

/// Pops the tag it pushed when dropped. Not `Send`: tags belong to one thread.
#[must_use = "the tag is popped when the guard is dropped"]
pub struct TagGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TagGuard {
    /// Pushes `name`; the guard pops it.
    pub fn new(name: &str) -> TagGuard {
        tag_push(name);
        TagGuard {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for TagGuard {
    fn drop(&mut self) {
        tag_pop();
    }
}

/// Runs `f` with `name` pushed on this thread's tag stack (popped afterwards, also on panic).
pub fn with_tag<R>(name: &str, f: impl FnOnce() -> R) -> R {
    let _g = TagGuard::new(name);
    f()
}

// ---------------------------------------------------------------------------------------------
// Threads and time.

static NEXT_THREAD: AtomicU32 = AtomicU32::new(1);

/// This thread's small id (1, 2, ... in order of first use; never 0).
#[inline]
pub fn thread_id() -> u32 {
    THREAD_ID
        .try_with(|t| {
            let v = t.get();
            if v != 0 {
                v
            } else {
                let v = NEXT_THREAD.fetch_add(1, Relaxed);
                t.set(v);
                v
            }
        })
        .unwrap_or(0)
}

#[inline]
fn raw_clock_ns() -> u64 {
    #[cfg(target_os = "linux")]
    {
        crate::sys::monotonic_coarse_ns()
    }
    #[cfg(not(target_os = "linux"))]
    {
        static START: OnceLock<std::time::Instant> = OnceLock::new();
        START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
    }
}

fn clock_base() -> u64 {
    static BASE: OnceLock<u64> = OnceLock::new();
    *BASE.get_or_init(|| raw_clock_ns().saturating_sub(1))
}

/// Monotonic nanoseconds since the process first read this clock (a pool's creation reads it),
/// never 0. Coarse on Linux (steps of a few milliseconds): for ages, not for ordering.
#[inline]
pub fn now_ns() -> u64 {
    raw_clock_ns().saturating_sub(clock_base()).max(1)
}

// ---------------------------------------------------------------------------------------------
// Call sites: `sites.rs`.

mod sites;
pub use sites::{
    capture_site, set_site_provider, site_count, site_frames, site_label, site_provider,
    split_frame, SiteProvider,
};

// ---------------------------------------------------------------------------------------------
// What the hot path records.

/// How much provenance a pool records (`provenance` in `CISTERN_CONF`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Nothing: the hot path skips provenance on one branch.
    Off,
    /// Tag, thread, time and sequence of every block; the ledger.
    #[default]
    Tags,
    /// As `Tags`, plus a sampled native backtrace every `stack_sample_rate` allocations.
    Stacks,
}

/// The provenance of one allocation, read before the arena lock.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct Origin {
    pub tag: u32,
    pub site: u32,
    pub thread: u32,
    pub time_ns: u64,
}

/// Reads this thread's provenance for an allocation (and captures a stack when one is due).
#[inline]
pub(crate) fn origin(stacks: bool, rate: u32) -> Origin {
    let site = if stacks && rate != 0 {
        let due = COUNTDOWN
            .try_with(|c| {
                let v = c.get();
                if v == 0 || v > rate {
                    c.set(rate - 1);
                    true
                } else {
                    c.set(v - 1);
                    false
                }
            })
            .unwrap_or(false);
        if due {
            capture_site()
        } else {
            0
        }
    } else {
        0
    };
    Origin {
        tag: current_tag_id(),
        site,
        thread: thread_id(),
        time_ns: now_ns(),
    }
}

/// One (tag, site) slot of an arena's ledger.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Slot {
    pub tag: u32,
    pub site: u32,
    pub live_bytes: i64,
    pub live_blocks: i64,
    pub peak_bytes: i64,
    pub total_allocs: u64,
}

/// One arena's ledger: live bytes, blocks, peak and total allocations per (tag, site).
#[derive(Debug)]
pub(crate) struct Ledger {
    pub slots: Vec<Slot>,
    index: FxHashMap<u64, u32>,
    last_key: u64,
    last_slot: u32,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            slots: Vec::new(),
            index: FxHashMap::default(),
            last_key: u64::MAX,
            last_slot: 0,
        }
    }
}

impl Ledger {
    /// Counts a new live block of `bytes`; returns its slot.
    #[inline]
    pub fn add(&mut self, tag: u32, site: u32, bytes: u64) -> u32 {
        let key = (tag as u64) << 32 | site as u64;
        let slot = if key == self.last_key {
            self.last_slot
        } else {
            let slot = self.slot_of(key, tag, site);
            self.last_key = key;
            self.last_slot = slot;
            slot
        };
        let s = &mut self.slots[slot as usize];
        s.live_bytes += bytes as i64;
        s.live_blocks += 1;
        s.total_allocs += 1;
        s.peak_bytes = s.peak_bytes.max(s.live_bytes);
        slot
    }

    #[cold]
    fn slot_of(&mut self, key: u64, tag: u32, site: u32) -> u32 {
        let n = self.slots.len() as u32;
        let slot = *self.index.entry(key).or_insert(n);
        if slot == n {
            self.slots.push(Slot {
                tag,
                site,
                ..Slot::default()
            });
        }
        slot
    }

    /// Counts the end of a live block of `bytes` in `slot`.
    #[inline]
    pub fn remove(&mut self, slot: u32, bytes: u64) {
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.live_bytes -= bytes as i64;
            s.live_blocks -= 1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reports.

/// Live bytes, blocks, peak and total allocations of one (tag, site) on one device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LedgerEntry {
    /// The tag (empty: allocations made with no tag pushed).
    pub tag: String,
    /// The sampled call site ([`site_frames`] symbolises it); `None` for unsampled blocks.
    pub site: Option<u32>,
    /// Bytes in live blocks (rounded sizes, like `allocated_bytes`).
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Highest live bytes (per stream, summed over streams: see the module docs).
    pub peak_bytes: u64,
    /// Allocations ever made.
    pub total_allocs: u64,
}

/// A point in a device pool's allocation history ([`crate::DevicePool::mark`]).
#[derive(Clone, Debug)]
pub struct Mark {
    pub(crate) pool: u64,
    /// Each arena's sequence number at the mark, by the arena's stream id (a handle can name
    /// several streams: per thread, or after a stream was destroyed).
    pub(crate) seqs: Vec<(u64, u64)>,
    /// [`now_ns`] at the mark.
    pub time_ns: u64,
}

impl Mark {
    /// The arena sequence number at the mark (0: the arena did not exist yet).
    pub(crate) fn seq_of(&self, stream_id: u64) -> u64 {
        self.seqs
            .iter()
            .find(|(s, _)| *s == stream_id)
            .map_or(0, |(_, q)| *q)
    }
}

/// A live block with its provenance.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LiveBlock {
    /// Device pointer.
    pub ptr: u64,
    /// Rounded size.
    pub size: u64,
    /// Size asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: u64,
    /// Its tag (`None`: no tag, or provenance off).
    pub tag: Option<String>,
    /// Its sampled call site.
    pub site: Option<u32>,
    /// The small id of the allocating thread (0: unknown).
    pub thread: u32,
    /// [`now_ns`] when it was allocated (0: unknown).
    pub time_ns: u64,
    /// How long it has been live (coarse).
    pub age: Duration,
}

/// Live blocks of one (tag, site), for leak reports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LiveGroup {
    /// The tag (empty: none).
    pub tag: String,
    /// The sampled call site.
    pub site: Option<u32>,
    /// Bytes (rounded).
    pub bytes: u64,
    /// Blocks.
    pub blocks: u64,
    /// The age of the oldest block.
    pub oldest: Duration,
}

/// Groups blocks by (tag, site), largest bytes first.
pub fn group_live(blocks: &[LiveBlock]) -> Vec<LiveGroup> {
    let mut m: FxHashMap<(String, Option<u32>), LiveGroup> = FxHashMap::default();
    for b in blocks {
        let tag = b.tag.clone().unwrap_or_default();
        let g = m.entry((tag.clone(), b.site)).or_insert(LiveGroup {
            tag,
            site: b.site,
            bytes: 0,
            blocks: 0,
            oldest: Duration::ZERO,
        });
        g.bytes += b.size;
        g.blocks += 1;
        g.oldest = g.oldest.max(b.age);
    }
    let mut v: Vec<_> = m.into_values().collect();
    v.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then_with(|| a.tag.cmp(&b.tag))
            .then(a.site.cmp(&b.site))
    });
    v
}

/// Sums per-arena ledgers into entries, largest live bytes first.
pub(crate) fn merge_ledgers<'a>(ledgers: impl Iterator<Item = &'a Ledger>) -> Vec<LedgerEntry> {
    let mut m: FxHashMap<(u32, u32), Slot> = FxHashMap::default();
    for l in ledgers {
        for s in &l.slots {
            let e = m.entry((s.tag, s.site)).or_insert(Slot {
                tag: s.tag,
                site: s.site,
                ..Slot::default()
            });
            e.live_bytes += s.live_bytes;
            e.live_blocks += s.live_blocks;
            e.peak_bytes += s.peak_bytes;
            e.total_allocs += s.total_allocs;
        }
    }
    let mut v: Vec<LedgerEntry> = m
        .into_values()
        .map(|s| LedgerEntry {
            tag: tag_name(s.tag).unwrap_or_default(),
            site: (s.site != 0).then_some(s.site),
            live_bytes: s.live_bytes.max(0) as u64,
            live_blocks: s.live_blocks.max(0) as u64,
            peak_bytes: s.peak_bytes.max(0) as u64,
            total_allocs: s.total_allocs,
        })
        .collect();
    v.sort_by(|a, b| {
        b.live_bytes
            .cmp(&a.live_bytes)
            .then_with(|| a.tag.cmp(&b.tag))
            .then(a.site.cmp(&b.site))
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_tags_are_cut_at_a_character_boundary() {
        let long = "é".repeat(400); // 800 bytes
        let id = intern_tag(&long);
        let name = tag_name(id).unwrap();
        assert!(name.len() <= MAX_TAG_BYTES && name.len() >= MAX_TAG_BYTES - 1);
        assert!(long.starts_with(&name));
        assert_eq!(intern_tag(&name), id);
    }

    #[test]
    fn tags_intern_and_nest() {
        assert_eq!(intern_tag("unit-a"), intern_tag("unit-a"));
        assert_ne!(intern_tag("unit-a"), intern_tag("unit-b"));
        assert_eq!(tag_name(0), None);
        assert_eq!(current_tag(), None);
        with_tag("unit-outer", || {
            assert_eq!(current_tag().as_deref(), Some("unit-outer"));
            {
                let _g = TagGuard::new("unit-inner");
                assert_eq!(current_tag().as_deref(), Some("unit-inner"));
                assert_eq!(tag_depth(), 2);
                std::thread::spawn(|| assert_eq!(current_tag(), None))
                    .join()
                    .unwrap();
            }
            assert_eq!(current_tag().as_deref(), Some("unit-outer"));
        });
        assert_eq!(current_tag(), None);
        assert!(!tag_pop());
    }

    #[test]
    fn threads_get_distinct_small_ids() {
        let a = thread_id();
        assert_eq!(a, thread_id());
        let b = std::thread::spawn(thread_id).join().unwrap();
        assert_ne!(a, b);
        assert!(a > 0 && b > 0);
    }

    #[test]
    fn clock_is_monotonic() {
        let a = now_ns();
        std::thread::sleep(Duration::from_millis(20));
        let b = now_ns();
        assert!(a >= 1 && b > a, "{a} {b}");
    }

    #[test]
    fn ledger_slots() {
        let (a, b) = (intern_tag("unit-ledger-a"), intern_tag("unit-ledger-b"));
        let mut l = Ledger::default();
        let s1 = l.add(a, 0, 512);
        let s2 = l.add(b, 0, 1024);
        assert_eq!(l.add(a, 0, 512), s1);
        l.remove(s1, 512);
        l.remove(s2, 1024);
        let e = merge_ledgers([&l].into_iter());
        assert_eq!(e[0].tag, "unit-ledger-a");
        assert_eq!(
            (e[0].live_bytes, e[0].live_blocks, e[0].total_allocs),
            (512, 1, 2)
        );
        assert_eq!((e[1].live_bytes, e[1].peak_bytes), (0, 1024));
        let s = &l.slots[s1 as usize];
        assert_eq!(
            (s.live_bytes, s.live_blocks, s.peak_bytes, s.total_allocs),
            (512, 1, 1024, 2)
        );
    }
}
