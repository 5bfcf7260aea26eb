//! What the leader should do next, decided from a snapshot of the world with no I/O:
//! count holds down, release them on time (TTL, cap, manual, Pod kept, workload gone),
//! pace the releases, and repair the reservations and records against each other.
//!
//! The engine feeds every watch change into [`Planner::plan`] and carries out the
//! [`Plan`]; the tests below drive it with plain structs.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use capo_api::reserved_ip::single_ip_cidr;
use capo_api::{ManualAction, ReservedIP, ReservedIPStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

use crate::pod::PodFacts;
use crate::policy::CompiledPolicy;

/// Why an IP was released; the `reason` label of `capo_releases_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReleaseReason {
    /// `reserveFor` has passed since the Pod was gone.
    Ttl,
    /// The policy held more than `maxReserved`: the oldest went first.
    Cap,
    /// An operator ran `capo release`.
    Manual,
    /// The Pod was never deleted (an eviction refused by a PodDisruptionBudget, a
    /// deletion denied by another webhook) and stayed for the grace period.
    PodKept,
    /// The Pod's namespace or workload was deleted and the policy releases early then.
    WorkloadGone,
    /// Repair: a record whose entry was missing while its Pod still runs, or an entry in a
    /// reservation that another hold of the same IP makes redundant.
    Repair,
}

impl ReleaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ttl => "ttl",
            Self::Cap => "cap",
            Self::Manual => "manual",
            Self::PodKept => "pod-kept",
            Self::WorkloadGone => "workload-gone",
            Self::Repair => "repair",
        }
    }
}

/// Where the Pod of a hold is, as far as the leader's caches know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    /// Running and not being deleted: the hold is not counted down.
    Kept,
    /// Has a deletionTimestamp: not counted down until it is gone.
    Deleting,
    /// In a terminal phase (its IPs are freed by the CNI), or no longer there.
    Gone,
}

/// Knobs of the planner that are not in any policy.
#[derive(Clone, Debug)]
pub struct PlanSettings {
    /// How long a hold whose Pod stays (not deleted) is kept before it is dropped.
    pub kept_pod_grace: Duration,
    /// How long a mismatch between a record and its reservation must last before repair
    /// acts on it: the webhook writes entry and record concurrently, and watches lag.
    pub settle: Duration,
    /// Pacing and TTL of holds whose policy is gone or invalid.
    pub default_release_interval: Duration,
    pub default_release_batch: usize,
    pub default_reserve_for: Duration,
}

impl Default for PlanSettings {
    fn default() -> Self {
        Self {
            kept_pod_grace: Duration::from_secs(600),
            settle: Duration::from_secs(5),
            default_release_interval: Duration::from_secs(5),
            default_release_batch: 10,
            default_reserve_for: Duration::from_secs(40 * 60),
        }
    }
}

/// A capo-owned reservation as the leader sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReservationView {
    /// The `capo.io/policy` label.
    pub policy: String,
    pub entries: Vec<String>,
}

/// Everything the planner looks at, at one instant.
pub struct World<'a> {
    pub now: Timestamp,
    pub records: &'a [Arc<ReservedIP>],
    /// capo-owned reservations by name.
    pub reservations: &'a BTreeMap<String, ReservationView>,
    /// Valid policies by name.
    pub policies: &'a BTreeMap<String, Arc<CompiledPolicy>>,
    pub pod: &'a dyn Fn(&str, &str) -> Option<Arc<PodFacts>>,
    pub namespace_exists: &'a dyn Fn(&str) -> bool,
    /// `None`: capo does not track that kind of workload.
    pub workload_exists: &'a dyn Fn(&str, &str, &str) -> Option<bool>,
}

/// One record leaving in a release batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Leaving {
    pub record: String,
    pub record_uid: String,
    pub pod_uid: String,
    pub cidr: String,
    pub policy: String,
    pub reason: ReleaseReason,
    /// When it was due; `capo_release_lateness_seconds` measures from here.
    pub due: Timestamp,
}

