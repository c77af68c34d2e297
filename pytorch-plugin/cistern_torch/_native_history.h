// cistern_torch native mode: allocation history in PyTorch's own terms, for
// torch.cuda.memory._record_memory_history() and the memory viewer.
//
// PyTorch's allocator keeps a ring of TraceEntry per device (alloc, free_requested,
// free_completed, oom, ...) with the stack (GatheredContext) its context recorder captured, and a
// context per live block; snapshot() returns both. This keeps the same for cistern, on the
// allocating thread, in the C++ layer where PyTorch's recorder can be called: cistern's Rust pool
// never sees Python frames. Header-only and free of CUDA calls, so that a test harness can drive
// it without a GPU. _native.cpp includes it.
//
// What it records: every allocation and free made through PyTorch (alloc, free_requested), OOMs,
// and what cistern's pool reports through its observer (pool_event, from cistern_set_observer):
// segment_map / segment_unmap as pages are mapped and moved, segment_alloc / segment_free without
// VMM, and free_completed when a block is free for reuse, which for a block other streams used
// (record_stream) is when their work is done. Without the observer (pool_completes(false)),
// free_completed is recorded with free_requested. Pool events carry no stack: they come with
// cistern's locks held, where PyTorch's recorder (which takes the GIL) must not be called. Not
// recorded: the snapshot marker.
//
// Trace trackers (attachAllocatorTraceTracker: ProcessGroupNCCL's hook that registers the
// allocator's memory with NCCL, profilers) are told every entry, alloc to segment_unmap, whether
// or not the history records, as PyTorch's allocator tells them; the history's skip_actions
// apply to its rings only. Trackers can be attached, never detached (as in PyTorch). They are
// called on the thread that caused the event: for pool events with cistern's locks held, so, as
// PyTorch's comment on attachAllocatorTraceTracker says, a tracker must not take the GIL nor
// call the allocator.
//
// Also kept, as PyTorch's allocator keeps them: the annotations of record_function ranges
// (recordAnnotation, the snapshot's external_annotations, bounded as the rings); in newer torch,
// the torch.compile region an entry was made in (pushCompileContext: compile_context_, "N/A"
// outside one; a stack per thread, where PyTorch keeps one per device), the string set by
// torch.cuda.memory._set_memory_metadata (user_metadata_ of every later entry made on that
// thread, as PyTorch keeps it per thread) and annotateMemory's `annotate` entries. Segment
// entries carry the graph pool of their memory (mempool_, where the torch has it).

#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cistern_native {

namespace cca = c10::cuda::CUDACachingAllocator;
using TraceEntry = cca::TraceEntry;
using RecordContext = cca::RecordContext;
using Context = std::shared_ptr<c10::GatheredContext>;

// A TraceEntry whichever constructor this torch has: (..., stream, mempool, time, context) in
// later versions, (..., stream, time, context) in 2.5. Its time is set in microseconds since the
// epoch (the `t_` that snapshot() hands to PyTorch, which prints it as `time_us`).
// The graph pool an entry is about ((0, 0): none), where the torch's entries carry one.
using Pool = std::pair<uint64_t, uint64_t>;

template <class TE>
TE construct_entry(
    typename TE::Action action,
    c10::DeviceIndex device,
    size_t addr,
    size_t size,
    cudaStream_t stream,
    Context context,
    Pool pool = {0, 0}) {
  using Time = c10::approx_time_t;
  // A template, so that only the branch this torch can compile is instantiated.
  if constexpr (std::is_constructible_v<TE, typename TE::Action, c10::DeviceIndex, size_t, size_t,
                                        void*, c10::cuda::MempoolId_t, Time, Context>) {
    return TE(action, device, addr, size, stream, c10::cuda::MempoolId_t{pool.first, pool.second},
              Time{}, std::move(context));
  } else {
    (void)pool;
    return TE(action, device, addr, size, stream, Time{}, std::move(context));
  }
}

// What a torch's TraceEntry has beyond 2.5's (detected, so that one source serves every torch).
template <class TE, class = void>
struct HasCompileContext : std::false_type {};
template <class TE>
struct HasCompileContext<TE, std::void_t<decltype(std::declval<TE&>().compile_context_)>>
    : std::true_type {};
