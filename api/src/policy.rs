//! `CapoPolicy`: which Pods keep their IPs held after deletion, for how long, and how many.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::selector::LabelSelector;

pub const DEFAULT_RESERVE_FOR: &str = "40m";
pub const DEFAULT_MAX_RESERVED: u32 = 300;
pub const DEFAULT_RELEASE_INTERVAL: &str = "5s";
pub const DEFAULT_RELEASE_BATCH: u32 = 10;
pub const DEFAULT_STICKY_FALLBACK_AFTER: &str = "90s";

/// A cluster-scoped policy that selects Pods whose IPs capo holds in a Calico
/// `IPReservation` when they are deleted or evicted.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "capo.io",
    version = "v1alpha1",
    kind = "CapoPolicy",
    plural = "capopolicies",
    singular = "capopolicy",
    shortname = "capopol",
    category = "capo",
    status = "CapoPolicyStatus",
    derive = "PartialEq",
    doc = "Selects Pods whose IPs capo holds in a Calico IPReservation after they are deleted or evicted.",
    printcolumn(name = "Reserve-For", type_ = "string", json_path = ".spec.reserveFor"),
    printcolumn(name = "Max", type_ = "integer", json_path = ".spec.maxReserved"),
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = 1
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("size(self.metadata.name) <= 63").message("a CapoPolicy name is at most 63 characters: capo labels its reservations and records with it (capo.io/policy), and a label value is at most 63")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.namespaceSelector) || has(self.podSelector) || has(self.workloads)").message("a policy must select something: set namespaceSelector, podSelector or workloads (an empty podSelector {} selects every Pod)"))]
pub struct CapoPolicySpec {
    /// Namespaces whose Pods this policy covers (by namespace labels). Absent: every
    /// namespace except those capo always skips (kube-system and its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,

    /// Pods this policy covers (by Pod labels). Absent: every Pod in the selected namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,

    /// Restrict the policy to Pods controlled by these workloads (matched through the Pod's
    /// controller owner reference). Absent: no restriction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub workloads: Option<Vec<WorkloadRef>>,

    /// How long a held IP stays held after its Pod is gone, e.g. `40m`.
    #[serde(default = "default_reserve_for")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("reserveFor must be at least 1s"))]
    pub reserve_for: String,

    /// The most IPs this policy holds at once; past it the oldest (by when the API server
    /// recorded them) are released first. Size it to fit a whole failed node, e.g. 1.2 ×
    /// the nodes' maxPods. capo spreads a policy's holds over as many reservation objects
    /// as this needs, so any value up to 100000 works.
    #[serde(default = "default_max_reserved")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_reserved: u32,

    /// The most IPs this policy holds for the Pods of one namespace; past it that
    /// namespace's oldest holds are released first, whatever other namespaces hold. Set it
    /// when one policy covers the namespaces of several teams, so that a storm of
    /// deletions in one namespace cannot push the other teams' holds out at the cap.
    /// Absent: no share, only `maxReserved`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_reserved_per_namespace: Option<u32>,

    /// The most of an IP pool's unused addresses this policy may hold, in percent: of the
    /// addresses of a Calico IPPool that no Pod uses (the pool's size minus what Calico's
    /// IPAM has allocated), this policy's holds take at most this share; past it, its
    /// oldest holds in that pool are released first, at the policy's pace. Deletions are
    /// never refused for it. capo's `--max-pool-share` bounds all policies together.
    /// Absent: only that global bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_pool_share: Option<u32>,

    /// The least time between two releases of this policy's IPs (release pacing).
    #[serde(default = "default_release_interval")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    pub release_interval: String,

    /// When several policies select a Pod, the highest priority wins; ties go to the
    /// policy whose name sorts first.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,

    /// What to do when the hold cannot be written before answering the API server.
    #[serde(default)]
    pub on_hold_failure: HoldFailureAction,

    /// When not to hold at all.
    #[serde(default)]
    pub skip: SkipRules,

    /// When to release before the TTL runs out because nobody will come back for the IP.
    #[serde(default)]
    pub release_early: ReleaseEarly,

    /// The most IPs of this policy released in one batch (one write per
    /// `releaseInterval`), so a burst of expiries does not hand many just-freed IPs to
    /// one wave of new Pods. Releases over `maxReserved` are never held back by it.
    #[serde(default = "default_release_batch")]
    #[schemars(range(min = 1, max = 1000))]
    pub release_batch: u32,

    /// What a Pod may ask for through its annotations.
    #[serde(default)]
    pub pod_overrides: PodOverrides,

