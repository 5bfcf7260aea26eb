package main

// One-shot commands: check (what Calico's library reads as IPReservations), assign and
// release (one CNI ADD/DEL by hand), reserve (an IPReservation written by Calico's own
// client, the reference for what capo must write) and blocks.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"sort"
	"strings"

	apiv3 "github.com/projectcalico/api/pkg/apis/projectcalico/v3"
	"github.com/projectcalico/calico/libcalico-go/lib/ipam"
	"github.com/projectcalico/calico/libcalico-go/lib/options"
)

type reservationJSON struct {
	Name            string            `json:"name"`
	Labels          map[string]string `json:"labels,omitempty"`
	ResourceVersion string            `json:"resourceVersion"`
	ReservedCIDRs   []string          `json:"reservedCIDRs"`
}

func toJSON(r apiv3.IPReservation) reservationJSON {
	cidrs := r.Spec.ReservedCIDRs
	if cidrs == nil {
		cidrs = []string{}
	}
	return reservationJSON{Name: r.Name, Labels: r.Labels, ResourceVersion: r.ResourceVersion, ReservedCIDRs: cidrs}
}

// check lists IPReservations through clientv3, exactly as IPAM does before assigning.
func cmdCheck(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	var c common
	c.register(fs)
	name := fs.String("reservation", "", "only this IPReservation (exit 3 if Calico does not see it)")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	items, _, err := cal.listReservations(ctx)
	if err != nil {
		return err
	}
	out := []reservationJSON{}
	for _, r := range items {
		if *name == "" || r.Name == *name {
			out = append(out, toJSON(r))
		}
	}
	if err := printJSON(out); err != nil {
		return err
	}
	if *name != "" && len(out) == 0 {
		return exitCode(3, fmt.Errorf("Calico's library (%s datastore) sees no IPReservation %q", c.datastore, *name))
	}
	return nil
}

// exitError carries a specific exit code.
type exitError struct {
	code int
	err  error
}

func (e exitError) Error() string { return e.err.Error() }
func exitCode(code int, err error) error {
	return exitError{code, err}
}

