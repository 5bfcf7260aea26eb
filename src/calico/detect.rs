//! Which Calico API group serves `IPReservation` here, decided the way Calico decides:
//! `projectcalico.org/v3` when it is served and `crd.projectcalico.org/v1` is not.
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
                info!(crd_v1 = v1, v3, chosen = %chosen, "detected the Calico API");
                return Detected { chosen, served };
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
    Detected { chosen, served: vec![chosen] }
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
}
