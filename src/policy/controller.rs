//! Watches CapoPolicies, recompiles the matcher on every change and swaps it in
//! atomically, and reports each policy's health in its status.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::store::Guarded;
use arc_swap::ArcSwap;
use capo_api::CapoPolicy;
use capo_api::policy::{CapoPolicyStatus, READY_CONDITION};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::core::error_boundary::InvalidObject;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tracing::{info, warn};

use super::{CompiledPolicy, Matcher, PolicyError};
use crate::health::Readiness;
use crate::leader::Fence;
use crate::metrics::Metrics;

/// The matcher the admission path reads: a lock-free pointer swap per policy change.
pub type SharedMatcher = Arc<ArcSwap<Matcher>>;

pub struct PolicyController {
    client: Client,
    matcher: SharedMatcher,
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    field_manager: String,
    /// Only the leader writes policy status; `None`: this process always does.
    status_fence: Option<Fence>,
    /// What this replica last wrote per policy: (generation, status, reason, message).
    written: HashMap<String, (Option<i64>, String, String, String)>,
    /// Told whenever the matcher is swapped.
    changes: tokio::sync::broadcast::Sender<()>,
}

impl PolicyController {
    pub fn new(
        client: Client,
        matcher: SharedMatcher,
        readiness: Arc<Readiness>,
        metrics: Arc<Metrics>,
        field_manager: String,
        status_fence: Option<Fence>,
        changes: tokio::sync::broadcast::Sender<()>,
    ) -> Self {
        Self { client, matcher, readiness, metrics, field_manager, status_fence, written: HashMap::new(), changes }
    }

    /// Resolves when this replica becomes (or stops being) the leader; never without a fence.
    async fn leadership_changed(fence: &mut Option<Fence>, leading: &mut bool) {
        match fence {
            None => std::future::pending().await,
            Some(f) if *leading => f.lost().await,
            Some(f) => f.acquired().await,
        }
        *leading = !*leading;
    }

