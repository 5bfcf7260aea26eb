#!/usr/bin/env bash
# Builds Argo CD (the application controller, the repo server and its git helper, as one
# multi-call binary: hack/argocd) from the Go module proxy, with the kustomize and helm
# versions Argo CD's own image ships (its hack/tool-versions.sh; kustomize one patch
# release older, see below), into a cache keyed by
# the pins, the toolchain and the recipe. A second run with unchanged pins does nothing.
#
# Argo CD v3.6 needs Go 1.27: GOTOOLCHAIN=go1.27.4 fetches it through the Go module proxy
# (about 10 s, once).
#
# The cache directory holds:
#   argocd                 the multi-call binary (ARGOCD_BINARY_NAME picks the component)
#   kustomize, helm        what the repo server runs to render kustomize folders and charts
#   git-verify-wrapper.sh  Argo CD's script the repo server calls on every checkout
#   crds/                  Argo CD's CRDs (Application, AppProject, ApplicationSet)
#   version                the Argo CD version
#
# Output: prints the cache directory on the last line of stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
module="$here/argocd"
cache_root="${CAPO_ARGOCD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capo/argocd}"
toolchain=go1.27.4
# Argo CD 3.6.1's image ships kustomize 5.8.3, but 5.8.3 requires a kube-openapi
# pseudo-version the Go module proxy refuses (403 "not available"); 5.8.2 builds.
kustomize_version=v5.8.2
helm_version=v4.3.1
# Bump when the way the binaries are built changes (flags, extra files).
recipe=1

argocd_version="$(grep -Eo 'github\.com/argoproj/argo-cd/v3 v[0-9][^ ]*' "$module/go.mod" | head -n1 | cut -d' ' -f2)"
key="$(cat "$module/go.mod" "$module/go.sum" "$module/main.go" \
        | { cat; echo "$toolchain kustomize=$kustomize_version helm=$helm_version recipe=$recipe"; } \
        | sha256sum | cut -c1-12)"
dir="$cache_root/argocd-$argocd_version-$key"

log() { printf '[build-argocd] %s\n' "$*" >&2; }

parts=(argocd kustomize helm git-verify-wrapper.sh crds version)
cached=true
for p in "${parts[@]}"; do [[ -e "$dir/$p" ]] || cached=false; done
if $cached; then
  log "cached: $dir"
  echo "$dir"
  exit 0
fi

export GOTOOLCHAIN="$toolchain" CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$dir.partial"
started=$SECONDS

# Each part lands in the partial directory once built, so an interrupted build resumes.
step() {
  local name="$1"; shift
  if [[ -e "$dir.partial/$name" ]]; then
    log "$name already built"
    return
  fi
  local start=$SECONDS
  log "building $name ..."
  "$@"
  log "built $name in $((SECONDS - start))s"
}

build_argocd() {
  local pkg=github.com/argoproj/argo-cd/v3/common
  (cd "$module" && go build -trimpath \
    -ldflags "-s -w -X $pkg.version=${argocd_version#v} -X $pkg.gitTag=$argocd_version -X $pkg.gitTreeState=clean" \
    -o "$dir.partial/argocd.tmp" .)
  mv "$dir.partial/argocd.tmp" "$dir.partial/argocd"
}

# kustomize and helm are installed from their own modules (go install pkg@version keeps
# their module versions in the build info, which `kustomize version` reports).
go_install() {
  local name="$1" pkg="$2" ldflags="${3:-}"
  local gobin="$dir.partial/$name.d"
  (cd /tmp && GOBIN="$gobin" go install -trimpath -ldflags "-s -w $ldflags" "$pkg")
  mv "$gobin/$name" "$dir.partial/$name"
  rmdir "$gobin"
}

argocd_source() {
  (cd "$module" && go list -m -f '{{.Dir}}' github.com/argoproj/argo-cd/v3)
}

copy_git_verify_wrapper() {
  install -m 0755 "$(argocd_source)/hack/git-verify-wrapper.sh" "$dir.partial/git-verify-wrapper.sh"
}

copy_crds() {
  rm -rf "$dir.partial/crds.tmp" && mkdir -p "$dir.partial/crds.tmp"
  install -m 0644 "$(argocd_source)"/manifests/crds/*-crd.yaml "$dir.partial/crds.tmp/"
  mv "$dir.partial/crds.tmp" "$dir.partial/crds"
}

step argocd build_argocd
step kustomize go_install kustomize "sigs.k8s.io/kustomize/kustomize/v5@$kustomize_version"
step helm go_install helm "helm.sh/helm/v4/cmd/helm@$helm_version" \
  "-X helm.sh/helm/v4/internal/version.version=$helm_version"
step git-verify-wrapper.sh copy_git_verify_wrapper
step crds copy_crds
echo "$argocd_version" > "$dir.partial/version"

rm -rf "$dir"
mv "$dir.partial" "$dir"
log "done in $((SECONDS - started))s: $dir"
echo "$dir"
