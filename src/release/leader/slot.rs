//! A policy's release slot (a `Key::Release`): the releases the pacer hands out, each
//! re-decided against the current record and Pod, its Pod marked, its entry removed (one
//! fenced write per shard), its record deleted. It remembers, per record, how often its
//! Pod could not be marked (the backoff).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use capo_api::CalicoApiGroup;
use capo_api::keys::RELEASED_ANNOTATION;
use futures::StreamExt;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use tokio::time::Instant;
use tracing::{info, warn};

use super::context::{Key, Shared};
use super::policy::PolicyWork;
use crate::events::pod_ref;
use crate::hold::marks;
use crate::release::decide::{self, PodState, ReleaseReason};
use crate::release::pacer::{Leaving, Taken};
use crate::release::writes::{RecordFate, ReleaseError};

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
/// When a released hold's record that could not be deleted is looked at again.
const RECORD_RETRY: Duration = Duration::from_secs(1);

#[derive(Default)]
pub struct SlotWork {
    /// Record → how often its Pod could not be marked before its release.
    unmarked: Mutex<HashMap<String, u32>>,
}

impl SlotWork {
    fn unmarked(&self) -> MutexGuard<'_, HashMap<String, u32>> {
        self.unmarked.lock().expect("slot memory lock")
    }

    /// A record that is gone.
    pub fn forget_record(&self, name: &str) {
        self.unmarked().remove(name);
    }

    /// A release slot of `policy`: marks the Pods that stay, removes the entries (one
    /// fenced write per shard), then deletes the records.
    pub async fn reconcile(
        &self,
        s: &Shared,
        policies: &PolicyWork,
        policy: &str,
    ) -> Result<Option<Instant>, ReleaseError> {
        let (interval, batch) = match s.matcher.load().get(policy) {
            Some(p) => (p.release_interval, p.release_batch as usize),
            None => (s.settings.plan.default_release_interval, s.settings.plan.default_release_batch),
        };
        let cap_budget = policies.arrivals(policy, interval);
        let (last, taken) = {
            let mut pacer = s.pacer();
            let last = pacer.last_slot(policy);
            (last, pacer.take(policy, Instant::now(), interval, batch, cap_budget))
        };
        let leaving = match taken {
            Taken::Empty => return Ok(None),
            Taken::Wait(at) => return Ok(Some(at)),
            Taken::Batch(b) => b,
        };
        let (leaving, changed) = still_decided(s, leaving);
        if !changed.is_empty() {
            let mut pacer = s.pacer();
            pacer.finish(changed.iter().map(Leaving::name));
            if leaving.is_empty() {
                pacer.unspend(policy, last);
            }
            drop(pacer);
            for l in &changed {
                info!(record = %l.name(), reason = l.reason.as_str(), "the hold changed since its release was decided; deciding afresh");
                s.queue.add(Key::Record(l.name()));
                s.pool_of_changed(&l.record.spec.cidr);
            }
            s.queue.add(Key::Policy(policy.to_string()));
            if leaving.is_empty() {
                return Ok(None);
            }
        }
        // A Pod that cannot be marked keeps its own hold (retried later); the rest go.
        let (leaving, unmarked) = self.mark_staying(s, leaving).await;
        if !unmarked.is_empty() {
            self.retry_unmarked(s, policy, unmarked).await;
        }
        let shard_of = |l: &Leaving| {
            let r = &l.record.spec;
            (r.calico_api_group.parse::<CalicoApiGroup>().unwrap_or(s.reservations.group()), r.reservation.clone())
        };
        let mut by_shard: BTreeMap<(CalicoApiGroup, String), (BTreeSet<String>, BTreeSet<String>)> = BTreeMap::new();
        for l in &leaving {
            let (recorded, shard) = shard_of(l);
            // The same shard in the other group, where the two are stores of their own
            // (Calico's datastore migration copied it, or the leader re-asserted the hold
            // there): the copy goes too.
            let other = s.reservations.index().canonical(recorded.other());
            let copied = other != recorded
                && s.reservations.index().get(other, &shard).is_some_and(|v| v.position(&l.record.spec.cidr).is_some());
            if copied {
                by_shard.entry((other, shard.clone())).or_default().0.insert(l.record.spec.cidr.clone());
            }
            let (cidrs, reviewable) = by_shard.entry((recorded, shard)).or_default();
            cidrs.insert(l.record.spec.cidr.clone());
            // Its Pod's deletion may still be reviewed (the store shows the Pod, or never saw
            // it leave): an entry written a moment ago stays until it has settled.
            let p = &l.record.spec.pod;
            let there = s.pods.get(&p.namespace, &p.name).is_some_and(|pod| pod.uid == p.uid);
            if there || !s.pods.saw_depart(&p.uid) {
                reviewable.insert(l.record.spec.cidr.clone());
            }
        }
        // The shards go concurrently too: a large policy's slot spans all of them.
        let removals: Vec<_> = futures::stream::iter(by_shard)
            .map(|((group, shard), (cidrs, reviewable))| async move {
                s.reservations.settled(group, &shard, &reviewable).await;
                let removed = s.reservations.remove(group, &shard, &cidrs, &s.fence).await;
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
            s.pacer().put_back(policy, back);
        }
        // The records go concurrently (a slot of a large policy releases hundreds).
        let results: Vec<(Leaving, Result<(), ReleaseError>)> = futures::stream::iter(gone)
            .map(|l| async move {
                let r = finish_release(s, &l).await;
                (l, r)
            })
            .buffer_unordered(SLOT_RECORDS_AT_ONCE)
            .collect()
            .await;
        let (done, failed_records): (Vec<_>, Vec<_>) = results.into_iter().partition(|(_, r)| r.is_ok());
        let more = {
            let mut pacer = s.pacer();
            // Released, and still in the store (its deletion not seen yet): kept out of
            // every count until it is, or the cap would take one hold too many.
            pacer.finish(done.iter().map(|(l, _)| l.name()));
            let unseen = done
                .into_iter()
                .map(|(l, _)| l.record)
                .filter(|r| s.records.get(&r.name_any()).is_some_and(|now| now.metadata.uid == r.metadata.uid));
            pacer.released(unseen, Instant::now());
            pacer.finish(failed_records.iter().map(|(l, _)| l.name()));
            pacer.waiting(policy)
        };
        // Their entries are out and their records stay: each is looked at again on its own
        // (a hold over whose entry is missing drops its record, and is counted then).
        for (l, e) in &failed_records {
            warn!(record = %l.name(), policy, error = ?e.as_ref().err().map(ToString::to_string), "the record of a released hold could not be deleted; looking at it again");
            s.queue.add_after(Key::Record(l.name()), RECORD_RETRY);
        }
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
    async fn mark_staying(&self, s: &Shared, leaving: Vec<Leaving>) -> (Vec<Leaving>, Vec<(Leaving, ReleaseError)>) {
        let results: Vec<(Leaving, Result<(), ReleaseError>)> = futures::stream::iter(leaving)
            .map(|l| async move {
                let r = self.mark_one(s, &l).await;
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

    async fn mark_one(&self, s: &Shared, l: &Leaving) -> Result<(), ReleaseError> {
        let p = &l.record.spec.pod;
        let pod = s.pods.get(&p.namespace, &p.name);
        if pod.is_none()
            || decide::pod_state(&l.record, pod.as_deref()) == PodState::Kept
            || l.reason == ReleaseReason::PodKept
        {
            return Ok(());
        }
        let tries = self.unmarked().get(&l.name()).copied().unwrap_or(0);
        if tries >= MARK_ATTEMPTS {
            // Nothing is held forever: past its attempts the hold goes without the mark
            // (the cost: a safety net that sees this Pod again after a leader change may
            // hold it once more, for one more reserveFor).
            warn!(record = %l.name(), pod = %format!("{}/{}", p.namespace, p.name), tries, "releasing without marking the Pod");
            return Ok(());
        }
        if pod.is_some_and(|pod| pod.uid == p.uid) {
            // A replica that lost the Lease marks nothing (like every other leader write).
            s.fence.check()?;
            marks::mark(&s.client, &p.namespace, &p.name, &p.uid, RELEASED_ANNOTATION, l.reason.as_str())
                .await
                .map_err(|source| ReleaseError::Mark { pod: format!("{}/{}", p.namespace, p.name), source })?;
        }
        Ok(())
    }

    /// Releases whose Pod could not be marked: each stays held and is looked at again
    /// after a backoff of its own (2 s, doubling), so it neither fails nor leads its
    /// policy's later slots; after [`MARK_ATTEMPTS`] it goes without the mark. Said once
    /// per hold (a `ReleaseDeferred` Event on the Pod), counted each time
    /// (`capo_release_failures_total{reason="mark"}`).
    async fn retry_unmarked(&self, s: &Shared, policy: &str, unmarked: Vec<(Leaving, ReleaseError)>) {
        s.pacer().finish(unmarked.iter().map(|(l, _)| l.name()));
        for (l, e) in unmarked {
            let name = l.name();
            let attempt = {
                let mut memory = self.unmarked();
                let n = memory.entry(name.clone()).or_insert(0);
                *n += 1;
                *n
            };
            let backoff = Duration::from_secs(2).saturating_mul(1 << (attempt - 1).min(8)).min(MARK_BACKOFF_MAX);
            s.metrics.release.failures.with_label_values(&[policy, e.kind()]).inc();
            warn!(record = %name, policy, attempt, retry_in = ?backoff, error = %e, "could not mark the Pod released; its hold stays, the rest are released");
            s.queue.add_after(Key::Record(name), backoff);
            if attempt == 1 {
                let p = &l.record.spec.pod;
                let note = format!(
                    "capo could not mark this Pod before releasing {} ({e}); the address stays held and capo tries again, the policy's other releases go on",
                    l.record.spec.cidr
                );
                let pod = pod_ref(&p.namespace, &p.name, &p.uid);
                s.events.publish(&pod, EventType::Warning, "ReleaseDeferred", "Release", note).await;
            }
        }
    }
}

/// Of a slot's releases, those still what they were decided on: the record unchanged
/// (an operator's `extend`, a new hold under the same name) and its Pod in the same state
/// (a refused eviction retried and allowed, its hold now answered "held"). The others are
/// looked at afresh.
fn still_decided(s: &Shared, leaving: Vec<Leaving>) -> (Vec<Leaving>, Vec<Leaving>) {
    leaving.into_iter().partition(|l| {
        let Some(now) = s.records.get(&l.name()) else { return false };
        let p = &now.spec.pod;
        now.metadata.uid == l.record.metadata.uid
            && now.metadata.resource_version == l.record.metadata.resource_version
            && decide::pod_state(&now, s.pods.get(&p.namespace, &p.name).as_deref()) == l.pod
    })
}

/// How often a record deletion whose answer was lost (the connection closed after the
/// request was sent) is looked at again before the release is retried from its slot.
const UNKNOWN_OUTCOME_ATTEMPTS: usize = 3;

/// Whether a failed record write may have landed: no answer came (the connection closed,
/// a timeout), as opposed to an answer that refused it.
fn outcome_unknown(e: &ReleaseError) -> bool {
    matches!(e, ReleaseError::Record { source, .. } if !matches!(source, kube::Error::Api(_)))
}

/// The entry is out: the record goes (if it still describes this hold). A deletion whose
/// answer was lost is read back: a record that is gone was released (counted once, here),
/// one that is still there is deleted again.
async fn finish_release(s: &Shared, l: &Leaving) -> Result<(), ReleaseError> {
    let spec = &l.record.spec;
    let done = || {
        s.released(&spec.policy, l.reason, Some(l.due));
        info!(ip = %spec.cidr, reservation = %spec.reservation, reason = l.reason.as_str(), "released");
    };
    let mut current = (*l.record).clone();
    for attempt in 1..=UNKNOWN_OUTCOME_ATTEMPTS {
        match s.writes.delete(&current).await {
            Ok(RecordFate::Deleted | RecordFate::AlreadyGone) => {
                done();
                return Ok(());
            }
            Ok(RecordFate::Changed) => {}
            Err(e) if outcome_unknown(&e) && attempt < UNKNOWN_OUTCOME_ATTEMPTS => {
                warn!(record = %l.name(), attempt, error = %e, "the record's deletion got no answer; reading it back");
            }
            Err(e) => return Err(e),
        }
        let Some(now) = s.writes.read(&l.name()).await? else {
            // Gone: by this deletion (its answer lost) or another; its entry is out.
            done();
            return Ok(());
        };
        if now.metadata.uid == current.metadata.uid
            && now.metadata.resource_version == current.metadata.resource_version
        {
            // Unchanged: the lost deletion did not land; it is sent again.
            continue;
        }
        if now.spec.pod.uid != spec.pod.uid || now.spec.reservation != spec.reservation {
            // Held for another Pod meanwhile: its entry goes back.
            let group = now.spec.calico_api_group.parse::<CalicoApiGroup>().unwrap_or(s.reservations.group());
            s.reservations
                .write_back(group, &now.spec.reservation, &now.spec.policy, &now.spec.cidr, &s.fence)
                .await
                .map_err(|source| ReleaseError::Reservation { reservation: now.spec.reservation.clone(), source })?;
            info!(ip = %spec.cidr, "re-held for another Pod meanwhile; entry written back");
            return Ok(());
        }
        current = now;
    }
    Ok(())
}
