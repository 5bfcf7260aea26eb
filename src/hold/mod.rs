//! Holding an IP: its `/32` or `/128` entry in one of the policy's capo-owned Calico
//! reservations, and its `ReservedIP` record, written concurrently. "Held" is only ever
//! answered when the API server has confirmed both are there. For a repeated review of a
//! hold this replica just made: within 5 s of the append that added the entry, that
//! append's answer (the leader removes no such entry sooner than 6 s after it); later, the
//! entry read now. Either implies the record; see `HoldWriter::recheck`.

pub mod marks;
mod records;
pub mod rule;
pub mod safety_net;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capo_api::reserved_ip::{PodRef, record_name};
use capo_api::{HoldTrigger, ReservedIPSpec};
use futures::future::join_all;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Client;

pub use records::{RecordError, RecordOutcome, Records};

use crate::calico::{CalicoError, Reservations, entry};
use crate::pod::PodFacts;

/// What to hold, decided by the rule.
pub struct HoldRequest<'a> {
    pub policy: &'a str,
    /// How many shards the policy's cap gives it.
    pub shards: u32,
    pub reserve_for: std::time::Duration,
    pub pod: &'a PodFacts,
    pub trigger: HoldTrigger,
    /// Deleted with a grace period of 0: never handed back (sticky IPs).
    pub forced: bool,
}

/// One IP that is now held.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    pub ip: IpAddr,
    pub reservation: String,
    /// The entry's index in the reservation's list, as the API server last confirmed it.
    pub entry_at: Option<usize>,
    pub record: RecordOutcome,
    /// When this request sent the append that added the entry (`None`: it was there
    /// already, or this is a confirmation).
    pub appended: Option<Instant>,
}

impl Held {
    /// Whether this request made the hold (rather than finding it in place).
    pub fn is_new(&self) -> bool {
        self.record.created_here()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("reservation entry {cidr}: {source}")]
    Reservation { cidr: String, source: CalicoError },
    #[error("record {record} for {ip}: {source}")]
    Record { record: String, ip: IpAddr, source: RecordError },
}

impl HoldError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Reservation { source, .. } => source.kind(),
            Self::Record { .. } => "record",
        }
    }
}

/// How long a hold this replica made is checked, not written again, when the same Pod's
/// deletion is reviewed once more (`kubectl drain` retries an eviction a budget refuses
/// every 5 s).
const RECENT_FOR: Duration = Duration::from_secs(30);
/// How long after its append was sent a hold whose entry that append added is answered
/// "held" again with no read at all: the leader removes no entry until
/// [`crate::calico::index::YOUNG_ENTRY`] after its own watch first showed it, which is
/// after the commit, which is after the send.
const ANSWERED_FROM_ACK: Duration = Duration::from_secs(5);
const _: () = assert!(ANSWERED_FROM_ACK.as_millis() < crate::calico::index::YOUNG_ENTRY.as_millis());
/// A hold this replica made a moment ago.
#[derive(Clone)]
struct Recent {
    shard: String,
    record_uid: String,
    made: Instant,
    entry_at: Option<usize>,
    /// When the append that added its entry was sent (`None`: the entry was there already).
    sent: Option<Instant>,
}

/// Writes holds into the active Calico API group.
#[derive(Clone)]
pub struct HoldWriter {
    reservations: Reservations,
    records: Records,
    /// By Pod UID and IP. The API server reviews one deletion several times (and a
    /// client may repeat it); each later review confirms the hold instead of sending both
    /// writes again (an append the server refuses as a duplicate, then a read of the
    /// whole reservation; a create refused as existing, then a read).
    recent: Arc<Mutex<HashMap<(String, IpAddr), Recent>>>,
}

impl HoldWriter {
    pub fn new(client: Client, reservations: Reservations) -> Self {
        Self { reservations, records: Records::new(client), recent: Default::default() }
    }

    /// Never replaces the hold of a Pod the store shows still there with that IP.
    pub fn with_pods(mut self, pods: Arc<crate::store::PodStore>) -> Self {
        self.records = self.records.with_pods(pods);
        self
    }

    pub fn calico_api(&self) -> capo_api::CalicoApiGroup {
        self.reservations.group()
    }

    pub fn reservations(&self) -> &Reservations {
        &self.reservations
    }