// cmdHost makes Calico know a host, as calico/node does when it starts there: the real
// node of the test environment (its CNI plugin assigns on the host's behalf).
func cmdHost(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("host", flag.ContinueOnError)
	var c common
	c.register(fs)
	name := fs.String("name", "", "the host (required)")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	if *name == "" {
		return fmt.Errorf("--name is required: %w", errUsage)
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	return cal.ensureHost(ctx, *name)
}

func cmdAssign(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("assign", flag.ContinueOnError)
	var c common
	c.register(fs)
	host := fs.String("host", "kwok-node-0", "the node (a Kubernetes Node with the kubernetes datastore)")
	handle := fs.String("handle", "", "IPAM handle (required)")
	num4 := fs.Int("num4", 1, "IPv4 addresses")
	num6 := fs.Int("num6", 0, "IPv6 addresses")
	named := fs.String("ip", "", "assign exactly these addresses (a JSON list, as in cni.projectcalico.org/ipAddrs) with AssignIP instead")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	if *handle == "" {
		return fmt.Errorf("--handle is required: %w", errUsage)
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	if err := cal.ensureHost(ctx, *host); err != nil {
		return err
	}
	if *named != "" {
		ips, err := cal.assignNamed(ctx, *host, *handle, *named, map[string]string{ipam.AttributeNode: *host})
		if err != nil {
			return err
		}
		return printJSON(struct {
			Handle string   `json:"handle"`
			IPs    []string `json:"ips"`
			Blocks []string `json:"blocks"`
		}{Handle: *handle, IPs: ips, Blocks: []string{}})
	}
	v4, v6, err := cal.client.IPAM().AutoAssign(ctx, ipam.AutoAssignArgs{
		Num4: *num4, Num6: *num6, HandleID: handle, Hostname: *host,
		Attrs:       map[string]string{ipam.AttributeNode: *host},
		IntendedUse: apiv3.IPPoolAllowedUseWorkload,
	})
	out := struct {
		Handle string   `json:"handle"`
		IPs    []string `json:"ips"`
		Blocks []string `json:"blocks"`
		Error  string   `json:"error,omitempty"`
	}{Handle: *handle, IPs: []string{}, Blocks: []string{}}
	for _, a := range []*ipam.IPAMAssignments{v4, v6} {
		if a == nil {
			continue
		}
		for _, ipn := range a.IPs {
			out.IPs = append(out.IPs, ipn.IP.String())
			out.Blocks = append(out.Blocks, ipn.Network().String())
		}
	}
	if err != nil {
		out.Error = err.Error()
	}
	if perr := printJSON(out); perr != nil {
		return perr
	}
	return err
}

func cmdRelease(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("release", flag.ContinueOnError)
	var c common
	c.register(fs)
	handle := fs.String("handle", "", "release every address of this handle")
	addrs := fs.String("ip", "", "release these addresses (comma-separated)")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	if *handle != "" {
		released, err := cal.releaseHandle(ctx, *handle)
		if err == nil && !released {
			return exitCode(3, fmt.Errorf("no handle %s", *handle))
		}
		return err
	}
	var opts []ipam.ReleaseOptions
	for _, ip := range splitList(*addrs) {
		opts = append(opts, ipam.ReleaseOptions{Address: ip})
	}
	if len(opts) == 0 {
		return fmt.Errorf("--handle or --ip is required: %w", errUsage)
	}
	unallocated, err := cal.client.IPAM().ReleaseIPs(ctx, opts...)
	if err != nil {
		return err
	}
	if len(unallocated) > 0 {
		return exitCode(3, fmt.Errorf("not allocated: %v", unallocated))
	}
	return nil
}

// reserve creates or replaces an IPReservation through Calico's clientv3, so its
// stored form (CRD object, or etcd key and value) is Calico's own.
func cmdReserve(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("reserve", flag.ContinueOnError)
	var c common
	c.register(fs)
	name := fs.String("name", "", "the IPReservation's name (required)")
	cidrs := fs.String("cidrs", "", "reserved CIDRs, comma-separated (empty: delete the reservation)")
	labels := fs.String("labels", "app.kubernetes.io/managed-by=capo", "labels k=v,k=v")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	if *name == "" {
		return fmt.Errorf("--name is required: %w", errUsage)
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	res := cal.client.IPReservations()
	if *cidrs == "" {
		_, err := res.Delete(ctx, *name, options.DeleteOptions{})
		if isNotFound(err) {
			return nil
		}
		return err
	}
	obj := apiv3.NewIPReservation()
	obj.Name = *name
	obj.Labels = map[string]string{}
	for _, kv := range splitList(*labels) {
		k, v, _ := strings.Cut(kv, "=")
		obj.Labels[k] = v
	}
	obj.Spec.ReservedCIDRs = splitList(*cidrs)
	current, err := res.Get(ctx, *name, options.GetOptions{})
	switch {
	case err == nil:
		obj.ResourceVersion = current.ResourceVersion
		obj.CreationTimestamp = current.CreationTimestamp
		obj.UID = current.UID
		_, err = res.Update(ctx, obj, options.SetOptions{})
	case isNotFound(err):
		_, err = res.Create(ctx, obj, options.SetOptions{})
	}
	if err != nil {
		return fmt.Errorf("writing IPReservation %s: %w", *name, err)
	}
	return nil
}

// blocks prints what `calicoctl ipam show --show-blocks` shows: pools, blocks, use.
func cmdBlocks(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("blocks", flag.ContinueOnError)
	var c common
	c.register(fs)
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	usage, err := cal.client.IPAM().GetUtilization(ctx, ipam.GetUtilizationArgs{})
	if err != nil {
		return err
	}
	type block struct {
		CIDR      string `json:"cidr"`
		Capacity  int    `json:"capacity"`
		Available int    `json:"available"`
	}
	type pool struct {
		Name   string  `json:"name"`
		CIDR   string  `json:"cidr"`
		Blocks []block `json:"blocks"`
	}
	out := []pool{}
	for _, p := range usage {
		entry := pool{Name: p.Name, CIDR: p.CIDR.String(), Blocks: []block{}}
		for _, b := range p.Blocks {
			entry.Blocks = append(entry.Blocks, block{CIDR: b.CIDR.String(), Capacity: b.Capacity, Available: b.Available})
		}
		sort.Slice(entry.Blocks, func(i, j int) bool { return entry.Blocks[i].CIDR < entry.Blocks[j].CIDR })
		out = append(out, entry)
	}
	return printJSON(out)
}

// asExit unwraps an exitError's code (1 otherwise).
func asExit(err error) int {
	var e exitError
	if errors.As(err, &e) {
		return e.code
	}
	return 1
}
