//! One `CapoPolicy` checked and turned into the form the matcher evaluates.

use std::time::Duration;

use capo_api::policy::{CapoPolicySpec, SkipRules, WorkloadRef};
use capo_api::selector::SelectorError;
use capo_api::{CapoPolicy, DurationError, HoldFailureAction, LabelSelector, ReleaseEarly};
use kube::ResourceExt;

#[derive(Clone, Debug, PartialEq)]
pub struct CompiledPolicy {
    pub name: String,
    /// The CapoPolicy's UID: Events about it name it, so `kubectl describe` shows them.
    pub uid: Option<String>,
    pub generation: Option<i64>,
    pub namespace_selector: Option<LabelSelector>,
    pub pod_selector: Option<LabelSelector>,
    pub workloads: Option<Vec<WorkloadRef>>,
    pub reserve_for: Duration,
    pub max_reserved: u32,
    /// The most holds for the Pods of one namespace (`maxReservedPerNamespace`).
    pub max_reserved_per_namespace: Option<u32>,
    /// The most of a pool's unused addresses this policy holds, in percent (`maxPoolShare`).
    pub max_pool_share: Option<u32>,
    pub release_interval: Duration,
    pub priority: i32,
    pub on_hold_failure: HoldFailureAction,
    pub skip: SkipRules,
    pub release_early: ReleaseEarly,
    /// The most TTL releases per `release_interval` (cap releases are never held back).
    pub release_batch: u32,
    pub allow_opt_in: bool,
    /// Bounds of a Pod's `capo.io/reserve-for`; `None` when the policy allows no override.
    pub reserve_for_bounds: Option<(Duration, Duration)>,
    /// Sticky IPs: `Some(fallbackAfter)` when the policy hands held addresses back.
    pub sticky: Option<Duration>,
}

/// Why a policy cannot be used; shown as the reason of its `Ready=False` condition.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    #[error("spec.{field}: {source}")]
    Duration { field: &'static str, source: DurationError },
    #[error("spec.{field}.{source}")]
    Selector { field: &'static str, source: SelectorError },
    #[error("spec.{field} must be at least {min}")]
    TooShort { field: &'static str, min: &'static str },
    #[error("spec.maxReserved must be at least 1")]
    ZeroMaxReserved,
    #[error("spec.podOverrides.minReserveFor ({min}) exceeds maxReserveFor ({max})")]
    InvertedBounds { min: String, max: String },
    #[error("a policy must select something: set namespaceSelector, podSelector or workloads")]
    SelectsNothing,
    #[error(
        "the policy name {0:?} is too long: capo labels its IPReservations and records with it (capo.io/policy), and a label value is at most {MAX_NAME} characters"
    )]
    NameTooLong(String),
}

/// The longest policy name: the value of the `capo.io/policy` label on every reservation
/// and record of the policy (the CRD refuses longer ones at apply; one created before
/// that rule is `Ready=False`, so it can never make a hold write fail).
pub const MAX_NAME: usize = 63;

impl PolicyError {
    /// The condition reason (CamelCase, as Kubernetes conventions ask).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Duration { .. } => "InvalidDuration",
            Self::Selector { .. } => "InvalidSelector",
            Self::TooShort { .. } => "InvalidDuration",
            Self::ZeroMaxReserved => "InvalidMaxReserved",
            Self::InvertedBounds { .. } => "InvalidOverrideBounds",
            Self::SelectsNothing => "SelectsNothing",
            Self::NameTooLong(_) => "NameTooLong",
        }
    }
}

fn duration(field: &'static str, raw: &str) -> Result<Duration, PolicyError> {
    raw.parse::<capo_api::Duration>().map(|d| d.as_std()).map_err(|source| PolicyError::Duration { field, source })
}

fn selector(field: &'static str, sel: &Option<LabelSelector>) -> Result<(), PolicyError> {
    match sel {
        Some(s) => s.validate().map_err(|source| PolicyError::Selector { field, source }),
        None => Ok(()),
    }
}

