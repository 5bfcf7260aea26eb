package main

// `bench`: what capo's holds cost Calico. Calico IPAM lists every IPReservation on every
// AutoAssign and checks candidate addresses against every reserved CIDR, so the cost
// grows with what is reserved. For each number of reserved /32 entries and each way of
// splitting them into objects, it measures AutoAssign (one IPv4 address, then release)
// on one host, the List of IPReservations alone, and the append of one entry to one
// object (what each capo hold costs the API server: the whole object is rewritten).

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"text/tabwriter"
	"time"

	apiv3 "github.com/projectcalico/api/pkg/apis/projectcalico/v3"
	"github.com/projectcalico/calico/libcalico-go/lib/options"
)

const benchLabel = "capo-bench"

type benchRow struct {
	Entries   int     `json:"entries"`
	PerObject int     `json:"perObject"`
	Objects   int     `json:"objects"`
	Create    float64 `json:"createSeconds"`
	List      latency `json:"listMillis"`
	Assign    latency `json:"assignMillis"`
	Append    latency `json:"appendMillis"`
}

func cmdBench(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	var c common
	c.register(fs)
	host := fs.String("host", "kwok-node-1", "the node to assign on (nothing else should assign there)")
	sizes := fs.String("sizes", "0,1000,10000,50000", "reserved entries")
	shards := fs.String("per-object", "0,1000,2000,5000", "entries per IPReservation object (0: all in one)")
	samples := fs.Int("samples", 30, "AutoAssign samples per row")
	base := fs.String("range", "100.64.0.0", "reserved entries are consecutive /32s from here")
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	if err := cal.ensureHost(ctx, *host); err != nil {
		return err
	}
	start := net.ParseIP(*base).To4()
	if start == nil {
		return fmt.Errorf("--range %q is not an IPv4 address", *base)
	}
	var rows []benchRow
	for _, sizeStr := range splitList(*sizes) {
		size, err := strconv.Atoi(sizeStr)
		if err != nil {
			return fmt.Errorf("--sizes: %w", err)
		}
		for _, perStr := range splitList(*shards) {
			per, err := strconv.Atoi(perStr)
			if err != nil {
				return fmt.Errorf("--per-object: %w", err)
			}
			if per == 0 || per > size {
				per = size
			}
			if dup(rows, size, per) {
				continue
			}
			row, err := benchOne(ctx, cal, *host, start, size, per, *samples)
			if err != nil {
				return fmt.Errorf("%d entries, %d per object: %w", size, per, err)
			}
			fmt.Fprintf(os.Stderr, "bench: %d entries in %d objects: AutoAssign p50 %.1f ms\n", size, row.Objects, row.Assign.P50)
			rows = append(rows, row)
		}
	}
	if err := clearBench(ctx, cal); err != nil {
		return err
	}
	if *asJSON {
		return printJSON(rows)
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "entries\tper object\tobjects\tcreate s\tList p50 ms\tAutoAssign p50 ms\tp90 ms\tmax ms\tappend 1 p50 ms\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%d\t%d\t%d\t%.2f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t\n",
			r.Entries, r.PerObject, r.Objects, r.Create, r.List.P50, r.Assign.P50, r.Assign.P90, r.Assign.Max, r.Append.P50)
	}
	return w.Flush()
}

func dup(rows []benchRow, size, per int) bool {
	for _, r := range rows {
		if r.Entries == size && r.PerObject == per {
			return true
		}
	}
	return false
}

// clearBench deletes the reservations an earlier row made.
func clearBench(ctx context.Context, cal *calico) error {
	list, err := cal.client.IPReservations().List(ctx, options.ListOptions{})
	if err != nil {
		return err
	}
	for _, r := range list.Items {
		if r.Labels[benchLabel] == "true" {
			if _, err := cal.client.IPReservations().Delete(ctx, r.Name, options.DeleteOptions{}); err != nil && !isNotFound(err) {
				return fmt.Errorf("deleting IPReservation %s: %w", r.Name, err)
			}
		}
	}
	return nil
}

func benchOne(ctx context.Context, cal *calico, host string, start net.IP, size, per, samples int) (benchRow, error) {
	row := benchRow{Entries: size, PerObject: per}
	if err := clearBench(ctx, cal); err != nil {
		return row, err
	}
	first := binary.BigEndian.Uint32(start)
	res := cal.client.IPReservations()
	t := time.Now()
	for done := 0; done < size; done += per {
		obj := apiv3.NewIPReservation()
		obj.Name = fmt.Sprintf("capo-bench-%d", row.Objects)
		obj.Labels = map[string]string{benchLabel: "true", "app.kubernetes.io/managed-by": "capo"}
		for i := done; i < done+per && i < size; i++ {
			ip := make(net.IP, 4)
			binary.BigEndian.PutUint32(ip, first+uint32(i))
			obj.Spec.ReservedCIDRs = append(obj.Spec.ReservedCIDRs, ip.String()+"/32")
		}
		if _, err := res.Create(ctx, obj, options.SetOptions{}); err != nil {
			return row, fmt.Errorf("creating %s (%d entries): %w", obj.Name, len(obj.Spec.ReservedCIDRs), err)
		}
		row.Objects++
	}
	row.Create = time.Since(t).Seconds()
	var lists, assigns, appends []time.Duration
	for i := -2; i < samples; i++ { // two warm-up rounds
		t := time.Now()
		if _, _, err := cal.listReservations(ctx); err != nil {
			return row, err
		}
		list := time.Since(t)
		handle := fmt.Sprintf("capo-bench.%s.%d", host, i+2)
		t = time.Now()
		if _, err := cal.autoAssign(ctx, host, handle, families{v4: true}, nil); err != nil {
			return row, err
		}
		assign := time.Since(t)
		if _, err := cal.releaseHandle(ctx, handle); err != nil {
			return row, err
		}
		if i >= 0 {
			lists = append(lists, list)
			assigns = append(assigns, assign)
		}
	}
	// Appending one entry to an object of `per` entries and taking it out again: a
	// read and a full rewrite each, as every hold and release of capo costs.
	if size > 0 {
		for i := 0; i < 10; i++ {
			t := time.Now()
			obj, err := res.Get(ctx, "capo-bench-0", options.GetOptions{})
			if err != nil {
				return row, err
			}
			obj.Spec.ReservedCIDRs = append(obj.Spec.ReservedCIDRs, fmt.Sprintf("100.127.255.%d/32", i))
			if _, err := res.Update(ctx, obj, options.SetOptions{}); err != nil {
				return row, fmt.Errorf("appending to capo-bench-0: %w", err)
			}
			appends = append(appends, time.Since(t))
		}
	}
	row.List, row.Assign, row.Append = summarize(lists), summarize(assigns), summarize(appends)
	return row, nil
}
