#!/usr/bin/env bash
# What a burst of held deletions costs the API server, request by request: a StatefulSet
# of N Pods (default 200, podManagementPolicy Parallel) on the kwok nodes, selected by a
# CapoPolicy, is scaled to 0; kube-apiserver's apiserver_request_total is read before and
# 20 s after the last Pod is gone (so the leader's work for the holds is in it). Each Pod
# goes through a graceful DELETE and kwok's final one, as on a real node.
#
# Runs on its own control plane state (.testenv-calls), with capo's release build.
#   N=500 bash hack/bench-calls.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=hack/lib.sh
source hack/lib.sh

N="${N:-200}"
state=.testenv-calls
cargo build -q --release --bin capo
cargo build -q --bin crdgen
cargo build -q -p capo-testenv
CAPO_TESTENV_BIN="$(bash hack/build-controlplane.sh 2>/dev/null | tail -n1)"
CAPO_CALICO_IPAM="$(bash hack/build-calico-ipam.sh 2>/dev/null | tail -n1)"
export CAPO_TESTENV_BIN CAPO_CALICO_IPAM
eval "$(target/debug/capo-testenv up --state-dir "$state" --calico kubernetes | grep '^export')"
export KUBECONFIG
capo_pid=""
cleanup() {
  [[ -n "$capo_pid" ]] && { kill "$capo_pid" 2>/dev/null; wait "$capo_pid" 2>/dev/null || true; }
  target/debug/capo-testenv down --state-dir "$state" >/dev/null
}
trap cleanup EXIT

kubectl apply --server-side -f config/crd/bases >/dev/null
target/debug/crdgen --calico | kubectl apply -f - >/dev/null 2>&1
kubectl wait --for=condition=Established crd --all --timeout=60s >/dev/null
kubectl create namespace capo-system --dry-run=client -o yaml | kubectl apply -f - >/dev/null
log="$state/capo.log"
target/release/capo run --webhook-addr 127.0.0.1:9443 --probe-addr 127.0.0.1:8081 \
  --self-register-url https://127.0.0.1:9443 --tls-secret capo-webhook-tls >"$log" 2>&1 &
capo_pid=$!
for _ in $(seq 150); do
  curl -fsS http://127.0.0.1:8081/readyz >/dev/null 2>&1 && break
  kill -0 "$capo_pid" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.2
done
sed -e 's/^  reserveFor: .*/  reserveFor: 30m/' -e "s/^  maxReserved: .*/  maxReserved: $((N * 2))/" \
  config/samples/statefulsets.yaml | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Ready capopolicy/statefulsets --timeout=30s >/dev/null
redis_statefulset "$N" Parallel 600s

# resource|subresource|verb|code|count, for what a deletion touches.
requests() {
  kubectl get --raw /metrics | grep '^apiserver_request_total' |
    grep -E 'resource="(pods|ipreservations|reservedips|events|configmaps)"' |
    sed -E 's/.*code="([0-9]+)".*resource="([a-z]+)".*subresource="([a-z]*)".*verb="([A-Z]+)".*\} ([0-9.e+]+)$/\2|\3|\4|\1|\5/'
}
before="$(requests)"
start="$(date +%s.%N)"
kubectl scale -n redis statefulset/redis --replicas=0 >/dev/null
while [[ "$(kubectl get pods -n redis --no-headers 2>/dev/null | wc -l)" != 0 ]]; do sleep 0.2; done
gone="$(date +%s.%N)"
sleep 20
after="$(requests)"
held="$(kubectl get reservedips --no-headers | wc -l)"
python3 - "$N" "$held" "$start" "$gone" "$before" "$after" <<'PY'
import sys
n, held, start, gone, before, after = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
def load(text):
    out = {}
    for line in text.splitlines():
        *key, count = line.split("|")
        out[tuple(key)] = out.get(tuple(key), 0) + float(count)
    return out
b, a = load(before), load(after)
print(f"{n} Pods scaled away in {gone - start:.1f} s; {held} ReservedIPs afterwards")
print("| request | code | count | per Pod |")
print("| --- | --- | --- | --- |")
for key in sorted(a):
    d = a[key] - b.get(key, 0)
    if d > 0:
        resource, sub, verb, code = key
        name = f"{verb} {resource}{'/' + sub if sub else ''}"
        print(f"| {name} | {code} | {int(d)} | {d / n:.2f} |")
PY
