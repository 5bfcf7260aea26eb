# capo — developer entry points. `make help` lists them.
SHELL := /usr/bin/env bash
.DEFAULT_GOAL := help

TESTENV_DIR ?= .testenv
# Calico's datastore in `make testenv-up`: kubernetes (CRDs), etcd (its own etcd, TLS),
# apiserver (CRDs and calico-apiserver serving projectcalico.org/v3 as their view), off.
TESTENV_CALICO ?= kubernetes
# TESTENV_REAL_NODE=1: `make testenv-up` also starts the real node (containerd, a kubelet
# and Calico's CNI plugin; see hack/build-real-node.sh).
TESTENV_REAL_NODE ?=
export KUBECONFIG_TESTENV := $(abspath $(TESTENV_DIR))/kubeconfig

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

# Calico's IPAM driver (hack/calico-ipam: Calico's IPAM library at v3.28.5), the same for
# every Kubernetes version.
CALICO_IPAM_ENV = CAPO_CALICO_IPAM="$$(bash hack/build-calico-ipam.sh 2>/dev/null | tail -n1)" \
  CAPO_CALICO_APISERVER="$$(bash hack/build-calico-apiserver.sh 2>/dev/null | tail -n1)"

.PHONY: controlplane
controlplane: calico-ipam calico-apiserver ## Build (or reuse cached) etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, Calico IPAM and calico-apiserver
	@bash hack/build-controlplane.sh >/dev/null

.PHONY: calico-ipam
calico-ipam: ## Build (or reuse cached) capo-calico-ipam, the test environment's Calico IPAM (v3.28.5)
	@bash hack/build-calico-ipam.sh >/dev/null

.PHONY: calico-apiserver
calico-apiserver: calico-ipam ## Build (or reuse cached) calico-apiserver (v3.28.5), for the calico-apiserver tests and testenv-up TESTENV_CALICO=apiserver
	@bash hack/build-calico-apiserver.sh >/dev/null

.PHONY: real-node
real-node: ## Build (or reuse cached) the real node: kubelet, containerd, Calico's CNI plugin (v3.28.5) and the test images; runc from Debian (make tools)
	@bash hack/build-real-node.sh >/dev/null

.PHONY: argocd
argocd: ## Build (or reuse cached) Argo CD's controller and repo server, kustomize and helm for the GitOps tests
	@bash hack/build-argocd.sh >/dev/null

.PHONY: crds
crds: ## Regenerate the CRD YAML (config/crd/bases, charts/capo/crds) and config/webhook from the code
	cargo run -q --bin crdgen

.PHONY: chart-readme
chart-readme: ## Regenerate charts/capo/README.md from values.yaml
	CAPO_REGENERATE=1 cargo test -q --test chart the_chart_readme_is_generated_from_the_values

.PHONY: manifests
manifests: crds ## Regenerate the generated manifests and deploy/capo.yaml (kubectl kustomize config/default)
	kubectl kustomize config/default > deploy/capo.yaml

.PHONY: lint
lint: ## cargo fmt --check and clippy -D warnings
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

.PHONY: tools
tools: ## Install lua5.1 and promtool (Debian packages) if missing
	@bash hack/tools.sh

# The oldest Kubernetes capo supports (its webhook needs matchConditions, GA in 1.30).
COMPAT_K8S ?= 1.30

.PHONY: test
test: test-latest test-compat ## Run every test (unit, drift, integration) on Kubernetes 1.35, then on the oldest supported (1.30)

.PHONY: test-latest
test-latest: controlplane argocd real-node tools ## Run every test on the default control plane (Kubernetes 1.35), the GitOps suite, the real node and the try-install paths included
	CAPO_TESTENV_BIN="$$(bash hack/build-controlplane.sh 2>/dev/null | tail -n1)" $(CALICO_IPAM_ENV) \
	  CAPO_ARGOCD_DIR="$$(bash hack/build-argocd.sh 2>/dev/null | tail -n1)" \
	  CAPO_REAL_NODE="$$(bash hack/build-real-node.sh 2>/dev/null | tail -n1)" \
	  CAPO_IMAGE="$$(cargo test --workspace --no-run >&2 && CAPO_BIN=target/debug/capo bash hack/build-image.sh | tail -n1)" \
	  cargo test --workspace
	CAPO_IMAGE="$$(CAPO_BIN=target/debug/capo bash hack/build-image.sh | tail -n1)" bash hack/test-try.sh

