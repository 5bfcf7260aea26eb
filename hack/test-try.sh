#!/usr/bin/env bash
# Runs the install paths a newcomer is told to try — `make try-helm` and `make try-argocd`
# (hack/try-install.sh), `make try-real-node` and `make try-sticky` (hack/try-real-node.sh)
# — each on a control plane of its own in a temporary state directory, torn down
# afterwards, so that a broken install path fails `make test`.
set -uo pipefail
cd "$(dirname "$0")/.."
passed=0 failed=0

# try NAME COMMAND...: runs COMMAND with TESTENV_DIR set to a fresh state directory,
# reports it, and tears its control plane down.
try() {
  local name="$1" state start
  shift
  state="$(mktemp -d "${TMPDIR:-/tmp}/capo-try-$name.XXXXXX")"
  start=$SECONDS
  if TESTENV_DIR="$state" "$@" >"$state.log" 2>&1; then
    echo "$name: ok ($((SECONDS - start))s)"
    passed=$((passed + 1))
  else
    echo "$name: FAILED ($((SECONDS - start))s); its output:"
    tail -n 60 "$state.log"
    failed=$((failed + 1))
  fi
  make -s testenv-down TESTENV_DIR="$state" >/dev/null 2>&1 || true
  rm -rf "$state" "$state.log"
}

# make try-real-node, then make testenv-down, after which nothing of the real node may be
# left: no process, no mount under the state directory, not the kubernetes Service's
# address.
real_node() {
  local state="$TESTENV_DIR"
  bash hack/try-real-node.sh || return 1
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

# With names (try-helm try-argocd try-real-node try-sticky), only those: the suite runner
# (hack/suite) runs each as a step of its own.
names=("$@")
((${#names[@]})) || names=(try-helm try-argocd try-real-node try-sticky)
for name in "${names[@]}"; do
  case "$name" in
    try-helm) try try-helm bash hack/try-install.sh chart ;;
    try-argocd) try try-argocd bash hack/try-install.sh argocd ;;
    try-real-node) try try-real-node real_node ;;
    try-sticky) try try-sticky bash hack/try-real-node.sh sticky ;;
    *) echo "test-try.sh: no install path $name (try-helm, try-argocd, try-real-node, try-sticky)" >&2; exit 2 ;;
  esac
done

echo "try-installs: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