template <class TE, class = void>
struct HasUserMetadata : std::false_type {};
template <class TE>
struct HasUserMetadata<TE, std::void_t<decltype(std::declval<TE&>().user_metadata_)>>
    : std::true_type {};
template <class TE, class = void>
struct HasAnnotate : std::false_type {};
template <class TE>
struct HasAnnotate<TE, std::void_t<decltype(TE::ANNOTATE)>> : std::true_type {};

// A record_function annotation, as this torch's snapshot holds them.
using Annotation = typename std::decay_t<
    decltype(std::declval<cca::SnapshotInfo&>().external_annotations)>::value_type;

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline TraceEntry make_entry(
    TraceEntry::Action action,
    c10::DeviceIndex device,
    size_t addr,
    size_t size,
    cudaStream_t stream,
    Context context,
    Pool pool = {0, 0}) {
  TraceEntry e =
      construct_entry<TraceEntry>(action, device, addr, size, stream, std::move(context), pool);
  e.time_.t_ = now_us();
  return e;
}

// The attached trace trackers: at most kMaxTrackers, called without a lock (each slot is written
// once, before the count that makes it visible).
class Trackers {
 public:
  static constexpr size_t kMaxTrackers = 64;

  // Adds `t`; false when kMaxTrackers are attached already.
  bool attach(cca::AllocatorTraceTracker t) {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = count_.load(std::memory_order_relaxed);
    if (n == kMaxTrackers) {
      return false;
    }
    slots_[n] = std::move(t);
    count_.store(n + 1, std::memory_order_release);
    return true;
  }

  bool any() const {
    return count_.load(std::memory_order_relaxed) != 0;
  }

  // Trackers get the entry as PyTorch's allocator hands it to them: its time in the
  // approximate clock's units (the rings keep microseconds since the epoch, as snapshot()
  // converts PyTorch's).
  void tell(const TraceEntry& e) const {
    size_t n = count_.load(std::memory_order_acquire);
    if (n == 0) {
      return;
    }
    TraceEntry t = e;
    t.time_.approx_t_ = c10::getApproximateTime();
    for (size_t i = 0; i < n; ++i) {
      if (slots_[i]) {
        slots_[i](t);
      }
    }
  }

 private:
  std::mutex mu_;
  std::atomic<size_t> count_{0};
  cca::AllocatorTraceTracker slots_[kMaxTrackers];
};

// The history of every device: what recordHistory switched on, the rings, and the context of each
// live block; and the trace trackers. Thread-safe.
class History {
 public:
  // recordHistory(enabled, recorder, max_entries, when[, clear[, skip_actions]]), as PyTorch's
  // allocator takes it: the trace is kept while `enabled`, stacks as `when` says, at least one
  // entry per device; `skip` names actions not to record ("alloc", "free_requested", ...).
  void record(bool enabled, cca::CreateContextFn recorder, size_t max_entries, RecordContext when,
              bool clear, const std::vector<std::string>& skip = {}) {
    std::lock_guard<std::mutex> g(mu_);
    enabled_.store(enabled, std::memory_order_relaxed);
    recorder_ = enabled ? recorder : nullptr;
    when_ = enabled ? when : RecordContext::NEVER;
    max_entries_ = std::max<size_t>(1, max_entries);
    skip_alloc_ = skip_free_requested_ = skip_free_completed_ = skip_oom_ = false;
    skip_segment_alloc_ = skip_segment_free_ = skip_segment_map_ = skip_segment_unmap_ = false;
    for (const auto& a : skip) {
      skip_alloc_ |= a == "alloc";
      skip_free_requested_ |= a == "free_requested";
      skip_free_completed_ |= a == "free_completed";
      skip_oom_ |= a == "oom";
      skip_segment_alloc_ |= a == "segment_alloc";
      skip_segment_free_ |= a == "segment_free";
      skip_segment_map_ |= a == "segment_map";
      skip_segment_unmap_ |= a == "segment_unmap";
    }
    // As PyTorch: switching off keeps what was recorded (a snapshot taken after still shows
    // it); only clearHistory drops the trace.
    if (clear) {
      rings_.clear();
      annotations_.clear();
    }
    for (auto& kv : rings_) {
      trim(kv.second);
    }
    trim(annotations_);
  }

