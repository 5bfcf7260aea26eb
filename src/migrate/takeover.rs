//! `capo take-over`: the IPs the original capo holds, taken over by capo with their
//! original reserve times, so the switch drops no hold and moves no due time.
//!
//! The original keeps its holds in the `projectcalico.org/v3` IPReservation
//! `ip-reserve-delay-release` (bare IPs, a placeholder `1.1.1.1`, possibly duplicates)
//! and in the ConfigMap `ip-reserve/ip-reserve-delay-release`, whose data maps each IP
//! to `<namespace>_<pod>_<node>_<YYYY-MM-DD-HH:MM:SS>`: the reserve time, in the local
//! time of the original's container. The original counted its TTL from that moment.
//!
//! For every address still reserved there, capo writes a `ReservedIP` (trigger
//! `Migrated`, `reservedAt` and `status.podGoneAt` the original reserve time, so the
//! leader releases it when the original would have) and then the canonical `/32` or
//! `/128` entry in the policy's capo-owned reservation. It never writes the original's
//! objects: remove them once the original is uninstalled. Running it again changes
//! nothing that capo already holds.

use std::collections::BTreeMap;
use std::net::IpAddr;

use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use capo_api::reserved_ip::{record_name, single_ip_cidr};
use capo_api::{CalicoApiGroup, CapoPolicy, HoldTrigger, PodRef, ReservedIP, ReservedIPSpec, ReservedIPStatus};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{self, SignedDuration, Timestamp, civil, tz};
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Error as KubeError};
use serde_json::json;

use crate::calico::{ReservationIndex, Reservations};

/// The original's placeholder entry, reserved forever so its JSON-patch appends worked.
pub const PLACEHOLDER: &str = "1.1.1.1";

#[derive(Clone, Debug)]
pub struct TakeOverSettings {
    /// The CapoPolicy whose reservation takes the IPs over.
    pub policy: String,
    /// The original's namespace (its ConfigMap lives there).
    pub namespace: String,
    /// The original's IPReservation (projectcalico.org/v3).
    pub reservation: String,
    /// The original's ConfigMap of reserve times.
    pub config_map: String,
    /// The UTC offset of the original's container clock.
    pub offset: tz::Offset,
    /// capo's Calico API group (None: detect as capo does).
    pub calico_api: Option<CalicoApiGroup>,
    /// Say what would be done, write nothing.
    pub dry_run: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    #[error("CapoPolicy {0} does not exist: create it first (capo migrate prints the policies)")]
    NoPolicy(String),
    #[error(
        "no IPReservation {0} in projectcalico.org/v3: nothing to take over (is calico-apiserver running, and is this the original's name?)"
    )]
    NoOriginal(String),
    #[error("CapoPolicy {policy} has a reserveFor capo cannot read: {value:?}")]
    BadPolicy { policy: String, value: String },
    #[error("reading {what}: {source}")]
    Read { what: String, source: KubeError },
    #[error("writing the hold of {ip}: {message}")]
    Write { ip: IpAddr, message: String },
}

impl TakeOverError {
    /// The exit code of `capo take-over`.
    pub fn exit_code(&self) -> u8 {
        match self {
            TakeOverError::NoPolicy(_) | TakeOverError::NoOriginal(_) | TakeOverError::BadPolicy { .. } => 2,
            TakeOverError::Read { source: KubeError::Api(s), .. } if s.code == 403 => 4,
            _ => 1,
        }
    }
}

/// What the original recorded of one held IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OriginalHold {
    pub ip: IpAddr,
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub node: Option<String>,
    /// `None`: no readable reserve time (capo counts from now).
    pub reserved_at: Option<Timestamp>,
    /// Why something is missing, if it is.
    pub note: Option<String>,
}

/// An entry of the original's that is not taken over, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub entry: String,
    pub why: String,
}

