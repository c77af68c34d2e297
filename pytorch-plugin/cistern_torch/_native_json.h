// cistern_torch native mode: cistern's JSON (cistern_stats_json, cistern_snapshot_json) read
// into PyTorch's own types (DeviceStats, SnapshotInfo).
//
// Header-only and free of CUDA calls, so that a test harness can include it against torch's
// headers and check the conversion on the simulated GPU, with no GPU and no libtorch_cuda.
// _native.cpp includes it. A tiny JSON reader is enough here: cistern writes both documents
// itself (objects, arrays, strings without escapes beyond \" and \\, integers, booleans,
// null), and anything unexpected is skipped, never fatal.

#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cistern_native {

// A JSON value. Integers keep all 64 bits (addresses); other numbers are read as doubles.
struct Json {
  enum Kind { Null, Bool, Int, Uint, Double, String, Array, Object } kind = Null;
  bool b = false;
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  std::string s;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;

  // The member `key` of an object, or a null value.
  const Json& operator[](const char* key) const {
    static const Json null_value;
    if (kind == Object) {
      for (const auto& kv : obj) {
        if (kv.first == key) {
          return kv.second;
        }
      }
    }
    return null_value;
  }

  int64_t as_i64() const {
    switch (kind) {
      case Int: return i;
      case Uint: return u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u);
      case Double: return static_cast<int64_t>(d);
      case Bool: return b ? 1 : 0;
      default: return 0;
    }
  }

  uint64_t as_u64() const {
    switch (kind) {
      case Int: return i < 0 ? 0 : static_cast<uint64_t>(i);
      case Uint: return u;
      case Double: return d < 0 ? 0 : static_cast<uint64_t>(d);
      case Bool: return b ? 1 : 0;
      default: return 0;
    }
  }

  bool truthy() const { return kind == Bool ? b : as_i64() != 0; }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : p_(text.c_str()), end_(text.c_str() + text.size()) {}

  // Parses the whole text; false when it is not one JSON value.
  bool parse(Json& out) {
    if (!value(out, 0)) {
      return false;
    }
    ws();
    return p_ == end_;
  }

 private:
  const char* p_;
  const char* end_;

  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) {
      ++p_;
    }
  }

  bool lit(const char* word) {
    const char* q = p_;
    for (; *word; ++word, ++q) {
      if (q >= end_ || *q != *word) {
        return false;
      }
    }
    p_ = q;
    return true;
  }

  bool string(std::string& out) {
    if (p_ >= end_ || *p_ != '"') {
      return false;
    }
    ++p_;
    while (p_ < end_ && *p_ != '"') {
      if (*p_ == '\\') {
        ++p_;
        if (p_ >= end_) {
          return false;
        }
        switch (*p_) {
          case 'n': out.push_back('\n'); break;
          case 't': out.push_back('\t'); break;
          case 'r': out.push_back('\r'); break;
          case 'b': out.push_back('\b'); break;
          case 'f': out.push_back('\f'); break;
          case 'u': {
            // \uXXXX: kept as '?' (cistern writes ASCII; a tag may carry more).
            if (end_ - p_ < 5) {
              return false;
            }
            p_ += 4;
            out.push_back('?');
            break;
          }
          default: out.push_back(*p_); break;
        }
        ++p_;
      } else {
        out.push_back(*p_++);
      }
    }
    if (p_ >= end_) {
      return false;
    }
    ++p_;
    return true;
  }

  bool number(Json& out) {
    const char* start = p_;
    bool neg = false, frac = false;
    if (p_ < end_ && *p_ == '-') {
      neg = true;
      ++p_;
    }
    while (p_ < end_ && ((*p_ >= '0' && *p_ <= '9') || *p_ == '.' || *p_ == 'e' || *p_ == 'E' ||
                         *p_ == '+' || *p_ == '-')) {
      if (*p_ == '.' || *p_ == 'e' || *p_ == 'E') {
        frac = true;
      }
      ++p_;
    }
    std::string tok(start, p_);
    if (tok.empty() || tok == "-") {
      return false;
    }
    char* stop = nullptr;
    if (frac) {
      out.kind = Json::Double;
      out.d = std::strtod(tok.c_str(), &stop);
    } else if (neg) {
      out.kind = Json::Int;
      out.i = std::strtoll(tok.c_str(), &stop, 10);
    } else {
      out.kind = Json::Uint;
      out.u = std::strtoull(tok.c_str(), &stop, 10);
    }
    return stop != nullptr && *stop == '\0';
  }

  bool value(Json& out, int depth) {
    if (depth > 64) {
      return false;
    }
    ws();
    if (p_ >= end_) {
      return false;
    }
    switch (*p_) {
      case '{': {
        ++p_;
        out.kind = Json::Object;
        ws();
        if (p_ < end_ && *p_ == '}') {
          ++p_;
          return true;
        }
        for (;;) {
          ws();
          std::string key;
          if (!string(key)) {
            return false;
          }
          ws();
          if (p_ >= end_ || *p_ != ':') {
            return false;
          }
          ++p_;
          Json v;
          if (!value(v, depth + 1)) {
            return false;
          }
          out.obj.emplace_back(std::move(key), std::move(v));
          ws();
          if (p_ < end_ && *p_ == ',') {
            ++p_;
            continue;
          }
          if (p_ < end_ && *p_ == '}') {
            ++p_;
            return true;
          }
          return false;
        }
      }
      case '[': {
        ++p_;
        out.kind = Json::Array;
        ws();
        if (p_ < end_ && *p_ == ']') {
          ++p_;
          return true;
        }
        for (;;) {
          Json v;
          if (!value(v, depth + 1)) {
            return false;
          }
          out.arr.push_back(std::move(v));
          ws();
          if (p_ < end_ && *p_ == ',') {
            ++p_;
            continue;
          }
          if (p_ < end_ && *p_ == ']') {
            ++p_;
            return true;
          }
          return false;
        }
      }
      case '"':
        out.kind = Json::String;
        return string(out.s);
      case 't':
        out.kind = Json::Bool;
        out.b = true;
        return lit("true");
      case 'f':
        out.kind = Json::Bool;
        out.b = false;
        return lit("false");
      case 'n':
        out.kind = Json::Null;
        return lit("null");
      default:
        return number(out);
    }
  }
};

