package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	apiv3 "github.com/projectcalico/api/pkg/apis/projectcalico/v3"
	"github.com/projectcalico/calico/libcalico-go/lib/apiconfig"
	libapiv3 "github.com/projectcalico/calico/libcalico-go/lib/apis/v3"
	"github.com/projectcalico/calico/libcalico-go/lib/backend"
	bapi "github.com/projectcalico/calico/libcalico-go/lib/backend/api"
	"github.com/projectcalico/calico/libcalico-go/lib/clientv3"
	cerrors "github.com/projectcalico/calico/libcalico-go/lib/errors"
	"github.com/projectcalico/calico/libcalico-go/lib/ipam"
	cnet "github.com/projectcalico/calico/libcalico-go/lib/net"
	"github.com/projectcalico/calico/libcalico-go/lib/options"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"
)

// common holds the flags every command takes: where Calico's datastore and the
// Kubernetes API are, and how fast the clients may go.
type common struct {
	kubeconfig string
	datastore  string
	qps        float64
	logLevel   string
}

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the API server")
	fs.StringVar(&c.datastore, "datastore", envOr("DATASTORE_TYPE", "kubernetes"),
		"Calico datastore: kubernetes, or etcdv3 (ETCD_ENDPOINTS, ETCD_CA_CERT_FILE, ETCD_CERT_FILE, ETCD_KEY_FILE)")
	// Calico's Kubernetes client defaults to 5 requests/s (burst 100); a node's CNI
	// plugin raises it through its configuration. One AutoAssign is ~10 requests.
	fs.Float64Var(&c.qps, "qps", 1000, "requests per second of the clients")
	fs.StringVar(&c.logLevel, "log-level", "warning", "log level of Calico's library (debug, info, warning, error)")
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// calico is a connection to Calico's datastore.
type calico struct {
	client    clientv3.Interface
	backend   bapi.Client
	datastore apiconfig.DatastoreType
}

// calicoClient connects to the datastore the flags and the environment name, the way
// calicoctl and the CNI plugin do (apiconfig from the environment).
func (c *common) calicoClient() (*calico, error) {
	cfg, err := apiconfig.LoadClientConfigFromEnvironment()
	if err != nil {
		return nil, err
	}
	cfg.Spec.DatastoreType = apiconfig.DatastoreType(c.datastore)
	switch cfg.Spec.DatastoreType {
	case apiconfig.Kubernetes:
		if c.kubeconfig == "" {
			return nil, errors.New("the kubernetes datastore needs --kubeconfig (or KUBECONFIG)")
		}
		cfg.Spec.Kubeconfig = c.kubeconfig
		cfg.Spec.K8sClientQPS = float32(c.qps)
	case apiconfig.EtcdV3:
		if cfg.Spec.EtcdEndpoints == "" {
			return nil, errors.New("the etcdv3 datastore needs ETCD_ENDPOINTS")
		}
	default:
		return nil, fmt.Errorf("unknown datastore %q (kubernetes or etcdv3)", c.datastore)
	}
	cli, err := clientv3.New(*cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to the %s datastore: %w", c.datastore, err)
	}
	be, err := backend.NewClient(*cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to the %s datastore: %w", c.datastore, err)
	}
	return &calico{client: cli, backend: be, datastore: cfg.Spec.DatastoreType}, nil
}

// restConfig is the Kubernetes client configuration (Pods, Nodes, CRDs).
func (c *common) restConfig() (*rest.Config, error) {
	if c.kubeconfig == "" {
		return nil, errors.New("--kubeconfig (or KUBECONFIG) is required")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", c.kubeconfig, err)
	}
	cfg.QPS = float32(c.qps)
	cfg.Burst = int(2 * c.qps)
	cfg.UserAgent = "capo-calico-ipam"
	return cfg, nil
}

