//! The unit tests of `heap.rs`, beside it (as rlsf keeps `tlsf/tests.rs`).

use super::*;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn heap_with(len: u64) -> (Heap, SpanId) {
    let mut h = Heap::new();
    let first = h.add_segment(0, 0x1000_0000, len, SpanState::Free);
    (h, first)
}

#[test]
fn mapping_is_monotonic_and_classes_fit() {
    let mut last = (0, 0);
    for units in 1..100_000u64 {
        let m = mapping(units * ALIGN);
        assert!(m >= last, "{units}");
        last = m;
    }
    assert_eq!(mapping(ALIGN), (0, 1));
    assert!(mapping(1 << 46).0 < FL);
}

#[test]
fn take_free_coalesce() {
    let (mut h, first) = heap_with(4 * MIB);
    let seg = [(first, 0x1000_0000, 4 * MIB)];
    let a = h.take(h.find(MIB).unwrap(), MIB);
    let b = h.take(h.find(MIB).unwrap(), MIB);
    let c = h.take(h.find(512).unwrap(), 512);
    h.check(&seg).unwrap();
    assert_eq!(h.span(a).start, 0x1000_0000);
    assert_eq!(h.span(b).start, 0x1000_0000 + MIB);
    assert_eq!(h.span(c).start, 0x1000_0000 + 2 * MIB);
    h.free(b);
    h.check(&seg).unwrap();
    // Exact fit comes back.
    let b2 = h.find(MIB).unwrap();
    assert_eq!(h.span(b2).start, 0x1000_0000 + MIB);
    h.free(a);
    h.free(c);
    h.check(&seg).unwrap();
    assert_eq!(h.free_count(), 1);
    assert_eq!(h.free_bytes(), 4 * MIB);
    assert!(h.find(4 * MIB).is_some());
    assert!(h.find(4 * MIB + 512).is_none());
}

#[test]
fn holes_carve_and_fill() {
    let g = 2 * MIB;
    let base = 0x1000_0000;
    let (mut h, first) = heap_with(8 * MIB);
    let seg = [(first, base, 8 * MIB)];
    let a = h.take(h.find(MIB).unwrap(), MIB);
    let free = h.find(7 * MIB).unwrap();
    let hole = h.carve_hole(free, base + g, base + 3 * g);
    h.check(&seg).unwrap();
    assert_eq!(h.span(hole).state, SpanState::Hole);
    assert_eq!(h.free_bytes(), 7 * MIB - 2 * g);
    // A second carve next to it merges holes.
    let free2 = h.find(2 * MIB).unwrap();
    assert_eq!(h.span(free2).start, base + 3 * g);
    let hole2 = h.carve_hole(free2, base + 3 * g, base + 4 * g);
    assert_eq!(hole2, hole);
    assert_eq!(h.span(hole).len, 3 * g);
    h.check(&seg).unwrap();
    let f = h.fill_hole(hole, base + g, base + 4 * g);
    h.check(&seg).unwrap();
    assert_eq!(h.span(f).start, base + MIB);
    assert_eq!(h.span(f).len, 7 * MIB);
    h.free(a);
    h.check(&seg).unwrap();
    assert_eq!(h.free_count(), 1);
}

/// A block taken at an exact address splits the free span around it, at its start, in its
/// middle and at its end, and frees back to one span.
#[test]
fn take_range_puts_a_block_at_its_address() {
    let base = 0x1000_0000;
    let (mut h, first) = heap_with(8 * MIB);
    let seg = [(first, base, 8 * MIB)];
    let whole = h.find(8 * MIB).unwrap();
    let mid = h.take_range(whole, base + 3 * MIB, MIB);
    h.check(&seg).unwrap();
    assert_eq!((h.span(mid).start, h.span(mid).len), (base + 3 * MIB, MIB));
    assert_eq!(h.span(mid).state, SpanState::Live);
    assert_eq!(h.free_count(), 2);
    assert_eq!(h.free_bytes(), 7 * MIB);
    let low = h.find(3 * MIB).unwrap();
    assert_eq!(h.span(low).start, base);
    let at_start = h.take_range(low, base, 512);
    h.check(&seg).unwrap();
    assert_eq!(h.span(at_start).start, base);
    let high = h.find(4 * MIB).unwrap();
    assert_eq!(h.span(high).start, base + 4 * MIB);
    let at_end = h.take_range(high, base + 7 * MIB, MIB);
    h.check(&seg).unwrap();
    assert_eq!(h.span(at_end).end(), base + 8 * MIB);
    for id in [mid, at_start, at_end] {
        h.free(id);
        h.check(&seg).unwrap();
    }
    assert_eq!(h.free_count(), 1);
    assert_eq!(h.free_bytes(), 8 * MIB);
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
    Carve(usize),
}

proptest! {
    #[test]
    fn random_programs_keep_the_heap_consistent(
        ops in prop::collection::vec(prop_oneof![
            (1u64..4096).prop_map(Op::Alloc),
            any::<usize>().prop_map(Op::Free),
            any::<usize>().prop_map(Op::Carve),
        ], 1..200)
    ) {
        let base = 0x1000_0000u64;
        let len = 64 * MIB;
        let (mut h, first) = heap_with(len);
        let seg = [(first, base, len)];
        let mut live: Vec<(SpanId, u64, u64)> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(units) => {
                    let size = units * ALIGN;
                    if let Some(id) = h.find(size) {
                        prop_assert!(h.span(id).len >= size);
                        let id = h.take(id, size);
                        let s = h.span(id);
                        for &(_, st, ln) in &live {
                            prop_assert!(s.end() <= st || st + ln <= s.start, "overlap");
                        }
                        live.push((id, s.start, s.len));
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let (id, _, _) = live.swap_remove(i % live.len());
                    h.free(id);
                }
                Op::Carve(i) => {
                    // Carve the first whole 2 MiB page of some free span, if any.
                    let frees: Vec<SpanId> = h.segment_spans(first)
                        .filter(|(_, s)| s.state == SpanState::Free)
                        .map(|(id, _)| id).collect();
                    if !frees.is_empty() {
                        let id = frees[i % frees.len()];
                        let s = h.span(id).clone();
                        let lo = s.start.div_ceil(2 * MIB) * 2 * MIB;
                        if lo + 2 * MIB <= s.end() {
                            h.carve_hole(id, lo, lo + 2 * MIB);
                        }
                    }
                }
                _ => {}
            }
            h.check(&seg).map_err(TestCaseError::fail)?;
            // The bitmap walk finds exactly the free spans a scan of the segment finds.
            for at_least in [ALIGN, 3 * ALIGN, MIB, 2 * MIB + ALIGN, 16 * MIB] {
                let mut walked: Vec<SpanId> = h.free_spans_at_least(at_least).collect();
                walked.sort_unstable();
                let mut scanned: Vec<SpanId> = h
                    .segment_spans(first)
                    .filter(|(_, s)| s.state == SpanState::Free && s.len >= at_least)
                    .map(|(id, _)| id)
                    .collect();
                scanned.sort_unstable();
                prop_assert_eq!(walked, scanned, "free spans of at least {}", at_least);
            }
        }
    }
}