/// Parses `<namespace>_<pod>_<node>_<YYYY-MM-DD-HH:MM:SS>` (names cannot contain `_`).
pub fn parse_value(value: &str, offset: tz::Offset) -> Result<(String, String, String, Timestamp), String> {
    let parts: Vec<&str> = value.trim().splitn(4, '_').collect();
    let [namespace, pod, node, time] = parts[..] else {
        return Err(format!("{value:?} is not <namespace>_<pod>_<node>_<time>"));
    };
    let at = civil::DateTime::strptime("%Y-%m-%d-%H:%M:%S", time)
        .map_err(|e| format!("{time:?} is not a time of the form 2024-05-01-13:45:00: {e}"))?;
    let at =
        at.to_zoned(tz::TimeZone::fixed(offset)).map_err(|e| format!("{time:?} at offset {offset}: {e}"))?.timestamp();
    Ok((namespace.to_string(), pod.to_string(), node.to_string(), at))
}

/// The address of an original entry: a bare IP, or a single-address CIDR.
fn entry_ip(entry: &str) -> Option<IpAddr> {
    if let Ok(ip) = entry.trim().parse::<IpAddr>() {
        return Some(ip);
    }
    let net: ipnet::IpNet = entry.trim().parse().ok()?;
    (net.prefix_len() == net.max_prefix_len()).then_some(net.addr())
}

/// Which of the original's entries to take over, with what it recorded of each. Pure.
pub fn plan(
    entries: &[String],
    data: &BTreeMap<String, String>,
    offset: tz::Offset,
) -> (Vec<OriginalHold>, Vec<Skipped>) {
    let mut holds: Vec<OriginalHold> = Vec::new();
    let mut skipped = Vec::new();
    let by_ip: BTreeMap<IpAddr, &String> = data.iter().filter_map(|(k, v)| Some((k.trim().parse().ok()?, v))).collect();
    for entry in entries {
        let Some(ip) = entry_ip(entry) else {
            skipped.push(Skipped { entry: entry.clone(), why: "not a single address".into() });
            continue;
        };
        if holds.iter().any(|h| h.ip == ip) {
            continue; // a duplicate the original had not deduplicated yet
        }
        let recorded = by_ip.get(&ip);
        if entry.trim() == PLACEHOLDER && recorded.is_none() {
            skipped.push(Skipped { entry: entry.clone(), why: "the original's placeholder".into() });
            continue;
        }
        let hold = match recorded.map(|v| parse_value(v, offset)) {
            Some(Ok((namespace, pod, node, at))) => OriginalHold {
                ip,
                namespace: Some(namespace),
                pod: Some(pod),
                node: Some(node),
                reserved_at: Some(at),
                note: None,
            },
            Some(Err(why)) => OriginalHold {
                ip,
                namespace: None,
                pod: None,
                node: None,
                reserved_at: None,
                note: Some(format!("its ConfigMap entry is unreadable ({why}); counted from now")),
            },
            None => OriginalHold {
                ip,
                namespace: None,
                pod: None,
                node: None,
                reserved_at: None,
                note: Some("no ConfigMap entry; counted from now".into()),
            },
        };
        holds.push(hold);
    }
    for (ip, _) in by_ip {
        if !holds.iter().any(|h| h.ip == ip) && !entries.iter().any(|e| entry_ip(e) == Some(ip)) {
            skipped.push(Skipped { entry: ip.to_string(), why: "in the ConfigMap only: no longer reserved".into() });
        }
    }
    (holds, skipped)
}

/// What happened to one IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    TakenOver,
    /// capo holds it already (its own webhook, or an earlier take-over): left as it is.
    AlreadyHeld,
    WouldTakeOver,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub hold: OriginalHold,
    pub release_at: Timestamp,
    pub outcome: Outcome,
}

#[derive(Clone, Debug)]
pub struct Report {
    pub reservation: String,
    pub rows: Vec<Row>,
    pub skipped: Vec<Skipped>,
}

