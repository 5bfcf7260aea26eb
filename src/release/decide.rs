//! What one hold needs now, decided with no I/O from what the leader's stores say: its
//! countdown (`status`), and whether it is due — by TTL, an operator's request, its Pod
//! staying, or its workload going — or its entry is missing and must be written back or
//! the record dropped.

use std::time::Duration;

use capo_api::{ManualAction, ReservedIP, ReservedIPStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::pod::PodFacts;
use crate::policy::CompiledPolicy;
use crate::store::workloads::Owner;

/// Why an IP was released; the `reason` label of `capo_releases_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReleaseReason {
    /// `reserveFor` has passed since the Pod was gone.
    Ttl,
    /// The policy (or the namespace's share of it) held more than its cap: the oldest went.
    Cap,
    /// capo held more of an IP pool's unused addresses than `maxPoolShare` (the policy's)
    /// or `--max-pool-share` (all policies') allows: the oldest in that pool went.
    Pool,
    /// An operator ran `capo release`.
    Manual,
    /// The Pod was never deleted (an eviction refused by a PodDisruptionBudget, a deletion
    /// denied by another webhook) and stayed for the grace period.
    PodKept,
    /// The Pod's namespace or workload was deleted and the policy releases early then.
    WorkloadGone,
    /// Repair: a record whose entry was missing while its Pod still runs, or an entry that
    /// another hold of the same IP makes redundant.
    Repair,
    /// Sticky IPs: the Pod that replaced the held one came up with the address; the hold
    /// has done its work.
    Sticky,
}

impl ReleaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ttl => "ttl",
            Self::Cap => "cap",
            Self::Pool => "pool",
            Self::Manual => "manual",
            Self::PodKept => "pod-kept",
            Self::WorkloadGone => "workload-gone",
            Self::Repair => "repair",
            Self::Sticky => "sticky",
        }
    }
}

/// Where the Pod of a hold is, as far as the leader's store knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    /// Running and not being deleted: the hold is not counted down.
    Kept,
    /// Has a deletionTimestamp: not counted down until it is gone.
    Deleting,
    /// In a terminal phase (its IPs are freed by the CNI), or no longer there.
    Gone,
}

/// The state of the Pod a record holds for (the Pod of that name with the record's UID).
pub fn pod_state(record: &ReservedIP, pod: Option<&PodFacts>) -> PodState {
    match pod {
        Some(p) if !record.spec.pod.uid.is_empty() && p.uid == record.spec.pod.uid => {
            if p.terminal() {
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

/// Whether a Pod missing from the leader's store cannot be taken as gone yet: the store
/// never saw it leave, and its hold was made less than the settle time ago, so most likely
/// the Pod's creation has not reached a lagging watch yet. Counting down from now would
/// start the countdown before the Pod is gone (a Pod kept by a finalizer, or in its grace
/// period); waiting out the settle time only ever starts it later.
pub fn missing_too_soon(
    record: &ReservedIP,
    pod: Option<&PodFacts>,
    departure_seen: bool,
    now: Timestamp,
    settings: &PlanSettings,
) -> bool {
    pod.is_none()
        && !departure_seen
        && record.status.as_ref().is_none_or(|s| s.pod_gone_at.is_none())
        && now < just_held(record, settings)
}

/// Until when a hold counts as made a moment ago (the settle time after `reservedAt`).
pub fn just_held(record: &ReservedIP, settings: &PlanSettings) -> Timestamp {
    plus(reserved_at(record), settings.settle)
}

/// How far a time another clock wrote (a former leader's countdown start, a record's
/// status, the writing replica's `reservedAt`) may be ahead of the clock it is compared
/// with before it is not believed: a few seconds of skew between nodes on NTP pass; more
/// is a wrong clock or an edit, and such a time is taken as now (it could otherwise hold
/// an address until that date).
pub const SKEW_ALLOWANCE: Duration = Duration::from_secs(5);

/// `t`, or `now` when `t` is more than [`SKEW_ALLOWANCE`] later than `now`.
pub fn not_ahead(t: Timestamp, now: Timestamp) -> Timestamp {
    if t > plus(now, SKEW_ALLOWANCE) { now } else { t }
}

/// The hold's `reservedAt` (the writing replica's clock), never taken later than its
/// record's `creationTimestamp` (the API server's clock) plus the skew allowance.
pub fn reserved_at(record: &ReservedIP) -> Timestamp {
    let at = record.spec.reserved_at.0;
    match &record.metadata.creation_timestamp {
        Some(created) => at.min(plus(created.0, SKEW_ALLOWANCE)),
        None => at,
    }
}

/// The times of `record` the leader compares with its clock that are ahead of `now` by
/// more than the skew allowance (each taken as now, or as its record's creation), by
/// field; for the leader's warning.
pub fn ahead_of(record: &ReservedIP, now: Timestamp) -> Vec<(&'static str, Timestamp)> {
    let limit = plus(now, SKEW_ALLOWANCE);
    let status = record.status.as_ref();
    let created = record.metadata.creation_timestamp.as_ref().map(|c| plus(c.0, SKEW_ALLOWANCE));
    let mut out = Vec::new();
    if record.spec.reserved_at.0 > created.unwrap_or(limit).min(limit) {
        out.push(("spec.reservedAt", record.spec.reserved_at.0));
    }
    let times = [
        ("status.podGoneAt", status.and_then(|s| s.pod_gone_at.as_ref())),
        ("status.podKeptSince", status.and_then(|s| s.pod_kept_since.as_ref())),
        ("status.claim.at", record.claim().map(|c| &c.at)),
        ("status.claim.firstAt", record.claim().and_then(|c| c.first_at.as_ref())),
    ];
    out.extend(times.into_iter().filter_map(|(field, t)| t.filter(|t| t.0 > limit).map(|t| (field, t.0))));
    out
}

/// Knobs of the leader that are not in any policy.
#[derive(Clone, Debug)]
pub struct PlanSettings {
    /// How long a hold whose Pod stays (not deleted) is kept before it is dropped.
    pub kept_pod_grace: Duration,
    /// How long a mismatch between a record and its reservation must last before repair
    /// acts on it: the webhook writes entry and record concurrently, and watches lag.
    pub settle: Duration,
    /// The longest a review may take (`--max-review-time`): a record whose entry is missing
    /// while its Pod still runs may belong to a hold still being written for that long
    /// (its entry retried on a slow or restarting datastore), so it is not dropped before.
    pub hold_in_flight: Duration,
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
            hold_in_flight: Duration::from_secs(10),
            default_release_interval: Duration::from_secs(5),
            default_release_batch: 10,
            default_reserve_for: Duration::from_secs(40 * 60),
        }
    }
}

/// What the leader knows about one hold.
pub struct Facts<'a> {
    pub now: Timestamp,
    pub record: &'a ReservedIP,
    /// The Pod of the record's namespace/name now, if any.
    pub pod: Option<&'a PodFacts>,
    /// Whether the leader's Pod store saw the record's Pod (by UID) leave.
    pub departure_seen: bool,
    /// The record's policy, if it exists and is valid.
    pub policy: Option<&'a CompiledPolicy>,
    /// Whether the entry is in the record's reservation.
    pub entry_present: bool,
    pub namespace_exists: bool,
    /// The Pod's controller, as the leader's store sees it.
    pub owner: Owner,
    /// Since when this leader has seen the entry missing.
    pub missing_since: Option<Timestamp>,
    /// When the countdown started: this leader's stores first showed the Pod gone (a Pod
    /// or record event), or a former leader's flushed start, unless the record's status
    /// says (`podGoneAt`): a backlog of work before this hold must not start it late.
    pub seen_gone: Option<Timestamp>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Nothing to do now; look again at this time (if any).
    Wait(Option<Timestamp>),
    /// Due: release it (paced with the policy's other releases).
    Release { reason: ReleaseReason, due: Timestamp },
    /// The entry is missing and the hold not over: put it back.
    WriteBack,
    /// The entry is missing and the hold is over (or its Pod stays): drop the record.
    Drop { reason: ReleaseReason, due: Option<Timestamp> },
    /// Sticky IPs: the claim ends before the recreated Pod showed the address (see
    /// [`FallBackReason`]): take the addresses back from it and note the claim fell back;
    /// the hold runs on (and an operator's release, or its workload's, goes ahead).
    FallBack(FallBackReason),
}

/// Why a hold's sticky claim ended without the Pod showing the address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallBackReason {
    /// No Pod showed the address by the claim's `until`.
    NotShown,
    /// The claim was renewed (the Pod created again) up to its bound: `fallbackAfter`
    /// after the first claim.
    BoundReached,
    /// An operator's `capo release`: their word beats a claim.
    Released,
    /// The hold's workload or namespace was deleted (`releaseEarly`).
    WorkloadGone,
}

