//! Release pacing, per policy: at most one release slot per `releaseInterval`, taking at
//! most `releaseBatch` TTL, manual, pod-kept and early releases (Calico hands a
//! just-released address to the very next allocation on that node, so a burst of expiries
//! should not all land on one wave of new Pods). Cap releases come first in each slot,
//! as many as the holds that arrived within the last interval (so the count never stays
//! above the cap for longer than one interval), but at least `releaseBatch` — a lowered
//! cap is worked off at that pace.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use capo_api::ReservedIP;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use tokio::time::Instant;

use super::decide::{PodState, ReleaseReason};

/// One hold on its way out.
#[derive(Clone, Debug)]
pub struct Leaving {
    /// The record as it was when the release was decided.
    pub record: Arc<ReservedIP>,
    pub reason: ReleaseReason,
    /// When it was due; `capo_release_lateness_seconds` measures from here.
    pub due: Timestamp,
    /// Its Pod's state when the release was decided: a release is carried out only while
    /// the record and this state are what it was decided on.
    pub pod: PodState,
}

impl Leaving {
    pub fn name(&self) -> String {
        self.record.name_any()
    }
}

#[derive(Default)]
struct Slot {
    last: Option<Instant>,
    /// Cap releases, oldest hold first.
    cap: Vec<Leaving>,
    /// The others, by due time.
    due: BTreeMap<(Timestamp, String), Leaving>,
}

/// What a slot gives out.
#[derive(Debug)]
pub enum Taken {
    Batch(Vec<Leaving>),
    /// The next slot opens then.
    Wait(Instant),
    Empty,
}

#[derive(Default)]
pub struct Pacer {
    slots: HashMap<String, Slot>,
    /// Records submitted and not finished.
    pending: HashSet<String>,
    /// Records released whose deletion the record store has not shown yet: name → the
    /// released record's uid. Until the store catches up they are neither counted against
    /// the cap nor released again (a stale store would otherwise make the cap take one
    /// more hold than it should).
    released: HashMap<String, (String, Instant)>,
}

/// How long a released record is remembered if the store never shows its deletion.
const FORGET_RELEASED_AFTER: Duration = Duration::from_secs(600);

impl Pacer {
    /// Whether this record is on its way out or already released.
    pub fn contains(&self, record: &ReservedIP) -> bool {
        let name = record.metadata.name.as_deref().unwrap_or_default();
        self.pending.contains(name)
            || self.released.get(name).is_some_and(|(uid, _)| Some(uid) == record.metadata.uid.as_ref())
    }

    /// Queues a release of `policy`'s; a record already queued is left as it is.
    pub fn submit(&mut self, policy: &str, leaving: Leaving) {
        if self.contains(&leaving.record) {
            return;
        }
        let name = leaving.name();
        self.pending.insert(name.clone());
        let slot = self.slots.entry(policy.to_string()).or_default();
        match leaving.reason {
            ReleaseReason::Cap | ReleaseReason::Pool => slot.cap.push(leaving),
            _ => {
                slot.due.insert((leaving.due, name), leaving);
            }
        }
    }

    /// The releases of the slot that is open at `now`, if any.
    pub fn take(&mut self, policy: &str, now: Instant, interval: Duration, batch: usize, cap_budget: usize) -> Taken {
        let Some(slot) = self.slots.get_mut(policy) else { return Taken::Empty };
        if slot.cap.is_empty() && slot.due.is_empty() {
            self.slots.remove(policy);
            return Taken::Empty;
        }
        if let Some(last) = slot.last
            && last + interval > now
        {
            return Taken::Wait(last + interval);
        }
        let n = slot.cap.len().min(cap_budget.max(batch));
        let mut out: Vec<Leaving> = slot.cap.drain(..n).collect();
        while out.len() < n + batch {
            let Some((_, l)) = slot.due.pop_first() else { break };
            out.push(l);
        }
        slot.last = Some(now);
        Taken::Batch(out)
    }

    /// When `policy`'s last slot opened.
    pub fn last_slot(&self, policy: &str) -> Option<Instant> {
        self.slots.get(policy).and_then(|s| s.last)
    }

    /// Gives back a slot that released nothing (all it took was decided afresh).
    pub fn unspend(&mut self, policy: &str, last: Option<Instant>) {
        if let Some(s) = self.slots.get_mut(policy) {
            s.last = last;
        }
    }

    /// Whether `policy` has releases waiting for a later slot.
    pub fn waiting(&self, policy: &str) -> bool {
        self.slots.get(policy).is_some_and(|s| !s.cap.is_empty() || !s.due.is_empty())
    }

    /// These records are done with (released, or to be looked at afresh).
    pub fn finish(&mut self, records: impl IntoIterator<Item = String>) {
        for r in records {
            self.pending.remove(&r);
        }
    }