impl Report {
    pub fn render(&self) -> String {
        let mut out = format!("{:<40} {:<40} {:<26} {:<26} WHAT\n", "IP", "POD", "RESERVED-AT", "RELEASE-AT");
        for r in &self.rows {
            let pod = match (&r.hold.namespace, &r.hold.pod) {
                (Some(ns), Some(p)) => format!("{ns}/{p}"),
                _ => "-".into(),
            };
            let reserved =
                r.hold.reserved_at.map_or("-".to_string(), |t| t.round(jiff::Unit::Second).unwrap_or(t).to_string());
            let what = match r.outcome {
                Outcome::TakenOver => format!("taken over into {}", self.reservation),
                Outcome::AlreadyHeld => "already held by capo: left as it is".into(),
                Outcome::WouldTakeOver => format!("would be taken over into {} (dry run)", self.reservation),
            };
            let note = r.hold.note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default();
            let release = r.release_at.round(jiff::Unit::Second).unwrap_or(r.release_at);
            out.push_str(&format!(
                "{:<40} {:<40} {:<26} {:<26} {what}{note}\n",
                r.hold.ip,
                pod,
                reserved,
                release.to_string()
            ));
        }
        for s in &self.skipped {
            out.push_str(&format!("{:<40} skipped: {}\n", s.entry, s.why));
        }
        out
    }
}

