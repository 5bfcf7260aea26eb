//! When each hold's countdown started (its Pod first seen gone), as this leader knows it,
//! and the flush of those starts to the countdown ConfigMaps
//! ([`crate::release::countdowns`]): at most one write per shard per
//! [`countdowns::FLUSH_EVERY`], only for shards whose starts changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client, ResourceExt};
use prometheus::IntGaugeVec;
use tracing::{debug, warn};

use crate::leader::Fence;
use crate::release::countdowns::{self, Part};
use crate::release::decide;
use crate::store::RecordIndex;

struct Start {
    uid: String,
    at: Timestamp,
    part: Part,
}

#[derive(Default)]
struct Inner {
    /// Record name → its start.
    by_record: HashMap<String, Start>,
    /// Shard → the records with a start there.
    parts: HashMap<Part, BTreeSet<String>>,
    /// Shards whose ConfigMap no longer says what this leader knows.
    dirty: BTreeSet<Part>,
    /// Shards whose ConfigMap exists, as far as this leader knows (read or written): their
    /// next write is a replace, the others' a create.
    existing: BTreeSet<Part>,
    /// Policy → how many of its holds count down (`capo_countdowns_running`).
    running: HashMap<String, i64>,
}

/// What [`Starts::load`] took from a former leader's ConfigMaps.
#[derive(Debug, Default)]
pub struct Loaded {
    /// How many starts were taken.
    pub taken: usize,
    /// Records whose start was later than now (plus the skew allowance), with the start
    /// read; each was taken as now.
    pub ahead: Vec<(String, Timestamp)>,
}

#[derive(Default)]
pub struct Starts {
    inner: Mutex<Inner>,
    /// Held while a flush writes, so two flushes (the periodic one and the last one, on
    /// shutdown) never write one shard out of order.
    flushing: tokio::sync::Mutex<()>,
    /// `capo_countdowns_running`, by policy.
    gauge: Option<IntGaugeVec>,
}

/// Why a flush did not write everything (the rest is tried again at the next).
#[derive(Debug, thiserror::Error)]
#[error("writing the countdowns of reservation {reservation} (ConfigMap {namespace}/{name}): {source}")]
pub struct FlushError {
    pub reservation: String,
    pub policy: String,
    pub namespace: String,
    pub name: String,
    #[source]
    pub source: kube::Error,
}

impl Starts {
    /// Starts that report how many holds count down, by policy, on `gauge`.
    pub fn with_gauge(gauge: IntGaugeVec) -> Self {
        Self { gauge: Some(gauge), ..Default::default() }
    }

    /// Sets the gauge of `policy` from what is kept.
    fn report(&self, inner: &Inner, policy: &str) {
        if let Some(g) = &self.gauge {
            g.with_label_values(&[policy]).set(inner.running.get(policy).copied().unwrap_or(0));
        }
    }

