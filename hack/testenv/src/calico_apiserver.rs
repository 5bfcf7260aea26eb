//! calico-apiserver beside the control plane ([`crate::Calico::ApiServer`]): Calico's
//! aggregated API server (v3.28.5, built by `hack/build-calico-apiserver.sh`) on the
//! Kubernetes datastore, reached the way a cluster reaches it: `APIService
//! v3.projectcalico.org` → Service `calico-apiserver/calico-api` → an endpoint at this
//! machine's address (kube-apiserver routes to endpoints, see `route.rs`), over TLS
//! verified against the Service's name, with the front-proxy client certificate and
//! `X-Remote-*` headers telling it who asks. It serves `projectcalico.org/v3` as a view of
//! the `crd.projectcalico.org/v1` objects: one object, two names.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use base64::Engine;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;

use crate::pki::CALICO_APISERVER_SERVICE;
use crate::{ControlPlane, Error, free_port, path_arg};

/// The component's name (and log, `calico-apiserver.log`).
pub const CALICO_APISERVER: &str = "calico-apiserver";

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() { version.into() } else { format!("{group}/{version}") },
        kind: kind.into(),
        plural: plural.into(),
    }
}

impl ControlPlane {
    /// Starts calico-apiserver and registers it; returns once `projectcalico.org/v3`
    /// serves IPReservations through kube-apiserver.
    pub(crate) async fn start_calico_apiserver(&mut self, client: &Client) -> Result<(), Error> {
        let program = crate::binaries::locate_calico_apiserver()?;
        let host = crate::route::host_ip().ok_or_else(|| Error::Timeout {
            what: "a non-loopback IPv4 address for calico-apiserver's endpoint".into(),
            after: Duration::ZERO,
            state_dir: self.state_dir.clone(),
        })?;
        let port = free_port()?;
        let pki = self.state_dir.join("pki");
        let kubeconfig = self.kubeconfig.clone();
        let env = vec![
            ("DATASTORE_TYPE".to_string(), "kubernetes".to_string()),
            ("KUBECONFIG".to_string(), kubeconfig.display().to_string()),
        ];
        self.spawn_with_env(
            CALICO_APISERVER,
            &program,
            vec![
                format!("--secure-port={port}"),
                format!("--bind-address={host}"),
                path_arg("tls-cert-file", &pki.join("calico-apiserver.crt")),
                path_arg("tls-private-key-file", &pki.join("calico-apiserver.key")),
                path_arg("kubeconfig", &kubeconfig),
                path_arg("authentication-kubeconfig", &kubeconfig),
                path_arg("authorization-kubeconfig", &kubeconfig),
            ],
            &env,
        )?;
        let ca = std::fs::read(pki.join("ca.crt")).map_err(|source| Error::Io { path: pki.join("ca.crt"), source })?;
        register(client, SocketAddr::new(host, port), &ca).await?;
        self.wait_v3_served(client, Duration::from_secs(90)).await
    }

    /// Waits until kube-apiserver lists IPReservations through calico-apiserver.
    async fn wait_v3_served(&mut self, client: &Client, limit: Duration) -> Result<(), Error> {
        let api = Api::<DynamicObject>::all_with(
            client.clone(),
            &resource("projectcalico.org", "v3", "IPReservation", "ipreservations"),
        );
        let deadline = Instant::now() + limit;
        loop {
            self.check_components()?;
            if api.list(&Default::default()).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.timeout("calico-apiserver to serve projectcalico.org/v3", limit));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The Namespace, Service, endpoints and APIService a cluster has for calico-apiserver.
async fn register(client: &Client, at: SocketAddr, ca_pem: &[u8]) -> Result<(), Error> {
    let (namespace, service) = CALICO_APISERVER_SERVICE;
    let params = PatchParams::apply("capo-testenv").force();
    let ns = json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": namespace } });
    Api::<DynamicObject>::all_with(client.clone(), &resource("", "v1", "Namespace", "namespaces"))
        .patch(namespace, &params, &Patch::Apply(ns))
        .await?;
    let svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": service, "namespace": namespace },
        "spec": { "ports": [{ "name": "apiserver", "port": 443, "targetPort": at.port(), "protocol": "TCP" }] },
    });
    Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource("", "v1", "Service", "services"))
        .patch(service, &params, &Patch::Apply(svc))
        .await?;
    crate::route::route_service(client, namespace, service, "apiserver", at).await?;
    let apiservice = json!({
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": { "name": "v3.projectcalico.org" },
        "spec": {
            "group": "projectcalico.org", "version": "v3",
            "groupPriorityMinimum": 1500, "versionPriority": 200,
            "service": { "namespace": namespace, "name": service, "port": 443 },
            "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_pem),
        },
    });
    Api::<DynamicObject>::all_with(
        client.clone(),
        &resource("apiregistration.k8s.io", "v1", "APIService", "apiservices"),
    )
    .patch("v3.projectcalico.org", &params, &Patch::Apply(apiservice))
    .await?;
    Ok(())
}
