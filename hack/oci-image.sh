#!/usr/bin/env bash
# Packs a root filesystem into a single-layer image archive, without a container engine:
# an OCI image layout (oci-layout, index.json, blobs/sha256) that also carries Docker's
# manifest.json, so `ctr images import`, `podman load` and `docker load` all take it.
# Reproducible: files sorted, every file owned by 0:0, every timestamp 0, gzip without a
# name or time; the same rootfs gives the same bytes (and digests).
#
#   hack/oci-image.sh ROOTFS NAME:TAG OUT.tar ENTRYPOINT [USER]
#
# ENTRYPOINT is a JSON array (e.g. '["/capo"]'); USER e.g. 65532:65532.
set -euo pipefail

rootfs="$1" ref="$2" out="$3" entrypoint="$4" user="${5:-0:0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/blobs/sha256"

blob() { # FILE -> moves it into blobs/sha256, prints its digest
  local d
  d="$(sha256sum "$1" | cut -d' ' -f1)"
  mv "$1" "$work/blobs/sha256/$d"
  echo "$d"
}
size() { stat -c %s "$work/blobs/sha256/$1"; }

tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$rootfs" -cf "$work/layer.tar" .
diff_id="$(sha256sum "$work/layer.tar" | cut -d' ' -f1)"
gzip -n -9 <"$work/layer.tar" >"$work/layer.tar.gz"
rm "$work/layer.tar"
layer="$(blob "$work/layer.tar.gz")"

printf '{"architecture":"amd64","os":"linux","config":{"User":"%s","Entrypoint":%s,"Env":["PATH=/usr/local/bin:/usr/bin:/bin"],"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created_by":"hack/oci-image.sh"}]}' \
  "$user" "$entrypoint" "$diff_id" >"$work/config.json"
config="$(blob "$work/config.json")"

printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
  "$config" "$(size "$config")" "$layer" "$(size "$layer")" >"$work/manifest"
manifest="$(blob "$work/manifest")"

printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
  "$manifest" "$(size "$manifest")" "$ref" "${ref##*:}" >"$work/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$work/oci-layout"
printf '[{"Config":"blobs/sha256/%s","RepoTags":["%s"],"Layers":["blobs/sha256/%s"]}]' \
  "$config" "$ref" "$layer" >"$work/manifest.json"

tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work" \
    -cf "$out.tmp" oci-layout index.json manifest.json blobs
mv "$out.tmp" "$out"
