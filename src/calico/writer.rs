//! Every write to capo-owned Calico `IPReservation`s, for both API groups:
//!
//! - **holds** (every replica): an entry already listed in one of the policy's shards is
//!   confirmed by a write that only tests it is there (the API server writes nothing);
//!   otherwise it is appended to the first shard with room ([`super::shards`]).
//!   Concurrent appends to one shard are group-committed: while one patch is in flight,
//!   new entries queue and go out together in the next. An append tests capo's ownership
//!   and the policy label, and adds at the end of the list, so it never loses a concurrent
//!   append; a duplicate counts as success.
//! - **releases and repairs** (the leader): removals test each entry at its index in the
//!   watched copy (no read first) and the shard's leader epoch, which the leader raised
//!   when it took over; a replica that lost the Lease fails that test and stops. Nothing
//!   is retried once the fence is closed.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capo_api::CalicoApiGroup;
use capo_api::calico::RESERVED_CIDRS;
use capo_api::keys::{LEADER_EPOCH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL, shard_name};
use kube::api::DynamicObject;
use kube::core::Status;
use kube::{Client, Error as KubeError, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tracing::{debug, warn};

use super::datastore::Datastore;
use super::entry::pointer_escape;
use super::index::{CALICO_METADATA_ANNOTATION, Effective, ReservationIndex, ShardView};
use super::shards::{self, JOIN_BELOW, SHARD_SIZE};
use super::writing::WritingGroup;
use crate::leader::{Fence, NotLeader};

/// How often one write retries after conflicts or throttling.
const ATTEMPTS: usize = 10;

/// The patch that puts back what a write through `projectcalico.org/v3` moved into
/// [`CALICO_METADATA_ANNOTATION`] (`None`: nothing was moved), tested against the
/// object's resourceVersion.
fn restore_patch(obj: &DynamicObject) -> Option<Vec<Value>> {
    let meta = Effective::of(obj);
    if !meta.moved {
        return None;
    }
    let mut annotations = meta.annotations;
    // What else Calico keeps there (creation time, uid, owners) stays.
    let rest = obj
        .annotations()
        .get(CALICO_METADATA_ANNOTATION)
        .and_then(|m| serde_json::from_str::<serde_json::Map<String, Value>>(m).ok())
        .map(|mut m| {
            m.remove("labels");
            m.remove("annotations");
            m
        })
        .filter(|m| !m.is_empty());
    if let Some(rest) = rest {
        annotations.insert(CALICO_METADATA_ANNOTATION.to_string(), Value::Object(rest).to_string());
    }
    let rv = obj.metadata.resource_version.clone().unwrap_or_default();
    Some(vec![
        json!({ "op": "test", "path": "/metadata/resourceVersion", "value": rv }),
        json!({ "op": "add", "path": "/metadata/labels", "value": meta.labels }),
        json!({ "op": "add", "path": "/metadata/annotations", "value": annotations }),
    ])
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum CalicoError {
    #[error("{api} IPReservation is not served by the API server: is Calico (or its CRDs) installed?")]
    NotServed { api: CalicoApiGroup },
    #[error(
        "IPReservation {name} exists but is not managed by capo (label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE} missing); capo will not touch it"
    )]
    NotOwned { name: String },
    #[error("IPReservation {name} belongs to policy {other:?}, not {policy}")]
    OtherPolicy { name: String, policy: String, other: Option<String> },
    #[error("IPReservation {name} is full: {message}")]
    Full { name: String, message: String },
    #[error("every reservation of policy {policy} is full or taken ({tried} tried)")]
    NoRoom { policy: String, tried: u32 },
    #[error("forbidden: {message}")]
    Forbidden { message: String },
    #[error("gave up after {ATTEMPTS} attempts that conflicted or were throttled")]
    Contention,
    #[error("the writer of this reservation stopped")]
    WriterGone,
    #[error("the API server rejected the entry: {message}")]
    Rejected { message: String },
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error(
        "IPReservation {name} carries leader epoch {seen}, newer than this replica's {epoch}: another replica leads"
    )]
    Fenced { name: String, epoch: u64, seen: u64 },
    #[error("{0}")]
    Api(#[source] Arc<KubeError>),
}

impl CalicoError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotServed { .. } => "calico_not_served",
            Self::NotOwned { .. } => "not_owned",
            Self::OtherPolicy { .. } => "other_policy",
            Self::Full { .. } => "full",
            Self::NoRoom { .. } => "no_room",
            Self::Forbidden { .. } => "forbidden",
            Self::Contention => "contention",
            Self::WriterGone => "writer_gone",
            Self::Rejected { .. } => "rejected",
            Self::NotLeader(_) => "not_leader",
            Self::Fenced { .. } => "fenced",
            Self::Api(_) => "api",
        }
    }

    /// Whether another shard may take the entry instead.
    fn try_next_shard(&self) -> bool {
        matches!(self, Self::NotOwned { .. } | Self::OtherPolicy { .. } | Self::Full { .. })
    }
}

fn status_of(e: &KubeError) -> Option<&Status> {
    match e {
        KubeError::Api(s) => Some(s),
        _ => None,
    }
}

/// The API server's answer when a resource type (not an object) does not exist: a 404
/// that names no object.
pub fn is_type_not_served(s: &Status) -> bool {
    s.code == 404 && s.details.as_ref().is_none_or(|d| d.name.is_empty())
}

