//! The operator's subcommands (`capo holds`, `capo release`, `capo extend`,
//! `capo policies`), run with the current kubeconfig like kubectl.
//!
//! `release` and `extend` do not release anything themselves: they write the request into
//! the hold's record through its status subresource (`status.manual`, with the user's name
//! from a SelfSubjectReview; `patch reservedips/status` is all it needs) and wait for the
//! leader to carry it out, so only the leader ever releases.
//!
//! Exit codes: 0 done; 1 an API error; 3 no hold for an IP; 4 permission denied; 5 the
//! leader did not act within `--wait`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use capo_api::reserved_ip::record_name;
use capo_api::{CapoPolicy, ManualAction, ManualChange, ReservedIP};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::release::decide::FallBackReason;

/// `-o`, as kubectl takes it: a table, the table with more columns, the rows as JSON or
/// YAML, or the objects' `kind.group/name` (for `xargs kubectl …`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Wide,
    Json,
    Yaml,
    Name,
}

impl Output {
    /// `rows` as JSON or YAML; None for the table formats and `name`.
    pub(crate) fn structured(self, rows: &[serde_json::Value]) -> Option<String> {
        match self {
            Self::Json => Some(serde_json::to_string_pretty(rows).expect("JSON") + "\n"),
            Self::Yaml => Some(serde_saphyr::to_string(&rows).expect("YAML")),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("no hold for {0} (see `capo holds`)")]
    UnknownIp(IpAddr),
    #[error("permission denied: {0}")]
    Forbidden(String),
    #[error("{what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("{0}: the leader did not act in time (is a capo replica running and leading?)")]
    TimedOut(String),
    #[error("{0} was released before the leader saw the extension")]
    ReleasedFirst(IpAddr),
    #[error("{ip}: another request replaced this one before the leader took it ({by})")]
    Superseded { ip: IpAddr, by: String },
}

impl OpsError {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Api { .. } | Self::Superseded { .. } => 1,
            Self::UnknownIp(_) | Self::ReleasedFirst(_) => 3,
            Self::Forbidden(_) => 4,
            Self::TimedOut(_) => 5,
        }
    }

    fn api(what: impl Into<String>, source: kube::Error) -> Self {
        match &source {
            kube::Error::Api(s) if s.code == 403 => Self::Forbidden(s.message.clone()),
            _ => Self::Api { what: what.into(), source },
        }
    }
}

/// `1h2m3s`-style, whole seconds.
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    let (h, m, s) = (s / 3600, (s % 3600) / 60, s % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m"),
    }
}

fn since(now: Timestamp, t: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(t)).unwrap_or_default()
}

/// "Due in" for one hold, as the leader last wrote it.
fn due_in(now: Timestamp, r: &ReservedIP) -> String {
    let status = r.status.clone().unwrap_or_default();
    if r.manual().is_some_and(|m| m.action == ManualAction::Release) {
        return "releasing".into();
    }
    match (status.release_at, status.pod_kept_since) {
        (Some(at), _) if at.0 <= now => "now".into(),
        (Some(at), _) => human(since(at.0, now)),
        (None, Some(_)) => "pod kept".into(),
        (None, None) => "pod not gone".into(),
    }
}

/// The hold's sticky-IP state: claimed by a recreated Pod (and for how long still), fallen
/// back, or never to be handed back (a forced deletion).
fn sticky(now: Timestamp, r: &ReservedIP) -> String {
    match r.claim() {
        Some(c) if c.fell_back_at.is_some() => {
            match c.fell_back_reason.as_deref().and_then(FallBackReason::from_field) {
                Some(FallBackReason::NotShown) => "fell back (not shown in time)".into(),
                Some(FallBackReason::BoundReached) => format!("fell back (claim bound, {} renewals)", c.renewals),
                Some(FallBackReason::Released) => "fell back (released)".into(),
                Some(FallBackReason::WorkloadGone) => "fell back (workload gone)".into(),
                None => "fell back".into(),
            }
        }
        Some(c) if c.pending(now) && c.renewals > 0 => {
            format!("claimed, {} left ({} renewals)", human(since(c.until.0, now)), c.renewals)
        }
        Some(c) if c.pending(now) => format!("claimed, {} left", human(since(c.until.0, now))),
        Some(_) => "claim expired".into(),
        None if r.spec.forced => "no (forced deletion)".into(),
        None => "-".into(),
    }
}