inline bool parse(const std::string& text, Json& out) {
  return Parser(text).parse(out);
}

using DeviceStats = c10::CachingDeviceAllocator::DeviceStats;
using SnapshotInfo = c10::cuda::CUDACachingAllocator::SnapshotInfo;
using SegmentInfo = c10::cuda::CUDACachingAllocator::SegmentInfo;
using BlockInfo = c10::cuda::CUDACachingAllocator::BlockInfo;

// What resetAccumulatedStats subtracts: every "allocated"/"freed" counter and the event
// counts as they were at the reset (cistern keeps them from process start).
using Baseline = std::map<std::string, int64_t>;

// The counters resetAccumulatedStats resets, as cistern names them.
inline bool is_accumulated(const std::string& key) {
  auto ends = [&](const char* suffix) {
    std::string s(suffix);
    return key.size() >= s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".allocated") || ends(".freed") || key == "num_alloc_retries" ||
      key == "num_ooms" || key == "num_sync_all_streams" || key == "num_device_alloc" ||
      key == "num_device_free";
}

// The baseline of a stats document: its accumulated counters now.
inline Baseline baseline_of(const Json& flat) {
  Baseline b;
  if (flat.kind == Json::Object) {
    for (const auto& kv : flat.obj) {
      if (is_accumulated(kv.first)) {
        b[kv.first] = kv.second.as_i64();
      }
    }
  }
  return b;
}

