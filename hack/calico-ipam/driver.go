package main

// `run`: the driver. For every Pod on a kwok node (kwok fakes the kubelet but, with
// capo's stage file, neither assigns IPs nor deletes Pods) it does what a kubelet with
// the calico-ipam CNI plugin does:
//
//   - CNI ADD: AutoAssign with the handle k8s-pod-network.<pod uid> (or, for a Pod that
//     names its addresses in cni.projectcalico.org/ipAddrs, AssignIP of each, as the
//     plugin does), then the IPs go into the Pod's status (podIP, podIPs); a failed ADD
//     is retried with backoff, as the kubelet retries sandbox creation, reading the
//     Pod's annotations afresh each time;
//   - CNI DEL: release by handle, when the Pod is being deleted, has terminated, or is gone;
//   - finish a graceful deletion as a kubelet does: delete with grace 0 and a uid
//     precondition, so a recreated Pod of the same name is never deleted by mistake.
//
// Unscheduled test Pods annotated capo-test/ipam-host=<node> get IPs the same way (and
// phase Running), so tests can have Calico-assigned IPs on Pods nothing else touches.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/projectcalico/calico/libcalico-go/lib/backend/model"
	"github.com/projectcalico/calico/libcalico-go/lib/ipam"
	cnet "github.com/projectcalico/calico/libcalico-go/lib/net"
	log "github.com/sirupsen/logrus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

const (
	// handlePrefix is the calico-ipam CNI plugin's handle prefix (its network name).
	handlePrefix = "k8s-pod-network."
	// annotationHost asks the driver to give an unscheduled Pod IPs as if it ran there.
	annotationHost = "capo-test/ipam-host"
	// annotationFamilies picks the Pod's IP families: v4, v6 or v4,v6.
	annotationFamilies = "capo-test/ip-families"
	// annotationIPAddrs names the Pod's addresses, as with Calico's CNI plugin: each is
	// assigned with AssignIP (which ignores IPReservations), none is auto-assigned.
	annotationIPAddrs = "cni.projectcalico.org/ipAddrs"
	// annotationIPv4Pools and annotationIPv6Pools pick a Pod's pools, as with Calico's CNI plugin.
	annotationIPv4Pools = "cni.projectcalico.org/ipv4pools"
	annotationIPv6Pools = "cni.projectcalico.org/ipv6pools"
	// kwokAnnotation marks the Nodes kwok manages (hack/testenv/src/nodes.rs).
	kwokAnnotation = "kwok.x-k8s.io/node"
)

// events is the driver's own log (CNI ADD/DEL, deletions, counters), at info level
// whatever --log-level says for Calico's library.
var events = func() *log.Logger {
	l := log.New()
	l.SetLevel(log.InfoLevel)
	return l
}()

type driver struct {
	cal      *calico
	kube     kubernetes.Interface
	pods     cache.Indexer
	nodes    listersv1.NodeLister
	queue    workqueue.RateLimitingInterface
	families families
	// hostLocks serialises IPAM on a host, as calico-ipam's host-wide lock does on a
	// node (concurrent assignments in one block only cause write conflicts and retries).
	hostLocks sync.Map // host -> *sync.Mutex
	// counters, logged every minute and on exit
	assigned, released, finished, refused atomic.Int64
}

