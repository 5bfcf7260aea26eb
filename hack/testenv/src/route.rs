//! Reaching a process that runs outside the cluster through a Service, the way the API
//! server reaches an in-cluster webhook: the test API server routes Service traffic to
//! the Service's endpoints (`--enable-aggregator-routing`), and [`route_service`] writes
//! those endpoints — an EndpointSlice (Kubernetes 1.33 and later read these) and an
//! Endpoints object (earlier versions) — pointing at an address of this machine.
//! Endpoints may not be loopback addresses, so it is the machine's first non-loopback
//! IPv4 address ([`host_ip`]). The webhook's certificate is then verified against the
//! Service's DNS name, exactly as in a cluster.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;

/// The field manager of the endpoints written here.
const MANAGER: &str = "capo-testenv";

/// This machine's first IPv4 address that is not loopback or link-local.
pub fn host_ip() -> Option<IpAddr> {
    let mut found = None;
    // SAFETY: getifaddrs fills a list that is read here and freed with freeifaddrs.
    unsafe {
        let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut addrs) != 0 {
            return None;
        }
        let mut cur = addrs;
        while !cur.is_null() {
            let a = &*cur;
            if !a.ifa_addr.is_null() && i32::from((*a.ifa_addr).sa_family) == libc::AF_INET {
                let sin = &*(a.ifa_addr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() && !ip.is_link_local() && !ip.is_unspecified() && found.is_none() {
                    found = Some(IpAddr::V4(ip));
                }
            }
            cur = a.ifa_next;
        }
        libc::freeifaddrs(addrs);
    }
    found
}

/// Points Service `namespace/service`'s port `port_name` at `to`.
pub async fn route_service(
    client: &Client,
    namespace: &str,
    service: &str,
    port_name: &str,
    to: SocketAddr,
) -> Result<(), kube::Error> {
    let ip = to.ip().to_string();
    let port = to.port();
    let params = PatchParams::apply(MANAGER).force();
    let endpoints = json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": { "name": service, "namespace": namespace },
        "subsets": [{ "addresses": [{ "ip": ip }], "ports": [{ "name": port_name, "port": port, "protocol": "TCP" }] }],
    });
    Api::<k8s_openapi::api::core::v1::Endpoints>::namespaced(client.clone(), namespace)
        .patch(service, &params, &Patch::Apply(endpoints))
        .await?;
    let family = if to.is_ipv4() { "IPv4" } else { "IPv6" };
    let name = format!("{service}-{MANAGER}");
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": name, "namespace": namespace, "labels": {
            "kubernetes.io/service-name": service, "endpointslice.kubernetes.io/managed-by": MANAGER } },
        "addressType": family,
        "endpoints": [{ "addresses": [ip], "conditions": { "ready": true } }],
        "ports": [{ "name": port_name, "port": port, "protocol": "TCP" }],
    });
    let ar = kube::api::ApiResource {
        group: "discovery.k8s.io".into(),
        version: "v1".into(),
        api_version: "discovery.k8s.io/v1".into(),
        kind: "EndpointSlice".into(),
        plural: "endpointslices".into(),
    };
    Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &ar)
        .patch(&name, &params, &Patch::Apply(slice))
        .await?;
    Ok(())
}
