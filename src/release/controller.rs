//! The leader's controller: watches → indexes → a keyed work queue → per-key reconciles →
//! the reservation owner ([`crate::calico`]) and the record writes.
//!
//! Keys: a record (its countdown, release, missing entry), a policy (its cap and gauges),
//! a policy's release slot (pacing), a reservation shard (repair), a Pod (the safety
//! net). An event touches only the keys it concerns — a Pod's event its own records and
//! itself, a policy's edit that policy's records, a shard's change the records of the
//! entries it gained or lost. A reconcile says when to look again; a failed one comes back
//! with backoff (`capo_release_retries_total`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capo_api::CalicoApiGroup;
use capo_api::keys::RELEASED_ANNOTATION;
use capo_api::reserved_ip::record_name;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, ResourceExt};
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::announce::{Announce, Announcer};
use super::decide::{self, Action, Facts, PlanSettings, PodState, ReleaseReason};
use super::pacer::{Leaving, Pacer, Taken};
use super::queue::WorkQueue;
use super::writes::{RecordFate, RecordWrites, ReleaseError};
use super::{cap, consistency, repair};
use crate::calico::Datastore;
use crate::calico::pools::{PoolStore, detect_ipam_api};
use crate::calico::{IndexEvent, ReservationIndex, Reservations, entry};
use crate::hold::safety_net::SafetyNet;
use crate::hold::{HoldWriter, marks};
use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::policy::{CompiledPolicy, SharedMatcher};
use crate::store::pods::PodEvent;
use crate::store::records::RecordEvent;
use crate::store::workloads::{Owner, WorkloadEvent};
use crate::store::{NamespaceStore, PodStore, RecordIndex, WorkloadStore};

/// The default of `--max-pool-share`: capo's holds may take at most half of a pool's
/// unallocated addresses, so a new Pod always finds at least as many free addresses as
/// capo holds (docs/calico.md).
pub const DEFAULT_MAX_POOL_SHARE: u32 = 50;

/// How long a shard's changes are gathered before repair looks at it. A look reads every
/// entry of the shard, and each hold changes its shard and its record: looking once per
/// change made a hold's cost grow with the shard. Repair acts only on mismatches older
/// than the settle time (seconds), and a non-CIDR entry is still removed within this.
const SHARD_GATHER: Duration = Duration::from_millis(500);

/// How long record changes are gathered before their policy's cap is looked at (a look
/// reads all of the policy's holds; a storm changes many at once). Well within any
/// `releaseInterval`.
const POLICY_GATHER: Duration = Duration::from_millis(100);

/// A release slot's writes at once: its shards, then its records. A slot takes every
/// release that is due (up to `releaseBatch`), so these bound how many releases a second
/// one policy keeps up with while the API server is busy: 20,000 holds in 4 minutes (about
/// 90 a second, `tests/scale.rs` by hand) fell further behind with 16 record deletions at
/// once (about 70 a second kept up with).
const SLOT_SHARDS_AT_ONCE: usize = 16;
const SLOT_RECORDS_AT_ONCE: usize = 64;
/// The longest wait before a release whose Pod could not be marked is tried again.
const MARK_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// How often a release waits for its Pod's mark (2 s, doubling: about 2 minutes in all)
/// before it goes without it.
const MARK_ATTEMPTS: u32 = 6;

/// How long pool changes are gathered before the pool guard looks (every Pod start and
/// stop in the cluster changes an IPAM block).
const POOL_SETTLE: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
pub struct EngineSettings {
    pub plan: PlanSettings,
    /// Only act on policies whose name starts with this (tests share one API server).
    pub policy_prefix: Option<String>,
    /// Namespaces the safety net never holds in (kube-system, capo's own).
    pub excluded_namespaces: Vec<String>,
    /// How many keys are worked on at once (status writes, releases, holds).
    pub workers: usize,
    /// The most of a Calico IP pool's unallocated addresses all policies together may
    /// hold, in percent (`--max-pool-share`); `maxPoolShare` bounds one policy.
    pub max_pool_share: u32,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            plan: PlanSettings::default(),
            policy_prefix: None,
            excluded_namespaces: vec![],
            workers: 8,
            max_pool_share: DEFAULT_MAX_POOL_SHARE,
        }
    }
}

/// What the engine needs from the rest of capo.
pub struct ReleaseEngine {
    pub client: Client,
    pub reservations: Reservations,
    pub served: Vec<CalicoApiGroup>,
    pub pods: Arc<PodStore>,
    pub namespaces: Arc<NamespaceStore>,
    pub matcher: SharedMatcher,
    pub policy_changes: broadcast::Sender<()>,
    pub settings: EngineSettings,
    pub metrics: Arc<Metrics>,
    pub identity: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Key {
    Record(String),
    Policy(String),
    Release(String),
    Shard(CalicoApiGroup, String),
    Pod(String, String),
    /// A Calico IP pool (the pool guard).
    Pool(String),
    /// A policy's summary of a burst of holds (an `IPsHeld` Event).
    Held(String),
}

impl Key {
    fn kind(&self) -> &'static str {
        match self {
            Self::Record(_) => "record",
            Self::Policy(_) => "policy",
            Self::Release(_) => "release",
            Self::Shard(..) => "shard",
            Self::Pod(..) => "pod",
            Self::Pool(_) => "pool",
            Self::Held(_) => "held",
        }
    }
}

/// Where a hold stands for the cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// Its Pod is still there (a refused eviction, a denied review): it goes first.
    Present,
    /// Held a moment ago, its Pod still in the store: settled at that time.
    Unsettled(Timestamp),
    Gone,
}

/// The leader's memory between reconciles.
#[derive(Default)]
struct Memory {
    /// Record → since when its entry has been missing.
    missing: HashMap<String, Timestamp>,
    /// Shard → its mismatched entries, with when first seen.
    first_seen: HashMap<(CalicoApiGroup, String), HashMap<String, Timestamp>>,
    /// Records announced (by name: the uid of the hold announced), forgotten with the
    /// record.
    announced: HashMap<String, String>,
    /// Record → (its uid, when the leader's stores first showed its Pod gone), until its
    /// countdown is written: the countdown starts there, however long the hold waits for
    /// a worker.
    gone_seen: HashMap<String, (String, Timestamp)>,
    /// Per policy: holds announced one by one, and a burst's summary.
    announcer: Announcer,
    /// Policies past their cap (a `CapReached` Event when one gets there).
    over_cap: HashSet<String>,
    /// (pool, policy) pairs the pool guard is releasing from (a `PoolShareReached` Event
    /// when one gets there).
    over_pool: HashSet<(String, String)>,
    /// Foreign entries per shard, as last reported.
    foreign: HashMap<(CalicoApiGroup, String), (String, Vec<String>)>,
    /// Holds that arrived, per policy (to size cap release slots).
    arrivals: HashMap<String, VecDeque<Instant>>,
    /// The compiled policies as last seen (to tell which ones an update changed).
    policies: BTreeMap<String, Arc<CompiledPolicy>>,
    /// Record → how often its Pod could not be marked before its release (the backoff).
    unmarked: HashMap<String, u32>,
    /// Record → (its uid, when its Pod left): holds whose Pod stayed at first (a refused
    /// eviction) and left later count against the cap from then, not from the hold.
    left: HashMap<String, (String, Timestamp)>,
    /// Records reported as inconsistent (by name: the uid reported), forgotten with the
    /// record.
    inconsistent: HashMap<String, String>,
}