/// Entries removed from one reservation and their records deleted: one write.
#[derive(Clone, Debug, PartialEq)]
pub struct ReleaseBatch {
    pub reservation: String,
    pub leaving: Vec<Leaving>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Adoption {
    pub reservation: String,
    pub policy: String,
    pub cidr: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WriteBack {
    pub record: String,
    pub reservation: String,
    pub policy: String,
    pub cidr: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct DropRecord {
    pub record: String,
    pub record_uid: String,
    pub pod_uid: String,
    pub policy: String,
    pub reason: ReleaseReason,
    pub due: Option<Timestamp>,
}

/// Entries removed without touching any record.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoveEntries {
    pub reservation: String,
    pub policy: String,
    /// Entries that are not a canonical `/32` or `/128`.
    pub garbage: Vec<String>,
    /// Canonical entries whose IP is held (recorded) in another reservation.
    pub redundant: Vec<String>,
}

/// Per-policy figures for the gauges.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyFigures {
    pub held: usize,
    pub oldest_age: Duration,
    pub max_reserved: Option<u32>,
}

#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// (record, policy, the status it should have)
    pub status: Vec<(String, String, ReservedIPStatus)>,
    pub releases: Vec<ReleaseBatch>,
    pub write_back: Vec<WriteBack>,
    pub drop_records: Vec<DropRecord>,
    pub adopt: Vec<Adoption>,
    pub remove_entries: Vec<RemoveEntries>,
    /// Policies past `maxReserved` in this plan (for a "cap reached" Event).
    pub over_cap: Vec<String>,
    pub figures: BTreeMap<String, PolicyFigures>,
    /// Plan again at this time even if nothing changes.
    pub wake_at: Option<Timestamp>,
}

/// A mismatch between records and reservations, waiting out [`PlanSettings::settle`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Mismatch {
    MissingEntry(String),
    Orphan(String, String),
}

/// The planner's memory between plans: pacing and how long mismatches have lasted.
#[derive(Default)]
pub struct Planner {
    pub settings: PlanSettings,
    /// The time of the last release batch per reservation.
    last_release: HashMap<String, Timestamp>,
    first_seen: HashMap<Mismatch, Timestamp>,
    /// Records (by uid) whose release or drop is under way: left alone until the watch
    /// shows them gone.
    in_flight: HashSet<String>,
}

fn micro(t: Timestamp) -> MicroTime {
    MicroTime(t)
}

fn plus(t: Timestamp, d: Duration) -> Timestamp {
    t.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX)).unwrap_or(Timestamp::MAX)
}

fn age(now: Timestamp, since: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(since)).unwrap_or_default()
}

/// The canonical `/32` or `/128` form of `entry`, if it is one.
pub fn canonical_single_ip(entry: &str) -> Option<std::net::IpAddr> {
    let net: ipnet::IpNet = entry.parse().ok()?;
    (net.prefix_len() == net.max_prefix_len() && single_ip_cidr(net.addr()) == entry).then_some(net.addr())
}

/// The state of the Pod a record holds for.
pub fn pod_state(record: &ReservedIP, pod: Option<&PodFacts>) -> PodState {
    match pod {
        Some(p) if !record.spec.pod.uid.is_empty() && p.uid == record.spec.pod.uid => {
            if matches!(p.phase.as_deref(), Some("Succeeded" | "Failed")) {
                PodState::Gone
            } else if p.deleting {
                PodState::Deleting
            } else {
                PodState::Kept
            }
        }
        _ => PodState::Gone,
    }
}

impl Planner {
    pub fn new(settings: PlanSettings) -> Self {
        Self { settings, ..Default::default() }
    }

    /// Leaves a record alone until the watch shows it gone.
    pub fn mark_in_flight(&mut self, record_uid: &str) {
        self.in_flight.insert(record_uid.to_string());
    }

    /// The release of a record failed: plan it again.
    pub fn clear_in_flight(&mut self, record_uid: &str) {
        self.in_flight.remove(record_uid);
    }

    /// A batch went out (or failed) for this reservation: the next waits `releaseInterval`.
    pub fn mark_released(&mut self, reservation: &str, at: Timestamp) {
        self.last_release.insert(reservation.to_string(), at);
    }

    /// Whether a mismatch has lasted the settle time; remembers when it was first seen.
    fn settled(&mut self, m: Mismatch, now: Timestamp, seen: &mut HashSet<Mismatch>, wake: &mut Wake) -> bool {
        let first = *self.first_seen.entry(m.clone()).or_insert(now);
        seen.insert(m);
        let ready = plus(first, self.settings.settle);
        if ready <= now {
            true
        } else {
            wake.at(ready);
            false
        }
    }

