//! How large growth's physical handles are: a request's handles (`chunk_size`, `chunk_split`),
//! whole chunks (`grow_whole_chunks`) and how far past a request they reach, and the `auto`
//! policy that sizes them to what the process holds and decides when new handles replace
//! moved ones. `vmm.rs` creates and maps them.
//!
//! # Note [Auto growth]
//!
//! `chunk_split` and `grow_whole_chunks` (Note [Chunks] in `vmm.rs`) trade handles (each
//! `cuMemCreate` ~195 µs) against pinned memory: a handle partly covered by a live block
//! cannot move, so a freed block's range reused by smaller blocks strands the rest of its
//! handles, and what is stranded decides the smallest device a program runs on.
//! `grow_whole_chunks:auto`, the default, buys cheaply while memory is plentiful and memory
//! first as it runs short. While the process, after the growth, holds at most a quarter of
//! what the limit and the device allow it ([`AUTO_SHARE`]):
//! - it maps whole chunks, each at most an eighth of what it holds ([`AUTO_CHUNK_SHARE`], so a
//!   100 MiB program does not strand 20 MiB handles);
//! - it backs a request with handles of up to 1/32 of what it holds where that is more than
//!   `chunk_size` ([`AUTO_HANDLE_SHARE`]), so a KV cache of 1 GiB is bought, and later moved,
//!   in four handles, not fifty;
//! - and `chunk_split` yields to the whole chunks' cap: a request's handle may be up to an
//!   eighth of what the process holds where a `chunk_split`-th of the request is less, so a
//!   program holding gigabytes buys a 16 MiB request in one handle, not four, while a 100 MiB
//!   program still splits it.
//!
//! Past that, `chunk_size` and `chunk_split` rule. Measured with the replay's cost model
//! (`cistern replay`, the dev snapshots and every built-in workload): median modelled driver
//! time 1.07x `pytorch-expandable`'s on the dev snapshots instead of 4.9x, the serving
//! workloads 2.8x and 1.9x instead of 4.5x and 3.9x, peak reserved at most 1.4% above
//! expandable's on a device with room, and the smallest device each trace runs on within
//! 0.5% of memory first's (`off`). The early large handles are what a tight device pays for;
//! a quarter, an eighth and 1/32 are where that stayed within 0.5% on every trace (0.8% since
//! the floor below) while the time fell: a half with uncapped chunks needed a 17% larger
//! device on `packed-C`, chunks of a sixteenth raised the median over all traces from 1.65x
//! expandable's to 2.3x, and request handles of 1/16 needed a 0.7% larger device on
//! `training` (of 1/32 with no quarter rule, 2.2%).
//!
//! The split yielding to the eighth came later (`python3 scripts/cost-table.py` and the
//! smallest device per trace, as in the next note): median modelled driver time over the dev
//! snapshots 1.04x -> 0.88x expandable's and over all traces 1.41x -> 1.31x, at or under
//! expandable's on 11 traces of 26 instead of 6 (`rmm-random` 1.20x -> 0.58x, the `magma27`
//! snapshot 1.02x -> 0.45x, `llm-serving` 1.39x -> 0.92x, Mooncake 0.45x -> 0.28x); peak
//! reserved still at most 1.4% above expandable's; the smallest device 0.05-0.15% larger on
//! `training`, `llm-serving` and Mooncake and 0.5% on `rmm-random` (1.032x -> 1.037x its peak
//! live bytes), unchanged on the rest. With no cap at all the time was the same but the
//! minimalloc instances needed up to 16% more; a sixteenth instead of an eighth changed
//! nothing; the split dropped only while the process holds an eighth (not a quarter) gave
//! `rmm-random` 0.90x.
//!
//! An eighth alone bought a small program its memory a granule at a time: until it holds 16
//! granules an eighth is less than one, so a 64 MiB program (the `packed-*` and minimalloc
//! instances) made 22-27 creations where expandable makes 4-9, at 2.1-7.7x its modelled
//! driver time. So a whole chunk is at least 6 MiB ([`AUTO_CHUNK_FLOOR`]) or a 64th of what the
//! limit and the device allow the process ([`AUTO_FLOOR_SHARE`]), whichever is less (and at
//! most `chunk_size`): on a device with room a small program pins at most a few 6 MiB
//! handles, and on a device barely larger than the program (the smallest it runs on) chunks
//! start at a granule as before. Growth past a request still rounds its last run up to whole
//! chunks, so a fresh process's 80 MiB block, backed with 20 MiB handles, maps 84 MiB in five:
//! the pages past it are cache for the requests that follow (ending the run at the request's
//! last handle instead measured the same on the small programs and a median 0.53x -> 0.55x on
//! the other generated workloads).
//!
//! Measured over five draws of every generated workload with the dev snapshots and the
//! minimalloc instances (`cistern replay --seed`, lag 2, A100 prices), against
//! `pytorch-expandable`: the small programs' median driver time 2.79x -> 1.93x (worst 7.67x ->
//! 3.52x), their peak reserved a mean 0.81x -> 0.86x (over expandable's on 5 of 61 draws
//! instead of 4; the worst 1.11x -> 1.09x); the dev snapshots' median 0.88x -> 0.86x (worst
//! 1.58x -> 1.43x), the other generated workloads' 0.56x -> 0.53x. The smallest device of
//! every `packed-*` and minimalloc instance is unchanged; over 9 draws (`python3
//! scripts/cost-table.py --seeds 8`) `llm-serving`'s went from a median 1.0206x its peak live
//! bytes to 1.0231x (still under expandable's on every draw), `rmm-random`'s 1.0396x ->
//! 1.0420x and `rmm-random-normal`'s 1.0482x -> 1.0508x (worst unchanged and 1.0554x ->
//! 1.0590x): their first 48 MiB are laid out otherwise, and the rest follows. On their default
//! draws `llm-serving` and `rmm-random` now need a device 0.76% and 0.70% larger than memory
//! first's (within 0.5% before), every other trace within 0.4%. A floor of 8 MiB gave 1.66x
//! on the small programs but peak reserved up to 1.21x expandable's; 20 MiB
//! (expandable's), 1.11x and over expandable's peak on 34 of 61 draws; without the 64th the
//! smallest device of minimalloc-C grew from 1.20x its peak live bytes to 1.39x. With the
//! floor, an eighth of what the process holds is kept: a quarter gave 1.59x but peak reserved
//! over expandable's on 13 draws (up to 1.25x), a sixth 1.75x and 12 draws.
//!
//! # Note [Cheaper than moving]
//!
//! Stitching is cheap in memory and dear in calls: each cached chunk it moves costs an unmap, a
//! map and an access grant (≈64 µs at the published A100 prices), a quarter of a new handle's
//! create, map and grant (≈233 µs) whatever either's size. Serving workloads, whose KV caches
//! are freed and allocated again larger, had stitching move thousands of chunks, most of a
//! granule or a few. So while memory is plentiful (the quarter rule above) and not under
//! pressure, growth backs a large request with new handles instead when moving the cached
//! chunks that would serve it costs more than the handles it saves, and at least two would
//! move ([`creating_is_cheaper`]); the cached chunks stay where they are, for requests that fit
//! them in place. The new handles are sized as plentiful memory allows (1/32 of what the
//! process holds, above). The room is read afresh from `cuMemGetInfo`. Creation falling short
//! (the limit, the device) stitches after all. Measured (`python3 scripts/cost-table.py`, then
//! the smallest device per trace with `cistern replay` over the dev snapshots, every built-in
//! workload and the minimalloc instances): modelled driver time on `llm-serving` 2.79x -> 1.99x
//! expandable's, `llm-serving-mooncake` 1.85x -> 1.03x, the median over all traces 1.65x ->
//! 1.50x and over the dev snapshots 1.07x -> 1.04x; the smallest device unchanged on all 37
//! traces, peak reserved at most 1.014x expandable's as before (Mooncake's 36.0 -> 37.5 GB,
//! expandable's 51.6). Handles sized as the memory-first path sizes them gave 2.20x and 1.16x.
//! With no minimum of moves Mooncake fell to 1.05x, but `llm-serving` needed a 0.64% larger
//! device and `rmm-random` 0.41% (a single moved chunk replaced by a new handle strands it);
//! with a minimum of four, `llm-serving` 1.95x and Mooncake 1.28x.
//!
//! "Plentiful" here is looser than for whole chunks: up to a third of what the limit and the
//! device allow ([`INSTEAD_SHARE`]), not a quarter. Cached chunks left in place stay whole and
//! free, and stitching takes them as soon as memory runs short, but the new handles beside
//! them are sized for plenty (1/32 of what the process holds) and may be pinned later by
//! smaller blocks, so a tight device pays a little too. The quarter rule stopped replacing
//! moves just where serving programs churn: `cistern replay`'s default device is four times
//! the peak live bytes, so a server at its plateau holds about a quarter of it, as one holding
//! a fifth of an 80 GiB GPU does. Measured on one draw at first, with a half: `llm-serving`
//! 1.99x -> 1.39x expandable's driver time, Mooncake 1.03x -> 0.45x, `training` 0.61x ->
//! 0.53x, the median over all traces 1.50x -> 1.41x; peak reserved up and still below
//! expandable's on that draw. All of the room needed larger devices (`llm-serving` 6.8%,
//! Mooncake 7.0% more). A half for whole chunks too (`AUTO_SHARE`) needed up to 13% more on
//! the minimalloc instances and 7% on `packed-K`.
//!
//! Over 25 draws of each serving workload (`cistern replay --seed`, `--gpu-lag 2`), a half
//! gave up memory that a third keeps: Mooncake's peak reserved went over expandable's on 3
//! draws (by up to 11%), and its smallest device was a mean 1.0121x its peak live bytes
//! (worst 1.0277x). With a third: peak reserved at most 0.991x expandable's on every draw
//! (mean 0.931x -> 0.879x), the smallest device a mean 1.0067x (worst 1.0141x), and
//! `llm-serving`'s a mean 1.0301x -> 1.0289x (its default draw 1.042x -> 1.027x, under
//! expandable's 1.028x), for modelled driver time on Mooncake a mean 0.27x -> 0.33x
//! expandable's (worst 0.50x -> 0.70x) at the A100 prices and 0.90x -> 1.17x at the H200's;
//! `llm-serving`, `training` and the `rmm-random` workloads unchanged in time and peak, and
//! every dev snapshot and `packed-*`/minimalloc instance unchanged (the same calls).
//!
//! The prices in the rule stay the published A100 ones whatever the GPU. Priced as the H200
//! measured them (`replay/costs/h200-measured.json`: moving 38 µs, creating 34 µs, so
//! creating nearly always "wins"), the rule replaced most moves: measured with `python3
//! scripts/cost-table.py --costs replay/costs/h200-measured.json`, the `packed-*` workloads'
//! modelled time nearly halved (3.1-6.2x expandable's -> 2.0-3.3x) and the median over all
//! traces went 1.31x -> 1.29x, but peak reserved rose to 1.37x expandable's on them
//! (`packed-A` 0.14 GiB against 0.11; 1.014x at most before) and the dev snapshots' worst
//! case went 1.85x -> 2.05x. The rule exists to give up memory only where moving is dear; on
//! a GPU where creating costs what moving does it would give up memory everywhere, so the
//! A100 ratio is kept as the policy.
//!
//! # Note [Small pages stay small]
//!
//! The small heap grows a granule at a time, and a granule it frees is a cached chunk like any
//! other: a large window's stitching took it, and the small heap's next growth bought a new one.
//! On the dev training snapshots that was most of the churn (`gpt-medium_train_ctx128`: 47
//! granules moved from the small heaps to large windows, each followed by a new small-heap
//! handle: 49 creates and 49 moves that expandable segments, whose small pool keeps its
//! segments, never make). So once a small heap has had to buy pages again after a large window
//! took some of its own (`RecentMoves::small_churn` in `pages.rs`), and while memory is
//! plentiful (new memory covers the pages the large heaps' cached chunks do not, and the
//! process then holds at most a third of what the limit and the device allow it:
//! [`INSTEAD_SHARE`], as for new handles instead of moves), a large window leaves the small
//! heaps' free granules where they are, its feasibility check does not count them, and it buys
//! those pages new ([`small_pages_stay`]). As with moves replaced by new handles, the device's
//! room is read afresh before choosing so (a stale estimate would let growth take the room
//! another process took since), and the granules left are not lost: creation falling short
//! takes them without a wait, and under pressure stitching takes them first, as before.
//!
//! Measured (`python3 scripts/cost-table.py`, lag 2): modelled driver time on
//! `gpt-medium_train_ctx128` 1.20x -> 1.07x expandable's at A100 prices (1.34x -> 1.10x at the
//! H200's), `forward_bf16_ctx128` 1.53x -> 1.41x (1.85x -> 1.49x), the median over all traces
//! 1.17x -> 1.10x; peak reserved at most 1.014x expandable's and the smallest device of every
//! trace as before. Without waiting for churn (every large window, from the start) it also
//! took `infer_ctx128` from 1.14x to 1.12x but cost the small static programs, whose small
//! heaps rarely want their pages back: `packed-A` 3.38x -> 3.95x, and up to 7 points more
//! fragmentation on a roomy device over six of the ten `packed-*` instances; with the wait,
//! `packed-C` alone changes (30% -> 37% on a roomy device, 2.88x -> 2.95x, the same smallest
//! device). The generated workloads were compared over 24 draws each (`cistern replay --seed`)
//! together with Note [Windows over free spans] in `window.rs`.

