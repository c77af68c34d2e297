//! The search structure: spans of address ranges and a segregated-fit index over the free ones.
//!
//! A [`Heap`] owns the *bookkeeping* of one or more segments (contiguous address ranges). Every
//! byte of a segment belongs to exactly one [`Span`], and each span is
//!
//! * `Live`: handed to a user,
//! * `Pending`: freed by the user, but other streams may still use it (waiting on events),
//! * `Free`: mapped and reusable,
//! * `Hole`: address space with no physical memory behind it (page-aligned).
//!
//! It knows nothing of devices, drivers, pages or streams: it works on `(address, length)` and
//! never calls anything. The pool above it decides which pages are mapped and turns holes into
//! free space (after mapping) or free space into holes (before unmapping).
//!
//! # Note [Segregated fit]
//!
//! Free spans are indexed TLSF-style: sizes are counted in 512 B units, a first level per power
//! of two and 16 linear sub-classes per level, with one bitmap per level. Finding a free span is
//! O(1) in the number of spans: scan the head of the request's own class for the best fit (up to
//! [`CLASS_SCAN`] entries, stopping at an exact fit, so that a loop that frees and allocates the
//! same sizes gets its own blocks back), else take the first span of the next non-empty class
//! (every span there is large enough). Free spans are always coalesced with free neighbours, so
//! a span's neighbours are never free.

/// Every size and address the heap deals with is a multiple of this.
pub const ALIGN: u64 = 512;

/// Index of a span inside its heap. Stable for as long as the span is live or pending.
pub type SpanId = u32;

/// "No span".
pub const NIL: SpanId = u32::MAX;

const SL_LOG2: u32 = 4;
const SL: usize = 1 << SL_LOG2;
const FL: usize = 48;

/// How many spans of the request's own class are examined for a best fit.
pub const CLASS_SCAN: usize = 32;

/// The state of a span.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SpanState {
    /// Mapped and reusable.
    Free,
    /// Handed to a user.
    Live,
    /// Freed by the user; waiting for other streams' work to finish.
    Pending,
    /// Address space without physical memory.
    Hole,
    /// An unused slot of the span table.
    Vacant,
}

/// Provenance of a live block, kept beside its span (a parallel table, so that the spans the hot
/// path walks stay small). The provenance layer fills it; the pool clears it on free.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockMeta {
    /// Interned tag id (0: none).
    pub tag: u32,
    /// Interned call-site id (0: not sampled).
    pub site: u32,
    /// Small id of the allocating thread (0: unknown).
    pub thread: u32,
    /// Monotonic allocation time in nanoseconds (0: not recorded).
    pub time_ns: u64,
    /// The arena's allocation sequence number (0: not recorded), compared by marks.
    pub seq: u64,
    /// The arena ledger's slot of the block, plus one (0: not in the ledger).
    pub slot: u32,
}

/// One span: a range of a segment in one state.
#[derive(Clone, Debug)]
pub struct Span {
    /// First address.
    pub start: u64,
    /// Length in bytes (a multiple of [`ALIGN`]).
    pub len: u64,
    /// What the span is.
    pub state: SpanState,
    /// The segment it belongs to (the pool's index).
    pub seg: u32,
    /// The span just below, or [`NIL`].
    pub prev: SpanId,
    /// The span just above, or [`NIL`].
    pub next: SpanId,
    fprev: SpanId,
    fnext: SpanId,
    /// The size the user asked for (before rounding), for a live or pending block.
    pub requested: u64,
}