/// etcd refuses an object past its request size limit (1.5 MiB by default); the API
/// server passes that on.
fn is_too_large(s: &Status) -> bool {
    s.code == 413 || s.message.contains("too large")
}

fn label_path(key: &str) -> String {
    format!("/metadata/labels/{}", pointer_escape(key))
}

fn epoch_path() -> String {
    format!("/metadata/annotations/{}", pointer_escape(LEADER_EPOCH_ANNOTATION))
}

/// The tests that open every write: capo owns the object, and it is this policy's.
fn ownership(policy: Option<&str>) -> Vec<Value> {
    let mut ops = vec![json!({ "op": "test", "path": label_path(MANAGED_BY_LABEL), "value": MANAGED_BY_VALUE })];
    if let Some(p) = policy {
        ops.push(json!({ "op": "test", "path": label_path(POLICY_LABEL), "value": p }));
    }
    ops
}

struct Waiter {
    cidr: String,
    done: oneshot::Sender<Result<Placed, CalicoError>>,
}

/// Where an entry went in its shard, as the API server confirmed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Where the entry is in the list the write left, when the answer said.
    pub at: Option<usize>,
    /// This request's own write added it (it was not there before): its commit came after
    /// the request started.
    pub added: bool,
}

/// What an append left: the shard's list as its last write left it (empty when no write
/// was needed), and the entries it found there already.
struct Appended {
    list: Vec<String>,
    found: BTreeSet<String>,
}

impl Appended {
    fn placed(&self, cidr: &str) -> Placed {
        Placed { at: self.list.iter().position(|e| e == cidr), added: !self.found.contains(cidr) }
    }
}

#[derive(Default)]
struct Queue {
    /// Shards with a writer task running: (policy, entries waiting).
    pending: HashMap<(CalicoApiGroup, String), (String, Vec<Waiter>)>,
}

/// capo's reservations, for holds in the active group and for the leader's work in any.
#[derive(Clone)]
pub struct Reservations {
    store: Datastore,
    /// Where new holds go (moved at run time by a datastore migration).
    writing: WritingGroup,
    /// A hold in progress: the group it started with, whatever moves meanwhile.
    pinned: Option<CalicoApiGroup>,
    index: Arc<ReservationIndex>,
    queue: Arc<Mutex<Queue>>,
    /// Shard names found taken by an object that is not the policy's: skipped from now on.
    taken: Arc<Mutex<HashSet<(CalicoApiGroup, String)>>>,
    /// Counts labels put back after a write through `projectcalico.org/v3`.
    restored: Option<prometheus::IntCounter>,
    /// The newest leader epoch this replica knows (the Lease as last seen, and the
    /// highest epoch on capo's reservations): what a shard the webhook creates starts with.
    epoch_seen: Option<crate::leader::EpochFloor>,
}

impl Reservations {
    /// Holds go to `group` in the API server; the index is the watched copy of every
    /// served group.
    pub fn new(client: Client, group: CalicoApiGroup, index: Arc<ReservationIndex>) -> Self {
        Self::in_datastore(Datastore::Kubernetes(client), group, index)
    }

    /// Holds go to `group` of `store` (Calico's etcd keeps `projectcalico.org/v3` only).
    pub fn in_datastore(store: Datastore, group: CalicoApiGroup, index: Arc<ReservationIndex>) -> Self {
        Self::writing_to(store, WritingGroup::new(group), index)
    }

    /// Holds go to whichever group `writing` says at the time (shared with whoever moves it).
    pub fn writing_to(store: Datastore, writing: WritingGroup, index: Arc<ReservationIndex>) -> Self {
        Self {
            store,
            writing,
            pinned: None,
            index,
            queue: Default::default(),
            taken: Default::default(),
            restored: None,
            epoch_seen: None,
        }
    }

    /// Shards created without a fence (by the webhook) start with the epoch `seen` says:
    /// a leader that lost the Lease before it can no longer write them.
    pub fn with_epoch_seen(mut self, seen: crate::leader::EpochFloor) -> Self {
        self.epoch_seen = Some(seen);
        self
    }

    /// Counts each shard whose labels capo put back in `counter`.
    pub fn counting_restores(mut self, counter: prometheus::IntCounter) -> Self {
        self.restored = Some(counter);
        self
    }

    /// The group new holds go to now.
    pub fn group(&self) -> CalicoApiGroup {
        self.index.canonical(self.pinned.unwrap_or_else(|| self.writing.get()))
    }

    /// These reservations with the group fixed at what it is now: one hold's entry and
    /// record name the same group even if a datastore migration moves it meanwhile.
    pub fn pinned(&self) -> Self {
        Self { pinned: Some(self.group()), ..self.clone() }
    }

    pub fn writing_group(&self) -> &WritingGroup {
        &self.writing
    }

    pub fn index(&self) -> &Arc<ReservationIndex> {
        &self.index
    }

    /// Where the reservations are kept.
    pub fn datastore(&self) -> &Datastore {
        &self.store
    }

    fn classify(&self, group: CalicoApiGroup, e: KubeError) -> CalicoError {
        match status_of(&e) {
            Some(s) if is_type_not_served(s) => CalicoError::NotServed { api: group },
            Some(s) if s.code == 403 => CalicoError::Forbidden { message: s.message.clone() },
            _ => CalicoError::Api(Arc::new(e)),
        }
    }