  // recordAnnotation: a record_function range's start or end ({"name", ...}, {"stage",
  // "START"|"END"}), on `device`, while the history records.
  void annotation(c10::DeviceIndex device,
                  const std::vector<std::pair<std::string, std::string>>& md) {
    if (!on()) {
      return;
    }
    Annotation a(device, c10::approx_time_t{});
    a.time_.t_ = now_us();
    for (const auto& kv : md) {
      a.recordUserMetadata(kv.first, kv.second);
    }
    std::lock_guard<std::mutex> g(mu_);
    if (!enabled_) {
      return;
    }
    annotations_.push_back(std::move(a));
    trim(annotations_);
  }

  // The annotations kept, oldest first (the snapshot's external_annotations).
  std::vector<Annotation> annotations() const {
    std::lock_guard<std::mutex> g(mu_);
    return std::vector<Annotation>(annotations_.begin(), annotations_.end());
  }

  // pushCompileContext / popCompileContext, on the calling thread.
  static void push_compile_context(const std::string& name) {
    compile_stack().push_back(name);
  }
  static void pop_compile_context() {
    auto& st = compile_stack();
    if (!st.empty()) {
      st.pop_back();
    }
  }

  // Whether this torch's entries carry user metadata (supportsUserMetadata).
  static constexpr bool kUserMetadata = HasUserMetadata<TraceEntry>::value;

  // torch.cuda.memory._set_memory_metadata: carried by every later entry made on the calling
  // thread ("" for none), per thread as PyTorch keeps it.
  static void set_user_metadata(const std::string& md) {
    user_metadata_here() = md;
  }
  static std::string user_metadata() {
    return user_metadata_here();
  }

  // annotateMemory: an `annotate` entry for the live block at `ptr` (its size and stream),
  // carrying `md`, in a torch that has the action; false in one that has not.
  template <class TE = TraceEntry>
  bool annotate(c10::DeviceIndex device, const void* ptr, size_t size, cudaStream_t stream,
                const std::string& md) {
    if constexpr (HasAnnotate<TE>::value && HasUserMetadata<TE>::value) {
      bool tracked = trackers_.any();
      if (!on() && !tracked) {
        return true;
      }
      TE e = entry(TE::ANNOTATE, device, reinterpret_cast<size_t>(ptr), size, stream, nullptr);
      e.user_metadata_ = md;
      if (on()) {
        std::lock_guard<std::mutex> g(mu_);
        if (enabled_) {
          push(device, e);
        }
      }
      if (tracked) {
        trackers_.tell(e);
      }
      return true;
    } else {
      (void)device, (void)ptr, (void)size, (void)stream, (void)md;
      return false;
    }
  }

  bool enabled() const {
    return enabled_.load(std::memory_order_relaxed);
  }

  // An allocation of `size` bytes at `ptr` on `device` (called after it succeeded).
  void alloc(c10::DeviceIndex device, void* ptr, size_t size, cudaStream_t stream) {
    bool tracked = trackers_.any();
    if (!on() && !tracked) {
      return;
    }
    Context ctx = capture(RecordContext::STATE);
    Context entry_ctx;
    {
      std::lock_guard<std::mutex> g(mu_);
      entry_ctx = when_ >= RecordContext::ALLOC ? ctx : nullptr;
      if (enabled_) {
        if (ctx) {
          contexts_[ptr] = ctx;
          has_contexts_.store(true, std::memory_order_relaxed);
        } else {
          // No stack for this block (context=None): never an earlier block's at this address.
          contexts_.erase(ptr);
        }
        if (!skip_alloc_) {
          push(device, entry(TraceEntry::ALLOC, device, reinterpret_cast<size_t>(ptr), size,
                             stream, entry_ctx));
        }
      }
    }
    if (tracked) {
      trackers_.tell(entry(TraceEntry::ALLOC, device, reinterpret_cast<size_t>(ptr), size,
                           stream, std::move(entry_ctx)));
    }
  }