.PHONY: test-try
test-try: controlplane argocd real-node tools ## Run make try-helm, make try-argocd, make try-real-node and make try-sticky as a newcomer would (each on its own control plane, torn down after)
	CAPO_IMAGE="$$(CAPO_IMAGE_PROFILE=dev bash hack/build-image.sh | tail -n1)" bash hack/test-try.sh

.PHONY: test-compat
# The GitOps suite (tests/gitops.rs, a real Argo CD) and the real node (tests/real_node.rs,
# its kubelet built for the default Kubernetes) run in test-latest only; here their tests
# say they are skipped.
test-compat: tools calico-ipam calico-apiserver ## Run every test on the oldest Kubernetes capo supports (COMPAT_K8S, default 1.30), but the GitOps suite and the real node
	@CAPO_K8S=$(COMPAT_K8S) bash hack/build-controlplane.sh >/dev/null
	CAPO_TESTENV_BIN="$$(CAPO_K8S=$(COMPAT_K8S) bash hack/build-controlplane.sh 2>/dev/null | tail -n1)" $(CALICO_IPAM_ENV) \
	  CAPO_SKIP_GITOPS=1 CAPO_SKIP_REAL_NODE=1 cargo test --workspace

.PHONY: bench
bench: controlplane ## Measure the admission path end to end on the local control plane; writes docs/performance.md
	CAPO_TESTENV_BIN="$$(bash hack/build-controlplane.sh 2>/dev/null | tail -n1)" $(CALICO_IPAM_ENV) cargo bench --bench e2e

.PHONY: bench-calico
bench-calico: controlplane ## Measure Calico AutoAssign latency against reserved entries (one object vs shards) on a private control plane
	bash hack/bench-calico.sh

.PHONY: bench-calls
bench-calls: controlplane ## Count the API requests a burst of held deletions costs (a StatefulSet of N=200 scaled to 0), per Pod
	bash hack/bench-calls.sh

.PHONY: testenv-up
testenv-up: controlplane $(if $(TESTENV_REAL_NODE),real-node tools) ## Start the local control plane (TESTENV_REAL_NODE=1: with the real node); prints the export KUBECONFIG line
	@cargo build -q -p capo-testenv
	@CAPO_TESTENV_BIN="$$(bash hack/build-controlplane.sh 2>/dev/null | tail -n1)" $(CALICO_IPAM_ENV) \
	  $(if $(TESTENV_REAL_NODE),CAPO_REAL_NODE="$$(bash hack/build-real-node.sh 2>/dev/null | tail -n1)") \
	  $(if $(TESTENV_REAL_NODE),CAPO_IMAGE="$${CAPO_IMAGE:-$$(CAPO_IMAGE_PROFILE=dev bash hack/build-image.sh | tail -n1)}") \
	  target/debug/capo-testenv up --state-dir $(TESTENV_DIR) --calico $(TESTENV_CALICO) $(if $(TESTENV_REAL_NODE),--real-node)

.PHONY: testenv-down
testenv-down: ## Stop the local control plane and remove its state
	@cargo build -q -p capo-testenv
	@target/debug/capo-testenv down --state-dir $(TESTENV_DIR)

.PHONY: demo
demo: controlplane ## Bring up the control plane, run capo, delete a Redis Pod and show its IP held
	bash hack/demo.sh

.PHONY: try-helm
try-helm: controlplane ## Install capo from the Helm chart onto the local control plane and run it as its ServiceAccount
	bash hack/try-install.sh chart

.PHONY: try-real-node
try-real-node: controlplane real-node tools ## capo's own image on the real node: installed by its chart (two replicas), a StatefulSet Pod deleted, its IP held before Calico's CNI DEL
	bash hack/try-real-node.sh

.PHONY: try-sticky
try-sticky: controlplane real-node tools ## try-real-node with a sticky policy: redis-0 deleted and recreated on the real node gets its old address back
	bash hack/try-real-node.sh sticky

.PHONY: image
image: ## Build capo's image (release) without a container engine: an OCI archive (ctr/podman/docker load); prints its path
	@bash hack/build-image.sh | tail -n1

.PHONY: try-argocd
try-argocd: controlplane argocd ## A real Argo CD syncs capo and its policies (argocd/) from a local git repository onto the local control plane
	bash hack/try-install.sh argocd