    pub fn plan(&mut self, w: &World<'_>) -> Plan {
        let now = w.now;
        let mut plan = Plan::default();
        let mut wake = Wake(None);
        let mut seen = HashSet::new();
        let live: HashSet<String> = w.records.iter().filter_map(|r| r.uid()).collect();
        self.in_flight.retain(|uid| live.contains(uid));

        // Entries present per reservation, and which (reservation, cidr) pairs are recorded.
        let present: HashMap<&str, HashSet<&str>> = w
            .reservations
            .iter()
            .map(|(name, v)| (name.as_str(), v.entries.iter().map(String::as_str).collect()))
            .collect();
        let mut recorded: HashSet<(&str, &str)> = HashSet::new();
        let mut recorded_cidrs: HashSet<&str> = HashSet::new();

        // Release candidates per reservation.
        let mut candidates: BTreeMap<String, Vec<Leaving>> = BTreeMap::new();
        // Records counting against each policy's cap: (reservedAt, name).
        let mut counted: BTreeMap<String, Vec<(Timestamp, String, Arc<ReservedIP>)>> = BTreeMap::new();

        for rec in w.records {
            let spec = &rec.spec;
            recorded.insert((spec.reservation.as_str(), spec.cidr.as_str()));
            recorded_cidrs.insert(spec.cidr.as_str());
            let uid = rec.uid().unwrap_or_default();
            let policy = w.policies.get(&spec.policy);
            let figures = plan.figures.entry(spec.policy.clone()).or_default();
            figures.held += 1;
            figures.oldest_age = figures.oldest_age.max(age(now, spec.reserved_at.0));
            figures.max_reserved = policy.map(|p| p.max_reserved);
            if self.in_flight.contains(&uid) {
                continue;
            }
            let pod = (w.pod)(&spec.pod.namespace, &spec.pod.name);
            let state = pod_state(rec, pod.as_deref());
            let current = rec.status.clone().unwrap_or_default();
            let mut desired = current.clone();
            let reserve_for = spec
                .reserve_for
                .parse::<capo_api::Duration>()
                .map(|d| d.as_std())
                .unwrap_or(self.settings.default_reserve_for);
            let extend_until = spec
                .manual
                .as_ref()
                .filter(|m| m.action == ManualAction::Extend)
                .and_then(|m| m.until.as_ref())
                .map(|u| u.0);

            // When it is due, and why; None: not counting down.
            let mut due: Option<(Timestamp, ReleaseReason)> = match state {
                PodState::Kept => {
                    let since = current.pod_kept_since.as_ref().map_or(now, |t| t.0);
                    desired.pod_kept_since = Some(micro(since));
                    desired.pod_gone_at = None;
                    desired.release_at = None;
                    Some((plus(since, self.settings.kept_pod_grace), ReleaseReason::PodKept))
                }
                PodState::Deleting => {
                    desired.pod_kept_since = None;
                    None
                }
                PodState::Gone => {
                    let gone = current.pod_gone_at.as_ref().map_or(now, |t| t.0);
                    desired.pod_gone_at = Some(micro(gone));
                    desired.pod_kept_since = None;
                    let release_at = extend_until.unwrap_or_else(|| plus(gone, reserve_for));
                    desired.release_at = Some(micro(release_at));
                    Some((release_at, ReleaseReason::Ttl))
                }
            };
            if state == PodState::Gone
                && let Some(p) = policy
            {
                let ns_gone = p.release_early.namespace_deleted && !(w.namespace_exists)(&spec.pod.namespace);
                let workload_gone = p.release_early.workload_deleted
                    && spec
                        .pod
                        .controller
                        .as_ref()
                        .is_some_and(|c| (w.workload_exists)(&spec.pod.namespace, &c.kind, &c.name) == Some(false));
                if ns_gone || workload_gone {
                    due = Some((now, ReleaseReason::WorkloadGone));
                }
            }
            if let Some(m) = spec.manual.as_ref().filter(|m| m.action == ManualAction::Release) {
                due = Some((m.at.0.min(now), ReleaseReason::Manual));
            }
            if desired != current {
                plan.status.push((rec.name_any(), spec.policy.clone(), desired));
            }

            let entry_present = present.get(spec.reservation.as_str()).is_some_and(|e| e.contains(spec.cidr.as_str()));
            if !entry_present {
                if !self.settled(Mismatch::MissingEntry(uid.clone()), now, &mut seen, &mut wake) {
                    continue;
                }
                let drop = match (state, due) {
                    (PodState::Kept, _) => Some((ReleaseReason::Repair, None)),
                    (_, Some((at, reason))) if at <= now => Some((reason, Some(at))),
                    _ => None,
                };
                match drop {
                    Some((reason, due)) => plan.drop_records.push(DropRecord {
                        record: rec.name_any(),
                        record_uid: uid.clone(),
                        pod_uid: spec.pod.uid.clone(),
                        policy: spec.policy.clone(),
                        reason,
                        due,
                    }),
                    None => plan.write_back.push(WriteBack {
                        record: rec.name_any(),
                        reservation: spec.reservation.clone(),
                        policy: spec.policy.clone(),
                        cidr: spec.cidr.clone(),
                    }),
                }
                continue;
            }
            counted.entry(spec.policy.clone()).or_default().push((spec.reserved_at.0, rec.name_any(), rec.clone()));
            match due {
                Some((at, reason)) if at <= now => {
                    candidates.entry(spec.reservation.clone()).or_default().push(Leaving {
                        record: rec.name_any(),
                        record_uid: uid.clone(),
                        pod_uid: spec.pod.uid.clone(),
                        cidr: spec.cidr.clone(),
                        policy: spec.policy.clone(),
                        reason,
                        due: at,
                    })
                }
                Some((at, _)) => wake.at(at),
                None => {}
            }
        }

        // The cap: the oldest holds past maxReserved leave, whatever else is due.
        let mut cap_leaving: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (policy_name, mut holds) in counted {
            let Some(policy) = w.policies.get(&policy_name) else { continue };
            let max = policy.max_reserved as usize;
            if holds.len() <= max {
                continue;
            }
            plan.over_cap.push(policy_name.clone());
            holds.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
            for (_, name, rec) in holds.iter().take(holds.len() - max) {
                let spec = &rec.spec;
                cap_leaving.entry(spec.reservation.clone()).or_default().insert(name.clone());
                let list = candidates.entry(spec.reservation.clone()).or_default();
                if !list.iter().any(|l| &l.record == name) {
                    list.push(Leaving {
                        record: name.clone(),
                        record_uid: rec.uid().unwrap_or_default(),
                        pod_uid: spec.pod.uid.clone(),
                        cidr: spec.cidr.clone(),
                        policy: policy_name.clone(),
                        reason: ReleaseReason::Cap,
                        due: now,
                    });
                }
            }
        }

        // Pacing: one batch per reservation per releaseInterval.
        for (reservation, mut list) in candidates {
            let policy_name = list.first().map(|l| l.policy.clone()).unwrap_or_default();
            let policy = w.policies.get(&policy_name);
            let interval = policy.map_or(self.settings.default_release_interval, |p| p.release_interval);
            let batch = policy.map_or(self.settings.default_release_batch, |p| p.release_batch as usize);
            if let Some(last) = self.last_release.get(&reservation) {
                let next = plus(*last, interval);
                if next > now {
                    wake.at(next);
                    continue;
                }
            }
            let forced = cap_leaving.remove(&reservation).unwrap_or_default();
            list.sort_by(|a, b| (a.due, &a.record).cmp(&(b.due, &b.record)));
            let (mut leaving, rest): (Vec<_>, Vec<_>) = list.into_iter().partition(|l| forced.contains(&l.record));
            let room = batch.saturating_sub(leaving.len());
            let waiting = rest.len() > room;
            leaving.extend(rest.into_iter().take(room));
            if waiting {
                wake.at(plus(now, interval));
            }
            plan.releases.push(ReleaseBatch { reservation, leaving });
        }

        // Repair, reservation side: garbage, redundant and orphan entries.
        for (name, view) in w.reservations {
            let mut garbage = Vec::new();
            let mut redundant = Vec::new();
            for entry in &view.entries {
                if canonical_single_ip(entry).is_none() {
                    garbage.push(entry.clone());
                    continue;
                }
                if recorded.contains(&(name.as_str(), entry.as_str())) {
                    continue;
                }
                if !self.settled(Mismatch::Orphan(name.clone(), entry.clone()), now, &mut seen, &mut wake) {
                    continue;
                }
                if recorded_cidrs.contains(entry.as_str()) {
                    redundant.push(entry.clone());
                } else {
                    plan.adopt.push(Adoption {
                        reservation: name.clone(),
                        policy: view.policy.clone(),
                        cidr: entry.clone(),
                    });
                }
            }
            if !garbage.is_empty() || !redundant.is_empty() {
                plan.remove_entries.push(RemoveEntries {
                    reservation: name.clone(),
                    policy: view.policy.clone(),
                    garbage,
                    redundant,
                });
            }
        }
        self.first_seen.retain(|m, _| seen.contains(m));
        plan.wake_at = wake.0;
        plan
    }
}

