// calico-apiserver: Calico's aggregated API server (release-v3.28 at v3.28.5, the same
// Calico module hack/calico-ipam pins), serving projectcalico.org/v3 as a view of the
// crd.projectcalico.org/v1 objects, as clusters that run it do. Built by
// hack/build-calico-apiserver.sh; see docs/calico.md.
module capo.local/hack/calico-apiserver

go 1.26.0

require (
	github.com/projectcalico/api v0.0.0-20240708202104-e3f70b269c2c
	github.com/projectcalico/calico v1.11.0-cni-plugin.0.20250813170300-a0db560f0520
)

replace (
	k8s.io/api => k8s.io/api v0.29.15
	k8s.io/apiextensions-apiserver => k8s.io/apiextensions-apiserver v0.29.15
	k8s.io/apimachinery => k8s.io/apimachinery v0.29.15
	k8s.io/apiserver => k8s.io/apiserver v0.29.15
	k8s.io/cli-runtime => k8s.io/cli-runtime v0.29.15
	k8s.io/client-go => k8s.io/client-go v0.29.15
	k8s.io/cloud-provider => k8s.io/cloud-provider v0.29.15
	k8s.io/cluster-bootstrap => k8s.io/cluster-bootstrap v0.29.15
	k8s.io/code-generator => k8s.io/code-generator v0.29.15
	k8s.io/component-base => k8s.io/component-base v0.29.15
	k8s.io/component-helpers => k8s.io/component-helpers v0.29.15
	k8s.io/controller-manager => k8s.io/controller-manager v0.29.15
	k8s.io/cri-api => k8s.io/cri-api v0.29.15
	k8s.io/csi-translation-lib => k8s.io/csi-translation-lib v0.29.15
	k8s.io/endpointslice => k8s.io/endpointslice v0.29.15
	k8s.io/kube-aggregator => k8s.io/kube-aggregator v0.29.15
	k8s.io/kube-controller-manager => k8s.io/kube-controller-manager v0.29.15
	k8s.io/kube-proxy => k8s.io/kube-proxy v0.29.15
	k8s.io/kube-scheduler => k8s.io/kube-scheduler v0.29.15
	k8s.io/kubectl => k8s.io/kubectl v0.29.15
	k8s.io/kubelet => k8s.io/kubelet v0.29.15

	// Need replacements for all the k8s subsidiary projects that are pulled in indirectly because
	// the kubernets repo pulls them in via a replacement to its own vendored copies, which doesn't work for
	// transient imports.
	k8s.io/kubernetes => k8s.io/kubernetes v1.29.15
	k8s.io/legacy-cloud-providers => k8s.io/legacy-cloud-providers v0.29.15
	k8s.io/metrics => k8s.io/metrics v0.29.15
	k8s.io/mount-utils => k8s.io/mount-utils v0.29.15
	k8s.io/pod-security-admission => k8s.io/pod-security-admission v0.29.15
	k8s.io/sample-apiserver => k8s.io/sample-apiserver v0.29.15

	// Use an untagged knftables version that has changes we need.
	sigs.k8s.io/knftables => sigs.k8s.io/knftables v0.0.17-0.20240627140917-8d2660d78107
)