/// Reads the original's state and takes it over (see the module docs).
pub async fn take_over(client: Client, s: &TakeOverSettings) -> Result<Report, TakeOverError> {
    let read = |what: String| move |source| TakeOverError::Read { what, source };
    let policy = Api::<CapoPolicy>::all(client.clone())
        .get_opt(&s.policy)
        .await
        .map_err(read(format!("CapoPolicy {}", s.policy)))?
        .ok_or_else(|| TakeOverError::NoPolicy(s.policy.clone()))?;
    let reserve_for = policy.spec.reserve_for.clone();
    let ttl = reserve_for
        .parse::<capo_api::Duration>()
        .map_err(|_| TakeOverError::BadPolicy { policy: s.policy.clone(), value: reserve_for.clone() })?;
    let ttl = SignedDuration::try_from(ttl.as_std()).unwrap_or(SignedDuration::MAX);

    let original = Api::<DynamicObject>::all_with(client.clone(), &CalicoApiGroup::V3.ip_reservation());
    let original = match original.get_opt(&s.reservation).await {
        Ok(Some(o)) => o,
        Ok(None) => return Err(TakeOverError::NoOriginal(s.reservation.clone())),
        Err(KubeError::Api(e)) if e.code == 404 => return Err(TakeOverError::NoOriginal(s.reservation.clone())),
        Err(e) => return Err(read(format!("IPReservation {}", s.reservation))(e)),
    };
    let entries: Vec<String> = original.data["spec"]["reservedCIDRs"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let data = Api::<ConfigMap>::namespaced(client.clone(), &s.namespace)
        .get_opt(&s.config_map)
        .await
        .map_err(read(format!("ConfigMap {}/{}", s.namespace, s.config_map)))?
        .and_then(|c| c.data)
        .unwrap_or_default();
    let (holds, skipped) = plan(&entries, &data, s.offset);

    let group = match s.calico_api {
        Some(g) => g,
        None => crate::calico::detect_calico_api(&client, None).await.chosen,
    };
    let reservation = format!("capo-{}", s.policy);
    let records = Api::<ReservedIP>::all(client.clone());
    // No watched copy here: the entries go to the policy's first reservation (or the next
    // one with room), where capo's leader releases them.
    let reservations = Reservations::new(client.clone(), group, std::sync::Arc::new(ReservationIndex::default()));
    let now = Timestamp::now();
    let mut rows = Vec::new();
    for hold in holds {
        let reserved_at = hold.reserved_at.unwrap_or(now);
        let release_at = reserved_at.checked_add(ttl).unwrap_or(Timestamp::MAX);
        let name = record_name(hold.ip);
        let existing = records.get_opt(&name).await.map_err(read(format!("ReservedIP {name}")))?;
        let outcome = match (existing, s.dry_run) {
            (Some(_), _) => Outcome::AlreadyHeld,
            (None, true) => Outcome::WouldTakeOver,
            (None, false) => {
                write(
                    &records,
                    &reservations,
                    &s.policy,
                    &reservation,
                    group,
                    &hold,
                    reserved_at,
                    release_at,
                    &reserve_for,
                )
                .await?;
                Outcome::TakenOver
            }
        };
        rows.push(Row { hold, release_at, outcome });
    }
    Ok(Report { reservation, rows, skipped })
}

/// The record (with the original's clock), then the entry: a crash in between leaves a
/// record without entry, which the leader's repair writes back.
#[allow(clippy::too_many_arguments)]
async fn write(
    records: &Api<ReservedIP>,
    reservations: &Reservations,
    policy: &str,
    reservation: &str,
    group: CalicoApiGroup,
    hold: &OriginalHold,
    reserved_at: Timestamp,
    release_at: Timestamp,
    reserve_for: &str,
) -> Result<(), TakeOverError> {
    let fail = |message: String| TakeOverError::Write { ip: hold.ip, message };
    let name = record_name(hold.ip);
    let cidr = single_ip_cidr(hold.ip);
    let mut labels: std::collections::BTreeMap<String, String> =
        [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, policy)]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into();
    if let Some(ns) = &hold.namespace {
        labels.insert(capo_api::keys::NAMESPACE_LABEL.to_string(), ns.clone());
    }
    let record = ReservedIP {
        metadata: ObjectMeta { name: Some(name.clone()), labels: Some(labels), ..Default::default() },
        spec: ReservedIPSpec {
            ip: hold.ip.to_string(),
            cidr: cidr.clone(),
            reservation: reservation.to_string(),
            calico_api_group: group.to_string(),
            policy: policy.to_string(),
            pod: PodRef {
                namespace: hold.namespace.clone().unwrap_or_default(),
                name: hold.pod.clone().unwrap_or_default(),
                uid: String::new(),
                node: hold.node.clone(),
                controller: None,
                addresses: vec![],
            },
            trigger: HoldTrigger::Migrated,
            reserved_at: MicroTime(reserved_at),
            reserve_for: reserve_for.to_string(),
            manual: None,
            forced: false,
        },
        status: None,
    };
    match records.create(&PostParams::default(), &record).await {
        Ok(_) => {}
        Err(KubeError::Api(s)) if s.code == 409 => return Ok(()), // capo held it meanwhile
        Err(e) => return Err(fail(format!("creating ReservedIP {name}: {e}"))),
    }
    // The Pod is long gone: the countdown runs from the original's reserve time.
    let status = ReservedIPStatus {
        pod_gone_at: Some(MicroTime(reserved_at)),
        release_at: Some(MicroTime(release_at)),
        pod_kept_since: None,
        manual: None,
        claim: None,
    };
    records
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
        .await
        .map_err(|e| fail(format!("setting the status of ReservedIP {name}: {e}")))?;
    let shard =
        reservations.hold(policy, 1, &cidr).await.map_err(|e| fail(format!("adding {cidr} to {reservation}: {e}")))?;
    if shard != reservation {
        let patch = json!({ "spec": { "reservation": shard } });
        records
            .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| fail(format!("pointing ReservedIP {name} at {shard}: {e}")))?;
    }
    Ok(())
}

