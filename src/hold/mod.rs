//! Holding an IP: its `/32` or `/128` entry in the policy's capo-owned Calico
//! `IPReservation`, and its `ReservedIP` record, written concurrently.

mod calico;
mod detect;
mod records;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capo_api::reserved_ip::{PodRef, record_name, single_ip_cidr};
use capo_api::{HoldTrigger, ReservedIPSpec};
use futures::future::join_all;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Client;

pub use calico::{CalicoError, Reservations};
pub use detect::detect_calico_api;
pub use records::{RecordError, RecordOutcome, Records};

use crate::pod::PodFacts;

/// What to hold, decided by the matcher.
pub struct HoldRequest<'a> {
    pub policy: &'a str,
    pub reserve_for: std::time::Duration,
    pub pod: &'a PodFacts,
    pub trigger: HoldTrigger,
}

/// One IP that is now held.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    pub ip: IpAddr,
    pub reservation: String,
    pub record: RecordOutcome,
}

#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("reservation entry {cidr} in IPReservation {reservation}: {source}")]
    Reservation { cidr: String, reservation: String, source: CalicoError },
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

/// How long this replica remembers a hold it wrote, to answer a repeated review of the
/// same deletion (the API server re-validates a DELETE when its cached Pod was stale)
/// without writing again. Far shorter than any hold: nothing is released this soon.
const RECENT: Duration = Duration::from_secs(30);

/// Writes holds for one Calico API group.
#[derive(Clone)]
pub struct HoldWriter {
    reservations: Reservations,
    records: Records,
    /// (Pod UID, IP) written in the last [`RECENT`], with when.
    recent: Arc<Mutex<HashMap<(String, IpAddr), Instant>>>,
}

impl HoldWriter {
    pub fn new(client: Client, calico: capo_api::CalicoApiGroup) -> Self {
        Self {
            reservations: Reservations::new(client.clone(), calico),
            records: Records::new(client),
            recent: Default::default(),
        }
    }

    /// Whether every IP of the Pod was held by this replica moments ago.
    fn recently_held(&self, pod: &PodFacts, reservation: &str) -> Option<Vec<Held>> {
        let mut recent = self.recent.lock().expect("recent holds lock");
        recent.retain(|_, at| at.elapsed() < RECENT);
        pod.ips
            .iter()
            .map(|&ip| {
                recent.contains_key(&(pod.uid.clone(), ip)).then(|| Held {
                    ip,
                    reservation: reservation.to_string(),
                    record: RecordOutcome::Kept,
                })
            })
            .collect()
    }

    fn remember(&self, pod: &PodFacts) {
        let now = Instant::now();
        let mut recent = self.recent.lock().expect("recent holds lock");
        for &ip in &pod.ips {
            recent.insert((pod.uid.clone(), ip), now);
        }
    }

    pub fn calico_api(&self) -> capo_api::CalicoApiGroup {
        self.reservations.group()
    }

    /// Holds every IP of the Pod: all reservation entries and records are written
    /// concurrently; succeeds only when every one of them is in place.
    pub async fn hold(&self, req: &HoldRequest<'_>) -> Result<Vec<Held>, Vec<HoldError>> {
        let reservation = capo_api::keys::reservation_name(req.policy);
        if !req.pod.uid.is_empty()
            && let Some(held) = self.recently_held(req.pod, &reservation)
        {
            return Ok(held);
        }
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let writes = req.pod.ips.iter().map(|&ip| {
            let reservation = reservation.clone();
            let spec = ReservedIPSpec {
                ip: ip.to_string(),
                cidr: single_ip_cidr(ip),
                reservation: reservation.clone(),
                calico_api_group: self.reservations.group().api_version(),
                policy: req.policy.to_string(),
                pod: PodRef {
                    namespace: req.pod.namespace.clone(),
                    name: req.pod.name.clone(),
                    uid: req.pod.uid.clone(),
                    node: req.pod.node.clone(),
                    controller: req
                        .pod
                        .controller
                        .as_ref()
                        .map(|(kind, name)| capo_api::ControllerRef { kind: kind.clone(), name: name.clone() }),
                },
                trigger: req.trigger,
                reserved_at: now.clone(),
                reserve_for: capo_api::Duration::from_std(req.reserve_for).to_string(),
                manual: None,
            };
            async move {
                let cidr = spec.cidr.clone();
                let (entry, record) =
                    tokio::join!(self.reservations.add(&reservation, req.policy, &cidr), self.records.record(ip, spec));
                let mut errors = Vec::new();
                if let Err(source) = entry {
                    errors.push(HoldError::Reservation { cidr, reservation: reservation.clone(), source });
                }
                let mut created = None;
                match record {
                    Ok(outcome) if errors.is_empty() => {
                        return Ok(Held { ip, reservation, record: outcome });
                    }
                    Ok(RecordOutcome::Created { uid }) => created = Some((ip, uid)),
                    Ok(_) => {}
                    Err(source) => errors.push(HoldError::Record { record: record_name(ip), ip, source }),
                }
                Err((errors, created))
            }
        });
        let mut held = Vec::new();
        let mut errors = Vec::new();
        let mut created = Vec::new();
        for result in join_all(writes).await {
            match result {
                Ok(h) => held.push(h),
                Err((e, record)) => {
                    errors.extend(e);
                    created.extend(record);
                }
            }
        }
        if errors.is_empty() {
            self.remember(req.pod);
            return Ok(held);
        }
        // The deletion will be denied: take back the records this request created. (An
        // entry that did get in stays; without a record it is adopted by the leader's
        // repair and released on schedule — the Pod still uses the address meanwhile.)
        created.extend(held.iter().filter_map(|h| match &h.record {
            RecordOutcome::Created { uid } => Some((h.ip, uid.clone())),
            _ => None,
        }));
        self.forget(created).await;
        Err(errors)
    }

    /// A hold that completed after its request was already denied (the deadline passed):
    /// takes back the records it created, so the denied deletion leaves no record.
    pub async fn take_back(&self, held: &[Held]) {
        self.recent.lock().expect("recent holds lock").retain(|(_, ip), _| !held.iter().any(|h| h.ip == *ip));
        let created = held.iter().filter_map(|h| match &h.record {
            RecordOutcome::Created { uid } => Some((h.ip, uid.clone())),
            _ => None,
        });
        self.forget(created.collect()).await;
    }

    async fn forget(&self, created: Vec<(IpAddr, String)>) {
        for (ip, uid) in created {
            if let Err(e) = self.records.forget(ip, &uid).await {
                tracing::warn!(%ip, error = %e, "could not take back the record of a failed hold");
            }
        }
    }
}
