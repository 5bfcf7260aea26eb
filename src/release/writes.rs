//! The leader's writes: entries removed from capo-owned reservations, records deleted,
//! status written, orphans adopted. Every write first checks the [`Fence`]: a replica that
//! has lost (or cannot confirm) the Lease writes nothing.

use std::collections::BTreeSet;
use std::time::Duration;

use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use capo_api::reserved_ip::record_name;
use capo_api::{CalicoApiGroup, HoldTrigger, PodRef, ReservedIP, ReservedIPSpec, ReservedIPStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, Error as KubeError, ResourceExt};
use serde_json::json;
use tracing::debug;

use crate::hold::CalicoError;
use crate::leader::{Fence, NotLeader};

const ATTEMPTS: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("IPReservation {reservation}: {source}")]
    Reservation { reservation: String, source: KubeError },
    #[error("IPReservation {reservation} is not managed by capo; capo will not remove entries from it")]
    NotOwned { reservation: String },
    #[error("IPReservation {reservation}: gave up after {ATTEMPTS} attempts that conflicted")]
    Contention { reservation: String },
    #[error("ReservedIP {record}: {source}")]
    Record { record: String, source: KubeError },
    #[error("writing back {cidr} to IPReservation {reservation}: {source}")]
    WriteBack { reservation: String, cidr: String, source: CalicoError },
}

impl ReleaseError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotLeader(_) => "not_leader",
            Self::Reservation { .. } => "reservation",
            Self::NotOwned { .. } => "not_owned",
            Self::Contention { .. } => "contention",
            Self::Record { .. } => "record",
            Self::WriteBack { .. } => "write_back",
        }
    }
}

fn pointer_escape(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// What happened to one record whose entry was removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordFate {
    /// Deleted: the release is complete.
    Deleted,
    /// Already gone.
    AlreadyGone,
    /// Re-held for another Pod meanwhile: the entry was written back, nothing released.
    ReHeld,
}

#[derive(Clone)]
pub struct LeaderWrites {
    client: Client,
    reservations: Api<DynamicObject>,
    records: Api<ReservedIP>,
    group: CalicoApiGroup,
    fence: Fence,
}

impl LeaderWrites {
    pub fn new(client: Client, group: CalicoApiGroup, fence: Fence) -> Self {
        Self {
            reservations: Api::all_with(client.clone(), &group.ip_reservation()),
            records: Api::all(client.clone()),
            client,
            group,
            fence,
        }
    }

    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// Removes `cidrs` from the capo-owned reservation with one JSON patch: for each entry,
    /// a `test` of its value at its index, then `remove` (highest index first). The server
    /// applies it to the latest version: appends by other replicas land behind and are not
    /// touched, and if anything moved the tests fail and capo reads again. Entries that are
    /// no longer there count as removed. Returns the entries actually removed.
    pub async fn remove_entries(
        &self,
        reservation: &str,
        cidrs: &BTreeSet<String>,
    ) -> Result<BTreeSet<String>, ReleaseError> {
        let label_path = format!("/metadata/labels/{}", pointer_escape(MANAGED_BY_LABEL));
        let err = |source| ReleaseError::Reservation { reservation: reservation.to_string(), source };
        for attempt in 0..ATTEMPTS {
            self.fence.check()?;
            let Some(obj) = self.reservations.get_opt(reservation).await.map_err(err)? else {
                return Ok(BTreeSet::new());
            };
            let owned = obj.metadata.labels.as_ref().and_then(|l| l.get(MANAGED_BY_LABEL)).map(String::as_str)
                == Some(MANAGED_BY_VALUE);
            if !owned {
                return Err(ReleaseError::NotOwned { reservation: reservation.to_string() });
            }
            let entries: Vec<String> = obj.data["spec"][capo_api::calico::RESERVED_CIDRS]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
                .unwrap_or_default();
            let mut ops = vec![json!({ "op": "test", "path": label_path, "value": MANAGED_BY_VALUE })];
            let mut removed = BTreeSet::new();
            for (i, entry) in entries.iter().enumerate().rev() {
                if cidrs.contains(entry) {
                    let path = format!("/spec/{}/{i}", capo_api::calico::RESERVED_CIDRS);
                    ops.push(json!({ "op": "test", "path": path, "value": entry }));
                    ops.push(json!({ "op": "remove", "path": path }));
                    removed.insert(entry.clone());
                }
            }
            if removed.is_empty() {
                return Ok(removed);
            }
            let patch: json_patch::Patch = serde_json::from_value(json!(ops)).expect("static patch shape");
            match self.reservations.patch(reservation, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
                Ok(_) => return Ok(removed),
                Err(KubeError::Api(s)) if matches!(s.code, 409 | 422 | 429 | 500 | 503 | 504) => {
                    debug!(reservation, attempt, code = s.code, "reservation changed meanwhile; reading again");
                    tokio::time::sleep(Duration::from_millis(20 * (1 << attempt))).await;
                }
                Err(e) => return Err(err(e)),
            }
        }
        Err(ReleaseError::Contention { reservation: reservation.to_string() })
    }

