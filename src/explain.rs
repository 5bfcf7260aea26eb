//! `capo explain <namespace>/<pod>`: why a Pod's addresses would be (or were) held, or not.
//!
//! For a live Pod it runs the webhook's own rule ([`crate::hold::rule::decide`], which
//! calls [`Matcher::decide`]) on the Pod, its namespace and the CapoPolicies as the cluster
//! has them now, and the leader's own cap choice ([`crate::release::cap::over_cap`]) on the
//! policy's holds as they stand. For a Pod that is gone it shows its holds, when each is
//! due and why. It reads with the caller's rights and says what it could not read.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;

use capo_api::{CapoPolicy, ManualAction, ReservedIP};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde::Serialize;

use crate::hold::rule::{self, GARBAGE_COLLECTOR_USER, NAMESPACE_CONTROLLER_USER, Origin};
use crate::ops::{OpsError, Output, human};
use crate::pod::PodFacts;
use crate::policy::{CompiledPolicy, Consideration, Decision, Matcher, OptIn};
use crate::release::cap;
use crate::store::NamespaceFacts;

/// What `capo explain` found, as `-o json|yaml` prints it.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    pub namespace: String,
    pub pod: String,
    /// The Pod exists (possibly with its deletion under way).
    pub live: bool,
    pub addresses: Vec<String>,
    /// Every usable policy in the order the webhook tries them.
    pub policies: Vec<Consideration>,
    /// CapoPolicies the webhook cannot use (`Ready=False`), and why.
    pub invalid_policies: BTreeMap<String, String>,
    /// What a deletion or an eviction by a user would do now.
    pub deletion: Option<Outcome>,
    /// What the same deletion by the garbage collector (its owner deleted) would do.
    pub by_garbage_collector: Option<Outcome>,
    /// What it would do while the namespace is being deleted.
    pub in_terminating_namespace: Option<Outcome>,
    /// The Pod's holds, as their records have them.
    pub holds: Vec<HoldState>,
    /// What explain could not read or cannot know.
    pub unknown: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    /// `hold` or `skip`.
    pub verdict: &'static str,
    pub policy: Option<String>,
    pub reserve_for: Option<String>,
    /// For a skip: why, as the webhook's metric labels it, and in words.
    pub reason: Option<&'static str>,
    pub why: Option<String>,
    /// What the client would be told.
    pub warnings: Vec<String>,
    /// For a skip: the policies that nearly take the Pod, and what they lack (what a
    /// dry-run deletion warns).
    pub near_misses: Vec<String>,
    /// Addresses not held: outside every Calico IP pool.
    pub outside_pools: Vec<String>,
    /// Sticky IPs: what the recreated Pod would get.
    pub sticky: Option<String>,
    /// The policy's cap (and namespace share) with this hold added.
    pub cap: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HoldState {
    pub ip: String,
    pub policy: String,
    pub trigger: String,
    pub reserved_at: String,
    pub due: String,
    pub record: String,
    /// The hold is an earlier Pod's of the same name (another UID): a StatefulSet's Pod
    /// recreated after its deletion was held.
    pub earlier_pod: bool,
}

