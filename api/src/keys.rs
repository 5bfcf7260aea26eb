//! Labels, annotations and names with a meaning to capo.

/// The label every object capo creates carries (`app.kubernetes.io/managed-by=capo`).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// The value of [`MANAGED_BY_LABEL`] on capo's objects.
pub const MANAGED_BY_VALUE: &str = "capo";
/// On a capo-owned `IPReservation` and on a `ReservedIP`: the policy it belongs to.
pub const POLICY_LABEL: &str = "capo.io/policy";

/// On a `ReservedIP`: the held Pod's namespace, so a tenant lists the holds of theirs
/// (`kubectl get reservedips -l capo.io/namespace=shop`).
pub const NAMESPACE_LABEL: &str = "capo.io/namespace";

/// On a `ReservedIP`: the uid of the held Pod's controller (its StatefulSet), so the
/// webhook finds the holds of a Pod created again by that controller.
pub const OWNER_UID_LABEL: &str = "capo.io/owner-uid";

/// The prefix of every capo label and annotation.
pub const CAPO_PREFIX: &str = "capo.io/";

/// Pod annotation: opt this Pod into the named `CapoPolicy` (the policy must allow opt-in
/// and its `namespaceSelector` must still match the Pod's namespace).
pub const POLICY_ANNOTATION: &str = "capo.io/policy";
/// Pod annotation: `"false"` opts the Pod out of every policy; `"true"` opts it into the
/// highest-priority policy that allows opt-in in its namespace.
pub const HOLD_ANNOTATION: &str = "capo.io/hold";
/// Pod annotation: ask for a longer or shorter hold (a duration such as `2h`), within the
/// bounds the policy's `podOverrides` allow.
pub const RESERVE_FOR_ANNOTATION: &str = "capo.io/reserve-for";
/// Pod annotation: `"false"` opts the Pod out of sticky IPs (its policy's `sticky`).
pub const STICKY_ANNOTATION: &str = "capo.io/sticky";
/// Pod annotation read by Calico's CNI plugin: the addresses the Pod must get (a JSON
/// list). capo's sticky webhook writes it on a recreated Pod.
pub const CALICO_IP_ADDRS_ANNOTATION: &str = "cni.projectcalico.org/ipAddrs";
/// Pod annotation written with [`CALICO_IP_ADDRS_ANNOTATION`]: the held addresses capo
/// handed back, so the leader removes exactly its own annotation on fallback.
pub const STICKY_CLAIM_ANNOTATION: &str = "capo.io/sticky-claim";
/// Pod annotation written by capo's leader when it released the hold of a Pod whose object
/// still exists (a Failed Pod lingers, a deleted one waits on a finalizer): `<reason> <time>`.
/// capo never holds that Pod's IPs again — a hold belongs to one Pod UID, once.
pub const RELEASED_ANNOTATION: &str = "capo.io/released";
/// Pod annotation written by capo's safety net when it saw the Pod terminate without a
/// hold after its IPs already belonged to another Pod: `<ips> <time>`. Reported once.
pub const NOT_HELD_ANNOTATION: &str = "capo.io/not-held";
/// Annotation on a capo-owned `IPReservation`: the epoch (the Lease's `leaseTransitions`)
/// of the leader allowed to remove entries from it. Every leader write tests it, and a new
/// leader raises it before its first write, so a replica that lost the Lease cannot
/// release anything any more, whatever its clock says.
pub const LEADER_EPOCH_ANNOTATION: &str = "capo.io/leader-epoch";

/// Name of the first (and usually only) capo-owned Calico `IPReservation` of a policy,
/// the one object earlier versions of capo used.
pub fn reservation_name(policy: &str) -> String {
    format!("capo-{policy}")
}

/// Name of shard `index` of a policy's reservations: `capo-<policy>` for shard 0, then
/// `capo-<policy>.1`, `capo-<policy>.2`, ...
pub fn shard_name(policy: &str, index: u32) -> String {
    match index {
        0 => reservation_name(policy),
        i => format!("capo-{policy}.{i}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names() {
        assert_eq!(shard_name("redis", 0), "capo-redis");
        assert_eq!(shard_name("redis", 1), "capo-redis.1");
        assert_eq!(shard_name("redis", 49), "capo-redis.49");
    }
}
