//! Watches CapoPolicies, recompiles the matcher on every change and swaps it in
//! atomically, and reports each policy's health in its status.

use std::collections::BTreeMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use capo_api::CapoPolicy;
use capo_api::policy::{CapoPolicyStatus, READY_CONDITION};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
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
}

impl PolicyController {
    pub fn new(
        client: Client,
        matcher: SharedMatcher,
        readiness: Arc<Readiness>,
        metrics: Arc<Metrics>,
        field_manager: String,
        status_fence: Option<Fence>,
    ) -> Self {
        Self { client, matcher, readiness, metrics, field_manager, status_fence }
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

    pub async fn run(self) {
        let api = Api::<CapoPolicy>::all(self.client.clone());
        let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut policies: BTreeMap<String, CapoPolicy> = BTreeMap::new();
        let mut listing: BTreeMap<String, CapoPolicy> = BTreeMap::new();
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
                        self.rebuild(&policies).await;
                    }
                    continue;
                }
            };
            match event {
                Ok(watcher::Event::Init) => listing.clear(),
                Ok(watcher::Event::InitApply(p)) => {
                    listing.insert(p.name_any(), p);
                }
                Ok(watcher::Event::InitDone) => {
                    policies = std::mem::take(&mut listing);
                    self.rebuild(&policies).await;
                }
                Ok(watcher::Event::Apply(p)) => {
                    policies.insert(p.name_any(), p);
                    self.rebuild(&policies).await;
                }
                Ok(watcher::Event::Delete(p)) => {
                    // The policy's held IPs stay held: release is the leader's job, on
                    // schedule (a deleted policy never releases early by itself).
                    policies.remove(&p.name_any());
                    self.rebuild(&policies).await;
                }
                Err(e) => warn!(error = %e, "watching CapoPolicies failed; retrying"),
            }
        }
    }

    async fn rebuild(&self, policies: &BTreeMap<String, CapoPolicy>) {
        let mut usable = Vec::new();
        let mut statuses = Vec::new();
        for policy in policies.values() {
            let compiled = CompiledPolicy::compile(policy);
            statuses.push((policy, desired_condition(policy, compiled.as_ref().err())));
            match compiled {
                Ok(c) => usable.push(c),
                Err(e) => {
                    warn!(policy = %policy.name_any(), error = %e, "CapoPolicy is invalid; ignoring it")
                }
            }
        }
        let (ready, invalid) = (usable.len(), policies.len() - usable.len());
        let matcher = Matcher::new(usable);
        info!(ready, invalid, order = ?matcher.policies().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), "policies loaded");
        self.matcher.store(Arc::new(matcher));
        self.metrics.policies.with_label_values(&["ready"]).set(ready as i64);
        self.metrics.policies.with_label_values(&["invalid"]).set(invalid as i64);
        self.readiness.set_policies_synced();
        for (policy, condition) in statuses {
            self.update_status(policy, condition).await;
        }
    }

    async fn update_status(&self, policy: &CapoPolicy, mut condition: Condition) {
        if self.status_fence.as_ref().is_some_and(|f| !f.is_leader()) {
            return;
        }
        let current = policy.status.clone().unwrap_or_default();
        let existing = current.condition(READY_CONDITION);
        let generation = policy.metadata.generation;
        if let Some(old) = existing
            && old.status == condition.status
            && old.reason == condition.reason
            && old.message == condition.message
        {
            if current.observed_generation == generation && old.observed_generation == generation {
                return;
            }
            condition.last_transition_time = old.last_transition_time.clone();
        }
        let status = CapoPolicyStatus { observed_generation: generation, conditions: vec![condition] };
        let api = Api::<CapoPolicy>::all(self.client.clone());
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        let name = policy.name_any();
        if let Err(e) = api.patch_status(&name, &PatchParams::apply(&self.field_manager), &patch).await {
            warn!(policy = %name, error = %e, "could not update CapoPolicy status");
        }
    }
}

fn desired_condition(policy: &CapoPolicy, error: Option<&PolicyError>) -> Condition {
    let (status, reason, message) = match error {
        None => ("True", "Compiled", "the policy is loaded and in use".to_string()),
        Some(e) => ("False", e.reason(), format!("{e}; capo ignores this policy until it is fixed")),
    };
    Condition {
        type_: READY_CONDITION.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: policy.metadata.generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}