impl Span {
    /// One past the last address.
    #[inline]
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Spans of some segments, with a segregated free-list index.
#[derive(Debug)]
pub struct Heap {
    spans: Vec<Span>,
    /// Provenance by span id; empty until someone records provenance.
    meta: Vec<BlockMeta>,
    vacant: Vec<SpanId>,
    heads: Vec<SpanId>,
    fl_bitmap: u64,
    sl_bitmap: [u32; FL],
    free_count: u64,
    free_bytes: u64,
    /// Hole spans by start address (slow-path bookkeeping: growth looks for windows here).
    holes: std::collections::BTreeMap<u64, SpanId>,
}

impl Default for Heap {
    fn default() -> Self {
        Heap::new()
    }
}

#[inline]
fn mapping(len: u64) -> (usize, usize) {
    let units = len / ALIGN;
    if units < SL as u64 {
        (0, units as usize)
    } else {
        let f = 63 - units.leading_zeros();
        let fl = (f - (SL_LOG2 - 1)) as usize;
        let sl = ((units >> (f - SL_LOG2)) as usize) - SL;
        (fl.min(FL - 1), sl)
    }
}

impl Heap {
    /// An empty heap.
    pub fn new() -> Heap {
        Heap {
            spans: Vec::new(),
            meta: Vec::new(),
            vacant: Vec::new(),
            heads: vec![NIL; FL * SL],
            fl_bitmap: 0,
            sl_bitmap: [0; FL],
            free_count: 0,
            free_bytes: 0,
            holes: std::collections::BTreeMap::new(),
        }
    }

    /// The span `id`.
    #[inline]
    pub fn span(&self, id: SpanId) -> &Span {
        &self.spans[id as usize]
    }

    /// Sets the requested size of the live span `id`.
    #[inline]
    pub fn set_requested(&mut self, id: SpanId, requested: u64) {
        self.spans[id as usize].requested = requested;
    }

    /// The provenance of span `id`.
    #[inline]
    pub fn meta(&self, id: SpanId) -> BlockMeta {
        self.meta.get(id as usize).copied().unwrap_or_default()
    }

    /// The provenance of span `id`, mutably (grows the table on first use).
    #[inline]
    pub fn meta_mut(&mut self, id: SpanId) -> &mut BlockMeta {
        let i = id as usize;
        if self.meta.len() <= i {
            self.meta
                .resize(self.spans.len().max(i + 1), BlockMeta::default());
        }
        &mut self.meta[i]
    }

    /// Number of free spans.
    pub fn free_count(&self) -> u64 {
        self.free_count
    }

    /// Bytes in free spans.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    fn new_span(&mut self, span: Span) -> SpanId {
        if let Some(id) = self.vacant.pop() {
            self.spans[id as usize] = span;
            id
        } else {
            self.spans.push(span);
            (self.spans.len() - 1) as SpanId
        }
    }

    fn release(&mut self, id: SpanId) {
        let s = &mut self.spans[id as usize];
        s.state = SpanState::Vacant;
        s.prev = NIL;
        s.next = NIL;
        self.vacant.push(id);
    }

    fn insert_free(&mut self, id: SpanId) {
        let (fl, sl) = mapping(self.spans[id as usize].len);
        let idx = fl * SL + sl;
        let head = self.heads[idx];
        {
            let s = &mut self.spans[id as usize];
            s.state = SpanState::Free;
            s.fprev = NIL;
            s.fnext = head;
        }
        if head != NIL {
            self.spans[head as usize].fprev = id;
        }
        self.heads[idx] = id;
        self.fl_bitmap |= 1 << fl;
        self.sl_bitmap[fl] |= 1 << sl;
        self.free_count += 1;
        self.free_bytes += self.spans[id as usize].len;
    }

