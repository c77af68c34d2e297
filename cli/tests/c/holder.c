/* A process that uses libcistern.so: holds memory under a tag, then exits or waits to be
   killed. Used by cli/tests/e2e_registry.rs. Usage: holder TAG MIB exit|wait */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cistern.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: holder TAG MIB exit|wait\n");
        return 2;
    }
    size_t bytes = (size_t)atoi(argv[2]) << 20;
    cistern_tag_push(argv[1]);
    void *held = cistern_malloc(bytes, 0, NULL);
    void *scratch = cistern_malloc(1 << 20, 0, NULL);
    cistern_free(scratch, 1 << 20, 0, NULL);
    cistern_tag_pop();
    if (held == NULL) {
        fprintf(stderr, "allocation failed: %s\n", cistern_last_error());
        return 3;
    }
    printf("ready\n");
    fflush(stdout);
    if (strcmp(argv[3], "exit") == 0) {
        return 0; /* `held` is never freed: the exit record must name it as a leak */
    }
    for (;;) {
        pause();
    }
}