    /// These records are released: until the store shows them gone
    /// ([`Pacer::seen_gone`]) they stay out of every count.
    pub fn released(&mut self, records: impl IntoIterator<Item = Arc<ReservedIP>>, now: Instant) {
        self.released.retain(|_, (_, at)| now.duration_since(*at) < FORGET_RELEASED_AFTER);
        for r in records {
            let name = r.name_any();
            self.pending.remove(&name);
            if let Some(uid) = r.metadata.uid.clone() {
                self.released.insert(name, (uid, now));
            }
        }
    }

    /// The store no longer holds `name` with `uid` (deleted, or replaced by another hold).
    pub fn seen_gone(&mut self, name: &str, uid: Option<&str>) {
        if self.released.get(name).is_some_and(|(u, _)| Some(u.as_str()) == uid) {
            self.released.remove(name);
        }
    }

    /// Puts releases back at the front (their write failed; the slot is spent).
    pub fn put_back(&mut self, policy: &str, leaving: Vec<Leaving>) {
        let slot = self.slots.entry(policy.to_string()).or_default();
        for l in leaving {
            match l.reason {
                ReleaseReason::Cap | ReleaseReason::Pool => slot.cap.insert(0, l),
                _ => {
                    slot.due.insert((l.due, l.name()), l);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::decide::tests::{at, gone_at, record};

    fn leaving(ip: &str, reason: ReleaseReason, due: f64) -> Leaving {
        Leaving { record: Arc::new(record(ip, "p", 0.0, gone_at(0.0))), reason, due: at(due), pod: PodState::Gone }
    }

    #[test]
    fn one_slot_per_interval_cap_first_then_by_due_time() {
        let mut p = Pacer::default();
        let t = Instant::now();
        for (i, ip) in ["10.0.0.3", "10.0.0.1", "10.0.0.2"].iter().enumerate() {
            p.submit("p", leaving(ip, ReleaseReason::Ttl, 10.0 - i as f64));
        }
        p.submit("p", leaving("10.0.0.9", ReleaseReason::Cap, 0.0));
        p.submit("p", leaving("10.0.0.9", ReleaseReason::Ttl, 0.0)); // already queued
        let Taken::Batch(b) = p.take("p", t, Duration::from_secs(5), 2, 0) else { panic!() };
        let ips: Vec<&str> = b.iter().map(|l| l.record.spec.ip.as_str()).collect();
        assert_eq!(ips, vec!["10.0.0.9", "10.0.0.2", "10.0.0.1"], "cap first, then the two due first");
        assert!(
            matches!(p.take("p", t + Duration::from_secs(1), Duration::from_secs(5), 2, 0), Taken::Wait(w) if w == t + Duration::from_secs(5))
        );
        let Taken::Batch(b) = p.take("p", t + Duration::from_secs(5), Duration::from_secs(5), 2, 0) else { panic!() };
        assert_eq!(b.len(), 1);
        assert!(matches!(p.take("p", t + Duration::from_secs(20), Duration::from_secs(5), 2, 0), Taken::Empty));
    }

    #[test]
    fn a_lowered_cap_is_worked_off_at_the_batch_pace_unless_new_holds_arrive() {
        let mut p = Pacer::default();
        for i in 0..10 {
            p.submit("p", leaving(&format!("10.0.1.{i}"), ReleaseReason::Cap, 0.0));
        }
        let t = Instant::now();
        let Taken::Batch(b) = p.take("p", t, Duration::from_secs(1), 3, 0) else { panic!() };
        assert_eq!(b.len(), 3);
        let Taken::Batch(b) = p.take("p", t + Duration::from_secs(1), Duration::from_secs(1), 3, 5) else { panic!() };
        assert_eq!(b.len(), 5, "five holds arrived meanwhile: five go");
    }

    fn with_uid(l: Leaving, uid: &str) -> Leaving {
        let mut r = (*l.record).clone();
        r.metadata.uid = Some(uid.into());
        Leaving { record: Arc::new(r), ..l }
    }

    #[test]
    fn a_released_record_the_store_still_shows_is_not_counted_or_released_again() {
        let mut p = Pacer::default();
        let t = Instant::now();
        let a = with_uid(leaving("10.0.2.1", ReleaseReason::Cap, 0.0), "uid-a");
        p.submit("p", a.clone());
        let Taken::Batch(b) = p.take("p", t, Duration::from_secs(1), 1, 0) else { panic!() };
        p.released(b.into_iter().map(|l| l.record), t);
        assert!(p.contains(&a.record), "released, not yet seen gone: still out of the count");
        p.submit("p", a.clone());
        assert!(matches!(p.take("p", t + Duration::from_secs(5), Duration::from_secs(1), 1, 0), Taken::Empty));
        // The same name held again for another Pod (a new record): counted as usual.
        let again = with_uid(leaving("10.0.2.1", ReleaseReason::Cap, 0.0), "uid-b");
        assert!(!p.contains(&again.record));
        // Once the store shows the deletion, the name is forgotten.
        p.seen_gone("10.0.2.1", Some("uid-a"));
        assert!(!p.contains(&a.record));
        // Remembered at most ten minutes if the store never shows it.
        p.released([a.record.clone()], t);
        p.released([], t + FORGET_RELEASED_AFTER);
        assert!(!p.contains(&a.record));
    }
}