/// The earliest of the times something becomes due.
struct Wake(Option<Timestamp>);

impl Wake {
    fn at(&mut self, t: Timestamp) {
        self.0 = Some(self.0.map_or(t, |w| w.min(t)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capo_api::{HoldTrigger, ManualChange, PodRef, ReservedIPSpec};
    use kube::api::ObjectMeta;
    use serde_json::json;

    const T0: i64 = 1_800_000_000;

    fn at(secs: f64) -> Timestamp {
        Timestamp::from_microsecond(((T0 as f64 + secs) * 1e6) as i64).unwrap()
    }

    fn policy(name: &str, extra: serde_json::Value) -> Arc<CompiledPolicy> {
        let mut spec = json!({ "podSelector": {}, "reserveFor": "60s", "maxReserved": 100, "releaseInterval": "5s" });
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let p: capo_api::CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
            "metadata": { "name": name }, "spec": spec,
        }))
        .unwrap();
        Arc::new(CompiledPolicy::compile(&p).unwrap())
    }

    fn record(ip: &str, policy: &str, reserved: f64, status: Option<ReservedIPStatus>) -> Arc<ReservedIP> {
        let ipaddr: std::net::IpAddr = ip.parse().unwrap();
        Arc::new(ReservedIP {
            metadata: ObjectMeta {
                name: Some(capo_api::reserved_ip::record_name(ipaddr)),
                uid: Some(format!("uid-{ip}")),
                ..Default::default()
            },
            spec: ReservedIPSpec {
                ip: ip.into(),
                cidr: single_ip_cidr(ipaddr),
                reservation: format!("capo-{policy}"),
                calico_api_group: "crd.projectcalico.org/v1".into(),
                policy: policy.into(),
                pod: PodRef {
                    namespace: "ns".into(),
                    name: format!("pod-{ip}"),
                    uid: format!("pod-uid-{ip}"),
                    node: None,
                    controller: Some(capo_api::ControllerRef { kind: "StatefulSet".into(), name: "redis".into() }),
                },
                trigger: HoldTrigger::Delete,
                reserved_at: MicroTime(at(reserved)),
                reserve_for: "60s".into(),
                manual: None,
            },
            status,
        })
    }