use super::placement::Placement;
use super::vmm::Window;

/// What moving one cached chunk costs against creating one handle, in the published A100
/// figures (see Note [Cheaper than moving]): `cuMemUnmap` 26 + `cuMemMap` 1.5 +
/// `cuMemSetAccess` 36 µs against `cuMemCreate` 195 + `cuMemMap` 1.5 + `cuMemSetAccess` 36 µs,
/// in tenths of a microsecond. Not the prices of the GPU at hand: see the end of that note.
const MOVE_COST: usize = 635;
const CREATE_COST: usize = 2325;
/// New handles replace stitching only when it would move at least this many chunks.
pub(super) const MIN_MOVES: usize = 2;

/// Whether backing a window with new handles of up to `chunk_pages` costs less than moving
/// the `cached_chunks` cached chunks (`cached` pages) that stitching would place there and
/// creating handles for the rest.
pub(super) fn creating_is_cheaper(
    place: &Placement,
    chunk_pages: u32,
    cached: usize,
    cached_chunks: usize,
) -> bool {
    let chunk = chunk_pages.max(1) as usize;
    let all: usize = place
        .runs
        .iter()
        .map(|&(_, n, f)| ((n - f) as usize).div_ceil(chunk))
        .sum();
    let open = place.open();
    let rest = open.saturating_sub(cached).div_ceil(chunk);
    cached_chunks >= MIN_MOVES && cached_chunks * MOVE_COST > all.saturating_sub(rest) * CREATE_COST
}
use super::DevicePool;
use crate::arena::{ArenaState, HeapKind};
use crate::config::{Config, StreamSync, WholeChunks};
use crate::driver::Driver;
use crate::heap::SpanState;

