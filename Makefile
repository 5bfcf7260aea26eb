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

# The suite runner (hack/suite): the builds, lint, every test binary on Kubernetes 1.35 and
# on the oldest supported (1.30), and the try-install paths, as many at once as fit
# (CAPO_SUITE_JOBS), ending with a table of where the time went (target/suite/report.md).
SUITE := target/debug/capo-suite

.PHONY: suite
suite:
	@cargo build -q -p capo-suite

.PHONY: test
test: suite ## Run every test (lint, unit, drift, integration on Kubernetes 1.35 and 1.30, try-install paths); ends with where the time went
	@$(SUITE) run

.PHONY: test-latest
test-latest: suite ## Every test on the default control plane (Kubernetes 1.35) only, with the try-install paths
	@$(SUITE) run --k8s 1.35

.PHONY: test-compat
test-compat: suite ## The integration tests that run on the oldest Kubernetes capo supports (1.30) only
	@$(SUITE) run --k8s 1.30 --no-lint

.PHONY: test-try
test-try: suite ## make try-helm, try-argocd, try-real-node and try-sticky as a newcomer would (each on its own control plane, torn down after)
	@$(SUITE) run --only try

.PHONY: test-plan
test-plan: suite ## Print what make test runs: each step, what it needs, its weight
	@$(SUITE) plan

.PHONY: test-cold
test-cold: ## CI as a new machine meets it: a fresh clone with every cache empty (hack/cold-run.sh); keeps its report for make test-report
	bash hack/cold-run.sh

.PHONY: test-report
test-report: suite ## Rewrite docs/testing.md's timing section and the README's line from the last cold and warm reports (target/suite/)
	@$(SUITE) docs

# make test-<area>: one test binary (test-holds, test-holds@1.30), a group (test-admission,
# test-calico, test-install, test-policies, test-release, test-sticky, test-real-node),
# test-unit, test-lint; with the builds it needs. TEST_ARGS go to the test binaries
# (a libtest filter: make test-holds TEST_ARGS=dry_run).
test-%: suite
	@$(SUITE) run --only $* $(if $(TEST_ARGS),-- $(TEST_ARGS))

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
# CAPO_PREBUILT=1: target/debug has capo's binaries already (the suite runner built them
# with its test build; a build of one package alone would compile its dependencies again).
testenv-up: controlplane $(if $(TESTENV_REAL_NODE),real-node tools) ## Start the local control plane (TESTENV_REAL_NODE=1: with the real node); prints the export KUBECONFIG line
	@$(if $(CAPO_PREBUILT),,cargo build -q -p capo-testenv)
	@CAPO_TESTENV_BIN="$$(bash hack/build-controlplane.sh 2>/dev/null | tail -n1)" $(CALICO_IPAM_ENV) \
	  $(if $(TESTENV_REAL_NODE),CAPO_REAL_NODE="$$(bash hack/build-real-node.sh 2>/dev/null | tail -n1)") \
	  $(if $(TESTENV_REAL_NODE),CAPO_IMAGE="$${CAPO_IMAGE:-$$(CAPO_IMAGE_PROFILE=dev bash hack/build-image.sh | tail -n1)}") \
	  target/debug/capo-testenv up --state-dir $(TESTENV_DIR) --calico $(TESTENV_CALICO) $(if $(TESTENV_REAL_NODE),--real-node)

.PHONY: testenv-down
testenv-down: ## Stop the local control plane and remove its state
	@$(if $(CAPO_PREBUILT),,cargo build -q -p capo-testenv)
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