struct Ctx {
    client: Client,
    fence: Fence,
    reservations: Reservations,
    index: Arc<ReservationIndex>,
    pods: Arc<PodStore>,
    namespaces: Arc<NamespaceStore>,
    workloads: Arc<WorkloadStore>,
    records: Arc<RecordIndex>,
    /// Calico's pools and IPAM blocks, when the cluster serves them (the pool guard).
    pools: Option<Arc<PoolStore>>,
    matcher: SharedMatcher,
    metrics: Arc<Metrics>,
    recorder: Recorder,
    writes: RecordWrites,
    net: SafetyNet,
    settings: EngineSettings,
    queue: WorkQueue<Key>,
    pacer: Mutex<Pacer>,
    memory: Mutex<Memory>,
    started: Timestamp,
}

/// `at` on the monotonic clock.
fn instant(at: Timestamp) -> Instant {
    let d = at.duration_since(Timestamp::now());
    Instant::now() + Duration::try_from(d).unwrap_or_default()
}

/// The API server refuses an Event whose note is longer than 1024 bytes (an API error
/// quoted in full can be): cut at a character boundary, marked with an ellipsis.
fn fit_note(mut note: String) -> String {
    const MAX: usize = 1024;
    if note.len() <= MAX {
        return note;
    }
    let mut end = MAX - '…'.len_utf8();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push('…');
    note
}