    fn gone_at(secs: f64) -> Option<ReservedIPStatus> {
        Some(ReservedIPStatus {
            pod_gone_at: Some(MicroTime(at(secs))),
            release_at: Some(MicroTime(at(secs + 60.0))),
            pod_kept_since: None,
        })
    }

    struct Fixture {
        records: Vec<Arc<ReservedIP>>,
        reservations: BTreeMap<String, ReservationView>,
        policies: BTreeMap<String, Arc<CompiledPolicy>>,
        pods: Vec<PodFacts>,
        namespaces: Vec<String>,
        workloads: Vec<String>,
    }

    impl Fixture {
        fn new(policies: Vec<Arc<CompiledPolicy>>) -> Self {
            Self {
                records: vec![],
                reservations: BTreeMap::new(),
                policies: policies.into_iter().map(|p| (p.name.clone(), p)).collect(),
                pods: vec![],
                namespaces: vec!["ns".into()],
                workloads: vec!["redis".into()],
            }
        }
        /// A held record with its entry in place.
        fn hold(&mut self, r: Arc<ReservedIP>) {
            let v = self.reservations.entry(r.spec.reservation.clone()).or_default();
            v.policy = r.spec.policy.clone();
            v.entries.push(r.spec.cidr.clone());
            self.records.push(r);
        }
        fn pod(&mut self, rec: &ReservedIP, deleting: bool, phase: &str) {
            self.pods.push(PodFacts {
                namespace: rec.spec.pod.namespace.clone(),
                name: rec.spec.pod.name.clone(),
                uid: rec.spec.pod.uid.clone(),
                labels: Default::default(),
                annotations: Default::default(),
                controller: None,
                node: None,
                host_network: false,
                ips: vec![rec.spec.ip.parse().unwrap()],
                phase: Some(phase.into()),
                deleting,
            });
        }
        fn plan(&self, planner: &mut Planner, now: f64) -> Plan {
            let pod = |ns: &str, name: &str| {
                self.pods.iter().find(|p| p.namespace == ns && p.name == name).cloned().map(Arc::new)
            };
            let ns = |n: &str| self.namespaces.iter().any(|x| x == n);
            let wl = |_: &str, _: &str, name: &str| Some(self.workloads.iter().any(|x| x == name));
            planner.plan(&World {
                now: at(now),
                records: &self.records,
                reservations: &self.reservations,
                policies: &self.policies,
                pod: &pod,
                namespace_exists: &ns,
                workload_exists: &wl,
            })
        }
    }

