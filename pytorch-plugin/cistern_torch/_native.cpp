// cistern_torch native mode: cistern as PyTorch's own CUDA allocator.
//
// Why. Installed through torch.cuda.memory.CUDAPluggableAllocator, cistern is reached for
// malloc/free and a few hooks, and every other torch.cuda memory API raises
// ("CUDAPluggableAllocator does not yet support ..."): memory_stats, memory_allocated,
// max_memory_allocated, reset_peak_memory_stats, memory_summary, memory_snapshot, and CUDA
// graphs get no private pools (memory freed during a capture would be reused outside it).
// The loggers of Lightning, Hugging Face's Trainer and DeepSpeed call those APIs.
//
// What. A subclass of PyTorch's CUDAPluggableAllocator, compiled at install() against the
// installed torch's headers (so its interface is the installed torch's, whatever the version),
// that answers those APIs from libcistern.so:
//   getDeviceStats / resetPeakStats / resetAccumulatedStats   cistern_stats_json, cistern_reset_peak_stats
//   snapshot (every version's signature)                       cistern_snapshot_json
//   emptyCache (every version's signature)                     cistern_empty_cache / _empty_pool_cache
//   cacheInfo                                                  cistern_cache_info
//   beginAllocateToPool / endAllocateToPool / releasePool,
//   createOrIncrefPool / getPoolUseCount                       cistern's graph pools
//   enablePeerAccess                                           cistern_enable_peer_access
//   name()                                                     "cistern"
// and allocates through cistern_malloc, throwing c10::OutOfMemoryError with cistern's report
// on OOM (never a NULL tensor). It is installed with PyTorch's own changeCurrentAllocator.
//   recordHistory (every version's signature), isHistoryEnabled   _native_history.h
//   attachOutOfMemoryObserver                                    called on each OOM
//   cistern_set_observer                                         segment_map/unmap, free_completed in the history
//   attachAllocatorTraceTracker                                  every trace entry (vmm:false; refused with VMM)
//   attachOomRejectionObserver                                   kept; cistern never rejects before trying
//   recordAnnotation, push/popCompileContext, set/getUserMetadata,
//   annotateMemory, getContextForPointer                         _native_history.h
//   getExpandableSegmentSizes                                    the snapshot's VMM runs, per stream
//   shareIpcHandle / getIpcDevPtr                              cistern_ipc_share / _open / _close
//   setUseOnOOM (MemPool(use_on_oom=True))                     cistern_set_use_on_oom
//   getCheckpointState / setCheckpointPoolState,
//   checkPoolLiveAllocations (CUDA graph trees)                cistern_pool_checkpoint / _restore,
//                                                              cistern_pool_live_blocks
//
// Signatures that differ between torch versions (snapshot(), snapshot(MempoolId_t[, bool]);
// emptyCache(), emptyCache(MempoolId_t)) are all declared without `override`: the one the
// installed torch declares virtual is overridden, the others are plain overloads.
//
// Exports: cistern_torch_native_bind, cistern_torch_native_install, cistern_torch_native_error.

#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "_native_history.h"
#include "_native_json.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#define CISTERN_SHIM_EXPORT __attribute__((visibility("default")))

// Names that only newer torch declares, for the methods below that take or return them. The
// using-directive makes these fallbacks visible in torch's namespace, where qualified lookup
// finds them only when torch declares no name of its own: so each method compiles against every
// torch, and overrides the virtual where the torch has one (2.5 has neither).
namespace cistern_compat {
struct Absent {};
using OomRejectionObserver = std::function<void(Absent)>;
struct StreamSegmentSize {
  StreamSegmentSize(cudaStream_t s, bool small, size_t size)
      : stream(s), is_small_pool(small), total_size(size) {}
  cudaStream_t stream;
  bool is_small_pool;
  size_t total_size;
};
} // namespace cistern_compat
namespace c10::cuda::CUDACachingAllocator {
using namespace ::cistern_compat;
} // namespace c10::cuda::CUDACachingAllocator