/// Every hold (of Pods in `pod_namespace`, if given), with the countdowns the leader keeps
/// in `capo_namespace` shown in its status as `podGoneAt` and `releaseAt`. Countdowns the
/// caller may not read leave those empty, with a warning on standard error.
pub async fn holds(
    client: Client,
    output: Output,
    pod_namespace: Option<&str>,
    capo_namespace: &str,
) -> Result<String, OpsError> {
    let api = Api::<ReservedIP>::all(client.clone());
    let mut list = api.list(&ListParams::default()).await.map_err(|e| OpsError::api("listing ReservedIPs", e))?.items;
    list.retain(|r| pod_namespace.is_none_or(|ns| r.spec.pod.namespace == ns));
    match crate::release::countdowns::read(&client, Some(capo_namespace)).await {
        Ok(starts) => {
            let settings = crate::release::decide::PlanSettings::default();
            for r in &mut list {
                crate::release::countdowns::overlay(r, &starts, &settings);
            }
        }
        Err(kube::Error::Api(s)) if s.code == 403 => eprintln!(
            "capo: warning: no countdowns (DUE IN): cannot list ConfigMaps in namespace {capo_namespace} \
             (--capo-namespace; the role in docs/operations.md grants it): {}",
            s.message
        ),
        Err(e) => {
            return Err(OpsError::api(
                format!("reading the countdowns in namespace {capo_namespace} (--capo-namespace)"),
                e,
            ));
        }
    }
    list.sort_by(|a, b| (&a.spec.policy, a.spec.reserved_at.0).cmp(&(&b.spec.policy, b.spec.reserved_at.0)));
    let now = Timestamp::now();
    if output == Output::Name {
        return Ok(list.iter().map(|r| format!("reservedip.capo.io/{}\n", r.name_any())).collect());
    }
    let rows: Vec<_> = list
        .iter()
        .map(|r| {
            let st = r.status.clone().unwrap_or_default();
            json!({
                "ip": r.spec.ip, "namespace": r.spec.pod.namespace, "pod": r.spec.pod.name,
                "policy": r.spec.policy, "reservation": r.spec.reservation, "trigger": r.spec.trigger,
                "reservedAt": r.spec.reserved_at, "podGoneAt": st.pod_gone_at, "releaseAt": st.release_at,
                "heldForSeconds": since(now, r.spec.reserved_at.0).as_secs(),
                "dueInSeconds": st.release_at.map(|t| t.0.duration_since(now).as_secs().max(0)),
                "manual": r.manual(),
                "claim": st.claim, "forced": r.spec.forced, "record": r.name_any(),
            })
        })
        .collect();
    if let Some(out) = output.structured(&rows) {
        return Ok(out);
    }
    let wide = output == Output::Wide;
    let mut header = vec!["IP", "POD", "POLICY", "TRIGGER", "HELD FOR", "DUE IN", "STICKY"];
    if wide {
        header.extend(["RESERVATION", "RELEASE AT", "MANUAL", "RECORD"]);
    }
    let mut rows = vec![header.into_iter().map(String::from).collect::<Vec<_>>()];
    for r in &list {
        let pod = if r.spec.pod.name.is_empty() {
            "-".to_string()
        } else {
            format!("{}/{}", r.spec.pod.namespace, r.spec.pod.name)
        };
        let mut row = vec![
            r.spec.ip.clone(),
            pod,
            r.spec.policy.clone(),
            format!("{:?}", r.spec.trigger),
            human(since(now, r.spec.reserved_at.0)),
            due_in(now, r),
            sticky(now, r),
        ];
        if wide {
            let st = r.status.clone().unwrap_or_default();
            row.extend([
                r.spec.reservation.clone(),
                st.release_at.map_or_else(|| "-".into(), |t| t.0.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()),
                r.manual().map_or_else(|| "-".into(), |m| format!("{:?} by {}", m.action, m.by)),
                r.name_any(),
            ]);
        }
        rows.push(row);
    }
    if list.is_empty() {
        return Ok(match pod_namespace {
            Some(ns) => format!("No IPs held for Pods in namespace {ns}.\n"),
            None => "No IPs held.\n".into(),
        });
    }
    Ok(table(&rows))
}

