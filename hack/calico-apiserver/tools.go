//go:build tools

// The command built here lives in the Calico module; this file only pins it in go.mod.
package tools

import _ "github.com/projectcalico/calico/apiserver/pkg/apiserver"
