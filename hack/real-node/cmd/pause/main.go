// pause: the sandbox process of the real node's Pods (what registry.k8s.io/pause is to a
// cluster): it holds the Pod's namespaces and exits on SIGTERM or SIGINT.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
