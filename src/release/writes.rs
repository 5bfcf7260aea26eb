//! The leader's writes to records: each is conditional on the version the leader read
//! (a status patch tests the `resourceVersion`, a deletion carries `uid` and
//! `resourceVersion` preconditions), each checks the fence first, and none is retried by
//! the client behind the leader's back (its client has kube's retry layer off).

use std::time::Duration;

use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use capo_api::reserved_ip::record_name;
use capo_api::{CalicoApiGroup, HoldTrigger, PodRef, ReservedIP, ReservedIPSpec, ReservedIPStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, Error as KubeError, ResourceExt};
use serde_json::json;

use crate::calico::{CalicoError, entry};
use crate::leader::{Fence, NotLeader};

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("IPReservation {reservation}: {source}")]
    Reservation { reservation: String, source: CalicoError },
    #[error("ReservedIP {record}: {source}")]
    Record { record: String, source: KubeError },
    #[error("marking Pod {pod} released: {source}")]
    Mark { pod: String, source: KubeError },
    #[error("the safety net: {0}")]
    SafetyNet(#[from] crate::hold::safety_net::NetError),
}

impl ReleaseError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotLeader(_) => "not_leader",
            Self::Reservation { source, .. } => source.kind(),
            Self::Record { .. } => "record",
            Self::Mark { .. } => "mark",
            Self::SafetyNet(_) => "safety_net",
        }
    }

    /// Whether this replica must stop leading.
    pub fn lost_lead(&self) -> bool {
        matches!(
            self,
            Self::NotLeader(_)
                | Self::Reservation { source: CalicoError::NotLeader(_) | CalicoError::Fenced { .. }, .. }
                | Self::SafetyNet(crate::hold::safety_net::NetError::NotLeader(_))
        )
    }
}

/// What became of a record the leader deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordFate {
    Deleted,
    AlreadyGone,
    /// It changed since the leader read it (re-held for another Pod, an operator's
    /// request): left alone, looked at again.
    Changed,
}

#[derive(Clone)]
pub struct RecordWrites {
    api: Api<ReservedIP>,
    fence: Fence,
}

impl RecordWrites {
    pub fn new(client: Client, fence: Fence) -> Self {
        Self { api: Api::all(client), fence }
    }

    /// Writes `status` if the record is still as read; says whether it was written (not:
    /// the record is gone or changed since, and the watch brings the news).
    pub async fn status(&self, rec: &ReservedIP, status: &ReservedIPStatus) -> Result<bool, ReleaseError> {
        self.fence.check()?;
        let name = rec.name_any();
        let patch: json_patch::Patch = serde_json::from_value(json!([
            { "op": "test", "path": "/metadata/resourceVersion", "value": rec.metadata.resource_version },
            { "op": "add", "path": "/status", "value": status },
        ]))
        .expect("static patch shape");
        match self.api.patch_status(&name, &PatchParams::default(), &Patch::<()>::Json(patch)).await {
            Ok(_) => Ok(true),
            // Gone, or changed since: the watch brings the news and it is looked at again.
            Err(KubeError::Api(s)) if matches!(s.code, 404 | 409 | 422) => Ok(false),
            Err(source) => Err(ReleaseError::Record { record: name, source }),
        }
    }

    /// Deletes the record exactly as read.
    pub async fn delete(&self, rec: &ReservedIP) -> Result<RecordFate, ReleaseError> {
        self.fence.check()?;
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: rec.metadata.uid.clone(),
                resource_version: rec.metadata.resource_version.clone(),
            }),
            ..Default::default()
        };
        match self.api.delete(&rec.name_any(), &dp).await {
            Ok(_) => Ok(RecordFate::Deleted),
            Err(KubeError::Api(s)) if s.code == 404 => Ok(RecordFate::AlreadyGone),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(RecordFate::Changed),
            Err(source) => Err(ReleaseError::Record { record: rec.name_any(), source }),
        }
    }

    /// Reads a record again (after a precondition failed).
    pub async fn read(&self, name: &str) -> Result<Option<ReservedIP>, ReleaseError> {
        self.api.get_opt(name).await.map_err(|source| ReleaseError::Record { record: name.to_string(), source })
    }

    /// Creates a record for an entry found without one; it counts from now. `Ok(false)`:
    /// somebody recorded it meanwhile.
    pub async fn adopt(
        &self,
        group: CalicoApiGroup,
        reservation: &str,
        policy: &str,
        cidr: &str,
        reserve_for: Duration,
    ) -> Result<bool, ReleaseError> {
        self.fence.check()?;
        let Some(ip) = entry::single_ip(cidr) else { return Ok(false) };
        let name = record_name(ip);
        let labels = [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, policy)]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into();
        let rec = ReservedIP {
            metadata: ObjectMeta { name: Some(name.clone()), labels: Some(labels), ..Default::default() },
            spec: ReservedIPSpec {
                ip: ip.to_string(),
                cidr: cidr.to_string(),
                reservation: reservation.to_string(),
                calico_api_group: group.api_version(),
                policy: policy.to_string(),
                pod: PodRef {
                    namespace: String::new(),
                    name: String::new(),
                    uid: String::new(),
                    node: None,
                    controller: None,
                    addresses: vec![],
                },
                trigger: HoldTrigger::Adopted,
                reserved_at: MicroTime(k8s_openapi::jiff::Timestamp::now()),
                reserve_for: capo_api::Duration::from_std(reserve_for).to_string(),
                manual: None,
                forced: false,
            },
            status: None,
        };
        match self.api.create(&PostParams::default(), &rec).await {
            Ok(_) => Ok(true),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(false),
            Err(source) => Err(ReleaseError::Record { record: name, source }),
        }
    }
}