  // A free of the block at `ptr` (called before the block is given back).
  void free(c10::DeviceIndex device, void* ptr, size_t size, cudaStream_t stream) {
    bool tracked = trackers_.any();
    if (!on()) {
      // Recording stopped: the block's stack (kept while it lives, for snapshots) goes with
      // it, so that a later block at its address never shows it.
      if (has_contexts_.load(std::memory_order_relaxed)) {
        std::lock_guard<std::mutex> g(mu_);
        contexts_.erase(ptr);
        has_contexts_.store(!contexts_.empty(), std::memory_order_relaxed);
      }
      if (tracked) {
        tell_free(device, reinterpret_cast<size_t>(ptr), size, stream, nullptr);
      }
      return;
    }
    Context ctx = capture(RecordContext::ALL);
    auto addr = reinterpret_cast<size_t>(ptr);
    {
      std::lock_guard<std::mutex> g(mu_);
      contexts_.erase(ptr);
      if (enabled_) {
        if (!skip_free_requested_) {
          push(device, entry(TraceEntry::FREE_REQUESTED, device, addr, size, stream, ctx));
        }
        if (!skip_free_completed_ && !pool_completes_.load(std::memory_order_relaxed)) {
          push(device, entry(TraceEntry::FREE_COMPLETED, device, addr, size, stream, ctx));
        }
      }
    }
    if (tracked) {
      tell_free(device, addr, size, stream, std::move(ctx));
    }
  }

  // Attaches a trace tracker; false when too many are attached (see Trackers).
  bool attach_tracker(cca::AllocatorTraceTracker t) {
    return trackers_.attach(std::move(t));
  }

  // Whether any trace tracker is attached (cistern's observer must then report pool events).
  bool tracked() const {
    return trackers_.any();
  }

  // Whether cistern's observer reports completed frees (then free() records free_requested only).
  void pool_completes(bool on) {
    pool_completes_.store(on, std::memory_order_relaxed);
  }

  // One event of cistern's observer (cistern_event_t's kind: 1 segment_map, 2 segment_unmap,
  // 3 segment_alloc, 4 segment_free, 5 free_completed), for `bytes` at `addr`. Called with
  // cistern's locks held: takes no stack, calls nothing of cistern's or Python's.
  void pool_event(int kind, c10::DeviceIndex device, size_t addr, size_t bytes,
                  Pool pool = {0, 0}) {
    bool tracked = trackers_.any();
    if (!on() && !tracked) {
      return;
    }
    TraceEntry::Action action;
    switch (kind) {
      case 1:
        action = TraceEntry::SEGMENT_MAP;
        break;
      case 2:
        action = TraceEntry::SEGMENT_UNMAP;
        break;
      case 3:
        action = TraceEntry::SEGMENT_ALLOC;
        break;
      case 4:
        action = TraceEntry::SEGMENT_FREE;
        break;
      case 5:
        action = TraceEntry::FREE_COMPLETED;
        break;
      default:
        return;  // a kind a newer libcistern reports: not PyTorch's to show
    }
    if (on()) {
      std::lock_guard<std::mutex> g(mu_);
      if (enabled_ && !skipped(action)) {
        push(device, entry(action, device, addr, bytes, nullptr, nullptr, pool));
      }
    }
    if (tracked) {
      trackers_.tell(entry(action, device, addr, bytes, nullptr, nullptr, pool));
    }
  }