func (c *common) kubeClient() (kubernetes.Interface, error) {
	cfg, err := c.restConfig()
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// pools are the IP pools of the test environment.
type pools struct {
	v4, v6           string
	v4Block, v6Block int
}

func (p *pools) register(fs *flag.FlagSet) {
	// RFC 2544/5180 benchmarking ranges: nothing here is ever sent traffic. Tests pick
	// hand-made addresses from 198.19.0.0/16 and 2001:2::/64, outside these pools; those
	// ranges are disabled pools (IPAM assigns nothing from them), so that every address a
	// test Pod has is in a Calico pool, as on a real cluster.
	fs.StringVar(&p.v4, "v4-pool", "198.18.0.0/16", "the IPv4 pool's CIDR (empty: none)")
	fs.StringVar(&p.v6, "v6-pool", "2001:2:0:1::/112", "the IPv6 pool's CIDR (empty: none)")
	fs.IntVar(&p.v4Block, "v4-block-size", 26, "IPv4 block size (Calico's default, 64 addresses)")
	fs.IntVar(&p.v6Block, "v6-block-size", 122, "IPv6 block size (Calico's default, 64 addresses)")
}

// ensure creates the pools (named capo-testenv-ipv4/-ipv6) unless they exist.
func (p *pools) ensure(ctx context.Context, c *calico) error {
	for _, pool := range []struct {
		name, cidr string
		block      int
	}{{"capo-testenv-ipv4", p.v4, p.v4Block}, {"capo-testenv-ipv6", p.v6, p.v6Block}} {
		if pool.cidr == "" {
			continue
		}
		obj := apiv3.NewIPPool()
		obj.Name = pool.name
		obj.Spec = apiv3.IPPoolSpec{
			CIDR:         pool.cidr,
			BlockSize:    pool.block,
			IPIPMode:     apiv3.IPIPModeNever,
			VXLANMode:    apiv3.VXLANModeNever,
			NodeSelector: "all()",
			AllowedUses:  []apiv3.IPPoolAllowedUse{apiv3.IPPoolAllowedUseWorkload, apiv3.IPPoolAllowedUseTunnel},
		}
		_, err := c.client.IPPools().Create(ctx, obj, options.SetOptions{})
		if err != nil && !isAlreadyExists(err) {
			return fmt.Errorf("creating IPPool %s (%s): %w", pool.name, pool.cidr, err)
		}
	}
	for _, pool := range []struct{ name, cidr string }{
		{"capo-testenv-handmade-ipv4", "198.19.0.0/16"},
		{"capo-testenv-handmade-ipv6", "2001:2::/64"},
	} {
		obj := apiv3.NewIPPool()
		obj.Name = pool.name
		obj.Spec = apiv3.IPPoolSpec{
			CIDR:         pool.cidr,
			Disabled:     true,
			IPIPMode:     apiv3.IPIPModeNever,
			VXLANMode:    apiv3.VXLANModeNever,
			NodeSelector: "!all()",
			AllowedUses:  []apiv3.IPPoolAllowedUse{apiv3.IPPoolAllowedUseWorkload},
		}
		_, err := c.client.IPPools().Create(ctx, obj, options.SetOptions{})
		if err != nil && !isAlreadyExists(err) {
			return fmt.Errorf("creating IPPool %s (%s): %w", pool.name, pool.cidr, err)
		}
	}
	return nil
}

func isAlreadyExists(err error) bool {
	var exists cerrors.ErrorResourceAlreadyExists
	return errors.As(err, &exists)
}

func isNotFound(err error) bool {
	var missing cerrors.ErrorResourceDoesNotExist
	return errors.As(err, &missing)
}

// ensureHost makes sure Calico knows the host: with the Kubernetes datastore a Calico
// Node is the Kubernetes Node (it must exist); with etcd it is created, as calico/node
// does when it starts on a host.
func (c *calico) ensureHost(ctx context.Context, host string) error {
	if c.datastore != apiconfig.EtcdV3 {
		return nil
	}
	node := libapiv3.NewNode()
	node.Name = host
	if _, err := c.client.Nodes().Create(ctx, node, options.SetOptions{}); err != nil && !isAlreadyExists(err) {
		return fmt.Errorf("creating Calico Node %s: %w", host, err)
	}
	return nil
}

// families is the set of IP families a Pod gets: "v4", "v6" or "v4,v6".
type families struct{ v4, v6 bool }

func parseFamilies(s string) (families, error) {
	var f families
	for _, part := range splitList(s) {
		switch strings.ToLower(part) {
		case "v4", "ipv4", "4":
			f.v4 = true
		case "v6", "ipv6", "6":
			f.v6 = true
		default:
			return f, fmt.Errorf("unknown IP family %q (v4, v6 or v4,v6)", part)
		}
	}
	if !f.v4 && !f.v6 {
		return f, fmt.Errorf("no IP family in %q (v4, v6 or v4,v6)", s)
	}
	return f, nil
}

func (f families) String() string {
	switch {
	case f.v4 && f.v6:
		return "v4,v6"
	case f.v6:
		return "v6"
	default:
		return "v4"
	}
}

func (f families) counts() (int, int) {
	n4, n6 := 0, 0
	if f.v4 {
		n4 = 1
	}
	if f.v6 {
		n6 = 1
	}
	return n4, n6
}

// autoAssign is what calico-ipam does on CNI ADD: one address per family for the
// handle, on the host, for a workload.
func (c *calico) autoAssign(ctx context.Context, host, handle string, fam families, attrs map[string]string) ([]cnet.IPNet, error) {
	return c.autoAssignIn(ctx, host, handle, fam, attrs, nil, nil)
}

// autoAssignIn is autoAssign from the requested pools (as the CNI plugin passes a Pod's
// cni.projectcalico.org/ipv4pools and ipv6pools; empty: the pools selecting the node).
func (c *calico) autoAssignIn(ctx context.Context, host, handle string, fam families, attrs map[string]string, v4Pools, v6Pools []cnet.IPNet) ([]cnet.IPNet, error) {
	n4, n6 := fam.counts()
	v4, v6, err := c.client.IPAM().AutoAssign(ctx, ipam.AutoAssignArgs{
		Num4:        n4,
		Num6:        n6,
		IPv4Pools:   v4Pools,
		IPv6Pools:   v6Pools,
		HandleID:    &handle,
		Attrs:       attrs,
		Hostname:    host,
		IntendedUse: apiv3.IPPoolAllowedUseWorkload,
	})
	var ips []cnet.IPNet
	for _, a := range []*ipam.IPAMAssignments{v4, v6} {
		if a == nil {
			continue
		}
		ips = append(ips, a.IPs...)
		if err == nil {
			if short := a.PartialFulfillmentError(); short != nil {
				err = short
			}
		}
	}
	if err != nil {
		// Do not leak what was assigned before the failure (calico-ipam does the same).
		if len(ips) > 0 {
			_ = c.client.IPAM().ReleaseByHandle(ctx, handle)
		}
		return nil, fmt.Errorf("AutoAssign %s for handle %s on %s: %w", fam, handle, host, err)
	}
	return ips, nil
}

// assignNamed is the CNI plugin's path for a Pod annotated cni.projectcalico.org/ipAddrs
// (a JSON list): AssignIP of each address with the Pod's handle, on the host. Calico
// assigns such an address even when an IPReservation lists it, and refuses one another
// handle owns ("already assigned"); on any failure what was assigned is released.
func (c *calico) assignNamed(ctx context.Context, host, handle, annotation string, attrs map[string]string) ([]string, error) {
	var named []string
	if err := json.Unmarshal([]byte(annotation), &named); err != nil || len(named) == 0 {
		return nil, fmt.Errorf("cni.projectcalico.org/ipAddrs %q: not a JSON list of addresses", annotation)
	}
	var ips []string
	for _, s := range named {
		ip := cnet.ParseIP(s)
		if ip == nil {
			return nil, fmt.Errorf("cni.projectcalico.org/ipAddrs: %q is not an address", s)
		}
		err := c.client.IPAM().AssignIP(ctx, ipam.AssignIPArgs{IP: *ip, HandleID: &handle, Hostname: host, Attrs: attrs})
		if err != nil {
			if len(ips) > 0 {
				_ = c.client.IPAM().ReleaseByHandle(ctx, handle)
			}
			return nil, fmt.Errorf("AssignIP %s for handle %s on %s: %w", s, handle, host, err)
		}
		ips = append(ips, ip.String())
	}
	return ips, nil
}

// requestedPools resolves a Pod's cni.projectcalico.org/ipv4pools or ipv6pools annotation
// (a JSON list of pool names or CIDRs) to CIDRs, as the CNI plugin does.
func (c *calico) requestedPools(ctx context.Context, annotation string) ([]cnet.IPNet, error) {
	if annotation == "" {
		return nil, nil
	}
	var names []string
	if err := json.Unmarshal([]byte(annotation), &names); err != nil {
		return nil, fmt.Errorf("pool annotation %q: %w", annotation, err)
	}
	var out []cnet.IPNet
	for _, name := range names {
		if _, n, err := cnet.ParseCIDR(name); err == nil {
			out = append(out, *n)
			continue
		}
		pool, err := c.client.IPPools().Get(ctx, name, options.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("pool %q of the annotation: %w", name, err)
		}
		_, n, err := cnet.ParseCIDR(pool.Spec.CIDR)
		if err != nil {
			return nil, fmt.Errorf("pool %q: %w", name, err)
		}
		out = append(out, *n)
	}
	return out, nil
}

// releaseHandle is what calico-ipam does on CNI DEL; an unknown handle is not an error.
func (c *calico) releaseHandle(ctx context.Context, handle string) (bool, error) {
	err := c.client.IPAM().ReleaseByHandle(ctx, handle)
	if err != nil {
		if isNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("releasing handle %s: %w", handle, err)
	}
	return true, nil
}

// reservationSet is every CIDR listed in an IPReservation, as Calico's library sees it.
type reservationSet []reservedCIDR

type reservedCIDR struct {
	cidr cnet.IPNet
	name string
}

// listReservations lists IPReservations through clientv3 (what IPAM reads).
func (c *calico) listReservations(ctx context.Context) ([]apiv3.IPReservation, reservationSet, error) {
	list, err := c.client.IPReservations().List(ctx, options.ListOptions{})
	if err != nil {
		return nil, nil, fmt.Errorf("listing IPReservations: %w", err)
	}
	var set reservationSet
	for _, r := range list.Items {
		for _, s := range r.Spec.ReservedCIDRs {
			if _, cidr, err := cnet.ParseCIDROrIP(strings.TrimSpace(s)); err == nil {
				set = append(set, reservedCIDR{cidr: *cidr, name: r.Name})
			}
		}
	}
	return list.Items, set, nil
}

// holder names the reservation listing ip, or "".
func (s reservationSet) holder(ip cnet.IP) string {
	for _, r := range s {
		if r.cidr.Contains(ip.IP) {
			return r.name
		}
	}
	return ""
}

// installCRDs creates Calico's crd.projectcalico.org/v1 CRDs found in dir (taken from the
// pinned Calico module at build time) and waits until they are Established.
func installCRDs(ctx context.Context, cfg *rest.Config, dir string) error {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		return fmt.Errorf("no CRD files in %s", dir)
	}
	sort.Strings(files)
	cli, err := apiextclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	crds := cli.ApiextensionsV1().CustomResourceDefinitions()
	// Created all at once: the API server takes a moment to establish each.
	names := make([]string, len(files))
	errs := make(chan error, len(files))
	for i, f := range files {
		go func() {
			errs <- func() error {
				data, err := os.ReadFile(f)
				if err != nil {
					return err
				}
				var crd apiextv1.CustomResourceDefinition
				if err := yaml.UnmarshalStrict(data, &crd); err != nil {
					return fmt.Errorf("%s: %w", f, err)
				}
				names[i] = crd.Name
				_, err = crds.Create(ctx, &crd, metav1.CreateOptions{FieldManager: "capo-calico-ipam"})
				if err != nil && !apierrors.IsAlreadyExists(err) {
					return fmt.Errorf("creating CRD %s: %w", crd.Name, err)
				}
				return nil
			}()
		}()
	}
	for range files {
		if err := <-errs; err != nil {
			return err
		}
	}
	deadline := time.Now().Add(60 * time.Second)
	for _, name := range names {
		for {
			crd, err := crds.Get(ctx, name, metav1.GetOptions{})
			if err == nil && established(crd) {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("CRD %s not Established after 60s (last error: %v)", name, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil
}

func established(crd *apiextv1.CustomResourceDefinition) bool {
	for _, c := range crd.Status.Conditions {
		if c.Type == apiextv1.Established && c.Status == apiextv1.ConditionTrue {
			return true
		}
	}
	return false
}

// setupFlags are the flags of `setup` (and `run`, which sets up first).
type setupFlags struct {
	crds  string
	pools pools
}

func (s *setupFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&s.crds, "crds", "", "install Calico's CRDs from this directory first (Kubernetes datastore)")
	s.pools.register(fs)
}

// setup installs the CRDs (if asked), initialises the datastore as calico/node would
// (ClusterInformation) and creates the pools.
func (s *setupFlags) setup(ctx context.Context, c *common) (*calico, error) {
	if s.crds != "" {
		cfg, err := c.restConfig()
		if err != nil {
			return nil, err
		}
		if err := installCRDs(ctx, cfg, s.crds); err != nil {
			return nil, err
		}
	}
	cal, err := c.calicoClient()
	if err != nil {
		return nil, err
	}
	if err := cal.client.EnsureInitialized(ctx, calicoVersion, "capo-testenv"); err != nil {
		return nil, fmt.Errorf("initialising the %s datastore: %w", c.datastore, err)
	}
	if err := s.pools.ensure(ctx, cal); err != nil {
		return nil, err
	}
	return cal, nil
}

func cmdSetup(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("setup", flag.ContinueOnError)
	var c common
	var s setupFlags
	c.register(fs)
	s.register(fs)
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	_, err := s.setup(ctx, &c)
	return err
}
