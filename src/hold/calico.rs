//! capo-owned Calico `IPReservation`s: entries appended without losing a concurrent
//! append, an entry already present counted as success, and no write to an object capo
//! does not own.
//!
//! Concurrent holds for the same reservation are group-committed: while one patch is in
//! flight, new entries queue up and go out together in the next one. A burst of
//! deletions (a drained node, a scaled-down StatefulSet) costs a handful of writes to the
//! reservation instead of one contended write per IP.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use capo_api::CalicoApiGroup;
use capo_api::calico::RESERVED_CIDRS;
use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::Status;
use kube::{Client, Error as KubeError};
use serde_json::json;
use tokio::sync::oneshot;
use tracing::debug;

/// How often one batch retries after conflicts, lost create races or throttling.
const ATTEMPTS: usize = 10;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CalicoError {
    #[error("{api} IPReservation is not served by the API server: is Calico (or its CRDs) installed?")]
    NotServed { api: CalicoApiGroup },
    #[error(
        "IPReservation {name} exists but is not managed by capo (label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE} missing); capo will not touch it"
    )]
    NotOwned { name: String },
    #[error("forbidden: {message}")]
    Forbidden { message: String },
    #[error("gave up after {ATTEMPTS} attempts that conflicted or were throttled")]
    Contention,
    #[error("the writer of this reservation stopped")]
    WriterGone,
    #[error("the API server rejected the entry: {message}")]
    Rejected { message: String },
    #[error("{0}")]
    Api(#[source] Arc<KubeError>),
}

impl CalicoError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotServed { .. } => "calico_not_served",
            Self::NotOwned { .. } => "not_owned",
            Self::Forbidden { .. } => "forbidden",
            Self::Contention => "contention",
            Self::WriterGone => "writer_gone",
            Self::Rejected { .. } => "rejected",
            Self::Api(_) => "api",
        }
    }
}

struct Waiter {
    cidr: String,
    done: oneshot::Sender<Result<(), CalicoError>>,
}

#[derive(Default)]
struct Queue {
    /// Reservations with a writer task running, and the entries waiting for it.
    pending: HashMap<String, (String, Vec<Waiter>)>,
}

#[derive(Clone)]
pub struct Reservations {
    api: Api<DynamicObject>,
    group: CalicoApiGroup,
    queue: Arc<Mutex<Queue>>,
}

fn status_of(e: &KubeError) -> Option<&Status> {
    match e {
        KubeError::Api(s) => Some(s),
        _ => None,
    }
}

/// The API server's answer when a resource type (not an object) does not exist: a 404
/// that names no object ("the server could not find the requested resource" when the
/// group is served, a bare "404 page not found" when it is not).
pub(crate) fn is_type_not_served(s: &Status) -> bool {
    s.code == 404 && s.details.as_ref().is_none_or(|d| d.name.is_empty())
}