namespace {

using Stream = void*;
using FilterFn = int (*)(void*, Stream);
using ReleaseFn = void (*)(void*);

// libcistern.so's exports, bound at run time (addresses from ctypes), so one build of this
// file serves whichever libcistern.so is loaded. A plain struct of function pointers, filled
// by cistern_torch_native_bind in this order.
struct Api {
  void* (*malloc)(size_t, int, Stream);
  void (*free)(void*, size_t, int, Stream);
  const char* (*last_error)();
  void (*init)(int);
  void (*empty_cache)();
  void (*set_memory_fraction)(double, int);
  void (*record_stream)(void*, Stream);
  void* (*base_alloc)(void*, size_t*);
  size_t (*stats_json)(int, char*, size_t);
  size_t (*snapshot_json)(char*, size_t);
  void (*reset_peak_stats)(int);
  int (*enable_peer_access)(int, int);
  int (*begin_allocate_to_pool)(int, uint64_t, uint64_t, FilterFn, void*, ReleaseFn);
  int (*end_allocate_to_pool)(int, uint64_t, uint64_t);
  int (*release_pool)(int, uint64_t, uint64_t);
  int (*create_or_incref_pool)(int, uint64_t, uint64_t);
  int64_t (*pool_use_count)(int, uint64_t, uint64_t);
  double (*get_memory_fraction)(int);
  int (*last_oom)(int, size_t*, size_t*);
  int (*set_observer)(void (*)(void*, const void*), void*, ReleaseFn);
  size_t (*ipc_share)(void*, int, uint8_t*, size_t, uint64_t*);
  void* (*ipc_open)(const uint8_t*, size_t, int);
  int (*ipc_close)(void*, int);
  int (*set_use_on_oom)(int, uint64_t, uint64_t, int);
  int64_t (*pool_live_blocks)(int, uint64_t, uint64_t, void**, size_t);
  void* (*pool_checkpoint)(int, uint64_t, uint64_t);
  void (*checkpoint_free)(void*);
  int (*pool_restore)(const void*, void (*)(void*, int, void*, size_t, Stream), void*);
  int (*empty_pool_cache)(uint64_t, uint64_t);
  int (*cache_info)(int, size_t*, size_t*);
  int (*uses_vmm)(int);
};

// cistern_event_t, as libcistern.so's header declares it.
struct Event {
  int kind;
  int device;
  uint64_t addr;
  uint64_t bytes;
  uint64_t pool_id_0;
  uint64_t pool_id_1;
};

Api g_api{};

// The torch these headers are: which shareable-handle format its readers expect.
constexpr int kTorchVersion = TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR;
std::string g_error;

std::string last_error() {
  const char* raw = g_api.last_error ? g_api.last_error() : nullptr;
  std::string s = raw ? raw : "";
  return s.empty() ? std::string("cistern gave no reason") : s;
}

bool is_oom(const std::string& message) {
  return message.find("out of memory") != std::string::npos ||
      message.find("limit exceeded") != std::string::npos;
}

// A JSON document from one of cistern's snprintf-like exports (which return the whole length
// whatever the room): read again, with more room, until it fits, since other threads may make
// it longer between two calls.
template <class F>
std::string read_json(F call) {
  size_t n = call(nullptr, 0);
  for (int tries = 0; tries < 8; ++tries) {
    std::string buf(n + n / 8 + 256, '\0');
    size_t m = call(&buf[0], buf.size());
    if (m < buf.size()) {
      buf.resize(m);
      return buf;
    }
    n = m;
  }
  return std::string();
}

// The allocation history (torch.cuda.memory._record_memory_history), shared by the allocation
// functions below and the allocator's snapshot. This file's state is never destroyed (leaked,
// as PyTorch leaks its allocator): frees reach it until the process ends, from threads
// (NCCL's watchdog) that outlive this library's static destructors.
cistern_native::History& g_history = *new cistern_native::History();

// OOM observers (attachOutOfMemoryObserver: PyTorch's OOM snapshot hooks).
std::mutex& g_observers_mu = *new std::mutex();
std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver>& g_observers =
    *new std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver>();

// A block cistern already made live (a checkpoint's restore) that the next call of
// cistern_alloc on this thread returns instead of allocating: the base's malloc then books it
// as its own (see CisternAllocator::adopt).
thread_local void* t_adopt = nullptr;

void* cistern_alloc(size_t size, int device, cudaStream_t stream) {
  if (t_adopt != nullptr) {
    void* adopted = t_adopt;
    t_adopt = nullptr;
    return adopted;
  }
  void* ptr = g_api.malloc(size, device, stream);
  if (ptr != nullptr || size == 0) {
    if (ptr != nullptr) {
      g_history.alloc(static_cast<c10::DeviceIndex>(device), ptr, size, stream);
    }
    return ptr;
  }
  std::string report = last_error();
  if (is_oom(report)) {
    // The device's free and total bytes at this failure, as PyTorch's OOM entry and observers
    // carry them.
    size_t device_free = 0, device_total = 0;
    g_api.last_oom(device, &device_free, &device_total);
    g_history.oom(static_cast<c10::DeviceIndex>(device), size, device_free, stream);
    std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> g(g_observers_mu);
      observers = g_observers;
    }
    if (!observers.empty()) {
      // As PyTorch calls them: the request's size, and the most this process may hold (the
      // memory fraction's share of the device when one is set).
      double f = g_api.get_memory_fraction(device);
      size_t allowed = (f > 0 && f < 1)
          ? static_cast<size_t>(f * static_cast<double>(device_total))
          : device_total;
      for (const auto& obs : observers) {
        obs(device, size, allowed, device_free);
      }
    }
    TORCH_CHECK_WITH(
        OutOfMemoryError, false, "CUDA out of memory. cistern could not allocate ", size,
        " bytes on device ", device, ": ", report);
  }
  TORCH_CHECK(false, "cistern could not allocate ", size, " bytes on device ", device, ": ", report);
  return nullptr;
}

