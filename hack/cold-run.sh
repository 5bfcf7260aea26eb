#!/usr/bin/env bash
# Runs CI as a new machine meets it: a fresh clone of HEAD beside ../shared, with an empty
# XDG cache (capo's builds, Go's build cache), Go module cache, cargo home (registry) and
# target directory, `CI=true bash .ci/run` without stdin. Debian's packages of `make tools`
# stay installed (they are the machine's, not the project's caches). The suite's report
# is copied back to target/suite/report-cold.json, for `make test-report`.
#
#   bash hack/cold-run.sh            (make test-cold; about 40-50 minutes on 2 cores)
#
# Everything it made is removed afterwards, unless KEEP=1.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/capo-cold.XXXXXX")"
cleanup() {
  if [[ -z "${KEEP:-}" ]]; then
    chmod -R u+w "$work" 2>/dev/null || true # the Go module cache is read-only
    rm -rf "$work"
  fi
}
trap cleanup EXIT

mkdir -p "$work/cache" "$work/go" "$work/cargo"
git clone -q "$repo" "$work/capo"
# .ci/run expects ../shared beside the clone.
if [[ -d "$repo/../shared" ]]; then ln -s "$(cd "$repo/../shared" && pwd)" "$work/shared"; fi
echo "cold run of $(git -C "$work/capo" log --oneline -1) in $work"

# cargo and rustup: the toolchain stays where rustup keeps it; only cargo's registry and
# caches start empty. TMPDIR stays the machine's: the real node's containerd puts its
# sockets under the test's state directory there, and a unix socket's path may not be
# longer than 104 bytes.
cargo_bin="$(dirname "$(command -v cargo)")"
start=$SECONDS
status=0
env -i PATH="$cargo_bin:/usr/local/go/bin:$PATH" HOME="$HOME" USER="${USER:-root}" TERM=dumb \
  RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}" CARGO_HOME="$work/cargo" \
  XDG_CACHE_HOME="$work/cache" GOPATH="$work/go" GOMODCACHE="$work/go/pkg/mod" GOCACHE="$work/cache/go-build" \
  CI=true CAPO_SUITE_COMMAND="CI=true bash .ci/run (cold: hack/cold-run.sh)" \
  bash -c 'cd "$0" && bash .ci/run </dev/null' "$work/capo" || status=$?
echo "cold run: .ci/run exited $status after $((SECONDS - start)) s"
mkdir -p "$repo/target/suite"
for f in report.json report.md; do
  [[ -f "$work/capo/target/suite/$f" ]] && cp "$work/capo/target/suite/$f" "$repo/target/suite/cold-$f"
done
if [[ -f "$work/capo/target/suite/report-cold.json" ]]; then
  cp "$work/capo/target/suite/report-cold.json" "$repo/target/suite/report-cold.json"
fi
exit "$status"