    pub async fn run(mut self) {
        // One object that does not deserialize must not stall the others: each arrives as
        // its own Ok or Err.
        let api = Api::<Guarded<CapoPolicy>>::all(self.client.clone());
        let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut policies: BTreeMap<String, Entry> = BTreeMap::new();
        let mut listing: BTreeMap<String, Entry> = BTreeMap::new();
        let mut fence = self.status_fence.clone();
        let mut leading = false;
        loop {
            let event = tokio::select! {
                event = events.next() => match event {
                    Some(e) => e,
                    None => return,
                },
                _ = Self::leadership_changed(&mut fence, &mut leading) => {
                    if leading {
                        // A new leader brings every policy's status up to date.
                        self.written.clear();
                        self.write_statuses(policies.values()).await;
                    }
                    continue;
                }
            };
            match &event {
                Ok(_) => self.readiness.watch_ok("policies"),
                Err(_) => self.readiness.watch_failed("policies"),
            }
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(p)) => {
                    listing.insert(entry_name(&p.0), p.0);
                }
                Ok(watcher::Event::InitDone) => {
                    policies = std::mem::take(&mut listing);
                    self.rebuild(&policies);
                    self.write_statuses(policies.values()).await;
                }
                Ok(watcher::Event::Apply(p)) => {
                    self.metrics.policy_events.inc();
                    let name = entry_name(&p.0);
                    // Status writes come back as events too: only a new generation (or a
                    // policy that turns valid or invalid) changes the matcher, and only this
                    // policy's status is looked at.
                    let changed = policies.get(&name).is_none_or(|old| {
                        entry_generation(old) != entry_generation(&p.0) || old.is_ok() != p.0.is_ok()
                    });
                    policies.insert(name.clone(), p.0);
                    if changed {
                        self.rebuild(&policies);
                    }
                    self.write_statuses(policies.get(&name)).await;
                }
                Ok(watcher::Event::Delete(p)) => {
                    self.metrics.policy_events.inc();
                    // The policy's held IPs stay held: release is the leader's job, on
                    // schedule (a deleted policy never releases early by itself).
                    let name = entry_name(&p.0);
                    policies.remove(&name);
                    self.written.remove(&name);
                    self.rebuild(&policies);
                }
                Err(e) => warn!(error = %e, "watching CapoPolicies failed; retrying"),
            }
        }
    }

    /// Compiles every valid policy and swaps the matcher in.
    fn rebuild(&self, policies: &BTreeMap<String, Entry>) {
        let mut usable = Vec::new();
        for entry in policies.values() {
            match entry.as_ref().map(CompiledPolicy::compile) {
                Ok(Ok(c)) => usable.push(c),
                Ok(Err(e)) => warn!(policy = %entry_name(entry), error = %e, "CapoPolicy is invalid; ignoring it"),
                Err(e) => warn!(policy = %entry_name(entry), error = %e, "CapoPolicy is malformed; ignoring it"),
            }
        }
        let (ready, invalid) = (usable.len(), policies.len() - usable.len());
        let matcher = Matcher::new(usable);
        info!(ready, invalid, order = ?matcher.policies().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), "policies loaded");
        self.matcher.store(Arc::new(matcher));
        let _ = self.changes.send(());
        self.metrics.policies.with_label_values(&["ready"]).set(ready as i64);
        self.metrics.policies.with_label_values(&["invalid"]).set(invalid as i64);
        self.readiness.set_policies_synced();
    }

    async fn write_statuses<'a>(&mut self, entries: impl IntoIterator<Item = &'a Entry>) {
        for entry in entries {
            let condition = match entry {
                Ok(p) => desired_condition(p.metadata.generation, CompiledPolicy::compile(p).err().as_ref()),
                Err(e) => malformed_condition(e),
            };
            self.update_status(entry, condition).await;
        }
    }

    /// Writes the policy's status if it differs from what the object (or, for a policy
    /// capo cannot read, this replica's last write) says.
    async fn update_status(&mut self, entry: &Entry, mut condition: Condition) {
        if self.status_fence.as_ref().is_some_and(|f| !f.is_leader()) {
            return;
        }
        let name = entry_name(entry);
        let generation = entry_generation(entry);
        let key = (generation, condition.status.clone(), condition.reason.clone(), condition.message.clone());
        if self.written.get(&name) == Some(&key) {
            return;
        }
        let current = entry.as_ref().ok().and_then(|p| p.status.clone()).unwrap_or_default();
        if let Some(old) = current.condition(READY_CONDITION)
            && old.status == condition.status
            && old.reason == condition.reason
            && old.message == condition.message
        {
            if current.observed_generation == generation && old.observed_generation == generation {
                self.written.insert(name, key);
                return;
            }
            condition.last_transition_time = old.last_transition_time.clone();
        }
        let status = CapoPolicyStatus { observed_generation: generation, conditions: vec![condition] };
        let api = Api::<CapoPolicy>::all(self.client.clone());
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        match api.patch_status(&name, &PatchParams::apply(&self.field_manager), &patch).await {
            Ok(_) => {
                self.metrics.policy_status_writes.inc();
                self.written.insert(name, key);
            }
            Err(e) => warn!(policy = %name, error = %e, "could not update CapoPolicy status"),
        }
    }
}

/// A CapoPolicy as watched: the object, or why it could not be read as one.
type Entry = Result<CapoPolicy, InvalidObject>;

fn entry_name(entry: &Entry) -> String {
    match entry {
        Ok(p) => p.name_any(),
        Err(e) => e.metadata.name.clone().unwrap_or_default(),
    }
}

fn entry_generation(entry: &Entry) -> Option<i64> {
    match entry {
        Ok(p) => p.metadata.generation,
        Err(e) => e.metadata.generation,
    }
}

fn malformed_condition(e: &InvalidObject) -> Condition {
    Condition {
        type_: READY_CONDITION.to_string(),
        status: "False".into(),
        reason: "Malformed".into(),
        message: format!("capo cannot read this CapoPolicy: {}; capo ignores it until it is fixed", e.error),
        observed_generation: e.metadata.generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}

fn desired_condition(generation: Option<i64>, error: Option<&PolicyError>) -> Condition {
    let (status, reason, message) = match error {
        None => ("True", "Compiled", "the policy is loaded and in use".to_string()),
        Some(e) => ("False", e.reason(), format!("{e}; capo ignores this policy until it is fixed")),
    };
    Condition {
        type_: READY_CONDITION.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}