impl FallBackReason {
    /// The record's `status.claim.fellBackReason`.
    pub fn as_field(self) -> &'static str {
        match self {
            Self::NotShown => "NotShown",
            Self::BoundReached => "BoundReached",
            Self::Released => "Released",
            Self::WorkloadGone => "WorkloadGone",
        }
    }

    /// The reason a record's `status.claim.fellBackReason` names, if capo wrote it.
    pub fn from_field(field: &str) -> Option<Self> {
        [Self::NotShown, Self::BoundReached, Self::Released, Self::WorkloadGone]
            .into_iter()
            .find(|r| r.as_field() == field)
    }

    /// The `reason` label of `capo_sticky_fallbacks_total`.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::NotShown => "not_shown",
            Self::BoundReached => "bound_reached",
            Self::Released => "released",
            Self::WorkloadGone => "workload_gone",
        }
    }
}

/// Until when `claim` (sticky IPs) keeps its hold, if it does at `now`: its `until`, never
/// later than its bound — `fallbackAfter` after the first claim (the bound the webhook
/// writes; checked here too, for a policy shortened since), or the claim's own length
/// when its policy is gone.
pub fn claim_pending(
    claim: &capo_api::StickyClaim,
    policy: Option<&CompiledPolicy>,
    now: Timestamp,
) -> Option<Timestamp> {
    let after = policy
        .and_then(|p| p.sticky)
        .unwrap_or_else(|| Duration::try_from(claim.until.0.duration_since(claim.at.0)).unwrap_or(Duration::ZERO));
    let until = claim.until.0.min(plus(claim.first(), after));
    (claim.fell_back_at.is_none() && now < until).then_some(until)
}

/// `claim` with its times taken as `now` where they are ahead of it by more than the skew
/// allowance (a webhook replica's clock ahead): its bound then runs from the moment the
/// leader saw it, and is written so (counted from a time a day ahead, the claim would keep
/// its hold a day).
fn claim_not_ahead(claim: &capo_api::StickyClaim, now: Timestamp) -> capo_api::StickyClaim {
    let mut claim = claim.clone();
    if claim.fell_back_at.is_none() && claim.first() > plus(now, SKEW_ALLOWANCE) {
        claim.first_at = Some(MicroTime(now));
    }
    claim.at = MicroTime(not_ahead(claim.at.0, now));
    claim
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The status the record should have (written if it differs).
    pub status: ReservedIPStatus,
    pub action: Action,
}

/// `t + d`, saturating (a duration past the year 9999 never falls due).
pub fn plus(t: Timestamp, d: Duration) -> Timestamp {
    t.checked_add(SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX)).unwrap_or(Timestamp::MAX)
}