    /// Takes this term's counts off the gauge (a follower counts nothing down).
    pub fn unreport(&self) {
        if let Some(g) = &self.gauge {
            for policy in self.inner().running.keys() {
                let _ = g.remove_label_values(&[policy]);
            }
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("countdown starts lock")
    }

    /// The start of `record` (with the UID it was noted for), if any.
    pub fn get(&self, record: &str) -> Option<(String, Timestamp)> {
        self.inner().by_record.get(record).map(|s| (s.uid.clone(), s.at))
    }

    /// Notes that `record` (of `uid`, in `part`) started counting down `at`; a start
    /// already noted for the same UID stays.
    pub fn start(&self, record: &str, uid: &str, at: Timestamp, part: Part) {
        let mut inner = self.inner();
        if inner.by_record.get(record).is_some_and(|s| s.uid == uid) {
            return;
        }
        let old = inner.remove(record);
        inner.dirty.insert(part.clone());
        let policy = part.policy.clone();
        inner.insert(record.to_string(), Start { uid: uid.to_string(), at, part });
        if let Some(old) = old.filter(|o| *o != policy) {
            self.report(&inner, &old);
        }
        self.report(&inner, &policy);
    }

    /// `record` is not counting down (its Pod is back or still there), or is gone.
    pub fn remove(&self, record: &str) {
        let mut inner = self.inner();
        if let Some(policy) = inner.remove(record) {
            self.report(&inner, &policy);
        }
    }

    /// What a former leader flushed (`cms`, the countdown ConfigMaps of capo's namespace),
    /// for the records of `records` that are in scope and carry no `status.podGoneAt`;
    /// a ConfigMap naming records that are gone is written again at the next flush.
    /// Returns how many starts were taken, and the records whose start was ahead of `now`
    /// (taken as `now`, and written so at the next flush).
    pub fn load(
        &self,
        cms: &[ConfigMap],
        records: &RecordIndex,
        in_scope: impl Fn(&str) -> bool,
        now: Timestamp,
    ) -> Loaded {
        let by_uid: HashMap<String, _> = records
            .matching(|r| in_scope(&r.spec.policy))
            .into_iter()
            .filter_map(|r| Some((r.metadata.uid.clone()?, r)))
            .collect();
        let mut inner = self.inner();
        let mut loaded = Loaded::default();
        for cm in cms {
            let (Some(part), starts) = countdowns::parse(cm) else { continue };
            if !in_scope(&part.policy) {
                continue;
            }
            inner.existing.insert(part.clone());
            for (uid, at) in starts {
                let Some(rec) = by_uid.get(&uid) else {
                    inner.dirty.insert(part.clone());
                    continue;
                };
                if rec.status.as_ref().is_some_and(|s| s.pod_gone_at.is_some()) {
                    inner.dirty.insert(part.clone());
                    continue;
                }
                let name = rec.name_any();
                let at_part = Part::of(rec);
                if at_part != part {
                    inner.dirty.insert(part.clone());
                    inner.dirty.insert(at_part.clone());
                }
                inner.remove(&name);
                // A ConfigMap anyone with rights in capo's namespace can edit is a claim: a
                // start before the record existed (the API server's clock) is never taken.
                let at = rec.metadata.creation_timestamp.as_ref().map_or(at, |c| at.max(c.0));
                // Nor one later than now (a former leader's clock ahead of this one's, an
                // edit): counted from it, the hold would stay until that date.
                let at = match decide::not_ahead(at, now) {
                    taken if taken != at => {
                        loaded.ahead.push((name.clone(), at));
                        inner.dirty.insert(at_part.clone());
                        taken
                    }
                    _ => at,
                };
                inner.insert(name, Start { uid, at, part: at_part });
                loaded.taken += 1;
            }
        }
        let policies: Vec<String> = inner.running.keys().cloned().collect();
        for policy in policies {
            self.report(&inner, &policy);
        }
        // Loading is not a change: only what differs from the objects is written back.
        loaded
    }

    /// Writes the ConfigMap of every shard whose starts changed since the last flush
    /// (deletes it once a shard has none), each after checking the fence. Returns how
    /// many were written; a failed write is tried again at the next flush.
    pub async fn flush(&self, client: &Client, namespace: &str, fence: &Fence) -> Result<usize, FlushError> {
        let _one_at_a_time = self.flushing.lock().await;
        let dirty = std::mem::take(&mut self.inner().dirty);
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
        let mut written = 0;
        let mut parts = dirty.into_iter();
        while let Some(part) = parts.next() {
            let starts: BTreeMap<String, Timestamp> = {
                let inner = self.inner();
                let names = inner.parts.get(&part).into_iter().flatten();
                names.filter_map(|n| inner.by_record.get(n)).map(|s| (s.uid.clone(), s.at)).collect()
            };
            let exists = self.inner().existing.contains(&part);
            let result = match fence.check() {
                Ok(()) => write(&api, countdowns::render(namespace, &part, &starts), exists).await,
                // Not leading any more: the next leader writes its own.
                Err(_) => return Ok(written),
            };
            if let Err(source) = result {
                let mut inner = self.inner();
                inner.dirty.insert(part.clone());
                inner.dirty.extend(parts);
                let name = part.object_name();
                return Err(FlushError {
                    reservation: part.reservation,
                    policy: part.policy,
                    namespace: namespace.to_string(),
                    name,
                    source,
                });
            }
            debug!(reservation = %part.reservation, group = %part.group, policy = %part.policy, starts = starts.len(), "countdowns flushed");
            let mut inner = self.inner();
            if starts.is_empty() {
                inner.existing.remove(&part);
            } else {
                inner.existing.insert(part);
            }
            written += 1;
        }
        Ok(written)
    }
}

impl Inner {
    fn insert(&mut self, record: String, start: Start) {
        self.parts.entry(start.part.clone()).or_default().insert(record.clone());
        *self.running.entry(start.part.policy.clone()).or_default() += 1;
        self.by_record.insert(record, start);
    }