    /// Deletes the record of a released entry, if it still holds for `pod_uid`. If it was
    /// re-held for another Pod meanwhile, the entry is written back.
    pub async fn finish_release(
        &self,
        record: &str,
        pod_uid: &str,
        reservation: &str,
    ) -> Result<RecordFate, ReleaseError> {
        let err = |source| ReleaseError::Record { record: record.to_string(), source };
        for _ in 0..ATTEMPTS {
            self.fence.check()?;
            let Some(current) = self.records.get_opt(record).await.map_err(err)? else {
                return Ok(RecordFate::AlreadyGone);
            };
            if current.spec.pod.uid != pod_uid || current.spec.reservation != reservation {
                let cidr = current.spec.cidr.clone();
                self.write_back(&current.spec.reservation, &current.spec.policy, &cidr).await?;
                return Ok(RecordFate::ReHeld);
            }
            match self.delete_unchanged(&current).await.map_err(err)? {
                Some(fate) => return Ok(fate),
                None => continue,
            }
        }
        Err(ReleaseError::Contention { reservation: reservation.to_string() })
    }

    /// Deletes a record whose entry is missing, if it is still the one planned on.
    pub async fn drop_record(&self, record: &str, pod_uid: &str) -> Result<RecordFate, ReleaseError> {
        let err = |source| ReleaseError::Record { record: record.to_string(), source };
        self.fence.check()?;
        let Some(current) = self.records.get_opt(record).await.map_err(err)? else {
            return Ok(RecordFate::AlreadyGone);
        };
        if current.spec.pod.uid != pod_uid {
            return Ok(RecordFate::ReHeld);
        }
        Ok(self.delete_unchanged(&current).await.map_err(err)?.unwrap_or(RecordFate::ReHeld))
    }

    /// Deletes the record exactly as read (uid and resourceVersion preconditions).
    /// `None`: it changed since.
    async fn delete_unchanged(&self, current: &ReservedIP) -> Result<Option<RecordFate>, KubeError> {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: current.metadata.uid.clone(),
                resource_version: current.metadata.resource_version.clone(),
            }),
            ..Default::default()
        };
        match self.records.delete(&current.name_any(), &dp).await {
            Ok(_) => Ok(Some(RecordFate::Deleted)),
            Err(KubeError::Api(s)) if s.code == 404 => Ok(Some(RecordFate::AlreadyGone)),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Puts a record's entry back into its reservation.
    pub async fn write_back(&self, reservation: &str, policy: &str, cidr: &str) -> Result<(), ReleaseError> {
        self.fence.check()?;
        crate::hold::Reservations::new(self.client.clone(), self.group).add(reservation, policy, cidr).await.map_err(
            |source| ReleaseError::WriteBack { reservation: reservation.to_string(), cidr: cidr.to_string(), source },
        )
    }

    pub async fn write_status(&self, record: &str, status: &ReservedIPStatus) -> Result<(), ReleaseError> {
        self.fence.check()?;
        // A merge patch: `null` clears a field the planner dropped.
        let value = json!({ "status": {
            "podGoneAt": status.pod_gone_at,
            "releaseAt": status.release_at,
            "podKeptSince": status.pod_kept_since,
        }});
        match self.records.patch_status(record, &PatchParams::default(), &Patch::Merge(value)).await {
            Ok(_) => Ok(()),
            Err(KubeError::Api(s)) if s.code == 404 => Ok(()),
            Err(source) => Err(ReleaseError::Record { record: record.to_string(), source }),
        }
    }

    /// Creates a record for an entry found without one. It counts from now.
    pub async fn adopt(
        &self,
        reservation: &str,
        policy: &str,
        cidr: &str,
        reserve_for: Duration,
    ) -> Result<bool, ReleaseError> {
        self.fence.check()?;
        let Some(ip) = crate::release::plan::canonical_single_ip(cidr) else { return Ok(false) };
        let name = record_name(ip);
        let labels = [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, policy)]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into();
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let rec = ReservedIP {
            metadata: ObjectMeta { name: Some(name.clone()), labels: Some(labels), ..Default::default() },
            spec: ReservedIPSpec {
                ip: ip.to_string(),
                cidr: cidr.to_string(),
                reservation: reservation.to_string(),
                calico_api_group: self.group.api_version(),
                policy: policy.to_string(),
                pod: PodRef {
                    namespace: String::new(),
                    name: String::new(),
                    uid: String::new(),
                    node: None,
                    controller: None,
                },
                trigger: HoldTrigger::Adopted,
                reserved_at: now,
                reserve_for: capo_api::Duration::from_std(reserve_for).to_string(),
                manual: None,
            },
            status: None,
        };
        match self.records.create(&PostParams::default(), &rec).await {
            Ok(_) => Ok(true),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(false),
            Err(source) => Err(ReleaseError::Record { record: name, source }),
        }
    }
}