func cmdRun(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	var c common
	var s setupFlags
	c.register(fs)
	s.register(fs)
	fam := fs.String("families", "v4", "IP families of a Pod without the "+annotationFamilies+" annotation")
	workers := fs.Int("workers", 4, "Pods handled at once")
	ready := fs.String("ready-file", "", "write this file once the informers are synced")
	gcEvery := fs.Duration("gc-interval", 30*time.Second, "release handles of Pods that are gone this often")
	if err := parse(fs, &c, args); err != nil {
		return err
	}
	defaults, err := parseFamilies(*fam)
	if err != nil {
		return err
	}
	cal, err := s.setup(ctx, &c)
	if err != nil {
		return err
	}
	kube, err := c.kubeClient()
	if err != nil {
		return err
	}
	factory := informers.NewSharedInformerFactory(kube, 0)
	podInformer := factory.Core().V1().Pods().Informer()
	nodeLister := factory.Core().V1().Nodes().Lister()
	d := &driver{
		cal:      cal,
		kube:     kube,
		pods:     podInformer.GetIndexer(),
		nodes:    nodeLister,
		queue:    workqueue.NewRateLimitingQueue(workqueue.NewItemExponentialFailureRateLimiter(50*time.Millisecond, 5*time.Second)),
		families: defaults,
	}
	defer d.queue.ShutDown()
	_, err = podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { d.enqueuePod(obj) },
		UpdateFunc: func(_, obj any) { d.enqueuePod(obj) },
		DeleteFunc: d.podGone,
	})
	if err != nil {
		return err
	}
	factory.Start(ctx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("the %v informer did not sync", typ)
		}
	}
	for i := 0; i < *workers; i++ {
		go wait.UntilWithContext(ctx, d.work, time.Second)
	}
	go wait.UntilWithContext(ctx, d.collectGarbage, *gcEvery)
	go wait.UntilWithContext(ctx, d.logCounters, time.Minute)
	events.WithFields(log.Fields{"datastore": c.datastore, "families": defaults.String()}).Info("capo-calico-ipam: ready (Calico IPAM " + calicoVersion + ")")
	if *ready != "" {
		if err := os.WriteFile(*ready, []byte("ready\n"), 0o644); err != nil {
			return err
		}
	}
	<-ctx.Done()
	d.logCounters(context.Background())
	return nil
}

func (d *driver) logCounters(context.Context) {
	events.WithFields(log.Fields{
		"assigned": d.assigned.Load(), "released": d.released.Load(),
		"deletionsFinished": d.finished.Load(), "deletionsRefusedByUID": d.refused.Load(),
	}).Info("counters")
}

// Queue items: "pod/<namespace>/<name>" or "handle/<handle>" (a Pod that is gone).
func (d *driver) enqueuePod(obj any) {
	if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
		d.queue.Add("pod/" + key)
	}
}

func (d *driver) podGone(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if pod, ok := obj.(*corev1.Pod); ok {
		d.queue.Add("handle/" + handleOf(pod.UID))
	}
}

func handleOf(uid types.UID) string { return handlePrefix + string(uid) }

func (d *driver) work(ctx context.Context) {
	for {
		item, quit := d.queue.Get()
		if quit {
			return
		}
		key := item.(string)
		err := d.handle(ctx, key)
		if err != nil && ctx.Err() == nil {
			events.WithError(err).WithField("item", key).Warn("retrying")
			d.queue.AddRateLimited(key)
		} else {
			d.queue.Forget(key)
		}
		d.queue.Done(key)
	}
}

func (d *driver) handle(ctx context.Context, item string) error {
	if handle, ok := strings.CutPrefix(item, "handle/"); ok {
		released, err := d.cal.releaseHandle(ctx, handle)
		if released {
			d.released.Add(1)
			events.WithField("handle", handle).Info("CNI DEL: the Pod is gone, released")
		}
		return err
	}
	obj, exists, err := d.pods.GetByKey(strings.TrimPrefix(item, "pod/"))
	if err != nil || !exists {
		return err
	}
	pod := obj.(*corev1.Pod)
	host, ok := d.hostOf(pod)
	if !ok {
		return nil
	}
	handle := handleOf(pod.UID)
	lock, _ := d.hostLocks.LoadOrStore(host, &sync.Mutex{})
	lock.(*sync.Mutex).Lock()
	defer lock.(*sync.Mutex).Unlock()
	switch {
	case pod.DeletionTimestamp != nil:
		if _, err := d.release(ctx, pod, handle, "deleted"); err != nil {
			return err
		}
		if pod.Spec.NodeName != "" {
			return d.finishDeletion(ctx, pod)
		}
		return nil
	case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		// The kubelet tears the sandbox down: CNI DEL. The IPs stay in the status.
		_, err := d.release(ctx, pod, handle, string(pod.Status.Phase))
		return err
	case pod.Status.PodIP != "":
		return nil
	default:
		return d.assign(ctx, pod, host, handle)
	}
}

