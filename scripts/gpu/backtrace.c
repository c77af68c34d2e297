// A native backtrace on stderr when a process crashes (SIGSEGV, SIGBUS, SIGABRT): gpu-check.sh
// preloads it (LD_PRELOAD) into the PyTorch steps when it can compile it, so that a crash inside
// torch or cistern's C++ names its frames in the step's log (found this way: an OOM message
// written through a second, statically linked libstdc++). Python's own faulthandler shows only
// Python frames. Build: gcc -shared -fPIC -O1 -o backtrace.so scripts/gpu/backtrace.c
//
// After printing, the signal's default action runs (a core dump where enabled, the usual exit
// status). The handler runs on an alternate stack on the main thread (a stack overflow there
// still prints); on other threads on their own stack.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void on_crash(int sig, siginfo_t *si, void *ctx) {
  (void)ctx;
  void *frames[80];
  int n = backtrace(frames, 80);
  char msg[128];
  int len = snprintf(msg, sizeof msg, "SIGNAL %d at %p; native backtrace:\n", sig, si->si_addr);
  if (len > 0 && write(2, msg, (size_t)len) < 0) {
    // Nothing more can be said.
  }
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  // backtrace() loads libgcc_s on first use, which may allocate: do it now, not in a handler
  // that may have interrupted malloc.
  void *warm[1];
  backtrace(warm, 1);
  stack_t ss;
  ss.ss_sp = malloc(1 << 20);
  ss.ss_size = 1 << 20;
  ss.ss_flags = 0;
  if (ss.ss_sp != NULL) {
    sigaltstack(&ss, NULL);
  }
  struct sigaction sa = {0};
  sa.sa_sigaction = on_crash;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
