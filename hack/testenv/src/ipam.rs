//! A stand-in for the one Calico IPAM rule capo relies on: an address listed in an
//! `IPReservation` is never auto-assigned to a Pod.
//!
//! kwok hands out Pod IPs itself (lowest free address of the node's Pod CIDR), so a
//! recreated Pod would get the very address capo holds. For the local demo this task
//! watches Pods on kwok nodes and, when one is given a reserved address, moves it to the
//! lowest address of the node's CIDR that is neither in use nor reserved, as Calico would
//! have chosen in the first place. Tests of capo do not depend on it.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

fn reservation_apis(client: &Client) -> Vec<Api<DynamicObject>> {
    [("crd.projectcalico.org", "v1"), ("projectcalico.org", "v3")]
        .into_iter()
        .map(|(g, v)| {
            let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(g, v, "IPReservation"), "ipreservations");
            Api::all_with(client.clone(), &ar)
        })
        .collect()
}

/// Every reserved IPv4 range as (first, last) address.
async fn reserved(client: &Client) -> Vec<(u32, u32)> {
    let mut ranges = Vec::new();
    for api in reservation_apis(client) {
        let Ok(list) = api.list(&ListParams::default()).await else { continue };
        for obj in list.items {
            for cidr in obj.data["spec"]["reservedCIDRs"].as_array().into_iter().flatten().filter_map(|v| v.as_str()) {
                if let Some(range) = v4_range(cidr) {
                    ranges.push(range);
                }
            }
        }
    }
    ranges
}

fn v4_range(cidr: &str) -> Option<(u32, u32)> {
    let (addr, len) = cidr.split_once('/').unwrap_or((cidr, "32"));
    let addr = u32::from(addr.parse::<Ipv4Addr>().ok()?);
    let len: u32 = len.parse().ok().filter(|l| *l <= 32)?;
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Some((addr & mask, (addr & mask) | !mask))
}

fn is_reserved(ip: u32, ranges: &[(u32, u32)]) -> bool {
    ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&ip))
}

async fn reassign(client: &Client, pod: &Pod) -> Result<(), kube::Error> {
    let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()).and_then(|ip| ip.parse::<Ipv4Addr>().ok())
    else {
        return Ok(());
    };
    let ranges = reserved(client).await;
    if !is_reserved(u32::from(ip), &ranges) {
        return Ok(());
    }
    let node_name = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    let node = Api::<Node>::all(client.clone()).get(&node_name).await?;
    let Some((first, last)) = node.spec.as_ref().and_then(|s| s.pod_cidr.as_deref()).and_then(v4_range) else {
        return Ok(());
    };
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node_name}")))
        .await?;
    let used: BTreeSet<u32> = pods
        .items
        .iter()
        .filter_map(|p| p.status.as_ref()?.pod_ip.as_deref()?.parse::<Ipv4Addr>().ok())
        .map(u32::from)
        .collect();
    let Some(free) = (first + 1..last).find(|a| !used.contains(a) && !is_reserved(*a, &ranges)) else { return Ok(()) };
    let free = Ipv4Addr::from(free).to_string();
    let ns = pod.namespace().unwrap_or_default();
    let patch = json!({ "status": { "podIP": free, "podIPs": [{ "ip": free }] } });
    Api::<Pod>::namespaced(client.clone(), &ns)
        .patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    eprintln!("ipam: {ns}/{} was given reserved {ip}; reassigned {free}", pod.name_any());
    Ok(())
}

/// Runs until the watch ends (it does not, short of the process exiting).
pub async fn run(client: Client) {
    let pods = Api::<Pod>::all(client.clone());
    let mut events = watcher(pods, watcher::Config::default()).applied_objects().default_backoff().boxed();
    while let Some(event) = events.next().await {
        let Ok(pod) = event else { continue };
        let on_kwok =
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_some_and(|n| n.starts_with("kwok-node-"));
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        if on_kwok
            && !host_network
            && pod.metadata.deletion_timestamp.is_none()
            && let Err(e) = reassign(&client, &pod).await
        {
            eprintln!("ipam: {}/{}: {e}", pod.namespace().unwrap_or_default(), pod.name_any());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_membership() {
        assert_eq!(v4_range("10.0.0.5/32"), Some((0x0a000005, 0x0a000005)));
        assert_eq!(v4_range("10.0.1.0/24"), Some((0x0a000100, 0x0a0001ff)));
        assert_eq!(v4_range("fd00::1/128"), None);
        let r = [v4_range("10.0.0.5/32").unwrap()];
        assert!(is_reserved(0x0a000005, &r) && !is_reserved(0x0a000006, &r));
    }
}
