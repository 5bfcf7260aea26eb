#!/usr/bin/env bash
# Installs the tools `make test` needs besides Rust and Go, if they are missing:
#   helm     renders the chart (tests/chart.rs): built from the Go module proxy into
#            ~/.cache/capo/tools/helm-<version>/helm (about 2 minutes, once)
#   lua5.1   runs Argo CD's health-check tests (tests/argocd.rs)
#   promtool checks and tests the alerts (tests/prometheus.rs), from Debian's prometheus
#   redis-server  Argo CD's cache (tests/gitops.rs, make try-argocd), from Debian's
#            redis-server; started by the tests on a free port, never as a service
#   kubectl  applies and renders manifests (tests/install.rs, tests/admission.rs)
#   faketime libfaketime, to run one capo replica with its clock ahead (tests/failover.rs)
#   runc     the real node's low-level runtime (tests/real_node.rs, make try-real-node), from
#            Debian's runc; containerd and the kubelet are built by hack/build-real-node.sh
#   CRDs     of Argo CD, cert-manager and the Prometheus operator (see below)
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

# Other projects' real CRDs, so the manifests that use them are checked against their
# real schemas (tests/install.rs, tests/chart.rs): Argo CD's Application and AppProject,
# cert-manager's Certificate and Issuer, the Prometheus operator's ServiceMonitor and
# PrometheusRule. From the Go module proxy (checksum-verified), copied to
# ~/.cache/capo/crds/<pins>.
crd_pins=(
  "github.com/argoproj/argo-cd/v3@v3.2.0 manifests/crds/application-crd.yaml manifests/crds/appproject-crd.yaml"
  "github.com/cert-manager/cert-manager@v1.19.1 deploy/crds/cert-manager.io_certificates.yaml deploy/crds/cert-manager.io_issuers.yaml"
  "github.com/prometheus-operator/prometheus-operator@v0.85.0 example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
)
crd_key="$(printf '%s\n' "${crd_pins[@]}" | sha256sum | cut -c1-12)"
crd_dir="${XDG_CACHE_HOME:-$HOME/.cache}/capo/crds/$crd_key"
if [[ ! -e "$crd_dir/.done" ]]; then
  log "fetching Argo CD's, cert-manager's and the Prometheus operator's CRDs from the Go module proxy"
  mkdir -p "$crd_dir"
  for pin in "${crd_pins[@]}"; do
    read -r module files <<<"$pin"
    dir="$(cd /tmp && GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "$module" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
    [[ -n "$dir" ]] || { log "could not download $module"; exit 1; }
    for f in $files; do install -m 0644 "$dir/$f" "$crd_dir/$(basename "$f")"; done
  done
  touch "$crd_dir/.done"
fi
ln -sfn "$crd_key" "${XDG_CACHE_HOME:-$HOME/.cache}/capo/crds/current"

missing=()
command -v lua5.1 >/dev/null 2>&1 || missing+=(lua5.1)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[[ -x /usr/sbin/runc || -x /usr/bin/runc ]] || missing+=(runc)
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
# No service is started by the packages' scripts (Debian's policy-rc.d convention): the
# tests start redis themselves. Where a policy already exists (containers), it stays.
policy=/usr/sbin/policy-rc.d
own_policy=false
if [[ ! -e "$policy" ]]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod 0755 "$policy" && own_policy=true
fi
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if $own_policy; then $sudo rm -f "$policy"; fi
# The prometheus package enables a server; capo only needs its promtool.
if [[ " ${missing[*]} " == *" prometheus "* ]]; then
  $sudo pkill -x prometheus 2>/dev/null || true
fi
command -v lua5.1 >/dev/null && command -v promtool >/dev/null && command -v faketime >/dev/null && command -v redis-server >/dev/null
[[ -x /usr/sbin/runc || -x /usr/bin/runc ]]
log "done"
