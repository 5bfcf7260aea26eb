//! The one rule that decides whether a Pod on its way out is selected and should be held,
//! for the webhook (a DELETE or an eviction) and the safety net (a Pod seen leaving without
//! a hold) alike. They differ only in how they learn two facts: whether the garbage
//! collector is removing the Pod because its owner is going, and whether its namespace is
//! being deleted.

use crate::pod::PodFacts;
use crate::policy::{Decision, Matcher, RequestContext, SkipReason};
use crate::store::NamespaceFacts;
use crate::store::workloads::Owner;

/// The user the garbage collector deletes dependents as (kube-controller-manager with
/// `--use-service-account-credentials`, the default everywhere that matters).
pub const GARBAGE_COLLECTOR_USER: &str = "system:serviceaccount:kube-system:generic-garbage-collector";
/// The user the namespace controller deletes a terminating namespace's Pods as: a signal
/// that does not depend on the Namespace cache having caught up.
pub const NAMESPACE_CONTROLLER_USER: &str = "system:serviceaccount:kube-system:namespace-controller";

/// Who is taking the Pod away.
#[derive(Clone, Copy, Debug)]
pub enum Origin<'a> {
    /// A request the webhook reviews, by this user.
    Request { user: Option<&'a str> },
    /// The safety net saw the Pod leave; its controller is in this state.
    SafetyNet { owner: Owner },
}

/// Whether `pod` (in namespace `ns`) should be held, and how.
pub fn decide(
    matcher: &Matcher,
    pod: &PodFacts,
    ns: &NamespaceFacts,
    origin: Origin<'_>,
    excluded: &[String],
) -> Decision {
    if excluded.iter().any(|e| e == &pod.namespace) {
        return Decision::Skip(SkipReason::Excluded);
    }
    if let Some(what) = pod.hold_done() {
        return Decision::Skip(SkipReason::Done(what));
    }
    let (by_garbage_collector, by_namespace_controller) = match origin {
        // Whoever began the deletion was reviewed then (or the safety net has it): the
        // kubelet's final DELETE, by another user, must not undo that decision.
        Origin::Request { .. } if pod.deleting => return Decision::Skip(SkipReason::AlreadyDeleting),
        Origin::Request { user } => (user == Some(GARBAGE_COLLECTOR_USER), user == Some(NAMESPACE_CONTROLLER_USER)),
        // A foreground cascade deletes the Pods while their owner still exists, marked for
        // deletion: the owner is going either way.
        Origin::SafetyNet { owner } => (matches!(owner, Owner::Gone | Owner::Deleting), false),
    };
    let ctx = RequestContext {
        namespace_labels: &ns.labels,
        namespace_terminating: ns.terminating || by_namespace_controller,
        by_garbage_collector,
    };
    matcher.decide(pod, &ctx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::CompiledPolicy;
    use serde_json::json;

    fn matcher() -> Matcher {
        let p: capo_api::CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": {"name": "p"},
            "spec": {"podSelector": {"matchLabels": {"app": "redis"}}},
        }))
        .unwrap();
        Matcher::new([CompiledPolicy::compile(&p).unwrap()])
    }

    fn pod(annotations: serde_json::Value) -> PodFacts {
        PodFacts::from_json(&json!({
            "metadata": {"name": "redis-0", "namespace": "shop", "uid": "u-1", "labels": {"app": "redis"},
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "redis", "uid": "o", "controller": true}]},
            "status": {"podIPs": [{"ip": "10.0.0.9"}]}
        }))
        .unwrap()
    }

    fn ns() -> NamespaceFacts {
        NamespaceFacts::from_meta("shop", None, false)
    }

    fn skipped(d: Decision) -> Option<&'static str> {
        match d {
            Decision::Skip(r) => Some(r.as_str()),
            Decision::Hold(_) => None,
        }
    }

    #[test]
    fn the_webhook_and_the_safety_net_agree_on_a_cascade() {
        let m = matcher();
        let p = pod(json!({}));
        let gc = Origin::Request { user: Some(GARBAGE_COLLECTOR_USER) };
        assert_eq!(skipped(decide(&m, &p, &ns(), gc, &[])), Some("owner_deleted"));
        for owner in [Owner::Deleting, Owner::Gone] {
            assert_eq!(skipped(decide(&m, &p, &ns(), Origin::SafetyNet { owner }, &[])), Some("owner_deleted"));
        }
        for owner in [Owner::Present, Owner::Unknown] {
            assert_eq!(skipped(decide(&m, &p, &ns(), Origin::SafetyNet { owner }, &[])), None);
        }
        assert_eq!(skipped(decide(&m, &p, &ns(), Origin::Request { user: Some("alice") }, &[])), None);
        // The kubelet's final DELETE of a Pod the garbage collector began deleting.
        let mut deleting = p.clone();
        deleting.deleting = true;
        let kubelet = Origin::Request { user: Some("system:node:n1") };
        assert_eq!(skipped(decide(&m, &deleting, &ns(), kubelet, &[])), Some("already_deleting"));
    }

    #[test]
    fn a_pod_capo_is_done_with_is_never_held_again_but_a_copied_mark_does_not_count() {
        let m = matcher();
        let origin = Origin::Request { user: None };
        let released = pod(json!({"capo.io/released": "u-1 ttl 2026-11-23T10:00:00Z"}));
        assert_eq!(skipped(decide(&m, &released, &ns(), origin, &[])), Some("released_before"));
        let taken = pod(json!({"capo.io/not-held": "u-1 10.0.0.9 2026-11-23T10:00:00Z"}));
        assert_eq!(skipped(decide(&m, &taken, &ns(), origin, &[])), Some("taken_before"));
        let copied = pod(json!({"capo.io/released": "u-other ttl 2026-11-23T10:00:00Z"}));
        assert_eq!(skipped(decide(&m, &copied, &ns(), origin, &[])), None);
        assert_eq!(skipped(decide(&m, &pod(json!({})), &ns(), origin, &["shop".into()])), Some("excluded"));
    }
}
