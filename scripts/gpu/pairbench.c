// pairbench: cistern's C ABI (libcistern.so) on the real driver, timed without Python, for
// scripts/gpu-check.sh (steps pool_vmm and pool_novmm). No CUDA headers or toolkit needed: it
// dlopens libcistern.so ($CISTERN_LIB) and, for streams and the driver's own timings,
// libcuda.so.1.
//
// Build:  gcc -O2 -Wall -Wextra -o pairbench scripts/gpu/pairbench.c -ldl   (build-gpu-kit.sh)
// Run:    CISTERN_LIB=/path/libcistern.so ./pairbench [device]
//         CISTERN_CONF=vmm:false ...                         (the cuMemAlloc path)
//
// Measures, printing one JSON object per line on stdout and a readable line on stderr:
//   * cold growth: the first cistern_malloc of 2 MiB and of 64 MiB on the NULL stream
//   * the cache-hit pair: cistern_malloc + cistern_free at 512 B, 4 KiB, 1 MiB, 64 MiB (best
//     of 5 x 200000 pairs), against the driver's own pair (cuMemAlloc_v2 + cuMemFree_v2, median
//     of 50) at 4 KiB and 64 MiB
//   * the cross-stream move: 1 GiB grown as 16 x 64 MiB on the NULL stream, freed, then asked
//     for on a second (non-blocking) stream; its time and the deltas of cistern's counters
//     (num_stream_syncs and num_sync_all_streams: the host waits; num_stitched_pages,
//     num_cross_stream_pages, num_device_alloc)
//   * cistern_empty_cache, and how many distinct libcuda files the process mapped (must be 1)
// When $STEP_KEYS names a file, the key numbers are appended to it as key=value lines.
// Exit status: 0, or 1 when a check failed (an allocation, two libcuda files), 2 when
// libcistern.so cannot be loaded.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void *(*malloc_fn)(size_t, int, void *);
typedef void (*free_fn)(void *, size_t, int, void *);
typedef void (*init_fn)(int);
typedef void (*void_fn)(void);
typedef size_t (*stats_fn)(int, char *, size_t);
typedef const char *(*err_fn)(void);

static malloc_fn c_malloc;
static free_fn c_free;
static stats_fn c_stats;
static err_fn c_err;
static FILE *keys;
static int failed;

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static void key(const char *name, double v) {
  if (keys) fprintf(keys, "%s=%.6g\n", name, v);
}

static long long stat_of(int dev, const char *name) {
  static char buf[1 << 16];
  size_t n = c_stats(dev, buf, sizeof buf);
  if (n == 0 || n >= sizeof buf) return -1;
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\":", name);
  char *p = strstr(buf, pat);
  return p ? atoll(p + strlen(pat)) : -1;
}