// hostOf says on which host the Pod's network lives, if the driver serves it: a kwok
// node, or the node an unscheduled test Pod names in its annotation.
func (d *driver) hostOf(pod *corev1.Pod) (string, bool) {
	if pod.Spec.HostNetwork {
		return "", false
	}
	if pod.Spec.NodeName == "" {
		host := pod.Annotations[annotationHost]
		return host, host != ""
	}
	node, err := d.nodes.Get(pod.Spec.NodeName)
	if err != nil || node.Annotations[kwokAnnotation] != "fake" {
		return "", false
	}
	return node.Name, true
}

func (d *driver) familiesOf(pod *corev1.Pod) (families, error) {
	if s, ok := pod.Annotations[annotationFamilies]; ok {
		return parseFamilies(s)
	}
	return d.families, nil
}

// assign is CNI ADD: the handle's addresses if a previous attempt got them, else a new
// AutoAssign; then the Pod's status, guarded by its uid.
func (d *driver) assign(ctx context.Context, pod *corev1.Pod, host, handle string) error {
	fam, err := d.familiesOf(pod)
	if err != nil {
		events.WithError(err).WithField("pod", pod.Namespace+"/"+pod.Name).Error("bad " + annotationFamilies + " annotation; no IPs")
		return nil
	}
	start := time.Now()
	var ips []string
	what := "CNI ADD"
	existing, err := d.cal.client.IPAM().IPsByHandle(ctx, handle)
	switch {
	case err == nil && len(existing) > 0:
		// An earlier attempt assigned them (or the status was read before it was written).
		what = "CNI ADD (the handle's addresses)"
		for _, ip := range existing {
			ips = append(ips, ip.String())
		}
	case err == nil || isNotFound(err):
		if err := d.cal.ensureHost(ctx, host); err != nil {
			return err
		}
		attrs := map[string]string{
			ipam.AttributeNode:      host,
			ipam.AttributeNamespace: pod.Namespace,
			ipam.AttributePod:       pod.Name,
			ipam.AttributeTimestamp: time.Now().UTC().Format(time.RFC3339),
		}
		if named, ok := pod.Annotations[annotationIPAddrs]; ok {
			what = "CNI ADD (ipAddrs)"
			assigned, err := d.cal.assignNamed(ctx, host, handle, named, attrs)
			if err != nil {
				events.WithError(err).WithFields(log.Fields{"pod": pod.Namespace + "/" + pod.Name, "uid": pod.UID}).Warn("CNI ADD failed (ipAddrs); retrying")
				return err
			}
			ips = append(ips, assigned...)
			d.assigned.Add(1)
			break
		}
		v4Pools, err := d.cal.requestedPools(ctx, pod.Annotations[annotationIPv4Pools])
		if err != nil {
			return err
		}
		v6Pools, err := d.cal.requestedPools(ctx, pod.Annotations[annotationIPv6Pools])
		if err != nil {
			return err
		}
		assigned, err := d.cal.autoAssignIn(ctx, host, handle, fam, attrs, v4Pools, v6Pools)
		if err != nil {
			return err
		}
		for _, ipn := range assigned {
			ips = append(ips, ipn.IP.String())
		}
		d.assigned.Add(1)
	default:
		return fmt.Errorf("reading handle %s: %w", handle, err)
	}
	ips = v4First(ips)
	status := map[string]any{"podIP": ips[0], "podIPs": podIPs(ips)}
	if pod.Spec.NodeName == "" {
		status["phase"] = corev1.PodRunning
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"uid": pod.UID}, "status": status})
	_, err = d.kube.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		// Gone or replaced (the uid no longer matches): CNI DEL for what was assigned.
		_, rerr := d.release(ctx, pod, handle, "gone before its IPs were written")
		return rerr
	}
	if err != nil {
		return fmt.Errorf("writing the IPs %v into Pod %s/%s: %w", ips, pod.Namespace, pod.Name, err)
	}
	events.WithFields(log.Fields{"pod": pod.Namespace + "/" + pod.Name, "uid": pod.UID, "host": host, "ips": ips,
		"took": time.Since(start).Round(time.Millisecond)}).Info(what)
	return nil
}

