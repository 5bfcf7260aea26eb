//! The leader's work in one term: watches → indexes → a keyed work queue → per-key
//! reconciles → the reservation owner ([`crate::calico`]) and the record writes; beside it,
//! the safety net's loop over Pods and the announcements' loop over new holds.
//!
//! One module per kind of work, each owning what it remembers: [`record`] (a hold's
//! countdown and release), [`policy`] (a policy's cap), [`slot`] (a policy's paced
//! release slots), [`shard`] (a reservation's repair), [`pool`] (the pool guard),
//! [`safety_net`] (Pods that left without a hold); [`starts`] keeps the holds' countdown
//! starts and flushes them to capo's namespace. What they share — keys, stores,
//! writers, the pacer — is in [`context`]; which event touches which key in [`routing`].
//! A reconcile says when to look again; a failed one comes back with backoff
//! (`capo_release_retries_total`).

mod context;
mod policy;
mod pool;
mod record;
mod routing;
mod safety_net;
mod shard;
mod slot;
mod starts;

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::events::EventType;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use self::context::{Key, Shared};
use self::policy::PolicyWork;
use self::pool::PoolWork;
use self::record::RecordWork;
use self::routing::Receivers;
use self::safety_net::NetLoop;
use self::shard::ShardWork;
use self::slot::SlotWork;
use super::announce::Announcements;
use super::countdowns;
use super::decide::{self, PlanSettings};
use super::writes::ReleaseError;
use crate::calico::pools::{PoolStore, detect_ipam_api};
use crate::calico::{CalicoError, Datastore, Reservations};
use crate::events::{Events, policy_ref};
use crate::hold::HoldWriter;
use crate::hold::safety_net::SafetyNet;
use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::policy::SharedMatcher;
use crate::store::{NamespaceStore, PodStore, RecordIndex, WorkloadStore};
use capo_api::CalicoApiGroup;

/// The default of `--max-pool-share`: capo's holds may take at most half of a pool's
/// unallocated addresses, so a new Pod always finds at least as many free addresses as
/// capo holds (docs/calico.md).
pub const DEFAULT_MAX_POOL_SHARE: u32 = 50;