// cistern's observer: its pool events go to the history (segment map/unmap, completed frees).
void observe_trampoline(void*, const void* raw) noexcept {
  const auto* e = static_cast<const Event*>(raw);
  try {
    g_history.pool_event(e->kind, static_cast<c10::DeviceIndex>(e->device),
                         static_cast<size_t>(e->addr), static_cast<size_t>(e->bytes),
                         {e->pool_id_0, e->pool_id_1});
  } catch (...) {
    // A history entry lost (e.g. no memory for it): never an exception into cistern.
  }
}

// cistern's observer is set only while the history records or a trace tracker is attached
// (segment events, and frees completed when the pool says so), so that otherwise a free costs
// nothing more; without it the history records free_completed at the free.
std::mutex g_observing_mu;
bool g_observing = false;

void sync_observer() {
  std::lock_guard<std::mutex> g(g_observing_mu);
  bool enabled = g_history.enabled() || g_history.tracked();
  if (enabled && !g_observing) {
    // Before the observer: a free in between must not record free_completed twice.
    g_history.pool_completes(true);
    g_observing = g_api.set_observer(observe_trampoline, nullptr, nullptr) == 1;
    if (!g_observing) {
      g_history.pool_completes(false);
    }
  } else if (!enabled && g_observing) {
    g_history.pool_completes(false);
    g_api.set_observer(nullptr, nullptr, nullptr);
    g_observing = false;
  }
}

void cistern_dealloc(void* ptr, size_t size, int device, cudaStream_t stream) {
  g_history.free(static_cast<c10::DeviceIndex>(device), ptr, size, stream);
  g_api.free(ptr, size, device, stream);
}

// PyTorch's filter, owned by cistern's window until it calls `release`.
struct FilterBox {
  std::function<bool(cudaStream_t)> filter;
};

// 1 or 0 as PyTorch's filter says; -1 when it throws (its CUDA query failed): cistern then fails
// the allocation, as PyTorch's own malloc lets the exception out, rather than serve it from
// memory reused outside the graph.
int filter_trampoline(void* ctx, Stream stream) noexcept {
  try {
    return static_cast<FilterBox*>(ctx)->filter(static_cast<cudaStream_t>(stream)) ? 1 : 0;
  } catch (...) {
    return -1;
  }
}

void filter_release(void* ctx) noexcept {
  delete static_cast<FilterBox*>(ctx);
}

// What cistern_pool_restore reported: the blocks it freed, and those it made live again.
struct RestoreSeen {
  std::vector<void*> freed;
  std::vector<std::tuple<void*, size_t, Stream>> made;
  bool failed = false;
};

void restore_trampoline(void* ctx, int allocated, void* ptr, size_t size, Stream stream) noexcept {
  auto* seen = static_cast<RestoreSeen*>(ctx);
  try {
    if (allocated) {
      seen->made.emplace_back(ptr, size, stream);
    } else {
      seen->freed.push_back(ptr);
    }
  } catch (...) {
    seen->failed = true;
  }
}

