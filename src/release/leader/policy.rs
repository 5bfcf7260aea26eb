//! A policy (a `Key::Policy`): its gauges, and its holds past the cap or a namespace's
//! share. It remembers the compiled policies as last seen (to tell which ones an update
//! changed), the holds that arrived (to size cap slots), which policies are past their cap,
//! and when a once-staying Pod left (a hold's age at the cap).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use tokio::time::Instant;

use super::context::{Shared, instant};
use crate::events::policy_ref;
use crate::policy::CompiledPolicy;
use crate::release::decide::{self, PodState, ReleaseReason};
use crate::release::writes::ReleaseError;
use crate::release::{cap, consistency};

/// Where a hold stands for the cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// Its Pod is still there (a refused eviction, a denied review): it goes first.
    Present,
    /// Held a moment ago, its Pod still in the store: settled at that time.
    Unsettled(Timestamp),
    Gone,
}

#[derive(Default)]
struct Memory {
    /// Policies past their cap (a `CapReached` Event when one gets there).
    over_cap: HashSet<String>,
    /// Holds that arrived, per policy (to size cap release slots).
    arrivals: HashMap<String, VecDeque<Instant>>,
    /// The compiled policies as last seen.
    compiled: BTreeMap<String, Arc<CompiledPolicy>>,
    /// Record → (its uid, when its Pod left): holds whose Pod stayed at first (a refused
    /// eviction) and left later count against the cap from then, not from the hold.
    left: HashMap<String, (String, Timestamp)>,
}

#[derive(Default)]
pub struct PolicyWork {
    memory: Mutex<Memory>,
}

impl PolicyWork {
    fn memory(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().expect("policy memory lock")
    }

    /// A record that is gone.
    pub fn forget_record(&self, name: &str) {
        self.memory().left.remove(name);
    }

    /// A new hold of `policy`.
    pub fn arrived(&self, policy: &str) {
        self.memory().arrivals.entry(policy.to_string()).or_default().push_back(Instant::now());
    }

    /// How many holds of `policy` arrived within the last `interval`.
    pub fn arrivals(&self, policy: &str, interval: Duration) -> usize {
        let mut memory = self.memory();
        let Some(q) = memory.arrivals.get_mut(policy) else { return 0 };
        while q.front().is_some_and(|t| t.elapsed() > interval) {
            q.pop_front();
        }
        q.len()
    }

    /// The policies whose compiled form differs from the last look.
    pub fn changed(&self, s: &Shared) -> Vec<String> {
        let now: BTreeMap<String, Arc<CompiledPolicy>> =
            s.matcher.load().policies().iter().map(|p| (p.name.clone(), p.clone())).collect();
        let mut memory = self.memory();
        let names: BTreeSet<&String> = now.keys().chain(memory.compiled.keys()).collect();
        let changed: Vec<String> =
            names.into_iter().filter(|n| now.get(*n) != memory.compiled.get(*n)).cloned().collect();
        // A lowered cap (or share) is worked off at the policy's pace: the holds that came
        // before the change do not make a slot larger.
        for name in &changed {
            let lowered = match (memory.compiled.get(name), now.get(name)) {
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
        memory.compiled = now;
        changed
    }

    /// Notes when the Pod of a hold that was counted as staying (`podKeptSince`) left.
    pub fn note_left(&self, rec: &capo_api::ReservedIP, pod: Option<&crate::pod::PodFacts>, now: Timestamp) {
        let kept_before = rec.status.as_ref().is_some_and(|s| s.pod_kept_since.is_some());
        if kept_before && decide::pod_state(rec, pod) != PodState::Kept {
            let uid = rec.uid().unwrap_or_default();
            let mut memory = self.memory();
            let e = memory.left.entry(rec.name_any()).or_insert_with(|| (uid.clone(), now));
            if e.0 != uid {
                *e = (uid, now);
            }
        }
    }

    /// Where a hold stands for the cap: its Pod still there (counted as staying, or past
    /// the settle time), not known yet (held a moment ago, the Pod not yet seen leaving),
    /// or gone; and its age, from its record or from when its once-staying Pod left.
    fn cap_standing(&self, s: &Shared, rec: &capo_api::ReservedIP, now: Timestamp) -> (Standing, Timestamp) {
        let p = &rec.spec.pod;
        let pod = s.pods.get(&p.namespace, &p.name);
        self.note_left(rec, pod.as_deref(), now);
        let kept = decide::pod_state(rec, pod.as_deref()) == PodState::Kept;
        let kept_since = rec.status.as_ref().is_some_and(|s| s.pod_kept_since.is_some());
        let settled = decide::just_held(rec, &s.settings.plan);
        let standing = match kept {
            true if kept_since || settled <= now => Standing::Present,
            true => Standing::Unsettled(settled),
            false => Standing::Gone,
        };
        let created = rec.metadata.creation_timestamp.as_ref().map_or(rec.spec.reserved_at.0, |t| t.0);
        let uid = rec.uid().unwrap_or_default();
        let left = self.memory().left.get(&rec.name_any()).filter(|(u, _)| *u == uid).map(|l| l.1);
        (standing, left.map_or(created, |l| l.max(created)))
    }

    /// A policy: its gauges, and its holds past the cap (or a namespace's share).
    pub async fn reconcile(&self, s: &Shared, name: &str) -> Result<Option<Instant>, ReleaseError> {
        if !s.in_scope(name) {
            return Ok(None);
        }
        let matcher = s.matcher.load();
        let policy = matcher.get(name).cloned();
        let holds: Vec<_> = s.records.records_of(name).into_iter().filter(|r| consistency::check(r).is_ok()).collect();
        let m = &s.metrics.release;
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
            self.memory().over_cap.remove(name);
            return Ok(None);
        }
        let now = Timestamp::now();
        let standing: Vec<(Standing, Timestamp)> = holds.iter().map(|r| self.cap_standing(s, r, now)).collect();
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
            let pacer = s.pacer();
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
                    // A claimed hold (sticky IPs) counts, and is never a victim while its
                    // claim is pending: a claim is a reason to keep it, not to leave it out.
                    kept: r.claim().and_then(|c| decide::claim_pending(c, Some(&policy), now)).is_some(),
                })
                .collect();
            cap::over_cap(policy.max_reserved as usize, policy.max_reserved_per_namespace.map(|n| n as usize), counted)
        };
        let newly_over = {
            let mut memory = self.memory();
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
            s.events.publish(&policy_ref(name), EventType::Warning, "CapReached", "Release", note).await;
        }
        let leaving: Vec<_> =
            victims.iter().filter_map(|v| s.records.get(v)).map(|r| s.leaving(r, ReleaseReason::Cap, now)).collect();
        s.submit(name, leaving);
        Ok(recheck)
    }
}