/// Parses a UTC offset: `+08:00`, `-0500`, `Z` or `UTC`.
pub fn parse_offset(s: &str) -> Result<tz::Offset, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("utc") || t == "Z" {
        return Ok(tz::Offset::UTC);
    }
    let bad = || format!("{s:?} is not a UTC offset such as +08:00, -05:00 or UTC");
    let (sign, rest) = match t.as_bytes().first() {
        Some(b'+') => (1, &t[1..]),
        Some(b'-') => (-1, &t[1..]),
        _ => return Err(bad()),
    };
    let digits: String = rest.chars().filter(|c| *c != ':').collect();
    if digits.len() != 4 || !digits.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad());
    }
    let (h, m): (i32, i32) = (digits[..2].parse().map_err(|_| bad())?, digits[2..].parse().map_err(|_| bad())?);
    if h > 14 || m > 59 {
        return Err(bad());
    }
    tz::Offset::from_seconds(sign * (h * 3600 + m * 60)).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_originals_values_are_read_in_its_local_time() {
        let cst = parse_offset("+08:00").unwrap();
        let (ns, pod, node, at) = parse_value("shop_redis-0_node-1_2024-05-01-13:45:00", cst).unwrap();
        assert_eq!((ns.as_str(), pod.as_str(), node.as_str()), ("shop", "redis-0", "node-1"));
        assert_eq!(at.to_string(), "2024-05-01T05:45:00Z");
        let (_, _, _, utc) = parse_value("shop_redis-0_node-1_2024-05-01-13:45:00", tz::Offset::UTC).unwrap();
        assert_eq!(utc.to_string(), "2024-05-01T13:45:00Z");
        assert!(parse_value("shop_redis-0_2024-05-01-13:45:00", cst).unwrap_err().contains("is not <namespace>"));
        assert!(parse_value("a_b_c_yesterday", cst).unwrap_err().contains("\"yesterday\" is not a time"));
        for (s, secs) in [("UTC", 0), ("Z", 0), ("-05:00", -18000), ("+0530", 19800)] {
            assert_eq!(parse_offset(s).unwrap().seconds(), secs, "{s}");
        }
        for bad in ["8", "+8:00", "+25:00", "CST"] {
            assert!(parse_offset(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_placeholder_duplicates_and_garbage_are_skipped() {
        let entries: Vec<String> = ["1.1.1.1", "10.0.0.7", "10.0.0.7", "10.0.0.8/32", "fd00::9", "10.0.1.0/24"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let cm = data(&[
            ("10.0.0.7", "shop_redis-0_node-1_2024-05-01-13:45:00"),
            ("10.0.0.8", "shop_redis-1_node-2_not-a-time"),
            ("10.0.0.99", "shop_redis-9_node-2_2024-05-01-13:45:00"),
        ]);
        let (holds, skipped) = plan(&entries, &cm, tz::Offset::UTC);
        let ips: Vec<String> = holds.iter().map(|h| h.ip.to_string()).collect();
        assert_eq!(ips, ["10.0.0.7", "10.0.0.8", "fd00::9"]);
        assert_eq!(holds[0].pod.as_deref(), Some("redis-0"));
        assert!(holds[0].reserved_at.is_some() && holds[0].note.is_none());
        assert!(holds[1].reserved_at.is_none() && holds[1].note.as_deref().unwrap().contains("unreadable"));
        assert!(holds[2].note.as_deref().unwrap().contains("no ConfigMap entry"));
        let why: Vec<(&str, &str)> = skipped.iter().map(|s| (s.entry.as_str(), s.why.as_str())).collect();
        assert_eq!(
            why,
            [
                ("1.1.1.1", "the original's placeholder"),
                ("10.0.1.0/24", "not a single address"),
                ("10.0.0.99", "in the ConfigMap only: no longer reserved")
            ]
        );
        // A real hold of 1.1.1.1 (it has a ConfigMap entry) is taken over.
        let (holds, _) = plan(&["1.1.1.1".into()], &data(&[("1.1.1.1", "a_b_c_2024-05-01-13:45:00")]), tz::Offset::UTC);
        assert_eq!(holds.len(), 1);
    }
}
