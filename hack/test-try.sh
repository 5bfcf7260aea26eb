#!/usr/bin/env bash
# Runs the install paths a newcomer is told to try — `make try-helm` and `make try-argocd`
# (hack/try-install.sh) — each on a control plane of its own in a temporary state
# directory, torn down afterwards, so that a broken install path fails `make test` — and
# `make try-real-node` (hack/try-real-node.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
passed=0 failed=0
for how in chart argocd; do
  state="$(mktemp -d "${TMPDIR:-/tmp}/capo-try-$how.XXXXXX")"
  log="$state.log"
  start=$SECONDS
  if TESTENV_DIR="$state" bash hack/try-install.sh "$how" >"$log" 2>&1; then
    echo "try-install $how: ok ($((SECONDS - start))s)"
    passed=$((passed + 1))
  else
    echo "try-install $how: FAILED ($((SECONDS - start))s); its output:"
    tail -n 60 "$log"
    failed=$((failed + 1))
  fi
  make -s testenv-down TESTENV_DIR="$state" >/dev/null 2>&1 || true
  rm -rf "$state" "$log"
done
# make try-real-node (capo's image, its chart, a held deletion on the real node), then
# make testenv-down, after which nothing of the real node may be left: no process, no
# mount under the state directory, not the kubernetes Service's address.
real_node() {
  local state="$1"
  TESTENV_DIR="$state" bash hack/try-real-node.sh || return 1
  make -s testenv-down TESTENV_DIR="$state" || return 1
  if grep -q " $state" /proc/self/mountinfo; then
    echo "mounts left under $state:"; grep " $state" /proc/self/mountinfo; return 1
  fi
  if pgrep -f "$state" >/dev/null; then
    echo "processes left:"; pgrep -af "$state"; return 1
  fi
  if ip -o addr show dev lo | grep -q " 10\.0\.0\.1/"; then
    echo "the kubernetes Service's address is left on lo:"; ip -o addr show dev lo; return 1
  fi
}
state="$(mktemp -d "${TMPDIR:-/tmp}/capo-try-real-node.XXXXXX")"
start=$SECONDS
if real_node "$state" >"$state.log" 2>&1; then
  echo "try-real-node: ok ($((SECONDS - start))s)"
  passed=$((passed + 1))
else
  echo "try-real-node: FAILED ($((SECONDS - start))s); its output:"
  tail -n 60 "$state.log"
  failed=$((failed + 1))
fi
make -s testenv-down TESTENV_DIR="$state" >/dev/null 2>&1 || true
rm -rf "$state" "$state.log"

echo "try-installs: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
