//! What one client may cost capo's webhook, against a real API server calling it over TLS:
//! connections that never send a request are closed within the header timeout, a body
//! that stalls is answered within the review's deadline, and a flood of 4 MiB reviews
//! (the real binary, its memory read from /proc) stays within the review memory capo is
//! given while `/readyz` answers and an ordinary deletion in the same namespace is held.

mod support;

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::Client;
use kube::api::Api;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// The tests here measure time and memory: one at a time, so that none is another's load.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A TLS client that trusts the CA in webhook configuration `name` (what the API server
/// trusts).
async fn connector(client: &Client, name: &str) -> TlsConnector {
    let vwc = Api::<ValidatingWebhookConfiguration>::all(client.clone()).get(name).await.unwrap();
    let bundle = vwc.webhooks.unwrap()[0].client_config.ca_bundle.clone().expect("a CA bundle").0;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&bundle) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

fn localhost() -> ServerName<'static> {
    ServerName::IpAddress("127.0.0.1".parse::<IpAddr>().unwrap().into())
}

/// Waits until the peer closes `conn` (end of stream or an error); what it sent is dropped.
async fn closed(mut conn: impl tokio::io::AsyncRead + Unpin) {
    let mut buf = [0u8; 256];
    while let Ok(n) = conn.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}

#[tokio::test]
async fn a_thousand_connections_that_send_no_request_are_closed_within_the_header_timeout_while_a_deletion_is_held() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (client, ns) = setup("lim-idle").await;
    let name = format!("capo-test-{}", ns.name);
    let mut settings = capo_settings(&name, &[&ns.name], None);
    let header_timeout = Duration::from_secs(3);
    settings.limits.connections.header_timeout = header_timeout;
    let capo = start_capo_with(&client, &ns.name, settings).await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "zk" } } })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("zk-0", &[("app", "zk")], &[]), &[ip]).await;
    let tls = connector(&client, &name).await;

    // Half never start TLS; half finish the handshake and never send a request header.
    let mut watching = Vec::new();
    for i in 0..1000 {
        let tcp = TcpStream::connect(capo.webhook_addr).await.expect("capo accepts the connection");
        let opened = Instant::now();
        if i % 2 == 0 {
            watching.push(tokio::spawn(async move {
                closed(tcp).await;
                opened.elapsed()
            }));
        } else {
            let conn = tls.connect(localhost(), tcp).await.expect("TLS handshake");
            watching.push(tokio::spawn(async move {
                closed(conn).await;
                opened.elapsed()
            }));
        }
    }
    // Meanwhile the API server's review of an ordinary deletion is answered and held.
    delete_pod(&client, &ns.name, "zk-0").await.expect("deletion allowed");
    assert!(record(&client, ip).await.is_some(), "{ip} held while 1,000 idle connections are open");

    let mut lifetimes = Vec::new();
    for w in watching {
        let lifetime = tokio::time::timeout(header_timeout + Duration::from_secs(10), w)
            .await
            .expect("capo closed the connection")
            .unwrap();
        lifetimes.push(lifetime);
    }
    lifetimes.sort();
    let (first, last) = (lifetimes[0], lifetimes[lifetimes.len() - 1]);
    eprintln!("1,000 idle connections closed after {first:?} to {last:?} (header timeout {header_timeout:?})");
    assert!(first >= header_timeout - Duration::from_millis(500), "closed by the timeout, not before: {first:?}");
    assert!(
        last <= header_timeout + Duration::from_secs(2),
        "every connection closed within the header timeout: {last:?}"
    );
    let counted = metric_value(&capo, "capo_webhook_connections_closed_total{reason=\"header_timeout\"}");
    assert!(counted.unwrap_or(0.0) >= 1000.0, "counted: {counted:?}");
}

#[tokio::test]
async fn a_body_that_stalls_is_answered_408_within_the_reviews_deadline() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (client, ns) = setup("lim-body").await;
    let name = format!("capo-test-{}", ns.name);
    let capo = start_capo_with(&client, &ns.name, capo_settings(&name, &[&ns.name], None)).await;
    let tls = connector(&client, &name).await;
    let tcp = TcpStream::connect(capo.webhook_addr).await.unwrap();
    let mut conn = tls.connect(localhost(), tcp).await.unwrap();
    let head = format!(
        "POST {}?timeout=2s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"apiVersion\"",
        capo::admission::REVIEW_PATH
    );
    let sent = Instant::now();
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed without an answer");
            answer.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    read.expect("an answer within the review's deadline");
    let waited = sent.elapsed();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    // The budget of a 2 s deadline keeps half a second back for the answer.
    assert!(waited < Duration::from_secs(2), "answered after {waited:?}");
    let counted = metric_value(&capo, "capo_admission_requests_total{operation=\"unknown\",outcome=\"body_timeout\"}");
    assert_eq!(counted, Some(1.0));
}