    /// Where [`Reservations::hold_placed`] puts `entry` when told to prefer this shard: the
    /// policy's shard that lists it already; during a burst, a shard of the policy with
    /// an append in flight and entries waiting for the next, while it holds fewer than
    /// [`JOIN_BELOW`] (its next patch carries this entry too: one request for several
    /// holds); otherwise the first shard of the probe order with room. (The record of a
    /// hold is written at the same time as its entry, and names this shard.)
    pub fn foresee(&self, policy: &str, count: u32, entry: &str) -> String {
        let group = self.group();
        if let Some((_, view)) =
            self.index.shards_with(entry).into_iter().find(|(g, v)| *g == group && v.policy.as_deref() == Some(policy))
        {
            return view.name.clone();
        }
        if let Some(name) = self.writing(policy) {
            return name;
        }
        let taken = self.taken.lock().expect("taken lock");
        shards::probe_order(entry, count)
            .map(|i| shard_name(policy, i))
            .find(|name| {
                !taken.contains(&(group, name.clone()))
                    && self
                        .index
                        .get(group, name)
                        .is_none_or(|v| v.policy.as_deref() == Some(policy) && v.entries.len() < SHARD_SIZE)
            })
            .unwrap_or_else(|| shard_name(policy, 0))
    }

    /// The shard of `policy` a new entry joins during a burst: of those with a writer
    /// running (an append in flight), the one with the most entries waiting, if it holds
    /// fewer than [`JOIN_BELOW`] with them.
    fn writing(&self, policy: &str) -> Option<String> {
        let writing = self.group();
        let taken = self.taken.lock().expect("taken lock");
        let q = self.queue.lock().expect("reservation queue lock");
        q.pending
            .iter()
            .filter(|((group, name), (p, _))| {
                *group == writing && p == policy && !taken.contains(&(*group, name.clone()))
            })
            .filter_map(|((group, name), (_, waiting))| {
                let held = self.index.get(*group, name).map_or(0, |v| v.entries.len());
                (held + waiting.len() < JOIN_BELOW).then_some((waiting.len(), std::cmp::Reverse(held), name))
            })
            .max()
            .map(|(_, _, name)| name.clone())
    }

    /// Holds `entry` for `policy`, whose cap gives it `count` shards; returns the shard
    /// that lists it once the API server has confirmed it there.
    pub async fn hold(&self, policy: &str, count: u32, entry: &str) -> Result<String, CalicoError> {
        self.hold_placed(policy, count, entry, None).await.map(|(shard, _)| shard)
    }