// A graph pool's checkpoint (CUDA graph trees keep one per recorded graph), freed with it.
struct CisternPoolState : c10::cuda::CUDACachingAllocator::AllocatorState {
  CisternPoolState(void* c, c10::DeviceIndex d) : cp(c), device(d) {}
  ~CisternPoolState() override {
    g_api.checkpoint_free(cp);
  }
  CisternPoolState(const CisternPoolState&) = delete;
  CisternPoolState& operator=(const CisternPoolState&) = delete;
  void* cp;
  c10::DeviceIndex device;
};

// The deleter of every DataPtr cistern hands out (defined after the installed allocator).
void cistern_raw_deleter(void* ptr);

using PluggableBase = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using c10::cuda::MempoolId_t;

class CisternAllocator : public PluggableBase {
 public:
  CisternAllocator() : PluggableBase(cistern_alloc, cistern_dealloc) {
    set_init_fn([](int n) { g_api.init(n); });
    set_reset_fn([]() { g_api.empty_cache(); });
    set_memory_fraction_fn([](double f, int d) { g_api.set_memory_fraction(f, d); });
    set_base_alloc_fn([](void* p, size_t* s) { return g_api.base_alloc(p, s); });
    set_record_stream_fn([](void* p, cudaStream_t s) { g_api.record_stream(p, s); });
  }

  // Every DataPtr carries its pointer as its context and frees through raw_delete (the base's
  // books of each pointer's size, device and stream): the same in every torch (2.5's base
  // makes a deleter context of its own instead), and what checkpoint restores hand out too,
  // so torch's `_has_Standard_Deleter` holds for both.
  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
    void* r = this->malloc(size, device, stream);
    return {r, r, &cistern_raw_deleter, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &cistern_raw_deleter;
  }

  // raw_alloc(0) returns NULL, which the base books like any pointer: a second raw_delete of
  // it would throw. Nothing was allocated, nothing to free.
  void raw_delete(void* ptr) override {
    if (ptr != nullptr) {
      PluggableBase::raw_delete(ptr);
    }
  }

