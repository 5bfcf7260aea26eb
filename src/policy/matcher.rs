//! Which policy, if any, holds a Pod's IPs: evaluated in memory on the admission path.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use capo_api::keys::{HOLD_ANNOTATION, POLICY_ANNOTATION, RESERVE_FOR_ANNOTATION};
use capo_api::policy::{WorkloadKind, WorkloadRef};

use super::CompiledPolicy;
use crate::pod::{PodFacts, Unholdable};

/// The usable policies, highest priority first (ties: name ascending).
#[derive(Clone, Debug, Default)]
pub struct Matcher {
    policies: Vec<Arc<CompiledPolicy>>,
}

/// What the matcher needs to know besides the Pod.
pub struct RequestContext<'a> {
    pub namespace_labels: &'a BTreeMap<String, String>,
    pub namespace_terminating: bool,
    /// The request comes from the garbage collector: the Pod's owner was deleted.
    pub by_garbage_collector: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Skip(SkipReason),
    Hold(HoldPlan),
}

#[derive(Clone, Debug, PartialEq)]
pub struct HoldPlan {
    pub policy: Arc<CompiledPolicy>,
    pub reserve_for: Duration,
    /// Shown to the client (e.g. an override outside the policy's bounds).
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// kube-system, capo's own namespace, or another the operator excluded.
    Excluded,
    /// A DELETE that finishes a deletion already under way (the kubelet's last one): the
    /// deletion was reviewed when it began, and one that began unreviewed is the safety
    /// net's.
    AlreadyDeleting,
    /// capo already released this Pod's hold while the Pod stayed, or found its IPs taken
    /// (`capo.io/released`, `capo.io/not-held`): a hold belongs to one Pod UID, once.
    Done(&'static str),
    NoIps,
    HostNetwork,
    OptedOut,
    /// A KubeVirt VM's launcher Pod ([`PodFacts::is_kubevirt_vm`]): Calico keeps its
    /// address for the VM.
    KubeVirtVm,
    NotSelected,
    NamespaceTerminating {
        policy: String,
    },
    OwnerDeleted {
        policy: String,
    },
}

/// One policy's view of a Pod ([`Matcher::consider`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Consideration {
    pub policy: String,
    pub priority: i32,
    /// Its `namespaceSelector` takes the Pod's namespace (or it has none).
    pub covers_namespace: bool,
    /// Its `podSelector` and `workloads` take the Pod (or it has neither).
    pub selects: bool,
    pub opt_in: OptIn,
}

/// Whether the Pod asks this policy to hold it by annotation, and may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub enum OptIn {
    /// No `capo.io/policy` naming it, no `capo.io/hold: "true"`.
    NotAsked,
    /// Named by `capo.io/policy`, and the policy allows opt-in.
    Named,
    /// `capo.io/hold: "true"` without a name, and the policy allows opt-in.
    Hold,
    /// Asked, but the policy does not set `podOverrides.allowOptIn`.
    NotAllowed,
}

impl SkipReason {
    /// Why, in a sentence for an operator (`capo explain`).
    pub fn describe(&self) -> String {
        match self {
            Self::Excluded => "its namespace is excluded (kube-system, capo's own, --excluded-namespaces)".into(),
            Self::AlreadyDeleting => "its deletion is already under way: it was decided when the deletion began".into(),
            Self::Done("released") => "capo released its hold already while the Pod stayed (capo.io/released)".into(),
            Self::Done(_) => "capo found its addresses taken before (capo.io/not-held)".into(),
            Self::NoIps => "it has no address yet".into(),
            Self::HostNetwork => "it uses the node's network: its address is the node's".into(),
            Self::OptedOut => "it opts out (capo.io/hold: \"false\")".into(),
            Self::KubeVirtVm => "it is a KubeVirt VM's launcher: Calico keeps the VM's address itself".into(),
            Self::NotSelected => "no policy selects it".into(),
            Self::NamespaceTerminating { policy } => {
                format!(
                    "its namespace is being deleted, and policy {policy} skips such Pods (skip.namespaceTerminating)"
                )
            }
            Self::OwnerDeleted { policy } => {
                format!("its owner is being deleted, and policy {policy} skips such Pods (skip.ownerDeleted)")
            }
        }
    }