static void *must_malloc(size_t sz, int dev, void *stream) {
  void *p = c_malloc(sz, dev, stream);
  if (!p) {
    fprintf(stderr, "pairbench: cistern_malloc(%zu) failed: %s\n", sz, c_err());
    exit(1);
  }
  return p;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static int libcuda_files(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[4096], seen[8][1024];
  int nseen = 0;
  while (fgets(line, sizeof line, f)) {
    char *path = strchr(line, '/');
    if (!path || !strstr(path, "libcuda")) continue;
    path[strcspn(path, "\n")] = 0;
    int dup = 0;
    for (int i = 0; i < nseen; i++) dup |= strcmp(seen[i], path) == 0;
    if (!dup && nseen < 8) {
      strncpy(seen[nseen], path, 1023);
      seen[nseen++][1023] = 0;
    }
  }
  fclose(f);
  printf("{\"info\":\"libcuda_files\",\"count\":%d", nseen);
  for (int i = 0; i < nseen; i++) printf(",\"f%d\":\"%s\"", i, seen[i]);
  printf("}\n");
  for (int i = 0; i < nseen; i++) fprintf(stderr, "libcuda mapped: %s\n", seen[i]);
  return nseen;
}

typedef int (*cu_alloc_fn)(unsigned long long *, size_t);
typedef int (*cu_free_fn)(unsigned long long);

// The driver's own allocation pair, for comparison with cistern's cache hit.
static void driver_pair(void *cuda, size_t bytes, const char *keyname) {
  cu_alloc_fn al = (cu_alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
  cu_free_fn fr = (cu_free_fn)dlsym(cuda, "cuMemFree_v2");
  if (!al || !fr) return;
  enum { N = 50 };
  double t[N];
  for (int i = 0; i < N; i++) {
    unsigned long long p = 0;
    double a = now_ns();
    int r = al(&p, bytes);
    if (r == 0) r = fr(p);
    t[i] = (now_ns() - a) / 1e3;
    if (r != 0) {
      printf("{\"bench\":\"driver_pair\",\"bytes\":%zu,\"error\":%d}\n", bytes, r);
      return;
    }
  }
  qsort(t, N, sizeof t[0], cmp_double);
  printf("{\"bench\":\"driver_pair\",\"bytes\":%zu,\"median_us\":%.2f}\n", bytes, t[N / 2]);
  fprintf(stderr, "driver cuMemAlloc+cuMemFree %10zu B: %9.2f us (median of %d)\n", bytes,
          t[N / 2], N);
  key(keyname, t[N / 2]);
}

int main(int argc, char **argv) {
  int dev = argc > 1 ? atoi(argv[1]) : 0;
  const char *path = getenv("CISTERN_LIB");
  const char *conf = getenv("CISTERN_CONF") ? getenv("CISTERN_CONF") : "";
  if (getenv("STEP_KEYS")) keys = fopen(getenv("STEP_KEYS"), "a");
  if (!path) {
    fprintf(stderr, "pairbench: set CISTERN_LIB\n");
    return 2;
  }
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "pairbench: %s\n", dlerror());
    return 2;
  }
  c_malloc = (malloc_fn)dlsym(lib, "cistern_malloc");
  c_free = (free_fn)dlsym(lib, "cistern_free");
  c_stats = (stats_fn)dlsym(lib, "cistern_stats_json");
  c_err = (err_fn)dlsym(lib, "cistern_last_error");
  init_fn c_init = (init_fn)dlsym(lib, "cistern_init");
  void_fn c_empty = (void_fn)dlsym(lib, "cistern_empty_cache");
  // cistern must hear of a stream before it is destroyed: it may still name the stream
  // (an event record on its cached pages' stream), and a destroyed handle is undefined
  // behaviour on a real driver (a segfault at cistern_empty_cache on an H200).
  typedef void (*forget_fn)(void *);
  forget_fn c_forget = (forget_fn)dlsym(lib, "cistern_forget_stream");
  if (!c_malloc || !c_free || !c_stats || !c_err || !c_init || !c_empty) {
    fprintf(stderr, "pairbench: libcistern.so lacks an export\n");
    return 2;
  }

  double t0 = now_ns();
  c_init(1);
  double t1 = now_ns();
  printf("{\"bench\":\"init\",\"us\":%.1f,\"conf\":\"%s\"}\n", (t1 - t0) / 1e3, conf);
  fprintf(stderr, "cistern_init: %.1f us (CISTERN_CONF=%s)\n", (t1 - t0) / 1e3, conf);

  // Cold growth on the NULL stream.
  size_t cold[2] = {2u << 20, 64u << 20};
  void *keep[2];
  for (int i = 0; i < 2; i++) {
    double a = now_ns();
    keep[i] = must_malloc(cold[i], dev, NULL);
    double us = (now_ns() - a) / 1e3;
    printf("{\"bench\":\"cold_malloc\",\"bytes\":%zu,\"us\":%.1f}\n", cold[i], us);
    fprintf(stderr, "cold cistern_malloc %10zu B: %9.1f us\n", cold[i], us);
    key(i ? "cold_64MiB_us" : "cold_2MiB_us", us);
  }
  for (int i = 0; i < 2; i++) c_free(keep[i], cold[i], dev, NULL);

  // Cache-hit pairs.
  size_t hit[4] = {512, 4096, 1u << 20, 64u << 20};
  const char *hit_key[4] = {"hit_512B_ns", "hit_4KiB_ns", "hit_1MiB_ns", "hit_64MiB_ns"};
  for (int s = 0; s < 4; s++) {
    void *p = must_malloc(hit[s], dev, NULL); // warm
    c_free(p, hit[s], dev, NULL);
    double best = 1e30;
    const int iters = 200000;
    for (int rep = 0; rep < 5; rep++) {
      double a = now_ns();
      for (int i = 0; i < iters; i++) {
        void *q = c_malloc(hit[s], dev, NULL);
        c_free(q, hit[s], dev, NULL);
      }
      double per = (now_ns() - a) / iters;
      if (per < best) best = per;
    }
    printf("{\"bench\":\"hit_pair\",\"bytes\":%zu,\"ns_per_pair\":%.1f}\n", hit[s], best);
    fprintf(stderr, "cache-hit malloc+free %10zu B: %7.1f ns/pair (best of 5 x %d)\n", hit[s],
            best, iters);
    key(hit_key[s], best);
  }

  // The cross-stream move: 1 GiB on the NULL stream, freed, then wanted on a second stream.
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  int (*sc)(void **, unsigned) =
      cuda ? (int (*)(void **, unsigned))dlsym(cuda, "cuStreamCreate") : NULL;
  int (*sd)(void *) = cuda ? (int (*)(void *))dlsym(cuda, "cuStreamDestroy_v2") : NULL;
  int (*ss)(void *) = cuda ? (int (*)(void *))dlsym(cuda, "cuStreamSynchronize") : NULL;
  int (*pr)(void **, int) =
      cuda ? (int (*)(void **, int))dlsym(cuda, "cuDevicePrimaryCtxRetain") : NULL;
  int (*setc)(void *) = cuda ? (int (*)(void *))dlsym(cuda, "cuCtxSetCurrent") : NULL;
  if (sc && sd && ss && pr && setc) {
    // Streams belong to a context: make the device's primary context (cistern's) current.
    void *prim = NULL;
    pr(&prim, dev);
    setc(prim);
    void *s2 = NULL;
    int r = sc(&s2, 1 /* CU_STREAM_NON_BLOCKING */);
    if (r != 0) {
      printf("{\"bench\":\"cross_stream\",\"error\":\"cuStreamCreate %d\"}\n", r);
      failed = 1;
    } else {
      enum { N = 16 };
      void *ps[N];
      double a = now_ns();
      for (int i = 0; i < N; i++) ps[i] = must_malloc(64u << 20, dev, NULL);
      double b = now_ns();
      for (int i = 0; i < N; i++) c_free(ps[i], 64u << 20, dev, NULL);
      const char *names[5] = {"num_stream_syncs", "num_sync_all_streams", "num_stitched_pages",
                              "num_cross_stream_pages", "num_device_alloc"};
      long long before[5], after[5];
      for (int k = 0; k < 5; k++) before[k] = stat_of(dev, names[k]);
      double c = now_ns();
      for (int i = 0; i < N; i++) ps[i] = must_malloc(64u << 20, dev, s2);
      double d = now_ns();
      for (int k = 0; k < 5; k++) after[k] = stat_of(dev, names[k]);
      for (int i = 0; i < N; i++) c_free(ps[i], 64u << 20, dev, s2);
      ss(s2);
      printf("{\"bench\":\"grow_1GiB_null_stream\",\"us\":%.1f}\n", (b - a) / 1e3);
      printf("{\"bench\":\"cross_stream_1GiB\",\"us\":%.1f", (d - c) / 1e3);
      for (int k = 0; k < 5; k++) printf(",\"%s\":%lld", names[k], after[k] - before[k]);
      printf("}\n");
      long long waits = (after[0] - before[0]) + (after[1] - before[1]);
      fprintf(stderr, "grow 1 GiB (16 x 64 MiB) on the NULL stream: %.1f us\n", (b - a) / 1e3);
      fprintf(stderr,
              "the same 1 GiB on stream 2 after the free: %.1f us, %lld host waits (%lld stream "
              "syncs, %lld sync-all), %lld pages stitched, %lld new pages\n",
              (d - c) / 1e3, waits, after[0] - before[0], after[1] - before[1],
              after[2] - before[2], after[4] - before[4]);
      key("grow_1GiB_us", (b - a) / 1e3);
      key("move_1GiB_us", (d - c) / 1e3);
      key("move_host_waits", (double)waits);
      key("move_stitched_pages", (double)(after[2] - before[2]));
      key("move_new_pages", (double)(after[4] - before[4]));
      if (c_forget) c_forget(s2);
      sd(s2);
    }
    driver_pair(cuda, 4096, "drv_pair_4KiB_us");
    driver_pair(cuda, 64u << 20, "drv_pair_64MiB_us");
  } else {
    printf("{\"bench\":\"cross_stream\",\"error\":\"libcuda.so.1 lacks the stream calls\"}\n");
    fprintf(stderr, "pairbench: libcuda.so.1 lacks the stream calls: no cross-stream move\n");
  }

  double e0 = now_ns();
  c_empty();
  double e1 = now_ns();
  long long reserved = stat_of(dev, "reserved_bytes.all.current");
  printf("{\"bench\":\"empty_cache\",\"us\":%.1f,\"reserved_after\":%lld}\n", (e1 - e0) / 1e3,
         reserved);
  fprintf(stderr, "cistern_empty_cache: %.1f us, reserved after %lld B\n", (e1 - e0) / 1e3,
          reserved);
  key("empty_cache_us", (e1 - e0) / 1e3);
  key("host_waits_total",
      (double)(stat_of(dev, "num_stream_syncs") + stat_of(dev, "num_sync_all_streams")));
  int files = libcuda_files();
  key("libcuda_files", files);
  if (files != 1) {
    fprintf(stderr, "pairbench: %d libcuda files mapped (expected exactly 1)\n", files);
    failed = 1;
  }
  static char buf[1 << 16];
  size_t n = c_stats(dev, buf, sizeof buf);
  if (n > 0 && n < sizeof buf) printf("{\"bench\":\"stats\",\"stats\":%s}\n", buf);
  if (keys) fclose(keys);
  return failed;
}