    /// Sticky IPs (opt-in): a StatefulSet Pod created again under the same name gets its
    /// held addresses back, instead of new ones, while they are held.
    #[serde(default, skip_serializing_if = "Sticky::is_off")]
    pub sticky: Sticky,
}

fn default_reserve_for() -> String {
    DEFAULT_RESERVE_FOR.to_string()
}
fn default_max_reserved() -> u32 {
    DEFAULT_MAX_RESERVED
}
fn default_release_interval() -> String {
    DEFAULT_RELEASE_INTERVAL.to_string()
}
fn default_release_batch() -> u32 {
    DEFAULT_RELEASE_BATCH
}
fn default_true() -> bool {
    true
}

/// A workload whose Pods a policy covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    pub kind: WorkloadKind,
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum WorkloadKind {
    StatefulSet,
    Deployment,
    ReplicaSet,
    DaemonSet,
}

/// What the webhook answers when it cannot write the hold in time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum HoldFailureAction {
    /// Refuse the deletion or eviction with the reason; controllers and `kubectl drain`
    /// retry. Keeps the guarantee that an allowed deletion always has its IPs held.
    #[default]
    Deny,
    /// Let the deletion proceed and retry the hold in the background (the safety net).
    Allow,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkipRules {
    /// Do not hold IPs of Pods whose namespace is being deleted: nobody comes back for them.
    #[serde(default = "default_true")]
    pub namespace_terminating: bool,
    /// Do not hold IPs of Pods deleted by the garbage collector because their owning
    /// workload was deleted ("deleting the cluster needs no hold").
    #[serde(default = "default_true")]
    pub owner_deleted: bool,
}

impl Default for SkipRules {
    fn default() -> Self {
        Self { namespace_terminating: true, owner_deleted: true }
    }
}

/// Early release: the held IP is released before its TTL when nobody comes back for it.
/// Both default to false: the IP stays held for the full `reserveFor`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseEarly {
    /// Release as soon as the Pod's controller (StatefulSet or ReplicaSet) is deleted.
    #[serde(default)]
    pub workload_deleted: bool,
    /// Release as soon as the Pod's namespace is deleted.
    #[serde(default)]
    pub namespace_deleted: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.minReserveFor) || !has(self.maxReserveFor) || duration(self.minReserveFor) <= duration(self.maxReserveFor)").message("podOverrides.minReserveFor must not exceed podOverrides.maxReserveFor"))]
pub struct PodOverrides {
    /// Pods may opt in with the `capo.io/policy: <name>` or `capo.io/hold: "true"`
    /// annotation even when `podSelector`/`workloads` do not select them (the
    /// `namespaceSelector` still applies). Off by default: whoever can create a Pod in a
    /// covered namespace could otherwise add holds that count against this policy's cap
    /// and push other teams' holds out.
    #[serde(default)]
    pub allow_opt_in: bool,
    /// Shortest hold a Pod may ask for with `capo.io/reserve-for`. Absent with
    /// `maxReserveFor` absent: the annotation is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    pub min_reserve_for: Option<String>,
    /// Longest hold a Pod may ask for with `capo.io/reserve-for`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    pub max_reserve_for: Option<String>,
}

/// Sticky IPs: capo's mutating webhook names the held addresses in the recreated Pod's
/// `cni.projectcalico.org/ipAddrs`, and Calico's CNI plugin assigns exactly those.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Sticky {
    /// Hand held addresses back to the Pod that replaces the deleted one (same namespace,
    /// name and StatefulSet). A Pod annotated `capo.io/sticky: "false"` opts out.
    #[serde(default)]
    pub enabled: bool,
    /// How long the recreated Pod may take to come up with its old addresses. Past it capo
    /// removes the annotation, so the Pod gets new addresses, and the old ones stay held
    /// for the rest of their time. Also the bound of a hold's claims: however often the Pod
    /// is created again, they end this long after the first.
    #[serde(default = "default_sticky_fallback_after")]
    #[schemars(regex(pattern = crate::duration::PATTERN), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('5s')").message("sticky.fallbackAfter must be at least 5s"))]
    pub fallback_after: String,
}

fn default_sticky_fallback_after() -> String {
    DEFAULT_STICKY_FALLBACK_AFTER.to_string()
}

impl Default for Sticky {
    fn default() -> Self {
        Self { enabled: false, fallback_after: default_sticky_fallback_after() }
    }
}

impl Sticky {
    fn is_off(&self) -> bool {
        *self == Self::default()
    }
}

/// Health only; counters live in metrics (status churn would make Argo CD re-sync).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapoPolicyStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl CapoPolicyStatus {
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

pub const READY_CONDITION: &str = "Ready";