// cistern's "reserved_bytes_by_private_pools.<a>_<b>.<half>.<field>" counters (each graph pool's
// reserved bytes, keyed as PyTorch flattens its MempoolId_t) into DeviceStats'
// reserved_bytes_by_private_pools, in a torch whose DeviceStats has it (the `int` overload is
// chosen then), less `base` (the accumulated counters at the last reset).
template <class S>
auto fill_private_pools(S& s, const Json& flat, const Baseline& base, int)
    -> decltype((void)s.reserved_bytes_by_private_pools, void()) {
  static const std::string prefix = "reserved_bytes_by_private_pools.";
  if (flat.kind != Json::Object) {
    return;
  }
  for (const auto& kv : flat.obj) {
    const std::string& key = kv.first;
    if (key.compare(0, prefix.size(), prefix) != 0) {
      continue;
    }
    // "<a>_<b>.<half>.<field>"
    size_t id_end = key.find('.', prefix.size());
    size_t half_end = id_end == std::string::npos ? id_end : key.find('.', id_end + 1);
    if (half_end == std::string::npos) {
      continue;
    }
    std::string id = key.substr(prefix.size(), id_end - prefix.size());
    size_t us = id.find('_');
    if (us == std::string::npos) {
      continue;
    }
    std::string half = key.substr(id_end + 1, half_end - id_end - 1);
    std::string field = key.substr(half_end + 1);
    int idx = half == "all" ? 0 : half == "small_pool" ? 1 : half == "large_pool" ? 2 : -1;
    if (idx < 0) {
      continue;
    }
    using Key = typename std::decay_t<decltype(s.reserved_bytes_by_private_pools)>::key_type;
    Key pool{std::strtoull(id.substr(0, us).c_str(), nullptr, 10),
                          std::strtoull(id.substr(us + 1).c_str(), nullptr, 10)};
    auto& st = s.reserved_bytes_by_private_pools[pool][idx];
    // The value at hand (a lookup by name would scan the document once per key).
    auto b = base.find(key);
    int64_t v = kv.second.as_i64() - (b == base.end() ? 0 : b->second);
    if (field == "current") {
      st.current = v;
    } else if (field == "peak") {
      st.peak = v;
    } else if (field == "allocated") {
      st.allocated = v;
    } else if (field == "freed") {
      st.freed = v;
    }
  }
}
template <class S>
void fill_private_pools(S&, const Json&, const Baseline&, long) {}

// cistern's flat statistics ("allocated_bytes.large_pool.peak": n, ...) as PyTorch's
// DeviceStats, less `base` (the accumulated counters at the last reset).
inline DeviceStats stats_from_json(const Json& flat, const Baseline& base = Baseline()) {
  auto get = [&](const std::string& key) -> int64_t {
    int64_t v = flat[key.c_str()].as_i64();
    auto it = base.find(key);
    return it == base.end() ? v : v - it->second;
  };
  auto fill_stat = [&](c10::CachingDeviceAllocator::Stat& st, const std::string& prefix) {
    st.current = get(prefix + ".current");
    st.peak = get(prefix + ".peak");
    st.allocated = get(prefix + ".allocated");
    st.freed = get(prefix + ".freed");
  };
  const char* pools[3] = {"all", "small_pool", "large_pool"};
  auto fill_array = [&](c10::CachingDeviceAllocator::StatArray& arr, const char* name) {
    for (size_t i = 0; i < 3; ++i) {
      fill_stat(arr[i], std::string(name) + "." + pools[i]);
    }
  };
  DeviceStats s;
  fill_array(s.allocation, "allocation");
  fill_array(s.segment, "segment");
  fill_array(s.active, "active");
  fill_array(s.inactive_split, "inactive_split");
  fill_array(s.allocated_bytes, "allocated_bytes");
  fill_array(s.reserved_bytes, "reserved_bytes");
  fill_array(s.active_bytes, "active_bytes");
  fill_array(s.inactive_split_bytes, "inactive_split_bytes");
  fill_array(s.requested_bytes, "requested_bytes");
  s.num_alloc_retries = get("num_alloc_retries");
  s.num_ooms = get("num_ooms");
  fill_stat(s.oversize_allocations, "oversize_allocations.all");
  fill_stat(s.oversize_segments, "oversize_segments.all");
  s.num_sync_all_streams = get("num_sync_all_streams");
  s.num_device_alloc = get("num_device_alloc");
  s.num_device_free = get("num_device_free");
  s.max_split_size = get("max_split_size");
  fill_private_pools(s, flat, base, 0);
  return s;
}