/// `grow_whole_chunks:auto` maps whole chunks only while the process, after the growth, holds
/// at most 1/`AUTO_SHARE` of what the limit and the device allow it.
pub(super) const AUTO_SHARE: u64 = 4;
/// New handles replace stitching (Note [Cheaper than moving]) while the process, after the
/// growth, holds at most 1/`INSTEAD_SHARE` of what the limit and the device allow it.
pub(super) const INSTEAD_SHARE: u64 = 3;
/// ... in chunks of at most 1/`AUTO_CHUNK_SHARE` of what it holds.
const AUTO_CHUNK_SHARE: u64 = 8;
/// ... but not below `AUTO_CHUNK_FLOOR` bytes or 1/`AUTO_FLOOR_SHARE` of what the limit and the
/// device allow it, whichever is less ...
const AUTO_CHUNK_FLOOR: u64 = 6 << 20;
const AUTO_FLOOR_SHARE: u64 = 64;
/// ... and while it does, backs a request with handles of up to 1/`AUTO_HANDLE_SHARE` of what
/// it holds when that is more than `chunk_size` (still at most a `chunk_split`-th of the
/// request).
const AUTO_HANDLE_SHARE: u64 = 32;

/// Whether memory is plentiful for `auto`: the process, holding `held` pages and adding
/// `adding`, holds at most 1/`share` ([`AUTO_SHARE`], [`INSTEAD_SHARE`]) of what the limit and
/// the device allow it (what it holds, the window's `missing` pages and the room `headroom`
/// beyond them).
pub(super) fn plentiful(share: u64, held: u64, adding: u64, missing: u64, headroom: u64) -> bool {
    held.saturating_add(adding) <= held.saturating_add(missing).saturating_add(headroom) / share
}

