package main

// `oracle`: N cycles of AutoAssign then release on one host, one handle per cycle, as a
// node's CNI plugin would for N short-lived Pods. It reports every address handed out,
// in order, and every one that an IPReservation listed at that moment (read through
// clientv3 right before the AutoAssign, the same list IPAM itself reads).

import (
	"context"
	"flag"
	"fmt"
	"sort"
	"time"

	"github.com/projectcalico/calico/libcalico-go/lib/ipam"
	cnet "github.com/projectcalico/calico/libcalico-go/lib/net"
)

type oracleReport struct {
	Host     string `json:"host"`
	Families string `json:"families"`
	Cycles   int    `json:"cycles"`
	// HandedOut[i] are the addresses of cycle i (IPv4 first).
	HandedOut [][]string `json:"handedOut"`
	// Blocks are the IPAM blocks the addresses came from.
	Blocks []string `json:"blocks"`
	// Distinct is how many different addresses were handed out.
	Distinct int `json:"distinct"`
	// ReservedAtStart is how many reserved CIDRs Calico's client listed before cycle 0.
	ReservedAtStart int `json:"reservedAtStart"`
	// ReservedHits are addresses handed out although an IPReservation listed them.
	ReservedHits []oracleHit `json:"reservedHits"`
	Seconds      float64     `json:"seconds"`
	AssignMillis latency     `json:"assignMillis"`
	ReleaseMilli latency     `json:"releaseMillis"`
}

type oracleHit struct {
	Cycle       int    `json:"cycle"`
	IP          string `json:"ip"`
	Reservation string `json:"reservation"`
}

type latency struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

func summarize(samples []time.Duration) latency {
	if len(samples) == 0 {
		return latency{}
	}
	s := append([]time.Duration(nil), samples...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	at := func(q float64) float64 {
		i := int(q * float64(len(s)-1))
		return float64(s[i].Microseconds()) / 1000
	}
	return latency{P50: at(0.5), P90: at(0.9), P99: at(0.99), Max: at(1)}
}

func cmdOracle(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("oracle", flag.ContinueOnError)
	var c common
	c.register(fs)
	cycles := fs.Int("cycles", 2000, "AutoAssign/release cycles")
	host := fs.String("host", "kwok-node-0", "the node (a Kubernetes Node with the kubernetes datastore)")
	fam := fs.String("families", "v4", "v4, v6 or v4,v6")
	prefix := fs.String("handle-prefix", "capo-oracle", "handles are <prefix>.<host>.<cycle>")
	keep := fs.Bool("keep-last", false, "do not release the last cycle's addresses")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	families, err := parseFamilies(*fam)
	if err != nil {
		return err
	}
	cal, err := c.calicoClient()
	if err != nil {
		return err
	}
	if err := cal.ensureHost(ctx, *host); err != nil {
		return err
	}
	report := oracleReport{Host: *host, Families: families.String(), Cycles: *cycles,
		HandedOut: [][]string{}, Blocks: []string{}, ReservedHits: []oracleHit{}}
	seen, blocks := map[string]bool{}, map[string]bool{}
	var assignTimes, releaseTimes []time.Duration
	start := time.Now()
	for i := 0; i < *cycles; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		_, reserved, err := cal.listReservations(ctx)
		if err != nil {
			return err
		}
		if i == 0 {
			report.ReservedAtStart = len(reserved)
		}
		handle := fmt.Sprintf("%s.%s.%d", *prefix, *host, i)
		attrs := map[string]string{ipam.AttributeNode: *host, "capo-oracle-cycle": fmt.Sprint(i)}
		t := time.Now()
		ips, err := cal.autoAssign(ctx, *host, handle, families, attrs)
		if err != nil {
			return fmt.Errorf("cycle %d: %w", i, err)
		}
		assignTimes = append(assignTimes, time.Since(t))
		var addrs []string
		for _, ipn := range ips {
			ip := ipn.IP.String()
			addrs = append(addrs, ip)
			seen[ip] = true
			blocks[ipn.Network().String()] = true
			if name := reserved.holder(cnet.IP{IP: ipn.IP}); name != "" {
				report.ReservedHits = append(report.ReservedHits, oracleHit{Cycle: i, IP: ip, Reservation: name})
			}
		}
		report.HandedOut = append(report.HandedOut, v4First(addrs))
		if *keep && i == *cycles-1 {
			break
		}
		t = time.Now()
		if _, err := cal.releaseHandle(ctx, handle); err != nil {
			return fmt.Errorf("cycle %d: %w", i, err)
		}
		releaseTimes = append(releaseTimes, time.Since(t))
	}
	report.Seconds = time.Since(start).Seconds()
	report.Distinct = len(seen)
	for b := range blocks {
		report.Blocks = append(report.Blocks, b)
	}
	sort.Strings(report.Blocks)
	report.AssignMillis = summarize(assignTimes)
	report.ReleaseMilli = summarize(releaseTimes)
	return printJSON(report)
}
