# Shared by hack/demo.sh and hack/try-install.sh: printing, and the steps both show.

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }

# Waits (up to 10 s) until capo has written its CA into ValidatingWebhookConfiguration
# capo, and says how much.
show_ca_bundle() {
  local bundle=""
  for _ in $(seq 50); do
    bundle="$(kubectl get validatingwebhookconfiguration capo -o jsonpath='{.webhooks[0].clientConfig.caBundle}')"
    [[ -n "$bundle" ]] && break
    sleep 0.2
  done
  printf 'caBundle of ValidatingWebhookConfiguration capo: %s bytes\n' "${#bundle}"
}

# A Redis StatefulSet of $1 replicas in namespace redis (labelled ip-reserve=enabled),
# on the kwok nodes; returns once it is rolled out. $2: its podManagementPolicy
# (default OrderedReady, as Kubernetes'); $3: how long the rollout may take (default 90s).
redis_statefulset() {
  kubectl create namespace redis --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  kubectl label namespace redis ip-reserve=enabled --overwrite >/dev/null
  kubectl apply -n redis -f - >/dev/null <<YAML
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: redis}
spec:
  serviceName: redis
  replicas: $1
  podManagementPolicy: ${2:-OrderedReady}
  selector: {matchLabels: {app: redis}}
  template:
    metadata: {labels: {app: redis}}
    spec:
      tolerations: [{operator: Exists}]
      containers: [{name: redis, image: redis:7}]
YAML
  kubectl rollout status -n redis statefulset/redis --timeout="${3:-90s}" >/dev/null
}
