#!/usr/bin/env bash
# Installs Debian's `prometheus` package (the server and `promtool`) when either is missing, for
# the exporter's tests (cli/tests/suite/export.rs runs a real Prometheus; the exposition is checked with
# `promtool check metrics`). Quiet when both are already there. Needs root and apt-get; anywhere
# else it says what to install and fails.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-prometheus: no apt-get here: install Prometheus (the server and promtool) by hand" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ensure-prometheus: apt-get needs root: run 'sudo apt-get install -y prometheus'" >&2
  exit 1
fi
echo "ensure-prometheus: installing Debian's prometheus package (server and promtool)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# The tests start servers of their own; on a machine with a service manager the package's own
# service starts too (on :9090), which the tests do not use (they pick free ports).
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null && command -v prometheus >/dev/null || {
  echo "ensure-prometheus: installed, but promtool or prometheus is still not on PATH" >&2
  exit 1
}