/// Whether a large window leaves the small heaps' free pages where they are and buys the
/// `missing` pages that the large heaps' cached chunks do not cover new instead (Note [Small
/// pages stay small]): with `grow_whole_chunks:auto` (and not `stream_sync:always`, which
/// takes cached pages first), while new memory (`room` pages under the limit and on the
/// device) covers them and the process, holding `held` pages, then holds at most
/// 1/[`INSTEAD_SHARE`] of what it may.
pub(super) fn small_pages_stay(config: &Config, held: u64, room: usize, missing: usize) -> bool {
    config.grow_whole_chunks == WholeChunks::Auto
        && config.stream_sync != StreamSync::Always
        && missing > 0
        && room >= missing
        && plentiful(
            INSTEAD_SHARE,
            held,
            missing as u64,
            missing as u64,
            (room - missing) as u64,
        )
}

/// How much room `auto` growth sees for a large request's handles ([`request_chunk_pages`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plenty {
    /// Not `auto`, under pressure, or the process holds more than a third of what it may.
    Tight,
    /// After the growth it holds at most a third ([`INSTEAD_SHARE`]; `held` pages now).
    Third(u64),
    /// ... at most a quarter ([`AUTO_SHARE`]).
    Quarter(u64),
}

/// The largest handle backing a large-heap request of `window_pages`: up to `chunk_size`, or,
/// while memory is plentiful (`plenty` not [`Plenty::Tight`]), up to 1/`AUTO_HANDLE_SHARE` of
/// the pages the process holds when that is more, so that a large block (a KV cache) is
/// bought, and later moved, in a few handles. Then (`chunk_split`, 4 by default) at most a
/// quarter of the request, so that a block spans at least four handles and, when it is freed
/// and its range is reused by smaller blocks, at most a quarter of it is pinned by a partly
/// used one (`chunk_split:none` trades that for fewer handles); but with [`Plenty::Quarter`],
/// up to 1/`AUTO_CHUNK_SHARE` of what the process holds where that is more than the split
/// allows, as whole chunks are (Note [Auto growth]). At least one granule.
pub(super) fn request_chunk_pages(
    config: &Config,
    g: u64,
    window_pages: u64,
    plenty: Plenty,
) -> u32 {
    let mut most = config.chunk_size / g;
    if let Plenty::Third(held) | Plenty::Quarter(held) = plenty {
        most = most.max(held / AUTO_HANDLE_SHARE);
    }
    match config.chunk_split {
        Some(n) => {
            let mut split = window_pages / u64::from(n.max(1));
            if let Plenty::Quarter(held) = plenty {
                split = split.max(held / AUTO_CHUNK_SHARE);
            }
            most.min(split)
        }
        None => most,
    }
    .clamp(1, u32::MAX as u64) as u32
}

