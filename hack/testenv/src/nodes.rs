//! kwok nodes: Node objects kwok recognises by annotation and keeps `Ready`, with a fake
//! kubelet that runs their Pods (capo-calico-ipam gives them IPs through Calico IPAM).

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};

use crate::Error;

pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";

pub fn node_names(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("kwok-node-{i}")).collect()
}

pub async fn create(client: &Client, count: usize) -> Result<(), Error> {
    let api = Api::<Node>::all(client.clone());
    for name in node_names(count) {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "annotations": { KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0" },
                "labels": {
                    "type": "kwok",
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node-role.kubernetes.io/agent": "",
                },
            },
            // No podCIDR: Pod IPs come from Calico IPAM's blocks (capo-calico-ipam).
            "status": {
                "allocatable": { "cpu": "32", "memory": "256Gi", "pods": "110" },
                "capacity": { "cpu": "32", "memory": "256Gi", "pods": "110" },
            },
        }))
        .expect("node");
        match api.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub async fn ready_count(client: &Client) -> Result<usize, Error> {
    let nodes = Api::<Node>::all(client.clone()).list(&ListParams::default().labels("type=kwok")).await?;
    Ok(nodes
        .items
        .iter()
        .filter(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .count())
}