  // As PyTorch's own allocator: only cistern's memory is recorded on a stream; empty tensors
  // (NULL) and memory from elsewhere (IPC, DLPack) are not cistern's to track.
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr || ptr.get_deleter() != &cistern_raw_deleter) {
      return;
    }
    PluggableBase::recordStream(ptr, stream);
  }

  // A copy between devices without peer access: cudaMemcpyAsync cannot read or write
  // cuMemMap memory across devices then, cudaMemcpyPeerAsync can (PyTorch's expandable
  // segments have the same rule).
  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    cistern_native::Json flat;
    std::string text = stats_text(device);
    TORCH_CHECK(cistern_native::parse(text, flat), "cistern: unreadable statistics: ", text);
    std::lock_guard<std::mutex> g(mu_);
    return cistern_native::stats_from_json(flat, baselines_[device]);
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    cistern_native::Json flat;
    std::string text = stats_text(device);
    TORCH_CHECK(cistern_native::parse(text, flat), "cistern: unreadable statistics: ", text);
    std::lock_guard<std::mutex> g(mu_);
    baselines_[device] = cistern_native::baseline_of(flat);
  }

  // torch later than 2.5: torch.cuda.get_per_process_memory_fraction asks the allocator.
  double getMemoryFraction(c10::DeviceIndex device) {
    double f = g_api.get_memory_fraction(device);
    TORCH_CHECK(f >= 0, "cistern: getMemoryFraction: ", last_error());
    return f;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    g_api.reset_peak_stats(device);
  }

  // torch <= 2.5: snapshot().
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() {
    return snapshot_of({0, 0});
  }
  // Later torch: snapshot(MempoolId_t), then snapshot(MempoolId_t, bool include_traces).
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(MempoolId_t pool) {
    return snapshot_of(pool);
  }
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(MempoolId_t pool, bool /*traces*/) {
    return snapshot_of(pool);
  }

  // torch <= 2.7: emptyCache(); later emptyCache(MempoolId_t). {0, 0}: every cached page,
  // released pools' included. A pool's own: its cached pages once the pool is released, on
  // every device cistern uses, as PyTorch frees a released pool's cached blocks; a pool still
  // in use keeps its memory (its graphs'), as in PyTorch.
  void emptyCache() {
    g_api.empty_cache();
  }
  void emptyCache(MempoolId_t pool) {
    if (pool.first == 0 && pool.second == 0) {
      g_api.empty_cache();
      return;
    }
    TORCH_CHECK(g_api.empty_pool_cache(pool.first, pool.second) == 1,
                "cistern: emptyCache(pool): ", last_error());
  }

  // What cuDNN may take for a convolution's workspace, as PyTorch's allocator answers it: the
  // larger of the room to grow (the device's free memory, within cistern's limit; taken as
  // the first guess only when the caller passes 0, as PyTorch does) and the largest cached free
  // block, graph pools' included (a capture's workspace comes from its pool).
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    size_t largest = 0, room = 0;
    TORCH_CHECK(g_api.cache_info(device, &largest, &room) == 1, "cistern: cacheInfo: ",
                last_error());
    if (*largestBlock == 0) {
      *largestBlock = room;
    }
    *largestBlock = std::max(*largestBlock, largest);
  }

  void beginAllocateToPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    auto* box = new FilterBox{std::move(filter)};
    int ok = g_api.begin_allocate_to_pool(
        device, mempool_id.first, mempool_id.second, filter_trampoline, box, filter_release);
    TORCH_CHECK(ok == 1, "cistern: beginAllocateToPool: ", last_error());
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    int ok = g_api.end_allocate_to_pool(device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(ok == 1, "cistern: endAllocateToPool: ", last_error());
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    int ok = g_api.release_pool(device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(ok == 1, "cistern: releasePool: ", last_error());
  }

  // torch with MemPool's pool bookkeeping (later than 2.5): a pool made or shared by a MemPool
  // is one more use, released by releasePool. A MemPool with an allocator of its own cannot be
  // served while cistern is PyTorch's allocator: refused with the reason.
  using AllocatorBase = c10::cuda::CUDACachingAllocator::CUDAAllocator;
  void createOrIncrefPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<AllocatorBase> allocator = nullptr) {
    createOrIncrefPool(device, mempool_id, allocator.get());
  }
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id, AllocatorBase* allocator) {
    TORCH_CHECK(
        allocator == nullptr || allocator == this,
        "cistern: a MemPool with an allocator of its own cannot be used while cistern is "
        "PyTorch's allocator (cistern_torch.install()); make the MemPool without one");
    int ok = g_api.create_or_incref_pool(device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(ok == 1, "cistern: createOrIncrefPool: ", last_error());
  }
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) {
    int64_t n = g_api.pool_use_count(device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(n >= 0, "cistern: getPoolUseCount: ", last_error());
    return static_cast<int>(n);
  }

  // MemPool(use_on_oom=True): (device, id, bool) in the newest torch, (device, id) in 2.8 and
  // 2.9 (only ever to turn it on); plain methods where the torch has neither (no override).
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) {
    int ok = g_api.set_use_on_oom(device, mempool_id.first, mempool_id.second, use_on_oom ? 1 : 0);
    TORCH_CHECK(ok == 1, "cistern: setUseOnOOM: ", last_error());
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id) {
    setUseOnOOM(device, mempool_id, true);
  }

  // MemPool(no_split=True) (newer torch): cistern serves a pool's blocks from pages shared
  // with its other blocks and has no mode that gives each block segments of its own, so the
  // MemPool is refused, with the fix, rather than made and not honoured.
  void setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) {
    TORCH_CHECK(false, "cistern: MemPool(no_split=True) (pool (", mempool_id.first, ", ",
                mempool_id.second, ")) is not supported while cistern is PyTorch's allocator: "
                "make the MemPool without no_split, or run this process without "
                "cistern_torch.install()");
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    // cudaDeviceEnablePeerAccess (the base) for kernels; cistern's grant for VMM mappings,
    // which that call does not cover: `dev` may access `dev_to_access`'s memory.
    PluggableBase::enablePeerAccess(dev, dev_to_access);
    int ok = g_api.enable_peer_access(dev_to_access, dev);
    TORCH_CHECK(ok == 1, "cistern: enablePeerAccess: ", last_error());
  }

  // Books `ptr`, already live in cistern (a restored checkpoint's block), in the base's
  // allocation_metadata_ so that its raw_delete frees it with this size and stream. Through the
  // base's malloc (cistern_alloc hands `ptr` back, t_adopt): the entry's type,
  // _AllocationMetadata, is not exported from libtorch_cuda.so in newer torch (2.11 hides its
  // constructors), so constructing one here would leave the library unloadable there.
  // The base's malloc books with emplace, which keeps an existing entry: every restored
  // block's address must be out of the books first (setCheckpointPoolState erases the freed
  // ones before adopting the made ones; a made block was not live before the restore).
  void adopt(void* ptr, size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    t_adopt = ptr;
    void* r = this->malloc(size, device, stream);
    t_adopt = nullptr;
    TORCH_CHECK(r == ptr, "cistern: setCheckpointPoolState: the restored block ", ptr,
                " was booked as ", r);
  }

  // CUDA graph trees (torch.compile(mode="reduce-overhead")) checkpoint the pool after each
  // recording and put it back before recording a new branch: cistern frees the pool's blocks
  // and makes the checkpoint's live again at their addresses. The base's books of each pointer
  // (size, stream: what its raw_delete frees with) follow, so the new DataPtrs free through
  // the usual path.
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      MempoolId_t id) override {
    void* cp = g_api.pool_checkpoint(device, id.first, id.second);
    TORCH_CHECK(cp != nullptr, "cistern: getCheckpointState: ", last_error());
    return std::make_shared<CisternPoolState>(cp, device);
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<CisternPoolState>(pps);
    TORCH_CHECK(
        state, "cistern: setCheckpointPoolState: the state was not made by cistern's "
        "getCheckpointState (a checkpoint taken before cistern_torch.install()?)");
    TORCH_CHECK(
        state->device == device, "cistern: setCheckpointPoolState: the checkpoint is of device ",
        static_cast<int>(state->device), ", not ", static_cast<int>(device));
    RestoreSeen seen;
    int ok = g_api.pool_restore(state->cp, restore_trampoline, &seen);
    TORCH_CHECK(ok == 1, "cistern: setCheckpointPoolState: ", last_error());
    TORCH_CHECK(!seen.failed, "cistern: setCheckpointPoolState: out of host memory");
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    // Each freed block's size and stream, from the base's books, for the history.
    std::vector<std::pair<size_t, cudaStream_t>> freed_meta(seen.freed.size(), {0, nullptr});
    {
      std::lock_guard<std::mutex> g(allocator_mutex_);
      for (size_t i = 0; i < seen.freed.size(); ++i) {
        auto it = allocation_metadata_.find(seen.freed[i]);
        if (it != allocation_metadata_.end()) {
          freed_meta[i] = {it->second.size, it->second.stream};
          allocation_metadata_.erase(it);
        }
      }
    }
    for (const auto& m : seen.made) {
      adopt(std::get<0>(m), std::get<1>(m), device, static_cast<cudaStream_t>(std::get<2>(m)));
    }
    // The history, as PyTorch's own restore records it: the frees, then the allocations.
    for (size_t i = 0; i < seen.freed.size(); ++i) {
      g_history.free(device, seen.freed[i], freed_meta[i].first, freed_meta[i].second);
    }
    for (const auto& m : seen.made) {
      g_history.alloc(device, std::get<0>(m), std::get<1>(m),
                      static_cast<cudaStream_t>(std::get<2>(m)));
    }
    delta.ptrs_freed = std::move(seen.freed);
    for (const auto& m : seen.made) {
      void* p = std::get<0>(m);
      delta.dataptrs_allocd.emplace_back(
          p, p, &cistern_raw_deleter, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      MempoolId_t id,
      const std::unordered_set<void*>& expected) override {
    std::vector<void*> live(expected.size() + 1);
    int64_t n = g_api.pool_live_blocks(device, id.first, id.second, live.data(), live.size());
    TORCH_CHECK(n >= 0, "cistern: checkPoolLiveAllocations: ", last_error());
    if (static_cast<size_t>(n) != expected.size()) {
      return false;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!expected.count(live[i])) {
        return false;
      }
    }
    return true;
  }

  std::string name() override {
    return "cistern";
  }

  // Tensors sent to other processes (torch.multiprocessing, DataLoader workers): PyTorch's own
  // handle format, for the torch these headers are (a receiver of the same torch reads it,
  // whether it runs cistern or PyTorch's allocator); see cistern_ipc_share.
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    uint64_t offset = 0;
    std::string bytes;
    for (int tries = 0; tries < 4; ++tries) {
      size_t n = g_api.ipc_share(ptr, kTorchVersion, reinterpret_cast<uint8_t*>(&bytes[0]),
                                 bytes.size(), &offset);
      TORCH_CHECK(n > 0, "cistern: cannot share ", ptr, " with another process: ", last_error());
      if (n <= bytes.size()) {
        bytes.resize(n);
        return {static_cast<ptrdiff_t>(offset), bytes};
      }
      bytes.assign(n, '\0');
    }
    TORCH_CHECK(false, "cistern: the shareable handle of ", ptr, " kept growing");
  }

  // The receiving side: the shared range's base (torch adds the offset), unmapped when the
  // last tensor on it is gone.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    int device = c10::cuda::current_device();
    void* base = g_api.ipc_open(reinterpret_cast<const uint8_t*>(handle.data()), handle.size(),
                                device);
    TORCH_CHECK(base != nullptr, "cistern: cannot open memory shared by another process: ",
                last_error());
    return std::shared_ptr<void>(base, [device](void* p) { g_api.ipc_close(p, device); });
  }

  // History, in every form torch has had: (enabled, recorder, max_entries, when) in 2.5, then
  // with clearHistory, then with skip_actions.
  using CreateContextFn = c10::cuda::CUDACachingAllocator::CreateContextFn;
  using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;
  void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries, RecordContext when) {
    g_history.record(enabled, recorder, max_entries, when, false);
    sync_observer();
  }
  void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries,
                     RecordContext when, bool clearHistory) {
    g_history.record(enabled, recorder, max_entries, when, clearHistory);
    sync_observer();
  }
  void recordHistory(bool enabled, CreateContextFn recorder, size_t max_entries,
                     RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) {
    g_history.record(enabled, recorder, max_entries, when, clearHistory, skip_actions);
    sync_observer();
  }
  bool isHistoryEnabled() override {
    return g_history.enabled();
  }

  // record_function ranges while the history records (the snapshot's external_annotations,
  // the memory viewer's annotation marks).
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    g_history.annotation(static_cast<c10::DeviceIndex>(c10::cuda::current_device()), md);
  }

  // Newer torch: the torch.compile region of each entry, user metadata, annotations of a live
  // block, and the stack a live block was allocated with.
  void pushCompileContext(std::string& md) {
    cistern_native::History::push_compile_context(md);
  }
  void popCompileContext() {
    cistern_native::History::pop_compile_context();
  }
  bool supportsUserMetadata() {
    return cistern_native::History::kUserMetadata;
  }
  void setUserMetadata(const std::string& metadata) {
    g_history.set_user_metadata(metadata);
  }
  std::string getUserMetadata() {
    return g_history.user_metadata();
  }
  void annotateMemory(const void* ptr, const std::string& metadata) {
    // The fields, not the struct: its constructors are not exported (see adopt).
    size_t size = 0;
    c10::DeviceIndex device = -1;
    cudaStream_t stream = nullptr;
    {
      std::lock_guard<std::mutex> g(allocator_mutex_);
      auto it = allocation_metadata_.find(const_cast<void*>(ptr));
      TORCH_CHECK(it != allocation_metadata_.end(), "cistern: annotateMemory: ", ptr,
                  " is not the start of a live allocation of cistern's");
      size = it->second.size;
      device = it->second.device_idx;
      stream = it->second.stream;
    }
    g_history.annotate(device, ptr, size, stream, metadata);
  }
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) {
    return g_history.context_of(reinterpret_cast<size_t>(ptr));
  }

  // ProcessGroupNCCL's registration hook (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) and
  // profilers: told every trace entry from now on (see _native_history.h), with cistern's
  // cuMemAlloc segments (vmm:false) as segment_alloc / segment_free, the ranges snapshot()
  // lists. With VMM, the ranges snapshot() lists are runs of pages that cistern unmaps and maps
  // elsewhere as it moves them (segment_map / segment_unmap, which NCCL's hook ignores): a
  // hook that registers those ranges would keep registrations of memory that is gone, which is
  // why PyTorch turns that hook off with its own expandable segments. So with VMM trackers are
  // refused, with the fix.
  void attachAllocatorTraceTracker(
      c10::cuda::CUDACachingAllocator::AllocatorTraceTracker tracker) override {
    int vmm = g_api.uses_vmm(c10::cuda::current_device());
    TORCH_CHECK(vmm >= 0, "cistern: attachAllocatorTraceTracker: ", last_error());
    TORCH_CHECK(
        vmm == 0,
        "cistern: attachAllocatorTraceTracker: trace trackers (ProcessGroupNCCL's memory "
        "registration hook, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) need the memory "
        "snapshot() lists to stay where it is, and cistern's VMM pool moves pages, as PyTorch's "
        "expandable segments do (PyTorch turns that hook off for them): unset "
        "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK, or run cistern with "
        "CISTERN_CONF=vmm:false");
    TORCH_CHECK(g_history.attach_tracker(std::move(tracker)),
                "cistern: attachAllocatorTraceTracker: at most ",
                cistern_native::Trackers::kMaxTrackers, " trace trackers can be attached");
    sync_observer();
  }

  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(g_observers_mu);
    g_observers.push_back(std::move(observer));
  }

  // Observers of allocations PyTorch's allocator rejects before asking the driver
  // (throw_on_cudamalloc_oom with a memory fraction). cistern has no such policy: a request over
  // its limit (cistern_torch.set_memory_fraction, `limit:`) first releases cached memory, as
  // any OOM, and fails as an OutOfMemoryError that the OOM observers see. So these observers
  // are kept and never called, and memory_stats()["num_oom_rejections"] stays 0: both true of
  // cistern, not missing.
  void attachOomRejectionObserver(c10::cuda::CUDACachingAllocator::OomRejectionObserver observer) {
    std::lock_guard<std::mutex> g(g_observers_mu);
    rejection_observers_.push_back(std::move(observer));
  }

  // Newer torch: the bytes mapped per stream and heap (see cistern_native::expandable_sizes).
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) {
    std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> out;
    for (const auto& s : cistern_native::expandable_sizes(snapshot_of({0, 0}), device)) {
      out.emplace_back(static_cast<cudaStream_t>(s.stream), s.small, s.bytes);
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::unordered_map<int, cistern_native::Baseline> baselines_;
  std::vector<c10::cuda::CUDACachingAllocator::OomRejectionObserver> rejection_observers_;

  static std::string stats_text(c10::DeviceIndex device) {
    std::string text =
        read_json([&](char* buf, size_t cap) { return g_api.stats_json(device, buf, cap); });
    TORCH_CHECK(!text.empty(), "cistern: no statistics for device ", device, ": ", last_error());
    return text;
  }

  static c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot_of(MempoolId_t pool) {
    std::string text = read_json([](char* buf, size_t cap) { return g_api.snapshot_json(buf, cap); });
    cistern_native::Json snap;
    TORCH_CHECK(
        !text.empty() && cistern_native::parse(text, snap), "cistern: no snapshot: ", last_error());
    auto info = cistern_native::snapshot_from_json(snap, {pool.first, pool.second});
    // The history: each live block's stack, and each device's trace.
    for (auto& seg : info.segments) {
      size_t addr = seg.address;
      for (auto& b : seg.blocks) {
        if (b.allocated) {
          b.context_when_allocated = g_history.context_of(addr);
        }
        addr += b.size;
      }
    }
    size_t devices = std::max(info.device_traces.size(), g_history.devices());
    info.device_traces = g_history.traces(devices);
    info.external_annotations = g_history.annotations();
    return info;
  }
};

std::shared_ptr<CisternAllocator>& g_allocator = *new std::shared_ptr<CisternAllocator>();

void cistern_raw_deleter(void* ptr) {
  // The installed allocator lives as long as the process (g_allocator is never reset).
  if (ptr != nullptr && g_allocator) {
    g_allocator->raw_delete(ptr);
  }
}


} // namespace