#[derive(Clone, Debug)]
pub struct EngineSettings {
    pub plan: PlanSettings,
    /// Only act on policies whose name starts with this (tests share one API server).
    pub policy_prefix: Option<String>,
    /// Namespaces the safety net never holds in (kube-system, capo's own).
    pub excluded_namespaces: Vec<String>,
    /// How many keys are worked on at once (status writes, releases, holds), and how
    /// many Pods the safety net looks at at once.
    pub workers: usize,
    /// The most of a Calico IP pool's unallocated addresses all policies together may
    /// hold, in percent (`--max-pool-share`); `maxPoolShare` bounds one policy.
    pub max_pool_share: u32,
    /// capo's namespace (`--namespace`): where the countdown ConfigMaps are kept.
    pub namespace: String,
    /// How often, at most, one shard's countdown starts are written
    /// ([`countdowns::FLUSH_EVERY`]; longer only in tests of the last flush on shutdown).
    pub flush_every: std::time::Duration,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            plan: PlanSettings::default(),
            policy_prefix: None,
            excluded_namespaces: vec![],
            workers: 8,
            max_pool_share: DEFAULT_MAX_POOL_SHARE,
            namespace: "default".into(),
            flush_every: countdowns::FLUSH_EVERY,
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
    /// Turns true when capo shuts down: the leader writes the countdowns it has not
    /// written yet, then stops (before the Lease is given up).
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

/// One term's release work: the shared context and each kind of work with its memory.
struct Leader {
    s: Shared,
    records: RecordWork,
    policies: PolicyWork,
    slots: SlotWork,
    shards: ShardWork,
    pools: PoolWork,
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
                if detect_ipam_api(&self.client).await.is_none() {
                    info!("pool guard: Calico's IPAM blocks are not served here; no pool guard");
                    return None;
                }
                info!(max_pool_share = share, "pool guard: watching Calico's IP pools where Calico's IPAM reads");
                tasks.push(store.follow(&self.client, self.reservations.writing_group(), true));
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
            writing: self.reservations.writing_group().subscribe(),
        };
        let net_rx = self.pods.subscribe();
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
            Err(e @ (CalicoError::Fenced { .. } | CalicoError::NotLeader(_))) => {
                warn!(error = %e, "leader: another replica leads");
                return;
            }
            Err(e) => {
                warn!(error = %e, "leader: could not raise the epoch everywhere yet; it is raised before each write")
            }
        }
        let events = Events::new(self.client.clone(), &self.identity).naming_policies_by_uid(self.matcher.clone());
        let (announcements, announcing) = Announcements::spawn(events.clone(), Timestamp::now());
        let writer = HoldWriter::new(self.client.clone(), self.reservations.clone()).with_pods(self.pods.clone());
        let net = SafetyNet::new(
            self.client.clone(),
            writer,
            self.pods.clone(),
            self.namespaces.clone(),
            workloads.clone(),
            records.clone(),
            self.matcher.clone(),
            self.metrics.clone(),
            events.clone(),
            self.settings.excluded_namespaces.clone(),
            self.settings.policy_prefix.clone(),
        );
        let net = Arc::new(NetLoop::new(
            net,
            self.pods.clone(),
            fence.clone(),
            self.metrics.clone(),
            events.clone(),
            self.settings.plan.settle,
        ));
        let leader = Arc::new(Leader {
            s: Shared::new(
                self.client.clone(),
                fence.clone(),
                self.reservations.clone(),
                self.pods.clone(),
                self.namespaces.clone(),
                workloads.clone(),
                records.clone(),
                pools,
                self.matcher.clone(),
                self.metrics.clone(),
                events,
                announcements,
                self.settings.clone(),
            ),
            records: RecordWork::new(starts::Starts::with_gauge(self.metrics.release.countdowns.clone())),
            policies: PolicyWork::default(),
            slots: SlotWork::default(),
            shards: ShardWork::default(),
            pools: PoolWork::default(),
        });
        let in_scope = |p: &str| leader.s.in_scope(p);
        tokio::select! {
            taken = self.read_countdowns(&fence) => {
                let loaded = leader.records.starts.load(&taken, &records, in_scope, Timestamp::now());
                for (record, read) in &loaded.ahead {
                    warn!(record, start = %read, allowance = ?decide::SKEW_ALLOWANCE, "leader: a countdown start read back is later than now (a clock ahead, or an edit): taken as now");
                    self.metrics.release.clock_ahead.with_label_values(&["countdownStart"]).inc();
                }
                info!(namespace = %self.settings.namespace, starts = loaded.taken, ahead = loaded.ahead.len(), "leader: read the countdowns a former leader kept");
            }
            _ = fence.lost() => return,
        }
        leader.enqueue_everything();
        info!(records = records.all_names().len(), "leader: release controller running");
        let workers = self.settings.workers.max(1);
        let mut loops = vec![announcing, tokio::spawn(leader.clone().pump(rx)), tokio::spawn(leader.clone().flush())];
        loops.extend((0..workers).map(|_| tokio::spawn(leader.clone().work())));
        loops.extend(net.spawn(net_rx, workers));
        // Declared first, so dropped last: also when the caller drops this future as the
        // Lease is lost (it selects on that too) before the line below runs.
        let _end = TermEnd { leader: leader.clone(), net };
        let _stop = AbortOnDrop(loops);
        let mut stopping = self.stopping.clone();
        let stopped = tokio::select! {
            _ = fence.lost() => false,
            r = stopping.wait_for(|s| *s) => r.is_ok(),
        };
        if stopped {
            leader.last_flush().await;
        } else {
            info!("leader: lost the Lease; the release controller stops");
        }
    }
}

impl ReleaseEngine {
    /// The countdown ConfigMaps of capo's namespace, read before anything is counted down
    /// (retried until they are read: counting down without them would start every hold
    /// whose start a former leader kept anew, late).
    async fn read_countdowns(&self, fence: &Fence) -> Vec<k8s_openapi::api::core::v1::ConfigMap> {
        let mut wait = std::time::Duration::from_millis(200);
        loop {
            match countdowns::list(&self.client, Some(&self.settings.namespace)).await {
                Ok(cms) => return cms,
                Err(e) => {
                    warn!(namespace = %self.settings.namespace, error = %e, retry_in = ?wait, "leader: could not read the countdowns; counting down waits");
                    if fence.check().is_err() {
                        return vec![];
                    }
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(std::time::Duration::from_secs(5));
                }
            }
        }
    }
}