impl CompiledPolicy {
    /// Checks everything the CRD schema checks, for a policy that slipped past it.
    pub fn compile(policy: &CapoPolicy) -> Result<Self, PolicyError> {
        let name = policy.name_any();
        let spec: &CapoPolicySpec = &policy.spec;
        // A label value (and so the shards' names, capo-<name>.<shard>, well within 253).
        if name.len() > MAX_NAME {
            return Err(PolicyError::NameTooLong(name));
        }
        if spec.namespace_selector.is_none() && spec.pod_selector.is_none() && spec.workloads.is_none() {
            return Err(PolicyError::SelectsNothing);
        }
        selector("namespaceSelector", &spec.namespace_selector)?;
        selector("podSelector", &spec.pod_selector)?;
        let reserve_for = duration("reserveFor", &spec.reserve_for)?;
        if reserve_for < Duration::from_secs(1) {
            return Err(PolicyError::TooShort { field: "reserveFor", min: "1s" });
        }
        let release_interval = duration("releaseInterval", &spec.release_interval)?;
        if spec.max_reserved == 0 {
            return Err(PolicyError::ZeroMaxReserved);
        }
        let o = &spec.pod_overrides;
        let min = o.min_reserve_for.as_deref().map(|m| duration("podOverrides.minReserveFor", m)).transpose()?;
        let max = o.max_reserve_for.as_deref().map(|m| duration("podOverrides.maxReserveFor", m)).transpose()?;
        let reserve_for_bounds = match (min, max) {
            (None, None) => None,
            (min, max) => {
                let (min, max) = (min.unwrap_or(Duration::from_secs(1)), max.unwrap_or(Duration::MAX));
                if min > max {
                    return Err(PolicyError::InvertedBounds {
                        min: o.min_reserve_for.clone().unwrap_or_default(),
                        max: o.max_reserve_for.clone().unwrap_or_default(),
                    });
                }
                Some((min, max))
            }
        };
        let sticky = if spec.sticky.enabled {
            let after = duration("sticky.fallbackAfter", &spec.sticky.fallback_after)?;
            if after < Duration::from_secs(5) {
                return Err(PolicyError::TooShort { field: "sticky.fallbackAfter", min: "5s" });
            }
            Some(after)
        } else {
            None
        };
        Ok(Self {
            name,
            uid: policy.metadata.uid.clone(),
            generation: policy.metadata.generation,
            namespace_selector: spec.namespace_selector.clone(),
            pod_selector: spec.pod_selector.clone(),
            workloads: spec.workloads.clone(),
            reserve_for,
            max_reserved: spec.max_reserved,
            max_reserved_per_namespace: spec.max_reserved_per_namespace,
            max_pool_share: spec.max_pool_share.map(|s| s.clamp(1, 100)),
            release_interval,
            priority: spec.priority,
            on_hold_failure: spec.on_hold_failure,
            skip: spec.skip.clone(),
            release_early: spec.release_early.clone(),
            release_batch: spec.release_batch.max(1),
            allow_opt_in: o.allow_opt_in,
            reserve_for_bounds,
            sticky,
        })
    }

    pub fn reservation_name(&self) -> String {
        capo_api::keys::reservation_name(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(crate) fn policy(name: &str, spec: serde_json::Value) -> CapoPolicy {
        serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy",
            "metadata": {"name": name, "generation": 3},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn defaults_compile_to_the_original_settings() {
        let c = CompiledPolicy::compile(&policy("p", json!({"podSelector": {}}))).unwrap();
        assert_eq!(c.reserve_for, Duration::from_secs(40 * 60));
        assert_eq!(c.max_reserved, 300);
        assert_eq!(c.release_interval, Duration::from_secs(5));
        assert_eq!(c.on_hold_failure, HoldFailureAction::Deny);
        assert!(!c.allow_opt_in, "opt-in by annotation is off unless a policy allows it");
        assert!(c.skip.namespace_terminating && c.skip.owner_deleted);
        assert_eq!(c.max_reserved_per_namespace, None);
        assert_eq!(c.reserve_for_bounds, None);
        assert_eq!(c.generation, Some(3));
        assert_eq!(c.reservation_name(), "capo-p");
    }

    #[test]
    fn invalid_policies_say_what_is_wrong() {
        let cases = [
            (json!({"podSelector": {}, "reserveFor": "forever"}), "InvalidDuration", "spec.reserveFor"),
            (json!({"podSelector": {}, "reserveFor": "0s"}), "InvalidDuration", "at least 1s"),
            (json!({}), "SelectsNothing", "must select something"),
            (
                json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}),
                "InvalidSelector",
                "spec.podSelector.matchExpressions[0]",
            ),
            (
                json!({"podSelector": {}, "podOverrides": {"minReserveFor": "2h", "maxReserveFor": "1h"}}),
                "InvalidOverrideBounds",
                "exceeds",
            ),
            (json!({"podSelector": {}, "maxReserved": 0}), "InvalidMaxReserved", "maxReserved"),
        ];
        for (spec, reason, text) in cases {
            let err = CompiledPolicy::compile(&policy("p", spec.clone())).unwrap_err();
            assert_eq!(err.reason(), reason, "{spec}");
            assert!(err.to_string().contains(text), "{spec}: {err}");
        }
    }

    /// Invariant 10: a name that cannot be a label value would make every hold write fail
    /// (the API server refuses the label). 63 compiles; 64 and 253 are NameTooLong.
    #[test]
    fn a_name_that_cannot_be_a_label_value_is_not_ready() {
        assert!(CompiledPolicy::compile(&policy(&"a".repeat(63), json!({"podSelector": {}}))).is_ok());
        for len in [64, 253] {
            let err = CompiledPolicy::compile(&policy(&"a".repeat(len), json!({"podSelector": {}}))).unwrap_err();
            assert_eq!(err.reason(), "NameTooLong", "{len}");
            assert!(err.to_string().contains("at most 63"), "{err}");
        }
    }

    #[test]
    fn override_bounds_fill_in_an_open_end() {
        let c =
            CompiledPolicy::compile(&policy("p", json!({"podSelector": {}, "podOverrides": {"maxReserveFor": "2h"}})))
                .unwrap();
        assert_eq!(c.reserve_for_bounds, Some((Duration::from_secs(1), Duration::from_secs(7200))));
    }
}
