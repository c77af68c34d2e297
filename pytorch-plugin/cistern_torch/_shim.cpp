// cistern_torch OOM shim: turns a failed cistern_malloc into a C++ exception PyTorch understands.
//
// Why this exists. PyTorch's CUDAPluggableAllocator::malloc calls the allocation function and
// stores whatever it returns, NULL included: a failed allocation becomes a tensor with a null
// data pointer instead of an error. PyTorch's own caching allocator reports OOM by throwing
// c10::OutOfMemoryError, which every Python entry point (HANDLE_TH_ERRORS, pybind11's
// translators, autograd's engine) turns into torch.OutOfMemoryError (== torch.cuda.
// OutOfMemoryError). The pluggable allocator calls our function through a std::function in C++
// frames, before it takes its own lock, so an exception thrown here travels the same way.
//
// So this file exports cistern_torch_malloc/cistern_torch_free, which forward to cistern_malloc /
// cistern_free (bound at run time by cistern_torch_bind, so one build serves any libcistern.so)
// and throw c10::OutOfMemoryError carrying cistern's OOM report when an allocation of a
// non-zero size fails with an out-of-memory error, or c10::Error for any other failure.
//
// It is compiled by cistern_torch at install() time against the headers of the installed torch
// (they ship in every torch wheel) and linked against torch's libc10.so; no CUDA headers needed.
// Never let an exception escape anything but cistern_torch_malloc.
//
// Exports: cistern_torch_bind, cistern_torch_malloc, cistern_torch_free.

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstring>
#include <string>

// Built with -fvisibility=hidden: only the functions marked with this are exported.
#define CISTERN_SHIM_EXPORT __attribute__((visibility("default")))

namespace {

using MallocFn = void* (*)(size_t, int, void*);
using FreeFn = void (*)(void*, size_t, int, void*);
using LastErrorFn = const char* (*)();

MallocFn g_malloc = nullptr;
FreeFn g_free = nullptr;
LastErrorFn g_last_error = nullptr;

bool contains(const std::string& text, const char* needle) {
  return text.find(needle) != std::string::npos;
}

bool is_oom(const std::string& message) {
  // cistern's Error Display: "out of memory: ..." and "memory limit exceeded: ...".
  return contains(message, "out of memory") || contains(message, "limit exceeded");
}

} // namespace

extern "C" {

// Binds the shim to the library's functions (addresses from ctypes). Returns the shim's ABI
// version so that Python can refuse a stale cached build.
CISTERN_SHIM_EXPORT int cistern_torch_bind(void* malloc_fn, void* free_fn, void* last_error_fn) noexcept {
  g_malloc = reinterpret_cast<MallocFn>(malloc_fn);
  g_free = reinterpret_cast<FreeFn>(free_fn);
  g_last_error = reinterpret_cast<LastErrorFn>(last_error_fn);
  return 1;
}

CISTERN_SHIM_EXPORT void* cistern_torch_malloc(size_t size, int device, void* stream) {
  TORCH_CHECK(g_malloc != nullptr, "cistern_torch: the OOM shim was used before it was bound");
  void* ptr = g_malloc(size, device, stream);
  if (ptr != nullptr || size == 0) {
    return ptr;
  }
  const char* raw = g_last_error ? g_last_error() : nullptr;
  std::string report = raw ? raw : "";
  if (report.empty()) {
    report = "cistern returned no pointer and no error message";
  }
  if (is_oom(report)) {
    // "CUDA out of memory." is the prefix tools look for in PyTorch's own OOM message.
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        false,
        "CUDA out of memory. cistern could not allocate ",
        size,
        " bytes on device ",
        device,
        ": ",
        report);
  }
  TORCH_CHECK(
      false,
      "cistern could not allocate ",
      size,
      " bytes on device ",
      device,
      ": ",
      report);
  return nullptr; // unreachable
}

CISTERN_SHIM_EXPORT void cistern_torch_free(void* ptr, size_t size, int device, void* stream) noexcept {
  if (g_free != nullptr) {
    g_free(ptr, size, device, stream);
  }
}

} // extern "C"