    /// As [`Reservations::hold`], with where the entry went (see [`Placed`]); a new entry
    /// goes to shard `prefer` first (what [`Reservations::foresee`] said), if it is the
    /// policy's and has room.
    pub async fn hold_placed(
        &self,
        policy: &str,
        count: u32,
        entry: &str,
        prefer: Option<&str>,
    ) -> Result<(String, Placed), CalicoError> {
        let writing = self.group();
        for (group, view) in self.index.shards_with(entry) {
            if group == writing
                && view.policy.as_deref() == Some(policy)
                && view.position(entry).is_some()
                && let Some(at) = self.confirm(&view.name, policy, entry).await?
            {
                return Ok((view.name.clone(), Placed { at: Some(at), added: false }));
            }
        }
        let mut tried = 0;
        let preferred = prefer.filter(|name| shards::index_of(name, policy).is_some()).map(str::to_string);
        let probed = shards::probe_order(entry, count).map(|i| shard_name(policy, i));
        for name in preferred.clone().into_iter().chain(probed.filter(|n| Some(n) != preferred.as_ref())) {
            if self.taken.lock().expect("taken lock").contains(&(writing, name.clone())) {
                continue;
            }
            if let Some(view) = self.index.get(writing, &name)
                && (view.policy.as_deref() != Some(policy) || view.entries.len() >= SHARD_SIZE)
            {
                continue;
            }
            tried += 1;
            match self.add(&name, policy, entry).await {
                Ok(placed) => return Ok((name, placed)),
                Err(e) if e.try_next_shard() => {
                    debug!(shard = %name, error = %e, "trying the next shard");
                    if !matches!(e, CalicoError::Full { .. }) {
                        self.taken.lock().expect("taken lock").insert((writing, name));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(CalicoError::NoRoom { policy: policy.to_string(), tried })
    }

    /// Where `entry` is in shard `name` right now, if the shard is still `policy`'s and
    /// lists it: one read from the datastore (a quorum read: the API server asks etcd,
    /// not its watch cache). A read costs the API server less than a patch of tests only,
    /// which it would decode, patch, validate in full and compare (2.0 against 5.1 ms p50
    /// for a shard of 420 entries; docs/performance.md).
    pub async fn confirm(&self, name: &str, policy: &str, entry: &str) -> Result<Option<usize>, CalicoError> {
        match self.read_owned(self.group(), name, Some(policy)).await {
            Ok(view) => Ok(view.position(entry)),
            Err(CalicoError::NotOwned { .. } | CalicoError::OtherPolicy { .. }) => Ok(None),
            Err(CalicoError::Api(e)) if matches!(status_of(&e), Some(s) if s.code == 404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Adds `cidr` to shard `name` (created on first use), together with whatever other
    /// entries were queued for it meanwhile.
    async fn add(&self, name: &str, policy: &str, cidr: &str) -> Result<Placed, CalicoError> {
        let (done, result) = oneshot::channel();
        let key = (self.group(), name.to_string());
        let start_writer = {
            let mut q = self.queue.lock().expect("reservation queue lock");
            let waiter = Waiter { cidr: cidr.to_string(), done };
            match q.pending.get_mut(&key) {
                Some((_, waiters)) => {
                    waiters.push(waiter);
                    false
                }
                None => {
                    q.pending.insert(key.clone(), (policy.to_string(), vec![waiter]));
                    true
                }
            }
        };
        if start_writer {
            let writer = tokio::spawn(self.clone().write_batches(key.clone()));
            // Should the writer die (a panic), its queue goes with it: the waiters get
            // `WriterGone` at once and the next entry starts a new writer.
            let queue = self.queue.clone();
            tokio::spawn(async move {
                if writer.await.is_err() {
                    queue.lock().expect("reservation queue lock").pending.remove(&key);
                }
            });
        }
        result.await.unwrap_or(Err(CalicoError::WriterGone))
    }

    async fn write_batches(self, key: (CalicoApiGroup, String)) {
        // Let the entries of a burst that arrive together go out together.
        tokio::task::yield_now().await;
        #[cfg(test)]
        if tests::PANIC_NEXT_WRITER.swap(false, std::sync::atomic::Ordering::SeqCst) {
            panic!("a writer dies (test)");
        }
        loop {
            let (policy, batch) = {
                let mut q = self.queue.lock().expect("reservation queue lock");
                match q.pending.get_mut(&key) {
                    Some((policy, waiters)) if !waiters.is_empty() => (policy.clone(), std::mem::take(waiters)),
                    _ => {
                        q.pending.remove(&key);
                        return;
                    }
                }
            };
            let cidrs: BTreeSet<String> = batch.iter().map(|w| w.cidr.clone()).collect();
            let result = self.append(key.0, &key.1, &policy, None, cidrs.clone()).await;
            if matches!(result, Err(CalicoError::Rejected { .. })) && cidrs.len() > 1 {
                // One entry the server refuses must not fail the others: each on its own.
                let mut each = HashMap::new();
                for c in &cidrs {
                    each.insert(
                        c.clone(),
                        self.append(key.0, &key.1, &policy, None, BTreeSet::from([c.clone()])).await,
                    );
                }
                for w in batch {
                    let r = match each.get(&w.cidr) {
                        Some(Ok(appended)) => Ok(appended.placed(&w.cidr)),
                        Some(Err(e)) => Err(e.clone()),
                        None => Err(CalicoError::WriterGone),
                    };
                    let _ = w.done.send(r);
                }
                continue;
            }
            debug!(reservation = %key.1, entries = batch.len(), ok = result.is_ok(), "reservation batch written");
            for w in batch {
                let placed = match &result {
                    Ok(appended) => Ok(appended.placed(&w.cidr)),
                    Err(e) => Err(e.clone()),
                };
                let _ = w.done.send(placed);
            }
        }
    }

    /// Appends every entry in `cidrs` to shard `name` of `group`; with `fence`, as the
    /// leader (the shard's epoch is tested). The list is a set: entries the server rejects
    /// as duplicates are dropped (`found`) and the rest sent again.
    async fn append(
        &self,
        group: CalicoApiGroup,
        name: &str,
        policy: &str,
        fence: Option<&Fence>,
        mut cidrs: BTreeSet<String>,
    ) -> Result<Appended, CalicoError> {
        let mut found = BTreeSet::new();
        for attempt in 0..ATTEMPTS {
            if cidrs.is_empty() {
                return Ok(Appended { list: Vec::new(), found });
            }
            let mut ops = ownership(Some(policy));
            if let Some(f) = fence {
                f.check()?;
                ops.push(json!({ "op": "test", "path": epoch_path(), "value": f.epoch().to_string() }));
            }
            ops.extend(
                cidrs.iter().map(|c| json!({ "op": "add", "path": format!("/spec/{RESERVED_CIDRS}/-"), "value": c })),
            );
            let err = match self.store.patch(group, name, ops).await {
                Ok(written) => return Ok(Appended { list: ShardView::from_object(&written).entries, found }),
                Err(e) => e,
            };
            let Some(status) = status_of(&err) else {
                // A connection closed before the answer: send again (a duplicate entry the
                // first attempt wrote is refused with 422 and dropped below).
                if crate::client::is_transport(&err) && attempt + 1 < ATTEMPTS {
                    debug!(reservation = name, attempt, error = %err, "retrying reservation append after a transport error");
                    crate::client::pause_before_retry(attempt).await;
                    continue;
                }
                return Err(CalicoError::Api(Arc::new(err)));
            };
            match status.code {
                404 if !is_type_not_served(status) => {
                    if self.create(group, name, policy, fence, &cidrs).await? {
                        return Ok(Appended { list: cidrs.into_iter().collect(), found });
                    }
                    continue; // created by somebody else meanwhile: append to theirs
                }
                422 => {
                    let current = self.read_owned(group, name, Some(policy)).await?;
                    if let Some(f) = fence
                        && current.epoch != Some(f.epoch())
                    {
                        self.stamp_view(group, &current, f).await?;
                        continue;
                    }
                    let present: HashSet<&String> = current.entries.iter().collect();
                    let before = cidrs.len();
                    cidrs.retain(|c| {
                        let there = present.contains(c);
                        if there {
                            found.insert(c.clone());
                        }
                        !there
                    });
                    if cidrs.len() < before || cidrs.is_empty() {
                        continue; // duplicates dropped; send the rest at once
                    }
                    if current.entries.is_empty() && !self.ensure_list(group, name, &current).await? {
                        continue;
                    }
                    // Not a duplicate: the server refuses the entry itself.
                    return Err(CalicoError::Rejected { message: status.message.clone() });
                }
                _ if is_too_large(status) => {
                    return Err(CalicoError::Full { name: name.to_string(), message: status.message.clone() });
                }
                409 | 429 | 500 | 503 | 504 => {}
                _ => return Err(self.classify(group, err)),
            }
            debug!(reservation = name, attempt, code = status.code, "retrying reservation append");
            crate::client::pause_before_retry(attempt).await;
        }
        Err(CalicoError::Contention)
    }

    /// Creates shard `name` holding `cidrs`. `Ok(false)`: somebody created it first.
    async fn create(
        &self,
        group: CalicoApiGroup,
        name: &str,
        policy: &str,
        fence: Option<&Fence>,
        cidrs: &BTreeSet<String>,
    ) -> Result<bool, CalicoError> {
        let mut obj = DynamicObject::new(name, &group.ip_reservation());
        obj.metadata.labels = Some(
            [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, policy)].map(|(k, v)| (k.into(), v.into())).into(),
        );
        let epoch = match fence {
            Some(f) => f.epoch(),
            None => self.epoch_seen.as_ref().map_or(0, |seen| seen()),
        };
        obj.metadata.annotations = Some([(LEADER_EPOCH_ANNOTATION.to_string(), epoch.to_string())].into());
        obj.data = json!({ "spec": { RESERVED_CIDRS: cidrs } });
        match self.store.create(group, &obj).await {
            Ok(_) => Ok(true),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(false),
            Err(KubeError::Api(s)) if s.code == 422 => Err(CalicoError::Rejected { message: s.message.clone() }),
            Err(KubeError::Api(s)) if is_too_large(&s) => {
                Err(CalicoError::Full { name: name.to_string(), message: s.message.clone() })
            }
            Err(e) => Err(self.classify(group, e)),
        }
    }

    /// Reads shard `name` and checks it is capo's (and `policy`'s, if given). A shard whose
    /// labels a write through `projectcalico.org/v3` moved into Calico's metadata
    /// annotation gets them back first ([`Reservations::restore`]), so that the tests
    /// capo's writes open with hold again.
    async fn read_owned(
        &self,
        group: CalicoApiGroup,
        name: &str,
        policy: Option<&str>,
    ) -> Result<ShardView, CalicoError> {
        let mut attempt = 0;
        loop {
            let obj = self.store.get(group, name).await.map_err(|e| self.classify(group, e))?;
            if !ShardView::is_owned(&obj) {
                return Err(CalicoError::NotOwned { name: name.to_string() });
            }
            let view = ShardView::from_object(&obj);
            if let Some(p) = policy
                && view.policy.as_deref() != Some(p)
            {
                return Err(CalicoError::OtherPolicy {
                    name: name.to_string(),
                    policy: p.to_string(),
                    other: view.policy.clone(),
                });
            }
            if !view.moved || attempt >= ATTEMPTS {
                return Ok(view);
            }
            attempt += 1;
            self.restore(group, &obj).await?;
        }
    }

    /// Puts back the labels and annotations that a write through `projectcalico.org/v3`
    /// (calico-apiserver, `calicoctl`, `kubectl` against v3) moved into Calico's metadata
    /// annotation: the object ends as Calico reads it back (moved values win), with the
    /// rest of that annotation kept, so the v3 view does not change. Only if the object is
    /// unchanged since read. `Ok(true)`: restored; `Ok(false)`: nothing to do, or it
    /// changed meanwhile (read again).
    async fn restore(&self, group: CalicoApiGroup, obj: &DynamicObject) -> Result<bool, CalicoError> {
        let Some(ops) = restore_patch(obj) else { return Ok(false) };
        let name = obj.name_any();
        match self.store.patch(group, &name, ops).await {
            Ok(_) => {
                warn!(
                    reservation = %name,
                    "a write through projectcalico.org/v3 had moved capo's labels into {CALICO_METADATA_ANNOTATION}; put them back"
                );
                if let Some(counter) = &self.restored {
                    counter.inc();
                }
                Ok(true)
            }
            Err(KubeError::Api(s)) if matches!(s.code, 409 | 422 | 429 | 500 | 503 | 504) => Ok(false),
            Err(KubeError::Api(s)) if s.code == 404 && !is_type_not_served(&s) => Ok(false),
            Err(e) => Err(self.classify(group, e)),
        }
    }

    /// The leader's look at a shard the watched copy shows with moved labels: puts them
    /// back. `Ok(true)`: they were put back now.
    pub async fn reown(&self, group: CalicoApiGroup, name: &str) -> Result<bool, CalicoError> {
        let group = self.index.canonical(group);
        let obj = match self.store.get(group, name).await {
            Ok(obj) => obj,
            Err(KubeError::Api(s)) if s.code == 404 && !is_type_not_served(&s) => return Ok(false),
            Err(e) => return Err(self.classify(group, e)),
        };
        if !ShardView::is_owned(&obj) {
            return Ok(false);
        }
        self.restore(group, &obj).await
    }

    /// Gives a capo object without an entry list an empty one (only if unchanged since
    /// read). `Ok(false)`: it changed meanwhile; read again.
    async fn ensure_list(&self, group: CalicoApiGroup, name: &str, current: &ShardView) -> Result<bool, CalicoError> {
        let obj = self.store.get(group, name).await.map_err(|e| self.classify(group, e))?;
        if obj.data.pointer(&format!("/spec/{RESERVED_CIDRS}")).is_some_and(Value::is_array) {
            return Ok(true);
        }
        let fix = if obj.data.get("spec").is_some_and(Value::is_object) {
            json!({ "op": "add", "path": format!("/spec/{RESERVED_CIDRS}"), "value": [] })
        } else {
            json!({ "op": "add", "path": "/spec", "value": { RESERVED_CIDRS: [] } })
        };
        let rv = current.resource_version.clone().unwrap_or_default();
        let ops = vec![json!({ "op": "test", "path": "/metadata/resourceVersion", "value": rv }), fix];
        match self.store.patch(group, name, ops).await {
            Ok(_) => Ok(false),
            Err(KubeError::Api(s)) if s.code == 409 || s.code == 422 => Ok(false),
            Err(e) => Err(self.classify(group, e)),
        }
    }

    /// Raises the leader epoch of a shard to the fence's (only if unchanged since read).
    async fn stamp_view(&self, group: CalicoApiGroup, view: &ShardView, fence: &Fence) -> Result<(), CalicoError> {
        fence.check()?;
        let epoch = fence.epoch();
        if let Some(seen) = view.epoch.filter(|s| *s > epoch) {
            fence.revoke();
            return Err(CalicoError::Fenced { name: view.name.clone(), epoch, seen });
        }
        let rv = view.resource_version.clone().unwrap_or_default();
        let set = if view.has_annotations {
            json!({ "op": "add", "path": epoch_path(), "value": epoch.to_string() })
        } else {
            json!({ "op": "add", "path": "/metadata/annotations", "value": { LEADER_EPOCH_ANNOTATION: epoch.to_string() } })
        };
        let mut ops = ownership(None);
        ops.push(json!({ "op": "test", "path": "/metadata/resourceVersion", "value": rv }));
        ops.push(set);
        match self.store.patch(group, &view.name, ops).await {
            Ok(_) => Ok(()),
            // Changed meanwhile (an append), or a passing failure: the caller reads again.
            Err(KubeError::Api(s))
                if matches!(s.code, 409 | 422 | 429 | 500 | 503 | 504)
                    || (s.code == 404 && !is_type_not_served(&s)) =>
            {
                Ok(())
            }
            Err(e) => Err(self.classify(group, e)),
        }
    }

    /// The leader raises the epoch of shard `name` if its watched copy shows a lower one (a
    /// shard created after the term began, by a webhook that had not seen the new Lease
    /// yet). `true`: a write was sent.
    pub async fn stamp_if_behind(&self, group: CalicoApiGroup, name: &str, fence: &Fence) -> Result<bool, CalicoError> {
        let group = self.index.canonical(group);
        let Some(view) = self.index.get(group, name) else { return Ok(false) };
        if view.epoch.is_some_and(|e| e >= fence.epoch()) {
            return Ok(false);
        }
        self.stamp_view(group, &view, fence).await?;
        Ok(true)
    }

    /// A new leader raises the epoch of every capo-owned shard it sees (of the policies
    /// `in_scope` says it acts on) before it writes anything, so that the replica it took
    /// over from can no longer remove entries.
    pub async fn stamp_all(&self, fence: &Fence, in_scope: impl Fn(&str) -> bool) -> Result<usize, CalicoError> {
        let mut stamped = 0;
        for (group, view) in self.index.all().into_values() {
            if !in_scope(view.policy.as_deref().unwrap_or_default()) {
                continue;
            }
            let mut view = (*view).clone();
            for _ in 0..ATTEMPTS {
                if view.epoch == Some(fence.epoch()) {
                    break;
                }
                self.stamp_view(group, &view, fence).await?;
                view = match self.read_owned(group, &view.name, None).await {
                    Ok(v) => v,
                    Err(CalicoError::Api(e)) if matches!(&*e, KubeError::Api(s) if s.code == 404) => break,
                    Err(e) => return Err(e),
                };
                if view.epoch == Some(fence.epoch()) {
                    stamped += 1;
                }
            }
        }
        Ok(stamped)
    }

    /// Waits until every entry of `cidrs` in shard `name` is [`super::index::YOUNG_ENTRY`]
    /// old by this replica's watch: the leader removes an entry no sooner, for a repeated
    /// review of its hold may have been answered from the append alone.
    pub async fn settled(&self, group: CalicoApiGroup, name: &str, cidrs: &BTreeSet<String>) {
        let young = self.index.young_for(group, name, cidrs);
        if !young.is_zero() {
            debug!(reservation = name, wait = ?young, "an entry to remove was written a moment ago; waiting");
            tokio::time::sleep(young).await;
        }
    }

    /// The leader removes `cidrs` from shard `name` of `group` with one patch: for each
    /// entry a test of its value at its index in the watched copy, then its removal
    /// (highest index first), after tests of ownership and the leader epoch. If anything
    /// moved, the shard is read once and the patch sent again. Entries no longer there
    /// count as removed. Returns the entries removed.
    pub async fn remove(
        &self,
        group: CalicoApiGroup,
        name: &str,
        cidrs: &BTreeSet<String>,
        fence: &Fence,
    ) -> Result<BTreeSet<String>, CalicoError> {
        let group = self.index.canonical(group);
        // What is removed is what the shard holds now: a watched copy that lacks the shard
        // or one of the entries (its watch stalled, or not caught up) is not taken for its
        // absence — that would let the caller delete records whose entries stay.
        let watched = self.index.get(group, name).map(|v| (*v).clone());
        let mut view = match watched {
            Some(v) if cidrs.iter().all(|c| v.position(c).is_some()) => v,
            _ => match self.read_owned(group, name, None).await {
                Ok(v) => v,
                // Gone, or not capo's: nothing of capo's there to remove.
                Err(CalicoError::Api(e)) if matches!(&*e, KubeError::Api(s) if s.code == 404) => {
                    return Ok(BTreeSet::new());
                }
                Err(CalicoError::NotOwned { .. }) => return Ok(BTreeSet::new()),
                Err(e) => return Err(e),
            },
        };
        for attempt in 0..ATTEMPTS {
            fence.check()?;
            let epoch = fence.epoch();
            if view.epoch != Some(epoch) {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(20 * (1 << attempt.min(6)))).await;
                }
                self.stamp_view(group, &view, fence).await?;
                view = match self.read_owned(group, name, None).await {
                    Ok(v) => v,
                    Err(CalicoError::Api(e)) if matches!(&*e, KubeError::Api(s) if s.code == 404) => {
                        return Ok(BTreeSet::new());
                    }
                    Err(e) => return Err(e),
                };
                continue;
            }
            let mut ops = ownership(None);
            ops.push(json!({ "op": "test", "path": epoch_path(), "value": epoch.to_string() }));
            let mut removed = BTreeSet::new();
            for (i, entry) in view.entries.iter().enumerate().rev() {
                if cidrs.contains(entry) {
                    let path = format!("/spec/{RESERVED_CIDRS}/{i}");
                    ops.push(json!({ "op": "test", "path": path, "value": entry }));
                    ops.push(json!({ "op": "remove", "path": path }));
                    removed.insert(entry.clone());
                }
            }
            if removed.is_empty() {
                return Ok(removed);
            }
            match self.store.patch(group, name, ops).await {
                Ok(_) => return Ok(removed),
                Err(KubeError::Api(s)) if s.code == 404 && !is_type_not_served(&s) => return Ok(BTreeSet::new()),
                Err(KubeError::Api(s)) if matches!(s.code, 409 | 422 | 429 | 500 | 503 | 504) => {
                    debug!(reservation = name, attempt, code = s.code, "reservation changed meanwhile; reading again");
                    if s.code != 422 {
                        tokio::time::sleep(Duration::from_millis(20 * (1 << attempt.min(6)))).await;
                    }
                    view = match self.read_owned(group, name, None).await {
                        Ok(v) => v,
                        Err(CalicoError::Api(e)) if matches!(&*e, KubeError::Api(s) if s.code == 404) => {
                            return Ok(BTreeSet::new());
                        }
                        Err(e) => return Err(e),
                    };
                    if let Some(seen) = view.epoch.filter(|s| *s > epoch) {
                        fence.revoke();
                        return Err(CalicoError::Fenced { name: name.to_string(), epoch, seen });
                    }
                }
                Err(e) => return Err(self.classify(group, e)),
            }
        }
        Err(CalicoError::Contention)
    }

    /// The leader puts a record's missing entry back into its shard.
    pub async fn write_back(
        &self,
        group: CalicoApiGroup,
        name: &str,
        policy: &str,
        cidr: &str,
        fence: &Fence,
    ) -> Result<(), CalicoError> {
        let group = self.index.canonical(group);
        self.append(group, name, policy, Some(fence), BTreeSet::from([cidr.to_string()])).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    /// Makes the next writer task panic before it writes.
    pub(super) static PANIC_NEXT_WRITER: AtomicBool = AtomicBool::new(false);

    /// A writer that dies fails its waiters at once, and the next entry gets a new writer
    /// instead of queueing behind the dead one until its deadline.
    #[tokio::test]
    async fn a_dead_writer_does_not_block_later_holds() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        config.connect_timeout = Some(Duration::from_millis(200));
        let index = Arc::new(ReservationIndex::default());
        let reservations = Reservations::new(Client::try_from(config).unwrap(), CalicoApiGroup::CrdV1, index);
        PANIC_NEXT_WRITER.store(true, std::sync::atomic::Ordering::SeqCst);
        let started = Instant::now();
        let first = reservations.add("capo-p", "p", "10.0.0.1/32").await;
        assert!(matches!(first, Err(CalicoError::WriterGone)), "{first:?}");
        let second = tokio::time::timeout(Duration::from_secs(5), reservations.add("capo-p", "p", "10.0.0.2/32")).await;
        assert!(matches!(second, Ok(Err(CalicoError::Api(_)))), "{second:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// The labels and annotations a write through v3 moved are put back as Calico reads
    /// them (moved values win), the user's own kept, the rest of Calico's annotation kept,
    /// and only if nothing changed since the read.
    #[test]
    fn moved_labels_are_put_back_as_calico_reads_them() {
        let meta = json!({
            "creationTimestamp": "2026-11-26T06:29:40Z",
            "labels": { MANAGED_BY_LABEL: MANAGED_BY_VALUE, POLICY_LABEL: "p", "team": "db" },
            "annotations": { LEADER_EPOCH_ANNOTATION: "3" },
        });
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "crd.projectcalico.org/v1", "kind": "IPReservation",
            "metadata": { "name": "capo-p", "resourceVersion": "42",
                          "labels": { "projectcalico.org/kept": "x" },
                          "annotations": { CALICO_METADATA_ANNOTATION: meta.to_string(), LEADER_EPOCH_ANNOTATION: "1" } },
            "spec": { "reservedCIDRs": ["10.0.0.1/32"] },
        }))
        .unwrap();
        let ops = restore_patch(&obj).expect("labels to put back");
        assert_eq!(ops[0], json!({ "op": "test", "path": "/metadata/resourceVersion", "value": "42" }));
        assert_eq!(
            ops[1]["value"],
            json!({ MANAGED_BY_LABEL: MANAGED_BY_VALUE, POLICY_LABEL: "p", "team": "db", "projectcalico.org/kept": "x" })
        );
        let annotations = &ops[2]["value"];
        assert_eq!(annotations[LEADER_EPOCH_ANNOTATION], "3");
        let rest: Value = serde_json::from_str(annotations[CALICO_METADATA_ANNOTATION].as_str().unwrap()).unwrap();
        assert_eq!(rest, json!({ "creationTimestamp": "2026-11-26T06:29:40Z" }));

        let mut restored = obj.clone();
        restored.metadata.labels = serde_json::from_value(ops[1]["value"].clone()).unwrap();
        restored.metadata.annotations = serde_json::from_value(annotations.clone()).unwrap();
        assert!(restore_patch(&restored).is_none(), "nothing left to put back");
        assert!(ShardView::from_object(&restored).epoch == Some(3) && !ShardView::from_object(&restored).moved);
    }

    /// During a burst a new entry is foreseen for (and held in) a shard of its policy with
    /// a writer running, the one with most entries waiting, while it holds fewer than
    /// `JOIN_BELOW`; otherwise for its home shard. Another policy's writer is not joined.
    #[tokio::test]
    async fn a_burst_joins_the_policys_shard_with_an_append_in_flight() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        let index = Arc::new(ReservationIndex::default());
        let reservations = Reservations::new(Client::try_from(config).unwrap(), CalicoApiGroup::CrdV1, index.clone());
        let entry = "10.0.0.9/32";
        let home = shard_name("p", shards::home(entry, 24));
        let (a, b) = (shard_name("p", 30), shard_name("p", 31));
        assert!(home != a && home != b);
        assert_eq!(reservations.foresee("p", 24, entry), home, "no writer running: its home shard");
        let writing = |name: &str, policy: &str, waiting: usize| {
            let waiters =
                (0..waiting).map(|i| Waiter { cidr: format!("10.9.0.{i}/32"), done: oneshot::channel().0 }).collect();
            let mut q = reservations.queue.lock().unwrap();
            q.pending.insert((CalicoApiGroup::CrdV1, name.to_string()), (policy.to_string(), waiters));
        };
        writing(&shard_name("other", 1), "other", 5);
        assert_eq!(reservations.foresee("p", 24, entry), home, "another policy's writer is not joined");
        writing(&a, "p", 1);
        writing(&b, "p", 3);
        assert_eq!(reservations.foresee("p", 24, entry), b, "the writer with most entries waiting");
        let view = |name: &str, n: usize| ShardView {
            name: name.to_string(),
            policy: Some("p".into()),
            entries: (0..n).map(|i| format!("10.1.{}.{}/32", i / 256, i % 256)).collect(),
            ..Default::default()
        };
        index.put_for_test(CalicoApiGroup::CrdV1, view(&b, JOIN_BELOW - 3));
        assert_eq!(reservations.foresee("p", 24, entry), a, "b with its waiting entries is at JOIN_BELOW");
        index.put_for_test(CalicoApiGroup::CrdV1, view(&a, JOIN_BELOW));
        assert_eq!(reservations.foresee("p", 24, entry), home, "both full enough: home again");
        reservations.taken.lock().unwrap().insert((CalicoApiGroup::CrdV1, home.clone()));
        assert_ne!(reservations.foresee("p", 24, entry), home, "a taken home shard is skipped");
    }

    /// A shard that is full by the watched copy, or another policy's, is skipped.
    #[test]
    fn full_and_foreign_shards_are_skipped() {
        let index = ReservationIndex::default();
        let full = ShardView {
            name: shard_name("p", 0),
            policy: Some("p".into()),
            entries: (0..SHARD_SIZE).map(|i| format!("10.1.{}.{}/32", i / 256, i % 256)).collect(),
            ..Default::default()
        };
        index.put_for_test(CalicoApiGroup::CrdV1, full);
        index.put_for_test(
            CalicoApiGroup::CrdV1,
            ShardView { name: shard_name("p", 1), policy: Some("p-other".into()), ..Default::default() },
        );
        let skip = |name: &str| {
            index
                .get(CalicoApiGroup::CrdV1, name)
                .is_some_and(|v| v.policy.as_deref() != Some("p") || v.entries.len() >= SHARD_SIZE)
        };
        assert!(skip("capo-p") && skip("capo-p.1") && !skip("capo-p.2"));
    }
}
