// listen: the real node's test workload, a stand-in for Redis or ZooKeeper: it listens on
// TCP (LISTEN_ADDR, default :6379) and answers every connection with the Pod's name
// (POD_NAME) and a newline, so a test can tell which Pod an address reaches. It exits on
// SIGTERM or SIGINT.
package main

import (
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	addr := os.Getenv("LISTEN_ADDR")
	if addr == "" {
		addr = ":6379"
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "listen %s: %v\n", addr, err)
		os.Exit(1)
	}
	fmt.Printf("listening on %s\n", l.Addr())
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(c, "%s\n", os.Getenv("POD_NAME"))
			c.Close()
		}
	}()
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
