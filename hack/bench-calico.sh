#!/usr/bin/env bash
# What capo's holds cost Calico: AutoAssign latency (Calico's IPAM library, v3.28.5)
# against the number of reserved /32 entries, in one IPReservation object or in shards,
# on a private control plane of its own (nothing else assigns addresses there).
#
#   bash hack/bench-calico.sh                       # the table in docs/performance.md
#   CALICO_DATASTORE=etcd bash hack/bench-calico.sh # Calico's etcd datastore instead
#   bash hack/bench-calico.sh --sizes 0,1000 --samples 10   # flags of `capo-calico-ipam bench`
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CAPO_TESTENV_BIN="$(bash hack/build-controlplane.sh 2>/dev/null | tail -n1)"
CAPO_CALICO_IPAM="$(bash hack/build-calico-ipam.sh 2>/dev/null | tail -n1)"
export CAPO_TESTENV_BIN CAPO_CALICO_IPAM
cargo build -q -p capo-testenv
state="$(mktemp -d)/testenv"
trap 'target/debug/capo-testenv down --state-dir "$state" >/dev/null 2>&1 || true' EXIT
target/debug/capo-testenv up --state-dir "$state" --calico "${CALICO_DATASTORE:-kubernetes}" >/dev/null
if [[ -f "$state/calico-etcd.env" ]]; then
  # shellcheck disable=SC1091
  source "$state/calico-etcd.env"
fi
echo "# $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), datastore ${CALICO_DATASTORE:-kubernetes}" >&2
"$CAPO_CALICO_IPAM/bin/capo-calico-ipam" bench --kubeconfig "$state/kubeconfig" --host kwok-node-1 "$@"
