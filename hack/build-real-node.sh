#!/usr/bin/env bash
# Builds the test environment's real node (capo-testenv's `--real-node`) from the Go module
# proxy into a cache keyed by the pins, and packs the images its tests run:
#   bin/kubelet               from the control plane's Kubernetes module (hack/controlplane)
#   bin/containerd, bin/containerd-shim-runc-v2, bin/ctr
#                             containerd v2.4.2 (hack/real-node); runc comes from Debian
#                             (`make tools` installs it)
#   cni/calico, cni/calico-ipam
#                             Calico's CNI plugin (cni-plugin/cmd/calico of the Calico module
#                             hack/calico-ipam pins, v3.28.5); one binary, two names, as
#                             Calico's install copies it
#   images/pause.tar, images/listen.tar
#                             the sandbox image (capo.local/pause:1) and a workload that
#                             listens on TCP (capo.local/listen:1), static Go programs
#                             packed by hack/oci-image.sh
# A second run with unchanged pins does nothing; an interrupted build resumes.
#
# Output: prints the directory on the last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${CAPO_REAL_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capo/real-node}"
k8s_module="$here/controlplane${CAPO_K8S:+-v$CAPO_K8S}"
k8s_version="$(grep -Eo 'k8s\.io/kubernetes v[0-9][^ ]*' "$k8s_module/go.mod" | head -n1 | cut -d' ' -f2)"
containerd_version="$(grep -Eo 'github\.com/containerd/containerd/v2 v[0-9][^ ]*' "$here/real-node/go.mod" | head -n1 | cut -d' ' -f2)"
go_version="$(go env GOVERSION)"
# Bump when the way the pieces are built changes (flags, extra files).
recipe=1
key="$(cat "$k8s_module/go.mod" "$k8s_module/go.sum" "$here/real-node/go.mod" "$here/real-node/go.sum" \
          "$here"/real-node/cmd/*/main.go "$here/calico-ipam/go.mod" "$here/calico-ipam/go.sum" "$here/oci-image.sh" \
        | { cat; echo "$go_version recipe=$recipe"; } | sha256sum | cut -c1-12)"
dir="$cache_root/kubelet-$k8s_version-containerd-$containerd_version-calico-v3.28.5-$key"

log() { printf '[build-real-node] %s\n' "$*" >&2; }

done_marker="$dir/.done"
if [[ -e "$done_marker" ]]; then
  log "cached: $dir"
  echo "$dir"
  exit 0
fi

part="$dir.partial"
mkdir -p "$part/bin" "$part/cni" "$part/images"
export CGO_ENABLED=0 GOFLAGS=-mod=mod

# step NAME OUT MODULE_DIR PACKAGE [LDFLAGS]: builds once; an interrupted build resumes.
step() {
  local name="$1" out="$2" module="$3" package="$4" ldflags="${5:--s -w}"
  if [[ -x "$out" ]]; then
    return
  fi
  local start=$SECONDS
  log "building $name ..."
  (cd "$module" && go build -trimpath -ldflags "$ldflags" -o "$out.tmp" "$package")
  mv "$out.tmp" "$out"
  log "built $name in $((SECONDS - start))s"
}

commit="$(curl -fsS "$(go env GOPROXY | cut -d, -f1)/k8s.io/kubernetes/@v/$k8s_version.info" 2>/dev/null \
          | sed -n 's/.*"Hash":"\([0-9a-f]*\)".*/\1/p' || true)"
minor="$(echo "$k8s_version" | cut -d. -f2)"
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  k8s_ldflags+=" -X $pkg.gitCommit=${commit:-unknown} -X $pkg.gitTreeState=clean"
  k8s_ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
step kubelet "$part/bin/kubelet" "$k8s_module" k8s.io/kubernetes/cmd/kubelet "$k8s_ldflags"

cd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
for c in containerd containerd-shim-runc-v2 ctr; do
  step "$c" "$part/bin/$c" "$here/real-node" "github.com/containerd/containerd/v2/cmd/$c" "$cd_ldflags"
done

step "Calico's CNI plugin" "$part/cni/calico" "$here/calico-ipam" github.com/projectcalico/calico/cni-plugin/cmd/calico
ln -sf calico "$part/cni/calico-ipam"

for image in pause listen; do
  [[ -e "$part/images/$image.tar" ]] && continue
  step "$image" "$part/images/$image" "$here/real-node" "./cmd/$image"
  root="$(mktemp -d)"
  install -m 0755 "$part/images/$image" "$root/$image"
  bash "$here/oci-image.sh" "$root" "capo.local/$image:1" "$part/images/$image.tar" "[\"/$image\"]" 65532:65532
  rm -rf "$root" "$part/images/$image"
  log "packed capo.local/$image:1 ($(stat -c %s "$part/images/$image.tar") bytes)"
done

touch "$part/.done"
rm -rf "$dir"
mv "$part" "$dir"
log "done: $dir"
echo "$dir"