    fn released(plan: &Plan) -> Vec<(String, ReleaseReason)> {
        plan.releases.iter().flat_map(|b| b.leaving.iter().map(|l| (l.cidr.clone(), l.reason))).collect()
    }

    #[test]
    fn the_clock_starts_when_the_pod_is_gone_and_the_ttl_releases_on_time() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        let r = record("10.0.0.1", "p", 0.0, None);
        f.hold(r.clone());
        f.pod(&r, true, "Running");
        let mut planner = Planner::default();
        // Being deleted: not counted down, nothing to release, no timer.
        let plan = f.plan(&mut planner, 100.0);
        assert!(plan.status.is_empty() && plan.releases.is_empty() && plan.wake_at.is_none(), "{plan:?}");
        // Gone: podGoneAt is now, releaseAt now + 60s, and the planner wakes then.
        f.pods.clear();
        let plan = f.plan(&mut planner, 200.0);
        let (_, _, st) = &plan.status[0];
        assert_eq!(st.pod_gone_at.as_ref().unwrap().0, at(200.0));
        assert_eq!(st.release_at.as_ref().unwrap().0, at(260.0));
        assert_eq!(plan.wake_at, Some(at(260.0)));
        assert!(plan.releases.is_empty());
        // With the status written back: released at the due time, not before.
        f.records = vec![record("10.0.0.1", "p", 0.0, gone_at(200.0))];
        assert!(f.plan(&mut planner, 259.9).releases.is_empty());
        let plan = f.plan(&mut planner, 260.0);
        assert_eq!(released(&plan), vec![("10.0.0.1/32".into(), ReleaseReason::Ttl)]);
        assert_eq!(plan.releases[0].leaving[0].due, at(260.0));
    }

    #[test]
    fn a_terminal_pod_counts_as_gone() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        let r = record("10.0.0.1", "p", 0.0, None);
        f.hold(r.clone());
        f.pod(&r, false, "Failed");
        let plan = f.plan(&mut Planner::default(), 10.0);
        assert_eq!(plan.status[0].2.pod_gone_at.as_ref().unwrap().0, at(10.0));
    }

    #[test]
    fn a_recreated_pod_with_the_same_name_does_not_keep_the_old_hold() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        let r = record("10.0.0.1", "p", 0.0, None);
        f.hold(r.clone());
        f.pod(&r, false, "Running");
        f.pods[0].uid = "someone-else".into();
        let plan = f.plan(&mut Planner::default(), 10.0);
        assert!(plan.status[0].2.pod_gone_at.is_some());
    }

    #[test]
    fn a_kept_pod_is_dropped_after_the_grace() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        let r = record("10.0.0.1", "p", 0.0, None);
        f.hold(r.clone());
        f.pod(&r, false, "Running");
        let mut planner = Planner::new(PlanSettings { kept_pod_grace: Duration::from_secs(30), ..Default::default() });
        let plan = f.plan(&mut planner, 10.0);
        assert_eq!(plan.status[0].2.pod_kept_since.as_ref().unwrap().0, at(10.0));
        assert_eq!(plan.wake_at, Some(at(40.0)));
        let mut kept = (*f.records[0]).clone();
        kept.status = Some(plan.status[0].2.clone());
        f.records = vec![Arc::new(kept)];
        assert!(f.plan(&mut planner, 39.0).releases.is_empty());
        assert_eq!(released(&f.plan(&mut planner, 40.0)), vec![("10.0.0.1/32".into(), ReleaseReason::PodKept)]);
    }

    #[test]
    fn the_cap_releases_the_oldest_first_at_once_and_pacing_holds_back_the_rest() {
        let mut f = Fixture::new(vec![policy("p", json!({ "maxReserved": 2, "releaseBatch": 1 }))]);
        for (i, ip) in ["10.0.0.3", "10.0.0.1", "10.0.0.4", "10.0.0.2", "10.0.0.5"].iter().enumerate() {
            // reservedAt: .3 oldest, then .1, .4, .2, .5
            f.hold(record(ip, "p", i as f64, None));
        }
        let mut planner = Planner::default();
        let plan = f.plan(&mut planner, 10.0);
        assert_eq!(plan.over_cap, vec!["p".to_string()]);
        let mut got = released(&plan);
        got.sort();
        assert_eq!(
            got,
            vec![
                ("10.0.0.1/32".into(), ReleaseReason::Cap),
                ("10.0.0.3/32".into(), ReleaseReason::Cap),
                ("10.0.0.4/32".into(), ReleaseReason::Cap)
            ],
            "three over the cap of two, oldest first, all in one batch despite releaseBatch 1"
        );
        planner.mark_released("capo-p", at(10.0));
        // The next batch waits for the interval.
        f.records.retain(|r| r.spec.ip == "10.0.0.2" || r.spec.ip == "10.0.0.5");
        f.records.push(record("10.0.0.9", "p", 11.0, None));
        f.reservations.get_mut("capo-p").unwrap().entries.push("10.0.0.9/32".into());
        f.reservations
            .get_mut("capo-p")
            .unwrap()
            .entries
            .retain(|e| !["10.0.0.1/32", "10.0.0.3/32", "10.0.0.4/32"].contains(&e.as_str()));
        let plan = f.plan(&mut planner, 12.0);
        assert!(plan.releases.is_empty());
        assert_eq!(plan.wake_at, Some(at(15.0)));
        assert_eq!(released(&f.plan(&mut planner, 15.0)), vec![("10.0.0.2/32".into(), ReleaseReason::Cap)]);
    }

    #[test]
    fn release_batches_are_limited_and_the_rest_follow_an_interval_later() {
        let mut f = Fixture::new(vec![policy("p", json!({ "releaseBatch": 2 }))]);
        for i in 1..=5 {
            f.hold(record(&format!("10.0.0.{i}"), "p", 0.0, gone_at(i as f64)));
        }
        let mut planner = Planner::default();
        let plan = f.plan(&mut planner, 100.0);
        assert_eq!(
            released(&plan),
            vec![("10.0.0.1/32".into(), ReleaseReason::Ttl), ("10.0.0.2/32".into(), ReleaseReason::Ttl)],
            "the two due first"
        );
        assert_eq!(plan.wake_at, Some(at(105.0)));
    }

    #[test]
    fn a_deleted_policy_keeps_its_holds_due_times() {
        let mut f = Fixture::new(vec![]);
        f.hold(record("10.0.0.1", "gone", 0.0, gone_at(10.0)));
        let mut planner = Planner::default();
        let plan = f.plan(&mut planner, 30.0);
        assert!(plan.releases.is_empty() && plan.status.is_empty(), "{plan:?}");
        assert_eq!(plan.wake_at, Some(at(70.0)));
        assert_eq!(released(&f.plan(&mut planner, 70.0)), vec![("10.0.0.1/32".into(), ReleaseReason::Ttl)]);
    }

    #[test]
    fn namespace_or_workload_gone_releases_early_only_where_the_policy_says_so() {
        let mut f = Fixture::new(vec![
            policy("keep", json!({})),
            policy("early", json!({ "releaseEarly": { "namespaceDeleted": true, "workloadDeleted": true } })),
        ]);
        f.hold(record("10.0.0.1", "keep", 0.0, gone_at(1.0)));
        f.hold(record("10.0.0.2", "early", 0.0, gone_at(1.0)));
        f.namespaces.clear();
        let mut planner = Planner::default();
        assert_eq!(released(&f.plan(&mut planner, 5.0)), vec![("10.0.0.2/32".into(), ReleaseReason::WorkloadGone)]);
        let mut f2 = Fixture::new(vec![policy("early", json!({ "releaseEarly": { "workloadDeleted": true } }))]);
        f2.hold(record("10.0.0.3", "early", 0.0, gone_at(1.0)));
        assert!(f2.plan(&mut Planner::default(), 5.0).releases.is_empty(), "the StatefulSet still exists");
        f2.workloads.clear();
        assert_eq!(
            released(&f2.plan(&mut Planner::default(), 5.0)),
            vec![("10.0.0.3/32".into(), ReleaseReason::WorkloadGone)]
        );
    }

    #[test]
    fn manual_release_and_extend() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        let mut r = (*record("10.0.0.1", "p", 0.0, gone_at(1.0))).clone();
        r.spec.manual = Some(ManualChange {
            action: ManualAction::Extend,
            by: "alice".into(),
            at: MicroTime(at(2.0)),
            until: Some(MicroTime(at(7200.0))),
        });
        f.hold(Arc::new(r.clone()));
        let plan = f.plan(&mut Planner::default(), 100.0);
        assert_eq!(plan.status[0].2.release_at.as_ref().unwrap().0, at(7200.0));
        assert!(plan.releases.is_empty());
        r.spec.manual = Some(ManualChange {
            action: ManualAction::Release,
            by: "bob".into(),
            at: MicroTime(at(50.0)),
            until: None,
        });
        f.records = vec![Arc::new(r)];
        assert_eq!(
            released(&f.plan(&mut Planner::default(), 100.0)),
            vec![("10.0.0.1/32".into(), ReleaseReason::Manual)]
        );
    }

    #[test]
    fn repair_adopts_orphans_writes_back_missing_entries_and_removes_garbage_after_settling() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        // A record whose entry is missing, Pod gone, not due: written back.
        f.records.push(record("10.0.0.1", "p", 0.0, gone_at(1.0)));
        // A record whose entry is missing and whose Pod still runs: dropped.
        let running = record("10.0.0.2", "p", 0.0, None);
        f.records.push(running.clone());
        f.pod(&running, false, "Running");
        // A record whose entry is missing and that is past due: dropped (release completes).
        f.records.push(record("10.0.0.3", "p", 0.0, gone_at(-100.0)));
        f.reservations.insert(
            "capo-p".into(),
            ReservationView {
                policy: "p".into(),
                entries: vec!["10.0.0.7/32".into(), "10.0.0.0/24".into(), "FD00::1/128".into()],
            },
        );
        let mut planner = Planner::default();
        let plan = f.plan(&mut planner, 10.0);
        assert!(plan.adopt.is_empty() && plan.write_back.is_empty() && plan.drop_records.is_empty());
        assert_eq!(plan.remove_entries[0].garbage, vec!["10.0.0.0/24".to_string(), "FD00::1/128".to_string()]);
        assert_eq!(plan.wake_at, Some(at(15.0)), "settling");
        let plan = f.plan(&mut planner, 15.0);
        assert_eq!(
            plan.adopt,
            vec![Adoption { reservation: "capo-p".into(), policy: "p".into(), cidr: "10.0.0.7/32".into() }]
        );
        assert_eq!(plan.write_back.iter().map(|w| w.cidr.as_str()).collect::<Vec<_>>(), vec!["10.0.0.1/32"]);
        let drops: Vec<_> = plan.drop_records.iter().map(|d| (d.record.as_str(), d.reason)).collect();
        assert_eq!(drops, vec![("10.0.0.2", ReleaseReason::Repair), ("10.0.0.3", ReleaseReason::Ttl)]);
    }

    #[test]
    fn an_entry_recorded_in_another_reservation_is_redundant() {
        let mut f = Fixture::new(vec![policy("p", json!({})), policy("q", json!({}))]);
        f.hold(record("10.0.0.1", "q", 0.0, None));
        f.reservations
            .insert("capo-p".into(), ReservationView { policy: "p".into(), entries: vec!["10.0.0.1/32".into()] });
        let mut planner = Planner::default();
        f.plan(&mut planner, 0.0);
        let plan = f.plan(&mut planner, 6.0);
        assert!(plan.adopt.is_empty());
        assert_eq!(plan.remove_entries[0].redundant, vec!["10.0.0.1/32".to_string()]);
    }

    #[test]
    fn records_in_flight_are_left_alone() {
        let mut f = Fixture::new(vec![policy("p", json!({}))]);
        f.hold(record("10.0.0.1", "p", 0.0, gone_at(-100.0)));
        let mut planner = Planner::default();
        planner.mark_in_flight("uid-10.0.0.1");
        assert!(f.plan(&mut planner, 0.0).releases.is_empty());
        assert_eq!(f.plan(&mut planner, 0.0).figures["p"].held, 1);
    }

    #[test]
    fn canonical_entries() {
        assert!(canonical_single_ip("10.0.0.1/32").is_some());
        assert!(canonical_single_ip("fd00::1/128").is_some());
        for bad in ["10.0.0.1", "10.0.0.0/24", "FD00::1/128", "fd00:0::1/128", "x", "10.0.0.01/32"] {
            assert!(canonical_single_ip(bad).is_none(), "{bad}");
        }
    }
}
