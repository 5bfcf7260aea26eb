#!/usr/bin/env bash
# Installs the tools `make test` needs besides Rust and Go, if they are missing:
#   helm     renders the chart (tests/chart.rs): built from the Go module proxy into
#            ~/.cache/capo/tools/helm-<version>/helm (about 2 minutes, once)
#   lua5.1   runs Argo CD's health-check tests (tests/argocd.rs)
#   promtool checks and tests the alerts (tests/prometheus.rs), from Debian's prometheus
#   kubectl  applies and renders manifests (tests/install.rs, tests/admission.rs)
# Debian packages via apt-get (root, or sudo when available).
set -euo pipefail

log() { printf '[tools] %s\n' "$*" >&2; }

helm_version=v3.22.0
helm_dir="${XDG_CACHE_HOME:-$HOME/.cache}/capo/tools/helm-$helm_version"
if [[ ! -x "$helm_dir/helm" ]]; then
  log "building helm $helm_version from the Go module proxy"
  mkdir -p "$helm_dir"
  (cd /tmp && CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$helm_dir" go install "helm.sh/helm/v3/cmd/helm@$helm_version")
fi

missing=()
command -v lua5.1 >/dev/null 2>&1 || missing+=(lua5.1)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if ((${#missing[@]} == 0)); then
  exit 0
fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || { log "need root (or sudo) to apt-get install ${missing[*]}"; exit 1; }
  sudo="sudo"
fi
log "installing ${missing[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The prometheus package enables a server; capo only needs its promtool.
if [[ " ${missing[*]} " == *" prometheus "* ]]; then
  $sudo pkill -x prometheus 2>/dev/null || true
fi
command -v lua5.1 >/dev/null && command -v promtool >/dev/null
log "done"
