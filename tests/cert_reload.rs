//! The webhook's serving certificate comes from a mounted Secret and is reloaded when
//! kubelet updates it, which it does by writing a new timestamped directory and swapping
//! the `..data` symlink: capo watches the directory, not the files.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::{Duration, Instant};

use axum::routing::get;

/// Lays out `dir` as kubelet does: `tls.crt -> ..data/tls.crt`, `..data -> ..<version>`.
fn publish(dir: &Path, version: &str, certs: &capo::certs::SelfSigned) {
    let versioned = dir.join(format!("..{version}"));
    certs.write(&versioned).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(format!("..{version}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap(); // the atomic swap
    for f in ["tls.crt", "tls.key"] {
        let link = dir.join(f);
        if !link.exists() {
            symlink(format!("..data/{f}"), link).unwrap();
        }
    }
}

fn client_trusting(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .build()
        .unwrap()
}

#[tokio::test]
async fn serving_certificate_is_reloaded_when_the_secret_volume_swaps() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("capo-cert-reload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let hosts = ["127.0.0.1".to_string()];
    let first = capo::certs::self_signed(&hosts).unwrap();
    publish(&dir, "2026_11_22_01", &first);

    let config = capo::certs::load(&dir).await.unwrap();
    let _watcher = capo::certs::watch(dir.clone(), config.clone()).unwrap();
    let handle: axum_server::Handle<std::net::SocketAddr> = axum_server::Handle::new();
    let app = axum::Router::new().route("/healthz", get(|| async { "ok" }));
    tokio::spawn(
        axum_server::bind_rustls("127.0.0.1:0".parse().unwrap(), config)
            .handle(handle.clone())
            .serve(app.into_make_service()),
    );
    let url = format!("https://{}/healthz", handle.listening().await.unwrap());

    assert!(client_trusting(&first.ca_pem).get(&url).send().await.is_ok(), "serves the first certificate");
    let second = capo::certs::self_signed(&hosts).unwrap();
    assert!(client_trusting(&second.ca_pem).get(&url).send().await.is_err(), "not yet the second");

    publish(&dir, "2026_11_22_02", &second);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        // A fresh client each time: no pooled connection from before the swap.
        if client_trusting(&second.ca_pem).get(&url).send().await.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "the new certificate was not picked up within 15s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(client_trusting(&first.ca_pem).get(&url).send().await.is_err(), "the old certificate is gone");
    handle.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}
