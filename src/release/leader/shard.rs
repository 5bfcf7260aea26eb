//! One reservation shard (a `Key::Shard`): labels a v3 write moved put back, its epoch
//! raised, garbage out, foreign CIDRs reported, orphans adopted, redundant entries out. It
//! remembers, per shard, its mismatched entries (with when first seen) and the foreign
//! entries last reported.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};

use capo_api::CalicoApiGroup;
use capo_api::reserved_ip::record_name;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::EventType;
use tokio::time::Instant;
use tracing::{info, warn};

use super::context::{Shared, instant};
use crate::events::policy_ref;
use crate::release::decide::ReleaseReason;
use crate::release::writes::ReleaseError;
use crate::release::{consistency, repair};

type ShardKey = (CalicoApiGroup, String);

#[derive(Default)]
struct Memory {
    /// Shard → its mismatched entries, with when first seen.
    first_seen: HashMap<ShardKey, HashMap<String, Timestamp>>,
    /// Foreign entries per shard (with its policy), as last reported.
    foreign: HashMap<ShardKey, (String, Vec<String>)>,
}

impl Memory {
    fn foreign_total(&self, policy: &str) -> usize {
        self.foreign.values().filter(|(p, _)| p == policy).map(|(_, f)| f.len()).sum()
    }
}

#[derive(Default)]
pub struct ShardWork {
    memory: Mutex<Memory>,
}

impl ShardWork {
    fn memory(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().expect("shard memory lock")
    }

    pub async fn reconcile(
        &self,
        s: &Shared,
        group: CalicoApiGroup,
        name: &str,
    ) -> Result<Option<Instant>, ReleaseError> {
        let group = s.index.canonical(group);
        let key = (group, name.to_string());
        let Some(view) = s.index.get(group, name) else {
            let mut memory = self.memory();
            memory.first_seen.remove(&key);
            if let Some((policy, _)) = memory.foreign.remove(&key) {
                let total = memory.foreign_total(&policy);
                s.metrics.release.foreign_entries.with_label_values(&[&policy]).set(total as i64);
            }
            return Ok(None);
        };
        let policy = view.policy.clone().unwrap_or_default();
        if !s.in_scope(&policy) {
            return Ok(None);
        }
        let reservation_error = |source| ReleaseError::Reservation { reservation: name.to_string(), source };
        if view.moved {
            // A write through projectcalico.org/v3 moved capo's labels into Calico's
            // metadata annotation: put them back before anything tests them.
            if s.reservations.reown(group, name).await.map_err(reservation_error)? {
                let note = format!(
                    "A write through projectcalico.org/v3 (calico-apiserver, calicoctl or kubectl) moved the labels of IPReservation {name} into its projectcalico.org/metadata annotation; capo put them back and keeps holding its entries"
                );
                s.events.publish(&policy_ref(&policy), EventType::Warning, "LabelsRestored", "Repair", note).await;
            }
        }
        // A shard created after this term began, with a lower epoch (by a webhook that had
        // not seen the new Lease yet): raised now, so the replica this one took over from
        // cannot write it either.
        s.reservations.stamp_if_behind(group, name, &s.fence).await.map_err(reservation_error)?;
        // A record names the group its entry was written through; where both groups name
        // one store, either name is this shard.
        let recorded_at = |ip| {
            s.records.get(&record_name(ip)).and_then(|r| {
                if consistency::check(&r).is_err() {
                    // A record capo did not write: its entry is left as it is, neither
                    // adopted nor removed as redundant.
                    return Some((group, view.name.clone()));
                }
                let recorded = s.index.canonical(r.spec.calico_api_group.parse::<CalicoApiGroup>().ok()?);
                if recorded != group && r.spec.reservation == view.name {
                    // The same shard in the other group, a store of its own: Calico's
                    // datastore migration copied it there, or the leader re-asserted the
                    // hold there after the migration. This entry is the record's too (during
                    // the migration it is what Calico reads next), and goes when the hold
                    // is released.
                    return Some((group, view.name.clone()));
                }
                Some((recorded, r.spec.reservation.clone()))
            })
        };
        let plan = {
            let mut memory = self.memory();
            let seen = memory.first_seen.entry(key.clone()).or_default();
            repair::plan(group, &view, &recorded_at, Timestamp::now(), s.settings.plan.settle, seen)
        };
        self.report_foreign(s, &key, &policy, &plan.foreign).await;
        let remove: BTreeSet<String> = plan.garbage.iter().chain(&plan.redundant).cloned().collect();
        if !remove.is_empty() {
            s.reservations.settled(group, name, &remove).await;
            let removed = s.reservations.remove(group, name, &remove, &s.fence).await.map_err(reservation_error)?;
            let garbage = plan.garbage.iter().filter(|g| removed.contains(*g)).count();
            let repairs = &s.metrics.release.repairs;
            repairs.with_label_values(&["garbage_removed"]).inc_by(garbage as u64);
            repairs.with_label_values(&["redundant_removed"]).inc_by((removed.len() - garbage) as u64);
            if removed.len() > garbage {
                s.released(&policy, ReleaseReason::Repair, None);
            }
            warn!(reservation = name, garbage = ?plan.garbage, redundant = ?plan.redundant, "removed entries no hold needs");
        }
        for cidr in &plan.adopt {
            let reserve_for =
                s.matcher.load().get(&policy).map_or(s.settings.plan.default_reserve_for, |p| p.reserve_for);
            if s.writes.adopt(group, name, &policy, cidr, reserve_for).await? {
                s.metrics.release.repairs.with_label_values(&["adopted"]).inc();
                info!(entry = %cidr, reservation = name, "adopted an entry without a record");
            }
        }
        Ok(plan.wake.map(instant))
    }

    /// Valid CIDRs in a capo-owned reservation that capo did not write: left in place,
    /// counted, and reported once per change.
    async fn report_foreign(&self, s: &Shared, key: &ShardKey, policy: &str, foreign: &[String]) {
        let changed = {
            let mut memory = self.memory();
            let before = memory.foreign.get(key).map(|(_, f)| f.clone()).unwrap_or_default();
            if foreign.is_empty() {
                memory.foreign.remove(key);
            } else {
                memory.foreign.insert(key.clone(), (policy.to_string(), foreign.to_vec()));
            }
            let total = memory.foreign_total(policy);
            s.metrics.release.foreign_entries.with_label_values(&[policy]).set(total as i64);
            before != foreign && !foreign.is_empty()
        };
        if changed {
            let note = format!(
                "IPReservation {} holds entries capo did not write: {}; capo leaves them (they are valid CIDRs) — remove them by hand if nobody needs them",
                key.1,
                foreign.join(", ")
            );
            warn!(reservation = %key.1, entries = ?foreign, "entries capo did not write");
            s.events.publish(&policy_ref(policy), EventType::Warning, "ForeignEntries", "Repair", note).await;
        }
    }
}
