//! Where the leader keeps when each hold's countdown started (the moment its stores first
//! showed the hold's Pod gone): one ConfigMap per reservation shard in capo's namespace,
//! one key per hold (the record's UID) and its start as the value. The leader writes a
//! shard's ConfigMap at most once per [`FLUSH_EVERY`] while its countdowns changed, so a
//! storm of holds costs a few writes in all instead of a status write per hold; a new
//! leader reads them all before it counts anything down.
//!
//! A countdown the last flush did not carry (it started less than [`FLUSH_EVERY`] before
//! the leader changed) starts again at the new leader's first look: that hold is released
//! late by at most the flush interval plus the failover, never early.
//!
//! Holds whose record carries `status.podGoneAt` (written by capo before this, or by
//! `capo take-over`) keep counting from there; [`overlay`] shows the others as if it did.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use capo_api::ReservedIP;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::release::decide::{self, PlanSettings};

/// How often, at most, the leader writes one shard's countdowns.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// The label selector of every countdown ConfigMap.
pub const SELECTOR: &str = "app.kubernetes.io/managed-by=capo,app.kubernetes.io/component=countdowns";

/// Annotations naming the shard (`<group>/<name>`) and the policy a ConfigMap is for.
pub const RESERVATION_ANNOTATION: &str = "capo.io/reservation";
pub const POLICY_ANNOTATION: &str = "capo.io/policy";

/// The shard a hold's countdown is kept with: its record's reservation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Part {
    pub group: String,
    pub reservation: String,
    pub policy: String,
}

impl Part {
    pub fn of(rec: &ReservedIP) -> Self {
        Self {
            group: rec.spec.calico_api_group.clone(),
            reservation: rec.spec.reservation.clone(),
            policy: rec.spec.policy.clone(),
        }
    }

    /// The ConfigMap's name: `capo-countdowns-<FNV-1a of group/reservation>` (a shard's name
    /// can be longer than a ConfigMap's name may be with a prefix).
    pub fn object_name(&self) -> String {
        let key = format!("{}/{}", self.group, self.reservation);
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        format!("capo-countdowns-{hash:016x}")
    }
}

/// The ConfigMap holding `starts` (record UID → start) for `part` in `namespace`.
pub fn render(namespace: &str, part: &Part, starts: &BTreeMap<String, Timestamp>) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(part.object_name()),
            namespace: Some(namespace.to_string()),
            labels: Some(
                [("app.kubernetes.io/managed-by", "capo"), ("app.kubernetes.io/component", "countdowns")]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            annotations: Some(
                [
                    (RESERVATION_ANNOTATION.to_string(), format!("{}/{}", part.group, part.reservation)),
                    (POLICY_ANNOTATION.to_string(), part.policy.clone()),
                ]
                .into(),
            ),
            ..Default::default()
        },
        data: Some(starts.iter().map(|(uid, at)| (uid.clone(), at.to_string())).collect()),
        ..Default::default()
    }
}

/// What one countdown ConfigMap says: its shard (if its annotations name one) and its
/// starts, record UID → start (values that are not a time are skipped).
pub fn parse(cm: &ConfigMap) -> (Option<Part>, BTreeMap<String, Timestamp>) {
    let annotations = cm.annotations();
    // The group has a slash of its own (crd.projectcalico.org/v1): the name is after the last.
    let part = annotations.get(RESERVATION_ANNOTATION).and_then(|full| {
        let (group, reservation) = full.rsplit_once('/')?;
        Some(Part {
            group: group.to_string(),
            reservation: reservation.to_string(),
            policy: annotations.get(POLICY_ANNOTATION).cloned().unwrap_or_default(),
        })
    });
    let starts =
        cm.data.iter().flatten().filter_map(|(uid, at)| Some((uid.clone(), at.parse::<Timestamp>().ok()?))).collect();
    (part, starts)
}

/// Every countdown ConfigMap in `namespace` (`None`: in all namespaces).
pub async fn list(client: &Client, namespace: Option<&str>) -> Result<Vec<ConfigMap>, kube::Error> {
    let api: Api<ConfigMap> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    Ok(api.list(&ListParams::default().labels(SELECTOR)).await?.items)
}

/// Every countdown start in `namespace` (`None`: all namespaces), by record UID.
pub async fn read(client: &Client, namespace: Option<&str>) -> Result<HashMap<String, Timestamp>, kube::Error> {
    Ok(list(client, namespace).await?.iter().flat_map(|cm| parse(cm).1).collect())
}

/// `rec` as it would read had the leader written its countdown into its status: a record
/// without `status.podGoneAt` whose UID has a start gets `podGoneAt` and `releaseAt` (the
/// operator's `extend`, or `reserveFor` after the start).
pub fn overlay(rec: &mut ReservedIP, starts: &HashMap<String, Timestamp>, settings: &PlanSettings) {
    if rec.status.as_ref().is_some_and(|s| s.pod_gone_at.is_some()) {
        return;
    }
    let Some(gone) = rec.metadata.uid.as_ref().and_then(|u| starts.get(u)).copied() else { return };
    let release_at = decide::release_at(rec, gone, settings);
    let status = rec.status.get_or_insert_with(Default::default);
    status.pod_gone_at = Some(MicroTime(gone));
    status.release_at = Some(MicroTime(release_at));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part() -> Part {
        Part { group: "crd.projectcalico.org/v1".into(), reservation: "capo-redis.3".into(), policy: "redis".into() }
    }

    #[test]
    fn a_rendered_configmap_parses_back_to_its_shard_and_starts() {
        let at: Timestamp = "2026-11-28T15:00:00.123456Z".parse().unwrap();
        let starts = BTreeMap::from([("uid-a".to_string(), at)]);
        let cm = render("capo-system", &part(), &starts);
        assert!(cm.name_any().starts_with("capo-countdowns-") && cm.name_any().len() == 32, "{}", cm.name_any());
        let (p, s) = parse(&cm);
        assert_eq!(p, Some(part()));
        assert_eq!(s, starts, "to the microsecond");
    }

    #[test]
    fn each_shard_and_group_has_its_own_object() {
        let mut other = part();
        other.reservation = "capo-redis.4".into();
        assert_ne!(part().object_name(), other.object_name());
        other = part();
        other.group = "projectcalico.org/v3".into();
        assert_ne!(part().object_name(), other.object_name());
        assert_eq!(part().object_name(), part().object_name(), "stable");
    }

    #[test]
    fn a_value_that_is_not_a_time_is_skipped() {
        let mut cm = render("ns", &part(), &BTreeMap::new());
        cm.data = Some([("a".to_string(), "soon".to_string())].into());
        assert!(parse(&cm).1.is_empty());
    }
}
