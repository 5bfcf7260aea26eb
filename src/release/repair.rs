//! What one capo-owned reservation needs, decided with no I/O: entries that are not CIDRs
//! at all (one makes every Calico allocation in the cluster fail) are removed; valid CIDRs
//! capo did not write are left in place and reported (invariant 3); an entry without a
//! record is adopted, one recorded in another reservation is redundant — both only once
//! the mismatch has lasted the settle time (the webhook writes entry and record
//! concurrently, and watches lag).

use std::collections::HashMap;
use std::time::Duration;

use capo_api::CalicoApiGroup;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::calico::{ShardView, entry};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Repair {
    /// Not CIDRs: removed.
    pub garbage: Vec<String>,
    /// Valid CIDRs that are not capo's single-address entries: left, reported.
    pub foreign: Vec<String>,
    /// Canonical entries without a record: adopted.
    pub adopt: Vec<String>,
    /// Canonical entries whose IP is recorded in another reservation: removed.
    pub redundant: Vec<String>,
    /// Look again then (a mismatch settling).
    pub wake: Option<Timestamp>,
}

/// Where the record of an IP says its entry is: (group, reservation).
pub type RecordedAt = Option<(CalicoApiGroup, String)>;

/// `first_seen` remembers when each mismatch of this shard was first seen; entries that
/// no longer mismatch are dropped from it.
pub fn plan(
    group: CalicoApiGroup,
    view: &ShardView,
    recorded_at: &dyn Fn(std::net::IpAddr) -> RecordedAt,
    now: Timestamp,
    settle: Duration,
    first_seen: &mut HashMap<String, Timestamp>,
) -> Repair {
    let mut out = Repair::default();
    let mut mismatched = Vec::new();
    for e in &view.entries {
        if !entry::is_cidr(e) {
            out.garbage.push(e.clone());
            continue;
        }
        let Some(ip) = entry::single_ip(e) else {
            out.foreign.push(e.clone());
            continue;
        };
        let here = recorded_at(ip);
        if here.as_ref().is_some_and(|(g, r)| *g == group && *r == view.name) {
            continue;
        }
        mismatched.push(e.clone());
        let first = *first_seen.entry(e.clone()).or_insert(now);
        let ready = first.checked_add(SignedDuration::try_from(settle).unwrap_or(SignedDuration::MAX)).unwrap_or(now);
        if ready > now {
            out.wake = Some(out.wake.map_or(ready, |w| w.min(ready)));
            continue;
        }
        match here {
            Some(_) => out.redundant.push(e.clone()),
            None => out.adopt.push(e.clone()),
        }
    }
    first_seen.retain(|e, _| mismatched.contains(e));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn garbage_goes_foreign_cidrs_stay_and_mismatches_wait_out_the_settle_time() {
        let view = ShardView {
            name: "capo-p".into(),
            entries: ["10.0.0.1/32", "10.0.0.7/32", "10.0.0.8/32", "not-an-ip", "10.0.0.0/24", "FD00::1/128"]
                .map(String::from)
                .to_vec(),
            ..Default::default()
        };
        let recorded = |ip: std::net::IpAddr| match ip.to_string().as_str() {
            "10.0.0.1" => Some((CalicoApiGroup::CrdV1, "capo-p".to_string())),
            "10.0.0.8" => Some((CalicoApiGroup::CrdV1, "capo-q".to_string())),
            _ => None,
        };
        let mut seen = HashMap::new();
        let settle = Duration::from_secs(5);
        let r = plan(CalicoApiGroup::CrdV1, &view, &recorded, at(0), settle, &mut seen);
        assert_eq!(r.garbage, vec!["not-an-ip".to_string()]);
        assert_eq!(r.foreign, vec!["10.0.0.0/24".to_string(), "FD00::1/128".to_string()]);
        assert!(r.adopt.is_empty() && r.redundant.is_empty());
        assert_eq!(r.wake, Some(at(5)));
        let r = plan(CalicoApiGroup::CrdV1, &view, &recorded, at(5), settle, &mut seen);
        assert_eq!(r.adopt, vec!["10.0.0.7/32".to_string()]);
        assert_eq!(r.redundant, vec!["10.0.0.8/32".to_string()]);
        // Recorded here now: forgotten.
        let fixed = |ip: std::net::IpAddr| {
            Some((CalicoApiGroup::CrdV1, if ip.to_string() == "10.0.0.8" { "capo-q" } else { "capo-p" }.to_string()))
        };
        plan(CalicoApiGroup::CrdV1, &view, &fixed, at(6), settle, &mut seen);
        assert_eq!(seen.keys().collect::<Vec<_>>(), vec!["10.0.0.8/32"]);
    }

    /// Where the two groups are two stores (native v3 CRDs beside v1). Where they are one
    /// (calico-apiserver), the leader names both by one group before planning, so the
    /// entry is recorded here (tests/calico_apiserver.rs).
    #[test]
    fn the_same_ip_recorded_in_the_other_group_is_redundant_here() {
        let view = ShardView { name: "capo-p".into(), entries: vec!["10.0.0.1/32".into()], ..Default::default() };
        let v3 = |_: std::net::IpAddr| Some((CalicoApiGroup::V3, "capo-p".to_string()));
        let mut seen = HashMap::new();
        plan(CalicoApiGroup::CrdV1, &view, &v3, at(0), Duration::ZERO, &mut seen);
        let r = plan(CalicoApiGroup::CrdV1, &view, &v3, at(0), Duration::ZERO, &mut seen);
        assert_eq!(r.redundant, vec!["10.0.0.1/32".to_string()]);
    }
}
