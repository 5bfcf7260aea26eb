//! One hold (a `Key::Record`): its countdown, and its release, write-back or drop when due.
//! It remembers, per record, since when its entry has been missing, when its Pod was first
//! seen gone (its countdown's start, kept in [`Starts`] and flushed to the countdown
//! ConfigMaps, not to the record), and whether it was reported as inconsistent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use capo_api::CalicoApiGroup;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use tokio::time::Instant;
use tracing::{info, warn};

use super::context::{Key, Shared, instant};
use super::policy::PolicyWork;
use super::starts::Starts;
use crate::release::consistency;
use crate::release::countdowns::Part;
use crate::release::decide::{self, Action, Facts, FallBackReason, PodState};
use crate::release::writes::{RecordFate, ReleaseError};
use crate::store::workloads::Owner;

#[derive(Default)]
struct Memory {
    /// Record → since when its entry has been missing.
    missing: HashMap<String, Timestamp>,
    /// Records reported as inconsistent (by name: the uid reported).
    inconsistent: HashMap<String, String>,
    /// Record → (uid, resourceVersion) its last status write was made against. Whether
    /// that write went through or found the record changed, that version is past: while
    /// the store still shows it (the watch is behind the leader's own write), another write
    /// against it could only fail, and would cost the API server a request per look.
    written: HashMap<String, (String, String)>,
    /// Record → (uid, resourceVersion) whose times ahead of the clock were reported.
    ahead: HashMap<String, (String, String)>,
}

#[derive(Default)]
pub struct RecordWork {
    memory: Mutex<Memory>,
    /// Record → when the leader's stores first showed its Pod gone (for the record's UID),
    /// unless its status carries `podGoneAt`: the countdown starts there, however long the
    /// hold waits for a worker, and a next leader reads it back.
    pub starts: Starts,
}

impl RecordWork {
    pub fn new(starts: Starts) -> Self {
        Self { memory: Mutex::default(), starts }
    }

    fn memory(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().expect("record memory lock")
    }

    /// A record that is gone.
    pub fn forget(&self, name: &str) {
        let mut memory = self.memory();
        memory.missing.remove(name);
        memory.inconsistent.remove(name);
        memory.written.remove(name);
        memory.ahead.remove(name);
        drop(memory);
        self.starts.remove(name);
    }

    /// Notes when the stores first showed `rec`'s Pod gone, unless its status carries the
    /// start (`Facts::seen_gone`), and has the hold looked at when that countdown runs
    /// out, even if it still waits behind a backlog of new holds by then; forgets it if
    /// the Pod is there (a relist showed it back).
    pub fn note_pod_gone(&self, s: &Shared, rec: &capo_api::ReservedIP) {
        // Another leader's (`--policy-prefix`): its countdowns are that leader's to keep.
        if !s.in_scope(&rec.spec.policy) || rec.status.as_ref().is_some_and(|s| s.pod_gone_at.is_some()) {
            return;
        }
        let pod = s.pods.get(&rec.spec.pod.namespace, &rec.spec.pod.name);
        let name = rec.name_any();
        if decide::pod_state(rec, pod.as_deref()) != PodState::Gone {
            self.starts.remove(&name);
            return;
        }
        let departed = s.pods.saw_depart(&rec.spec.pod.uid);
        if decide::missing_too_soon(rec, pod.as_deref(), departed, Timestamp::now(), &s.settings.plan) {
            return;
        }
        let uid = rec.uid().unwrap_or_default();
        if self.starts.get(&name).is_none_or(|(u, _)| u != uid) {
            let now = Timestamp::now();
            self.starts.start(&name, &uid, now, Part::of(rec));
            let due = decide::ttl_due(rec, now, &s.settings.plan);
            s.queue.add_at(Key::Record(name), instant(due));
        }
    }

