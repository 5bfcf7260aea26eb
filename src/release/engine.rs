//! The leader's loop: wake on any watched change or at the next due time, plan, write.
//! No periodic reread: the stores are kept current by watches, and the timer is set to
//! the earliest moment something becomes due.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use capo_api::keys::POLICY_LABEL;
use capo_api::{CalicoApiGroup, HoldTrigger, ReservedIP};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, ResourceExt};
use tracing::{debug, info, warn};

use super::plan::{Plan, PlanSettings, Planner, ReleaseReason, ReservationView, World};
use super::watches::Views;
use super::writes::{LeaderWrites, RecordFate, ReleaseError};
use crate::hold::{HoldRequest, HoldWriter, RecordOutcome};
use crate::leader::Fence;
use crate::metrics::Metrics;
use crate::pod::PodFacts;
use crate::policy::{CompiledPolicy, Decision, RequestContext, SharedMatcher};

#[derive(Clone, Debug, Default)]
pub struct EngineSettings {
    pub plan: PlanSettings,
    /// Only act on policies whose name starts with this (tests share one API server).
    pub policy_prefix: Option<String>,
    /// Namespaces the safety net never holds in (kube-system, capo's own).
    pub excluded_namespaces: Vec<String>,
}

pub struct ReleaseEngine {
    pub client: Client,
    pub group: CalicoApiGroup,
    pub settings: EngineSettings,
    pub metrics: Arc<Metrics>,
    pub matcher: SharedMatcher,
    pub identity: String,
}

/// Debounce: changes arriving together are planned together.
const SETTLE_EVENTS: Duration = Duration::from_millis(50);

struct Run<'a> {
    engine: &'a ReleaseEngine,
    views: Views,
    planner: Planner,
    writes: LeaderWrites,
    store: HoldWriter,
    recorder: Recorder,
    /// Pods the safety net tried, with when (retried after a while).
    netted: HashMap<String, Timestamp>,
    /// Records already announced with a `Held` Event on their Pod.
    announced: HashSet<String>,
    started: Timestamp,
}

fn in_scope(prefix: &Option<String>, policy: &str) -> bool {
    prefix.as_deref().is_none_or(|p| policy.starts_with(p))
}