/// The Pod `namespace/name`: its explanation, as a text or `-o json|yaml`.
pub async fn explain(
    client: Client,
    namespace: &str,
    name: &str,
    capo_namespace: &str,
    output: Output,
) -> Result<String, OpsError> {
    let mut e = Explanation { namespace: namespace.into(), pod: name.into(), ..Default::default() };
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|err| api(format!("reading Pod {namespace}/{name}"), err))?;
    let records = records_of(&client, namespace, name, capo_namespace, &mut e.unknown).await?;
    e.holds = records.iter().map(hold_state).collect();
    if let Some(pod) = pod {
        let facts = PodFacts::from_pod(&pod);
        for (h, r) in e.holds.iter_mut().zip(&records) {
            h.earlier_pod = r.spec.pod.uid != facts.uid;
        }
        let ns = Api::<Namespace>::all(client.clone())
            .get_opt(namespace)
            .await
            .map_err(|err| api(format!("reading Namespace {namespace}"), err))?;
        let ns = ns.map_or_else(
            || NamespaceFacts::from_meta(namespace, None, false),
            |n| {
                NamespaceFacts::from_meta(
                    namespace,
                    n.metadata.labels.as_ref(),
                    n.metadata.deletion_timestamp.is_some(),
                )
            },
        );
        let (matcher, invalid) = policies(&client).await?;
        e.invalid_policies = invalid;
        let pools = pools(&client, &mut e.unknown).await;
        let scene = Scene { matcher: &matcher, excluded: &[capo_namespace.to_string(), "kube-system".to_string()] };
        live(&mut e, &scene, &facts, &ns, pools.as_ref());
        if let Some(Outcome { policy: Some(policy), .. }) = &e.deletion {
            let held = policy_holds(&client, policy).await;
            match (held, matcher.get(policy)) {
                (Ok(held), Some(p)) => {
                    let cap = cap_outcome(p, &facts, &held);
                    if let Some(d) = e.deletion.as_mut() {
                        d.cap = Some(cap);
                    }
                }
                (Err(err), _) => e.unknown.push(format!("the cap: cannot list ReservedIPs: {err}")),
                _ => {}
            }
        }
        e.unknown.push(format!(
            "namespaces capo's --excluded-namespaces names besides kube-system and {capo_namespace} (--capo-namespace)"
        ));
        e.unknown.push("the pool guard's share of each pool (see `capo policies`, POOL-SHARE)".into());
    }
    Ok(match output.structured(&[serde_json::to_value(&e).expect("JSON")]) {
        Some(s) => s,
        None => render(&e),
    })
}

/// The policies the webhook would use now: compiled as the policy controller compiles them.
async fn policies(client: &Client) -> Result<(Matcher, BTreeMap<String, String>), OpsError> {
    let list = Api::<CapoPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|err| api("listing CapoPolicies", err))?;
    let mut invalid = BTreeMap::new();
    let mut usable = Vec::new();
    for p in &list.items {
        match CompiledPolicy::compile(p) {
            Ok(c) => usable.push(c),
            Err(err) => {
                invalid.insert(p.name_any(), err.to_string());
            }
        }
    }
    Ok((Matcher::new(usable), invalid))
}

async fn pools(client: &Client, unknown: &mut Vec<String>) -> Option<crate::calico::pools::PoolStore> {
    let Some(version) = crate::calico::pools::calico_ipam_api(client).await else {
        unknown.push("whether its addresses are in a Calico IP pool: Calico's IPAM API is not served".into());
        return None;
    };
    match crate::calico::pools::PoolStore::list(client, &version).await {
        Ok(store) => Some(store),
        Err(err) => {
            unknown.push(format!("whether its addresses are in a Calico IP pool: listing {version} pools: {err}"));
            None
        }
    }
}

fn api(what: impl Into<String>, err: kube::Error) -> OpsError {
    match &err {
        kube::Error::Api(s) if s.code == 403 => OpsError::Forbidden(s.message.clone()),
        _ => OpsError::Api { what: what.into(), source: err },
    }
}

/// The holds of the Pod `namespace/name`, with the leader's countdowns laid over them.
async fn records_of(
    client: &Client,
    namespace: &str,
    name: &str,
    capo_namespace: &str,
    unknown: &mut Vec<String>,
) -> Result<Vec<ReservedIP>, OpsError> {
    let lp = ListParams::default().labels(&format!("{}={namespace}", capo_api::keys::NAMESPACE_LABEL));
    let mut list =
        Api::<ReservedIP>::all(client.clone()).list(&lp).await.map_err(|err| api("listing ReservedIPs", err))?.items;
    list.retain(|r| r.spec.pod.namespace == namespace && r.spec.pod.name == name);
    if !list.is_empty() {
        match crate::release::countdowns::read(client, Some(capo_namespace)).await {
            Ok(starts) => {
                let settings = crate::release::decide::PlanSettings::default();
                for r in &mut list {
                    crate::release::countdowns::overlay(r, &starts, &settings);
                }
            }
            Err(err) => unknown.push(format!(
                "when its holds are due: the countdowns in namespace {capo_namespace} (--capo-namespace): {err}"
            )),
        }
    }
    Ok(list)
}

