#!/usr/bin/env bash
# Installs capo onto the local control plane the way a platform team would — from the
# Helm chart (`chart`, the default), or with a real Argo CD (`argocd`: Argo CD v3.6 built
# by hack/build-argocd.sh syncs argocd/capo.yaml, then argocd/policies.yaml, from a local
# git repository of this worktree) — and runs capo beside it, outside the cluster (no
# container can run here), exactly as the installed Deployment would: as the installed
# ServiceAccount with nothing but the installed RBAC, called by the API server through
# the installed Service, with its self-managed certificate. Then deletes a Redis Pod and
# shows its IP held; with Argo CD, a commit then removes the policy: Argo CD prunes it
# and the hold stays.
#
#   bash hack/try-install.sh chart|argocd      (make try-helm, make try-argocd)
#
# The control plane (and Argo CD) stay up afterwards (make testenv-down removes them);
# capo stops.
set -euo pipefail
how="${1:-chart}"
case "$how" in chart | argocd) ;; *) echo "usage: $0 chart|argocd" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
state="${TESTENV_DIR:-.testenv}"
[[ "$state" == /* ]] || state="$(pwd)/$state" # relative to the repository, or absolute
port="${CAPO_TRY_PORT:-9443}"
probe="${CAPO_TRY_PROBE_PORT:-8081}"

# shellcheck source=hack/lib.sh
source hack/lib.sh

# A git repository of this worktree's argocd/, config/ and charts/, its Applications'
# repoURL (and the project's sourceRepos) rewritten to it as a fork would; Argo CD reads
# the bare repository through a file:// URL. A new one per run (Argo CD caches what a
# URL's branch pointed at).
git_repo() {
  local dir="$state/git/$(date +%s)"
  rm -rf "$state/git" && mkdir -p "$dir"
  bare="$dir/capo.git" work="$dir/work"
  git init -q --bare -b main "$bare" && git init -q -b main "$work"
  git ls-files -z argocd config charts | xargs -0 cp --parents -t "$work"
  sed -i "s#https://github.com/capo-io/capo.git#file://$bare#" "$work"/argocd/*.yaml
  commit_and_push "capo, as this worktree has it"
  echo "git repository: file://$bare ($(git -C "$work" ls-files | wc -l) files)"
}

commit_and_push() {
  git -C "$work" add -A
  git -C "$work" -c user.name=capo -c user.email=capo@try.invalid -c commit.gpgsign=false commit -q -m "$1"
  git -C "$work" push -q "$bare" main
}

# Waits (up to 3 minutes) until Argo CD reports the Application Synced and Healthy.
wait_app() {
  local now=""
  for _ in $(seq 360); do
    now="$(kubectl -n argocd get application "$1" -o jsonpath='{.status.sync.status}/{.status.health.status}' 2>/dev/null || true)"
    [[ "$now" == Synced/Healthy ]] && return 0
    sleep 0.5
  done
  echo "Application $1 is $now after 3 minutes:"
  kubectl -n argocd get application "$1" -o yaml
  exit 1
}

say "The local control plane"
bash hack/tools.sh
helm="${XDG_CACHE_HOME:-$HOME/.cache}/capo/tools/helm-v3.22.0/helm"
eval "$(make -s testenv-up TESTENV_DIR="$state")"
export KUBECONFIG
# CAPO_PREBUILT: the suite runner's test build made target/debug's binaries already.
[[ -n "${CAPO_PREBUILT:-}" ]] || cargo build -q --workspace --bins
echo "Calico's own IPAM library gives the Pods their IPs and installed Calico's CRDs (kwok plays the kubelets)."

if [[ "$how" == chart ]]; then
  say "capo from the Helm chart (self-managed certificates, the default)"
  run "$helm" upgrade --install capo charts/capo -n capo-system --create-namespace
else
  say "A real Argo CD next to the control plane: redis, repo server, application controller"
  run target/debug/capo-testenv argocd-up --state-dir "$state" --resync 10
  echo "capo's CapoPolicy health check, registered as docs/install.md says:"
  run kubectl -n argocd patch configmap argocd-cm --patch-file argocd/argocd-cm-patch.yaml
  git_repo
  say "Wave 0: the AppProject and the Application capo (argocd/manifests)"
  run kubectl apply -f "$work/argocd/project.yaml" -f "$work/argocd/capo.yaml"
  wait_app capo
  run kubectl -n argocd get applications
  echo "What Argo CD ran, in order (CRDs in wave -2, the controller in -1, the webhook in 0):"
  kubectl -n argocd get application capo -o jsonpath=\
'{range .status.operationState.syncResult.resources[*]}  {.kind}/{.name}: {.message}{"\n"}{end}'
fi
run kubectl -n capo-system get deployment,service,serviceaccount,role -o name
echo "(kwok 'runs' the Deployment's Pods on its fake nodes; no container starts. capo runs below instead.)"

say "capo, outside the cluster, as ServiceAccount capo-system/capo, reached through Service capo-system/capo"
run target/debug/capo-testenv route capo-system/capo "webhook=$port" --state-dir "$state"
sa_kubeconfig="$state/capo-sa.kubeconfig"
cp "$KUBECONFIG" "$sa_kubeconfig"
kubectl --kubeconfig "$sa_kubeconfig" config set-credentials capo-sa \
  --token="$(kubectl -n capo-system create token capo --duration=2h)" >/dev/null
kubectl --kubeconfig "$sa_kubeconfig" config set-context --current --user=capo-sa >/dev/null
log="$state/capo-try.log"
KUBECONFIG="$sa_kubeconfig" POD_NAME=capo-local target/debug/capo run \
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
  kubectl wait --for=condition=Ready capopolicy/statefulsets --timeout=60s >/dev/null
else
  echo "Wave 1: the Application capo-policies (argocd/policies), Healthy once capo has loaded them"
  run kubectl apply -f "$work/argocd/policies.yaml"
  wait_app capo-policies
  run kubectl -n argocd get applications
  kubectl -n argocd get application capo-policies -o jsonpath=\
'{range .status.resources[*]}  {.kind}/{.name}: {.health.status} ({.health.message}){"\n"}{end}'
fi
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

if [[ "$how" == argocd ]]; then
  say "A commit removes the policy: Argo CD prunes it, the hold stays until it is due"
  run git -C "$work" rm -q argocd/policies/statefulsets.yaml
  commit_and_push "drop the statefulsets policy"
  echo "(a refresh, as Argo CD's git webhook would ask for; otherwise Argo CD notices at its next poll)"
  run kubectl -n argocd annotate application capo-policies argocd.argoproj.io/refresh=normal --overwrite
  for _ in $(seq 120); do
    kubectl get capopolicy statefulsets >/dev/null 2>&1 || break
    sleep 0.5
  done
  wait_app capo-policies
  kubectl -n argocd get application capo-policies -o jsonpath=\
'{range .status.operationState.syncResult.resources[*]}  {.kind}/{.name}: {.message}{"\n"}{end}'
  run kubectl get capopolicies
  run kubectl get reservedips
  run target/debug/capo holds --capo-namespace capo-system
  echo "the policy is gone, $old_ip is still held: released when DUE IN says (40m after the Pod is gone), not before"
fi
say "Done. capo stops now; the control plane stays up (make testenv-down)."