pub async fn policies(client: Client, output: Output) -> Result<String, OpsError> {
    let policies = Api::<CapoPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| OpsError::api("listing CapoPolicies", e))?
        .items;
    let records = Api::<ReservedIP>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| OpsError::api("listing ReservedIPs", e))?
        .items;
    let mut holds: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &records {
        *holds.entry(r.spec.policy.as_str()).or_default() += 1;
    }
    // The pool column is extra: a user who may not list Calico's pools still gets the rest.
    let shares = pool_shares(&client, &records).await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "no POOL-SHARE column");
        BTreeMap::new()
    });
    let state = |p: &CapoPolicy| {
        let cond = p.status.as_ref().and_then(|s| s.condition("Ready"));
        match cond {
            Some(c) if c.status == "True" => ("Ready".to_string(), c.reason.clone()),
            Some(c) => ("NotReady".to_string(), c.reason.clone()),
            None => ("Unknown".to_string(), String::new()),
        }
    };
    if output == Output::Name {
        return Ok(policies.iter().map(|p| format!("capopolicy.capo.io/{}\n", p.name_any())).collect());
    }
    if matches!(output, Output::Json | Output::Yaml) {
        let rows: Vec<_> = policies
            .iter()
            .map(|p| {
                let (st, reason) = state(p);
                json!({ "name": p.name_any(), "state": st, "reason": reason, "priority": p.spec.priority,
                        "holds": holds.get(p.name_any().as_str()).copied().unwrap_or(0),
                        "maxReserved": p.spec.max_reserved, "reserveFor": p.spec.reserve_for,
                        "maxPoolShare": p.spec.max_pool_share,
                        "pools": shares.get(p.name_any().as_str()).cloned().unwrap_or_default().iter()
                            .map(|s| json!({ "pool": s.pool, "held": s.held, "unallocated": s.unused as u64 }))
                            .collect::<Vec<_>>() })
            })
            .collect();
        return Ok(output.structured(&rows).expect("JSON or YAML"));
    }
    let wide = output == Output::Wide;
    let mut header = vec!["NAME", "STATE", "REASON", "HOLDS", "CAP", "RESERVE-FOR", "MAX-POOL-SHARE", "POOL-SHARE"];
    if wide {
        header.extend(["PRIORITY", "RELEASE-INTERVAL", "STICKY", "OPT-IN"]);
    }
    let mut rows = vec![header.into_iter().map(String::from).collect::<Vec<_>>()];
    let pool_column = |policy: &str| {
        let list = shares.get(policy).map(|l| l.iter().map(PoolShare::to_string).collect::<Vec<_>>());
        list.filter(|l| !l.is_empty()).map_or_else(|| "-".to_string(), |l| l.join(","))
    };
    for p in &policies {
        let (st, reason) = state(p);
        let name = p.name_any();
        let mut row = vec![
            name.clone(),
            st,
            reason,
            holds.get(name.as_str()).copied().unwrap_or(0).to_string(),
            p.spec.max_reserved.to_string(),
            p.spec.reserve_for.clone(),
            p.spec.max_pool_share.map_or_else(|| "global".to_string(), |s| format!("{s}%")),
            pool_column(&name),
        ];
        if wide {
            row.extend([
                p.spec.priority.to_string(),
                p.spec.release_interval.clone(),
                p.spec.sticky.enabled.to_string(),
                p.spec.pod_overrides.allow_opt_in.to_string(),
            ]);
        }
        rows.push(row);
    }
    for (policy, n) in &holds {
        if !policies.iter().any(|p| p.name_any() == *policy) {
            let mut row = vec![policy.to_string(), "Deleted".into(), String::new(), n.to_string()];
            row.extend(["-".into(), "-".into(), "-".into(), pool_column(policy)]);
            if wide {
                row.extend(["-".into(), "-".into(), "-".into(), "-".into()]);
            }
            rows.push(row);
        }
    }
    Ok(table(&rows))
}

/// A policy's holds in one Calico IP pool, against the addresses IPAM has not allocated.
#[derive(Clone, Debug)]
struct PoolShare {
    pool: String,
    held: usize,
    unused: u128,
}

impl std::fmt::Display for PoolShare {
    /// `small 25% (7/28)`: 7 held of the pool's 28 unallocated addresses.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = if self.unused == 0 { 0 } else { (self.held as u128 * 100).div_ceil(self.unused) };
        write!(f, "{} {pct}% ({}/{})", self.pool, self.held, self.unused)
    }
}

/// Each policy's holds per Calico IP pool (nothing when Calico's IPAM blocks are not served
/// here), counted as the leader's pool guard counts them.
async fn pool_shares(client: &Client, records: &[ReservedIP]) -> Result<BTreeMap<String, Vec<PoolShare>>, OpsError> {
    let Some(api_version) = crate::calico::pools::calico_ipam_api(client).await else { return Ok(BTreeMap::new()) };
    let store = crate::calico::pools::PoolStore::list(client, &api_version)
        .await
        .map_err(|e| OpsError::api(format!("listing Calico's IP pools and IPAM blocks ({api_version})"), e))?;
    let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in records {
        let Some(ip) = crate::calico::entry::single_ip(&r.spec.cidr) else { continue };
        if let Some(pool) = store.pool_of(ip)
            && !store.is_allocated(ip)
        {
            *counts.entry((r.spec.policy.clone(), pool.name)).or_default() += 1;
        }
    }
    let mut out: BTreeMap<String, Vec<PoolShare>> = BTreeMap::new();
    for ((policy, pool), held) in counts {
        let unused = store.usage(&pool).map(|u| u.unused()).unwrap_or(0);
        out.entry(policy).or_default().push(PoolShare { pool, held, unused });
    }
    Ok(out)
}

fn table(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> =
        (0..rows[0].len()).map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", line.join("   ").trim_end());
    }
    out
}

