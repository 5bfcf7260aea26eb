#!/usr/bin/env bash
# Builds capo-calico-ipam (hack/calico-ipam: the test environment's IPAM driver, Calico's
# own IPAM library at v3.28.5) from the Go module proxy, and copies the
# crd.projectcalico.org/v1 CRDs that library reads out of the pinned Calico module.
# Cached by go.mod, go.sum, the driver's sources, the Go version and the recipe: a second
# run with nothing changed does nothing. An interrupted build resumes (Go's build cache
# keeps what was compiled).
#
# Output: prints the directory (bin/capo-calico-ipam, crds/*.yaml) on the last line of
# stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
module="$here/calico-ipam"
cache_root="${CAPO_CALICO_IPAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capo/calico-ipam}"
calico_module=github.com/projectcalico/calico
# The pseudo-version pins release-v3.28 at the v3.28.5 tag (see go.mod).
calico_version=v3.28.5
go_version="$(go env GOVERSION)"
# Bump when the way the driver is built changes (flags, extra files).
recipe=1
key="$(cd "$module" && cat go.mod go.sum ./*.go | { cat; echo "$go_version recipe=$recipe"; } | sha256sum | cut -c1-12)"
dir="$cache_root/calico-$calico_version-$key"

log() { printf '[build-calico-ipam] %s\n' "$*" >&2; }

if [[ -x "$dir/bin/capo-calico-ipam" && -f "$dir/crds/.done" ]]; then
  log "cached: $dir"
  echo "$dir"
  exit 0
fi

mkdir -p "$dir.partial/bin" "$dir.partial/crds"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
cd "$module"
if [[ ! -x "$dir.partial/bin/capo-calico-ipam" ]]; then
  start=$SECONDS
  log "building capo-calico-ipam (Calico IPAM $calico_version; about 5 minutes on 2 cores, once) ..."
  go build -trimpath -ldflags "-s -w" -o "$dir.partial/bin/capo-calico-ipam.tmp" .
  mv "$dir.partial/bin/capo-calico-ipam.tmp" "$dir.partial/bin/capo-calico-ipam"
  log "built capo-calico-ipam in $((SECONDS - start))s"
fi
if [[ ! -f "$dir.partial/crds/.done" ]]; then
  src="$(go list -m -f '{{.Dir}}' "$calico_module")/libcalico-go/config/crd"
  for crd in "$src"/crd.projectcalico.org_*.yaml; do
    install -m 0644 "$crd" "$dir.partial/crds/"
  done
  touch "$dir.partial/crds/.done"
  log "copied $(ls "$dir.partial/crds" | wc -l) CRDs from $calico_module ($calico_version)"
fi

rm -rf "$dir"
mv "$dir.partial" "$dir"
log "done: $dir"
echo "$dir"
