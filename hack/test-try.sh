#!/usr/bin/env bash
# Runs the install paths a newcomer is told to try — `make try-helm` and `make try-argocd`
# (hack/try-install.sh) — each on a control plane of its own in a temporary state
# directory, torn down afterwards, so that a broken install path fails `make test`.
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
echo "try-installs: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
