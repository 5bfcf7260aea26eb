//! What capo keeps in memory, each kept current by one watch: Pods (trimmed to
//! [`crate::pod::PodFacts`] as they are decoded) and Namespaces for every replica — the
//! admission path decides from them with no API read — and, on the leader, ReservedIP
//! records and workload metadata. Every watch decodes each object on its own, so one it
//! cannot read is reported and skipped instead of stalling the rest. Stores tell
//! subscribers what changed.

pub mod guard;
pub mod namespaces;
pub mod pods;
pub mod records;
pub mod workloads;

use std::fmt::Debug;

use futures::StreamExt;
use kube::Resource;
use kube::api::Api;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tracing::warn;

pub use guard::Guarded;
pub use namespaces::{NamespaceFacts, NamespaceStore};
pub use pods::PodStore;
pub use records::RecordIndex;
pub use workloads::WorkloadStore;

/// One event of a guarded watch, as a store applies it.
pub enum Change<K> {
    /// A fresh list begins.
    Restart,
    /// An object of the list (`initial`), or a change.
    Apply {
        object: K,
        initial: bool,
    },
    Delete(K),
    /// The list is complete.
    Listed,
    /// An object that could not be decoded (reported once per version by the watch).
    Invalid(Box<InvalidObject>),
    /// The watch failed (it retries with backoff).
    Failed(String),
}

/// Runs a watch of `api` in which every object is decoded on its own, and hands each event
/// to `apply` until the task is dropped.
pub async fn guarded_watch<K, F>(what: &'static str, api: Api<Guarded<K>>, config: watcher::Config, mut apply: F)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
    F: FnMut(Change<K>),
{
    let mut events = watcher(api, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let change = match event {
            Ok(watcher::Event::Init) => Change::Restart,
            Ok(watcher::Event::InitApply(Guarded(o))) => match o {
                Ok(object) => Change::Apply { object, initial: true },
                Err(bad) => Change::Invalid(Box::new(bad)),
            },
            Ok(watcher::Event::Apply(Guarded(o))) => match o {
                Ok(object) => Change::Apply { object, initial: false },
                Err(bad) => Change::Invalid(Box::new(bad)),
            },
            Ok(watcher::Event::Delete(Guarded(o))) => match o {
                Ok(object) => Change::Delete(object),
                Err(bad) => Change::Invalid(Box::new(bad)),
            },
            Ok(watcher::Event::InitDone) => Change::Listed,
            Err(e) => {
                warn!(watch = what, error = %e, "watch failed; retrying");
                Change::Failed(e.to_string())
            }
        };
        if let Change::Invalid(bad) = &change {
            warn!(
                watch = what,
                name = bad.metadata.name.as_deref().unwrap_or_default(),
                namespace = bad.metadata.namespace.as_deref().unwrap_or_default(),
                error = %bad.error,
                "an object capo cannot decode; skipping it"
            );
        }
        apply(change);
    }
}