impl Leader {
    /// On shutdown, while the Lease is still this replica's: writes the countdown starts
    /// not written yet (after a flush in flight, if any), so the next leader counts from
    /// them instead of from its first look.
    async fn last_flush(&self) {
        let s = &self.s;
        match self.records.starts.flush(&s.client, &s.settings.namespace, &s.fence).await {
            Ok(written) => info!(written, "leader: stopping; the countdowns are written"),
            Err(e) => {
                s.metrics.release.failures.with_label_values(&[&e.policy, "countdowns"]).inc();
                warn!(error = %e, "leader: stopping; countdowns not written (the next leader starts them when it looks)");
            }
        }
    }

    /// Writes the countdown starts that changed, every `flush_every`
    /// ([`countdowns::FLUSH_EVERY`]).
    async fn flush(self: Arc<Self>) {
        let s = &self.s;
        // The first write one period into the term, not at once: the term has just read
        // the starts back, and a write racing the workers' first look would be one more.
        let mut tick =
            tokio::time::interval_at(tokio::time::Instant::now() + s.settings.flush_every, s.settings.flush_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = self.records.starts.flush(&s.client, &s.settings.namespace, &s.fence).await {
                s.metrics.release.failures.with_label_values(&[&e.policy, "countdowns"]).inc();
                warn!(error = %e, "leader: countdowns not written; tried again in a second");
            }
        }
    }

    /// A worker: takes keys until the queue closes.
    async fn work(self: Arc<Self>) {
        let s = &self.s;
        while let Some(key) = s.queue.next().await {
            s.metrics.release.reconciles.with_label_values(&[key.kind()]).inc();
            match self.reconcile(&key).await {
                Ok(again) => {
                    s.queue.forget(&key);
                    if let Some(at) = again {
                        s.queue.add_at(key.clone(), at);
                    }
                }
                Err(e) if e.lost_lead() => {
                    debug!(error = %e, "leader: not leading any more");
                    s.queue.done(&key);
                    return;
                }
                Err(e) => {
                    let policy = self.policy_of(&key);
                    s.metrics.release.failures.with_label_values(&[&policy, e.kind()]).inc();
                    s.metrics.release.retries.with_label_values(&[&policy]).inc();
                    let after = s.queue.retry(key.clone());
                    warn!(key = ?key, error = %e, retry_in = ?after, "leader: write failed; retrying");
                    s.events
                        .publish(&policy_ref(&policy), EventType::Warning, "ReleaseFailed", "Release", e.to_string())
                        .await;
                }
            }
            s.queue.done(&key);
            s.metrics.release.queue_depth.set(s.queue.busy() as i64);
        }
    }

    fn policy_of(&self, key: &Key) -> String {
        let s = &self.s;
        match key {
            Key::Record(r) => s.records.get(r).map(|r| r.spec.policy.clone()).unwrap_or_default(),
            Key::Policy(p) | Key::Release(p) => p.clone(),
            Key::Shard(g, n) => s.index.get(*g, n).and_then(|v| v.policy.clone()).unwrap_or_default(),
            Key::Pool(_) => String::new(),
        }
    }

    async fn reconcile(&self, key: &Key) -> Result<Option<Instant>, ReleaseError> {
        let s = &self.s;
        match key {
            Key::Record(name) => match s.records.get(name) {
                Some(rec) => self.records.reconcile(s, &self.policies, rec).await,
                None => {
                    self.forget_record(name);
                    Ok(None)
                }
            },
            Key::Policy(name) => self.policies.reconcile(s, name).await,
            Key::Release(policy) => self.slots.reconcile(s, &self.policies, policy).await,
            Key::Shard(group, name) => self.shards.reconcile(s, *group, name).await,
            Key::Pool(name) => {
                self.pools.reconcile(s, name).await;
                Ok(None)
            }
        }
    }

    /// A record that is gone: every kind of work forgets it.
    fn forget_record(&self, name: &str) {
        self.records.forget(name);
        self.policies.forget_record(name);
        self.slots.forget_record(name);
        self.s.announcements.forget(name);
    }
}

/// What a term leaves behind when it ends, however it ends: no queue, no memory of Pods
/// looked at (a follower looks at nothing), no pool gauges (a stale gauge would outlive
/// what it measured).
struct TermEnd {
    leader: Arc<Leader>,
    net: Arc<NetLoop>,
}

impl Drop for TermEnd {
    fn drop(&mut self) {
        let s = &self.leader.s;
        s.queue.close();
        self.net.end();
        self.leader.records.starts.unreport();
        for p in s.pools.iter().flat_map(|store| store.pools()) {
            s.metrics.release.pools.forget(&p.name);
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
