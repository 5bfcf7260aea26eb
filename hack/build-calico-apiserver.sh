#!/usr/bin/env bash
# Builds calico-apiserver (hack/calico-apiserver: Calico's aggregated API server from the
# Calico module hack/calico-ipam pins, v3.28.5) from the Go module proxy. The test
# environment runs it behind an APIService, as clusters that run calico-apiserver do
# (capo-testenv's `--calico apiserver`). Cached by go.mod, go.sum, the Go version and the
# recipe: a second run with nothing changed does nothing.
#
# Output: prints the directory (bin/calico-apiserver) on the last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
module="$here/calico-apiserver"
cache_root="${CAPO_CALICO_APISERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capo/calico-apiserver}"
calico_version=v3.28.5
go_version="$(go env GOVERSION)"
# Bump when the way it is built changes (flags, extra files).
recipe=1
key="$(cd "$module" && cat go.mod go.sum ./*.go | { cat; echo "$go_version recipe=$recipe"; } | sha256sum | cut -c1-12)"
dir="$cache_root/calico-$calico_version-$key"

log() { printf '[build-calico-apiserver] %s\n' "$*" >&2; }

if [[ -x "$dir/bin/calico-apiserver" ]]; then
  log "cached: $dir"
  echo "$dir"
  exit 0
fi

mkdir -p "$dir.partial/bin"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
cd "$module"
start=$SECONDS
log "building calico-apiserver (Calico $calico_version; about 4 minutes on 2 cores, once) ..."
go build -trimpath -ldflags "-s -w" -o "$dir.partial/bin/calico-apiserver.tmp" \
  github.com/projectcalico/calico/apiserver/cmd/apiserver
mv "$dir.partial/bin/calico-apiserver.tmp" "$dir.partial/bin/calico-apiserver"
log "built calico-apiserver in $((SECONDS - start))s"

rm -rf "$dir"
mv "$dir.partial" "$dir"
log "done: $dir"
echo "$dir"