/// The pages of a whole chunk: `chunk_size`, and with `auto` (`Some((held, may))`: the pages
/// the process holds, and what the limit and the device allow it) at most 1/`AUTO_CHUNK_SHARE`
/// of what it holds: at a small scale a 20 MiB handle is a large share of a process's memory,
/// and pins it once partly used. But not below [`AUTO_CHUNK_FLOOR`] or 1/[`AUTO_FLOOR_SHARE`]
/// of what it may hold, whichever is less (Note [Auto growth]). At least one granule.
pub(super) fn whole_chunk_pages(config: &Config, g: u64, auto: Option<(u64, u64)>) -> u32 {
    let full = (config.chunk_size / g).clamp(1, u32::MAX as u64);
    let pages = match auto {
        Some((held, may)) => {
            let floor = (AUTO_CHUNK_FLOOR / g).min(may / AUTO_FLOOR_SHARE);
            full.min((held / AUTO_CHUNK_SHARE).max(floor))
        }
        None => full,
    };
    pages.clamp(1, u32::MAX as u64) as u32
}

impl<D: Driver> DevicePool<D> {
    /// Whether `grow_whole_chunks` backs the window's last run of missing pages with whole
    /// chunks, and how many pages past the window's end it then maps: `None` unless that run
    /// covers the window's end, still has open pages and ends in an unmapped range of the
    /// extent; else `Some(extra)`, what makes the run's open pages a whole number of chunks of
    /// `full` pages, as far as that range (and any range in it still mapped: `still_mapped`,
    /// a failed or a deferred unmap) allows, and only while the limit and the device (`headroom`: their room beyond the
    /// request) keep room for one chunk more after it, so that the pages pinned beyond a
    /// request never take the last of the room. With `auto_held` (`grow_whole_chunks:auto`:
    /// the pages the process holds), also `None` once the growth would leave the process
    /// holding more than 1/`AUTO_SHARE` of what the limit and the device allow it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn whole_chunk_extension(
        &self,
        a: &ArenaState,
        kind: HeapKind,
        w: &Window,
        place: &Placement,
        full: u32,
        headroom: usize,
        still_mapped: &[(u64, u64)],
        auto_held: Option<u64>,
    ) -> Option<u32> {
        let g = self.core.granularity;
        let &(lo, n, f) = place.runs.last()?;
        let end = lo + n as u64 * g;
        if end < w.hi || f == n {
            return None;
        }
        let seg = a.kinds[kind].segment(w.seg);
        let seg_end = seg.base + seg.len;
        let mut hole_end = a.kinds[kind]
            .heap
            .segment_spans(seg.first)
            .find(|(_, s)| s.state == SpanState::Hole && s.start < end && end <= s.end())
            .map(|(_, s)| s.end().min(seg_end))?;
        for &(at, _) in still_mapped {
            if at >= end && at < hole_end {
                hole_end = at;
            }
        }
        let avail = ((hole_end - end) / g).min(u32::MAX as u64) as u32;
        let open = n - f;
        let want = open.div_ceil(full).saturating_mul(full) - open;
        let room = headroom
            .saturating_sub(full as usize)
            .min(u32::MAX as usize) as u32;
        let extra = want.min(avail).min(room);
        if let Some(held) = auto_held {
            // `auto`: only while the process, after this growth, holds at most a quarter of what
            // the limit and the device allow it. Past that, memory comes first: handles of a
            // `chunk_split`-th of the request, which pin less of a freed block that smaller
            // ones reuse.
            let adding = u64::from(open) + u64::from(extra);
            if !plentiful(
                AUTO_SHARE,
                held,
                adding,
                w.missing.len() as u64,
                headroom as u64,
            ) {
                return None;
            }
        }
        Some(extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    /// Memory first splits a request into `chunk_split` handles of at most `chunk_size`;
    /// plentiful memory lifts the size to 1/32 of what the process holds; a quarter's plenty
    /// also lets the split reach an eighth of it, for large processes only.
    #[test]
    fn request_handles_follow_how_plentiful_memory_is() {
        let c = Config::default(); // chunk_size 20 MiB = 10 granules, chunk_split 4
        let held_small = 20; // 40 MiB
        let held_large = 1024; // 2 GiB

        // A 20 MiB request (10 granules): a quarter is 2 granules.
        assert_eq!(request_chunk_pages(&c, G, 10, Plenty::Tight), 2);
        assert_eq!(request_chunk_pages(&c, G, 10, Plenty::Third(held_large)), 2);
        assert_eq!(
            request_chunk_pages(&c, G, 10, Plenty::Quarter(held_small)),
            2
        );
        assert_eq!(
            request_chunk_pages(&c, G, 10, Plenty::Quarter(held_large)),
            32
        );
        // A 1 GiB request (512 granules): 1/32 of 2 GiB is 32 granules, more than chunk_size.
        assert_eq!(request_chunk_pages(&c, G, 512, Plenty::Tight), 10);
        assert_eq!(
            request_chunk_pages(&c, G, 512, Plenty::Third(held_large)),
            32
        );
        assert_eq!(
            request_chunk_pages(&c, G, 512, Plenty::Quarter(held_large)),
            32
        );
        // `chunk_split:none`: the size alone.
        let none = Config::parse("chunk_split:none").unwrap();
        assert_eq!(request_chunk_pages(&none, G, 10, Plenty::Tight), 10);
        assert_eq!(
            request_chunk_pages(&none, G, 10, Plenty::Third(held_large)),
            32
        );
        // Never below a granule.
        assert_eq!(request_chunk_pages(&c, G, 1, Plenty::Tight), 1);
    }

    /// Whole chunks are `chunk_size` (ten granules), with `auto` at most an eighth of what the
    /// process holds, but at least 6 MiB (three granules) or a 64th of what it may hold,
    /// whichever is less.
    #[test]
    fn whole_chunks_scale_with_the_process_and_start_at_six_mib() {
        let c = Config::default();
        assert_eq!(whole_chunk_pages(&c, G, None), 10);
        // Holding 2 GiB: an eighth is past chunk_size.
        assert_eq!(whole_chunk_pages(&c, G, Some((1024, 8192))), 10);
        // Holding 96 MiB: an eighth, six granules.
        assert_eq!(whole_chunk_pages(&c, G, Some((48, 8192))), 6);
        // Holding nothing on a roomy device: the floor; on 256 MiB, a 64th (two granules); on
        // 64 MiB, one granule.
        assert_eq!(whole_chunk_pages(&c, G, Some((0, 8192))), 3);
        assert_eq!(whole_chunk_pages(&c, G, Some((0, 128))), 2);
        assert_eq!(whole_chunk_pages(&c, G, Some((0, 32))), 1);
        // Holding 40 MiB: the floor is more than an eighth (two granules).
        assert_eq!(whole_chunk_pages(&c, G, Some((20, 8192))), 3);
        // A granule larger than the floor: one granule.
        assert_eq!(whole_chunk_pages(&c, 8 << 20, Some((0, 8192))), 1);
        // Never past chunk_size.
        let small = Config::parse("chunk_size:4MiB").unwrap();
        assert_eq!(whole_chunk_pages(&small, G, Some((0, 8192))), 2);
    }

    /// Small pages stay while the room covers the missing pages and the process then holds at
    /// most a third of what it may; never with `stream_sync:always` or without `auto`.
    #[test]
    fn small_pages_stay_only_while_memory_is_plentiful() {
        let c = Config::default();
        // Holding 100 pages, 2 missing, 400 of room: 102 of 500.
        assert!(small_pages_stay(&c, 100, 400, 2));
        // Nothing missing: nothing to buy.
        assert!(!small_pages_stay(&c, 100, 400, 0));
        // No room for the missing pages: the small heap's are needed.
        assert!(!small_pages_stay(&c, 100, 1, 2));
        // 152 of 500: within a third; 172 of 500: past it.
        assert!(small_pages_stay(&c, 150, 350, 2));
        assert!(!small_pages_stay(&c, 170, 330, 2));
        for other in [
            "stream_sync:always",
            "grow_whole_chunks:on",
            "grow_whole_chunks:off",
        ] {
            let c = Config::parse(other).unwrap();
            assert!(!small_pages_stay(&c, 100, 400, 2), "{other}");
        }
    }

    /// A quarter and a third of what the limit and the device allow, after the growth.
    #[test]
    fn plentiful_is_a_share_of_what_the_process_may_hold() {
        // Holding 100 pages, adding 20, with 380 more of room beyond them: 120 of 500.
        assert!(plentiful(AUTO_SHARE, 100, 20, 20, 380));
        assert!(plentiful(INSTEAD_SHARE, 100, 20, 20, 380));
        // 140 of 500: past a quarter, within a third.
        assert!(!plentiful(AUTO_SHARE, 120, 20, 20, 360));
        assert!(plentiful(INSTEAD_SHARE, 120, 20, 20, 360));
        // 170 of 500: past a third.
        assert!(!plentiful(INSTEAD_SHARE, 150, 20, 20, 330));
    }
}