    /// A short label for metrics and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Excluded => "excluded",
            Self::AlreadyDeleting => "already_deleting",
            Self::Done("released") => "released_before",
            Self::Done(_) => "taken_before",
            Self::NoIps => "no_ips",
            Self::HostNetwork => "host_network",
            Self::OptedOut => "opted_out",
            Self::KubeVirtVm => "kubevirt_vm",
            Self::NotSelected => "not_selected",
            Self::NamespaceTerminating { .. } => "namespace_terminating",
            Self::OwnerDeleted { .. } => "owner_deleted",
        }
    }
}

impl Matcher {
    pub fn new(policies: impl IntoIterator<Item = CompiledPolicy>) -> Self {
        let mut policies: Vec<Arc<CompiledPolicy>> = policies.into_iter().map(Arc::new).collect();
        policies.sort_by(|a, b| b.priority.cmp(&a.priority).then_with(|| a.name.cmp(&b.name)));
        Self { policies }
    }

    pub fn policies(&self) -> &[Arc<CompiledPolicy>] {
        &self.policies
    }

    pub fn get(&self, name: &str) -> Option<&Arc<CompiledPolicy>> {
        self.policies.iter().find(|p| p.name == name)
    }

    pub fn decide(&self, pod: &PodFacts, ctx: &RequestContext<'_>) -> Decision {
        match pod.unholdable() {
            Some(Unholdable::NoIps) => return Decision::Skip(SkipReason::NoIps),
            Some(Unholdable::HostNetwork) => return Decision::Skip(SkipReason::HostNetwork),
            Some(Unholdable::OptedOut) => return Decision::Skip(SkipReason::OptedOut),
            None => {}
        }
        if pod.is_kubevirt_vm() {
            return Decision::Skip(SkipReason::KubeVirtVm);
        }
        let hold = pod.annotations.get(HOLD_ANNOTATION).map(String::as_str);
        let mut warnings = Vec::new();
        let Some(policy) = self.choose(pod, ctx, hold == Some("true"), &mut warnings) else {
            return Decision::Skip(SkipReason::NotSelected);
        };
        if policy.skip.namespace_terminating && ctx.namespace_terminating {
            return Decision::Skip(SkipReason::NamespaceTerminating { policy: policy.name.clone() });
        }
        if policy.skip.owner_deleted && ctx.by_garbage_collector {
            return Decision::Skip(SkipReason::OwnerDeleted { policy: policy.name.clone() });
        }
        let reserve_for = reserve_for(pod, policy, &mut warnings);
        Decision::Hold(HoldPlan { policy: policy.clone(), reserve_for, warnings })
    }

    /// Whether a policy with sticky IPs may select `pod` (created, so without addresses):
    /// through its selectors, or an opt-in by annotation. `namespace_labels` `None` (not
    /// cached): any namespace. A superset of [`Self::decide`]'s choice, for the sticky
    /// webhook to answer at once, without a read, for a Pod no sticky policy holds.
    pub fn sticky_may_select(&self, pod: &PodFacts, namespace_labels: Option<&BTreeMap<String, String>>) -> bool {
        let named = pod.annotations.get(POLICY_ANNOTATION);
        let opt_in = pod.annotations.get(HOLD_ANNOTATION).is_some_and(|v| v == "true");
        self.policies.iter().filter(|p| p.sticky.is_some()).any(|p| {
            let by_opt_in = p.allow_opt_in && (named == Some(&p.name) || (opt_in && named.is_none()));
            namespace_labels.is_none_or(|l| covers(p, l)) && (by_opt_in || selects(p, pod))
        })
    }

    /// How each policy, in the order [`Self::decide`] tries them, sees `pod` in a namespace
    /// with these labels: the same tests `decide` makes, one by one (`capo explain`).
    pub fn consider(&self, pod: &PodFacts, namespace_labels: &BTreeMap<String, String>) -> Vec<Consideration> {
        let named = pod.annotations.get(POLICY_ANNOTATION);
        let hold = pod.annotations.get(HOLD_ANNOTATION).is_some_and(|v| v == "true");
        self.policies
            .iter()
            .map(|p| {
                let opt_in = match (named, hold) {
                    (Some(n), _) if *n == p.name && p.allow_opt_in => OptIn::Named,
                    (Some(n), _) if *n == p.name => OptIn::NotAllowed,
                    (None, true) if p.allow_opt_in => OptIn::Hold,
                    (None, true) => OptIn::NotAllowed,
                    _ => OptIn::NotAsked,
                };
                Consideration {
                    policy: p.name.clone(),
                    priority: p.priority,
                    covers_namespace: covers(p, namespace_labels),
                    selects: selects(p, pod),
                    opt_in,
                }
            })
            .collect()
    }