    /// Forgets `record`'s start; returns its policy if it had one.
    fn remove(&mut self, record: &str) -> Option<String> {
        let old = self.by_record.remove(record)?;
        if let Some(names) = self.parts.get_mut(&old.part) {
            names.remove(record);
            if names.is_empty() {
                self.parts.remove(&old.part);
            }
        }
        if let Some(n) = self.running.get_mut(&old.part.policy) {
            *n -= 1;
        }
        let policy = old.part.policy.clone();
        self.dirty.insert(old.part);
        Some(policy)
    }
}

/// Replaces the ConfigMap (`exists`) or creates it, each falling back to the other when
/// the API server says it is missing or already there; deletes it when it would be empty.
async fn write(api: &Api<ConfigMap>, cm: ConfigMap, exists: bool) -> Result<(), kube::Error> {
    let name = cm.name_any();
    let is_404 = |e: &kube::Error| matches!(e, kube::Error::Api(s) if s.code == 404);
    let is_409 = |e: &kube::Error| matches!(e, kube::Error::Api(s) if s.code == 409);
    if cm.data.as_ref().is_none_or(|d| d.is_empty()) {
        return match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if is_404(&e) => Ok(()),
            Err(e) => Err(e),
        };
    }
    let pp = PostParams { field_manager: Some("capo".into()), ..Default::default() };
    let result = if exists {
        match api.replace(&name, &pp, &cm).await {
            Err(e) if is_404(&e) => api.create(&pp, &cm).await,
            other => other,
        }
    } else {
        match api.create(&pp, &cm).await {
            Err(e) if is_409(&e) => api.replace(&name, &pp, &cm).await,
            other => other,
        }
    };
    result.map(|_| ()).inspect_err(|e| warn!(configmap = %name, error = %e, "countdowns: write failed"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(n: u32) -> Part {
        Part { group: "crd.projectcalico.org/v1".into(), reservation: format!("capo-p.{n}"), policy: "p".into() }
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn a_start_stays_for_its_uid_and_marks_its_shard_changed() {
        let starts = Starts::default();
        starts.start("r1", "u1", at(100), part(1));
        starts.start("r1", "u1", at(200), part(1));
        assert_eq!(starts.get("r1"), Some(("u1".into(), at(100))), "the first sight stays");
        starts.inner().dirty.clear();
        starts.start("r1", "u2", at(300), part(1));
        assert_eq!(starts.get("r1"), Some(("u2".into(), at(300))), "a new record of that name starts afresh");
        assert!(starts.inner().dirty.contains(&part(1)));
    }

    #[test]
    fn removing_the_last_start_of_a_shard_leaves_it_to_be_emptied() {
        let starts = Starts::default();
        starts.start("r1", "u1", at(100), part(1));
        starts.start("r2", "u2", at(100), part(2));
        starts.inner().dirty.clear();
        starts.remove("r1");
        starts.remove("nothing");
        let inner = starts.inner();
        assert_eq!(inner.dirty.iter().collect::<Vec<_>>(), vec![&part(1)]);
        assert!(!inner.parts.contains_key(&part(1)), "nothing left there: the flush deletes its ConfigMap");
        assert_eq!(inner.parts[&part(2)].len(), 1);
    }
}
