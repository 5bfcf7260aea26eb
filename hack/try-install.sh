#!/usr/bin/env bash
# Installs capo onto the local control plane the way a platform team would — from the
# Helm chart (`chart`, the default) or from what capo's Argo CD Applications sync
# (`argocd`: argocd/manifests, then the policies folder argocd/policies) — and runs capo
# beside it, outside the cluster (no container can run here), exactly as the installed
# Deployment would: as the installed ServiceAccount with nothing but the installed RBAC,
# called by the API server through the installed Service, with its self-managed
# certificate. Then deletes a Redis Pod and shows its IP held.
#
#   bash hack/try-install.sh chart|argocd      (make try-helm, make try-argocd)
#
# The control plane stays up afterwards (make testenv-down removes it); capo stops.
set -euo pipefail
how="${1:-chart}"
case "$how" in chart | argocd) ;; *) echo "usage: $0 chart|argocd" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
state="${TESTENV_DIR:-.testenv}"
port="${CAPO_TRY_PORT:-9443}"
probe="${CAPO_TRY_PROBE_PORT:-8081}"

# shellcheck source=hack/lib.sh
source hack/lib.sh

say "The local control plane"
bash hack/tools.sh
helm="${XDG_CACHE_HOME:-$HOME/.cache}/capo/tools/helm-v3.22.0/helm"
eval "$(make -s testenv-up TESTENV_DIR="$state")"
export KUBECONFIG
cargo build -q --workspace --bins
echo "Calico is not here: its IPReservation CRDs stand in (kwok plays the kubelets)."
target/debug/crdgen --calico | kubectl apply --server-side -f - >/dev/null

if [[ "$how" == chart ]]; then
  say "capo from the Helm chart (self-managed certificates, the default)"
  run "$helm" upgrade --install capo charts/capo -n capo-system --create-namespace
else
  say "capo as Argo CD syncs it: argocd/manifests (CRDs, controller, webhook), then argocd/policies"
  echo "(no Argo CD here: kubectl applies what the Applications capo and capo-policies sync, in their waves)"
  run kubectl apply --server-side -k argocd/manifests
  kubectl wait --for=condition=Established crd/capopolicies.capo.io --timeout=60s >/dev/null
  run kubectl apply --server-side -f argocd/policies/
fi
run kubectl -n capo-system get deployment,service,serviceaccount,role -o name
echo "(kwok 'runs' the Deployment's Pods on its fake nodes; no container starts. capo runs below instead.)"

say "capo, outside the cluster, as ServiceAccount capo-system/capo, reached through Service capo-system/capo"
run target/debug/capo-testenv route capo-system/capo "webhook=$port" --state-dir "$state"
sa_kubeconfig="$(pwd)/$state/capo-sa.kubeconfig"
cp "$KUBECONFIG" "$sa_kubeconfig"
kubectl --kubeconfig "$sa_kubeconfig" config set-credentials capo-sa \
  --token="$(kubectl -n capo-system create token capo --duration=2h)" >/dev/null
kubectl --kubeconfig "$sa_kubeconfig" config set-context --current --user=capo-sa >/dev/null
log="$(pwd)/$state/capo-try.log"
KUBECONFIG="$sa_kubeconfig" POD_NAME=capo-local target/debug/capo \
  --namespace capo-system --tls-secret capo-webhook-tls \
  --webhook-addr "0.0.0.0:$port" --probe-addr "127.0.0.1:$probe" >"$log" 2>&1 &
capo_pid=$!
trap 'kill $capo_pid 2>/dev/null; wait $capo_pid 2>/dev/null || true' EXIT
for _ in $(seq 150); do
  curl -fsS "http://127.0.0.1:$probe/readyz" >/dev/null 2>&1 && break
  kill -0 $capo_pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$probe/readyz" >/dev/null || { echo "capo did not become ready:"; cat "$log"; exit 1; }
echo "capo is ready (log: $log)"
run kubectl -n capo-system get secret capo-webhook-tls -L app.kubernetes.io/managed-by
show_ca_bundle

say "A CapoPolicy selecting StatefulSet Pods in namespaces labelled ip-reserve=enabled"
if [[ "$how" == chart ]]; then
  run kubectl apply --server-side -f config/samples/statefulsets.yaml
fi
kubectl wait --for=condition=Ready capopolicy/statefulsets --timeout=60s >/dev/null
run kubectl get capopolicies

say "A Redis StatefulSet on the kwok nodes"
redis_statefulset 1
old_ip="$(kubectl -n redis get pod redis-0 -o jsonpath='{.status.podIP}')"
echo "redis-0 has IP $old_ip"

say "Delete redis-0: the API server asks capo (through the Service, over TLS) first"
run kubectl -n redis delete pod redis-0 --wait=false
run kubectl get reservedips
held="$(kubectl get reservedips -o jsonpath='{range .items[*]}{.spec.ip}{"\n"}{end}' | grep -Fx "$old_ip" || true)"
if [[ -z "$held" ]]; then
  echo "capo did not hold $old_ip; its log:"; cat "$log"; exit 1
fi
echo "held: $old_ip, written by capo as its ServiceAccount with the installed RBAC only"
say "Done. capo stops now; the control plane stays up (make testenv-down)."