extern "C" {

// Binds the library's exports, in the order of `Api` (addresses from ctypes). Returns this
// file's ABI version so that Python can refuse a stale cached build.
CISTERN_SHIM_EXPORT int cistern_torch_native_bind(void** fns, int n) noexcept {
  constexpr int kFns = sizeof(Api) / sizeof(void*);
  if (fns == nullptr || n != kFns) {
    return -kFns;
  }
  for (int i = 0; i < n; ++i) {
    if (fns[i] == nullptr) {
      return -1 - i;
    }
  }
  std::memcpy(&g_api, fns, sizeof(Api));
  return 1;
}

// Makes cistern PyTorch's allocator (changeCurrentAllocator). Returns 1, or 0 with the reason
// in cistern_torch_native_error().
CISTERN_SHIM_EXPORT int cistern_torch_native_install() noexcept {
  try {
    TORCH_CHECK(g_api.malloc != nullptr, "cistern_torch: the native allocator was not bound");
    if (!g_allocator) {
      g_allocator = std::make_shared<CisternAllocator>();
    }
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(g_allocator);
    return 1;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown C++ exception";
  }
  return 0;
}

CISTERN_SHIM_EXPORT const char* cistern_torch_native_error() noexcept {
  return g_error.c_str();
}

} // extern "C"
