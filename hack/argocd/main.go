// Command argocd is the part of Argo CD that capo's GitOps tests run: one multi-call
// binary, like Argo CD's own image, whose component is picked by ARGOCD_BINARY_NAME (or
// the name it is called by). Only the components that sync Applications out of cluster
// are linked in: the application controller, the repo server, and the git credential
// helper the repo server calls.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	appcontroller "github.com/argoproj/argo-cd/v3/cmd/argocd-application-controller/commands"
	gitaskpass "github.com/argoproj/argo-cd/v3/cmd/argocd-git-ask-pass/commands"
	reposerver "github.com/argoproj/argo-cd/v3/cmd/argocd-repo-server/commands"
	"github.com/argoproj/argo-cd/v3/common"
	"github.com/argoproj/argo-cd/v3/util/log"
)

func main() {
	// As Argo CD's own entry point does: klog through Argo CD's logger. (Its entry point
	// also calls grpc.DisableSRVLookups, which panics unless some linked package turned
	// SRV lookups on: grpc 1.84 has them off by default, and nothing here turns them on.)
	klog.SetLogger(log.NewLogrusLogger(log.NewWithCurrentConfig()))

	name := filepath.Base(os.Args[0])
	if v := os.Getenv("ARGOCD_BINARY_NAME"); v != "" {
		name = v
	}
	var command *cobra.Command
	switch name {
	case common.CommandApplicationController:
		command = appcontroller.NewCommand()
	case common.CommandRepoServer:
		command = reposerver.NewCommand()
	case common.CommandGitAskPass:
		command = gitaskpass.NewCommand()
	default:
		fmt.Fprintf(os.Stderr, "argocd: unknown component %q (set ARGOCD_BINARY_NAME to %s, %s or %s)\n",
			name, common.CommandApplicationController, common.CommandRepoServer, common.CommandGitAskPass)
		os.Exit(2)
	}
	if err := command.Execute(); err != nil {
		os.Exit(1)
	}
}