    /// Holds every IP of the Pod: all entries and records are written concurrently;
    /// succeeds only when every one of them is in place. On failure the records this
    /// request created are taken back (a denied deletion leaves none).
    pub async fn hold(&self, req: &HoldRequest<'_>) -> Result<Vec<Held>, Vec<HoldError>> {
        let results = join_all(req.pod.ips.iter().map(|&ip| self.hold_ip(req, ip))).await;
        let (held, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
        let held: Vec<Held> = held.into_iter().map(Result::unwrap).collect();
        let mut created = Vec::new();
        let mut failures = Vec::new();
        for (errs, record) in errors.into_iter().filter_map(Result::err) {
            failures.extend(errs);
            created.extend(record);
        }
        if failures.is_empty() {
            self.remember(&req.pod.uid, &held);
            return Ok(held);
        }
        // An entry that did get in stays; without a record it is adopted by the leader's
        // repair and released on schedule.
        created.extend(held.iter().filter(|h| h.is_new()).map(|h| (h.ip, h.record.uid().to_string())));
        self.forget(created).await;
        Err(failures)
    }

    fn remember(&self, pod_uid: &str, held: &[Held]) {
        if pod_uid.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut recent = self.recent.lock().expect("recent holds lock");
        recent.retain(|_, r| now.duration_since(r.made) < RECENT_FOR);
        for h in held {
            let r = Recent {
                shard: h.reservation.clone(),
                record_uid: h.record.uid().to_string(),
                made: now,
                entry_at: h.entry_at,
                sent: h.appended,
            };
            recent.insert((pod_uid.to_string(), h.ip), r);
        }
    }

    /// A hold of this Pod's `ip` this replica made a moment ago, if its entry is in its
    /// shard now. Within [`ANSWERED_FROM_ACK`] of sending the append that added the entry,
    /// the API server's answer to that append says so (the leader leaves a new entry alone
    /// longer than that); later, or for an entry that was there already, one read of the
    /// shard (a quorum read, never the watched copy). `None`: write it as usual.
    ///
    /// The record needs no read of its own. capo removes a record only after its entry
    /// (a release removes the entry first; a record is dropped only when its entry has
    /// been missing), and nothing but the record's own Pod can be held under its IP while
    /// the entry stays. So an entry there now means its record is there too; were it
    /// deleted by hand, the leader adopts the entry as an orphan, and the IP stays held.
    async fn recheck(&self, req: &HoldRequest<'_>, ip: IpAddr) -> Option<Held> {
        let key = (req.pod.uid.clone(), ip);
        let recent = {
            let recent = self.recent.lock().expect("recent holds lock");
            recent.get(&key).filter(|r| r.made.elapsed() < RECENT_FOR).cloned()
        }?;
        let at = if recent.sent.is_some_and(|sent| sent.elapsed() < ANSWERED_FROM_ACK) {
            recent.entry_at
        } else {
            let cidr = entry::canonical(ip);
            Some(self.reservations.confirm(&recent.shard, req.policy, &cidr).await.ok()??)
        };
        Some(Held {
            ip,
            reservation: recent.shard,
            entry_at: at,
            record: RecordOutcome::Kept { uid: recent.record_uid },
            appended: None,
        })
    }

    /// One IP: its entry and its record, concurrently (or, for a hold made a moment ago,
    /// checked).
    async fn hold_ip(
        &self,
        req: &HoldRequest<'_>,
        ip: IpAddr,
    ) -> Result<Held, (Vec<HoldError>, Option<(IpAddr, String)>)> {
        // A forced deletion goes to the record even after a recent hold of the Pod: the
        // hold must come to say so (see `Records::record`).
        if !req.forced
            && let Some(held) = self.recheck(req, ip).await
        {
            return Ok(held);
        }
        let cidr = entry::canonical(ip);
        // The entry and the record name one group, even if a datastore migration moves new
        // holds to another while this one is written.
        let reservations = self.reservations.pinned();
        let foreseen = reservations.foresee(req.policy, req.shards, &cidr);
        let spec = ReservedIPSpec {
            ip: ip.to_string(),
            cidr: cidr.clone(),
            reservation: foreseen.clone(),
            calico_api_group: reservations.group().api_version(),
            policy: req.policy.to_string(),
            pod: PodRef {
                namespace: req.pod.namespace.clone(),
                name: req.pod.name.clone(),
                uid: req.pod.uid.clone(),
                node: req.pod.node.clone(),
                controller: req.pod.controller.clone(),
                addresses: req.pod.ips.iter().map(ToString::to_string).collect(),
            },
            trigger: req.trigger,
            reserved_at: MicroTime(k8s_openapi::jiff::Timestamp::now()),
            reserve_for: capo_api::Duration::from_std(req.reserve_for).to_string(),
            manual: None,
            forced: req.forced,
        };
        let sent = Instant::now();
        let (entry, record) = tokio::join!(
            reservations.hold_placed(req.policy, req.shards, &cidr, Some(&foreseen)),
            self.records.record(ip, spec)
        );
        let mut errors = Vec::new();
        let shard = match entry {
            Ok(placed) => Some(placed),
            Err(source) => {
                errors.push(HoldError::Reservation { cidr: cidr.clone(), source });
                None
            }
        };
        let outcome = match record {
            Ok(outcome) => Some(outcome),
            Err(source) => {
                errors.push(HoldError::Record { record: record_name(ip), ip, source });
                None
            }
        };
        match (shard, outcome) {
            (Some((shard, placed)), Some(outcome)) => {
                if shard != foreseen
                    && outcome.created_here()
                    && let Err(source) = self.records.moved(ip, outcome.uid(), &shard).await
                {
                    let created = Some((ip, outcome.uid().to_string()));
                    return Err((vec![HoldError::Record { record: record_name(ip), ip, source }], created));
                }
                Ok(Held {
                    ip,
                    reservation: shard,
                    entry_at: placed.at,
                    record: outcome,
                    appended: placed.added.then_some(sent),
                })
            }
            (_, outcome) => {
                let created = outcome.filter(RecordOutcome::created_here).map(|o| (ip, o.uid().to_string()));
                Err((errors, created))
            }
        }
    }

    /// A hold that completed after its request was already denied (the deadline passed):
    /// takes back the records it created, so the denied deletion leaves no record.
    pub async fn take_back(&self, held: &[Held]) {
        self.unremember(held);
        let created = held.iter().filter(|h| h.is_new()).map(|h| (h.ip, h.record.uid().to_string()));
        self.forget(created.collect()).await;
    }

    /// Forgets holds taken back: a retry of the denied request must write its hold again,
    /// not be answered "held" from a record that is gone.
    fn unremember(&self, held: &[Held]) {
        let mut recent = self.recent.lock().expect("recent holds lock");
        recent.retain(|(_, ip), r| !held.iter().any(|h| h.ip == *ip && h.record.uid() == r.record_uid));
    }

    async fn forget(&self, created: Vec<(IpAddr, String)>) {
        for (ip, uid) in created {
            if let Err(e) = self.records.forget(ip, &uid).await {
                tracing::warn!(%ip, error = %e, "could not take back the record of a failed hold");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose API server is a closed port: anything that needs a request fails.
    fn offline_writer() -> HoldWriter {
        let config = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let reservations = Reservations::new(client.clone(), capo_api::CalicoApiGroup::CrdV1, Default::default());
        HoldWriter::new(client, reservations)
    }

    #[tokio::test]
    async fn a_hold_taken_back_is_not_remembered_as_made() {
        let writer = offline_writer();
        let held = |ip: &str, uid: &str| Held {
            ip: ip.parse().unwrap(),
            reservation: "capo-p".into(),
            entry_at: Some(0),
            record: RecordOutcome::Created { uid: uid.into() },
            appended: None,
        };
        writer.remember("pod-a", &[held("10.0.0.1", "r1"), held("10.0.0.2", "r2")]);
        writer.remember("pod-b", &[held("10.0.0.3", "r3")]);
        writer.unremember(&[held("10.0.0.1", "r1"), held("10.0.0.3", "other-record")]);
        let recent = writer.recent.lock().unwrap();
        let mut left: Vec<String> = recent.keys().map(|(pod, ip)| format!("{pod} {ip}")).collect();
        left.sort();
        assert_eq!(left, ["pod-a 10.0.0.2", "pod-b 10.0.0.3"], "only the hold taken back is forgotten");
    }

    /// An answer that needed a read is `None` (the API server is a closed port).
    #[tokio::test]
    async fn a_repeated_review_is_answered_from_the_append_only_while_the_leader_leaves_the_entry_alone() {
        let writer = offline_writer();
        let pod = |uid: &str| PodFacts {
            namespace: "redis".into(),
            name: "redis-0".into(),
            uid: uid.into(),
            labels: Default::default(),
            annotations: Default::default(),
            controller: None,
            node: None,
            host_network: false,
            ips: vec!["10.0.0.1".parse().unwrap()],
            phase: None,
            deleting: false,
        };
        let held = |appended: Option<Instant>| Held {
            ip: "10.0.0.1".parse().unwrap(),
            reservation: "capo-p".into(),
            entry_at: Some(3),
            record: RecordOutcome::Created { uid: "r1".into() },
            appended,
        };
        let ask = |uid: &'static str| {
            let writer = writer.clone();
            async move {
                let pod = pod(uid);
                let req = HoldRequest {
                    policy: "p",
                    shards: 1,
                    reserve_for: Duration::from_secs(60),
                    pod: &pod,
                    trigger: HoldTrigger::Delete,
                    forced: false,
                };
                writer.recheck(&req, "10.0.0.1".parse().unwrap()).await
            }
        };
        // The entry this request's append added a moment ago: no read.
        writer.remember("pod-a", &[held(Some(Instant::now()))]);
        let again = ask("pod-a").await.expect("answered from the append, with no read");
        assert_eq!((again.reservation.as_str(), again.entry_at), ("capo-p", Some(3)));
        assert_eq!(again.record, RecordOutcome::Kept { uid: "r1".into() });
        // Sent longer ago than the leader leaves an entry alone: read (and the read fails).
        let long_ago = Instant::now().checked_sub(ANSWERED_FROM_ACK).unwrap();
        writer.remember("pod-b", &[held(Some(long_ago))]);
        assert!(ask("pod-b").await.is_none(), "an old append is no answer");
        // Found there already (its commit may be old): read.
        writer.remember("pod-c", &[held(None)]);
        assert!(ask("pod-c").await.is_none(), "an entry this request did not add needs a read");
        // Another Pod's hold of the same address: not this one's.
        assert!(ask("pod-d").await.is_none());
    }
}
