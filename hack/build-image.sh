#!/usr/bin/env bash
# capo's image, built without a container engine: the Dockerfile's recipe (a release build
# of capo on the C runtime distroless/cc-debian12 ships, run as 65532:65532) assembled from
# Debian packages and packed by hack/oci-image.sh.
#
#   hack/build-image.sh            prints the archive's path on its last line
#
# CAPO_IMAGE_PROFILE=dev packs the debug build instead (make try-real-node does: quick
# after any debug build; same recipe, larger binary). CAPO_BIN=PATH packs a binary built
# already (make test packs the one its test build made: a release build costs CI minutes).
#
# The root filesystem: /capo; libc6 and libgcc-s1 at the versions this machine builds
# against (the binary's glibc symbols come from them), unpacked with dpkg-deb -x (no
# maintainer scripts run); /etc/passwd and /etc/group with root and nonroot (65532) as
# distroless has them; an empty /tmp (mode 1777). No shell, no package manager, no CA
# bundle (capo trusts only the CAs it is given: the API server's and Calico etcd's).
#
# The archive is cached under ${XDG_CACHE_HOME:-~/.cache}/capo/image/, keyed by the
# binary's and packages' digests; the same inputs give the same bytes.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/capo/image"
log() { echo "build-image: $*" >&2; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)"
ref="capo.local/capo:$version"

profile="${CAPO_IMAGE_PROFILE:-release}"
case "$profile" in
  release) dir=release ;;
  dev) dir=debug ;;
  *) log "CAPO_IMAGE_PROFILE is release or dev, not $profile"; exit 2 ;;
esac
if [[ -n "${CAPO_BIN:-}" ]]; then
  bin="$CAPO_BIN" profile=prebuilt
else
  start=$SECONDS
  (cd "$repo" && cargo build --profile "$profile" --locked --bin capo --quiet)
  bin="$repo/target/$dir/capo"
  log "cargo build --profile $profile: $((SECONDS - start)) s"
fi

mkdir -p "$cache/debs"
debs=()
for pkg in libc6 libgcc-s1; do
  ver="$(dpkg-query -W -f='${Version}' "$pkg")"
  file="$(ls "$cache/debs/${pkg}_"*"_amd64.deb" 2>/dev/null | grep -F "_${ver//:/%3a}_" | head -n1 || true)"
  if [[ -z "$file" ]]; then
    if ! (cd "$cache/debs" && apt-get download -qq -o APT::Sandbox::User=root "$pkg=$ver" >/dev/null 2>&1); then
      # A fresh machine may have no package lists yet.
      sudo=""
      [[ $(id -u) -eq 0 ]] || sudo=sudo
      $sudo apt-get update -qq >/dev/null
      (cd "$cache/debs" && apt-get download -qq -o APT::Sandbox::User=root "$pkg=$ver" >/dev/null)
    fi
    file="$(ls "$cache/debs/${pkg}_"*"_amd64.deb" | grep -F "_${ver//:/%3a}_" | head -n1)"
  fi
  debs+=("$file")
done

key="$( (sha256sum "$bin" "$here/oci-image.sh" "$0" | cut -d' ' -f1; for d in "${debs[@]}"; do sha256sum "$d" | cut -d' ' -f1; done) | sha256sum | cut -c1-12)"
out="$cache/capo-$version-$profile-$key.tar"
if [[ ! -e "$out" ]]; then
  rm -f "$cache/capo-"*"-$profile-"*.tar # one archive per profile is kept
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  for d in "${debs[@]}"; do dpkg-deb -x "$d" "$root"; done
  # Documentation, locale data and iconv modules the runtime never reads.
  rm -rf "$root/usr/share/doc" "$root/usr/share/lintian" "$root/usr/share/locale" "$root/usr/share/gcc" \
    "$root/usr/lib/x86_64-linux-gnu/gconv" # iconv modules: capo converts no character sets
  install -m 0755 "$bin" "$root/capo"
  mkdir -p "$root/etc" "$root/tmp" "$root/home/nonroot"
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
  bash "$here/oci-image.sh" "$root" "$ref" "$out" '["/capo"]' 65532:65532
  log "packed $ref ($(stat -c %s "$out") bytes; capo $(stat -c %s "$bin") bytes)"
fi
echo "$out"
