//! Which holds a bound releases. A policy's cap: past `maxReservedPerNamespace`, that
//! namespace's oldest; then past `maxReserved`, the policy's oldest. The pool guard, per
//! IP pool: past a policy's `maxPoolShare` of the pool's unused addresses, that policy's
//! oldest in the pool; then past `--max-pool-share`, the oldest of all in the pool.
//! Holds whose Pod is still there (a refused eviction, a denied review) go before all
//! others, oldest first. Past the bound itself, tenants share it: the namespace holding
//! the most gives its oldest, one hold at a time, so a namespace that churns gives up its
//! own holds before a quiet namespace loses any (with one namespace: simply the oldest).
//! "Oldest" is by the API server's clock — the record's `creationTimestamp` (seconds) —
//! and only within one second by `reservedAt` (the writing replica's clock), then by name.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::jiff::Timestamp;

/// One hold counting against the cap.
#[derive(Clone, Debug)]
pub struct Counted<'a> {
    pub name: &'a str,
    /// What a share is counted by: the namespace for the cap, the policy for the pool guard.
    pub group: &'a str,
    /// The namespace of the held Pod: past the bound, the namespace holding the most gives.
    pub namespace: &'a str,
    /// Its Pod is still there (a refused eviction, a denied review): such holds go first.
    pub present: bool,
    /// The record's `creationTimestamp` (or, for a hold whose Pod stayed at first, when
    /// it left).
    pub created: Timestamp,
    pub reserved_at: Timestamp,
    /// Kept whatever the bound (a pending sticky claim): counted, never chosen; a bound it
    /// helps pass is met by the others.
    pub kept: bool,
}

fn age_order(a: &Counted<'_>, b: &Counted<'_>) -> std::cmp::Ordering {
    (!a.present, a.created, a.reserved_at, a.name).cmp(&(!b.present, b.created, b.reserved_at, b.name))
}

/// The names of the holds to release, oldest first: past `maxReservedPerNamespace`
/// (`per_namespace`), a namespace's oldest; then past `max`, the oldest of the rest.
pub fn over_cap(max: usize, per_namespace: Option<usize>, holds: Vec<Counted<'_>>) -> Vec<String> {
    over(max, |_| per_namespace, holds)
}

/// The share `percent` of `unused` addresses, in holds (rounded down).
fn share_of(unused: u128, percent: u32) -> usize {
    usize::try_from(unused.saturating_mul(u128::from(percent.min(100))) / 100).unwrap_or(usize::MAX)
}

/// The holds in one pool to release, oldest first: a policy's past its `maxPoolShare`
/// (`policy_percent`) of the pool's `unused` addresses, then all past `global_percent`.
/// Holds are grouped by policy.
pub fn over_pool_share(
    unused: u128,
    global_percent: u32,
    policy_percent: impl Fn(&str) -> Option<u32>,
    holds: Vec<Counted<'_>>,
) -> Vec<String> {
    over(share_of(unused, global_percent), |p| policy_percent(p).map(|pc| share_of(unused, pc)), holds)
}

fn over<'a>(max: usize, per_group: impl Fn(&str) -> Option<usize>, mut holds: Vec<Counted<'a>>) -> Vec<String> {
    holds.sort_by(age_order);
    let mut out: Vec<&Counted<'_>> = Vec::new();
    let mut by_group: BTreeMap<&str, Vec<&Counted<'_>>> = BTreeMap::new();
    for h in &holds {
        by_group.entry(h.group).or_default().push(h);
    }
    for (group, list) in &by_group {
        if let Some(share) = per_group(group) {
            out.extend(list.iter().filter(|h| !h.kept).take(list.len().saturating_sub(share)));
        }
    }
    let chosen: HashSet<&str> = out.iter().map(|h| h.name).collect();
    let left = holds.len() - out.len();
    if left > max {
        let rest: Vec<&Counted<'_>> = holds.iter().filter(|h| !h.kept && !chosen.contains(h.name)).collect();
        out.extend(fairly(rest, left - max));
    }
    out.sort_by(|a, b| age_order(a, b));
    out.into_iter().map(|h| h.name.to_string()).collect()
}