fn pointer_escape(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

impl Reservations {
    pub fn new(client: Client, group: CalicoApiGroup) -> Self {
        Self { api: Api::all_with(client, &group.ip_reservation()), group, queue: Default::default() }
    }

    pub fn group(&self) -> CalicoApiGroup {
        self.group
    }

    fn classify(&self, e: KubeError) -> CalicoError {
        match status_of(&e) {
            Some(s) if is_type_not_served(s) => CalicoError::NotServed { api: self.group },
            Some(s) if s.code == 403 => CalicoError::Forbidden { message: s.message.clone() },
            _ => CalicoError::Api(Arc::new(e)),
        }
    }

    /// Adds `cidr` to the reservation `name` (created on first use) and returns once it is
    /// stored, together with whatever other entries were queued meanwhile.
    pub async fn add(&self, name: &str, policy: &str, cidr: &str) -> Result<(), CalicoError> {
        let (done, result) = oneshot::channel();
        let start_writer = {
            let mut q = self.queue.lock().expect("reservation queue lock");
            let waiter = Waiter { cidr: cidr.to_string(), done };
            match q.pending.get_mut(name) {
                Some((_, waiters)) => {
                    waiters.push(waiter);
                    false
                }
                None => {
                    q.pending.insert(name.to_string(), (policy.to_string(), vec![waiter]));
                    true
                }
            }
        };
        if start_writer {
            let writer = tokio::spawn(self.clone().write_batches(name.to_string()));
            // Should the writer die (a panic), its queue goes with it: the waiters get
            // `WriterGone` at once and the next entry starts a new writer, instead of every
            // later hold for this reservation waiting for a writer that is gone.
            let queue = self.queue.clone();
            let name = name.to_string();
            tokio::spawn(async move {
                if writer.await.is_err() {
                    queue.lock().expect("reservation queue lock").pending.remove(&name);
                }
            });
        }
        result.await.unwrap_or(Err(CalicoError::WriterGone))
    }

    /// Writes queued entries, a batch at a time, until the queue of `name` is empty.
    async fn write_batches(self, name: String) {
        // Let the entries of a burst that arrive together go out together.
        tokio::task::yield_now().await;
        #[cfg(test)]
        if tests::PANIC_NEXT_WRITER.swap(false, std::sync::atomic::Ordering::SeqCst) {
            panic!("a writer dies (test)");
        }
        loop {
            let (policy, batch) = {
                let mut q = self.queue.lock().expect("reservation queue lock");
                match q.pending.get_mut(&name) {
                    Some((policy, waiters)) if !waiters.is_empty() => (policy.clone(), std::mem::take(waiters)),
                    _ => {
                        q.pending.remove(&name);
                        return;
                    }
                }
            };
            let cidrs: BTreeSet<String> = batch.iter().map(|w| w.cidr.clone()).collect();
            let result = self.append(&name, &policy, cidrs.clone()).await;
            if matches!(result, Err(CalicoError::Rejected { .. })) && cidrs.len() > 1 {
                // One entry the server refuses must not fail the others: each on its own.
                let mut each = HashMap::new();
                for c in &cidrs {
                    each.insert(c.clone(), self.append(&name, &policy, BTreeSet::from([c.clone()])).await);
                }
                for w in batch {
                    let r = each.get(&w.cidr).cloned().unwrap_or(Err(CalicoError::WriterGone));
                    let _ = w.done.send(r);
                }
                continue;
            }
            debug!(reservation = %name, entries = batch.len(), ok = result.is_ok(), "reservation batch written");
            for w in batch {
                let _ = w.done.send(result.clone());
            }
        }
    }

    /// Appends every entry in `cidrs` to the reservation.
    ///
    /// One JSON patch first tests capo's ownership label, then adds each entry to the end
    /// of the list: the server applies it to the latest version, so appends from other
    /// replicas are never overwritten. The list is a set; if the server rejects an entry
    /// as a duplicate, the entries already present are dropped and the rest sent again.
    async fn append(&self, name: &str, policy: &str, mut cidrs: BTreeSet<String>) -> Result<(), CalicoError> {
        let label_path = format!("/metadata/labels/{}", pointer_escape(MANAGED_BY_LABEL));
        for attempt in 0..ATTEMPTS {
            if cidrs.is_empty() {
                return Ok(());
            }
            let mut ops = vec![json!({ "op": "test", "path": label_path, "value": MANAGED_BY_VALUE })];
            ops.extend(
                cidrs.iter().map(|c| json!({ "op": "add", "path": format!("/spec/{RESERVED_CIDRS}/-"), "value": c })),
            );
            let patch: json_patch::Patch = serde_json::from_value(json!(ops)).expect("static patch shape");
            let err = match self.api.patch(name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            let Some(status) = status_of(&err) else { return Err(CalicoError::Api(Arc::new(err))) };
            match status.code {
                404 if !is_type_not_served(status) => {
                    if self.create(name, policy, &cidrs).await? {
                        return Ok(());
                    }
                    continue; // created by somebody else meanwhile: append to theirs
                }
                422 => {
                    let present = self.present_entries(name).await?;
                    let before = cidrs.len();
                    cidrs.retain(|c| !present.contains(c));
                    if cidrs.len() < before || cidrs.is_empty() {
                        continue; // duplicates dropped; send the rest at once
                    }
                    // Not a duplicate: the server refuses the entry itself. Retrying cannot
                    // help; say why.
                    return Err(CalicoError::Rejected { message: status.message.clone() });
                }
                409 | 429 | 500 | 503 | 504 => {}
                _ => return Err(self.classify(err)),
            }
            debug!(reservation = name, attempt, code = status.code, "retrying reservation append");
            tokio::time::sleep(Duration::from_millis(10 * (1 << attempt.min(6)))).await;
        }
        Err(CalicoError::Contention)
    }

    /// Creates the reservation holding `cidrs`. `Ok(false)`: somebody created it first.
    async fn create(&self, name: &str, policy: &str, cidrs: &BTreeSet<String>) -> Result<bool, CalicoError> {
        let mut obj = DynamicObject::new(name, &self.group.ip_reservation());
        obj.metadata.labels = Some(
            [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, policy)].map(|(k, v)| (k.into(), v.into())).into(),
        );
        obj.data = json!({ "spec": { RESERVED_CIDRS: cidrs } });
        match self.api.create(&PostParams::default(), &obj).await {
            Ok(_) => Ok(true),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(false),
            Err(KubeError::Api(s)) if s.code == 422 => Err(CalicoError::Rejected { message: s.message.clone() }),
            Err(e) => Err(self.classify(e)),
        }
    }

    /// After a 422: the entries already in the reservation. Fails if the object is not
    /// capo's (the ownership test failed); gives it an empty entry list if it has none
    /// (only on capo's object, and only if unchanged since read).
    async fn present_entries(&self, name: &str) -> Result<BTreeSet<String>, CalicoError> {
        let obj = self.api.get(name).await.map_err(|e| self.classify(e))?;
        let owned = obj.metadata.labels.as_ref().and_then(|l| l.get(MANAGED_BY_LABEL)).map(String::as_str)
            == Some(MANAGED_BY_VALUE);
        if !owned {
            return Err(CalicoError::NotOwned { name: name.to_string() });
        }
        if let Some(list) = obj.data.pointer(&format!("/spec/{RESERVED_CIDRS}")).and_then(|v| v.as_array()) {
            return Ok(list.iter().filter_map(|v| v.as_str().map(String::from)).collect());
        }
        let rv = obj.metadata.resource_version.clone().unwrap_or_default();
        let has_spec = obj.data.get("spec").is_some_and(|s| s.is_object());
        let fix = if has_spec {
            json!({ "op": "add", "path": format!("/spec/{RESERVED_CIDRS}"), "value": [] })
        } else {
            json!({ "op": "add", "path": "/spec", "value": { RESERVED_CIDRS: [] } })
        };
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{ "op": "test", "path": "/metadata/resourceVersion", "value": rv }, fix]))
                .expect("static patch shape");
        match self.api.patch(name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => Ok(BTreeSet::new()),
            Err(KubeError::Api(s)) if s.code == 409 || s.code == 422 => Ok(BTreeSet::new()), // changed meanwhile; retry
            Err(e) => Err(self.classify(e)),
        }
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
        let reservations = Reservations::new(Client::try_from(config).unwrap(), CalicoApiGroup::CrdV1);
        PANIC_NEXT_WRITER.store(true, std::sync::atomic::Ordering::SeqCst);
        let started = Instant::now();
        let first = reservations.add("capo-p", "p", "10.0.0.1/32").await;
        assert!(matches!(first, Err(CalicoError::WriterGone)), "{first:?}");
        // The next one is written by a new writer: here it fails fast (nothing listens on
        // the port), instead of hanging.
        let second = tokio::time::timeout(Duration::from_secs(5), reservations.add("capo-p", "p", "10.0.0.2/32")).await;
        assert!(matches!(second, Ok(Err(CalicoError::Api(_)))), "{second:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
