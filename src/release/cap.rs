//! Which holds a policy's cap releases: past `maxReservedPerNamespace`, that namespace's
//! oldest; then past `maxReserved`, the policy's oldest. "Oldest" is by the API server's
//! clock — the record's `creationTimestamp` (seconds) — and only within one second by
//! `reservedAt` (the writing replica's clock), then by name.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::jiff::Timestamp;

/// One hold counting against the cap.
#[derive(Clone, Debug)]
pub struct Counted<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    /// The record's `creationTimestamp`.
    pub created: Timestamp,
    pub reserved_at: Timestamp,
}

fn age_order(a: &Counted<'_>, b: &Counted<'_>) -> std::cmp::Ordering {
    (a.created, a.reserved_at, a.name).cmp(&(b.created, b.reserved_at, b.name))
}

/// The names of the holds to release, oldest first.
pub fn over_cap(max: usize, per_namespace: Option<usize>, mut holds: Vec<Counted<'_>>) -> Vec<String> {
    holds.sort_by(age_order);
    let mut out: Vec<&Counted<'_>> = Vec::new();
    if let Some(share) = per_namespace {
        let mut by_ns: BTreeMap<&str, Vec<&Counted<'_>>> = BTreeMap::new();
        for h in &holds {
            by_ns.entry(h.namespace).or_default().push(h);
        }
        for list in by_ns.values() {
            out.extend(list.iter().take(list.len().saturating_sub(share)));
        }
    }
    let chosen: HashSet<&str> = out.iter().map(|h| h.name).collect();
    let left = holds.len() - out.len();
    if left > max {
        out.extend(holds.iter().filter(|h| !chosen.contains(h.name)).take(left - max));
    }
    out.sort_by(|a, b| age_order(a, b));
    out.into_iter().map(|h| h.name.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64, micros: i64) -> Timestamp {
        Timestamp::from_microsecond(1_800_000_000_000_000 + s * 1_000_000 + micros).unwrap()
    }

    fn hold<'a>(name: &'a str, ns: &'a str, created: i64, reserved: i64) -> Counted<'a> {
        Counted { name, namespace: ns, created: t(created, 0), reserved_at: t(0, reserved) }
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
    fn within_the_cap_nothing_goes() {
        assert!(over_cap(3, None, vec![hold("a", "x", 0, 0), hold("b", "x", 1, 0)]).is_empty());
    }
}