    fn remove_free(&mut self, id: SpanId) {
        let (len, fprev, fnext) = {
            let s = &self.spans[id as usize];
            debug_assert_eq!(s.state, SpanState::Free);
            (s.len, s.fprev, s.fnext)
        };
        let (fl, sl) = mapping(len);
        let idx = fl * SL + sl;
        if fprev != NIL {
            self.spans[fprev as usize].fnext = fnext;
        } else {
            self.heads[idx] = fnext;
            if fnext == NIL {
                self.sl_bitmap[fl] &= !(1 << sl);
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if fnext != NIL {
            self.spans[fnext as usize].fprev = fprev;
        }
        self.free_count -= 1;
        self.free_bytes -= len;
    }

    /// Adds a segment `[start, start + len)` as one span in `state` (`Free` or `Hole`); returns
    /// the segment's first span, which stays its first span for as long as the segment exists.
    pub fn add_segment(&mut self, seg: u32, start: u64, len: u64, state: SpanState) -> SpanId {
        debug_assert!(len > 0 && len.is_multiple_of(ALIGN) && start.is_multiple_of(ALIGN));
        let id = self.new_span(Span {
            start,
            len,
            state: SpanState::Hole,
            seg,
            prev: NIL,
            next: NIL,
            fprev: NIL,
            fnext: NIL,
            requested: 0,
        });
        if state == SpanState::Free {
            self.insert_free(id);
        } else {
            self.holes.insert(start, id);
        }
        id
    }

    /// Removes a whole segment given its first span. Every span must be free or a hole.
    pub fn remove_segment(&mut self, first: SpanId) {
        let mut id = first;
        while id != NIL {
            let next = self.spans[id as usize].next;
            match self.spans[id as usize].state {
                SpanState::Free => self.remove_free(id),
                SpanState::Hole => {
                    self.holes.remove(&self.spans[id as usize].start);
                }
                _ => {}
            }
            self.release(id);
            id = next;
        }
    }

    /// Finds a free span of at least `size` bytes (a multiple of [`ALIGN`]).
    #[inline]
    pub fn find(&self, size: u64) -> Option<SpanId> {
        let (fl, sl) = mapping(size);
        // Best fit among the first few spans of the request's own class.
        let mut id = self.heads[fl * SL + sl];
        let mut best = NIL;
        let mut best_len = u64::MAX;
        let mut scanned = 0;
        while id != NIL && scanned < CLASS_SCAN {
            let s = &self.spans[id as usize];
            if s.len >= size && s.len < best_len {
                best = id;
                best_len = s.len;
                if s.len == size {
                    break;
                }
            }
            id = s.fnext;
            scanned += 1;
        }
        if best != NIL {
            return Some(best);
        }
        // Any span of a larger class fits.
        let sl_map = if sl + 1 < SL {
            self.sl_bitmap[fl] & (!0u32 << (sl + 1))
        } else {
            0
        };
        let (fl2, sl2) = if sl_map != 0 {
            (fl, sl_map.trailing_zeros() as usize)
        } else {
            let fl_map = if fl + 1 < FL {
                self.fl_bitmap & (!0u64 << (fl + 1))
            } else {
                0
            };
            if fl_map == 0 {
                return None;
            }
            let f = fl_map.trailing_zeros() as usize;
            (f, self.sl_bitmap[f].trailing_zeros() as usize)
        };
        let head = self.heads[fl2 * SL + sl2];
        debug_assert!(head != NIL);
        Some(head)
    }

    /// Turns the free span `id` into a live block of `size` bytes at its start; the rest, if
    /// any, stays free. Returns `id`, now live.
    #[inline]
    pub fn take(&mut self, id: SpanId, size: u64) -> SpanId {
        self.remove_free(id);
        let (start, len) = {
            let s = &self.spans[id as usize];
            (s.start, s.len)
        };
        debug_assert!(len >= size);
        if len > size {
            let rest = self.split_at(id, start + size);
            self.insert_free(rest);
        }
        let s = &mut self.spans[id as usize];
        s.state = SpanState::Live;
        id
    }

    /// Turns `[lo, lo + size)`, inside the free span `id`, into a live block; the free space
    /// on either side stays free. Returns the block's span. (Restoring a graph pool's
    /// checkpoint puts blocks back at their addresses.)
    pub fn take_range(&mut self, id: SpanId, lo: u64, size: u64) -> SpanId {
        let s = &self.spans[id as usize];
        debug_assert_eq!(s.state, SpanState::Free);
        debug_assert!(s.start <= lo && size > 0 && lo + size <= s.end());
        let start = s.start;
        self.remove_free(id);
        let mid = if lo > start {
            let m = self.split_at(id, lo);
            self.insert_free(id);
            m
        } else {
            id
        };
        if self.spans[mid as usize].len > size {
            let upper = self.split_at(mid, lo + size);
            self.insert_free(upper);
        }
        self.spans[mid as usize].state = SpanState::Live;
        mid
    }

    /// Marks a live span pending (freed, waiting on other streams).
    pub fn set_pending(&mut self, id: SpanId) {
        debug_assert_eq!(self.spans[id as usize].state, SpanState::Live);
        self.spans[id as usize].state = SpanState::Pending;
    }

    /// Frees a live or pending span and coalesces it with free neighbours. Returns the id of
    /// the resulting free span.
    #[inline]
    pub fn free(&mut self, id: SpanId) -> SpanId {
        debug_assert!(matches!(
            self.spans[id as usize].state,
            SpanState::Live | SpanState::Pending
        ));
        self.spans[id as usize].requested = 0;
        if let Some(m) = self.meta.get_mut(id as usize) {
            *m = BlockMeta::default();
        }
        let next = self.spans[id as usize].next;
        if next != NIL && self.spans[next as usize].state == SpanState::Free {
            self.remove_free(next);
            self.absorb_next(id);
        }
        let prev = self.spans[id as usize].prev;
        let id = if prev != NIL && self.spans[prev as usize].state == SpanState::Free {
            self.remove_free(prev);
            self.absorb_next(prev);
            prev
        } else {
            id
        };
        self.insert_free(id);
        id
    }

    /// `id` swallows the span after it.
    fn absorb_next(&mut self, id: SpanId) {
        let next = self.spans[id as usize].next;
        let (nlen, nnext) = {
            let n = &self.spans[next as usize];
            (n.len, n.next)
        };
        self.spans[id as usize].len += nlen;
        self.spans[id as usize].next = nnext;
        if nnext != NIL {
            self.spans[nnext as usize].prev = id;
        }
        self.release(next);
    }

    /// Splits span `id` at `at` (strictly inside it); returns the new upper span, in the same
    /// state. The caller fixes free-list membership.
    fn split_at(&mut self, id: SpanId, at: u64) -> SpanId {
        let (start, len, seg, next, state) = {
            let s = &self.spans[id as usize];
            (s.start, s.len, s.seg, s.next, s.state)
        };
        debug_assert!(at > start && at < start + len);
        let upper = self.new_span(Span {
            start: at,
            len: start + len - at,
            state,
            seg,
            prev: id,
            next,
            fprev: NIL,
            fnext: NIL,
            requested: 0,
        });
        if next != NIL {
            self.spans[next as usize].prev = upper;
        }
        let s = &mut self.spans[id as usize];
        s.next = upper;
        s.len = at - start;
        upper
    }

    /// Turns `[lo, hi)`, inside the free span `id`, into a hole (its pages are about to be
    /// unmapped). Returns the hole's span id.
    pub fn carve_hole(&mut self, id: SpanId, lo: u64, hi: u64) -> SpanId {
        let s = &self.spans[id as usize];
        debug_assert_eq!(s.state, SpanState::Free);
        debug_assert!(s.start <= lo && lo < hi && hi <= s.end());
        let (start, end) = (s.start, s.end());
        self.remove_free(id);
        let mid = if lo > start {
            let m = self.split_at(id, lo);
            self.insert_free(id);
            m
        } else {
            id
        };
        if hi < end {
            let upper = self.split_at(mid, hi);
            self.insert_free(upper);
        }
        self.spans[mid as usize].state = SpanState::Hole;
        self.holes.insert(lo, mid);
        self.merge_holes(mid)
    }

    fn merge_holes(&mut self, id: SpanId) -> SpanId {
        let next = self.spans[id as usize].next;
        if next != NIL && self.spans[next as usize].state == SpanState::Hole {
            self.holes.remove(&self.spans[next as usize].start);
            self.absorb_next(id);
        }
        let prev = self.spans[id as usize].prev;
        if prev != NIL && self.spans[prev as usize].state == SpanState::Hole {
            self.holes.remove(&self.spans[id as usize].start);
            self.absorb_next(prev);
            return prev;
        }
        id
    }

    /// Hole spans in address order.
    pub fn holes(&self) -> impl Iterator<Item = SpanId> + '_ {
        self.holes.values().copied()
    }

    /// Free spans of at least `len` bytes (every one of them; in no particular order).
    ///
    /// Walks only the size classes whose bitmap bit is set, so a heap with few free spans costs
    /// a few word operations, not one test per class: stealing and stitching call this for
    /// every arena of the device.
    pub fn free_spans_at_least(&self, len: u64) -> impl Iterator<Item = SpanId> + '_ {
        let (fl0, sl0) = mapping(len);
        let mut fl_bits = if fl0 < FL {
            self.fl_bitmap & (!0u64 << fl0)
        } else {
            0
        };
        let (mut fl, mut sl_bits) = (0usize, 0u32);
        let classes = std::iter::from_fn(move || loop {
            if sl_bits != 0 {
                let sl = sl_bits.trailing_zeros() as usize;
                sl_bits &= sl_bits - 1;
                return Some(fl * SL + sl);
            }
            if fl_bits == 0 {
                return None;
            }
            fl = fl_bits.trailing_zeros() as usize;
            fl_bits &= fl_bits - 1;
            sl_bits = self.sl_bitmap[fl] & if fl == fl0 { !0u32 << sl0 } else { !0 };
        });
        classes
            .flat_map(move |idx| {
                let mut id = self.heads[idx];
                std::iter::from_fn(move || {
                    if id == NIL {
                        return None;
                    }
                    let cur = id;
                    id = self.spans[cur as usize].fnext;
                    Some(cur)
                })
            })
            .filter(move |&id| self.spans[id as usize].len >= len)
    }