/// `need` of `holds` (in age order): those whose Pod is still there first, oldest first;
/// then, one at a time, the oldest of the namespace holding the most (a tie: the one whose
/// oldest is older).
fn fairly<'a, 'b>(holds: Vec<&'b Counted<'a>>, need: usize) -> Vec<&'b Counted<'a>> {
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, VecDeque};
    let (present, gone): (Vec<_>, Vec<_>) = holds.into_iter().partition(|h| h.present);
    let mut out: Vec<&Counted<'_>> = present.into_iter().take(need).collect();
    let mut by_namespace: BTreeMap<&str, VecDeque<&Counted<'_>>> = BTreeMap::new();
    for h in gone {
        by_namespace.entry(h.namespace).or_default().push_back(h);
    }
    // (how many it holds, its oldest first, its name): the greatest gives next.
    let key = |ns: &'a str, list: &VecDeque<&'b Counted<'a>>| {
        let front = list.front().expect("non-empty");
        (list.len(), Reverse((front.created, front.reserved_at, front.name)), ns)
    };
    let mut heap: BinaryHeap<_> = by_namespace.iter().map(|(ns, list)| key(ns, list)).collect();
    while out.len() < need {
        let Some((_, _, ns)) = heap.pop() else { break };
        let list = by_namespace.get_mut(ns).expect("a namespace of the heap");
        out.push(list.pop_front().expect("non-empty"));
        if !list.is_empty() {
            heap.push(key(ns, list));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64, micros: i64) -> Timestamp {
        Timestamp::from_microsecond(1_800_000_000_000_000 + s * 1_000_000 + micros).unwrap()
    }

    fn hold<'a>(name: &'a str, ns: &'a str, created: i64, reserved: i64) -> Counted<'a> {
        Counted {
            name,
            group: ns,
            namespace: ns,
            present: false,
            created: t(created, 0),
            reserved_at: t(0, reserved),
            kept: false,
        }
    }

    #[test]
    fn the_api_servers_clock_orders_first_and_the_replicas_only_within_a_second() {
        // b was recorded a second after a, by a replica whose clock ran behind.
        let holds = vec![hold("b", "x", 1, -30_000_000), hold("a", "x", 0, 0), hold("c", "x", 1, 5)];
        assert_eq!(over_cap(1, None, holds), vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn a_namespace_over_its_share_gives_up_its_own_oldest_first() {
        let holds = vec![
            hold("team-a-1", "a", 0, 0),
            hold("team-b-1", "b", 1, 0),
            hold("team-b-2", "b", 2, 0),
            hold("team-b-3", "b", 3, 0),
            hold("team-b-4", "b", 4, 0),
        ];
        // A share of 2: b's two oldest go, a keeps its hold though it is the oldest.
        assert_eq!(over_cap(10, Some(2), holds.clone()), vec!["team-b-1".to_string(), "team-b-2".to_string()]);
        // And the policy's cap applies to what is left: of a-1, b-3 and b-4, the two oldest.
        assert_eq!(
            over_cap(1, Some(2), holds),
            ["team-a-1", "team-b-1", "team-b-2", "team-b-3"].map(String::from).to_vec()
        );
    }

    #[test]
    fn a_pool_share_counts_each_policy_then_all_of_them() {
        let holds = vec![
            hold("a-1", "a", 0, 0),
            hold("b-1", "b", 1, 0),
            hold("a-2", "a", 2, 0),
            hold("b-2", "b", 3, 0),
            hold("a-3", "a", 4, 0),
            hold("b-3", "b", 5, 0),
        ];
        // 20 unused addresses: the global 50% allows 10, nothing goes.
        assert!(over_pool_share(20, 50, |_| None, holds.clone()).is_empty());
        // a may hold 10% = 2: its oldest goes; the global bound still allows the rest.
        assert_eq!(over_pool_share(20, 50, |p| (p == "a").then_some(10), holds.clone()), vec!["a-1".to_string()]);
        // 9 unused addresses, global 50% = 4 (rounded down): the two oldest of all go.
        assert_eq!(over_pool_share(9, 50, |_| None, holds.clone()), vec!["a-1".to_string(), "b-1".to_string()]);
        // No unused address at all: everything goes (held addresses count as unused, so
        // this only happens when nothing is held; the rule still has an answer).
        assert_eq!(over_pool_share(0, 50, |_| None, holds).len(), 6);
        // 100% never releases anything the pool could not hold.
        assert!(over_pool_share(6, 100, |_| Some(100), vec![hold("x", "a", 0, 0)]).is_empty());
    }

    #[test]
    fn holds_of_pods_still_there_go_before_holds_of_pods_that_left() {
        let mut staying = hold("evicted-refused", "x", 5, 0);
        staying.present = true;
        let holds = vec![hold("gone-1", "x", 0, 0), hold("gone-2", "x", 1, 0), staying];
        assert_eq!(over_cap(2, None, holds.clone()), vec!["evicted-refused".to_string()]);
        assert_eq!(over_cap(1, None, holds), vec!["evicted-refused".to_string(), "gone-1".to_string()]);
    }

    #[test]
    fn past_the_cap_a_namespace_that_churns_gives_before_a_quiet_one_loses_any() {
        // quiet holds the two oldest; churn six newer ones; a cap of 4 without a
        // per-namespace share: churn gives four, quiet keeps both.
        let mut holds = vec![hold("quiet-1", "quiet", 0, 0), hold("quiet-2", "quiet", 1, 0)];
        let churn: Vec<String> = (0..6).map(|i| format!("churn-{i}")).collect();
        holds.extend(churn.iter().enumerate().map(|(i, n)| hold(n, "churn", 10 + i as i64, 0)));
        assert_eq!(over_cap(4, None, holds.clone()), churn[..4].to_vec());
        // Once level, they give in turn, the older hold first: cap 2 also takes quiet-1
        // (older than churn-4), then churn-4.
        assert_eq!(
            over_cap(2, None, holds),
            ["quiet-1", "churn-0", "churn-1", "churn-2", "churn-3", "churn-4"].map(String::from).to_vec()
        );
    }

    /// Issue 55: a hold kept by a pending sticky claim counts against every bound, and is
    /// never the one chosen: the others give in its place.
    #[test]
    fn a_kept_hold_counts_against_the_bounds_and_is_never_chosen() {
        let mut claimed = hold("claimed", "x", 0, 0);
        claimed.kept = true;
        let holds = vec![claimed, hold("newer", "x", 1, 0), hold("newest", "y", 2, 0)];
        // Cap 2 of three: the oldest goes, unless it is kept; then the next oldest.
        assert_eq!(over_cap(2, None, holds.clone()), vec!["newer".to_string()]);
        // Cap 1: both others go, the kept one stays (over the cap by itself, it waits).
        assert_eq!(over_cap(1, None, holds.clone()), vec!["newer".to_string(), "newest".to_string()]);
        // A namespace share of 1: x is over by the kept one, so its other hold gives.
        assert_eq!(over_cap(10, Some(1), holds.clone()), vec!["newer".to_string()]);
        // Alone past the bound, nothing can be chosen.
        let mut alone = hold("alone", "x", 0, 0);
        alone.kept = true;
        assert!(over_cap(0, Some(0), vec![alone.clone()]).is_empty());
        // The pool guard too: 4 unused, 50% = 2, three held: the oldest not kept goes.
        assert_eq!(over_pool_share(4, 50, |_| None, holds), vec!["newer".to_string()]);
    }

    #[test]
    fn within_the_cap_nothing_goes() {
        assert!(over_cap(3, None, vec![hold("a", "x", 0, 0), hold("b", "x", 1, 0)]).is_empty());
    }
}
