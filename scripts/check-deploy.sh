#!/usr/bin/env bash
# Validates deploy/: the Kubernetes manifests against Kubernetes' schemas (kubernetes-validate,
# strict) and with each other, and the Grafana dashboard's PromQL against the metrics that
# `cistern export --list-metrics` lists (scripts/check_deploy.py says what is checked).
# Installs what it needs into a virtual environment under target/ (PyPI: kubernetes-validate,
# PyYAML); builds the cistern binary when needed.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/deploy-venv
if ! "$venv/bin/python" -c 'import kubernetes_validate, yaml' >/dev/null 2>&1; then
  echo "check-deploy: installing kubernetes-validate and PyYAML into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    'kubernetes-validate==1.37.0' 'pyyaml>=6'
fi

list=$(mktemp)
trap 'rm -f "$list"' EXIT
cargo run --quiet -p cistern-cli -- export --list-metrics >"$list"
"$venv/bin/python" scripts/check_deploy.py "$list" deploy