/// When a hold whose Pod is gone since `gone` falls due by its TTL (an operator's
/// `extend` aside).
pub fn ttl_due(rec: &ReservedIP, gone: Timestamp, settings: &PlanSettings) -> Timestamp {
    plus(gone, reserve_for(rec, settings))
}

/// When a hold whose Pod is gone since `gone` falls due: at the operator's `extend`, if
/// any, else by its TTL.
pub fn release_at(rec: &ReservedIP, gone: Timestamp, settings: &PlanSettings) -> Timestamp {
    extend_until(rec).unwrap_or_else(|| ttl_due(rec, gone, settings))
}

fn extend_until(rec: &ReservedIP) -> Option<Timestamp> {
    rec.manual().filter(|m| m.action == ManualAction::Extend).and_then(|m| m.until.as_ref()).map(|u| u.0)
}

fn reserve_for(rec: &ReservedIP, settings: &PlanSettings) -> Duration {
    rec.spec.reserve_for.parse::<capo_api::Duration>().map(|d| d.as_std()).unwrap_or(settings.default_reserve_for)
}

pub fn decide(f: &Facts<'_>, settings: &PlanSettings) -> Decision {
    let (now, rec) = (f.now, f.record);
    let spec = &rec.spec;
    let state = pod_state(rec, f.pod);
    let current = rec.status.clone().unwrap_or_default();
    let mut desired = current.clone();

    // A hold made a moment ago whose Pod still looks kept: its deletion has most likely not
    // reached this leader's Pod store yet. Looked at again once that had time to settle,
    // instead of writing `podKeptSince` now and taking it back a moment later.
    let just_held = just_held(rec, settings);
    let mut recheck = None;
    // When it is due, and why; None: not counting down.
    let mut due: Option<(Timestamp, ReleaseReason)> = match state {
        PodState::Gone if missing_too_soon(rec, f.pod, f.departure_seen, now, settings) => {
            recheck = Some(just_held);
            None
        }
        PodState::Kept if current.pod_kept_since.is_none() && now < just_held => {
            recheck = Some(just_held);
            None
        }
        PodState::Kept => {
            let since = current.pod_kept_since.as_ref().map_or(now, |t| not_ahead(t.0, now));
            desired.pod_kept_since = Some(MicroTime(since));
            desired.pod_gone_at = None;
            desired.release_at = None;
            Some((plus(since, settings.kept_pod_grace), ReleaseReason::PodKept))
        }
        PodState::Deleting => {
            desired.pod_kept_since = None;
            None
        }
        PodState::Gone => {
            // A start later than now (another leader's clock ahead, an edit) is taken as now
            // and written so: recounting from now at every look would never fall due.
            let gone = current
                .pod_gone_at
                .as_ref()
                .map(|t| not_ahead(t.0, now))
                .or(f.seen_gone.filter(|t| *t <= now))
                .unwrap_or(now);
            desired.pod_gone_at = Some(MicroTime(gone));
            desired.pod_kept_since = None;
            let release_at = release_at(rec, gone, settings);
            desired.release_at = Some(MicroTime(release_at));
            Some((release_at, ReleaseReason::Ttl))
        }
    };
    if state == PodState::Gone
        && due.is_some()
        && let Some(p) = f.policy
    {
        let ns_gone = p.release_early.namespace_deleted && !f.namespace_exists;
        let workload_gone = p.release_early.workload_deleted && spec.pod.controller.is_some() && f.owner == Owner::Gone;
        if ns_gone || workload_gone {
            due = Some((now, ReleaseReason::WorkloadGone));
        }
    }
    if let Some(m) = rec.manual().filter(|m| m.action == ManualAction::Release) {
        due = Some((m.at.0.min(now), ReleaseReason::Manual));
    }

    let action = if !f.entry_present {
        // A Pod that still runs may be waiting for the review that writes this hold.
        let in_flight = plus(f.missing_since.unwrap_or(now), settings.settle + settings.hold_in_flight);
        match f.missing_since.map(|s| plus(s, settings.settle)) {
            Some(_) if state == PodState::Kept && in_flight > now => Action::Wait(Some(in_flight)),
            Some(settled) if settled <= now => match (state, due) {
                (PodState::Kept, _) => Action::Drop { reason: ReleaseReason::Repair, due: None },
                (_, Some((at, reason))) if at <= now => Action::Drop { reason, due: Some(at) },
                _ => Action::WriteBack,
            },
            Some(settled) => Action::Wait(Some(settled)),
            None => Action::Wait(Some(plus(now, settings.settle))),
        }
    } else {
        match due {
            Some((at, reason)) if at <= now => Action::Release { reason, due: at },
            Some((at, _)) => Action::Wait(Some(at)),
            None => Action::Wait(recheck),
        }
    };
    desired.claim = current.claim.as_ref().map(|c| claim_not_ahead(c, now));
    take_request(rec, &mut desired, now);
    let action = sticky(f, desired.claim.as_ref(), action);
    Decision { status: desired, action }
}

/// Notes in the status that this leader has taken an operator's extension into its plan
/// (`capo extend` waits for it), once. A release needs no note: its end is the record's.
fn take_request(rec: &ReservedIP, desired: &mut ReservedIPStatus, now: Timestamp) {
    let current = rec.manual();
    if let Some(m) = desired.manual.as_mut()
        && m.action == ManualAction::Extend
        && m.taken_at.is_none()
        && current.is_some_and(|c| c.at == m.at && c.by == m.by)
    {
        m.taken_at = Some(MicroTime(now));
    }
}