  // A request of `size` bytes that failed for lack of memory (`device_free`: the device's free
  // bytes as the driver reports them, what PyTorch records in addr_).
  void oom(c10::DeviceIndex device, size_t size, size_t device_free, cudaStream_t stream) {
    bool tracked = trackers_.any();
    if (!on() && !tracked) {
      return;
    }
    Context ctx = capture(RecordContext::ALLOC);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (enabled_ && !skip_oom_) {
        push(device, entry(TraceEntry::OOM, device, device_free, size, stream, ctx));
      }
    }
    if (tracked) {
      trackers_.tell(entry(TraceEntry::OOM, device, device_free, size, stream, std::move(ctx)));
    }
  }

  // The context a live block was allocated with (nullptr when none was recorded).
  Context context_of(size_t addr) const {
    std::lock_guard<std::mutex> g(mu_);
    auto it = contexts_.find(reinterpret_cast<void*>(addr));
    return it == contexts_.end() ? nullptr : it->second;
  }

  // The ring of every device in `0..devices`, oldest first.
  std::vector<std::vector<TraceEntry>> traces(size_t devices) const {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::vector<TraceEntry>> out(devices);
    for (const auto& kv : rings_) {
      if (kv.first >= 0 && static_cast<size_t>(kv.first) < devices) {
        out[kv.first].assign(kv.second.begin(), kv.second.end());
      }
    }
    return out;
  }

  // The number of devices with an entry (the highest device + 1).
  size_t devices() const {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = 0;
    for (const auto& kv : rings_) {
      n = std::max(n, static_cast<size_t>(kv.first) + 1);
    }
    return n;
  }

 private:
  mutable std::mutex mu_;
  // Read without the lock on every allocation and free: history off costs one load.
  std::atomic<bool> enabled_{false};
  cca::CreateContextFn recorder_ = nullptr;
  RecordContext when_ = RecordContext::NEVER;
  size_t max_entries_ = 1;
  bool skip_alloc_ = false, skip_free_requested_ = false, skip_free_completed_ = false,
       skip_oom_ = false, skip_segment_alloc_ = false, skip_segment_free_ = false,
       skip_segment_map_ = false, skip_segment_unmap_ = false;
  std::atomic<bool> pool_completes_{false};
  // Whether contexts_ may hold a stack (so that a free with recording off skips the lock).
  std::atomic<bool> has_contexts_{false};
  std::unordered_map<int, std::deque<TraceEntry>> rings_;
  std::unordered_map<void*, Context> contexts_;

  Trackers trackers_;
  std::deque<Annotation> annotations_;

  static std::vector<std::string>& compile_stack() {
    thread_local std::vector<std::string> stack;
    return stack;
  }

  static std::string& user_metadata_here() {
    thread_local std::string md;
    return md;
  }

  // An entry with what this torch's entries carry beyond 2.5's: the thread's compile context
  // and the user metadata.
  TraceEntry entry(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size,
                   cudaStream_t stream, Context context, Pool pool = {0, 0}) const {
    TraceEntry e = make_entry(action, device, addr, size, stream, std::move(context), pool);
    decorate(e);
    return e;
  }

  template <class TE>
  void decorate(TE& e) const {
    if constexpr (HasCompileContext<TE>::value) {
      const auto& st = compile_stack();
      e.compile_context_ = st.empty() ? std::string("N/A") : st.back();
    }
    if constexpr (HasUserMetadata<TE>::value) {
      e.user_metadata_ = user_metadata_here();
    }
  }

  bool on() const {
    return enabled_.load(std::memory_order_relaxed);
  }

  // Whether skip_actions keeps `action` out of the rings (mu_ held).
  bool skipped(TraceEntry::Action action) const {
    switch (action) {
      case TraceEntry::SEGMENT_MAP:
        return skip_segment_map_;
      case TraceEntry::SEGMENT_UNMAP:
        return skip_segment_unmap_;
      case TraceEntry::SEGMENT_ALLOC:
        return skip_segment_alloc_;
      case TraceEntry::SEGMENT_FREE:
        return skip_segment_free_;
      case TraceEntry::FREE_COMPLETED:
        return skip_free_completed_;
      default:
        return false;
    }
  }

  // A free as the trackers see it: free_requested, and free_completed unless cistern's
  // observer reports it when the block is free for reuse.
  void tell_free(c10::DeviceIndex device, size_t addr, size_t size, cudaStream_t stream,
                 Context ctx) const {
    trackers_.tell(entry(TraceEntry::FREE_REQUESTED, device, addr, size, stream, ctx));
    if (!pool_completes_.load(std::memory_order_relaxed)) {
      trackers_.tell(entry(TraceEntry::FREE_COMPLETED, device, addr, size, stream, ctx));
    }
  }

  // The recorder's context when recording at `level` or above is asked for (outside the lock:
  // it takes the GIL and walks Python's stack).
  Context capture(RecordContext level) {
    cca::CreateContextFn f;
    RecordContext when;
    {
      std::lock_guard<std::mutex> g(mu_);
      f = recorder_;
      when = when_;
    }
    return f != nullptr && when != RecordContext::NEVER && when >= level ? f() : nullptr;
  }

  void push(c10::DeviceIndex device, TraceEntry e) {
    auto& ring = rings_[device];
    ring.push_back(std::move(e));
    trim(ring);
  }

  // Keeps the newest max_entries_ of a ring (trace entries or annotations).
  template <class T>
  void trim(std::deque<T>& ring) const {
    while (ring.size() > max_entries_) {
      ring.pop_front();
    }
  }
};

} // namespace cistern_native
