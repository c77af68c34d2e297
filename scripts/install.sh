#!/usr/bin/env bash
# Installs the C library for programs outside this repository:
#
#   scripts/install.sh PREFIX            # builds the release library first
#   scripts/install.sh --lib FILE PREFIX # installs FILE (a libcistern.so built already)
#
# PREFIX/lib/libcistern.so      stripped of debug info (what programs load)
# PREFIX/lib/.debug/libcistern.so.debug
#                               its debug info, kept apart; the library names it
#                               (.gnu_debuglink), so debuggers and cistern's own call-site
#                               capture find it there
# PREFIX/include/cistern.h
# PREFIX/lib/pkgconfig/cistern.pc
#                               `pkg-config --cflags --libs cistern`, with an rpath to
#                               PREFIX/lib, so programs run without LD_LIBRARY_PATH
# PREFIX/share/cistern/hello.c  a whole example program
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

lib=""
if [ "${1:-}" = "--lib" ]; then
  [ $# -ge 2 ] || { echo "install.sh: --lib needs a file: --lib path/to/libcistern.so PREFIX" >&2; exit 2; }
  lib="$2"
  shift 2
fi
if [ $# -ne 1 ]; then
  echo "usage: scripts/install.sh [--lib FILE] PREFIX   (e.g. scripts/install.sh \$HOME/.local)" >&2
  exit 2
fi
mkdir -p "$1"
prefix="$(cd "$1" && pwd)"

if [ -z "$lib" ]; then
  (cd "$root" && cargo build --release -p cistern-ffi)
  lib="$root/target/release/libcistern.so"
fi
[ -f "$lib" ] || { echo "install.sh: $lib: no such library (build it: cargo build --release -p cistern-ffi)" >&2; exit 1; }
command -v objcopy >/dev/null || { echo "install.sh: objcopy not found: install binutils" >&2; exit 1; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n 1)"
libdir="$prefix/lib"
mkdir -p "$libdir/.debug" "$libdir/pkgconfig" "$prefix/include" "$prefix/share/cistern"

# Debug info apart, then a stripped copy that points at it. Written beside the target and
# renamed, so a process that has the old library mapped keeps a whole file.
tmp="$libdir/.libcistern.so.tmp.$$"
trap 'rm -f "$tmp"' EXIT
objcopy --only-keep-debug "$lib" "$libdir/.debug/libcistern.so.debug"
chmod 0644 "$libdir/.debug/libcistern.so.debug"
objcopy --strip-debug --add-gnu-debuglink="$libdir/.debug/libcistern.so.debug" "$lib" "$tmp"
chmod 0755 "$tmp"
mv -f "$tmp" "$libdir/libcistern.so"

install -m 0644 "$root/ffi/include/cistern.h" "$prefix/include/cistern.h"
install -m 0644 "$root/ffi/examples/hello.c" "$prefix/share/cistern/hello.c"
cat > "$libdir/pkgconfig/cistern.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: cistern
Description: A stream-ordered caching allocator for CUDA device memory (the C ABI)
Version: $version
URL: https://example.invalid/cistern
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -lcistern
Libs.private: -lpthread -ldl -lm
Cflags: -I\${includedir}
PC

size() { du -h "$1" | cut -f1; }
echo "installed cistern $version in $prefix:"
echo "  lib/libcistern.so ($(size "$libdir/libcistern.so"); debug info in lib/.debug, $(size "$libdir/.debug/libcistern.so.debug"))"
echo "  include/cistern.h, lib/pkgconfig/cistern.pc, share/cistern/hello.c"
echo "build a program: PKG_CONFIG_PATH=$libdir/pkgconfig cc prog.c \$(pkg-config --cflags --libs cistern)"