/// Who is asking, as the API server authenticates them.
async fn whoami(client: &Client) -> String {
    let review = SelfSubjectReview { metadata: Default::default(), status: None };
    match Api::<SelfSubjectReview>::all(client.clone()).create(&PostParams::default(), &review).await {
        Ok(r) => r.status.and_then(|s| s.user_info).and_then(|u| u.username).unwrap_or_else(|| "unknown".into()),
        Err(_) => "unknown".into(),
    }
}

async fn request(client: &Client, ip: IpAddr, change: ManualChange) -> Result<ReservedIP, OpsError> {
    let api = Api::<ReservedIP>::all(client.clone());
    let name = record_name(ip);
    api.get_opt(&name)
        .await
        .map_err(|e| OpsError::api(format!("reading ReservedIP {name}"), e))?
        .ok_or(OpsError::UnknownIp(ip))?;
    // A merge patch keeps the fields it does not name: an earlier request's `until` and
    // `takenAt` are cleared explicitly.
    let mut manual = serde_json::to_value(&change).expect("JSON");
    for field in ["until", "takenAt"] {
        manual.as_object_mut().expect("object").entry(field).or_insert(serde_json::Value::Null);
    }
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({ "status": { "manual": manual } })))
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 404 => OpsError::UnknownIp(ip),
            e => OpsError::api(format!("patching the status of ReservedIP {name}"), e),
        })
}

async fn wait_for<F>(client: &Client, ip: IpAddr, wait: Duration, mut done: F) -> Result<Option<ReservedIP>, OpsError>
where
    F: FnMut(Option<&ReservedIP>) -> bool,
{
    let api = Api::<ReservedIP>::all(client.clone());
    let name = record_name(ip);
    let deadline = Instant::now() + wait;
    loop {
        let current = api.get_opt(&name).await.map_err(|e| OpsError::api(format!("reading ReservedIP {name}"), e))?;
        if done(current.as_ref()) {
            return Ok(current);
        }
        if Instant::now() >= deadline {
            return Err(OpsError::TimedOut(ip.to_string()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn release(client: Client, ips: &[IpAddr], wait: Duration) -> Result<String, OpsError> {
    let by = whoami(&client).await;
    let mut out = String::new();
    for &ip in ips {
        let change = ManualChange {
            action: ManualAction::Release,
            by: by.clone(),
            at: MicroTime(Timestamp::now()),
            until: None,
            taken_at: None,
        };
        request(&client, ip, change).await?;
    }
    for &ip in ips {
        wait_for(&client, ip, wait, |r| r.is_none()).await?;
        let _ = writeln!(out, "{ip} released (requested by {by})");
    }
    Ok(out)
}

pub async fn extend(client: Client, ip: IpAddr, for_: Duration, wait: Duration) -> Result<String, OpsError> {
    let by = whoami(&client).await;
    let until = Timestamp::now()
        .checked_add(SignedDuration::try_from(for_).unwrap_or(SignedDuration::MAX))
        .unwrap_or(Timestamp::MAX);
    let change = ManualChange {
        action: ManualAction::Extend,
        by: by.clone(),
        at: MicroTime(Timestamp::now()),
        until: Some(MicroTime(until)),
        taken_at: None,
    };
    // The API server keeps microseconds: compared so.
    let asked = change.at.0.as_microsecond();
    request(&client, ip, change).await?;
    // Done once the leader noted the request as taken into its plan (it then keeps the hold
    // until `until`); gone first: released before the leader saw the extension.
    let rec = wait_for(&client, ip, wait, |r| {
        r.is_none_or(|r| {
            r.status
                .as_ref()
                .and_then(|s| s.manual.as_ref())
                .is_none_or(|m| m.at.0.as_microsecond() != asked || m.taken_at.is_some())
        })
    })
    .await?;
    let Some(rec) = rec else { return Err(OpsError::ReleasedFirst(ip)) };
    match rec.status.as_ref().and_then(|s| s.manual.as_ref()) {
        Some(m) if m.at.0.as_microsecond() == asked => {
            Ok(format!("{ip} held until {} (extended by {by})\n", until.strftime("%Y-%m-%dT%H:%M:%SZ")))
        }
        other => Err(OpsError::Superseded {
            ip,
            by: other.map_or_else(|| "someone".into(), |m| format!("{:?} by {}", m.action, m.by)),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations() {
        assert_eq!(human(Duration::from_secs(5)), "5s");
        assert_eq!(human(Duration::from_secs(125)), "2m5s");
        assert_eq!(human(Duration::from_secs(7260)), "2h1m");
    }

    #[test]
    fn tables_align() {
        let t = table(&[vec!["A".into(), "BB".into()], vec!["ccc".into(), "d".into()]]);
        assert_eq!(t, "A     BB\nccc   d\n");
    }
}