// cistern's snapshot (PyTorch's schema, as JSON) as PyTorch's SnapshotInfo: every segment
// (only those of graph pool `pool` when it is not {0, 0}), and one empty trace per device (no
// history is recorded yet).
inline SnapshotInfo snapshot_from_json(
    const Json& snap,
    std::pair<unsigned long long, unsigned long long> pool = {0, 0}) {
  // Value-initialised: PyTorch's pickler writes config_metadata's fields into every snapshot.
  SnapshotInfo out{};
  // cistern splits any block (no max_split_size); its segments grow and shrink by pages, as
  // expandable segments do (vmm:false aside, which the snapshot does not say).
  out.config_metadata.max_split_size = std::numeric_limits<size_t>::max();
  out.config_metadata.expandable_segments = true;
  out.config_metadata.last_allocator_settings = "cistern";
  size_t devices = 0;
  for (const Json& sj : snap["segments"].arr) {
    SegmentInfo seg;
    const Json& id = sj["segment_pool_id"];
    if (id.kind == Json::Array && id.arr.size() == 2) {
      seg.owner_private_pool_id = {id.arr[0].as_u64(), id.arr[1].as_u64()};
    }
    bool wanted = (pool.first == 0 && pool.second == 0) ||
        (seg.owner_private_pool_id.first == pool.first &&
         seg.owner_private_pool_id.second == pool.second);
    if (!wanted) {
      continue;
    }
    seg.device = static_cast<c10::DeviceIndex>(sj["device"].as_i64());
    seg.address = static_cast<size_t>(sj["address"].as_u64());
    seg.total_size = static_cast<size_t>(sj["total_size"].as_u64());
    seg.requested_size = static_cast<size_t>(sj["requested_size"].as_u64());
    seg.allocated_size = static_cast<size_t>(sj["allocated_size"].as_u64());
    seg.active_size = static_cast<size_t>(sj["active_size"].as_u64());
    // void* in recent torch, cudaStream_t in older ones.
    seg.stream = reinterpret_cast<decltype(seg.stream)>(static_cast<uintptr_t>(sj["stream"].as_u64()));
    seg.is_large = sj["segment_type"].s == "large";
    seg.is_expandable = sj["is_expandable"].truthy();
    for (const Json& bj : sj["blocks"].arr) {
      BlockInfo b;
      b.size = static_cast<size_t>(bj["size"].as_u64());
      b.requested_size = static_cast<size_t>(bj["requested_size"].as_u64());
      const std::string& state = bj["state"].s;
      b.allocated = state == "active_allocated";
      b.active = state == "active_allocated" || state == "active_pending_free";
      seg.blocks.push_back(std::move(b));
    }
    devices = std::max(devices, static_cast<size_t>(seg.device) + 1);
    out.segments.push_back(std::move(seg));
  }
  devices = std::max(devices, snap["device_traces"].arr.size());
  out.device_traces.resize(devices);
  return out;
}

// One stream's mapped bytes in one heap (getExpandableSegmentSizes).
struct StreamBytes {
  void* stream;
  bool small;
  size_t bytes;
};

// getExpandableSegmentSizes (newer torch): the bytes each stream has mapped in its small and
// large heaps on `device`, as PyTorch reports its expandable segments: the snapshot's VMM runs
// (graph pools' included) summed per stream and heap, in the order first seen. Memory without
// VMM (vmm:false) is not expandable and not counted, as in PyTorch.
inline std::vector<StreamBytes> expandable_sizes(const SnapshotInfo& info,
                                                 c10::DeviceIndex device) {
  std::vector<StreamBytes> out;
  for (const auto& seg : info.segments) {
    if (seg.device != device || !seg.is_expandable) {
      continue;
    }
    void* stream = reinterpret_cast<void*>(seg.stream);
    bool small = !seg.is_large;
    auto it = std::find_if(out.begin(), out.end(), [&](const StreamBytes& s) {
      return s.stream == stream && s.small == small;
    });
    if (it == out.end()) {
      out.push_back({stream, small, seg.total_size});
    } else {
      it->bytes += seg.total_size;
    }
  }
  return out;
}

} // namespace cistern_native
