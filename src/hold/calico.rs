//! capo-owned Calico `IPReservation`s: entries appended without losing a concurrent
//! append, an entry already present counted as success, and no write to an object capo
//! does not own.

use std::time::Duration;

use capo_api::CalicoApiGroup;
use capo_api::calico::RESERVED_CIDRS;
use capo_api::keys::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, POLICY_LABEL};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::Status;
use kube::{Client, Error as KubeError};
use serde_json::json;
use tracing::debug;

/// How often one append retries after conflicts or a lost create race.
const ATTEMPTS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum CalicoError {
    #[error(
        "{api} IPReservation is not served by the API server: is Calico (or its CRDs) installed?"
    )]
    NotServed { api: CalicoApiGroup },
    #[error(
        "IPReservation {name} exists but is not managed by capo (label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE} missing); capo will not touch it"
    )]
    NotOwned { name: String },
    #[error("forbidden: {message}")]
    Forbidden { message: String },
    #[error("gave up after {ATTEMPTS} conflicting attempts")]
    Contention,
    #[error("{0}")]
    Api(#[source] KubeError),
}

impl CalicoError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotServed { .. } => "calico_not_served",
            Self::NotOwned { .. } => "not_owned",
            Self::Forbidden { .. } => "forbidden",
            Self::Contention => "contention",
            Self::Api(_) => "api",
        }
    }
}

#[derive(Clone)]
pub struct Reservations {
    api: Api<DynamicObject>,
    group: CalicoApiGroup,
}

fn status_of(e: &KubeError) -> Option<&Status> {
    match e {
        KubeError::Api(s) => Some(s),
        _ => None,
    }
}

/// The API server's answer when a resource type (not an object) does not exist.
fn is_type_not_served(s: &Status) -> bool {
    s.code == 404 && s.message.contains("could not find the requested resource")
}

impl Reservations {
    pub fn new(client: Client, group: CalicoApiGroup) -> Self {
        Self {
            api: Api::all_with(client, &group.ip_reservation()),
            group,
        }
    }

    pub fn group(&self) -> CalicoApiGroup {
        self.group
    }

    fn classify(&self, e: KubeError) -> CalicoError {
        match status_of(&e) {
            Some(s) if is_type_not_served(s) => CalicoError::NotServed { api: self.group },
            Some(s) if s.code == 403 => CalicoError::Forbidden {
                message: s.message.clone(),
            },
            _ => CalicoError::Api(e),
        }
    }

    /// Appends `cidr` to the reservation `name`, creating it on first use.
    ///
    /// The append is one JSON patch that first tests capo's ownership label and then adds
    /// to the end of the list, so the server applies it to the latest version: concurrent
    /// appends from several replicas cannot overwrite each other. The list is a set, so a
    /// duplicate is rejected by the server, and counts as success here.
    pub async fn add(&self, name: &str, policy: &str, cidr: &str) -> Result<(), CalicoError> {
        let label_path = format!(
            "/metadata/labels/{}",
            MANAGED_BY_LABEL.replace('~', "~0").replace('/', "~1")
        );
        for attempt in 0..ATTEMPTS {
            let patch: json_patch::Patch = serde_json::from_value(json!([
                { "op": "test", "path": label_path, "value": MANAGED_BY_VALUE },
                { "op": "add", "path": format!("/spec/{RESERVED_CIDRS}/-"), "value": cidr },
            ]))
            .expect("static patch");
            let err = match self
                .api
                .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            let Some(status) = status_of(&err) else {
                return Err(CalicoError::Api(err));
            };
            match status.code {
                404 if !is_type_not_served(status) => {
                    if self.create(name, policy, cidr).await? {
                        return Ok(());
                    }
                }
                422 if status.message.contains("Duplicate value") => return Ok(()),
                422 => self.repair_shape(name).await?,
                409 | 429 | 500 | 503 | 504 => {}
                _ => return Err(self.classify(err)),
            }
            debug!(
                reservation = name,
                cidr,
                attempt,
                code = status.code,
                "retrying reservation append"
            );
            tokio::time::sleep(Duration::from_millis(10 * (1 << attempt.min(5)))).await;
        }
        Err(CalicoError::Contention)
    }

    /// Creates the reservation holding `cidr`. `Ok(false)`: somebody created it first.
    async fn create(&self, name: &str, policy: &str, cidr: &str) -> Result<bool, CalicoError> {
        let mut obj = DynamicObject::new(name, &self.group.ip_reservation());
        obj.metadata.labels = Some(
            [(MANAGED_BY_LABEL, MANAGED_BY_VALUE), (POLICY_LABEL, policy)]
                .map(|(k, v)| (k.into(), v.into()))
                .into(),
        );
        obj.data = json!({ "spec": { RESERVED_CIDRS: [cidr] } });
        match self.api.create(&PostParams::default(), &obj).await {
            Ok(_) => Ok(true),
            Err(KubeError::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(self.classify(e)),
        }
    }

    /// A 422 that is not a duplicate: either the object is not capo's (the ownership test
    /// failed) or it has no entry list to append to. Tells the two apart, fixing the
    /// second (only on capo's object, only if unchanged since read).
    async fn repair_shape(&self, name: &str) -> Result<(), CalicoError> {
        let obj = self.api.get(name).await.map_err(|e| self.classify(e))?;
        let owned = obj
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(MANAGED_BY_LABEL))
            .map(String::as_str)
            == Some(MANAGED_BY_VALUE);
        if !owned {
            return Err(CalicoError::NotOwned {
                name: name.to_string(),
            });
        }
        if obj
            .data
            .pointer(&format!("/spec/{RESERVED_CIDRS}"))
            .is_some_and(|v| v.is_array())
        {
            return Ok(()); // Retry the append; whatever failed was transient.
        }
        let rv = obj.metadata.resource_version.clone().unwrap_or_default();
        let has_spec = obj.data.get("spec").is_some_and(|s| s.is_object());
        let mut ops =
            vec![json!({ "op": "test", "path": "/metadata/resourceVersion", "value": rv })];
        if has_spec {
            ops.push(
                json!({ "op": "add", "path": format!("/spec/{RESERVED_CIDRS}"), "value": [] }),
            );
        } else {
            ops.push(json!({ "op": "add", "path": "/spec", "value": { RESERVED_CIDRS: [] } }));
        }
        let patch: json_patch::Patch = serde_json::from_value(json!(ops)).expect("static patch");
        match self
            .api
            .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(KubeError::Api(s)) if s.code == 409 || s.code == 422 => Ok(()), // changed meanwhile; retry
            Err(e) => Err(self.classify(e)),
        }
    }
}
