//! Which Calico API group serves `IPReservation` here, decided the way Calico decides:
//! `projectcalico.org/v3` when it is served and `crd.projectcalico.org/v1` is not.

use capo_api::CalicoApiGroup;
use kube::Client;
use tracing::info;

async fn serves_ip_reservations(client: &Client, group: CalicoApiGroup) -> bool {
    match client.list_api_group_resources(&group.api_version()).await {
        Ok(list) => list.resources.iter().any(|r| r.name == "ipreservations"),
        Err(_) => false,
    }
}

pub async fn detect_calico_api(client: &Client) -> CalicoApiGroup {
    let v1 = serves_ip_reservations(client, CalicoApiGroup::CrdV1).await;
    let v3 = serves_ip_reservations(client, CalicoApiGroup::V3).await;
    let chosen = if v3 && !v1 { CalicoApiGroup::V3 } else { CalicoApiGroup::CrdV1 };
    info!(crd_v1 = v1, v3, chosen = %chosen, "detected the Calico API");
    chosen
}
