// Command capo-calico-ipam hands out Pod IPs in capo's test control plane with Calico's
// own IPAM library (libcalico-go, release-v3.28 at v3.28.5), the code the calico-ipam
// CNI plugin runs on every node. See docs/calico.md.
//
//	capo-calico-ipam run      drive Pods on kwok nodes (and annotated unscheduled test Pods):
//	                          CNI ADD/DEL through Calico IPAM, finish graceful deletions
//	capo-calico-ipam setup    install Calico's CRDs (Kubernetes datastore) and the IP pools
//	capo-calico-ipam check    list IPReservations through Calico's clientv3, as JSON
//	capo-calico-ipam assign   AutoAssign once, or AssignIP of --ip addresses (JSON); release: release by handle or address
//	capo-calico-ipam reserve  write an IPReservation through Calico's clientv3
//	capo-calico-ipam oracle   N AutoAssign/Release cycles; every address handed out, JSON
//	capo-calico-ipam bench    AutoAssign latency against the number of reserved entries
//	capo-calico-ipam blocks   the IPAM blocks and their use (calicoctl ipam show --show-blocks)
//
// The datastore is chosen as Calico's own components choose it: --datastore (or
// DATASTORE_TYPE) kubernetes uses --kubeconfig; etcdv3 uses ETCD_ENDPOINTS,
// ETCD_CA_CERT_FILE, ETCD_CERT_FILE and ETCD_KEY_FILE.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	log "github.com/sirupsen/logrus"
)

// calicoVersion is the Calico release whose IPAM library this module pins (go.mod).
const calicoVersion = "v3.28.5"

// errUsage makes main exit with code 2.
var errUsage = errors.New("usage")

var commands = map[string]func(ctx context.Context, args []string) error{
	"run":     cmdRun,
	"setup":   cmdSetup,
	"check":   cmdCheck,
	"assign":  cmdAssign,
	"release": cmdRelease,
	"reserve": cmdReserve,
	"oracle":  cmdOracle,
	"bench":   cmdBench,
	"blocks":  cmdBlocks,
	"host":    cmdHost,
}

func main() {
	if len(os.Args) < 2 || commands[os.Args[1]] == nil {
		fmt.Fprintln(os.Stderr, "usage: capo-calico-ipam <run|setup|check|assign|release|reserve|oracle|bench|blocks|host> [flags] (-h for a command's flags)")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	name := os.Args[1]
	if err := commands[name](ctx, os.Args[2:]); err != nil {
		if errors.Is(err, errUsage) || errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		}
		fmt.Fprintf(os.Stderr, "capo-calico-ipam %s: %v\n", name, err)
		os.Exit(asExit(err))
	}
}

// parse parses a command's flags, setting the library's log level from --log-level.
func parse(fs *flag.FlagSet, c *common, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unexpected arguments: %v\n", fs.Args())
		return errUsage
	}
	level, err := log.ParseLevel(c.logLevel)
	if err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log.SetLevel(level)
	return nil
}

// printJSON writes v to stdout, indented.
func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// splitList splits "a,b,,c" into [a b c].
func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}