/// The real binary, so that its memory is its own.
struct Capo {
    child: tokio::process::Child,
    probe: u16,
    port: u16,
    log: PathBuf,
}

impl Drop for Capo {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            for line in &lines[lines.len().saturating_sub(60)..] {
                eprintln!("{line}");
            }
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Capo {
    async fn spawn(ns: &str) -> Self {
        let (port, probe) = (free_port(), free_port());
        let log = std::env::temp_dir().join(format!("capo-limits-{ns}.log"));
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_capo"))
            .args([
                "run",
                &format!("--webhook-addr=127.0.0.1:{port}"),
                &format!("--self-register-url=https://127.0.0.1:{port}"),
                &format!("--probe-addr=127.0.0.1:{probe}"),
                &format!("--webhook-config-name=capo-test-{ns}"),
                &format!("--webhook-namespaces={ns}"),
                "--namespace=capo-system",
                "--leader-elect=false",
                &format!("--policy-prefix={ns}-"),
                "--calico-api=crd.projectcalico.org/v1",
                "--review-memory-mib=64",
            ])
            .env("KUBECONFIG", &capo_testenv::shared().kubeconfig)
            .env("RUST_LOG", "capo=info")
            .env("NO_COLOR", "1")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start capo");
        Self { child, probe, port, log }
    }

    /// Resident memory now and at its peak (VmRSS, VmHWM), in MiB.
    fn memory(&self) -> (f64, f64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id().unwrap())).unwrap();
        let kib = |key: &str| -> f64 {
            let line = status.lines().find(|l| l.starts_with(key)).unwrap();
            line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap()
        };
        (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let resp = reqwest::get(format!("http://127.0.0.1:{}{path}", self.probe)).await.ok()?;
        Some((resp.status().as_u16(), resp.text().await.ok()?))
    }
}

/// A DELETE review of a Pod that does not exist, padded to `size` bytes with a list of
/// zeros in its spec (a generic JSON tree of it would be many times its size).
fn padded_review(ns: &str, name: &str, size: usize) -> Vec<u8> {
    let head = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": name, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": name, "namespace": ns, "operation": "DELETE", "userInfo": {"username": "mallory"},
            "oldObject": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": { "name": name, "namespace": ns, "uid": format!("uid-{name}") },
                "status": { "podIPs": [{ "ip": "10.99.0.1" }] },
                "spec": { "padding": [] },
            },
        }
    })
    .to_string();
    let (before, after) = head.split_at(head.find("\"padding\":[]").unwrap() + "\"padding\":[".len());
    let room = size - before.len() - 1 - after.len();
    let mut body = Vec::with_capacity(size);
    body.extend_from_slice(before.as_bytes());
    body.push(b'0');
    body.extend(std::iter::repeat_n(b",0", room / 2).flatten());
    body.extend(std::iter::repeat_n(b' ', room % 2));
    body.extend_from_slice(after.as_bytes());
    body
}