    /// Why `pod`, skipped for `reason`, is not held, in the words a dry-run deletion shows:
    /// empty when no policy comes near it (a deletion nobody meant to be held says nothing).
    /// For a Pod no policy selects, each policy that fails one test only: its namespace
    /// selector, or an opt-in that is not allowed or not asked; for a Pod some policy takes
    /// but that is skipped anyway, the reason.
    pub fn why_not(
        &self,
        reason: &SkipReason,
        pod: &PodFacts,
        namespace_labels: &BTreeMap<String, String>,
    ) -> Vec<String> {
        let views = self.consider(pod, namespace_labels);
        let ns = &pod.namespace;
        let mut said = Vec::new();
        if let Some(name) = pod.annotations.get(POLICY_ANNOTATION)
            && self.get(name).is_none()
        {
            said.push(format!("{POLICY_ANNOTATION} names {name}, which is not loaded (not applied, or not Ready)"));
        }
        if *reason != SkipReason::NotSelected {
            let taken = views
                .iter()
                .any(|c| c.covers_namespace && (c.selects || matches!(c.opt_in, OptIn::Named | OptIn::Hold)));
            let chosen = matches!(reason, SkipReason::NamespaceTerminating { .. } | SkipReason::OwnerDeleted { .. });
            if taken || chosen || matches!(reason, SkipReason::Done(_) | SkipReason::AlreadyDeleting) {
                said.push(reason.describe());
            }
            return said;
        }
        for c in &views {
            let p = &c.policy;
            let allows = self.get(p).is_some_and(|p| p.allow_opt_in);
            match (c.covers_namespace, c.selects, c.opt_in) {
                (false, true, _) | (false, _, OptIn::Named | OptIn::Hold) => said.push(format!(
                    "policy {p} selects this Pod but not its namespace {ns} (namespaceSelector: is the namespace labelled?)"
                )),
                (true, false, OptIn::NotAllowed) => said.push(format!(
                    "this Pod asks policy {p} to hold it by annotation, but the policy allows no opt-in (podOverrides.allowOptIn)"
                )),
                (true, false, OptIn::NotAsked) if allows => said.push(format!(
                    "policy {p} covers namespace {ns} and allows opt-in: annotate the Pod {POLICY_ANNOTATION}={p} to have it held"
                )),
                _ => {}
            }
        }
        said
    }

    fn choose(
        &self,
        pod: &PodFacts,
        ctx: &RequestContext<'_>,
        opt_in: bool,
        warnings: &mut Vec<String>,
    ) -> Option<&Arc<CompiledPolicy>> {
        let ns_ok = |p: &CompiledPolicy| covers(p, ctx.namespace_labels);
        if let Some(name) = pod.annotations.get(POLICY_ANNOTATION) {
            match self.get(name) {
                Some(p) if p.allow_opt_in && ns_ok(p) => return Some(p),
                Some(p) if !p.allow_opt_in => {
                    warnings.push(format!("capo: policy {name} does not allow opt-in by annotation"))
                }
                Some(_) => warnings.push(format!("capo: policy {name} does not cover namespace {}", pod.namespace)),
                None => warnings.push(format!("capo: policy {name} named by {POLICY_ANNOTATION} is not loaded")),
            }
        } else if opt_in && let Some(p) = self.policies.iter().find(|p| p.allow_opt_in && ns_ok(p)) {
            return Some(p);
        }
        self.policies.iter().find(|p| ns_ok(p) && selects(p, pod))
    }
}

/// Whether `policy`'s namespace selector takes a namespace with these labels. With
/// [`selects`], the one place a policy's selectors are read ([`Matcher::decide`]'s choice
/// and the sticky pre-filter both ask here).
fn covers(policy: &CompiledPolicy, namespace_labels: &BTreeMap<String, String>) -> bool {
    policy.namespace_selector.as_ref().is_none_or(|s| s.matches(namespace_labels))
}