async fn policy_holds(client: &Client, policy: &str) -> Result<Vec<ReservedIP>, kube::Error> {
    let lp = ListParams::default().labels(&format!("{}={policy}", capo_api::keys::POLICY_LABEL));
    Ok(Api::<ReservedIP>::all(client.clone()).list(&lp).await?.items)
}

/// What the webhook knows besides the Pod and its namespace.
struct Scene<'a> {
    matcher: &'a Matcher,
    excluded: &'a [String],
}

/// The live Pod's outcomes, by the webhook's own rule.
fn live(
    e: &mut Explanation,
    scene: &Scene<'_>,
    pod: &PodFacts,
    ns: &NamespaceFacts,
    pools: Option<&crate::calico::pools::PoolStore>,
) {
    e.live = true;
    e.addresses = pod.ips.iter().map(ToString::to_string).collect();
    e.policies = scene.matcher.consider(pod, &ns.labels);
    let outcome = |origin: Origin<'_>, ns: &NamespaceFacts| {
        let decision = rule::decide(scene.matcher, pod, ns, origin, scene.excluded);
        let near = match &decision {
            Decision::Skip(reason) => {
                // The reason itself is the outcome's `why` already.
                let said = reason.describe();
                scene.matcher.why_not(reason, pod, &ns.labels).into_iter().filter(|w| *w != said).collect()
            }
            Decision::Hold(_) => vec![],
        };
        let mut o = outcome(decision, pod, pools);
        o.near_misses = near;
        o
    };
    let by_user = outcome(Origin::Request { user: Some("capo-explain") }, ns);
    let by_gc = outcome(Origin::Request { user: Some(GARBAGE_COLLECTOR_USER) }, ns);
    let in_terminating = outcome(Origin::Request { user: Some(NAMESPACE_CONTROLLER_USER) }, ns);
    if by_gc != by_user {
        e.by_garbage_collector = Some(by_gc);
    }
    if in_terminating != by_user {
        e.in_terminating_namespace = Some(in_terminating);
    }
    e.deletion = Some(by_user);
}

fn outcome(decision: Decision, pod: &PodFacts, pools: Option<&crate::calico::pools::PoolStore>) -> Outcome {
    match decision {
        Decision::Skip(reason) => Outcome {
            verdict: "skip",
            policy: None,
            reserve_for: None,
            reason: Some(reason.as_str()),
            why: Some(reason.describe()),
            warnings: vec![],
            near_misses: vec![],
            outside_pools: vec![],
            sticky: None,
            cap: None,
        },
        Decision::Hold(plan) => {
            let outside: Vec<String> = pods_outside(pod, pools).iter().map(ToString::to_string).collect();
            let all_outside = !pod.ips.is_empty() && outside.len() == pod.ips.len();
            let sticky = plan.policy.sticky.map(|fallback| {
                format!(
                    "the Pod its workload recreates with the same name gets the same address back (sticky; \
                     back to an ordinary hold after {})",
                    capo_api::Duration::from_std(fallback)
                )
            });
            Outcome {
                verdict: if all_outside { "skip" } else { "hold" },
                policy: Some(plan.policy.name.clone()),
                reserve_for: Some(capo_api::Duration::from_std(plan.reserve_for).to_string()),
                reason: all_outside.then_some("outside_pools"),
                why: all_outside.then(|| "no address of it is in a Calico IP pool: nothing to hold".to_string()),
                warnings: plan.warnings,
                near_misses: vec![],
                outside_pools: outside,
                sticky,
                cap: None,
            }
        }
    }
}

fn pods_outside(pod: &PodFacts, pools: Option<&crate::calico::pools::PoolStore>) -> Vec<IpAddr> {
    let Some(pools) = pools else { return vec![] };
    pod.ips.iter().copied().filter(|ip| pools.outside_every_pool(*ip) == Some(true)).collect()
}