fn policy_ref(name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("capo.io/v1alpha1".into()),
        kind: Some("CapoPolicy".into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

fn pod_ref(namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: (!uid.is_empty()).then(|| uid.into()),
        ..Default::default()
    }
}

impl ReleaseEngine {
    /// Runs until this replica stops leading.
    pub async fn run(&self, mut fence: Fence) {
        let reporter = Reporter { controller: "capo".into(), instance: Some(self.identity.clone()) };
        let mut run = Run {
            engine: self,
            views: Views::start(&self.client, self.group),
            planner: Planner::new(self.settings.plan.clone()),
            writes: LeaderWrites::new(self.client.clone(), self.group, fence.clone()),
            store: HoldWriter::new(self.client.clone(), self.group),
            recorder: Recorder::new(self.client.clone(), reporter),
            netted: HashMap::new(),
            announced: HashSet::new(),
            started: Timestamp::now(),
        };
        tokio::select! {
            _ = run.views.ready() => {}
            _ = fence.lost() => return,
        }
        info!("leader: release engine running");
        loop {
            let wake_at = match run.round().await {
                Ok(w) => w,
                Err(e) => {
                    warn!(error = %e, "leader: stopping the release engine");
                    return;
                }
            };
            let sleep = wake_at.map_or(Duration::from_secs(3600), |t| {
                Duration::try_from(t.duration_since(Timestamp::now())).unwrap_or_default()
            });
            tokio::select! {
                _ = run.views.changed.notified() => tokio::time::sleep(SETTLE_EVENTS).await,
                _ = tokio::time::sleep(sleep) => {}
                _ = fence.lost() => {
                    info!("leader: lost the Lease; the release engine stops");
                    return;
                }
            }
        }
    }
}

impl Run<'_> {
    fn policies(&self) -> BTreeMap<String, Arc<CompiledPolicy>> {
        let prefix = &self.engine.settings.policy_prefix;
        self.views
            .policies
            .state()
            .iter()
            .filter(|p| in_scope(prefix, &p.name_any()))
            .filter_map(|p| CompiledPolicy::compile(p).ok())
            .map(|c| (c.name.clone(), Arc::new(c)))
            .collect()
    }

    fn records(&self) -> Vec<Arc<ReservedIP>> {
        let prefix = &self.engine.settings.policy_prefix;
        let group = self.engine.group.api_version();
        self.views
            .records
            .state()
            .into_iter()
            .filter(|r| in_scope(prefix, &r.spec.policy) && r.spec.calico_api_group == group)
            .collect()
    }

    fn reservations(&self) -> BTreeMap<String, ReservationView> {
        let prefix = &self.engine.settings.policy_prefix;
        self.views
            .reservations
            .state()
            .iter()
            .filter_map(|r| {
                let policy = r.labels().get(POLICY_LABEL).cloned().unwrap_or_default();
                if !in_scope(prefix, &policy) {
                    return None;
                }
                let entries = r.data["spec"][capo_api::calico::RESERVED_CIDRS]
                    .as_array()
                    .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
                    .unwrap_or_default();
                Some((r.name_any(), ReservationView { policy, entries }))
            })
            .collect()
    }

    /// One plan, carried out. Returns when to plan again at the latest.
    async fn round(&mut self) -> Result<Option<Timestamp>, ReleaseError> {
        let records = self.records();
        debug!(records = records.len(), "leader: planning");
        let reservations = self.reservations();
        let policies = self.policies();
        let views = &self.views;
        let pod = |ns: &str, name: &str| views.pod(ns, name).map(|p| Arc::new(PodFacts::from_pod(&p)));
        let namespace_exists = |ns: &str| views.namespace(ns).is_some();
        let workload_exists = |ns: &str, kind: &str, name: &str| views.workload_exists(ns, kind, name);
        let plan = self.planner.plan(&World {
            now: Timestamp::now(),
            records: &records,
            reservations: &reservations,
            policies: &policies,
            pod: &pod,
            namespace_exists: &namespace_exists,
            workload_exists: &workload_exists,
        });
        self.figures(&plan, &policies);
        self.announce(&records);
        let wake = plan.wake_at;
        debug!(?plan, "leader: plan");
        self.carry_out(plan, &policies).await?;
        let net_wake = self.safety_net(&records).await?;
        Ok(match (wake, net_wake) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    fn figures(&self, plan: &Plan, policies: &BTreeMap<String, Arc<CompiledPolicy>>) {
        let m = &self.engine.metrics.release;
        m.held.reset();
        m.oldest_age.reset();
        m.max_reserved.reset();
        for (policy, f) in &plan.figures {
            m.held.with_label_values(&[policy]).set(f.held as i64);
            m.oldest_age.with_label_values(&[policy]).set(f.oldest_age.as_secs_f64());
        }
        for (name, p) in policies {
            m.max_reserved.with_label_values(&[name]).set(p.max_reserved as i64);
            if !plan.figures.contains_key(name) {
                m.held.with_label_values(&[name]).set(0);
            }
        }
    }

    async fn event(&self, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
        let ev = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
        if let Err(e) = self.recorder.publish(&ev, reference).await {
            debug!(error = %e, reason, "could not publish an Event");
        }
    }

    /// A `Held` Event on the Pod of every record that appeared since this replica leads.
    fn announce(&mut self, records: &[Arc<ReservedIP>]) {
        let since = self.started.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(10)).unwrap_or(self.started);
        for r in records {
            let uid = r.uid().unwrap_or_default();
            if r.spec.reserved_at.0 < since || r.spec.pod.name.is_empty() || !self.announced.insert(uid) {
                continue;
            }
            let s = &r.spec;
            let note = format!(
                "capo holds {} in IPReservation {} (policy {}, trigger {:?}) for {} after the Pod is gone",
                s.ip, s.reservation, s.policy, s.trigger, s.reserve_for
            );
            // Off the release loop: a storm of new holds must not delay releases.
            let recorder = self.recorder.clone();
            let reference = pod_ref(&s.pod.namespace, &s.pod.name, &s.pod.uid);
            let ev = Event {
                type_: EventType::Normal,
                reason: "IPHeld".into(),
                note: Some(note),
                action: "Hold".into(),
                secondary: None,
            };
            tokio::spawn(async move {
                if let Err(e) = recorder.publish(&ev, &reference).await {
                    debug!(error = %e, "could not publish an IPHeld Event");
                }
            });
        }
        let live: HashSet<String> = records.iter().filter_map(|r| r.uid()).collect();
        self.announced.retain(|u| live.contains(u));
    }

    async fn failed(&self, policy: &str, e: &ReleaseError) {
        self.engine.metrics.release.failures.with_label_values(&[policy, e.kind()]).inc();
        warn!(policy, error = %e, "leader: write failed");
        self.event(&policy_ref(policy), EventType::Warning, "ReleaseFailed", "Release", e.to_string()).await;
    }

    fn released(&self, policy: &str, reason: ReleaseReason, due: Option<Timestamp>) {
        let m = &self.engine.metrics.release;
        m.releases.with_label_values(&[policy, reason.as_str()]).inc();
        if let Some(due) = due {
            let late = Timestamp::now().duration_since(due).as_secs_f64().max(0.0);
            m.lateness.with_label_values(&[policy]).observe(late);
        }
    }

    async fn carry_out(
        &mut self,
        plan: Plan,
        policies: &BTreeMap<String, Arc<CompiledPolicy>>,
    ) -> Result<(), ReleaseError> {
        let stop = |e: ReleaseError| matches!(e, ReleaseError::NotLeader(_)).then_some(e);
        for (record, policy, status) in &plan.status {
            if let Err(e) = self.writes.write_status(record, status).await {
                self.failed(policy, &e).await;
                if let Some(e) = stop(e) {
                    return Err(e);
                }
            }
        }
        for policy in &plan.over_cap {
            let max = policies.get(policy).map_or(0, |p| p.max_reserved);
            let note = format!("more than maxReserved={max} IPs held: releasing the oldest");
            self.event(&policy_ref(policy), EventType::Warning, "CapReached", "Release", note).await;
        }
        for batch in &plan.releases {
            for l in &batch.leaving {
                self.planner.mark_in_flight(&l.record_uid);
            }
            let cidrs: BTreeSet<String> = batch.leaving.iter().map(|l| l.cidr.clone()).collect();
            let policy = batch.leaving.first().map(|l| l.policy.clone()).unwrap_or_default();
            let result = self.writes.remove_entries(&batch.reservation, &cidrs).await;
            self.planner.mark_released(&batch.reservation, Timestamp::now());
            if let Err(e) = result {
                for l in &batch.leaving {
                    self.planner.clear_in_flight(&l.record_uid);
                }
                if let Some(e) = stop(e) {
                    return Err(e);
                }
                continue;
            }
            for l in &batch.leaving {
                match self.writes.finish_release(&l.record, &l.pod_uid, &batch.reservation).await {
                    Ok(RecordFate::Deleted | RecordFate::AlreadyGone) => {
                        self.released(&l.policy, l.reason, Some(l.due));
                        info!(ip = %l.cidr, reservation = %batch.reservation, reason = l.reason.as_str(), "released");
                    }
                    Ok(RecordFate::ReHeld) => {
                        self.planner.clear_in_flight(&l.record_uid);
                        info!(ip = %l.cidr, "re-held for another Pod meanwhile; entry written back");
                    }
                    Err(e) => {
                        self.planner.clear_in_flight(&l.record_uid);
                        self.failed(&policy, &e).await;
                        if let Some(e) = stop(e) {
                            return Err(e);
                        }
                    }
                }
            }
        }
        for d in &plan.drop_records {
            self.planner.mark_in_flight(&d.record_uid);
            match self.writes.drop_record(&d.record, &d.pod_uid).await {
                Ok(RecordFate::Deleted) => {
                    self.released(&d.policy, d.reason, d.due);
                    info!(record = %d.record, reason = d.reason.as_str(), "dropped a record whose entry was missing");
                }
                Ok(_) => self.planner.clear_in_flight(&d.record_uid),
                Err(e) => {
                    self.planner.clear_in_flight(&d.record_uid);
                    self.failed(&d.policy, &e).await;
                    if let Some(e) = stop(e) {
                        return Err(e);
                    }
                }
            }
        }
        let repairs = &self.engine.metrics.release.repairs;
        for w in &plan.write_back {
            match self.writes.write_back(&w.reservation, &w.policy, &w.cidr).await {
                Ok(()) => {
                    repairs.with_label_values(&["written_back"]).inc();
                    info!(record = %w.record, reservation = %w.reservation, "wrote a missing entry back");
                }
                Err(e) => {
                    self.failed(&w.policy, &e).await;
                    if let Some(e) = stop(e) {
                        return Err(e);
                    }
                }
            }
        }
        for a in &plan.adopt {
            let reserve_for =
                policies.get(&a.policy).map_or(self.planner.settings.default_reserve_for, |p| p.reserve_for);
            match self.writes.adopt(&a.reservation, &a.policy, &a.cidr, reserve_for).await {
                Ok(true) => {
                    repairs.with_label_values(&["adopted"]).inc();
                    info!(entry = %a.cidr, reservation = %a.reservation, "adopted an entry without a record");
                }
                Ok(false) => {}
                Err(e) => {
                    self.failed(&a.policy, &e).await;
                    if let Some(e) = stop(e) {
                        return Err(e);
                    }
                }
            }
        }
        for r in &plan.remove_entries {
            let all: BTreeSet<String> = r.garbage.iter().chain(&r.redundant).cloned().collect();
            match self.writes.remove_entries(&r.reservation, &all).await {
                Ok(removed) => {
                    let garbage = r.garbage.iter().filter(|g| removed.contains(*g)).count();
                    repairs.with_label_values(&["garbage_removed"]).inc_by(garbage as u64);
                    repairs.with_label_values(&["redundant_removed"]).inc_by((removed.len() - garbage) as u64);
                    if !r.redundant.is_empty() {
                        self.released(&r.policy, ReleaseReason::Repair, None);
                    }
                    warn!(reservation = %r.reservation, garbage = ?r.garbage, redundant = ?r.redundant, "removed entries no hold needs");
                }
                Err(e) => {
                    self.failed(&r.policy, &e).await;
                    if let Some(e) = stop(e) {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Holds selected Pods that terminate without having passed through the webhook.
    async fn safety_net(&mut self, records: &[Arc<ReservedIP>]) -> Result<Option<Timestamp>, ReleaseError> {
        const RETRY: Duration = Duration::from_secs(30);
        let now = Timestamp::now();
        let held: HashSet<(&str, String)> =
            records.iter().map(|r| (r.spec.pod.uid.as_str(), r.spec.ip.clone())).collect();
        // Only Pods on their way out are candidates: look at those without converting the rest.
        let ending = |p: &Pod| {
            p.metadata.deletion_timestamp.is_some()
                || matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
        };
        let all = self.views.pods.state();
        let leaving: Vec<PodFacts> = all.iter().filter(|p| ending(p)).map(|p| PodFacts::from_pod(p)).collect();
        let mut wake = None;
        let mut candidates = Vec::new();
        for facts in &leaving {
            let terminal = matches!(facts.phase.as_deref(), Some("Succeeded" | "Failed"));
            if facts.ips.is_empty() || facts.host_network || !(facts.deleting || terminal) {
                continue;
            }
            if facts.ips.iter().all(|ip| held.contains(&(facts.uid.as_str(), ip.to_string()))) {
                continue;
            }
            if self.engine.settings.excluded_namespaces.contains(&facts.namespace) {
                continue;
            }
            if let Some(tried) = self.netted.get(&facts.uid) {
                let again = tried.checked_add(k8s_openapi::jiff::SignedDuration::try_from(RETRY).unwrap()).unwrap();
                if again > now {
                    wake = Some(wake.map_or(again, |w: Timestamp| w.min(again)));
                    continue;
                }
            }
            let Some((ns_labels, ns_terminating)) = self.views.namespace(&facts.namespace) else { continue };
            let owner_gone = facts
                .controller
                .as_ref()
                .is_some_and(|(kind, name)| self.views.workload_exists(&facts.namespace, kind, name) == Some(false));
            let ctx = RequestContext {
                namespace_labels: &ns_labels,
                namespace_terminating: ns_terminating,
                by_garbage_collector: owner_gone,
            };
            if let Decision::Hold(plan) = self.engine.matcher.load().decide(facts, &ctx)
                && in_scope(&self.engine.settings.policy_prefix, &plan.policy.name)
            {
                candidates.push((facts.clone(), plan));
            }
        }
        self.netted.retain(|uid, _| leaving.iter().any(|p| &p.uid == uid));
        if candidates.is_empty() {
            return Ok(wake);
        }
        // Who has which IP now, to not reserve an address another Pod already got.
        let pods: Vec<PodFacts> = all.iter().map(|p| PodFacts::from_pod(p)).collect();
        let mut owners: HashMap<IpAddr, Vec<&PodFacts>> = HashMap::new();
        for p in &pods {
            for ip in &p.ips {
                owners.entry(*ip).or_default().push(p);
            }
        }
        for (mut facts, plan) in candidates {
            self.netted.insert(facts.uid.clone(), now);
            let policy = plan.policy.name.clone();
            let (lost, keep): (Vec<IpAddr>, Vec<IpAddr>) = facts.ips.iter().partition(|ip| {
                owners.get(ip).is_some_and(|ps| {
                    ps.iter().any(|o| {
                        o.uid != facts.uid && !o.deleting && !matches!(o.phase.as_deref(), Some("Succeeded" | "Failed"))
                    })
                })
            });
            let reference = pod_ref(&facts.namespace, &facts.name, &facts.uid);
            if !lost.is_empty() {
                self.engine
                    .metrics
                    .release
                    .safety_net_lost_races
                    .with_label_values(&[&policy])
                    .inc_by(lost.len() as u64);
                let ips = lost.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
                warn!(namespace = %facts.namespace, pod = %facts.name, ips, "safety net too late: the IP is already another Pod's");
                let note = format!(
                    "capo saw this Pod terminate without a hold, too late: {ips} already belongs to another Pod; not held"
                );
                self.event(&reference, EventType::Warning, "LateHoldLost", "Hold", note).await;
            }
            if keep.is_empty() {
                continue;
            }
            facts.ips = keep;
            self.writes_fence()?;
            let req = HoldRequest {
                policy: &policy,
                reserve_for: plan.reserve_for,
                pod: &facts,
                trigger: HoldTrigger::SafetyNet,
            };
            match self.store.hold(&req).await {
                Ok(held) => {
                    let new = held.iter().filter(|h| h.record != RecordOutcome::Kept).count();
                    if new > 0 {
                        self.engine.metrics.release.safety_net_holds.with_label_values(&[&policy]).inc_by(new as u64);
                        info!(namespace = %facts.namespace, pod = %facts.name, policy, "safety net held a Pod that terminated without a hold");
                    }
                }
                Err(errors) => {
                    let msg = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
                    self.engine.metrics.release.failures.with_label_values(&[&policy, "safety_net"]).inc();
                    warn!(namespace = %facts.namespace, pod = %facts.name, error = %msg, "safety net hold failed; retrying later");
                    self.event(&policy_ref(&policy), EventType::Warning, "SafetyNetHoldFailed", "Hold", msg).await;
                }
            }
        }
        Ok(wake)
    }

    fn writes_fence(&self) -> Result<(), ReleaseError> {
        self.writes.fence().check().map_err(ReleaseError::from)
    }
}