    /// The hold `rec`, looked at now.
    pub async fn reconcile(
        &self,
        s: &Shared,
        policies: &PolicyWork,
        rec: Arc<capo_api::ReservedIP>,
    ) -> Result<Option<Instant>, ReleaseError> {
        let name = rec.name_any();
        let spec = &rec.spec;
        if !s.in_scope(&spec.policy) || s.pacer().contains(&rec) {
            return Ok(None);
        }
        if let Err(why) = consistency::check(&rec) {
            self.ignore(s, &rec, why).await;
            return Ok(None);
        }
        let Ok(group) = spec.calico_api_group.parse::<CalicoApiGroup>() else { return Ok(None) };
        let now = Timestamp::now();
        self.warn_ahead(s, &rec, now);
        let entry_present = s.index.get(group, &spec.reservation).is_some_and(|v| v.position(&spec.cidr).is_some());
        let (missing_since, seen_gone) = self.remembered(&rec, entry_present, now);
        let pod = s.pods.get(&spec.pod.namespace, &spec.pod.name);
        let matcher = s.matcher.load();
        let policy = matcher.get(&spec.policy).cloned();
        let owner = spec.pod.controller.as_ref().map_or(Owner::Unknown, |c| s.workloads.owner(&spec.pod.namespace, c));
        let decision = decide::decide(
            &Facts {
                now,
                record: &rec,
                pod: pod.as_deref(),
                departure_seen: s.pods.saw_depart(&spec.pod.uid),
                policy: policy.as_deref(),
                entry_present,
                namespace_exists: s.namespaces.get(&spec.pod.namespace).is_some(),
                owner,
                missing_since,
                seen_gone,
            },
            &s.settings.plan,
        );
        policies.note_left(&rec, pod.as_deref(), now);
        s.announcements.held(&rec);
        let current = rec.status.clone().unwrap_or_default();
        let mut status = decision.status.clone();
        if current.pod_gone_at.is_none() {
            // The countdown is kept with the starts (flushed to the countdown ConfigMaps),
            // not written into the record: one write per shard and second, not per hold.
            match (decide::pod_state(&rec, pod.as_deref()), &status.pod_gone_at) {
                (PodState::Gone, Some(gone)) => {
                    self.starts.start(&name, &rec.uid().unwrap_or_default(), gone.0, Part::of(&rec))
                }
                (PodState::Gone, None) => {}
                _ => self.starts.remove(&name),
            }
            status.pod_gone_at = None;
            status.release_at = None;
        }
        // A hold first looked at once it is already due (it waited behind a storm of new
        // holds) is released without writing a status it no longer needs: a worker held by
        // that write would be one more delay for every release behind it.
        let releasing = matches!(decision.action, Action::Release { .. } | Action::FallBack(_));
        if !releasing && status != current {
            self.write_status(s, &rec, &status).await?;
        }
        if !releasing && entry_present {
            reassert(s, &rec, group).await?;
        }
        match decision.action {
            Action::Wait(at) => Ok(at.map(instant)),
            Action::Release { reason, due } => {
                s.submit(&spec.policy, [s.leaving(rec.clone(), reason, due)]);
                Ok(None)
            }
            Action::WriteBack => {
                s.reservations
                    .write_back(group, &spec.reservation, &spec.policy, &spec.cidr, &s.fence)
                    .await
                    .map_err(|source| ReleaseError::Reservation { reservation: spec.reservation.clone(), source })?;
                s.metrics.release.repairs.with_label_values(&["written_back"]).inc();
                info!(record = name, reservation = %spec.reservation, "wrote a missing entry back");
                Ok(None)
            }
            Action::FallBack(why) => {
                self.fall_back(s, &rec, status, why).await?;
                Ok(None)
            }
            Action::Drop { reason, due } => {
                if s.writes.delete(&rec).await? == RecordFate::Deleted {
                    s.released(&spec.policy, reason, due);
                    info!(record = name, reason = reason.as_str(), "dropped a record whose entry was missing");
                }
                Ok(None)
            }
        }
    }

    /// Says, once per record version, which of its times are ahead of this leader's clock
    /// by more than the skew allowance (the decision takes each as now, or as the record's
    /// creation).
    fn warn_ahead(&self, s: &Shared, rec: &capo_api::ReservedIP, now: Timestamp) {
        let ahead = decide::ahead_of(rec, now);
        if ahead.is_empty() {
            return;
        }
        let version = (rec.uid().unwrap_or_default(), rec.resource_version().unwrap_or_default());
        if self.memory().ahead.insert(rec.name_any(), version.clone()) == Some(version) {
            return;
        }
        for (field, at) in ahead {
            s.metrics.release.clock_ahead.with_label_values(&[field]).inc();
            warn!(record = %rec.name_any(), field, at = %at, now = %now, allowance = ?decide::SKEW_ALLOWANCE, "a hold's time is later than now (a clock ahead, or an edit): taken as now");
        }
    }