#[tokio::test]
async fn thirty_two_concurrent_four_mib_reviews_stay_within_capos_review_memory_while_it_answers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (client, ns) = setup("lim-rss").await;
    let capo = Capo::spawn(&ns.name).await;
    eventually("capo ready", Duration::from_secs(60), || async {
        capo.get("/readyz").await.filter(|(code, _)| *code == 200)
    })
    .await;
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &ns.name);
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("capo-canary", &[], &[]), &[Ips::v4()]).await;
    eventually("the API server calls capo", Duration::from_secs(60), || {
        let pods = pods.clone();
        let capo = &capo;
        async move {
            let dry = kube::api::DeleteParams { dry_run: true, ..Default::default() };
            pods.delete("capo-canary", &dry).await.ok()?;
            capo.get("/metrics").await?.1.contains("capo_admission_requests_total{operation=\"delete\"").then_some(())
        }
    })
    .await;
    let policy = format!("{}-p", ns.name);
    apply_policy(&client, &policy, &ns.name, json!({ "podSelector": { "matchLabels": { "app": "zk" } } })).await;
    let ip = Ips::v4();
    create_pod_with_ips(&client, &ns.name, unscheduled_pod("zk-0", &[("app", "zk")], &[]), &[ip]).await;

    let (idle, _) = capo.memory();
    let size = capo::admission::LARGE_REVIEW_BYTES * 16; // 4 MiB, the largest review capo reads
    let bodies: Vec<Arc<Vec<u8>>> =
        (0..32).map(|i| Arc::new(padded_review(&ns.name, &format!("forged-{i}"), size))).collect();
    assert!(serde_json::from_slice::<serde_json::Value>(&bodies[0]).is_ok() && bodies[0].len() == size);
    let http = reqwest::Client::builder().danger_accept_invalid_certs(true).build().unwrap();
    let url = format!("https://127.0.0.1:{}{}?timeout=10s", capo.port, capo::admission::REVIEW_PATH);
    let flood = bodies.iter().map(|body| {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        tokio::spawn(async move {
            let sent = Instant::now();
            let resp = http.post(url).header("content-type", "application/json").body((*body).clone()).send().await;
            (resp.map(|r| r.status().as_u16()).unwrap_or(0), sent.elapsed())
        })
    });
    let flood: Vec<_> = flood.collect();
    // While the flood is read: /readyz answers, and an ordinary deletion is held.
    let probing = Instant::now();
    let mut probes = 0;
    while !flood.iter().all(|f| f.is_finished()) && probing.elapsed() < Duration::from_secs(30) {
        let asked = Instant::now();
        let ready = tokio::time::timeout(Duration::from_secs(2), capo.get("/readyz")).await;
        assert!(matches!(ready, Ok(Some((200, _)))), "/readyz during the flood: {ready:?}");
        assert!(asked.elapsed() < Duration::from_secs(1), "/readyz took {:?}", asked.elapsed());
        probes += 1;
        if probes == 1 {
            delete_pod(&client, &ns.name, "zk-0").await.expect("deletion allowed");
            assert!(record(&client, ip).await.is_some(), "{ip} held during the flood");
        }
    }
    let mut answers = Vec::new();
    for f in flood {
        answers.push(f.await.unwrap());
    }
    let (rss, peak) = capo.memory();
    let shed = answers.iter().filter(|(code, _)| *code == 429).count();
    eprintln!(
        "32 × 4 MiB reviews: {} answered 200, {shed} shed (429), slowest {:?}; RSS idle {idle:.1} MiB, after {rss:.1} MiB, peak {peak:.1} MiB; {probes} /readyz probes",
        answers.iter().filter(|(code, _)| *code == 200).count(),
        answers.iter().map(|(_, t)| *t).max().unwrap(),
    );
    // A shed review is answered 429 before its body is read; a client still sending 4 MiB
    // may see the connection close under it instead of the answer (0 here: no status).
    // Either way it is refused at once, well inside the review's deadline.
    assert!(answers.iter().all(|(code, _)| [200, 429, 0].contains(code)), "{answers:?}");
    assert!(
        answers.iter().filter(|(code, _)| *code != 200).all(|(_, t)| *t < Duration::from_secs(5)),
        "refused at once: {answers:?}"
    );
    if probes == 0 {
        // The flood was over before the first probe: the deletion is still held after it.
        delete_pod(&client, &ns.name, "zk-0").await.expect("deletion allowed");
        assert!(record(&client, ip).await.is_some(), "{ip} held after the flood");
    }
    // The bound: what capo had before, the 64 MiB of review memory it is given, and 16 MiB
    // for 32 connections' buffers and the answers. A generic JSON tree of one of these
    // bodies alone would be some 64 MiB.
    let bound = idle + 64.0 + 16.0;
    assert!(peak <= bound, "peak RSS {peak:.1} MiB over the bound {bound:.1} MiB");
    let metrics = capo.get("/metrics").await.unwrap().1;
    assert!(
        metrics.contains("capo_admission_unconfirmed_total{reason=\"no_such_pod\"}"),
        "the forged Pods are not held"
    );
}

#[tokio::test]
async fn past_the_connection_cap_a_new_connection_is_closed_at_once_and_counted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (client, ns) = setup("lim-cap").await;
    let name = format!("capo-test-{}", ns.name);
    let mut settings = capo_settings(&name, &[&ns.name], None);
    settings.limits.connections.max_connections = 20;
    let capo = start_capo_with(&client, &ns.name, settings).await;
    // The API server's own connection(s) count too: fill up to the cap with idle ones.
    let mut held = Vec::new();
    let refused = loop {
        let mut tcp = TcpStream::connect(capo.webhook_addr).await.unwrap();
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(500), tcp.read(&mut byte)).await {
            Err(_) => held.push(tcp),
            Ok(_) => break tcp,
        }
        assert!(held.len() <= 20, "more than 20 connections open at once");
    };
    drop(refused);
    assert!(held.len() >= 15, "the cap admitted only {} idle connections", held.len());
    assert_eq!(metric_value(&capo, "capo_webhook_connections_closed_total{reason=\"refused\"}"), Some(1.0));
    // A connection that goes makes room for a new one.
    held.pop();
    let slot = eventually("room for a connection", Duration::from_secs(5), || async {
        let mut tcp = TcpStream::connect(capo.webhook_addr).await.ok()?;
        let mut byte = [0u8; 1];
        tokio::time::timeout(Duration::from_millis(500), tcp.read(&mut byte)).await.is_err().then_some(tcp)
    })
    .await;
    drop((slot, held));
}
