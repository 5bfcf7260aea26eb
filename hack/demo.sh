#!/usr/bin/env bash
# The capo demo on the local control plane: a Redis StatefulSet Pod is deleted, capo
# holds its IP in a Calico IPReservation before the API server lets the deletion
# proceed, and the recreated Pod comes back with a new IP.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=hack/lib.sh
source hack/lib.sh

say "Local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)"
eval "$(make -s testenv-up)"
export KUBECONFIG
echo "KUBECONFIG=$KUBECONFIG"
run kubectl get nodes

say "capo's CRDs, and Calico's IPReservation CRDs (no Calico here; kwok plays the kubelets)"
cargo build -q --bin capo --bin crdgen
kubectl apply -f config/crd/bases >/dev/null
target/debug/crdgen --calico | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Established crd --all --timeout=60s >/dev/null
run kubectl get crd

say "capo, serving its webhook at https://127.0.0.1:9443 (self-registered), and leading"
kubectl create namespace capo-system --dry-run=client -o yaml | kubectl apply -f - >/dev/null
log="$(pwd)/.testenv/capo.log"
target/debug/capo run --webhook-addr 127.0.0.1:9443 --probe-addr 127.0.0.1:8081 \
  --self-register-url https://127.0.0.1:9443 --tls-secret capo-webhook-tls >"$log" 2>&1 &
capo_pid=$!
trap 'kill $capo_pid 2>/dev/null; wait $capo_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -fsS http://127.0.0.1:8081/readyz >/dev/null 2>&1 && break
  kill -0 $capo_pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.2
done
echo "capo is ready (log: $log)"
echo "It made its own CA and serving certificate (renewed and rotated before they expire)"
echo "and wrote the CA into its webhook configuration, so the API server trusts it:"
run kubectl -n capo-system get secret capo-webhook-tls -L app.kubernetes.io/managed-by
show_ca_bundle

say "A CapoPolicy: StatefulSet Pods in namespaces labelled ip-reserve=enabled"
echo "(for the demo the hold lasts 20s instead of the sample's 40m, so you can watch it end)"
sed 's/^  reserveFor: .*/  reserveFor: 20s/' config/samples/statefulsets.yaml | kubectl apply -f - >/dev/null
run kubectl get capopolicy statefulsets -o jsonpath='{.metadata.name}: reserveFor={.spec.reserveFor} maxReserved={.spec.maxReserved}{"\n"}'
kubectl wait --for=condition=Ready capopolicy/statefulsets --timeout=30s >/dev/null
run kubectl get capopolicies

say "A Redis StatefulSet on the kwok nodes"
redis_statefulset 3
run kubectl get pods -n redis -o wide

say "Ask capo what deleting redis-0 would do (the webhook's own rule, on the live cluster)"
run target/debug/capo explain redis/redis-0

old_ip="$(kubectl get pod -n redis redis-0 -o jsonpath='{.status.podIP}')"
old_uid="$(kubectl get pod -n redis redis-0 -o jsonpath='{.metadata.uid}')"
say "Delete redis-0 (IP $old_ip): capo answers the API server only once the IP is held"
run kubectl delete pod -n redis redis-0

say "The StatefulSet recreates redis-0; it gets a new IP"
for _ in $(seq 150); do
  uid="$(kubectl get pod -n redis redis-0 -o jsonpath='{.metadata.uid}' 2>/dev/null || true)"
  ip="$(kubectl get pod -n redis redis-0 -o jsonpath='{.status.podIP}' 2>/dev/null || true)"
  if [[ -n "$uid" && "$uid" != "$old_uid" && -n "$ip" && "$ip" != "$old_ip" ]]; then break; fi
  sleep 0.2
done
run kubectl get pods -n redis -o wide

say "The old IP in capo's Calico IPReservation, and capo's record of it"
run kubectl get ipreservations.crd.projectcalico.org capo-statefulsets -o jsonpath='{.metadata.name}: {.spec.reservedCIDRs}{"\n"}'
run kubectl get reservedips

new_ip="$(kubectl get pod -n redis redis-0 -o jsonpath='{.status.podIP}')"
if [[ "$new_ip" == "$old_ip" ]]; then
  echo "unexpected: redis-0 got its old IP back" >&2
  exit 1
fi
echo
echo "redis-0: $old_ip -> $new_ip; $old_ip stays held until its TTL runs out."

say "The leader counts the hold down from the moment the old Pod was gone (capo holds, capo explain)"
run target/debug/capo holds
run target/debug/capo explain redis/redis-0
for _ in $(seq 60); do
  kubectl get reservedip "$old_ip" >/dev/null 2>&1 || break
  sleep 5
  target/debug/capo holds | sed -n "1p;/^$old_ip /p"
done

say "Released: the entry left the IPReservation and the record is gone"
run target/debug/capo holds
run kubectl get ipreservations.crd.projectcalico.org capo-statefulsets -o jsonpath='{.metadata.name}: {.spec.reservedCIDRs}{"\n"}'
if kubectl get reservedip "$old_ip" >/dev/null 2>&1; then
  echo "unexpected: $old_ip is still held" >&2
  exit 1
fi
grep "released" "$log" | tail -n 3 || true
echo "The control plane keeps running: export KUBECONFIG=$KUBECONFIG; 'make testenv-down' stops it."