/// Sticky IPs: a claimed hold ends once the Pod that replaced its own shows the address;
/// while the claim is pending it is never released (nor dropped); past it, it falls back.
fn sticky(f: &Facts<'_>, claim: Option<&capo_api::StickyClaim>, action: Action) -> Action {
    let (rec, now) = (f.record, f.now);
    let Some(claim) = claim else { return action };
    let shown = f.pod.is_some_and(|p| {
        p.uid != rec.spec.pod.uid && rec.spec.ip.parse().is_ok_and(|ip: std::net::IpAddr| p.ips.contains(&ip))
    });
    if shown {
        return match action {
            Action::Wait(_) | Action::Release { .. } if f.entry_present => {
                Action::Release { reason: ReleaseReason::Sticky, due: now }
            }
            _ => Action::Drop { reason: ReleaseReason::Sticky, due: Some(now) },
        };
    }
    if claim.fell_back_at.is_some() {
        return action;
    }
    let Some(until) = claim_pending(claim, f.policy, now) else {
        // Renewed at least once: the webhook wrote `until` at the bound.
        let why = if claim.renewals > 0 { FallBackReason::BoundReached } else { FallBackReason::NotShown };
        return Action::FallBack(why);
    };
    match action {
        // An operator's release, or the workload's, ends the claim first (its addresses
        // taken back from the Pod), then goes ahead at the next look.
        Action::Release { reason: ReleaseReason::Manual, .. } | Action::Drop { reason: ReleaseReason::Manual, .. } => {
            Action::FallBack(FallBackReason::Released)
        }
        Action::Release { reason: ReleaseReason::WorkloadGone, .. }
        | Action::Drop { reason: ReleaseReason::WorkloadGone, .. } => Action::FallBack(FallBackReason::WorkloadGone),
        Action::Release { .. } => Action::Wait(Some(until)),
        // A missing entry of a claimed hold is written back: it keeps the address from
        // everyone else until the recreated Pod has it.
        Action::Drop { .. } => Action::WriteBack,
        Action::Wait(at) => Action::Wait(Some(at.map_or(until, |at| at.min(until)))),
        Action::WriteBack | Action::FallBack(_) => action,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use capo_api::reserved_ip::single_ip_cidr;
    use capo_api::{HoldTrigger, ManualChange, PodRef, ReservedIPSpec};
    use kube::api::ObjectMeta;
    use serde_json::json;

    const T0: i64 = 1_800_000_000;

    pub fn at(secs: f64) -> Timestamp {
        Timestamp::from_microsecond(((T0 as f64 + secs) * 1e6) as i64).unwrap()
    }

    pub fn policy(name: &str, extra: serde_json::Value) -> CompiledPolicy {
        let mut spec = json!({ "podSelector": {}, "reserveFor": "60s", "maxReserved": 100, "releaseInterval": "5s" });
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let p: capo_api::CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
            "metadata": { "name": name }, "spec": spec,
        }))
        .unwrap();
        CompiledPolicy::compile(&p).unwrap()
    }

    pub fn record(ip: &str, policy: &str, reserved: f64, status: Option<ReservedIPStatus>) -> ReservedIP {
        let ipaddr: std::net::IpAddr = ip.parse().unwrap();
        ReservedIP {
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
                    controller: Some(capo_api::ControllerRef {
                        api_version: Some("apps/v1".into()),
                        kind: "StatefulSet".into(),
                        name: "redis".into(),
                        uid: None,
                    }),
                    addresses: vec![],
                },
                trigger: HoldTrigger::Delete,
                reserved_at: MicroTime(at(reserved)),
                reserve_for: "60s".into(),
                manual: None,
                forced: false,
            },
            status,
        }
    }

    pub fn gone_at(secs: f64) -> Option<ReservedIPStatus> {
        Some(ReservedIPStatus {
            pod_gone_at: Some(MicroTime(at(secs))),
            release_at: Some(MicroTime(at(secs + 60.0))),
            pod_kept_since: None,
            manual: None,
            claim: None,
        })
    }

    fn pod_of(rec: &ReservedIP, deleting: bool, phase: &str) -> PodFacts {
        PodFacts {
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
        }
    }

    fn facts<'a>(
        rec: &'a ReservedIP,
        pod: Option<&'a PodFacts>,
        policy: Option<&'a CompiledPolicy>,
        now: f64,
    ) -> Facts<'a> {
        Facts {
            now: at(now),
            record: rec,
            pod,
            departure_seen: false,
            policy,
            entry_present: true,
            namespace_exists: true,
            owner: Owner::Present,
            missing_since: None,
            seen_gone: None,
        }
    }

    #[test]
    fn the_clock_starts_when_the_pod_is_gone_and_the_ttl_releases_on_time() {
        let p = policy("p", json!({}));
        let r = record("10.0.0.1", "p", 0.0, None);
        let deleting = pod_of(&r, true, "Running");
        let s = PlanSettings::default();
        let d = decide(&facts(&r, Some(&deleting), Some(&p), 100.0), &s);
        assert_eq!(d.action, Action::Wait(None), "being deleted: not counted down");
        assert!(d.status.pod_gone_at.is_none());
        let d = decide(&facts(&r, None, Some(&p), 200.0), &s);
        assert_eq!(d.status.pod_gone_at.as_ref().unwrap().0, at(200.0));
        assert_eq!(d.status.release_at.as_ref().unwrap().0, at(260.0));
        assert_eq!(d.action, Action::Wait(Some(at(260.0))));
        let written = record("10.0.0.1", "p", 0.0, gone_at(200.0));
        assert_eq!(decide(&facts(&written, None, Some(&p), 259.9), &s).action, Action::Wait(Some(at(260.0))));
        assert_eq!(
            decide(&facts(&written, None, Some(&p), 260.0), &s).action,
            Action::Release { reason: ReleaseReason::Ttl, due: at(260.0) }
        );
    }

    #[test]
    fn the_clock_starts_when_the_leader_saw_the_pod_gone_not_when_it_got_round_to_the_hold() {
        let p = policy("p", json!({}));
        let r = record("10.0.0.1", "p", 0.0, None);
        let mut f = facts(&r, None, Some(&p), 200.0);
        f.seen_gone = Some(at(150.0));
        let d = decide(&f, &PlanSettings::default());
        assert_eq!(d.status.pod_gone_at.as_ref().unwrap().0, at(150.0));
        assert_eq!(d.action, Action::Wait(Some(at(210.0))));
        // A countdown already written stays as written.
        let written = record("10.0.0.1", "p", 0.0, gone_at(170.0));
        let mut f = facts(&written, None, Some(&p), 200.0);
        f.seen_gone = Some(at(150.0));
        assert_eq!(decide(&f, &PlanSettings::default()).status.pod_gone_at.as_ref().unwrap().0, at(170.0));
        // A Pod still there is not gone, whatever was seen before.
        let deleting = pod_of(&r, true, "Running");
        let mut f = facts(&r, Some(&deleting), Some(&p), 200.0);
        f.seen_gone = Some(at(150.0));
        assert!(decide(&f, &PlanSettings::default()).status.pod_gone_at.is_none());
    }

    #[test]
    fn a_pod_missing_from_the_store_a_moment_after_its_hold_is_not_gone_unless_the_store_saw_it_leave() {
        let p = policy("p", json!({ "releaseEarly": { "workloadDeleted": true } }));
        let r = record("10.0.0.1", "p", 100.0, None);
        let s = PlanSettings::default();
        // Missing, never seen leaving, held 1 s ago: a lagging watch, not a gone Pod.
        let mut f = facts(&r, None, Some(&p), 101.0);
        f.owner = Owner::Gone;
        f.seen_gone = Some(at(100.5));
        let d = decide(&f, &s);
        assert!(d.status.pod_gone_at.is_none(), "no countdown from a Pod the store has not seen yet");
        assert_eq!(d.action, Action::Wait(Some(at(105.0))), "looked at again once the store had time to settle");
        // Seen leaving: gone at once, counted from when it was seen.
        f.departure_seen = true;
        let d = decide(&f, &s);
        assert_eq!(d.status.pod_gone_at.as_ref().unwrap().0, at(100.5));
        assert!(matches!(d.action, Action::Release { reason: ReleaseReason::WorkloadGone, .. }));
        // Past the settle time a missing Pod is gone (the store had its chance).
        let d = decide(&facts(&r, None, Some(&p), 105.0), &s);
        assert_eq!(d.status.pod_gone_at.as_ref().unwrap().0, at(105.0));
        // A countdown already written is kept, whatever the store says now.
        let written = record("10.0.0.1", "p", 100.0, gone_at(100.2));
        assert_eq!(decide(&facts(&written, None, Some(&p), 101.0), &s).action, Action::Wait(Some(at(160.2))));
    }

    #[test]
    fn a_terminal_pod_counts_as_gone_and_a_recreated_one_does_not_keep_the_hold() {
        let p = policy("p", json!({}));
        let r = record("10.0.0.1", "p", 0.0, None);
        let failed = pod_of(&r, false, "Failed");
        let d = decide(&facts(&r, Some(&failed), Some(&p), 10.0), &PlanSettings::default());
        assert_eq!(d.status.pod_gone_at.as_ref().unwrap().0, at(10.0));
        let mut recreated = pod_of(&r, false, "Running");
        recreated.uid = "someone-else".into();
        let d = decide(&facts(&r, Some(&recreated), Some(&p), 10.0), &PlanSettings::default());
        assert!(d.status.pod_gone_at.is_some());
    }

    #[test]
    fn a_pod_that_looks_kept_a_moment_after_its_hold_is_looked_at_again_before_it_counts_as_kept() {
        let p = policy("p", json!({}));
        let r = record("10.0.0.1", "p", 0.0, None);
        let running = pod_of(&r, false, "Running");
        let s = PlanSettings::default();
        let d = decide(&facts(&r, Some(&running), Some(&p), 1.0), &s);
        assert_eq!(d.status, ReservedIPStatus::default(), "no status write while the deletion may be on its way");
        assert_eq!(d.action, Action::Wait(Some(at(5.0))));
        let d = decide(&facts(&r, Some(&running), Some(&p), 5.0), &s);
        assert_eq!(d.status.pod_kept_since.as_ref().unwrap().0, at(5.0));
    }

    #[test]
    fn a_kept_pod_is_dropped_after_the_grace() {
        let p = policy("p", json!({}));
        let r = record("10.0.0.1", "p", 0.0, None);
        let running = pod_of(&r, false, "Running");
        let s = PlanSettings { kept_pod_grace: Duration::from_secs(30), ..Default::default() };
        let d = decide(&facts(&r, Some(&running), Some(&p), 10.0), &s);
        assert_eq!(d.status.pod_kept_since.as_ref().unwrap().0, at(10.0));
        assert_eq!(d.action, Action::Wait(Some(at(40.0))));
        let mut kept = r.clone();
        kept.status = Some(d.status);
        assert_eq!(
            decide(&facts(&kept, Some(&running), Some(&p), 40.0), &s).action,
            Action::Release { reason: ReleaseReason::PodKept, due: at(40.0) }
        );
    }

    #[test]
    fn namespace_or_workload_gone_releases_early_only_where_the_policy_says_so() {
        let keep = policy("keep", json!({}));
        let early = policy("early", json!({ "releaseEarly": { "namespaceDeleted": true, "workloadDeleted": true } }));
        let r = record("10.0.0.1", "early", 0.0, gone_at(1.0));
        let mut f = facts(&r, None, Some(&early), 5.0);
        f.namespace_exists = false;
        assert_eq!(
            decide(&f, &PlanSettings::default()).action,
            Action::Release { reason: ReleaseReason::WorkloadGone, due: at(5.0) }
        );
        f.policy = Some(&keep);
        assert_eq!(decide(&f, &PlanSettings::default()).action, Action::Wait(Some(at(61.0))));
        let mut f = facts(&r, None, Some(&early), 5.0);
        assert!(matches!(decide(&f, &PlanSettings::default()).action, Action::Wait(_)), "the StatefulSet still exists");
        f.owner = Owner::Deleting;
        assert!(matches!(decide(&f, &PlanSettings::default()).action, Action::Wait(_)), "not gone yet");
        f.owner = Owner::Gone;
        assert_eq!(
            decide(&f, &PlanSettings::default()).action,
            Action::Release { reason: ReleaseReason::WorkloadGone, due: at(5.0) }
        );
    }

    #[test]
    fn manual_release_and_extend() {
        let p = policy("p", json!({}));
        let mut r = record("10.0.0.1", "p", 0.0, gone_at(1.0));
        r.spec.manual = Some(ManualChange {
            action: ManualAction::Extend,
            by: "alice".into(),
            at: MicroTime(at(2.0)),
            until: Some(MicroTime(at(7200.0))),
            taken_at: None,
        });
        let d = decide(&facts(&r, None, Some(&p), 100.0), &PlanSettings::default());
        assert_eq!(d.status.release_at.as_ref().unwrap().0, at(7200.0));
        assert_eq!(d.action, Action::Wait(Some(at(7200.0))));
        r.spec.manual = Some(ManualChange {
            action: ManualAction::Release,
            by: "bob".into(),
            at: MicroTime(at(50.0)),
            until: None,
            taken_at: None,
        });
        assert_eq!(
            decide(&facts(&r, None, Some(&p), 100.0), &PlanSettings::default()).action,
            Action::Release { reason: ReleaseReason::Manual, due: at(50.0) }
        );
    }

    #[test]
    fn a_request_through_the_status_is_carried_out_and_kept_until_then_and_the_latest_request_wins() {
        let p = policy("p", json!({}));
        let mut r = record("10.0.0.1", "p", 0.0, gone_at(1.0));
        let extend = ManualChange {
            action: ManualAction::Extend,
            by: "alice".into(),
            at: MicroTime(at(2.0)),
            until: Some(MicroTime(at(7200.0))),
            taken_at: None,
        };
        r.status.as_mut().unwrap().manual = Some(extend.clone());
        let d = decide(&facts(&r, None, Some(&p), 100.0), &PlanSettings::default());
        assert_eq!(d.status.release_at.as_ref().unwrap().0, at(7200.0));
        let taken = ManualChange { taken_at: Some(MicroTime(at(100.0))), ..extend.clone() };
        assert_eq!(d.status.manual.as_ref(), Some(&taken), "the leader's status write keeps the request, taken");
        r.status.as_mut().unwrap().manual = Some(taken.clone());
        let again = decide(&facts(&r, None, Some(&p), 120.0), &PlanSettings::default());
        assert_eq!(again.status.manual.as_ref(), Some(&taken), "taken once: the first time stays");
        // An older request in the spec does not undo it; a newer one does.
        r.spec.manual = Some(ManualChange {
            action: ManualAction::Release,
            by: "bob".into(),
            at: MicroTime(at(1.5)),
            until: None,
            taken_at: None,
        });
        assert_eq!(
            decide(&facts(&r, None, Some(&p), 100.0), &PlanSettings::default()).action,
            Action::Wait(Some(at(7200.0)))
        );
        r.spec.manual.as_mut().unwrap().at = MicroTime(at(50.0));
        assert_eq!(
            decide(&facts(&r, None, Some(&p), 100.0), &PlanSettings::default()).action,
            Action::Release { reason: ReleaseReason::Manual, due: at(50.0) }
        );
    }

    #[test]
    fn a_missing_entry_is_written_back_or_its_record_dropped_once_settled() {
        let p = policy("p", json!({}));
        let s = PlanSettings::default();
        // Pod gone, not due: written back once the mismatch has lasted the settle time.
        let r = record("10.0.0.1", "p", 0.0, gone_at(1.0));
        let mut f = facts(&r, None, Some(&p), 10.0);
        f.entry_present = false;
        assert_eq!(decide(&f, &s).action, Action::Wait(Some(at(15.0))), "first seen: settle");
        f.missing_since = Some(at(8.0));
        assert_eq!(decide(&f, &s).action, Action::Wait(Some(at(13.0))));
        f.missing_since = Some(at(5.0));
        assert_eq!(decide(&f, &s).action, Action::WriteBack);
        // Pod still running: the record goes, but not while the review that wrote it may
        // still be writing its entry (it answers within the review time; until then the
        // Pod is not deleting, whatever the outcome).
        let running_rec = record("10.0.0.2", "p", 0.0, None);
        let running = pod_of(&running_rec, false, "Running");
        let mut f = facts(&running_rec, Some(&running), Some(&p), 10.0);
        f.entry_present = false;
        f.missing_since = Some(at(0.0));
        assert_eq!(decide(&f, &s).action, Action::Wait(Some(at(15.0))), "settle + the longest review");
        f.now = at(15.0);
        assert_eq!(decide(&f, &s).action, Action::Drop { reason: ReleaseReason::Repair, due: None });
        // Past due: the release completes.
        let past = record("10.0.0.3", "p", 0.0, gone_at(-100.0));
        let mut f = facts(&past, None, Some(&p), 10.0);
        f.entry_present = false;
        f.missing_since = Some(at(0.0));
        assert_eq!(decide(&f, &s).action, Action::Drop { reason: ReleaseReason::Ttl, due: Some(at(-40.0)) });
    }

    #[test]
    fn a_deleted_policy_keeps_its_holds_due_times() {
        let r = record("10.0.0.1", "gone", 0.0, gone_at(10.0));
        let d = decide(&facts(&r, None, None, 30.0), &PlanSettings::default());
        assert_eq!(d.action, Action::Wait(Some(at(70.0))));
        assert_eq!(
            decide(&facts(&r, None, None, 70.0), &PlanSettings::default()).action,
            Action::Release { reason: ReleaseReason::Ttl, due: at(70.0) }
        );
    }

    #[test]
    fn a_claimed_hold_outwaits_its_ttl_ends_when_the_new_pod_shows_the_address_and_falls_back_after() {
        let p = policy("p", json!({ "sticky": { "enabled": true } }));
        let claim = |until: f64, fell_back: Option<f64>| capo_api::StickyClaim {
            at: MicroTime(at(until - 90.0)),
            until: MicroTime(at(until)),
            first_at: None,
            renewals: 0,
            fell_back_at: fell_back.map(|t| MicroTime(at(t))),
            fell_back_reason: None,
        };
        let with = |c: capo_api::StickyClaim| {
            let mut status = gone_at(0.0).unwrap();
            status.claim = Some(c);
            record("10.0.0.1", "p", 0.0, Some(status))
        };
        let s = PlanSettings::default();
        // Due by its TTL (60 s) while the claim runs to 100: it waits for the claim.
        let r = with(claim(100.0, None));
        assert_eq!(decide(&facts(&r, None, Some(&p), 70.0), &s).action, Action::Wait(Some(at(100.0))));
        // A missing entry is still written back.
        let mut missing = facts(&r, None, Some(&p), 70.0);
        missing.entry_present = false;
        missing.missing_since = Some(at(60.0));
        assert_eq!(decide(&missing, &s).action, Action::WriteBack);
        // The Pod that replaced the held one (another uid) shows the address: the hold ends.
        let mut new = pod_of(&r, false, "Running");
        new.uid = "the-new-pod".into();
        let d = decide(&facts(&r, Some(&new), Some(&p), 70.0), &s);
        assert_eq!(d.action, Action::Release { reason: ReleaseReason::Sticky, due: at(70.0) });
        missing.pod = Some(&new);
        assert_eq!(decide(&missing, &s).action, Action::Drop { reason: ReleaseReason::Sticky, due: Some(at(70.0)) });
        // The held Pod itself (its own uid) with the address is no claim fulfilled.
        let own = pod_of(&r, false, "Running");
        assert!(!matches!(
            decide(&facts(&r, Some(&own), Some(&p), 70.0), &s).action,
            Action::Release { reason: ReleaseReason::Sticky, .. }
        ));
        // Past the claim without the address: fall back; once fallen back, the TTL rules.
        assert_eq!(decide(&facts(&r, None, Some(&p), 100.0), &s).action, Action::FallBack(FallBackReason::NotShown));
        let fell = with(claim(100.0, Some(101.0)));
        assert_eq!(
            decide(&facts(&fell, None, Some(&p), 102.0), &s).action,
            Action::Release { reason: ReleaseReason::Ttl, due: at(60.0) }
        );
        // Before the TTL a pending claim shortens nothing but the next look.
        let early = with(claim(30.0, None));
        assert_eq!(decide(&facts(&early, None, Some(&p), 10.0), &s).action, Action::Wait(Some(at(30.0))));
    }

    /// Issue 55: however often the Pod is created again, a claim keeps its hold at most
    /// `fallbackAfter` from the first claim; an operator's release and the workload's end
    /// it at once.
    #[test]
    fn a_claim_is_bounded_from_the_first_and_a_release_ends_it() {
        let p = policy("p", json!({ "sticky": { "enabled": true, "fallbackAfter": "10s" } }));
        let s = PlanSettings::default();
        let claim = |first: f64, latest: f64, until: f64, renewals: u32| capo_api::StickyClaim {
            at: MicroTime(at(latest)),
            until: MicroTime(at(until)),
            first_at: Some(MicroTime(at(first))),
            renewals,
            fell_back_at: None,
            fell_back_reason: None,
        };
        let with = |c: capo_api::StickyClaim| {
            let mut status = gone_at(0.0).unwrap();
            status.claim = Some(c);
            record("10.0.0.1", "p", 0.0, Some(status))
        };
        // Renewed twice; the webhook capped `until` at first + 10 s = 15.
        let renewed = with(claim(5.0, 12.0, 15.0, 2));
        assert_eq!(claim_pending(renewed.claim().unwrap(), Some(&p), at(14.0)), Some(at(15.0)));
        assert_eq!(decide(&facts(&renewed, None, Some(&p), 14.0), &s).action, Action::Wait(Some(at(15.0))));
        assert_eq!(claim_pending(renewed.claim().unwrap(), Some(&p), at(15.0)), None);
        assert_eq!(
            decide(&facts(&renewed, None, Some(&p), 15.0), &s).action,
            Action::FallBack(FallBackReason::BoundReached)
        );
        // An `until` past the bound (a policy shortened since, an older capo's renewal):
        // the bound still ends it, and the hold counts as any other.
        let long = with(claim(5.0, 40.0, 130.0, 3));
        assert_eq!(claim_pending(long.claim().unwrap(), Some(&p), at(14.0)), Some(at(15.0)));
        assert_eq!(claim_pending(long.claim().unwrap(), Some(&p), at(16.0)), None);
        assert_eq!(
            decide(&facts(&long, None, Some(&p), 16.0), &s).action,
            Action::FallBack(FallBackReason::BoundReached)
        );
        // A claim written before the bound existed (no firstAt): `at` stands in.
        let mut old = claim(0.0, 5.0, 50.0, 0);
        old.first_at = None;
        let old = with(old);
        assert_eq!(claim_pending(old.claim().unwrap(), Some(&p), at(14.0)), Some(at(15.0)));
        assert_eq!(decide(&facts(&old, None, Some(&p), 15.0), &s).action, Action::FallBack(FallBackReason::NotShown));
        // A claim written by a webhook replica whose clock is a day ahead: its times are
        // taken as the leader's now (and written so), its bound runs from there.
        let ahead = with(claim(86_400.0, 86_400.0, 86_410.0, 0));
        let d = decide(&facts(&ahead, None, Some(&p), 10.0), &s);
        let written = d.status.claim.clone().expect("the claim stays");
        assert_eq!((written.first(), written.at.0), (at(10.0), at(10.0)));
        assert_eq!(d.action, Action::Wait(Some(at(20.0))));
        assert_eq!(
            ahead_of(&ahead, at(10.0)),
            vec![("status.claim.at", at(86_400.0)), ("status.claim.firstAt", at(86_400.0))]
        );
        let mut status = ahead.status.clone().unwrap();
        status.claim = Some(written);
        let seen = record("10.0.0.1", "p", 0.0, Some(status));
        assert_eq!(decide(&facts(&seen, None, Some(&p), 20.0), &s).action, Action::FallBack(FallBackReason::NotShown));
        // A fallen-back claim keeps nothing.
        let mut fell = claim(5.0, 5.0, 15.0, 0);
        fell.fell_back_at = Some(MicroTime(at(15.0)));
        assert_eq!(claim_pending(&fell, Some(&p), at(6.0)), None);

        // An operator's release ends a pending claim first (its addresses taken back from
        // the Pod), and goes ahead once the claim has fallen back.
        let pending = with(claim(5.0, 5.0, 15.0, 0));
        let mut manual = pending.clone();
        manual.spec.manual = Some(capo_api::ManualChange {
            action: ManualAction::Release,
            by: "alice".into(),
            at: MicroTime(at(8.0)),
            until: None,
            taken_at: None,
        });
        assert_eq!(decide(&facts(&manual, None, Some(&p), 9.0), &s).action, Action::FallBack(FallBackReason::Released));
        let mut missing = facts(&manual, None, Some(&p), 9.0);
        missing.entry_present = false;
        missing.missing_since = Some(at(1.0));
        assert_eq!(decide(&missing, &s).action, Action::FallBack(FallBackReason::Released));
        let mut released = manual.clone();
        if let Some(c) = released.status.as_mut().and_then(|st| st.claim.as_mut()) {
            c.fell_back_at = Some(MicroTime(at(9.0)));
        }
        assert_eq!(
            decide(&facts(&released, None, Some(&p), 9.5), &s).action,
            Action::Release { reason: ReleaseReason::Manual, due: at(8.0) }
        );
        // The workload deleted (releaseEarly.workloadDeleted) ends it too.
        let early = policy(
            "p",
            json!({ "sticky": { "enabled": true, "fallbackAfter": "10s" }, "releaseEarly": { "workloadDeleted": true } }),
        );
        let mut owned = pending.clone();
        owned.spec.pod.controller = Some(capo_api::reserved_ip::ControllerRef {
            api_version: Some("apps/v1".into()),
            kind: "StatefulSet".into(),
            name: "kv".into(),
            uid: Some("sts-uid".into()),
        });
        let mut f = facts(&owned, None, Some(&early), 9.0);
        f.owner = Owner::Gone;
        assert_eq!(decide(&f, &s).action, Action::FallBack(FallBackReason::WorkloadGone));
    }

    #[test]
    fn times_ahead_of_the_clock_are_taken_as_now_and_reported() {
        let p = policy("p", json!({}));
        let s = PlanSettings::default();
        // A podGoneAt a day ahead: counted from now (and written so), due 60 s later.
        let r = record("10.0.0.1", "p", 0.0, gone_at(86_400.0));
        let d = decide(&facts(&r, None, Some(&p), 10.0), &s);
        assert_eq!(d.status.pod_gone_at, Some(MicroTime(at(10.0))));
        assert_eq!(d.action, Action::Wait(Some(at(70.0))));
        assert_eq!(ahead_of(&r, at(10.0)), vec![("status.podGoneAt", at(86_400.0))]);
        // Within the skew allowance a start is believed.
        let near = record("10.0.0.1", "p", 0.0, gone_at(14.0));
        assert_eq!(decide(&facts(&near, None, Some(&p), 10.0), &s).status.pod_gone_at, Some(MicroTime(at(14.0))));
        assert!(ahead_of(&near, at(10.0)).is_empty());
        // A countdown start a former leader flushed, ahead by an hour, starts nothing: now.
        let fresh = record("10.0.0.1", "p", 0.0, None);
        let mut f = facts(&fresh, None, Some(&p), 10.0);
        f.seen_gone = Some(at(3_600.0));
        assert_eq!(decide(&f, &s).status.pod_gone_at, Some(MicroTime(at(10.0))));
        // A podKeptSince ahead: the grace runs from now.
        let mut kept = record("10.0.0.1", "p", 0.0, None);
        kept.status = Some(ReservedIPStatus { pod_kept_since: Some(MicroTime(at(86_400.0))), ..Default::default() });
        let running = pod_of(&kept, false, "Running");
        let d = decide(&facts(&kept, Some(&running), Some(&p), 10.0), &s);
        assert_eq!(d.status.pod_kept_since, Some(MicroTime(at(10.0))));
        assert_eq!(d.action, Action::Wait(Some(at(10.0 + s.kept_pod_grace.as_secs_f64()))));
        // A reservedAt a day after its record was created: taken as the creation (plus
        // the allowance), so the settle time ends and the countdown starts.
        let mut late = record("10.0.0.1", "p", 86_400.0, None);
        late.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0.0)));
        assert_eq!(reserved_at(&late), at(5.0));
        let mut f = facts(&late, None, Some(&p), 20.0);
        f.departure_seen = false;
        assert_eq!(decide(&f, &s).status.pod_gone_at, Some(MicroTime(at(20.0))));
        assert_eq!(ahead_of(&late, at(20.0)), vec![("spec.reservedAt", at(86_400.0))]);
    }
}
