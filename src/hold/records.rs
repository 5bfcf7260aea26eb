//! `ReservedIP` records: one per held IP, created once per hold. A repeated deletion of
//! the same Pod keeps the first record (and its `reservedAt`).

use std::net::IpAddr;

use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use capo_api::reserved_ip::record_name;
use capo_api::{ReservedIP, ReservedIPSpec};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, Error as KubeError};

const ATTEMPTS: usize = 5;

#[derive(Debug, Clone, PartialEq)]
pub enum RecordOutcome {
    /// A new hold: the record's uid.
    Created { uid: String },
    /// The same Pod was already held: the first record stays as it was.
    Kept,
    /// The IP was recorded for another Pod; the record now describes this one.
    Replaced { previous_pod: String },
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the ReservedIP API is not served: are capo's CRDs installed?")]
    NotServed,
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("gave up after {ATTEMPTS} conflicting attempts")]
    Contention,
    #[error("{0}")]
    Api(#[source] KubeError),
}

fn classify(e: KubeError) -> RecordError {
    match &e {
        KubeError::Api(s) if super::calico::is_type_not_served(s) => RecordError::NotServed,
        KubeError::Api(s) if s.code == 403 => RecordError::Forbidden(s.message.clone()),
        _ => RecordError::Api(e),
    }
}

#[derive(Clone)]
pub struct Records {
    api: Api<ReservedIP>,
}

impl Records {
    pub fn new(client: Client) -> Self {
        Self { api: Api::all(client) }
    }

    /// Records the hold of `ip` (the address `spec.ip` spells).
    pub async fn record(&self, ip: IpAddr, spec: ReservedIPSpec) -> Result<RecordOutcome, RecordError> {
        let name = record_name(ip);
        let labels = [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, spec.policy.as_str())]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into();
        let fresh = ReservedIP {
            metadata: ObjectMeta { name: Some(name.clone()), labels: Some(labels), ..Default::default() },
            spec,
            status: None,
        };
        for _ in 0..ATTEMPTS {
            match self.api.create(&PostParams::default(), &fresh).await {
                Ok(created) => return Ok(RecordOutcome::Created { uid: created.metadata.uid.unwrap_or_default() }),
                Err(KubeError::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(classify(e)),
            }
            let existing = match self.api.get_opt(&name).await.map_err(classify)? {
                Some(r) => r,
                None => continue, // released meanwhile; create again
            };
            if existing.spec.pod.uid == fresh.spec.pod.uid {
                return Ok(RecordOutcome::Kept);
            }
            let previous_pod = format!("{}/{}", existing.spec.pod.namespace, existing.spec.pod.name);
            let mut replacement = fresh.clone();
            replacement.metadata.resource_version = existing.metadata.resource_version.clone();
            match self.api.replace(&name, &PostParams::default(), &replacement).await {
                Ok(_) => return Ok(RecordOutcome::Replaced { previous_pod }),
                Err(KubeError::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => return Err(classify(e)),
            }
        }
        Err(RecordError::Contention)
    }

    /// Deletes a record this request created, when the rest of its hold failed: a denied
    /// deletion leaves no record behind. Only that very record (uid precondition).
    pub async fn forget(&self, ip: IpAddr, uid: &str) -> Result<(), RecordError> {
        let dp = kube::api::DeleteParams {
            preconditions: Some(kube::api::Preconditions { uid: Some(uid.to_string()), resource_version: None }),
            ..Default::default()
        };
        match self.api.delete(&record_name(ip), &dp).await {
            Ok(_) => Ok(()),
            Err(KubeError::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(classify(e)),
        }
    }
}