    /// Writes a hold's status against the version the store shows, unless this leader
    /// has written against that version already (then the watch brings the result, and
    /// the hold is looked at again).
    async fn write_status(
        &self,
        s: &Shared,
        rec: &capo_api::ReservedIP,
        status: &capo_api::reserved_ip::ReservedIPStatus,
    ) -> Result<(), ReleaseError> {
        let version = (rec.uid().unwrap_or_default(), rec.resource_version().unwrap_or_default());
        let name = rec.name_any();
        if self.memory().written.get(&name) == Some(&version) {
            return Ok(());
        }
        tracing::debug!(record = %name, current = ?rec.status, desired = ?status, "writing a hold's status");
        s.writes.status(rec, status).await?;
        self.memory().written.insert(name, version);
        Ok(())
    }

    /// Sticky IPs: the claim ended before the recreated Pod showed the address (`why`).
    /// Its handed-back addresses are taken back (so Calico's CNI plugin gives it new ones
    /// on its next try), then the claim is noted as fallen back, and why; the hold runs its
    /// course (or the release that ended the claim goes ahead at the next look).
    async fn fall_back(
        &self,
        s: &Shared,
        rec: &capo_api::ReservedIP,
        mut status: capo_api::ReservedIPStatus,
        why: FallBackReason,
    ) -> Result<(), ReleaseError> {
        s.fence.check()?;
        // Fallen back already against this version: the store has not shown the written
        // status yet (its watch lags under load), and a second look must not take the
        // addresses back, write and count again.
        let version = (rec.uid().unwrap_or_default(), rec.resource_version().unwrap_or_default());
        if self.memory().written.get(&rec.name_any()) == Some(&version) {
            return Ok(());
        }
        let spec = &rec.spec;
        let (ns, name) = (&spec.pod.namespace, &spec.pod.name);
        // consistency::check has made sure spec.ip is an address.
        let Ok(ip) = spec.ip.parse::<std::net::IpAddr>() else { return Ok(()) };
        let taken = crate::hold::marks::take_back(&s.client, ns, name, &spec.pod.uid, ip)
            .await
            .map_err(|source| ReleaseError::Mark { pod: format!("{ns}/{name}"), source })?;
        if let Some(claim) = status.claim.as_mut() {
            claim.fell_back_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(Timestamp::now()));
            claim.fell_back_reason = Some(why.as_field().to_string());
        }
        if !s.writes.status(rec, &status).await? {
            // Changed since it was read (or gone): looked at again when the watch shows it.
            return Ok(());
        }
        self.memory().written.insert(rec.name_any(), version);
        let (until, first, renewals) =
            rec.claim().map(|c| (c.until.0.to_string(), c.first().to_string(), c.renewals)).unwrap_or_default();
        let pod_name = format!("{ns}/{name}");
        warn!(record = %rec.name_any(), pod = %pod_name, ip = %spec.ip, reason = why.as_label(), renewals, took_back = taken.is_some(), "sticky: the claim ended before the Pod came up with its old address; it gets a new one, the old one stays held");
        // Counted whether or not a Pod of that name is there to take the addresses from
        // (the StatefulSet scaled down meanwhile, or a CREATE the API server then refused).
        s.metrics.release.sticky_fallbacks.with_label_values(&[&spec.policy, why.as_label()]).inc();
        let ended = match why {
            FallBackReason::NotShown => format!("it did not come up with it by {until}"),
            FallBackReason::BoundReached => format!(
                "it was created again {renewals} times without coming up with it, and a claim lasts at most sticky.fallbackAfter from the first ({first})"
            ),
            FallBackReason::Released => "an operator released the hold (capo release)".to_string(),
            FallBackReason::WorkloadGone => "its workload or namespace was deleted".to_string(),
        };
        let ip = &spec.ip;
        let then = match why {
            FallBackReason::NotShown | FallBackReason::BoundReached => "stays held for the rest of its time",
            FallBackReason::Released | FallBackReason::WorkloadGone => "is released now",
        };
        let note = format!(
            "capo handed {ip} back to {pod_name} but {ended}: removed cni.projectcalico.org/ipAddrs so Calico assigns a new address; {ip} {then}"
        );
        // On the record always (`kubectl describe reservedip`), on the Pod if there is one.
        let record = kube::Resource::object_ref(rec, &());
        s.events.publish(&record, EventType::Warning, "StickyFellBack", "FallBack", note.clone()).await;
        if let Some(uid) = taken {
            let pod = crate::events::pod_ref(ns, name, &uid);
            s.events.publish(&pod, EventType::Warning, "StickyFellBack", "FallBack", note).await;
        }
        Ok(())
    }

    /// Reports, once per record, a record the leader will not act on (metric, warning,
    /// Event on the record).
    async fn ignore(&self, s: &Shared, rec: &capo_api::ReservedIP, why: consistency::Inconsistent) {
        let (name, uid) = (rec.name_any(), rec.uid().unwrap_or_default());
        if self.memory().inconsistent.insert(name.clone(), uid.clone()) == Some(uid) {
            return;
        }
        s.metrics.release.ignored_records.with_label_values(&[why.reason()]).inc();
        let spec = &rec.spec;
        warn!(
            record = %name, ip = %spec.ip, cidr = %spec.cidr, reservation = %spec.reservation, reason = why.reason(),
            "a ReservedIP capo did not write: left alone (no entry written back, nothing released)"
        );
        let note =
            format!("not acted on: {why} (ip {}, cidr {}, reservation {})", spec.ip, spec.cidr, spec.reservation);
        s.events
            .publish(&kube::Resource::object_ref(rec, &()), EventType::Warning, "Inconsistent", "Ignore", note)
            .await;
    }

    /// What this leader remembers of a hold: since when its entry has been missing (noted
    /// now if it is), and when its Pod was seen gone (unless its status says).
    fn remembered(
        &self,
        rec: &capo_api::ReservedIP,
        entry_present: bool,
        now: Timestamp,
    ) -> (Option<Timestamp>, Option<Timestamp>) {
        let name = rec.name_any();
        let uid = rec.uid().unwrap_or_default();
        let seen_gone = match self.starts.get(&name) {
            Some((u, at)) if u == uid && rec.status.as_ref().is_none_or(|s| s.pod_gone_at.is_none()) => Some(at),
            Some(_) => {
                self.starts.remove(&name);
                None
            }
            None => None,
        };
        let mut memory = self.memory();
        let missing_since = if entry_present {
            memory.missing.remove(&name);
            None
        } else {
            Some(*memory.missing.entry(name).or_insert(now))
        };
        (missing_since, seen_gone)
    }
}

/// Once a datastore migration has moved new holds to the group Calico reads: a hold still
/// only in its old group (written there after the migration copied its shard, or while no
/// capo ran) is put there too, into the shard of the same name. Its record keeps naming
/// the old group; the copy is the record's too, and is released with it.
async fn reassert(s: &Shared, rec: &capo_api::ReservedIP, group: CalicoApiGroup) -> Result<(), ReleaseError> {
    let spec = &rec.spec;
    let writing = s.reservations.group();
    if s.index.canonical(group) == writing
        || !s.reservations.writing_group().calico_reads_where_capo_writes()
        || !s.index.is_synced(writing)
        || s.index.get(writing, &spec.reservation).is_some_and(|v| v.position(&spec.cidr).is_some())
    {
        return Ok(());
    }
    s.reservations
        .write_back(writing, &spec.reservation, &spec.policy, &spec.cidr, &s.fence)
        .await
        .map_err(|source| ReleaseError::Reservation { reservation: spec.reservation.clone(), source })?;
    s.metrics.release.repairs.with_label_values(&["reasserted"]).inc();
    info!(record = %rec.name_any(), reservation = %spec.reservation, from = %group, to = %writing, "re-asserted a hold where Calico reads now (a datastore migration moved it)");
    Ok(())
}