/// What the policy's cap and namespace share would do with this Pod's holds added: the
/// leader's own choice ([`cap::over_cap`]) on the holds as they stand.
fn cap_outcome(policy: &CompiledPolicy, pod: &PodFacts, held: &[ReservedIP]) -> String {
    let now = Timestamp::now();
    let mine: Vec<String> = pod.ips.iter().map(|ip| format!("{ip} (this Pod)")).collect();
    let mut counted: Vec<cap::Counted<'_>> = held
        .iter()
        .filter(|r| !(r.spec.pod.namespace == pod.namespace && r.spec.pod.name == pod.name))
        .map(|r| cap::Counted {
            name: &r.spec.ip,
            group: &r.spec.pod.namespace,
            namespace: &r.spec.pod.namespace,
            present: false,
            created: r.metadata.creation_timestamp.as_ref().map_or(r.spec.reserved_at.0, |t| t.0),
            reserved_at: r.spec.reserved_at.0,
            kept: r.claim().is_some_and(|c| c.pending(now)),
        })
        .collect();
    counted.extend(mine.iter().map(|name| cap::Counted {
        name,
        group: &pod.namespace,
        namespace: &pod.namespace,
        present: false,
        created: now,
        reserved_at: now,
        kept: false,
    }));
    let total = counted.len();
    let in_ns = counted.iter().filter(|c| c.namespace == pod.namespace).count();
    let per_ns = policy.max_reserved_per_namespace.map(|n| n as usize);
    let victims = cap::over_cap(policy.max_reserved as usize, per_ns, counted);
    let mut said = format!("{total} of maxReserved {}", policy.max_reserved);
    if let Some(n) = per_ns {
        let _ = write!(said, ", {in_ns} in namespace {} of maxReservedPerNamespace {n}", pod.namespace);
    }
    if victims.is_empty() {
        said.push_str(" with this Pod's: within the bounds, nothing released for it");
    } else {
        let _ = write!(said, " with this Pod's: over, so the leader releases {}", victims.join(", "));
    }
    said
}

fn hold_state(r: &ReservedIP) -> HoldState {
    let now = Timestamp::now();
    let st = r.status.clone().unwrap_or_default();
    let due = match (r.manual(), st.release_at, st.pod_kept_since) {
        (Some(m), _, _) if m.action == ManualAction::Release => format!("now: a release asked by {}", m.by),
        (Some(m), Some(at), _) if m.action == ManualAction::Extend => {
            format!("at {} (in {}): extended by {}", stamp(at.0), human(since(at.0, now)), m.by)
        }
        (_, Some(at), _) if at.0 <= now => format!("now (was due at {}): the leader releases it next", stamp(at.0)),
        (_, Some(at), _) => {
            let gone = st.pod_gone_at.map_or_else(|| "?".into(), |t| stamp(t.0));
            format!(
                "at {} (in {}): the Pod left at {gone}, plus the policy's reserveFor",
                stamp(at.0),
                human(since(at.0, now))
            )
        }
        (_, None, Some(kept)) => format!(
            "not counting down: the Pod stayed (a refused eviction?) since {}; dropped after --kept-pod-grace",
            stamp(kept.0)
        ),
        (_, None, None) => "not counting down yet: its Pod is not seen gone".into(),
    };
    let mut due = due;
    if let Some(c) = r.claim() {
        let _ = write!(due, "; claimed by the recreated Pod (sticky) until {}", stamp(c.until.0));
    }
    HoldState {
        ip: r.spec.ip.clone(),
        policy: r.spec.policy.clone(),
        trigger: format!("{:?}", r.spec.trigger),
        reserved_at: stamp(r.spec.reserved_at.0),
        due,
        record: r.name_any(),
        earlier_pod: false,
    }
}