/// Whether `policy` selects `pod` by its own selectors: labels and workloads (not by an
/// opt-in annotation, not by namespace).
fn selects(policy: &CompiledPolicy, pod: &PodFacts) -> bool {
    policy.pod_selector.as_ref().is_none_or(|s| s.matches(&pod.labels))
        && policy.workloads.as_ref().is_none_or(|ws| ws.iter().any(|w| controlled_by(pod, w)))
}

/// Whether `pod`'s controller is the workload `w` (a Deployment through its ReplicaSet,
/// whose name is the Deployment's plus the Pod's `pod-template-hash`).
fn controlled_by(pod: &PodFacts, w: &WorkloadRef) -> bool {
    let Some(capo_api::ControllerRef { kind, name, .. }) = &pod.controller else {
        return false;
    };
    if w.namespace != pod.namespace {
        return false;
    }
    match w.kind {
        WorkloadKind::StatefulSet => kind == "StatefulSet" && *name == w.name,
        WorkloadKind::ReplicaSet => kind == "ReplicaSet" && *name == w.name,
        WorkloadKind::DaemonSet => kind == "DaemonSet" && *name == w.name,
        WorkloadKind::Deployment => {
            kind == "ReplicaSet"
                && pod.labels.get("pod-template-hash").is_some_and(|hash| *name == format!("{}-{hash}", w.name))
        }
    }
}

