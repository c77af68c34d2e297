// A native backtrace on stderr when a process crashes (SIGSEGV, SIGBUS, SIGABRT): gpu-check.sh
// preloads it (LD_PRELOAD) into the PyTorch steps when it can compile it, so that a crash inside
// torch or cistern's C++ names its frames in the step's log (found this way: an OOM message
// written through a second, statically linked libstdc++). Python's own faulthandler shows only
// Python frames. Build: gcc -shared -fPIC -O1 -o backtrace.so scripts/gpu/backtrace.c
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static void h(int sig, siginfo_t *si, void *ctx) {
  (void)ctx;
  void *b[80];
  int n = backtrace(b, 80);
  char msg[128];
  int l = snprintf(msg, sizeof msg, "SIGNAL %d at %p\n", sig, si->si_addr);
  if (write(2, msg, l) < 0) {
    _exit(139);
  }
  backtrace_symbols_fd(b, n, 2);
  _exit(139);
}
__attribute__((constructor)) static void init(void) {
  stack_t ss;
  ss.ss_sp = malloc(1 << 20);
  ss.ss_size = 1 << 20;
  ss.ss_flags = 0;
  sigaltstack(&ss, 0);
  struct sigaction sa = {0};
  sa.sa_sigaction = h;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
}
