#!/usr/bin/env bash
# capo as a cluster runs it, on the local control plane's real node (containerd, a real
# kubelet, Calico's own CNI plugin): capo's own image (hack/build-image.sh), installed by
# its Helm chart with two replicas; a StatefulSet Pod on the real node deleted with
# kubectl; its address held before the kubelet stops it and Calico's CNI DEL frees it, and
# the recreated Pod given another by Calico's CNI ADD.
#
#   bash hack/try-real-node.sh          (make try-real-node)
#   bash hack/try-real-node.sh sticky   (make try-sticky: the policy opts in to sticky
#                                        IPs, and the recreated Pod gets its address back)
#
# CAPO_IMAGE: an archive of capo's image to use (default: hack/build-image.sh with
# CAPO_IMAGE_PROFILE=dev, quick after a debug build; `make image` builds the release one).
# The control plane and capo stay up afterwards (make testenv-down removes them).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-hold}"
[[ "$mode" == hold || "$mode" == sticky ]] || { echo "usage: $0 [hold|sticky]" >&2; exit 2; }
state="${TESTENV_DIR:-.testenv}"
[[ "$state" == /* ]] || state="$(pwd)/$state"

# shellcheck source=hack/lib.sh
source hack/lib.sh

say "The local control plane, with a real node beside the kwok node"
bash hack/tools.sh
helm="${XDG_CACHE_HOME:-$HOME/.cache}/capo/tools/helm-v3.22.0/helm"
export CAPO_IMAGE="${CAPO_IMAGE:-$(CAPO_IMAGE_PROFILE=dev bash hack/build-image.sh | tail -n1)}"
eval "$(make -s testenv-up TESTENV_DIR="$state" TESTENV_REAL_NODE=1)"
export KUBECONFIG
run kubectl get nodes -L type
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
echo "capo's image capo.local/capo:$version ($(stat -c %s "$CAPO_IMAGE") bytes, built without a container engine)"
echo "is in the real node's containerd, beside the test workload's."

say "capo from its Helm chart, from its own image, two replicas on the real node"
run "$helm" upgrade --install capo charts/capo -n capo-system --create-namespace \
  --set "image.repository=capo.local/capo,image.tag=$version,image.pullPolicy=Never" \
  --set replicaCount=2,nodeSelector.type=real,logFormat=text
if ! kubectl -n capo-system rollout status deployment/capo --timeout=180s; then
  kubectl -n capo-system get pods -o wide
  kubectl -n capo-system get events
  kubectl -n capo-system logs -l app.kubernetes.io/name=capo --tail=40 || true
  exit 1
fi
run kubectl -n capo-system get pods -o wide
echo "leader (Lease capo-system/capo): $(kubectl -n capo-system get lease capo -o jsonpath='{.spec.holderIdentity}')"
run kubectl -n capo-system get endpointslices -l kubernetes.io/service-name=capo
show_ca_bundle

say "A CapoPolicy selecting StatefulSet Pods in namespaces labelled ip-reserve=enabled"
run kubectl apply --server-side -f config/samples/statefulsets.yaml
kubectl wait --for=condition=Ready capopolicy/statefulsets --timeout=60s >/dev/null
if [[ "$mode" == sticky ]]; then
  say "Opt the policy in to sticky IPs: a recreated StatefulSet Pod gets its held address back"
  run kubectl patch capopolicy statefulsets --type merge -p '{"spec":{"sticky":{"enabled":true,"fallbackAfter":"90s"}}}'
  kubectl wait --for=condition=Ready capopolicy/statefulsets --timeout=60s >/dev/null
  run kubectl get mutatingwebhookconfiguration capo
fi
run kubectl get capopolicies

say "A StatefulSet on the real node (a TCP listener standing in for Redis)"
kubectl create namespace redis --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl label namespace redis ip-reserve=enabled --overwrite >/dev/null
kubectl apply -n redis -f - >/dev/null <<'YAML'
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: redis}
spec:
  serviceName: redis
  replicas: 1
  selector: {matchLabels: {app: redis}}
  template:
    metadata: {labels: {app: redis}}
    spec:
      nodeSelector: {kubernetes.io/hostname: real-node-0}
      terminationGracePeriodSeconds: 5
      containers:
      - name: listen
        image: capo.local/listen:1
        imagePullPolicy: Never
        env: [{name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]
        ports: [{containerPort: 6379}]
        readinessProbe: {tcpSocket: {port: 6379}, periodSeconds: 1}
YAML
kubectl rollout status -n redis statefulset/redis --timeout=90s >/dev/null
old_ip="$(kubectl -n redis get pod redis-0 -o jsonpath='{.status.podIP}')"
old_uid="$(kubectl -n redis get pod redis-0 -o jsonpath='{.metadata.uid}')"
echo "redis-0 has $old_ip from Calico's CNI ADD"

say "Delete redis-0: the API server asks capo, through its Service, before the kubelet stops it"
run kubectl -n redis delete pod redis-0 --wait=false
run kubectl get reservedips
if ! kubectl get reservedips -o jsonpath='{range .items[*]}{.spec.ip}{"\n"}{end}' | grep -qFx "$old_ip"; then
  echo "capo did not hold $old_ip; its logs:"
  kubectl -n capo-system logs -l app.kubernetes.io/name=capo --tail=40
  exit 1
fi
new_ip=""
for _ in $(seq 180); do
  uid="$(kubectl -n redis get pod redis-0 -o jsonpath='{.metadata.uid}' 2>/dev/null || true)"
  ready="$(kubectl -n redis get pod redis-0 -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null || true)"
  if [[ -n "$uid" && "$uid" != "$old_uid" && "$ready" == True ]]; then
    new_ip="$(kubectl -n redis get pod redis-0 -o jsonpath='{.status.podIP}')"
    break
  fi
  sleep 0.5
done
[[ -n "$new_ip" ]] || { echo "the recreated redis-0 did not become Ready"; exit 1; }
echo "Calico's CNI plugin (its log, $state/real-node/cni/calico.log):"
grep -E "Releasing address using handleID|IPAM assigned addresses|Calico CNI IPAM request IP" \
  "$state/real-node/cni/calico.log" | cut -c1-160 || true
if [[ "$mode" == hold ]]; then
  echo "the recreated redis-0 has $new_ip; $old_ip stays held until it is due:"
  [[ "$new_ip" != "$old_ip" ]] || { echo "redis-0 got its old address $old_ip back"; exit 1; }
  run kubectl get reservedips
else
  echo "the recreated redis-0 has $new_ip, its old address: capo named it in the Pod's annotations"
  [[ "$new_ip" == "$old_ip" ]] || { echo "redis-0 got $new_ip, not its old address $old_ip"; exit 1; }
  run kubectl -n redis get pod redis-0 -o jsonpath='{.metadata.annotations}{"\n"}'
  echo "the hold ends once the Pod shows its address (reason sticky):"
  for _ in $(seq 60); do
    kubectl get reservedips -o jsonpath='{range .items[*]}{.spec.ip}{"\n"}{end}' | grep -qFx "$old_ip" || break
    sleep 0.5
  done
  if kubectl get reservedips -o jsonpath='{range .items[*]}{.spec.ip}{"\n"}{end}' | grep -qFx "$old_ip"; then
    echo "the hold of $old_ip did not end"; kubectl get reservedips; exit 1
  fi
  run kubectl get reservedips
  echo "capo's logs say so:"
  kubectl -n capo-system logs -l app.kubernetes.io/name=capo --tail=200 2>/dev/null | grep -i sticky | cut -c1-200 || true
fi

say "Done. capo keeps running on the real node; make testenv-down stops it all."
