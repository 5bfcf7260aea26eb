//! What every kind of the leader's work shares: the keys of its queue, the stores it reads,
//! the writers it writes through, the pacer of release slots, and where it reports. Each
//! kind keeps what it remembers in a module of its own ([`super::record`],
//! [`super::policy`], [`super::slot`], [`super::shard`], [`super::pool`]).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use capo_api::CalicoApiGroup;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use tokio::time::Instant;

use super::EngineSettings;
use crate::calico::pools::PoolStore;
use crate::calico::{ReservationIndex, Reservations, entry};
use crate::events::Events;
use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::policy::SharedMatcher;
use crate::release::announce::Announcements;
use crate::release::decide::{self, ReleaseReason};
use crate::release::pacer::{Leaving, Pacer};
use crate::release::queue::WorkQueue;
use crate::release::writes::RecordWrites;
use crate::store::{NamespaceStore, PodStore, RecordIndex, WorkloadStore};

/// How long pool changes are gathered before the pool guard looks (every Pod start and
/// stop in the cluster changes an IPAM block).
pub const POOL_SETTLE: Duration = Duration::from_secs(1);

/// A unit of the leader's work.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// A hold: its countdown, release, missing entry.
    Record(String),
    /// A policy: its gauges and cap.
    Policy(String),
    /// A policy's release slot (pacing).
    Release(String),
    /// A reservation shard (repair).
    Shard(CalicoApiGroup, String),
    /// A Calico IP pool (the pool guard).
    Pool(String),
}

impl Key {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Record(_) => "record",
            Self::Policy(_) => "policy",
            Self::Release(_) => "release",
            Self::Shard(..) => "shard",
            Self::Pool(_) => "pool",
        }
    }
}

/// The term's shared context.
pub struct Shared {
    pub client: Client,
    pub fence: Fence,
    pub reservations: Reservations,
    pub index: Arc<ReservationIndex>,
    pub pods: Arc<PodStore>,
    pub namespaces: Arc<NamespaceStore>,
    pub workloads: Arc<WorkloadStore>,
    pub records: Arc<RecordIndex>,
    /// Calico's pools and IPAM blocks, when the cluster serves them (the pool guard).
    pub pools: Option<Arc<PoolStore>>,
    pub matcher: SharedMatcher,
    pub metrics: Arc<Metrics>,
    pub events: Events,
    pub announcements: Announcements,
    pub writes: RecordWrites,
    pub settings: EngineSettings,
    pub queue: WorkQueue<Key>,
    /// Releases decided and not yet carried out, by policy (the release slots).
    pacer: Mutex<Pacer>,
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        fence: Fence,
        reservations: Reservations,
        pods: Arc<PodStore>,
        namespaces: Arc<NamespaceStore>,
        workloads: Arc<WorkloadStore>,
        records: Arc<RecordIndex>,
        pools: Option<Arc<PoolStore>>,
        matcher: SharedMatcher,
        metrics: Arc<Metrics>,
        events: Events,
        announcements: Announcements,
        settings: EngineSettings,
    ) -> Self {
        Self {
            index: reservations.index().clone(),
            writes: RecordWrites::new(client.clone(), fence.clone()),
            client,
            fence,
            reservations,
            pods,
            namespaces,
            workloads,
            records,
            pools,
            matcher,
            metrics,
            events,
            announcements,
            settings,
            queue: WorkQueue::new(Duration::from_millis(250), Duration::from_secs(30)),
            pacer: Mutex::new(Pacer::default()),
        }
    }

    /// Whether this replica acts on `policy` (tests share one API server).
    pub fn in_scope(&self, policy: &str) -> bool {
        self.settings.policy_prefix.as_deref().is_none_or(|p| policy.starts_with(p))
    }

    pub fn pacer(&self) -> MutexGuard<'_, Pacer> {
        self.pacer.lock().expect("pacer lock")
    }

    /// Releases decided for `policy`: they go at its next slot.
    pub fn submit(&self, policy: &str, leaving: impl IntoIterator<Item = Leaving>) {
        let mut pacer = self.pacer();
        for l in leaving {
            pacer.submit(policy, l);
        }
        drop(pacer);
        self.queue.add_urgent(Key::Release(policy.to_string()));
    }

    /// A release of `record`, decided now on its Pod's state as the store shows it.
    pub fn leaving(&self, record: Arc<capo_api::ReservedIP>, reason: ReleaseReason, due: Timestamp) -> Leaving {
        let p = &record.spec.pod;
        let pod = decide::pod_state(&record, self.pods.get(&p.namespace, &p.name).as_deref());
        Leaving { record, reason, due, pod }
    }

    /// Counts a release (and how late it was).
    pub fn released(&self, policy: &str, reason: ReleaseReason, due: Option<Timestamp>) {
        let m = &self.metrics.release;
        m.releases.with_label_values(&[policy, reason.as_str()]).inc();
        if let Some(due) = due {
            let late = Timestamp::now().duration_since(due).as_secs_f64().max(0.0);
            m.lateness.with_label_values(&[policy]).observe(late);
        }
    }

    /// Every pool's share changed (a policy's bound, a relist).
    pub fn all_pools_changed(&self) {
        for p in self.pools.iter().flat_map(|s| s.pools()) {
            self.queue.add_after(Key::Pool(p.name), POOL_SETTLE);
        }
    }

    /// A hold in `cidr` came or went: its pool's share changed.
    pub fn pool_of_changed(&self, cidr: &str) {
        if let (Some(store), Some(ip)) = (&self.pools, entry::single_ip(cidr))
            && let Some(pool) = store.pool_of(ip)
        {
            self.queue.add_after(Key::Pool(pool.name), POOL_SETTLE);
        }
    }
}

/// `at` on the monotonic clock.
pub fn instant(at: Timestamp) -> Instant {
    let d = at.duration_since(Timestamp::now());
    Instant::now() + Duration::try_from(d).unwrap_or_default()
}
