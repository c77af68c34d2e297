/* The C ABI as a C program sees it: compiled with the system `cc` against include/cistern.h
 * and linked to libcistern.so by tests/c_program.rs, run with CISTERN_DRIVER=sim (or a real
 * or fake libcuda).
 *
 * Patterns from shared/ACCEPTANCE.md: A.1 (4 B, 1 KiB, 1 MiB, 1 GiB, aligned to 512 B), A.2
 * (size 0), A.3 (no overlap), A.4 (1 PiB fails with an out-of-memory error, the pool stays
 * healthy), A.6 (random set of 100 in [1 B, 5 MiB]; mixed set of 200 steps), on the default and
 * a non-default stream; D.17/D.19 (the same from 4 threads on their own streams, counters exact
 * at the end); invalid frees; the stats JSON.
 *
 * Prints "abi_test: N checks passed" and exits 0, or names the first failed check and exits 1.
 */
#include "cistern.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static long checks = 0;
static pthread_mutex_t check_lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        pthread_mutex_lock(&check_lock);                                       \
        checks++;                                                              \
        pthread_mutex_unlock(&check_lock);                                     \
        if (!(cond)) {                                                         \
            fprintf(stderr, "abi_test: FAILED at %s:%d: %s: ", __FILE__,       \
                    __LINE__, #cond);                                          \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, " (last error: \"%s\")\n", cistern_last_error()); \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

typedef struct {
    void *ptr;
    size_t size;
} block;

static uint64_t next_rand(uint64_t *s) {
    /* xorshift64*: deterministic across platforms. */
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static int cmp_block(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const block *)a)->ptr;
    uintptr_t y = (uintptr_t)((const block *)b)->ptr;
    return x < y ? -1 : x > y;
}

/* A.3: no two live blocks overlap (sorts a copy). */
static void check_no_overlap(const block *live, size_t n) {
    block *s = malloc(n * sizeof *s);
    CHECK(s != NULL || n == 0, "host malloc");
    if (n == 0) {
        free(s);
        return;
    }
    memcpy(s, live, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_block);
    for (size_t i = 1; i < n; i++)
        CHECK((uintptr_t)s[i - 1].ptr + s[i - 1].size <= (uintptr_t)s[i].ptr,
              "%p+%zu overlaps %p", s[i - 1].ptr, s[i - 1].size, s[i].ptr);
    free(s);
}

static void *alloc_checked(size_t size, cistern_stream_t stream) {
    void *p = cistern_malloc(size, 0, stream);
    CHECK(p != NULL, "cistern_malloc(%zu) returned NULL", size);
    CHECK((uintptr_t)p % 512 == 0, "%p is not aligned to 512 B", p);
    return p;
}

/* A.1 and A.2. */
static void fixed_sizes(cistern_stream_t stream) {
    const size_t sizes[] = {4, KIB, MIB, GIB};
    block live[4];
    for (int i = 0; i < 4; i++) {
        live[i].ptr = alloc_checked(sizes[i], stream);
        live[i].size = sizes[i];
    }
    check_no_overlap(live, 4);
    for (int i = 0; i < 4; i++)
        cistern_free(live[i].ptr, live[i].size, 0, stream);

    void *z = cistern_malloc(0, 0, stream);
    CHECK(z == NULL, "size 0 gives NULL, got %p", z);
    cistern_free(z, 0, 0, stream);
}

/* A.6: random set of 100 in [1 B, 5 MiB], then a mixed set of 200 steps at 53%. */
static void random_sets(cistern_stream_t stream, uint64_t seed) {
    block live[200];
    size_t n = 0;
    for (int i = 0; i < 100; i++) {
        size_t size = 1 + next_rand(&seed) % (5 * MIB);
        live[n].ptr = alloc_checked(size, stream);
        live[n++].size = size;
    }
    check_no_overlap(live, n);
    for (size_t i = 0; i < n; i++)
        cistern_free(live[i].ptr, live[i].size, 0, stream);

    n = 0;
    for (int step = 0; step < 200; step++) {
        if (next_rand(&seed) % 100 < 53) {
            size_t size = 1 + next_rand(&seed) % (5 * MIB);
            live[n].ptr = alloc_checked(size, stream);
            live[n++].size = size;
        } else if (n > 0) {
            size_t victim = next_rand(&seed) % n;
            cistern_free(live[victim].ptr, live[victim].size, 0, stream);
            live[victim] = live[--n];
        }
    }
    check_no_overlap(live, n);
    while (n > 0) {
        n--;
        cistern_free(live[n].ptr, live[n].size, 0, stream);
    }
}

static void *thread_main(void *arg) {
    uintptr_t t = (uintptr_t)arg;
    cistern_stream_t stream = (cistern_stream_t)(0x7000 + 0x100 * t);
    for (int round = 0; round < 3; round++) {
        fixed_sizes(stream);
        random_sets(stream, 0x9E3779B97F4A7C15ULL * (t + 1) + round);
    }
    return NULL;
}

/* Reads an integer stat from the JSON text (keys are unique and values plain integers). */
static long long stat(const char *json, const char *key) {
    char pattern[128];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(json, pattern);
    CHECK(at != NULL, "stats JSON lacks %s", key);
    return strtoll(at + strlen(pattern), NULL, 10);
}

static char *stats_json(void) {
    size_t need = cistern_stats_json(0, NULL, 0);
    CHECK(need > 2, "stats JSON length %zu", need);
    char *buf = malloc(need + 1);
    CHECK(buf != NULL, "host malloc");
    size_t got = cistern_stats_json(0, buf, need + 1);
    CHECK(got == need, "stats length changed: %zu then %zu", need, got);
    CHECK(buf[0] == '{' && buf[need - 1] == '}' && buf[need] == '\0',
          "not a NUL-terminated object: %.40s", buf);
    return buf;
}

int main(void) {
    const char *version = cistern_version();
    CHECK(version != NULL && strlen(version) > 0, "version");
    CHECK(cistern_last_error() != NULL && cistern_last_error()[0] == '\0',
          "no error yet");
    cistern_init(1);
    CHECK(cistern_last_error()[0] == '\0', "init failed");

    cistern_stream_t other = (cistern_stream_t)0x5000;
    fixed_sizes(NULL);
    fixed_sizes(other);
    random_sets(NULL, 42);
    random_sets(other, 43);

    /* A.4: an impossible request fails with an out-of-memory error; the pool stays healthy. */
    void *huge = cistern_malloc((size_t)1 << 50, 0, NULL);
    CHECK(huge == NULL, "1 PiB succeeded");
    CHECK(strstr(cistern_last_error(), "out of memory") != NULL,
          "1 PiB error does not say out of memory");
    void *after = alloc_checked(MIB, NULL);
    cistern_free(after, MIB, 0, NULL);

    /* D.17: the same patterns from 4 threads on their own streams. */
    pthread_t threads[4];
    for (uintptr_t t = 0; t < 4; t++)
        CHECK(pthread_create(&threads[t], NULL, thread_main, (void *)t) == 0, "spawn");
    for (int t = 0; t < 4; t++)
        pthread_join(threads[t], NULL);

    /* base_alloc on an interior pointer, record_stream on the block and on garbage. */
    char *p = alloc_checked(3 * KIB, NULL);
    size_t base_size = 0;
    void *base = cistern_base_alloc(p + 100, &base_size);
    CHECK(base != NULL && (char *)base <= p && p + 3 * KIB <= (char *)base + base_size,
          "base_alloc(%p + 100) = %p, %zu", (void *)p, base, base_size);
    cistern_record_stream(p + 8, other);
    cistern_free(p, 3 * KIB, 0, NULL);
    cistern_record_stream((void *)0x10, other);
    CHECK(strstr(cistern_last_error(), "record_stream") != NULL, "record_stream error");

    /* Invalid frees: unknown, double, NULL, bad device. None crashes; each is reported. */
    char *before = stats_json();
    long long invalid_before = stat(before, "num_invalid_frees");
    free(before);
    cistern_free((void *)0xdead0000, 16, 0, NULL);
    CHECK(strstr(cistern_last_error(), "cistern_free") != NULL, "unknown free not reported");
    void *q = alloc_checked(KIB, NULL);
    cistern_free(q, KIB, 0, NULL);
    cistern_free(q, KIB, 0, NULL);
    CHECK(strstr(cistern_last_error(), "cistern_free") != NULL, "double free not reported");
    cistern_free(NULL, 0, 0, NULL);
    cistern_free(q, KIB, 99, NULL);
    CHECK(strstr(cistern_last_error(), "invalid device 99") != NULL, "bad device not reported");
    CHECK(cistern_malloc(KIB, -1, NULL) == NULL, "device -1");
    CHECK(cistern_malloc(KIB, 7, NULL) == NULL, "device 7");

    /* D.19 and the stats JSON: counters exact, nothing outstanding. */
    char *json = stats_json();
    CHECK(stat(json, "num_invalid_frees") == invalid_before + 2, "num_invalid_frees");
    CHECK(strstr(json, "\"allocated_bytes.all.current\":0") != NULL, "allocated at end");
    CHECK(stat(json, "allocation.all.current") == 0, "allocations at end");
    CHECK(stat(json, "allocation.all.allocated") > 4 * 3 * 100, "allocation count");
    CHECK(stat(json, "allocated_bytes.all.peak") >= (long long)GIB, "peak");
    CHECK(stat(json, "num_ooms") >= 1, "num_ooms");
    free(json);

    /* snprintf rules: a small buffer gets a truncated, NUL-terminated prefix. */
    char small[8];
    memset(small, 'x', sizeof small);
    size_t need = cistern_snapshot_json(small, sizeof small);
    CHECK(need > sizeof small && small[7] == '\0' && strlen(small) == 7 && small[0] == '{',
          "snapshot prefix \"%s\", need %zu", small, need);

    printf("abi_test: %ld checks passed\n", checks);
    return 0;
}