fn policy_ref(name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("capo.io/v1alpha1".into()),
        kind: Some("CapoPolicy".into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

fn pod_ref(namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: (!uid.is_empty()).then(|| uid.into()),
        ..Default::default()
    }
}

impl ReleaseEngine {
    /// The pool guard's store of Calico's pools and IPAM blocks, watched from wherever Calico
    /// keeps them (`None`: they are not served here, no pool guard).
    async fn pool_guard(&self, tasks: &mut Vec<tokio::task::JoinHandle<()>>) -> Option<Arc<PoolStore>> {
        let store = Arc::new(PoolStore::default());
        let share = self.settings.max_pool_share;
        match self.reservations.datastore() {
            Datastore::Etcd(etcd) => {
                info!(max_pool_share = share, "pool guard: watching Calico's IP pools in its etcd");
                tasks.extend(store.watch_etcd(etcd));
            }
            Datastore::Kubernetes(_) => {
                let Some(api_version) = detect_ipam_api(&self.client).await else {
                    info!("pool guard: Calico's IPAM blocks are not served here; no pool guard");
                    return None;
                };
                info!(api_version, max_pool_share = share, "pool guard: watching Calico's IP pools");
                tasks.extend(store.watch(&self.client, &api_version));
            }
        }
        Some(store)
    }

    /// Runs until this replica stops leading.
    pub async fn run(&self, fence: Fence) {
        let records = Arc::new(RecordIndex::default());
        let workloads = Arc::new(WorkloadStore::new(Some(self.metrics.release.owner_kinds.clone())));
        let mut tasks = vec![tokio::spawn(records.clone().watch(self.client.clone()))];
        tasks.extend(workloads.watch(&self.client));
        let pools = self.pool_guard(&mut tasks).await;
        let _abort = AbortOnDrop(tasks);
        // Subscribed before anything is listed, so no change is missed.
        let rx = Receivers {
            pods: self.pods.subscribe(),
            namespaces: self.namespaces.subscribe(),
            workloads: workloads.subscribe(),
            records: records.subscribe(),
            index: self.reservations.index().subscribe(),
            policies: self.policy_changes.subscribe(),
            pools: pools.as_ref().map(|p| p.subscribe()),
        };
        let index = self.reservations.index().clone();
        let synced = async {
            records.synced().await;
            workloads.synced().await;
            for g in &self.served {
                index.synced(*g).await;
            }
        };
        tokio::select! {
            _ = synced => {}
            _ = fence.lost() => return,
        }
        let prefix = self.settings.policy_prefix.clone();
        let in_scope = move |p: &str| prefix.as_deref().is_none_or(|x| p.starts_with(x));
        match self.reservations.stamp_all(&fence, in_scope).await {
            Ok(n) => info!(epoch = fence.epoch(), stamped = n, "leader: raised the epoch on capo's reservations"),
            Err(e)
                if matches!(
                    e,
                    crate::calico::CalicoError::Fenced { .. } | crate::calico::CalicoError::NotLeader(_)
                ) =>
            {
                warn!(error = %e, "leader: another replica leads");
                return;
            }
            Err(e) => {
                warn!(error = %e, "leader: could not raise the epoch everywhere yet; it is raised before each write")
            }
        }
        let reporter = Reporter { controller: "capo".into(), instance: Some(self.identity.clone()) };
        let recorder = Recorder::new(self.client.clone(), reporter);
        let writer = HoldWriter::new(self.client.clone(), self.reservations.clone()).with_pods(self.pods.clone());
        let ctx = Arc::new(Ctx {
            client: self.client.clone(),
            fence: fence.clone(),
            reservations: self.reservations.clone(),
            index: index.clone(),
            pods: self.pods.clone(),
            namespaces: self.namespaces.clone(),
            workloads: workloads.clone(),
            records: records.clone(),
            pools,
            matcher: self.matcher.clone(),
            metrics: self.metrics.clone(),
            recorder: recorder.clone(),
            writes: RecordWrites::new(self.client.clone(), fence.clone()),
            net: SafetyNet::new(
                self.client.clone(),
                writer,
                self.pods.clone(),
                self.namespaces.clone(),
                workloads.clone(),
                records.clone(),
                self.matcher.clone(),
                self.metrics.clone(),
                recorder,
                self.settings.excluded_namespaces.clone(),
                self.settings.policy_prefix.clone(),
            ),
            settings: self.settings.clone(),
            queue: WorkQueue::new(Duration::from_millis(250), Duration::from_secs(30)),
            pacer: Mutex::new(Pacer::default()),
            memory: Mutex::new(Memory::default()),
            started: Timestamp::now(),
        });
        ctx.enqueue_everything();
        info!(records = records.all_names().len(), "leader: release controller running");
        let pump = tokio::spawn(ctx.clone().pump(rx));
        let workers: Vec<_> = (0..self.settings.workers.max(1)).map(|_| tokio::spawn(ctx.clone().work())).collect();
        // Declared first, so dropped last: also when the caller drops this future as the
        // Lease is lost (it selects on that too) before the line below runs.
        let _end = TermEnd(ctx.clone());
        let _stop = AbortOnDrop(workers.into_iter().chain([pump]).collect());
        fence.lost().await;
        info!("leader: lost the Lease; the release controller stops");
    }
}

/// What a term leaves behind when it ends, however it ends: no queue, no memory of Pods
/// looked at (a follower looks at nothing), no pool gauges (a stale gauge would outlive
/// what it measured).
struct TermEnd(Arc<Ctx>);

impl Drop for TermEnd {
    fn drop(&mut self) {
        let ctx = &self.0;
        ctx.queue.close();
        ctx.net.clear();
        for p in ctx.pools.iter().flat_map(|s| s.pools()) {
            ctx.metrics.release.pools.forget(&p.name);
        }
    }
}

struct AbortOnDrop(Vec<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

struct Receivers {
    pods: broadcast::Receiver<PodEvent>,
    namespaces: broadcast::Receiver<String>,
    workloads: broadcast::Receiver<WorkloadEvent>,
    records: broadcast::Receiver<RecordEvent>,
    index: broadcast::Receiver<IndexEvent>,
    policies: broadcast::Receiver<()>,
    pools: Option<broadcast::Receiver<String>>,
}

/// The next pool change, or never when there is no pool guard.
async fn next_pool(rx: &mut Option<broadcast::Receiver<String>>) -> Result<String, RecvError> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// A received event, or a sign that some were lost (look at everything again).
fn got<T: Clone>(r: Result<T, RecvError>) -> Option<Option<T>> {
    match r {
        Ok(v) => Some(Some(v)),
        Err(RecvError::Lagged(_)) => Some(None),
        Err(RecvError::Closed) => None,
    }
}

impl Ctx {
    fn in_scope(&self, policy: &str) -> bool {
        self.settings.policy_prefix.as_deref().is_none_or(|p| policy.starts_with(p))
    }

    fn enqueue_everything(&self) {
        // A store listed afresh: what was seen gone is seen again (or not) from here on.
        self.memory.lock().expect("memory lock").gone_seen.clear();
        for name in self.records.all_names() {
            self.queue.add(Key::Record(name));
        }
        let mut policies: BTreeSet<String> = self.records.policies().into_iter().collect();
        policies.extend(self.matcher.load().policies().iter().map(|p| p.name.clone()));
        for p in policies {
            self.queue.add(Key::Policy(p));
        }
        for (group, view) in self.index.all().into_values() {
            self.queue.add(Key::Shard(group, view.name.clone()));
        }
        for (ns, name) in self.pods.keys() {
            self.pod_changed(&ns, &name);
        }
        self.policies_changed();
        self.all_pools_changed();
    }

    fn all_pools_changed(&self) {
        for p in self.pools.iter().flat_map(|s| s.pools()) {
            self.queue.add_after(Key::Pool(p.name), POOL_SETTLE);
        }
    }

    /// A hold in `cidr` came or went: its pool's share changed.
    fn pool_of_changed(&self, cidr: &str) {
        if let (Some(store), Some(ip)) = (&self.pools, entry::single_ip(cidr))
            && let Some(pool) = store.pool_of(ip)
        {
            self.queue.add_after(Key::Pool(pool.name), POOL_SETTLE);
        }
    }

    /// A Pod changed: its records, and the safety net (a Pod being deleted after a moment,
    /// so its owner's deletion — a cascade — is known by then).
    fn pod_changed(&self, namespace: &str, name: &str) {
        for r in self.records.for_pod(namespace, name) {
            if let Some(rec) = self.records.get(&r) {
                self.note_pod_gone(&rec);
                // Whether its Pod is still there decides its place at the cap.
                if self.in_scope(&rec.spec.policy) {
                    self.queue.add_after(Key::Policy(rec.spec.policy.clone()), POLICY_GATHER);
                }
            }
            self.queue.add(Key::Record(r));
        }
        let key = Key::Pod(namespace.to_string(), name.to_string());
        match self.pods.get(namespace, name) {
            Some(p) if p.terminal() => self.queue.add(key),
            Some(p) if p.deleting => self.queue.add_after(key, self.settings.plan.settle.min(Duration::from_secs(2))),
            Some(_) => {}
            None => self.net.forget(namespace, name),
        }
    }

    /// Notes when the stores first showed `rec`'s Pod gone, while its countdown is not
    /// written yet (`Facts::seen_gone`), and has the hold looked at when that countdown
    /// runs out, even if it still waits behind a backlog of new holds by then; forgets it
    /// if the Pod is back (a relist).
    fn note_pod_gone(&self, rec: &capo_api::ReservedIP) {
        if rec.status.as_ref().is_some_and(|s| s.pod_gone_at.is_some()) {
            return;
        }
        let pod = self.pods.get(&rec.spec.pod.namespace, &rec.spec.pod.name);
        let departed = self.pods.saw_depart(&rec.spec.pod.uid);
        let gone = decide::pod_state(rec, pod.as_deref()) == PodState::Gone
            && !decide::missing_too_soon(rec, pod.as_deref(), departed, Timestamp::now(), &self.settings.plan);
        let uid = rec.uid().unwrap_or_default();
        let mut memory = self.memory.lock().expect("memory lock");
        if !gone {
            memory.gone_seen.remove(&rec.name_any());
        } else if memory.gone_seen.get(&rec.name_any()).is_none_or(|(u, _)| *u != uid) {
            let now = Timestamp::now();
            memory.gone_seen.insert(rec.name_any(), (uid, now));
            drop(memory);
            let due = decide::ttl_due(rec, now, &self.settings.plan);
            self.queue.add_at(Key::Record(rec.name_any()), instant(due));
        }
    }

    /// The policies changed: the ones whose compiled form differs, and their records.
    fn policies_changed(&self) {
        let now: BTreeMap<String, Arc<CompiledPolicy>> =
            self.matcher.load().policies().iter().map(|p| (p.name.clone(), p.clone())).collect();
        let mut memory = self.memory.lock().expect("memory lock");
        let names: BTreeSet<&String> = now.keys().chain(memory.policies.keys()).collect();
        let changed: Vec<String> =
            names.into_iter().filter(|n| now.get(*n) != memory.policies.get(*n)).cloned().collect();
        // A lowered cap (or share) is worked off at the policy's pace: the holds that came
        // before the change do not make a slot larger.
        for name in &changed {
            let lowered = match (memory.policies.get(name), now.get(name)) {
                (Some(old), Some(new)) => {
                    new.max_reserved < old.max_reserved
                        || new.max_reserved_per_namespace.unwrap_or(u32::MAX)
                            < old.max_reserved_per_namespace.unwrap_or(u32::MAX)
                }
                _ => false,
            };
            if lowered {
                memory.arrivals.remove(name);
            }
        }
        memory.policies = now;
        drop(memory);
        if !changed.is_empty() {
            self.all_pools_changed();
        }
        for p in changed {
            for r in self.records.for_policy(&p) {
                self.queue.add(Key::Record(r));
            }
            self.queue.add(Key::Policy(p));
        }
    }

    /// Turns events into keys until the engine stops.
    async fn pump(self: Arc<Self>, mut rx: Receivers) {
        loop {
            tokio::select! {
                e = rx.pods.recv() => match got(e) {
                    Some(Some(PodEvent::Changed { namespace, name })) => self.pod_changed(&namespace, &name),
                    Some(_) => {
                        self.net.prune();
                        self.enqueue_everything()
                    }
                    None => return,
                },
                e = rx.namespaces.recv() => match got(e) {
                    Some(Some(ns)) if !ns.is_empty() => {
                        for r in self.records.for_namespace(&ns) {
                            self.queue.add(Key::Record(r));
                        }
                    }
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.workloads.recv() => match got(e) {
                    Some(Some(WorkloadEvent::Changed((ns, kind, name)))) => {
                        for r in self.records.for_controller(&ns, &kind, &name) {
                            self.queue.add(Key::Record(r));
                        }
                    }
                    Some(Some(WorkloadEvent::Listed { kind })) => {
                        let owned = |r: &capo_api::ReservedIP| r.spec.pod.controller.as_ref().is_some_and(|c| c.kind == kind);
                        for r in self.records.matching(owned) {
                            self.queue.add(Key::Record(r.name_any()));
                        }
                    }
                    Some(None) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.records.recv() => match got(e) {
                    Some(Some(RecordEvent::Changed { name, before, after })) => self.record_changed(name, before, after),
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.index.recv() => match got(e) {
                    Some(Some(IndexEvent::Shard { key, added, removed })) => {
                        for e in added.iter().chain(&removed) {
                            if let Some(ip) = entry::single_ip(e) {
                                self.queue.add(Key::Record(record_name(ip)));
                            }
                        }
                        self.queue.add_after(Key::Shard(key.0, key.1), SHARD_GATHER);
                    }
                    Some(_) => self.enqueue_everything(),
                    None => return,
                },
                e = rx.policies.recv() => match got(e) {
                    Some(_) => self.policies_changed(),
                    None => return,
                },
                e = next_pool(&mut rx.pools) => match got(e) {
                    Some(Some(pool)) if !pool.is_empty() => self.queue.add_after(Key::Pool(pool), POOL_SETTLE),
                    Some(_) => self.all_pools_changed(),
                    None => return,
                },
            }
            self.metrics.release.queue_depth.set(self.queue.busy() as i64);
        }
    }

    fn record_changed(
        &self,
        name: String,
        before: Option<Arc<capo_api::ReservedIP>>,
        after: Option<Arc<capo_api::ReservedIP>>,
    ) {
        for r in before.iter().chain(&after) {
            self.pool_of_changed(&r.spec.cidr);
            self.queue.add_after(Key::Policy(r.spec.policy.clone()), POLICY_GATHER);
            if let Ok(group) = r.spec.calico_api_group.parse::<CalicoApiGroup>() {
                let group = self.index.canonical(group);
                self.queue.add_after(Key::Shard(group, r.spec.reservation.clone()), SHARD_GATHER);
            }
        }
        if let Some(old) = &before
            && after.as_ref().is_none_or(|a| a.metadata.uid != old.metadata.uid)
        {
            self.pacer.lock().expect("pacer lock").seen_gone(&name, old.metadata.uid.as_deref());
        }
        if let Some(rec) = &after {
            self.note_pod_gone(rec);
        }
        if let (None, Some(new)) = (&before, &after) {
            let mut memory = self.memory.lock().expect("memory lock");
            memory.arrivals.entry(new.spec.policy.clone()).or_default().push_back(Instant::now());
        }
        self.queue.add(Key::Record(name));
    }

    /// A worker: takes keys until the queue closes.
    async fn work(self: Arc<Self>) {
        while let Some(key) = self.queue.next().await {
            self.metrics.release.reconciles.with_label_values(&[key.kind()]).inc();
            match self.reconcile(&key).await {
                Ok(again) => {
                    self.queue.forget(&key);
                    if let Some(at) = again {
                        self.queue.add_at(key.clone(), at);
                    }
                }
                Err(e) if e.lost_lead() => {
                    debug!(error = %e, "leader: not leading any more");
                    self.queue.done(&key);
                    return;
                }
                Err(e) => {
                    let policy = self.policy_of(&key);
                    self.metrics.release.failures.with_label_values(&[&policy, e.kind()]).inc();
                    self.metrics.release.retries.with_label_values(&[&policy]).inc();
                    let after = self.queue.retry(key.clone());
                    warn!(key = ?key, error = %e, retry_in = ?after, "leader: write failed; retrying");
                    self.event(&policy_ref(&policy), EventType::Warning, "ReleaseFailed", "Release", e.to_string())
                        .await;
                }
            }
            self.queue.done(&key);
            self.metrics.release.queue_depth.set(self.queue.busy() as i64);
        }
    }

    fn policy_of(&self, key: &Key) -> String {
        match key {
            Key::Record(r) => self.records.get(r).map(|r| r.spec.policy.clone()).unwrap_or_default(),
            Key::Policy(p) | Key::Release(p) | Key::Held(p) => p.clone(),
            Key::Shard(g, n) => self.index.get(*g, n).and_then(|v| v.policy.clone()).unwrap_or_default(),
            Key::Pod(..) | Key::Pool(_) => String::new(),
        }
    }

    async fn reconcile(&self, key: &Key) -> Result<Option<Instant>, ReleaseError> {
        match key {
            Key::Record(name) => self.record(name).await,
            Key::Policy(name) => self.policy(name).await,
            Key::Release(policy) => self.release(policy).await,
            Key::Shard(group, name) => self.shard(*group, name).await,
            Key::Pod(ns, name) => {
                self.net.check(ns, name, &self.fence).await?;
                Ok(None)
            }
            Key::Pool(name) => {
                self.pool(name).await;
                Ok(None)
            }
            Key::Held(policy) => Ok(self.held_summary(policy).await),
        }
    }

    async fn event(&self, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
        let ev =
            Event { type_, reason: reason.into(), note: Some(fit_note(note)), action: action.into(), secondary: None };
        if let Err(e) = self.recorder.publish(&ev, reference).await {
            debug!(error = %e, reason, "could not publish an Event");
        }
    }

    fn owner_of(&self, rec: &capo_api::ReservedIP) -> Owner {
        rec.spec.pod.controller.as_ref().map_or(Owner::Unknown, |c| self.workloads.owner(&rec.spec.pod.namespace, c))
    }

    /// One hold: its countdown, and its release, write-back or drop when due.
    async fn record(&self, name: &str) -> Result<Option<Instant>, ReleaseError> {
        let Some(rec) = self.records.get(name) else {
            let mut memory = self.memory.lock().expect("memory lock");
            memory.missing.remove(name);
            memory.announced.remove(name);
            memory.gone_seen.remove(name);
            memory.unmarked.remove(name);
            memory.left.remove(name);
            memory.inconsistent.remove(name);
            return Ok(None);
        };
        let spec = &rec.spec;
        if !self.in_scope(&spec.policy) || self.pacer.lock().expect("pacer lock").contains(&rec) {
            return Ok(None);
        }
        if let Err(why) = consistency::check(&rec) {
            self.ignore(&rec, why).await;
            return Ok(None);
        }
        let Ok(group) = spec.calico_api_group.parse::<CalicoApiGroup>() else { return Ok(None) };
        let now = Timestamp::now();
        let entry_present = self.index.get(group, &spec.reservation).is_some_and(|v| v.position(&spec.cidr).is_some());
        let (missing_since, seen_gone) = self.remembered(&rec, entry_present, now);
        let pod = self.pods.get(&spec.pod.namespace, &spec.pod.name);
        let matcher = self.matcher.load();
        let policy = matcher.get(&spec.policy).cloned();
        let decision = decide::decide(
            &Facts {
                now,
                record: &rec,
                pod: pod.as_deref(),
                departure_seen: self.pods.saw_depart(&spec.pod.uid),
                policy: policy.as_deref(),
                entry_present,
                namespace_exists: self.namespaces.get(&spec.pod.namespace).is_some(),
                owner: self.owner_of(&rec),
                missing_since,
                seen_gone,
            },
            &self.settings.plan,
        );
        self.note_left(&rec, pod.as_deref(), now);
        self.announce(&rec).await;
        // A hold first looked at once it is already due (it waited behind a storm of new
        // holds) is released without writing the countdown it no longer needs: a worker
        // held by that write would be one more delay for every release behind it.
        let releasing = matches!(decision.action, Action::Release { .. });
        if !releasing && Some(&decision.status) != rec.status.as_ref() && decision.status != Default::default() {
            self.writes.status(&rec, &decision.status).await?;
        }
        match decision.action {
            Action::Wait(at) => Ok(at.map(instant)),
            Action::Release { reason, due } => {
                self.pacer.lock().expect("pacer lock").submit(&spec.policy, self.leaving(rec.clone(), reason, due));
                self.queue.add_urgent(Key::Release(spec.policy.clone()));
                Ok(None)
            }
            Action::WriteBack => {
                self.reservations
                    .write_back(group, &spec.reservation, &spec.policy, &spec.cidr, &self.fence)
                    .await
                    .map_err(|source| ReleaseError::Reservation { reservation: spec.reservation.clone(), source })?;
                self.metrics.release.repairs.with_label_values(&["written_back"]).inc();
                info!(record = name, reservation = %spec.reservation, "wrote a missing entry back");
                Ok(None)
            }
            Action::Drop { reason, due } => {
                if self.writes.delete(&rec).await? == RecordFate::Deleted {
                    self.released(&spec.policy, reason, due);
                    info!(record = name, reason = reason.as_str(), "dropped a record whose entry was missing");
                }
                Ok(None)
            }
        }
    }

    /// Reports, once per record, a record the leader will not act on (metric, warning,
    /// Event on the record).
    async fn ignore(&self, rec: &capo_api::ReservedIP, why: consistency::Inconsistent) {
        let (name, uid) = (rec.name_any(), rec.uid().unwrap_or_default());
        if self.memory.lock().expect("memory lock").inconsistent.insert(name.clone(), uid.clone()) == Some(uid) {
            return;
        }
        self.metrics.release.ignored_records.with_label_values(&[why.reason()]).inc();
        let spec = &rec.spec;
        warn!(
            record = %name, ip = %spec.ip, cidr = %spec.cidr, reservation = %spec.reservation, reason = why.reason(),
            "a ReservedIP capo did not write: left alone (no entry written back, nothing released)"
        );
        let note =
            format!("not acted on: {why} (ip {}, cidr {}, reservation {})", spec.ip, spec.cidr, spec.reservation);
        self.event(&kube::Resource::object_ref(rec, &()), EventType::Warning, "Inconsistent", "Ignore", note).await;
    }

    /// What this leader remembers of a hold: since when its entry has been missing (noted
    /// now if it is), and when its Pod was seen gone (while its countdown is not written).
    fn remembered(
        &self,
        rec: &capo_api::ReservedIP,
        entry_present: bool,
        now: Timestamp,
    ) -> (Option<Timestamp>, Option<Timestamp>) {
        let name = rec.name_any();
        let uid = rec.uid().unwrap_or_default();
        let mut memory = self.memory.lock().expect("memory lock");
        let seen_gone = match memory.gone_seen.get(&name) {
            Some((u, at)) if *u == uid && rec.status.as_ref().is_none_or(|s| s.pod_gone_at.is_none()) => Some(*at),
            Some(_) => {
                memory.gone_seen.remove(&name);
                None
            }
            None => None,
        };
        let missing_since = if entry_present {
            memory.missing.remove(&name);
            None
        } else {
            Some(*memory.missing.entry(name).or_insert(now))
        };
        (missing_since, seen_gone)
    }

    /// A release of `record`, decided now on its Pod's state as the store shows it.
    fn leaving(&self, record: Arc<capo_api::ReservedIP>, reason: ReleaseReason, due: Timestamp) -> Leaving {
        let p = &record.spec.pod;
        let pod = decide::pod_state(&record, self.pods.get(&p.namespace, &p.name).as_deref());
        Leaving { record, reason, due, pod }
    }

    /// Notes when the Pod of a hold that was counted as staying (`podKeptSince`) left.
    fn note_left(&self, rec: &capo_api::ReservedIP, pod: Option<&crate::pod::PodFacts>, now: Timestamp) {
        let kept_before = rec.status.as_ref().is_some_and(|s| s.pod_kept_since.is_some());
        if kept_before && decide::pod_state(rec, pod) != PodState::Kept {
            let uid = rec.uid().unwrap_or_default();
            let mut memory = self.memory.lock().expect("memory lock");
            let e = memory.left.entry(rec.name_any()).or_insert_with(|| (uid.clone(), now));
            if e.0 != uid {
                *e = (uid, now);
            }
        }
    }

    /// Where a hold stands for the cap: its Pod still there (counted as staying, or past
    /// the settle time), not known yet (held a moment ago, the Pod not yet seen leaving),
    /// or gone; and its age, from its record or from when its once-staying Pod left.
    fn cap_standing(&self, rec: &capo_api::ReservedIP, now: Timestamp) -> (Standing, Timestamp) {
        let p = &rec.spec.pod;
        let pod = self.pods.get(&p.namespace, &p.name);
        self.note_left(rec, pod.as_deref(), now);
        let kept = decide::pod_state(rec, pod.as_deref()) == PodState::Kept;
        let kept_since = rec.status.as_ref().is_some_and(|s| s.pod_kept_since.is_some());
        let settled = decide::just_held(rec, &self.settings.plan);
        let standing = match kept {
            true if kept_since || settled <= now => Standing::Present,
            true => Standing::Unsettled(settled),
            false => Standing::Gone,
        };
        let created = rec.metadata.creation_timestamp.as_ref().map_or(rec.spec.reserved_at.0, |t| t.0);
        let uid = rec.uid().unwrap_or_default();
        let left =
            self.memory.lock().expect("memory lock").left.get(&rec.name_any()).filter(|(u, _)| *u == uid).map(|l| l.1);
        (standing, left.map_or(created, |l| l.max(created)))
    }

    /// Of a slot's releases, those still what they were decided on: the record unchanged
    /// (an operator's `extend`, a new hold under the same name) and its Pod in the same
    /// state (a refused eviction retried and allowed, its hold now answered "held"). The
    /// others are looked at afresh.
    fn still_decided(&self, leaving: Vec<Leaving>) -> (Vec<Leaving>, Vec<Leaving>) {
        leaving.into_iter().partition(|l| {
            let Some(now) = self.records.get(&l.name()) else { return false };
            let p = &now.spec.pod;
            now.metadata.uid == l.record.metadata.uid
                && now.metadata.resource_version == l.record.metadata.resource_version
                && decide::pod_state(&now, self.pods.get(&p.namespace, &p.name).as_deref()) == l.pod
        })
    }

    /// A record that appeared while this replica leads: an `IPHeld` Event on its Pod, or,
    /// during a burst, a place in its policy's summary (`announce`).
    async fn announce(&self, rec: &capo_api::ReservedIP) {
        let s = &rec.spec;
        let since = self.started.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(10)).unwrap_or(self.started);
        let uid = rec.uid().unwrap_or_default();
        if s.reserved_at.0 < since || s.pod.name.is_empty() {
            return;
        }
        let verdict = {
            let mut memory = self.memory.lock().expect("memory lock");
            if memory.announced.insert(rec.name_any(), uid.clone()).as_deref() == Some(uid.as_str()) {
                return;
            }
            let what = format!("{}/{} {}", s.pod.namespace, s.pod.name, s.ip);
            memory.announcer.admit(&s.policy, what, Instant::now())
        };
        match verdict {
            Announce::Each => {
                let note = format!(
                    "capo holds {} in IPReservation {} (policy {}, trigger {:?}) for {} after the Pod is gone",
                    s.ip, s.reservation, s.policy, s.trigger, s.reserve_for
                );
                let pod = pod_ref(&s.pod.namespace, &s.pod.name, &s.pod.uid);
                self.event(&pod, EventType::Normal, "IPHeld", "Hold", note).await;
            }
            Announce::Counted { due } => self.queue.add_at(Key::Held(s.policy.clone()), due),
        }
    }

    /// A burst's `IPsHeld` Event on the policy, once its window is over; else when to look
    /// again.
    async fn held_summary(&self, policy: &str) -> Option<Instant> {
        let now = Instant::now();
        let summary = {
            let mut memory = self.memory.lock().expect("memory lock");
            memory.announcer.trim(now);
            match memory.announcer.take(policy, now) {
                Some(summary) => summary,
                None => return memory.announcer.due(policy),
            }
        };
        self.event(&policy_ref(policy), EventType::Normal, "IPsHeld", "Hold", summary.note(policy)).await;
        None
    }

    fn released(&self, policy: &str, reason: ReleaseReason, due: Option<Timestamp>) {
        let m = &self.metrics.release;
        m.releases.with_label_values(&[policy, reason.as_str()]).inc();
        if let Some(due) = due {
            let late = Timestamp::now().duration_since(due).as_secs_f64().max(0.0);
            m.lateness.with_label_values(&[policy]).observe(late);
        }
    }

    fn interval_and_batch(&self, policy: &str) -> (Duration, usize) {
        match self.matcher.load().get(policy) {
            Some(p) => (p.release_interval, p.release_batch as usize),
            None => (self.settings.plan.default_release_interval, self.settings.plan.default_release_batch),
        }
    }

    /// A policy: its gauges, and its holds past the cap (or a namespace's share).
    async fn policy(&self, name: &str) -> Result<Option<Instant>, ReleaseError> {
        if !self.in_scope(name) {
            return Ok(None);
        }
        let matcher = self.matcher.load();
        let policy = matcher.get(name).cloned();
        let holds: Vec<_> =
            self.records.records_of(name).into_iter().filter(|r| consistency::check(r).is_ok()).collect();
        let m = &self.metrics.release;
        if holds.is_empty() && policy.is_none() {
            m.forget_policy(name);
            return Ok(None);
        }
        let oldest = holds.iter().map(|r| r.spec.reserved_at.0).min();
        m.set_policy(name, holds.len(), policy.as_ref().map(|p| p.max_reserved), oldest);
        let Some(policy) = policy else { return Ok(None) };
        // Within the cap (and with no namespace share) nothing goes: no need to order them.
        let within = holds.len() <= policy.max_reserved as usize && policy.max_reserved_per_namespace.is_none();
        if within {
            self.memory.lock().expect("memory lock").over_cap.remove(name);
            return Ok(None);
        }
        let now = Timestamp::now();
        let standing: Vec<(Standing, Timestamp)> = holds.iter().map(|r| self.cap_standing(r, now)).collect();
        // A hold made a moment ago whose Pod still looks there may be a deletion the Pod
        // store has not shown yet, or an eviction about to be refused; if the latter, it
        // would go first. So it is left out of the choice (as if it went first): only what
        // goes whichever it turns out to be is chosen now, the rest once it is settled (a
        // Pod event brings that forward).
        let unsettled = standing
            .iter()
            .filter_map(|(s, _)| match s {
                Standing::Unsettled(at) => Some(*at),
                _ => None,
            })
            .min();
        let victims = {
            let pacer = self.pacer.lock().expect("pacer lock");
            let counted: Vec<cap::Counted<'_>> = holds
                .iter()
                .zip(&standing)
                .filter(|(r, (s, _))| !pacer.contains(r) && !matches!(s, Standing::Unsettled(_)))
                .map(|(r, (s, age))| cap::Counted {
                    name: r.metadata.name.as_deref().unwrap_or_default(),
                    group: &r.spec.pod.namespace,
                    namespace: &r.spec.pod.namespace,
                    present: *s == Standing::Present,
                    created: *age,
                    reserved_at: r.spec.reserved_at.0,
                })
                .collect();
            cap::over_cap(policy.max_reserved as usize, policy.max_reserved_per_namespace.map(|n| n as usize), counted)
        };
        let newly_over = {
            let mut memory = self.memory.lock().expect("memory lock");
            if victims.is_empty() {
                memory.over_cap.remove(name);
                false
            } else {
                memory.over_cap.insert(name.to_string())
            }
        };
        let recheck = unsettled.map(instant);
        if victims.is_empty() {
            return Ok(recheck);
        }
        if newly_over {
            let share = policy
                .max_reserved_per_namespace
                .map(|n| format!(" or maxReservedPerNamespace={n}"))
                .unwrap_or_default();
            let note = format!("more than maxReserved={}{share} IPs held: releasing the oldest", policy.max_reserved);
            self.event(&policy_ref(name), EventType::Warning, "CapReached", "Release", note).await;
        }
        let mut pacer = self.pacer.lock().expect("pacer lock");
        for v in victims {
            if let Some(record) = self.records.get(&v) {
                pacer.submit(name, self.leaving(record, ReleaseReason::Cap, now));
            }
        }
        drop(pacer);
        self.queue.add_urgent(Key::Release(name.to_string()));
        Ok(recheck)
    }

    /// A pool (the pool guard): its gauges, and the holds in it past a policy's
    /// `maxPoolShare` or the global `--max-pool-share` of its unallocated addresses —
    /// released oldest first, at their policies' pace. Holds whose address Calico's IPAM
    /// still has allocated (the Pod not yet gone) are neither counted nor released.
    async fn pool(&self, name: &str) {
        let Some(store) = self.pools.as_ref().filter(|s| s.is_synced()) else { return };
        let gauges = &self.metrics.release.pools;
        let (Some(pool), Some(usage)) = (store.pools().into_iter().find(|p| p.name == name), store.usage(name)) else {
            gauges.forget(name);
            return;
        };
        let held = self.records.matching(|r| {
            consistency::check(r).is_ok()
                && entry::single_ip(&r.spec.cidr).is_some_and(|ip| pool.cidr.contains(&ip) && !store.is_allocated(ip))
        });
        let unused = usage.unused();
        gauges.set(name, usage.size, unused.saturating_sub(held.len() as u128), held.len());
        if pool.disabled {
            return;
        }
        let matcher = self.matcher.load();
        let victims = {
            let pacer = self.pacer.lock().expect("pacer lock");
            let counted: Vec<cap::Counted<'_>> = held
                .iter()
                .filter(|r| self.in_scope(&r.spec.policy) && !pacer.contains(r))
                .map(|r| cap::Counted {
                    name: r.metadata.name.as_deref().unwrap_or_default(),
                    group: &r.spec.policy,
                    namespace: &r.spec.pod.namespace,
                    // The pool guard counts only holds whose address Calico freed.
                    present: false,
                    created: r.metadata.creation_timestamp.as_ref().map_or(r.spec.reserved_at.0, |t| t.0),
                    reserved_at: r.spec.reserved_at.0,
                })
                .collect();
            let share = |p: &str| matcher.get(p).and_then(|c| c.max_pool_share);
            cap::over_pool_share(unused, self.settings.max_pool_share, share, counted)
        };
        let mut by_policy: BTreeMap<String, Vec<Arc<capo_api::ReservedIP>>> = BTreeMap::new();
        for v in &victims {
            if let Some(record) = self.records.get(v) {
                by_policy.entry(record.spec.policy.clone()).or_default().push(record);
            }
        }
        let newly_over: Vec<String> = {
            let mut memory = self.memory.lock().expect("memory lock");
            memory.over_pool.retain(|(p, policy)| p != name || by_policy.contains_key(policy));
            by_policy
                .keys()
                .filter(|policy| memory.over_pool.insert((name.to_string(), (*policy).clone())))
                .cloned()
                .collect()
        };
        for policy in newly_over {
            let bound = match matcher.get(&policy).and_then(|c| c.max_pool_share) {
                Some(s) => format!("maxPoolShare={s}% or --max-pool-share={}%", self.settings.max_pool_share),
                None => format!("--max-pool-share={}%", self.settings.max_pool_share),
            };
            let note = format!(
                "IP pool {name} ({}): capo holds {} of its {unused} unallocated addresses, more than {bound}: releasing this policy's oldest holds in it",
                pool.cidr,
                held.len()
            );
            warn!(
                pool = name,
                policy,
                held = held.len(),
                unused = unused as u64,
                "pool guard: releasing the oldest holds"
            );
            self.event(&policy_ref(&policy), EventType::Warning, "PoolShareReached", "Release", note).await;
        }
        let now = Timestamp::now();
        for (policy, records) in by_policy {
            let mut pacer = self.pacer.lock().expect("pacer lock");
            for record in records {
                pacer.submit(&policy, self.leaving(record, ReleaseReason::Pool, now));
            }
            drop(pacer);
            self.queue.add_urgent(Key::Release(policy));
        }
    }

    /// How many holds of `policy` arrived within the last `interval`.
    fn arrivals(&self, policy: &str, interval: Duration) -> usize {
        let mut memory = self.memory.lock().expect("memory lock");
        let Some(q) = memory.arrivals.get_mut(policy) else { return 0 };
        while q.front().is_some_and(|t| t.elapsed() > interval) {
            q.pop_front();
        }
        q.len()
    }

    /// A release slot of `policy`: marks the Pods that stay, removes the entries (one
    /// fenced write per shard), then deletes the records.
    async fn release(&self, policy: &str) -> Result<Option<Instant>, ReleaseError> {
        let (interval, batch) = self.interval_and_batch(policy);
        let cap_budget = self.arrivals(policy, interval);
        let last = self.pacer.lock().expect("pacer lock").last_slot(policy);
        let taken = self.pacer.lock().expect("pacer lock").take(policy, Instant::now(), interval, batch, cap_budget);
        let leaving = match taken {
            Taken::Empty => return Ok(None),
            Taken::Wait(at) => return Ok(Some(at)),
            Taken::Batch(b) => b,
        };
        let (leaving, changed) = self.still_decided(leaving);
        if !changed.is_empty() {
            let mut pacer = self.pacer.lock().expect("pacer lock");
            pacer.finish(changed.iter().map(Leaving::name));
            if leaving.is_empty() {
                pacer.unspend(policy, last);
            }
            drop(pacer);
            for l in &changed {
                info!(record = %l.name(), reason = l.reason.as_str(), "the hold changed since its release was decided; deciding afresh");
                self.queue.add(Key::Record(l.name()));
                self.pool_of_changed(&l.record.spec.cidr);
            }
            self.queue.add(Key::Policy(policy.to_string()));
            if leaving.is_empty() {
                return Ok(None);
            }
        }
        // A Pod that cannot be marked keeps its own hold (retried later); the rest go.
        let (leaving, unmarked) = self.mark_staying(leaving).await;
        if !unmarked.is_empty() {
            self.retry_unmarked(policy, unmarked).await;
        }
        let shard_of = |l: &Leaving| {
            let s = &l.record.spec;
            (s.calico_api_group.parse::<CalicoApiGroup>().unwrap_or(self.reservations.group()), s.reservation.clone())
        };
        let mut by_shard: BTreeMap<(CalicoApiGroup, String), BTreeSet<String>> = BTreeMap::new();
        for l in &leaving {
            by_shard.entry(shard_of(l)).or_default().insert(l.record.spec.cidr.clone());
        }
        // The shards go concurrently too: a large policy's slot spans all of them.
        let removals: Vec<_> = futures::stream::iter(by_shard)
            .map(|((group, shard), cidrs)| async move {
                let removed = self.reservations.remove(group, &shard, &cidrs, &self.fence).await;
                ((group, shard), removed)
            })
            .buffer_unordered(SLOT_SHARDS_AT_ONCE)
            .collect()
            .await;
        let mut out = HashSet::new();
        let mut failed = None;
        for (key, removed) in removals {
            match removed {
                Ok(_) => {
                    out.insert(key);
                }
                Err(source) => {
                    failed.get_or_insert(ReleaseError::Reservation { reservation: key.1, source });
                }
            }
        }
        let (gone, back): (Vec<Leaving>, Vec<Leaving>) = leaving.into_iter().partition(|l| out.contains(&shard_of(l)));
        if !back.is_empty() {
            self.pacer.lock().expect("pacer lock").put_back(policy, back);
        }
        // The records go concurrently (a slot of a large policy releases hundreds).
        let results: Vec<(Leaving, Result<(), ReleaseError>)> = futures::stream::iter(gone)
            .map(|l| async move {
                let r = self.finish_release(&l).await;
                (l, r)
            })
            .buffer_unordered(SLOT_RECORDS_AT_ONCE)
            .collect()
            .await;
        let (done, failed_records): (Vec<_>, Vec<_>) = results.into_iter().partition(|(_, r)| r.is_ok());
        let more = {
            let mut pacer = self.pacer.lock().expect("pacer lock");
            // Released, and still in the store (its deletion not seen yet): kept out of
            // every count until it is, or the cap would take one hold too many.
            pacer.finish(done.iter().map(|(l, _)| l.name()));
            let unseen = done
                .into_iter()
                .map(|(l, _)| l.record)
                .filter(|r| self.records.get(&r.name_any()).is_some_and(|now| now.metadata.uid == r.metadata.uid));
            pacer.released(unseen, Instant::now());
            pacer.finish(failed_records.iter().map(|(l, _)| l.name()));
            pacer.waiting(policy)
        };
        let result = failed_records.into_iter().map(|(_, r)| r).next().unwrap_or(Ok(()));
        if let Some(e) = failed {
            return Err(e);
        }
        result?;
        Ok(more.then(|| Instant::now() + interval))
    }

    /// Before their entries go: marks each Pod that is still there (deleted, terminal) as
    /// released, so that nobody holds it again. Returns the releases that may go on, and
    /// those whose Pod could not be marked (an admission policy refusing capo's patch, a
    /// Pod webhook that is down, throttling): those stay held, each on its own.
    async fn mark_staying(&self, leaving: Vec<Leaving>) -> (Vec<Leaving>, Vec<(Leaving, ReleaseError)>) {
        let results: Vec<(Leaving, Result<(), ReleaseError>)> = futures::stream::iter(leaving)
            .map(|l| async move {
                let r = self.mark_one(&l).await;
                (l, r)
            })
            .buffer_unordered(SLOT_RECORDS_AT_ONCE)
            .collect()
            .await;
        let mut go = Vec::with_capacity(results.len());
        let mut stay = Vec::new();
        for (l, r) in results {
            match r {
                Ok(()) => go.push(l),
                Err(e) => stay.push((l, e)),
            }
        }
        (go, stay)
    }

    async fn mark_one(&self, l: &Leaving) -> Result<(), ReleaseError> {
        let p = &l.record.spec.pod;
        let pod = self.pods.get(&p.namespace, &p.name);
        if pod.is_none()
            || decide::pod_state(&l.record, pod.as_deref()) == PodState::Kept
            || l.reason == ReleaseReason::PodKept
        {
            return Ok(());
        }
        let tries = self.memory.lock().expect("memory lock").unmarked.get(&l.name()).copied().unwrap_or(0);
        if tries >= MARK_ATTEMPTS {
            // Nothing is held forever: past its attempts the hold goes without the mark
            // (the cost: a safety net that sees this Pod again after a leader change may
            // hold it once more, for one more reserveFor).
            warn!(record = %l.name(), pod = %format!("{}/{}", p.namespace, p.name), tries, "releasing without marking the Pod");
            return Ok(());
        }
        if pod.is_some_and(|pod| pod.uid == p.uid) {
            // A replica that lost the Lease marks nothing (like every other leader write).
            self.fence.check()?;
            marks::mark(&self.client, &p.namespace, &p.name, &p.uid, RELEASED_ANNOTATION, l.reason.as_str())
                .await
                .map_err(|source| ReleaseError::Mark { pod: format!("{}/{}", p.namespace, p.name), source })?;
        }
        Ok(())
    }

    /// Releases whose Pod could not be marked: each stays held and is looked at again
    /// after a backoff of its own (2 s, doubling), so it neither fails nor leads its
    /// policy's later slots; after [`MARK_ATTEMPTS`] it goes without the mark. Said once per hold (a `ReleaseDeferred` Event on
    /// the Pod), counted each time (`capo_release_failures_total{reason="mark"}`).
    async fn retry_unmarked(&self, policy: &str, unmarked: Vec<(Leaving, ReleaseError)>) {
        self.pacer.lock().expect("pacer lock").finish(unmarked.iter().map(|(l, _)| l.name()));
        for (l, e) in unmarked {
            let name = l.name();
            let attempt = {
                let mut memory = self.memory.lock().expect("memory lock");
                let n = memory.unmarked.entry(name.clone()).or_insert(0);
                *n += 1;
                *n
            };
            let backoff = Duration::from_secs(2).saturating_mul(1 << (attempt - 1).min(8)).min(MARK_BACKOFF_MAX);
            self.metrics.release.failures.with_label_values(&[policy, e.kind()]).inc();
            warn!(record = %name, policy, attempt, retry_in = ?backoff, error = %e, "could not mark the Pod released; its hold stays, the rest are released");
            self.queue.add_after(Key::Record(name), backoff);
            if attempt == 1 {
                let p = &l.record.spec.pod;
                let note = format!(
                    "capo could not mark this Pod before releasing {} ({e}); the address stays held and capo tries again, the policy's other releases go on",
                    l.record.spec.cidr
                );
                self.event(
                    &pod_ref(&p.namespace, &p.name, &p.uid),
                    EventType::Warning,
                    "ReleaseDeferred",
                    "Release",
                    note,
                )
                .await;
            }
        }
    }

    /// The entry is out: the record goes (if it still describes this hold).
    async fn finish_release(&self, l: &Leaving) -> Result<(), ReleaseError> {
        let s = &l.record.spec;
        let mut current = (*l.record).clone();
        for _ in 0..3 {
            match self.writes.delete(&current).await? {
                RecordFate::Deleted | RecordFate::AlreadyGone => {
                    self.released(&s.policy, l.reason, Some(l.due));
                    info!(ip = %s.cidr, reservation = %s.reservation, reason = l.reason.as_str(), "released");
                    return Ok(());
                }
                RecordFate::Changed => {}
            }
            let Some(now) = self.writes.read(&l.name()).await? else { return Ok(()) };
            if now.spec.pod.uid != s.pod.uid || now.spec.reservation != s.reservation {
                // Held for another Pod meanwhile: its entry goes back.
                let group = now.spec.calico_api_group.parse::<CalicoApiGroup>().unwrap_or(self.reservations.group());
                self.reservations
                    .write_back(group, &now.spec.reservation, &now.spec.policy, &now.spec.cidr, &self.fence)
                    .await
                    .map_err(|source| ReleaseError::Reservation {
                        reservation: now.spec.reservation.clone(),
                        source,
                    })?;
                info!(ip = %s.cidr, "re-held for another Pod meanwhile; entry written back");
                return Ok(());
            }
            current = now;
        }
        Ok(())
    }

    /// One reservation: garbage out, foreign CIDRs reported, orphans adopted, redundant
    /// entries out.
    async fn shard(&self, group: CalicoApiGroup, name: &str) -> Result<Option<Instant>, ReleaseError> {
        let group = self.index.canonical(group);
        let key = (group, name.to_string());
        let Some(view) = self.index.get(group, name) else {
            let mut memory = self.memory.lock().expect("memory lock");
            memory.first_seen.remove(&key);
            if let Some((policy, _)) = memory.foreign.remove(&key) {
                let total = Self::foreign_total(&memory, &policy);
                self.metrics.release.foreign_entries.with_label_values(&[&policy]).set(total as i64);
            }
            return Ok(None);
        };
        let policy = view.policy.clone().unwrap_or_default();
        if !self.in_scope(&policy) {
            return Ok(None);
        }
        if view.moved {
            // A write through projectcalico.org/v3 moved capo's labels into Calico's
            // metadata annotation: put them back before anything tests them.
            let restored = self
                .reservations
                .reown(group, name)
                .await
                .map_err(|source| ReleaseError::Reservation { reservation: name.to_string(), source })?;
            if restored {
                let note = format!(
                    "A write through projectcalico.org/v3 (calico-apiserver, calicoctl or kubectl) moved the labels of IPReservation {name} into its projectcalico.org/metadata annotation; capo put them back and keeps holding its entries"
                );
                self.event(&policy_ref(&policy), EventType::Warning, "LabelsRestored", "Repair", note).await;
            }
        }
        // A shard created after this term began, with a lower epoch (by a webhook that had
        // not seen the new Lease yet): raised now, so the replica this one took over from
        // cannot write it either.
        self.reservations
            .stamp_if_behind(group, name, &self.fence)
            .await
            .map_err(|source| ReleaseError::Reservation { reservation: name.to_string(), source })?;
        // A record names the group its entry was written through; where both groups name
        // one store, either name is this shard.
        let recorded_at = |ip| {
            self.records.get(&record_name(ip)).and_then(|r| {
                if consistency::check(&r).is_err() {
                    // A record capo did not write: its entry is left as it is, neither
                    // adopted nor removed as redundant.
                    return Some((group, view.name.clone()));
                }
                let group = r.spec.calico_api_group.parse::<CalicoApiGroup>().ok()?;
                Some((self.index.canonical(group), r.spec.reservation.clone()))
            })
        };
        let plan = {
            let mut memory = self.memory.lock().expect("memory lock");
            let seen = memory.first_seen.entry(key.clone()).or_default();
            repair::plan(group, &view, &recorded_at, Timestamp::now(), self.settings.plan.settle, seen)
        };
        self.report_foreign(&key, &policy, &plan.foreign).await;
        let remove: BTreeSet<String> = plan.garbage.iter().chain(&plan.redundant).cloned().collect();
        if !remove.is_empty() {
            let removed = self
                .reservations
                .remove(group, name, &remove, &self.fence)
                .await
                .map_err(|source| ReleaseError::Reservation { reservation: name.to_string(), source })?;
            let garbage = plan.garbage.iter().filter(|g| removed.contains(*g)).count();
            let repairs = &self.metrics.release.repairs;
            repairs.with_label_values(&["garbage_removed"]).inc_by(garbage as u64);
            repairs.with_label_values(&["redundant_removed"]).inc_by((removed.len() - garbage) as u64);
            if removed.len() > garbage {
                self.released(&policy, ReleaseReason::Repair, None);
            }
            warn!(reservation = name, garbage = ?plan.garbage, redundant = ?plan.redundant, "removed entries no hold needs");
        }
        for cidr in &plan.adopt {
            let reserve_for =
                self.matcher.load().get(&policy).map_or(self.settings.plan.default_reserve_for, |p| p.reserve_for);
            if self.writes.adopt(group, name, &policy, cidr, reserve_for).await? {
                self.metrics.release.repairs.with_label_values(&["adopted"]).inc();
                info!(entry = %cidr, reservation = name, "adopted an entry without a record");
            }
        }
        Ok(plan.wake.map(instant))
    }

    fn foreign_total(memory: &Memory, policy: &str) -> usize {
        memory.foreign.values().filter(|(p, _)| p == policy).map(|(_, f)| f.len()).sum()
    }

    /// Valid CIDRs in a capo-owned reservation that capo did not write: left in place,
    /// counted, and reported once per change.
    async fn report_foreign(&self, key: &(CalicoApiGroup, String), policy: &str, foreign: &[String]) {
        let changed = {
            let mut memory = self.memory.lock().expect("memory lock");
            let before = memory.foreign.get(key).map(|(_, f)| f.clone()).unwrap_or_default();
            if foreign.is_empty() {
                memory.foreign.remove(key);
            } else {
                memory.foreign.insert(key.clone(), (policy.to_string(), foreign.to_vec()));
            }
            let total = Self::foreign_total(&memory, policy);
            self.metrics.release.foreign_entries.with_label_values(&[policy]).set(total as i64);
            before != foreign && !foreign.is_empty()
        };
        if changed {
            let note = format!(
                "IPReservation {} holds entries capo did not write: {}; capo leaves them (they are valid CIDRs) — remove them by hand if nobody needs them",
                key.1,
                foreign.join(", ")
            );
            warn!(reservation = %key.1, entries = ?foreign, "entries capo did not write");
            self.event(&policy_ref(policy), EventType::Warning, "ForeignEntries", "Repair", note).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fit_note;

    /// A note quoting an API error in full would get the Event refused (1024 bytes).
    #[test]
    fn event_notes_fit_the_api_servers_limit() {
        assert_eq!(fit_note("short".into()), "short");
        let long = fit_note("é".repeat(2000));
        assert!(long.len() <= 1024 && long.ends_with('…'), "{}", long.len());
        assert_eq!(fit_note("x".repeat(1024)).len(), 1024);
    }
}