    /// Turns `[lo, hi)`, inside the hole `id`, into free space (its pages were just mapped), and
    /// coalesces it. Returns the resulting free span.
    pub fn fill_hole(&mut self, id: SpanId, lo: u64, hi: u64) -> SpanId {
        let s = &self.spans[id as usize];
        debug_assert_eq!(s.state, SpanState::Hole);
        debug_assert!(s.start <= lo && lo < hi && hi <= s.end());
        let (start, end) = (s.start, s.end());
        let mid = if lo > start {
            self.split_at(id, lo)
        } else {
            self.holes.remove(&start);
            id
        };
        if hi < end {
            let upper = self.split_at(mid, hi);
            self.holes.insert(hi, upper);
        }
        // Treat the middle as a block being freed: it coalesces with free neighbours.
        self.spans[mid as usize].state = SpanState::Pending;
        self.free(mid)
    }

    /// The spans of a segment, in address order, from its first span.
    pub fn segment_spans(&self, first: SpanId) -> SegmentSpans<'_> {
        SegmentSpans {
            heap: self,
            id: first,
        }
    }

    /// Checks the heap's internal consistency for the segments whose first spans are given as
    /// `(first, base, len)`. Returns a description of the first violation.
    pub fn check(&self, segments: &[(SpanId, u64, u64)]) -> Result<(), String> {
        let mut seen_free = 0u64;
        let mut seen_free_bytes = 0u64;
        let mut live_spans = 0usize;
        for &(first, base, len) in segments {
            let mut expect = base;
            let mut prev = NIL;
            let mut prev_state = SpanState::Vacant;
            for (id, s) in self.segment_spans(first) {
                live_spans += 1;
                if s.start != expect {
                    return Err(format!(
                        "span {id} starts at {:#x}, expected {expect:#x}",
                        s.start
                    ));
                }
                if s.prev != prev {
                    return Err(format!("span {id} has prev {} instead of {prev}", s.prev));
                }
                if s.len == 0 || s.len % ALIGN != 0 || s.start % ALIGN != 0 {
                    return Err(format!("span {id} is misaligned: {s:?}"));
                }
                match s.state {
                    SpanState::Vacant => return Err(format!("span {id} is vacant but linked")),
                    SpanState::Free => {
                        if prev_state == SpanState::Free {
                            return Err(format!("free span {id} follows a free span"));
                        }
                        seen_free += 1;
                        seen_free_bytes += s.len;
                        let (fl, sl) = mapping(s.len);
                        let mut f = self.heads[fl * SL + sl];
                        let mut found = false;
                        while f != NIL {
                            if f == id {
                                found = true;
                                break;
                            }
                            f = self.spans[f as usize].fnext;
                        }
                        if !found {
                            return Err(format!("free span {id} is not in its class list"));
                        }
                    }
                    SpanState::Hole if self.holes.get(&s.start) != Some(&id) => {
                        return Err(format!("hole {id} at {:#x} is not indexed", s.start));
                    }
                    SpanState::Hole if prev_state == SpanState::Hole => {
                        return Err(format!("hole {id} follows a hole"));
                    }
                    _ => {}
                }
                expect = s.end();
                prev = id;
                prev_state = s.state;
            }
            if expect != base + len {
                return Err(format!(
                    "segment at {base:#x} covers up to {expect:#x}, expected {:#x}",
                    base + len
                ));
            }
        }
        if seen_free != self.free_count || seen_free_bytes != self.free_bytes {
            return Err(format!(
                "free totals {}/{} B disagree with spans {seen_free}/{seen_free_bytes} B",
                self.free_count, self.free_bytes
            ));
        }
        let mut listed = 0u64;
        for fl in 0..FL {
            for sl in 0..SL {
                let head = self.heads[fl * SL + sl];
                let bit = self.sl_bitmap[fl] & (1 << sl) != 0;
                if bit != (head != NIL) {
                    return Err(format!("bitmap bit ({fl},{sl}) disagrees with its list"));
                }
                let mut f = head;
                let mut fp = NIL;
                while f != NIL {
                    let s = &self.spans[f as usize];
                    if s.state != SpanState::Free || mapping(s.len) != (fl, sl) || s.fprev != fp {
                        return Err(format!("class list ({fl},{sl}) holds a bad span {f}"));
                    }
                    listed += 1;
                    fp = f;
                    f = s.fnext;
                }
            }
            if (self.fl_bitmap & (1 << fl) != 0) != (self.sl_bitmap[fl] != 0) {
                return Err(format!("first-level bit {fl} disagrees with its classes"));
            }
        }
        if listed != self.free_count {
            return Err(format!(
                "{listed} spans listed free, {} counted",
                self.free_count
            ));
        }
        let holes_linked = segments
            .iter()
            .flat_map(|&(first, _, _)| self.segment_spans(first))
            .filter(|(_, s)| s.state == SpanState::Hole)
            .count();
        if holes_linked != self.holes.len() {
            return Err(format!(
                "{} holes indexed, {holes_linked} linked",
                self.holes.len()
            ));
        }
        if live_spans + self.vacant.len() != self.spans.len() {
            return Err(format!(
                "{} spans linked + {} vacant != {} slots",
                live_spans,
                self.vacant.len(),
                self.spans.len()
            ));
        }
        Ok(())
    }
}

/// Iterator over a segment's spans in address order.
pub struct SegmentSpans<'a> {
    heap: &'a Heap,
    id: SpanId,
}

impl<'a> Iterator for SegmentSpans<'a> {
    type Item = (SpanId, &'a Span);
    fn next(&mut self) -> Option<Self::Item> {
        if self.id == NIL {
            return None;
        }
        let id = self.id;
        let s = &self.heap.spans[id as usize];
        self.id = s.next;
        Some((id, s))
    }
}

#[cfg(test)]
mod tests;