fn reserve_for(pod: &PodFacts, policy: &CompiledPolicy, warnings: &mut Vec<String>) -> Duration {
    let Some(raw) = pod.annotations.get(RESERVE_FOR_ANNOTATION) else {
        return policy.reserve_for;
    };
    let Some((min, max)) = policy.reserve_for_bounds else {
        warnings.push(format!(
            "capo: {RESERVE_FOR_ANNOTATION} ignored: policy {} allows no override; holding for {}",
            policy.name,
            capo_api::Duration::from_std(policy.reserve_for)
        ));
        return policy.reserve_for;
    };
    match raw.parse::<capo_api::Duration>() {
        Ok(asked) => {
            let clamped = asked.as_std().clamp(min, max);
            if clamped != asked.as_std() {
                warnings.push(format!(
                    "capo: {RESERVE_FOR_ANNOTATION}={raw} is outside policy {}'s bounds; holding for {}",
                    policy.name,
                    capo_api::Duration::from_std(clamped)
                ));
            }
            clamped
        }
        Err(e) => {
            warnings.push(format!("capo: {RESERVE_FOR_ANNOTATION} ignored: {e}"));
            policy.reserve_for
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capo_api::CapoPolicy;
    use serde_json::json;

    fn compiled(name: &str, spec: serde_json::Value) -> CompiledPolicy {
        let p: CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap();
        CompiledPolicy::compile(&p).unwrap()
    }

    fn pod(labels: serde_json::Value, annotations: serde_json::Value) -> PodFacts {
        PodFacts::from_json(&json!({
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u", "labels": labels, "annotations": annotations,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "o", "controller": true}]},
            "spec": {"nodeName": "n"},
            "status": {"podIPs": [{"ip": "10.0.0.9"}]}
        }))
        .unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn ctx(ns: &BTreeMap<String, String>) -> RequestContext<'_> {
        RequestContext { namespace_labels: ns, namespace_terminating: false, by_garbage_collector: false }
    }

    fn held_by(d: &Decision) -> Option<&str> {
        match d {
            Decision::Hold(p) => Some(&p.policy.name),
            Decision::Skip(_) => None,
        }
    }

    #[test]
    fn why_not_names_the_near_misses_and_nothing_else() {
        let m = Matcher::new([
            compiled(
                "elsewhere",
                json!({ "namespaceSelector": { "matchLabels": { "team": "b" } },
                "podSelector": { "matchLabels": { "app": "redis" } } }),
            ),
            compiled("strict", json!({ "podSelector": { "matchLabels": { "app": "zk" } } })),
            compiled(
                "open",
                json!({ "podSelector": { "matchLabels": { "app": "kafka" } }, "podOverrides": { "allowOptIn": true } }),
            ),
        ]);
        let ns = labels(&[]);
        let redis = pod(json!({ "app": "redis" }), json!({}));
        let why = m.why_not(&SkipReason::NotSelected, &redis, &ns);
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(why[0].contains("policy elsewhere selects this Pod but not its namespace shop"), "{why:?}");
        assert!(why[1].contains("policy open covers namespace shop and allows opt-in"), "{why:?}");
        let asks = pod(json!({ "app": "web" }), json!({ "capo.io/policy": "strict" }));
        let why = m.why_not(&SkipReason::NotSelected, &asks, &ns);
        assert!(why.iter().any(|w| w.contains("asks policy strict") && w.contains("allows no opt-in")), "{why:?}");
        let ghost = pod(json!({}), json!({ "capo.io/policy": "gone" }));
        assert!(m.why_not(&SkipReason::NotSelected, &ghost, &ns)[0].contains("names gone, which is not loaded"));
        // Skipped for its own sake: said only when a policy would take it.
        let opted = pod(json!({ "app": "zk" }), json!({ "capo.io/hold": "false" }));
        assert_eq!(m.why_not(&SkipReason::OptedOut, &opted, &ns).len(), 1);
        let other = pod(json!({ "app": "web" }), json!({ "capo.io/hold": "false" }));
        assert!(m.why_not(&SkipReason::OptedOut, &other, &ns).is_empty());
    }

    /// The sticky webhook's in-memory pre-filter never says no where `decide` would hold
    /// the Pod under a sticky policy, and says no where no sticky policy could.
    #[test]
    fn sticky_may_select_covers_every_way_a_sticky_policy_selects() {
        let sticky = json!({ "enabled": true });
        let m = Matcher::new([
            compiled("plain", json!({ "podSelector": {} })),
            compiled(
                "redis",
                json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "sticky": sticky,
                "namespaceSelector": { "matchLabels": { "team": "a" } } }),
            ),
            compiled(
                "web",
                json!({ "workloads": [{ "kind": "StatefulSet", "namespace": "shop", "name": "web" }],
                "sticky": sticky }),
            ),
            compiled(
                "opt",
                json!({ "podSelector": { "matchLabels": { "never": "x" } }, "podOverrides": { "allowOptIn": true },
                "sticky": sticky }),
            ),
        ]);
        let team_a = labels(&[("team", "a")]);
        let team_b = labels(&[("team", "b")]);
        let of_zk = |labels: serde_json::Value| {
            let mut p = pod(labels, json!({}));
            p.controller.as_mut().unwrap().name = "zk".into();
            p
        };
        let redis = of_zk(json!({"app": "redis"}));
        assert!(m.sticky_may_select(&redis, Some(&team_a)));
        assert!(!m.sticky_may_select(&redis, Some(&team_b)), "`redis` covers team a only");
        assert!(m.sticky_may_select(&redis, None), "namespace not cached: any namespace");
        // `web` selects by workload (this Pod's StatefulSet is `web`).
        assert!(m.sticky_may_select(&pod(json!({"app": "kafka"}), json!({})), Some(&team_b)));
        let other = of_zk(json!({"app": "kafka"}));
        assert!(!m.sticky_may_select(&other, Some(&team_b)), "only `plain` (not sticky) selects it");
        // Opt-in by annotation, by name or by capo.io/hold.
        let mut named = other.clone();
        named.annotations.insert(POLICY_ANNOTATION.into(), "opt".into());
        assert!(m.sticky_may_select(&named, Some(&team_b)));
        let mut opted = other.clone();
        opted.annotations.insert(HOLD_ANNOTATION.into(), "true".into());
        assert!(m.sticky_may_select(&opted, Some(&team_b)));
        // Whatever decide picks, if it is a sticky policy the pre-filter said yes.
        for (p, ns) in [(&redis, &team_a), (&named, &team_b), (&opted, &team_b), (&other, &team_b)] {
            if let Decision::Hold(plan) = m.decide(p, &ctx(ns)) {
                assert!(plan.policy.sticky.is_none() || m.sticky_may_select(p, Some(ns)), "{}", plan.policy.name);
            }
        }
    }

    #[test]
    fn namespace_and_pod_selectors_must_both_match() {
        let m = Matcher::new([compiled(
            "redis",
            json!({"namespaceSelector": {"matchLabels": {"ip-reserve": "enabled"}}, "podSelector": {"matchLabels": {"app": "redis"}}}),
        )]);
        let enabled = labels(&[("ip-reserve", "enabled")]);
        let plain = labels(&[]);
        assert_eq!(held_by(&m.decide(&pod(json!({"app": "redis"}), json!({})), &ctx(&enabled))), Some("redis"));
        assert_eq!(
            m.decide(&pod(json!({"app": "redis"}), json!({})), &ctx(&plain)),
            Decision::Skip(SkipReason::NotSelected)
        );
        assert_eq!(
            m.decide(&pod(json!({"app": "web"}), json!({})), &ctx(&enabled)),
            Decision::Skip(SkipReason::NotSelected)
        );
    }

    #[test]
    fn highest_priority_wins_then_name() {
        let m = Matcher::new([
            compiled("b-low", json!({"podSelector": {}, "priority": 1})),
            compiled("z-high", json!({"podSelector": {}, "priority": 10})),
            compiled("a-low", json!({"podSelector": {}, "priority": 1})),
        ]);
        let ns = labels(&[]);
        assert_eq!(held_by(&m.decide(&pod(json!({}), json!({})), &ctx(&ns))), Some("z-high"));
        let m = Matcher::new([compiled("b", json!({"podSelector": {}})), compiled("a", json!({"podSelector": {}}))]);
        assert_eq!(held_by(&m.decide(&pod(json!({}), json!({})), &ctx(&ns))), Some("a"));
    }

    #[test]
    fn annotations_opt_in_opt_out_and_name_a_policy() {
        let m = Matcher::new([
            compiled(
                "strict",
                json!({"podSelector": {"matchLabels": {"never": "x"}}, "podOverrides": {"allowOptIn": false}}),
            ),
            compiled(
                "open",
                json!({"podSelector": {"matchLabels": {"never": "x"}}, "podOverrides": {"allowOptIn": true}}),
            ),
            compiled("default", json!({"podSelector": {"matchLabels": {"never": "x"}}, "priority": 5})),
        ]);
        let ns = labels(&[]);
        // Opt-in is off unless the policy allows it: "default" outranks "open" but is not chosen.
        assert_eq!(held_by(&m.decide(&pod(json!({}), json!({"capo.io/policy": "open"})), &ctx(&ns))), Some("open"));
        assert_eq!(held_by(&m.decide(&pod(json!({}), json!({"capo.io/hold": "true"})), &ctx(&ns))), Some("open"));
        assert_eq!(m.decide(&pod(json!({}), json!({})), &ctx(&ns)), Decision::Skip(SkipReason::NotSelected));
        // A policy that refuses opt-in is not chosen by naming it.
        assert_eq!(
            m.decide(&pod(json!({}), json!({"capo.io/policy": "strict"})), &ctx(&ns)),
            Decision::Skip(SkipReason::NotSelected)
        );
        let m = Matcher::new([compiled("all", json!({"podSelector": {}}))]);
        assert_eq!(
            m.decide(&pod(json!({}), json!({"capo.io/hold": "false"})), &ctx(&ns)),
            Decision::Skip(SkipReason::OptedOut)
        );
    }

    #[test]
    fn reserve_for_override_is_clamped_to_bounds() {
        let m = Matcher::new([compiled(
            "p",
            json!({"podSelector": {}, "reserveFor": "40m", "podOverrides": {"minReserveFor": "10m", "maxReserveFor": "2h"}}),
        )]);
        let ns = labels(&[]);
        let plan = |ann| match m.decide(&pod(json!({}), ann), &ctx(&ns)) {
            Decision::Hold(p) => p,
            d => panic!("{d:?}"),
        };
        let p = plan(json!({"capo.io/reserve-for": "1h"}));
        assert_eq!((p.reserve_for, p.warnings.len()), (Duration::from_secs(3600), 0));
        let p = plan(json!({"capo.io/reserve-for": "24h"}));
        assert_eq!(p.reserve_for, Duration::from_secs(7200));
        assert!(p.warnings[0].contains("outside"), "{:?}", p.warnings);
        let p = plan(json!({"capo.io/reserve-for": "soon"}));
        assert_eq!(p.reserve_for, Duration::from_secs(2400));
        assert!(p.warnings[0].contains("ignored"));
        let m = Matcher::new([compiled("fixed", json!({"podSelector": {}}))]);
        match m.decide(&pod(json!({}), json!({"capo.io/reserve-for": "1h"})), &ctx(&ns)) {
            Decision::Hold(p) => {
                assert!(p.reserve_for == Duration::from_secs(2400) && p.warnings[0].contains("allows no override"))
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn workloads_match_through_the_controller_reference() {
        let m = Matcher::new([compiled(
            "sts",
            json!({"workloads": [{"kind": "StatefulSet", "namespace": "shop", "name": "web"}]}),
        )]);
        let ns = labels(&[]);
        assert_eq!(held_by(&m.decide(&pod(json!({}), json!({})), &ctx(&ns))), Some("sts"));
        let m = Matcher::new([compiled(
            "other",
            json!({"workloads": [{"kind": "StatefulSet", "namespace": "shop", "name": "db"}]}),
        )]);
        assert_eq!(m.decide(&pod(json!({}), json!({})), &ctx(&ns)), Decision::Skip(SkipReason::NotSelected));

        let deploy_pod = PodFacts::from_json(&json!({
            "metadata": {"name": "api-7d9-x", "namespace": "shop", "labels": {"pod-template-hash": "7d9"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "api-7d9", "uid": "o", "controller": true}]},
            "status": {"podIP": "10.0.0.3"}
        }))
        .unwrap();
        let m = Matcher::new([compiled(
            "dep",
            json!({"workloads": [{"kind": "Deployment", "namespace": "shop", "name": "api"}]}),
        )]);
        assert_eq!(held_by(&m.decide(&deploy_pod, &ctx(&ns))), Some("dep"));
    }

    #[test]
    fn skip_rules_and_unholdable_pods() {
        let m = Matcher::new([compiled("p", json!({"podSelector": {}}))]);
        let ns = labels(&[]);
        let terminating =
            RequestContext { namespace_labels: &ns, namespace_terminating: true, by_garbage_collector: false };
        assert!(matches!(
            m.decide(&pod(json!({}), json!({})), &terminating),
            Decision::Skip(SkipReason::NamespaceTerminating { .. })
        ));
        let gc = RequestContext { namespace_labels: &ns, namespace_terminating: false, by_garbage_collector: true };
        assert!(matches!(m.decide(&pod(json!({}), json!({})), &gc), Decision::Skip(SkipReason::OwnerDeleted { .. })));
        let m2 = Matcher::new([compiled("keep", json!({"podSelector": {}, "skip": {"ownerDeleted": false}}))]);
        assert_eq!(held_by(&m2.decide(&pod(json!({}), json!({})), &gc)), Some("keep"));

        let no_ip = PodFacts::from_json(&json!({"metadata": {"name": "x"}})).unwrap();
        assert_eq!(m.decide(&no_ip, &ctx(&ns)), Decision::Skip(SkipReason::NoIps));
        let host =
            PodFacts::from_json(&json!({"spec": {"hostNetwork": true}, "status": {"podIP": "10.1.1.1"}})).unwrap();
        assert_eq!(m.decide(&host, &ctx(&ns)), Decision::Skip(SkipReason::HostNetwork));
    }

    #[test]
    fn a_kubevirt_vms_launcher_pod_is_never_held() {
        let ns = BTreeMap::new();
        let m = Matcher::new([compiled("all", json!({"podSelector": {}}))]);
        let launcher = |meta: serde_json::Value| {
            let mut pod = json!({"metadata": {"name": "virt-launcher-vm1-x"}, "status": {"podIP": "10.1.1.1"}});
            for (k, v) in meta.as_object().unwrap() {
                pod["metadata"][k] = v.clone();
            }
            PodFacts::from_json(&pod).unwrap()
        };
        let labelled = launcher(json!({"labels": {"kubevirt.io": "virt-launcher", "vm.kubevirt.io/name": "vm1"}}));
        assert_eq!(m.decide(&labelled, &ctx(&ns)), Decision::Skip(SkipReason::KubeVirtVm));
        let owned =
            launcher(json!({"ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "name": "vm1", "uid": "u", "controller": true}]}));
        assert_eq!(m.decide(&owned, &ctx(&ns)), Decision::Skip(SkipReason::KubeVirtVm));
        // Another group's kind of that name, or another value of the label: held.
        let other = launcher(json!({"labels": {"kubevirt.io": "virt-handler"}, "ownerReferences": [{"apiVersion":
            "example.com/v1", "kind": "VirtualMachineInstance", "name": "vm1", "uid": "u", "controller": true}]}));
        assert_eq!(held_by(&m.decide(&other, &ctx(&ns))), Some("all"));
    }
}
