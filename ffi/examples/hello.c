/* A whole C program on cistern: allocate, fail on purpose, read the statistics, free.
 *
 *   scripts/install.sh "$HOME/.local"                     # libcistern.so, cistern.h, cistern.pc
 *   export PKG_CONFIG_PATH="$HOME/.local/lib/pkgconfig"
 *   cc hello.c $(pkg-config --cflags --libs cistern) -o hello
 *   CISTERN_DRIVER=sim ./hello                            # the simulated GPU; unset for CUDA
 *
 * `pkg-config --libs cistern` carries an rpath to the installed library, so the program runs
 * without LD_LIBRARY_PATH. Linked by hand instead (`-L DIR -lcistern`), it needs
 * `-Wl,-rpath,DIR` or LD_LIBRARY_PATH=DIR at run time.
 */
#include <cistern.h>

#include <stdio.h>
#include <string.h>

int main(void) {
    printf("hello: cistern %s\n", cistern_version());
    /* Optional: start the pool now, so that a bad CISTERN_CONF or a missing driver shows here
     * (through cistern_last_error) rather than at the first allocation. */
    cistern_init(0);
    size_t size = (size_t)64 << 20;
    void *p = cistern_malloc(size, 0, NULL); /* device 0, the default stream */
    if (p == NULL) {
        fprintf(stderr, "hello: %s\n", cistern_last_error());
        return 1;
    }
    printf("hello: 64 MiB at %p\n", p);

    /* Too much: NULL, and the out-of-memory report says who holds what. */
    void *q = cistern_malloc((size_t)1 << 50, 0, NULL);
    if (q == NULL) {
        const char *report = cistern_last_error();
        printf("hello: 1 PiB refused: %.60s...\n", report);
    }

    char stats[16384];
    if (cistern_stats_json(0, stats, sizeof stats) > 0 &&
        strstr(stats, "\"allocated_bytes.all.current\"") != NULL) {
        printf("hello: statistics read\n");
    }
    cistern_free(p, size, 0, NULL);
    printf("hello: done\n");
    return 0;
}
