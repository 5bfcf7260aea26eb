//! The webhook's certificates, observed through the TLS handshakes the API server itself
//! makes with capo. Every test runs in a namespace labelled
//! `capo.io/failure-policy=Fail`, so a review the API server cannot deliver (it does not
//! trust what capo serves) is a refused deletion, never a silent pass. The probe is a
//! dry-run DELETE: the API server calls capo for it, and capo writes nothing.
//!
//! - mounted certificates (cert-manager, or the operator's Secret) are reloaded when
//!   kubelet swaps the volume, and their `ca.crt` is injected;
//! - self-managed certificates are created, injected, renewed and their CA rotated with
//!   no review failing, each new certificate met by the API server;
//! - replicas share one Secret without fighting, a restart keeps it, garbage in it is
//!   replaced, a Secret capo does not own is never touched, a caBundle someone removed is
//!   written back.

mod support;

use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use capo::app::{Settings, TlsSource};
use capo::certs::managed::{ManagedSettings, Material};
use capo::certs::pki::{self, KeyedCert};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

const DAY: Duration = Duration::from_secs(86400);

/// Labels `ns` so its deletions need capo's answer (failurePolicy Fail).
async fn require_capo(client: &Client, ns: &str) {
    let patch = json!({ "metadata": { "labels": { capo::webhook_config::FAILURE_POLICY_LABEL: "Fail" } } });
    Api::<Namespace>::all(client.clone()).patch(ns, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
}

/// A dry-run DELETE of the canary Pod: the API server calls capo, over TLS. `Err`: the
/// API server's message (with Fail, a certificate it does not trust refuses it).
async fn probe(client: &Client, ns: &str) -> Result<(), String> {
    let dry = DeleteParams { dry_run: true, ..Default::default() };
    Api::<Pod>::namespaced(client.clone(), ns).delete("capo-canary", &dry).await.map(|_| ()).map_err(|e| e.to_string())
}

/// Probes until the API server has completed a handshake with the certificate of
/// `serial`; every probe must succeed. (The first may still travel on a connection made
/// before the change, which capo then closes.)
async fn met_by_the_api_server(client: &Client, ns: &str, capo: &capo::App, serial: &str) {
    for _ in 0..20 {
        probe(client, ns).await.unwrap_or_else(|e| panic!("a review failed while serving {serial}: {e}"));
        if capo.serving.handshakes_with(serial) > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the API server never completed a handshake with certificate {serial}");
}

/// Waits until every one of `capos` serves the certificate the Secret holds at that
/// moment, and returns it. With certificates of a few seconds the Secret is renewed
/// while this waits: each look reads it again, so a renewal just after the caller's last
/// look settles on the newer certificate instead of waiting for one capo no longer
/// serves.
async fn serving_the_secret(client: &Client, ns: &str, secret: &str, capos: &[&capo::App]) -> Material {
    eventually(&format!("capo to serve what Secret {secret} holds"), Duration::from_secs(15), || async {
        let m = material(client, ns, secret).await;
        let leaf = m.leaf_info().serial.clone();
        capos.iter().all(|c| c.serving.current().is_some_and(|s| s.info.serial == leaf)).then_some(m)
    })
    .await
}

async fn wait_serving(capo: &capo::App, serial: &str) {
    eventually(&format!("capo to serve {serial}"), Duration::from_secs(15), || async {
        (capo.serving.current()?.info.serial == serial).then_some(())
    })
    .await;
}

fn serial(pem: &str) -> String {
    pki::parse_one("certificate", pem).unwrap().serial
}

/// Lays out `dir` as kubelet does for a Secret volume: `tls.crt -> ..data/tls.crt`,
/// `..data -> ..<version>`, swapped atomically.
fn publish(dir: &Path, version: &str, leaf: &KeyedCert, ca_pem: &str) {
    let versioned = dir.join(format!("..{version}"));
    std::fs::create_dir_all(&versioned).unwrap();
    for (name, pem) in [("tls.crt", &leaf.cert_pem), ("tls.key", &leaf.key_pem), ("ca.crt", &ca_pem.to_string())] {
        std::fs::write(versioned.join(name), pem).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(format!("..{version}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for f in ["tls.crt", "tls.key", "ca.crt"] {
        let link = dir.join(f);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(format!("..data/{f}"), link).unwrap();
        }
    }
}

async fn ca_bundle_of(client: &Client, name: &str) -> Vec<String> {
    let config = Api::<ValidatingWebhookConfiguration>::all(client.clone()).get(name).await.unwrap();
    config
        .webhooks
        .unwrap_or_default()
        .iter()
        .map(|w| {
            w.client_config.ca_bundle.as_ref().map(|b| String::from_utf8_lossy(&b.0).to_string()).unwrap_or_default()
        })
        .collect()
}

fn managed(ns: &str, secret: &str, cert: Duration, ca: Duration) -> Settings {
    let name = format!("capo-test-{ns}");
    let mut settings = capo_settings(&name, &[ns], None);
    settings.tls = TlsSource::Managed(ManagedSettings {
        secret: secret.into(),
        namespace: ns.into(),
        hosts: vec!["127.0.0.1".into()],
        cert_validity: cert,
        ca_validity: ca,
    });
    settings.inject_ca_bundle = Some(name);
    settings
}

fn writes(capo: &capo::App, action: &str) -> f64 {
    metric_value(capo, &format!("capo_certificate_writes_total{{action=\"{action}\"}}")).unwrap_or(0.0)
}

async fn material(client: &Client, ns: &str, secret: &str) -> Material {
    let s = Api::<Secret>::namespaced(client.clone(), ns).get(secret).await.unwrap();
    Material::from_secret(&s).unwrap()
}

#[tokio::test]
async fn mounted_certificates_are_reloaded_and_their_ca_injected() {
    let (client, ns) = setup("certs-files").await;
    require_capo(&client, &ns.name).await;
    let dir = std::env::temp_dir().join(format!("capo-certs-{}-{}", ns.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let now = SystemTime::now();
    let hosts = vec!["127.0.0.1".to_string()];
    let ca1 = pki::new_ca(now, DAY).unwrap();
    let first = pki::new_leaf(&ca1, &hosts, now, DAY).unwrap();
    publish(&dir, "2026_11_23_01", &first, &ca1.cert_pem);

    let name = format!("capo-test-{}", ns.name);
    let mut settings = capo_settings(&name, &[&ns.name], None);
    settings.tls = TlsSource::Dir(dir.clone());
    settings.inject_ca_bundle = Some(name.clone());
    let capo = start_capo_with(&client, &ns.name, settings).await;
    assert!(ca_bundle_of(&client, &name).await.iter().all(|b| *b == ca1.cert_pem), "ca.crt injected");
    met_by_the_api_server(&client, &ns.name, &capo, &serial(&first.cert_pem)).await;

    // cert-manager renews the certificate with the same CA.
    let renewed = pki::new_leaf(&ca1, &hosts, now, DAY).unwrap();
    publish(&dir, "2026_11_23_02", &renewed, &ca1.cert_pem);
    wait_serving(&capo, &serial(&renewed.cert_pem)).await;
    met_by_the_api_server(&client, &ns.name, &capo, &serial(&renewed.cert_pem)).await;

    // A certificate from a CA nobody told the API server about: reviews fail (and with
    // Fail the deletion is refused), and capo counts the failed handshakes.
    let failed_before = metric_value(&capo, "capo_webhook_tls_handshakes_total{result=\"failed\"}").unwrap_or(0.0);
    let rogue = pki::new_leaf(&pki::new_ca(now, DAY).unwrap(), &hosts, now, DAY).unwrap();
    publish(&dir, "2026_11_23_03", &rogue, &ca1.cert_pem);
    wait_serving(&capo, &serial(&rogue.cert_pem)).await;
    let refused = eventually("a review to fail on the untrusted certificate", Duration::from_secs(10), || async {
        probe(&client, &ns.name).await.err()
    })
    .await;
    assert!(refused.contains("x509") || refused.contains("certificate"), "{refused}");
    let failed = metric_value(&capo, "capo_webhook_tls_handshakes_total{result=\"failed\"}").unwrap_or(0.0);
    assert!(failed > failed_before, "failed handshakes are counted ({failed_before} -> {failed})");

    // The operator's new CA and its certificate: the bundle is injected, reviews pass again.
    let ca2 = pki::new_ca(now, DAY).unwrap();
    let fixed = pki::new_leaf(&ca2, &hosts, now, DAY).unwrap();
    publish(&dir, "2026_11_23_04", &fixed, &ca2.cert_pem);
    eventually("the new CA injected", Duration::from_secs(15), || async {
        ca_bundle_of(&client, &name).await.iter().all(|b| *b == ca2.cert_pem).then_some(())
    })
    .await;
    wait_serving(&capo, &serial(&fixed.cert_pem)).await;
    eventually("reviews to pass again", Duration::from_secs(10), || async { probe(&client, &ns.name).await.ok() })
        .await;
    met_by_the_api_server(&client, &ns.name, &capo, &serial(&fixed.cert_pem)).await;
    capo.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// One state of the Secret: serving certificate, signing CA, bundle size.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    leaf: String,
    signer: String,
    next: Option<String>,
    bundle: Vec<String>,
}

impl Seen {
    fn of(m: &Material) -> Self {
        Seen {
            leaf: m.leaf_info().serial.clone(),
            signer: m.signer_info().serial.clone(),
            next: m.next_info().map(|n| n.serial.clone()),
            bundle: m.bundle_info().iter().map(|c| c.serial.clone()).collect(),
        }
    }
}

#[tokio::test]
async fn self_managed_certificates_are_renewed_and_their_ca_rotated_with_no_review_failing() {
    let (client, ns) = setup("certs-rotate").await;
    require_capo(&client, &ns.name).await;
    let secret = "capo-webhook-tls";
    // Short lives, so that in half a minute the serving certificate is renewed several
    // times and the CA is staged, promoted and the old one dropped.
    let settings = managed(&ns.name, secret, Duration::from_secs(6), Duration::from_secs(24));
    let capo = start_capo_with(&client, &ns.name, settings).await;
    let mut states: Vec<Seen> = Vec::new();
    let mut failures = Vec::new();
    let start = Instant::now();
    let mut probes = 0;
    // One probe (its failure noted), then the Secret's state (noted when it changed).
    let look = async |states: &mut Vec<Seen>, failures: &mut Vec<String>, probes: &mut usize| -> Seen {
        if let Err(e) = probe(&client, &ns.name).await {
            failures.push(format!("at {:?}: {e}", start.elapsed()));
        }
        *probes += 1;
        let seen = Seen::of(&material(&client, &ns.name, secret).await);
        if states.last() != Some(&seen) {
            states.push(seen.clone());
        }
        seen
    };
    while start.elapsed() < Duration::from_secs(32) {
        look(&mut states, &mut failures, &mut probes).await;
        // Pacing of the probes; the assertions are below.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The last certificates, too, must be met. Renewals go on meanwhile (every 4 s): the
    // probes go on until the API server has met every certificate seen so far and the
    // one the Secret holds now is served and met (it lives 4 s, probes come every 100 ms).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = look(&mut states, &mut failures, &mut probes).await;
        let served = capo.serving.current().is_some_and(|s| s.info.serial == seen.leaf);
        if served && states.iter().all(|s| capo.serving.handshakes_with(&s.leaf) > 0) {
            break;
        }
        assert!(Instant::now() < deadline, "the API server did not meet every certificate within 20 s: {states:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(failures.is_empty(), "{} of {probes} reviews failed during rotation: {failures:#?}", failures.len());

    let first = &states[0];
    let signers: Vec<&String> = {
        let mut s: Vec<&String> = states.iter().map(|s| &s.signer).collect();
        s.dedup();
        s
    };
    assert_eq!(signers.len(), 2, "the CA was rotated once: {states:#?}");
    let staged = states.iter().position(|s| s.signer == first.signer && s.next.is_some() && s.bundle.len() == 2);
    let promoted = states.iter().position(|s| s.signer != first.signer);
    let (Some(staged), Some(promoted)) = (staged, promoted) else { panic!("no staged then promoted CA: {states:#?}") };
    assert!(staged < promoted, "the next CA was trusted before it signed: {states:#?}");
    assert_eq!(&states[promoted].bundle, &vec![states[promoted].signer.clone(), first.signer.clone()]);
    let new = &states[promoted].signer;
    assert!(
        states[promoted..].iter().any(|s| s.bundle == vec![new.clone()]),
        "the old CA left the bundle when it expired: {states:#?}"
    );
    let mut leaves: Vec<&String> = states.iter().map(|s| &s.leaf).collect();
    leaves.dedup();
    assert!(leaves.len() >= 5, "the serving certificate was renewed several times: {states:#?}");
    for leaf in &leaves {
        let n = capo.serving.handshakes_with(leaf);
        assert!(n > 0, "the API server never made a handshake with serving certificate {leaf}: {states:#?}");
    }
    for action in ["created", "certificate_renewed", "ca_staged", "ca_promoted", "bundle_tidied"] {
        assert!(writes(&capo, action) >= 1.0, "no {action} write:\n{}", capo.metrics.render());
    }
    capo.shutdown().await;
}

#[tokio::test]
async fn replicas_share_one_secret_without_fighting() {
    let (client, ns) = setup("certs-replicas").await;
    require_capo(&client, &ns.name).await;
    let secret = "capo-webhook-tls";
    let versions = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let watching = {
        let versions = versions.clone();
        let api = Api::<Secret>::namespaced(client.clone(), &ns.name);
        tokio::spawn(async move {
            use futures::StreamExt;
            let config = kube::runtime::watcher::Config::default().fields(&format!("metadata.name={secret}"));
            let mut events = kube::runtime::watcher::watcher(api, config).boxed();
            while let Some(Ok(event)) = events.next().await {
                if let kube::runtime::watcher::Event::Apply(s) | kube::runtime::watcher::Event::InitApply(s) = event {
                    let rv = s.metadata.resource_version.unwrap_or_default();
                    let mut v = versions.lock().unwrap();
                    if !v.contains(&rv) {
                        v.push(rv);
                    }
                }
            }
        })
    };
    let (cert, ca) = (Duration::from_secs(6), Duration::from_secs(3600));
    let a = start_capo_with(&client, &ns.name, managed(&ns.name, secret, cert, ca)).await;
    let mut b_settings = managed(&ns.name, secret, cert, ca);
    b_settings.self_register = None;
    let b = capo::App::start(client.clone(), b_settings).await.expect("second replica");
    // Both renew at the same moments for a while; each version of the Secret is written
    // by exactly one of them.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(14) {
        probe(&client, &ns.name).await.expect("every review passes");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    serving_the_secret(&client, &ns.name, secret, &[&a, &b]).await;
    let total: f64 = [&a, &b]
        .iter()
        .map(|c| writes(c, "created") + writes(c, "certificate_renewed") + writes(c, "certificate_reissued"))
        .sum();
    let observed = versions.lock().unwrap().len() as f64;
    assert!(observed >= 3.0, "created and renewed at least twice: {observed}");
    assert_eq!(total, observed, "one write per version of the Secret: no replica overwrote another");
    watching.abort();
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn a_restart_keeps_the_secret_and_garbage_in_it_is_replaced() {
    let (client, ns) = setup("certs-restart").await;
    require_capo(&client, &ns.name).await;
    let secret = "capo-webhook-tls";
    let first = start_capo_with(&client, &ns.name, managed(&ns.name, secret, DAY, 30 * DAY)).await;
    let made = material(&client, &ns.name, secret).await;
    first.shutdown().await;

    let again = start_capo_with(&client, &ns.name, managed(&ns.name, secret, DAY, 30 * DAY)).await;
    assert_eq!(again.serving.current().unwrap().info.serial, made.leaf_info().serial, "the same certificate");
    let all_writes: f64 =
        again.metrics.render().lines().filter(|l| l.starts_with("capo_certificate_writes_total")).count() as f64;
    assert_eq!(all_writes, 0.0, "nothing written on restart");
    met_by_the_api_server(&client, &ns.name, &again, &made.leaf_info().serial).await;

    // Someone breaks the private key: capo makes everything anew, and reviews go on.
    let patch = json!({ "stringData": { "tls.key": "not a key" } });
    Api::<Secret>::namespaced(client.clone(), &ns.name)
        .patch(secret, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    eventually("the broken Secret replaced", Duration::from_secs(15), || async {
        (writes(&again, "replaced") >= 1.0).then_some(())
    })
    .await;
    let fixed = material(&client, &ns.name, secret).await;
    assert_ne!(fixed.signer_info().serial, made.signer_info().serial, "a new CA");
    wait_serving(&again, &fixed.leaf_info().serial).await;
    eventually("reviews to pass with the new CA", Duration::from_secs(15), || async {
        probe(&client, &ns.name).await.ok()
    })
    .await;
    met_by_the_api_server(&client, &ns.name, &again, &fixed.leaf_info().serial).await;
    again.shutdown().await;
}

#[tokio::test]
async fn a_secret_capo_does_not_own_is_never_touched() {
    let (client, ns) = setup("certs-foreign").await;
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns.name);
    let foreign: Secret = serde_json::from_value(json!({
        "metadata": { "name": "someone-elses" },
        "type": "kubernetes.io/tls",
        "stringData": { "tls.crt": "theirs", "tls.key": "theirs" },
    }))
    .unwrap();
    let before = secrets.create(&PostParams::default(), &foreign).await.unwrap();
    let mut settings = managed(&ns.name, "someone-elses", DAY, 30 * DAY);
    settings.self_register = None;
    let started = Instant::now();
    let err = match capo::App::start(client.clone(), settings).await {
        Ok(_) => panic!("capo started on a Secret that is not its own"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("is not capo's") && err.contains("someone-elses"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20), "said at once, not after the sync timeout");
    let after = secrets.get("someone-elses").await.unwrap();
    assert_eq!(after.metadata.resource_version, before.metadata.resource_version, "untouched");
}

#[tokio::test]
async fn a_ca_bundle_someone_removed_is_written_back() {
    let (client, ns) = setup("certs-reinject").await;
    require_capo(&client, &ns.name).await;
    let settings = managed(&ns.name, "capo-webhook-tls", DAY, 30 * DAY);
    let name = settings.inject_ca_bundle.clone().unwrap();
    let capo = start_capo_with(&client, &ns.name, settings).await;
    let bundle = material(&client, &ns.name, "capo-webhook-tls").await.bundle;
    // What `kubectl replace` of the manifests (which carry no caBundle) does.
    let api = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    let mut config = api.get(&name).await.unwrap();
    for w in config.webhooks.as_mut().unwrap() {
        w.client_config.ca_bundle = None;
    }
    config.metadata.managed_fields = None;
    api.replace(&name, &PostParams::default(), &config).await.unwrap();
    eventually("the caBundle written back", Duration::from_secs(15), || async {
        ca_bundle_of(&client, &name).await.iter().all(|b| *b == bundle).then_some(())
    })
    .await;
    eventually("reviews to pass again", Duration::from_secs(10), || async { probe(&client, &ns.name).await.ok() })
        .await;
    assert!(metric_value(&capo, "capo_ca_bundle_injections_total{result=\"ok\"}").unwrap_or(0.0) >= 2.0);
    capo.shutdown().await;
}

/// CPU seconds this thread has used (user + system), from /proc/thread-self/stat.
fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// Self-managed certificates without injection (the operator writes the caBundle): capo
/// serves its certificate, and its certificate loop waits for news instead of spinning —
/// with nothing to inject, the injector's channel is closed at once, and a loop that kept
/// selecting on it would burn a core. This test's runtime (and so capo's tasks) runs on
/// this thread, whose CPU time is measured over two idle seconds.
#[tokio::test]
async fn without_injection_the_certificate_is_served_and_capo_stays_idle() {
    let (client, ns) = setup("certs-noinject").await;
    let mut settings = managed(&ns.name, "capo-webhook-tls", DAY, 30 * DAY);
    (settings.inject_ca_bundle, settings.self_register) = (None, None);
    let capo = capo::App::start(client.clone(), settings).await.expect("start");
    let made = material(&client, &ns.name, "capo-webhook-tls").await;
    assert_eq!(capo.serving.current().unwrap().info.serial, made.leaf_info().serial);
    let before = thread_cpu_seconds();
    let window = Instant::now();
    // The observation window; the assertion is on the CPU used in it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = thread_cpu_seconds() - before;
    assert!(window.elapsed() < Duration::from_secs(5), "the runtime was starved");
    assert!(used < 0.5, "capo used {used:.2} s of CPU in 2 idle seconds");
    capo.shutdown().await;
}

/// A capo that may not read its Secret (RBAC): it gives up after the sync timeout with a
/// clear error, and meanwhile its failing watch backs off instead of retrying in a loop.
#[tokio::test]
async fn a_secret_capo_may_not_read_gives_a_clear_error_without_a_busy_loop() {
    let (_admin, ns) = setup("certs-forbidden").await;
    let mut config = capo_testenv::config_from_kubeconfig(&capo_testenv::shared().kubeconfig).await.unwrap();
    config.auth_info.impersonate = Some("capo-test:nobody".into());
    let nobody = Client::try_from(config).unwrap();
    let mut settings = managed(&ns.name, "capo-webhook-tls", DAY, 30 * DAY);
    (settings.self_register, settings.sync_timeout) = (None, Duration::from_secs(3));
    let before = thread_cpu_seconds();
    let err = match capo::App::start(nobody, settings).await {
        Ok(_) => panic!("capo started without access to its Secret"),
        Err(e) => e.to_string(),
    };
    let used = thread_cpu_seconds() - before;
    assert!(err.contains(&format!("no serving certificate in Secret {}/capo-webhook-tls", ns.name)), "{err}");
    assert!(used < 1.0, "{used:.2} s of CPU in a 3 s start that only waited");
}
