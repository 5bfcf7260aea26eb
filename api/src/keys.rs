//! Labels and annotations with a meaning to capo.

/// The label every object capo creates carries (`app.kubernetes.io/managed-by=capo`).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// The value of [`MANAGED_BY_LABEL`] on capo's objects.
pub const MANAGED_BY_VALUE: &str = "capo";
/// On a capo-owned `IPReservation` and on a `ReservedIP`: the policy it belongs to.
pub const POLICY_LABEL: &str = "capo.io/policy";

/// The prefix of every capo label and annotation.
pub const CAPO_PREFIX: &str = "capo.io/";

/// Pod annotation: opt this Pod into the named `CapoPolicy` (the policy must allow opt-in
/// and its `namespaceSelector` must still match the Pod's namespace).
pub const POLICY_ANNOTATION: &str = "capo.io/policy";
/// Pod annotation: `"false"` opts the Pod out of every policy; `"true"` opts it into the
/// highest-priority policy that allows opt-in in its namespace.
pub const HOLD_ANNOTATION: &str = "capo.io/hold";
/// Pod annotation: ask for a longer or shorter hold (a duration such as `2h`), within the
/// bounds the policy's `reserveForOverride` allows.
pub const RESERVE_FOR_ANNOTATION: &str = "capo.io/reserve-for";

/// Name of the capo-owned Calico `IPReservation` that holds a policy's IPs.
pub fn reservation_name(policy: &str) -> String {
    format!("capo-{policy}")
}
