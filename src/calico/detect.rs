//! Which Calico API group serves `IPReservation` here, decided the way Calico decides:
//! `projectcalico.org/v3` when it is served and `crd.projectcalico.org/v1` is not.
//!
//! Where both are served, whether they are two stores or one: calico-apiserver (an
//! aggregated API server, behind `APIService v3.projectcalico.org` with a Service) serves
//! `projectcalico.org/v3` as a view of the `crd.projectcalico.org/v1` objects, so every
//! object has two names; native `projectcalico.org/v3` CRDs beside the v1 ones (a cluster
//! moving to Calico 3.32's v3 CRDs) are objects of their own. capo watches and writes
//! one group where they are one store, both where they are two.
//!
//! Only a definite answer counts: a discovery request that fails for another reason than
//! "not found" (the API server restarting, throttling) is asked again, so a transient
//! error cannot pick the wrong group for the life of the process.

use std::time::Duration;

use capo_api::CalicoApiGroup;
use kube::Client;
use tracing::{info, warn};

/// How often discovery is asked before capo decides with what it knows.
const ATTEMPTS: u32 = 8;

async fn serves_ip_reservations(client: &Client, group: CalicoApiGroup) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(&group.api_version()).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "ipreservations")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Calico's rule on definite answers.
fn choose(v1: bool, v3: bool) -> CalicoApiGroup {
    if v3 && !v1 { CalicoApiGroup::V3 } else { CalicoApiGroup::CrdV1 }
}

/// The group capo writes holds in, and every group that serves IPReservations (capo
/// releases holds from all of them: holds made before a switch stay where they are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    pub chosen: CalicoApiGroup,
    pub served: Vec<CalicoApiGroup>,
    /// `projectcalico.org/v3` is served by an aggregated API server (calico-apiserver) as
    /// a view of the `crd.projectcalico.org/v1` objects: both groups name one store.
    pub one_store: bool,
}

impl Detected {
    /// Only `group` is served, and it is its own store.
    pub fn only(group: CalicoApiGroup) -> Self {
        Self { chosen: group, served: vec![group], one_store: false }
    }

    /// The groups capo watches: where both name one store, the chosen one alone (each
    /// object once); else every served group, and the chosen one.
    pub fn watched(&self) -> Vec<CalicoApiGroup> {
        if self.one_store {
            return vec![self.chosen];
        }
        let mut watched = self.served.clone();
        if !watched.contains(&self.chosen) {
            watched.push(self.chosen);
        }
        watched
    }

    /// Where both groups name one store: (the other group, the chosen one).
    pub fn alias(&self) -> Option<(CalicoApiGroup, CalicoApiGroup)> {
        let other = match self.chosen {
            CalicoApiGroup::CrdV1 => CalicoApiGroup::V3,
            CalicoApiGroup::V3 => CalicoApiGroup::CrdV1,
        };
        self.one_store.then_some((other, self.chosen))
    }
}

/// The APIService that serves `projectcalico.org/v3`.
const V3_API_SERVICE: &str = "v3.projectcalico.org";

/// Whether `projectcalico.org/v3` is served by an aggregated API server (its APIService
/// names a Service) rather than by CRDs in the API server itself (`service: null`).
async fn v3_is_aggregated(client: &Client) -> Result<bool, kube::Error> {
    let ar = kube::api::ApiResource {
        group: "apiregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "apiregistration.k8s.io/v1".into(),
        kind: "APIService".into(),
        plural: "apiservices".into(),
    };
    let api = kube::Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar);
    match api.get(V3_API_SERVICE).await {
        Ok(svc) => Ok(svc.data.pointer("/spec/service").is_some_and(|s| !s.is_null())),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether both served groups name one store. Unknown (the APIService cannot be read)
/// counts as one store: that is what clusters serving both run (calico-apiserver), and
/// taking one store for two would make capo remove its own entries as duplicates.
async fn one_store(client: &Client) -> bool {
    let mut delay = Duration::from_millis(200);
    for attempt in 1..=ATTEMPTS {
        match v3_is_aggregated(client).await {
            Ok(aggregated) => return aggregated,
            Err(kube::Error::Api(s)) if s.code == 403 => {
                warn!(
                    apiservice = V3_API_SERVICE,
                    "cannot read the APIService (forbidden); taking projectcalico.org/v3 for calico-apiserver's view of crd.projectcalico.org/v1"
                );
                return true;
            }
            Err(e) => {
                warn!(attempt, apiservice = V3_API_SERVICE, error = %e, "reading the APIService failed; asking again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
    warn!(apiservice = V3_API_SERVICE, "reading the APIService kept failing; taking both groups for one store");
    true
}

/// Asks discovery which groups serve IPReservations; `forced` (`--calico-api`) overrides
/// the choice but not what is watched.
pub async fn detect_calico_api(client: &Client, forced: Option<CalicoApiGroup>) -> Detected {
    let mut delay = Duration::from_millis(200);
    for attempt in 1..=ATTEMPTS {
        let v1 = serves_ip_reservations(client, CalicoApiGroup::CrdV1).await;
        let v3 = serves_ip_reservations(client, CalicoApiGroup::V3).await;
        match (v1, v3) {
            (Ok(v1), Ok(v3)) => {
                let chosen = forced.unwrap_or_else(|| choose(v1, v3));
                let served: Vec<CalicoApiGroup> = [(CalicoApiGroup::CrdV1, v1), (CalicoApiGroup::V3, v3)]
                    .into_iter()
                    .filter(|(_, s)| *s)
                    .map(|(g, _)| g)
                    .collect();
                let one_store = v1 && v3 && one_store(client).await;
                info!(crd_v1 = v1, v3, one_store, chosen = %chosen, "detected the Calico API");
                return Detected { chosen, served, one_store };
            }
            (v1, v3) => {
                let error = v1.err().or(v3.err()).map(|e| e.to_string()).unwrap_or_default();
                warn!(attempt, error, "Calico API discovery failed; asking again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
    let chosen = forced.unwrap_or(CalicoApiGroup::CrdV1);
    warn!(chosen = %chosen, "Calico API discovery kept failing; set --calico-api to choose");
    Detected::only(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calicos_rule() {
        assert_eq!(choose(true, true), CalicoApiGroup::CrdV1);
        assert_eq!(choose(true, false), CalicoApiGroup::CrdV1);
        assert_eq!(choose(false, true), CalicoApiGroup::V3);
        assert_eq!(choose(false, false), CalicoApiGroup::CrdV1);
    }

    #[test]
    fn one_store_is_watched_once_through_the_chosen_group() {
        let both = vec![CalicoApiGroup::CrdV1, CalicoApiGroup::V3];
        let apiserver = Detected { chosen: CalicoApiGroup::CrdV1, served: both.clone(), one_store: true };
        assert_eq!(apiserver.watched(), vec![CalicoApiGroup::CrdV1]);
        assert_eq!(apiserver.alias(), Some((CalicoApiGroup::V3, CalicoApiGroup::CrdV1)));
        let forced = Detected { chosen: CalicoApiGroup::V3, served: both.clone(), one_store: true };
        assert_eq!(forced.watched(), vec![CalicoApiGroup::V3]);
        assert_eq!(forced.alias(), Some((CalicoApiGroup::CrdV1, CalicoApiGroup::V3)));
        let two = Detected { chosen: CalicoApiGroup::CrdV1, served: both.clone(), one_store: false };
        assert_eq!(two.watched(), both);
        assert_eq!(two.alias(), None);
        assert_eq!(Detected::only(CalicoApiGroup::V3).watched(), vec![CalicoApiGroup::V3]);
    }
}