func (d *driver) release(ctx context.Context, pod *corev1.Pod, handle, why string) (bool, error) {
	released, err := d.cal.releaseHandle(ctx, handle)
	if released {
		d.released.Add(1)
		events.WithFields(log.Fields{"pod": pod.Namespace + "/" + pod.Name, "uid": pod.UID, "why": why}).Info("CNI DEL")
	}
	return released, err
}

// finishDeletion deletes the Pod with grace 0 and its uid as a precondition, as a
// kubelet does once the containers are gone. kwok's own pod-delete stage deletes by
// name, which can remove the recreated Pod of a StatefulSet; this never does.
func (d *driver) finishDeletion(ctx context.Context, pod *corev1.Pod) error {
	if g := pod.DeletionGracePeriodSeconds; g != nil && *g == 0 {
		return nil // already finished; finalizers (if any) keep the object
	}
	zero := int64(0)
	uid := pod.UID
	err := d.kube.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: &zero,
		Preconditions:      &metav1.Preconditions{UID: &uid},
	})
	switch {
	case err == nil:
		d.finished.Add(1)
		return nil
	case apierrors.IsNotFound(err):
		return nil
	case apierrors.IsConflict(err):
		d.refused.Add(1)
		events.WithFields(log.Fields{"pod": pod.Namespace + "/" + pod.Name, "uid": uid}).Warn("not deleting: the Pod of that name has another uid now")
		return nil
	default:
		return fmt.Errorf("finishing the deletion of Pod %s/%s (uid %s): %w", pod.Namespace, pod.Name, uid, err)
	}
}

// collectGarbage releases the handles of Pods that are gone (deleted while the driver
// was down, say), as calico-kube-controllers' IPAM garbage collection does.
func (d *driver) collectGarbage(ctx context.Context) {
	kvs, err := d.cal.backend.List(ctx, model.IPAMHandleListOptions{}, "")
	if err != nil {
		events.WithError(err).Warn("listing IPAM handles")
		return
	}
	live := map[string]bool{}
	for _, obj := range d.pods.List() {
		live[handleOf(obj.(*corev1.Pod).UID)] = true
	}
	for _, kv := range kvs.KVPairs {
		key, ok := kv.Key.(model.IPAMHandleKey)
		if ok && strings.HasPrefix(key.HandleID, handlePrefix) && isPodUID(key.HandleID[len(handlePrefix):]) && !live[key.HandleID] {
			d.queue.Add("handle/" + key.HandleID)
		}
	}
}

// isPodUID says whether a handle's suffix is a Pod UID, as the driver names its handles.
// Calico's CNI plugin on a real node names its handles k8s-pod-network.<container id>
// (64 hex digits): those belong to the plugin and its node, and are never the driver's
// to free.
func isPodUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i, c := range s {
		switch {
		case i == 8 || i == 13 || i == 18 || i == 23:
			if c != '-' {
				return false
			}
		case !strings.ContainsRune("0123456789abcdef", c):
			return false
		}
	}
	return true
}

func podIPs(ips []string) []map[string]string {
	out := make([]map[string]string, len(ips))
	for i, ip := range ips {
		out[i] = map[string]string{"ip": ip}
	}
	return out
}

// v4First orders a dual-stack Pod's IPs IPv4 first, as a v4-primary cluster lists them.
func v4First(ips []string) []string {
	var v4, v6 []string
	for _, ip := range ips {
		if p := cnet.ParseIP(ip); p != nil && p.Version() == 4 {
			v4 = append(v4, ip)
		} else {
			v6 = append(v6, ip)
		}
	}
	return append(v4, v6...)
}
