#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok) from the Go module proxy into a cache keyed by the pinned
# versions. A second run with unchanged pins does nothing.
#
# CAPO_K8S picks the Kubernetes minor version: unset for the default (hack/controlplane,
# 1.35), or e.g. 1.30 for hack/controlplane-v1.30 (the oldest version capo supports; see
# `make test-compat`). kwok is the same for every version.
#
# Output: prints the bin directory on the last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${CAPO_TESTENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capo/testenv}"

module="$here/controlplane${CAPO_K8S:+-v$CAPO_K8S}"
if [[ ! -f "$module/go.mod" ]]; then
  echo "[build-controlplane] no module for Kubernetes ${CAPO_K8S}: $module/go.mod is missing" >&2
  echo "[build-controlplane] available: $(cd "$here" && ls -d controlplane* | sed 's/^controlplane-v//; s/^controlplane$/default/' | paste -sd' ')" >&2
  exit 2
fi
k8s_version="$(grep -Eo 'k8s\.io/kubernetes v[0-9][^ ]*' "$module/go.mod" | head -n1 | cut -d' ' -f2)"
etcd_version="$(grep -Eo 'go\.etcd\.io/etcd/server/v3 v[0-9][^ ]*' "$module/go.mod" | head -n1 | cut -d' ' -f2)"
kwok_version="$(grep -Eo 'sigs\.k8s\.io/kwok v[0-9][^ ]*' "$here/kwok/go.mod" | head -n1 | cut -d' ' -f2)"
go_version="$(go env GOVERSION)"
# Bump when the way the binaries are built changes (flags, extra files).
recipe=2
# The key covers the pins (go.sum included), the toolchain and the recipe.
key="$(cat "$module/go.mod" "$module/go.sum" "$here/kwok/go.mod" "$here/kwok/go.sum" \
        | { cat; echo "$go_version recipe=$recipe"; } | sha256sum | cut -c1-12)"
bin="$cache_root/k8s-$k8s_version-etcd-$etcd_version-kwok-$kwok_version-$key/bin"

log() { printf '[build-controlplane] %s\n' "$*" >&2; }

components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kwok-stages.yaml)
cached=true
for c in "${components[@]}"; do [[ -e "$bin/$c" ]] || cached=false; done
if $cached; then
  log "cached: $bin"
  echo "$bin"
  exit 0
fi

mkdir -p "$bin.partial"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
commit="$(curl -fsS "$(go env GOPROXY | cut -d, -f1)/k8s.io/kubernetes/@v/$k8s_version.info" 2>/dev/null \
          | sed -n 's/.*"Hash":"\([0-9a-f]*\)".*/\1/p' || true)"
minor="$(echo "$k8s_version" | cut -d. -f2)"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  k8s_ldflags+=" -X $pkg.gitCommit=${commit:-unknown} -X $pkg.gitTreeState=clean"
  k8s_ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# Each binary lands in the partial directory once built, so an interrupted build
# resumes where it stopped.
step() {
  local name="$1"; shift
  if [[ -x "$bin.partial/$name" ]]; then
    log "$name already built"
    return
  fi
  local start=$SECONDS
  log "building $name ..."
  "$@" -o "$bin.partial/$name.tmp" "${pkg[$name]}"
  mv "$bin.partial/$name.tmp" "$bin.partial/$name"
  log "built $name in $((SECONDS - start))s"
}
declare -A pkg=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kwok]=sigs.k8s.io/kwok/cmd/kwok
)

cd "$module"
step etcd go build -trimpath -ldflags "-s -w"
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  step "$c" go build -trimpath -ldflags "$k8s_ldflags"
done
cd "$here/kwok"
step kwok go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$kwok_version"
# kwok ships no built-in stages; use its own "fast" set (what kwokctl uses by default):
# Nodes become Ready with a lease heartbeat, Pods Running with IPs, deletions complete.
if [[ ! -e "$bin.partial/kwok-stages.yaml" ]]; then
  stages="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"
    cat "$stages/$f"
  done > "$bin.partial/kwok-stages.yaml.tmp"
  mv "$bin.partial/kwok-stages.yaml.tmp" "$bin.partial/kwok-stages.yaml"
  log "wrote kwok-stages.yaml from sigs.k8s.io/kwok@$kwok_version"
fi

rm -rf "$bin"
mv "$bin.partial" "$bin"
log "done: $bin"
echo "$bin"
