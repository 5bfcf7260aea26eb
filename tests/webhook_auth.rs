//! Who may call capo's webhook: with `--webhook-client-ca-file` and `--webhook-token-file`
//! only a caller with a client certificate from that CA and the bearer token gets an
//! answer. A control plane of the test's own whose kube-apiserver is given both through
//! its `AdmissionConfiguration` (a kubeconfig for webhooks, as docs/install.md shows)
//! really calls capo and holds; a caller without the certificate fails the TLS handshake,
//! one without the token gets 401.

mod support;

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use capo_testenv::{Calico, TestNamespace};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use serde_json::json;
use support::plane::private_plane_configured;
use support::*;

/// A CA, and a client certificate (clientAuth) it signed: (CA, certificate, key), PEM.
fn client_identity() -> (String, String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(Vec::<String>::new()).unwrap();
    leaf.distinguished_name.push(rcgen::DnType::CommonName, "kube-apiserver");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

/// kube-apiserver's admission configuration: a kubeconfig for webhooks whose default
/// entry (`*`) presents `cert`, `key` and `token`.
fn admission_config(dir: &Path, cert: &str, key: &str, token: &str) -> std::path::PathBuf {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let kubeconfig = dir.join("webhook-kubeconfig.yaml");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nusers:\n- name: '*'\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n    token: {token}\n",
            b64(cert),
            b64(key)
        ),
    )
    .unwrap();
    let admission = dir.join("admission.yaml");
    std::fs::write(
        &admission,
        format!(
            "apiVersion: apiserver.config.k8s.io/v1\nkind: AdmissionConfiguration\nplugins:\n- name: ValidatingAdmissionWebhook\n  configuration:\n    apiVersion: apiserver.config.k8s.io/v1\n    kind: WebhookAdmissionConfiguration\n    kubeConfigFile: {}\n",
            kubeconfig.display()
        ),
    )
    .unwrap();
    admission
}

#[tokio::test]
async fn only_a_caller_with_the_client_certificate_and_the_token_is_answered() {
    let dir = std::env::temp_dir().join(format!("capo-webhook-auth-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, cert, key) = client_identity();
    let token = "s3cret-token-of-the-api-server";
    let (ca_file, token_file) = (dir.join("client-ca.pem"), dir.join("token"));
    std::fs::write(&ca_file, &ca).unwrap();
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let admission = admission_config(&dir, &cert, &key, token);
    let plane = private_plane_configured(
        "webhook-auth",
        false,
        Calico::Kubernetes,
        vec![format!("--admission-control-config-file={}", admission.display())],
    );
    let client = plane.client().await;
    install_capo_crds(&client).await;
    install_calico_crds(&client).await;
    let ns = TestNamespace::create(&client, "auth").await;
    let mut settings = capo_settings(&format!("capo-test-{}", ns.name), &[&ns.name], None);
    settings.caller_auth =
        capo::caller_auth::CallerAuth { client_ca_file: Some(ca_file), token_file: Some(token_file) };
    init_tracing();
    let capo = capo::App::start(client.clone(), settings).await.expect("start capo");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("capo-canary", &[], &[]), &[Ips::v4()]).await;
    eventually("the API server calls capo, certificate and token accepted", Duration::from_secs(30), || {
        let (pods, metrics) = (pods.clone(), capo.metrics.clone());
        async move {
            pods.delete("capo-canary", &DeleteParams { dry_run: true, ..Default::default() }).await.ok()?;
            metrics.render().contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
        }
    })
    .await;
    apply_policy(&client, &format!("{}-p", ns.name), &ns.name, json!({ "podSelector": {} })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("zk-0", &[], &[]), &[ip]).await;
    pods.delete("zk-0", &DeleteParams::default()).await.expect("deletion allowed");
    let held = Api::<capo_api::ReservedIP>::all(client.clone())
        .get_opt(&capo_api::reserved_ip::record_name(ip))
        .await
        .unwrap();
    assert!(held.is_some(), "the API server's review (certificate and token) was answered and held");

    let url = format!("https://{}{}", capo.webhook_addr, capo::admission::REVIEW_PATH);
    let anonymous = reqwest::Client::builder().danger_accept_invalid_certs(true).build().unwrap();
    let e = anonymous.post(&url).json(&json!({})).send().await.expect_err("no client certificate, no TLS session");
    eprintln!("without a client certificate: {e:?}");
    let identity = reqwest::Identity::from_pem(format!("{cert}{key}").as_bytes()).unwrap();
    let with_cert = reqwest::Client::builder().danger_accept_invalid_certs(true).identity(identity).build().unwrap();
    let no_token = with_cert.post(&url).json(&json!({})).send().await.unwrap();
    assert_eq!(no_token.status(), 401, "a client certificate without the token");
    let wrong = with_cert.post(&url).bearer_auth("guess").json(&json!({})).send().await.unwrap();
    assert_eq!(wrong.status(), 401, "a wrong token");
    let right = with_cert.post(&url).bearer_auth(token).json(&json!({})).send().await.unwrap();
    assert_eq!(right.status(), 400, "certificate and token: the (malformed) review is read");
    for reason in ["no_token", "wrong_token"] {
        let needle = format!("capo_webhook_unauthenticated_total{{reason=\"{reason}\"}}");
        assert_eq!(metric_value(&capo, &needle), Some(1.0), "{needle}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