fn stamp(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn since(later: Timestamp, earlier: Timestamp) -> std::time::Duration {
    std::time::Duration::try_from(later.duration_since(earlier)).unwrap_or_default()
}

/// The text form: what a deletion would do first, then why.
pub fn render(e: &Explanation) -> String {
    let mut out = String::new();
    let who = format!("{}/{}", e.namespace, e.pod);
    if e.live {
        let ips = if e.addresses.is_empty() { "no address".to_string() } else { e.addresses.join(", ") };
        let _ = writeln!(out, "Pod {who} ({ips})");
    } else {
        let _ = writeln!(out, "Pod {who}: no such Pod (gone, or never there)");
    }
    if let Some(d) = &e.deletion {
        let _ = writeln!(out, "\nDeleted or evicted now: {}", sentence(d));
        if let Some(gc) = &e.by_garbage_collector {
            let _ = writeln!(out, "Deleted because its owner is being deleted: {}", sentence(gc));
        }
        if let Some(t) = &e.in_terminating_namespace {
            let _ = writeln!(out, "Deleted with its namespace: {}", sentence(t));
        }
    }
    if e.live {
        let _ = writeln!(out, "\nPolicies, in the order the webhook tries them (priority, then name):");
        if e.policies.is_empty() {
            let _ = writeln!(out, "  none usable");
        }
        let winner = e.deletion.as_ref().and_then(|d| d.policy.clone());
        for c in &e.policies {
            let mark = if winner.as_deref() == Some(c.policy.as_str()) { "  <- holds it" } else { "" };
            let _ = writeln!(out, "  {} (priority {}): {}{mark}", c.policy, c.priority, view(c));
        }
        for (name, why) in &e.invalid_policies {
            let _ = writeln!(out, "  {name}: not usable (Ready=False): {why}");
        }
    }
    if !e.holds.is_empty() {
        let _ = writeln!(out, "\nHeld now:");
        for h in &e.holds {
            let whose = if h.earlier_pod { ", the earlier Pod of this name's" } else { "" };
            let _ = writeln!(
                out,
                "  {} by policy {} ({} at {}){whose}, record {}\n    due {}",
                h.ip, h.policy, h.trigger, h.reserved_at, h.record, h.due
            );
        }
    } else if !e.live {
        let _ = writeln!(
            out,
            "\nNo hold for it now: capo never held it, or released it already (capo keeps no history of released \
             holds; its Events on the Pod say: kubectl get events -n {} --field-selector involvedObject.name={}).",
            e.namespace, e.pod
        );
    }
    if !e.unknown.is_empty() {
        let _ = writeln!(out, "\nNot known here:");
        for u in &e.unknown {
            let _ = writeln!(out, "  - {u}");
        }
    }
    out
}

fn sentence(o: &Outcome) -> String {
    let mut s = match (o.verdict, &o.policy) {
        ("hold", Some(p)) => format!(
            "HOLD its addresses by policy {p}, for {} after the Pod is gone",
            o.reserve_for.as_deref().unwrap_or("?")
        ),
        _ => format!("NOT HELD: {} ({})", o.why.as_deref().unwrap_or("?"), o.reason.unwrap_or("?")),
    };
    if o.verdict == "hold" && !o.outside_pools.is_empty() {
        let _ = write!(s, "\n  not held (outside every Calico IP pool): {}", o.outside_pools.join(", "));
    }
    for w in &o.warnings {
        let _ = write!(s, "\n  warning: {w}");
    }
    for w in &o.near_misses {
        let _ = write!(s, "\n  {w}");
    }
    if let Some(sticky) = &o.sticky {
        let _ = write!(s, "\n  {sticky}");
    }
    if let Some(cap) = &o.cap {
        let _ = write!(s, "\n  cap: {cap}");
    }
    s
}

fn view(c: &Consideration) -> String {
    let mut parts = vec![];
    parts.push(if c.covers_namespace { "namespace covered" } else { "namespace not covered (namespaceSelector)" });
    parts.push(if c.selects { "selected (podSelector, workloads)" } else { "not selected (podSelector, workloads)" });
    match c.opt_in {
        OptIn::NotAsked => {}
        OptIn::Named => parts.push("named by capo.io/policy"),
        OptIn::Hold => parts.push("opted in by capo.io/hold"),
        OptIn::NotAllowed => parts.push("opt-in asked, but the policy does not allow it (podOverrides.allowOptIn)"),
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compiled(name: &str, spec: serde_json::Value) -> CompiledPolicy {
        let p: CapoPolicy = serde_json::from_value(json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "CapoPolicy", "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap();
        CompiledPolicy::compile(&p).unwrap()
    }

    fn pod() -> PodFacts {
        PodFacts::from_json(&json!({
            "metadata": {"name": "redis-0", "namespace": "shop", "uid": "u", "labels": {"app": "redis"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "redis", "uid": "o", "controller": true}]},
            "spec": {"nodeName": "n"},
            "status": {"podIPs": [{"ip": "10.0.0.9"}]}
        }))
        .unwrap()
    }

    fn explained(m: &Matcher, ns: &NamespaceFacts) -> Explanation {
        let mut e = Explanation::default();
        live(&mut e, &Scene { matcher: m, excluded: &["kube-system".into()] }, &pod(), ns, None);
        e
    }

    #[test]
    fn the_winner_and_the_variants_are_the_webhooks() {
        let m = Matcher::new([
            compiled("all", json!({ "podSelector": {} })),
            compiled(
                "redis",
                json!({ "podSelector": { "matchLabels": { "app": "redis" } }, "priority": 10,
                "skip": { "ownerDeleted": false }, "reserveFor": "1h" }),
            ),
            compiled("team-b", json!({ "namespaceSelector": { "matchLabels": { "team": "b" } }, "priority": 20 })),
        ]);
        let e = explained(&m, &NamespaceFacts::from_meta("shop", None, false));
        let d = e.deletion.clone().unwrap();
        assert_eq!((d.verdict, d.policy.as_deref(), d.reserve_for.as_deref()), ("hold", Some("redis"), Some("1h")));
        assert_eq!(e.policies.iter().map(|c| c.policy.as_str()).collect::<Vec<_>>(), ["team-b", "redis", "all"]);
        assert!(!e.policies[0].covers_namespace && e.policies[1].covers_namespace && e.policies[1].selects);
        assert!(e.by_garbage_collector.is_none(), "redis holds through a cascade too");
        let t = e.in_terminating_namespace.clone().unwrap();
        assert_eq!(t.reason, Some("namespace_terminating"));
        assert!(t.near_misses.is_empty(), "the reason is said once: {t:?}");
        let text = render(&e);
        assert!(text.contains("HOLD its addresses by policy redis, for 1h"), "{text}");
        assert!(text.contains("redis (priority 10): namespace covered; selected") && text.contains("<- holds it"));
    }

    #[test]
    fn a_pod_no_policy_selects_says_so_and_an_excluded_namespace_wins() {
        let m = Matcher::new([compiled("other", json!({ "podSelector": { "matchLabels": { "app": "kafka" } } }))]);
        let e = explained(&m, &NamespaceFacts::from_meta("shop", None, false));
        let d = e.deletion.unwrap();
        assert_eq!((d.verdict, d.reason), ("skip", Some("not_selected")));
        let mut e = Explanation::default();
        let excluded = ["shop".to_string()];
        live(
            &mut e,
            &Scene { matcher: &m, excluded: &excluded },
            &pod(),
            &NamespaceFacts::from_meta("shop", None, false),
            None,
        );
        assert_eq!(e.deletion.unwrap().reason, Some("excluded"));
    }

    #[test]
    fn the_cap_names_what_the_leader_would_release() {
        let p = compiled("redis", json!({ "podSelector": {}, "maxReserved": 2 }));
        let record = |ip: &str, ns: &str, at: &str| -> ReservedIP {
            serde_json::from_value(json!({
                "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP",
                "metadata": { "name": ip, "creationTimestamp": at },
                "spec": { "ip": ip, "cidr": format!("{ip}/32"), "policy": "redis", "reservation": "r",
                    "calicoApiGroup": "crd.projectcalico.org/v1", "reserveFor": "40m",
                    "pod": { "namespace": ns, "name": "x", "uid": "u" }, "reservedAt": at, "trigger": "Delete" }
            }))
            .unwrap()
        };
        let one = [record("10.0.0.1", "shop", "2026-01-01T00:00:00Z")];
        assert!(cap_outcome(&p, &pod(), &one).contains("2 of maxReserved 2 with this Pod's: within"));
        let two =
            [record("10.0.0.1", "shop", "2026-01-01T00:00:00Z"), record("10.0.0.2", "shop", "2026-01-01T00:01:00Z")];
        let said = cap_outcome(&p, &pod(), &two);
        assert!(said.contains("over, so the leader releases 10.0.0.1"), "{said}");
    }
}
