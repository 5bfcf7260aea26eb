//! Calico's etcd datastore as the tests look at it: straight through etcd's JSON gateway,
//! with the client certificate Calico's components get.

use capo_testenv::CalicoEtcd;
use serde_json::json;

/// capo's settings for Calico's etcd: the endpoints and the client certificate Calico's
/// components get.
pub fn etcd_config(etcd: &CalicoEtcd) -> capo::calico::etcd::EtcdConfig {
    capo::calico::etcd::EtcdConfig {
        endpoints: vec![etcd.endpoints.clone()],
        ca_cert_file: Some(etcd.ca_cert_file.clone()),
        cert_file: Some(etcd.cert_file.clone()),
        key_file: Some(etcd.key_file.clone()),
    }
}

/// An HTTPS client for Calico's etcd with the client certificate Calico's components get.
pub fn etcd_http(etcd: &CalicoEtcd, with_identity: bool) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&etcd.ca_cert_file).unwrap()).unwrap();
    let mut b = reqwest::Client::builder().add_root_certificate(ca).use_rustls_tls();
    if with_identity {
        let mut pem = std::fs::read(&etcd.cert_file).unwrap();
        pem.extend(std::fs::read(&etcd.key_file).unwrap());
        b = b.identity(reqwest::Identity::from_pem(&pem).unwrap());
    }
    b.build().unwrap()
}

pub fn b64(s: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(s)
}

pub fn unb64(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// etcd's JSON gateway: the keys (and values) under `prefix`.
pub async fn etcd_range(http: &reqwest::Client, etcd: &CalicoEtcd, prefix: &str) -> Vec<(String, Vec<u8>)> {
    try_etcd_range(http, etcd, prefix).await.expect("etcd range")
}

/// [`etcd_range`], with etcd's error if it does not answer (a restart).
pub async fn try_etcd_range(
    http: &reqwest::Client,
    etcd: &CalicoEtcd,
    prefix: &str,
) -> Result<Vec<(String, Vec<u8>)>, reqwest::Error> {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let body = json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&end) });
    let r: serde_json::Value = http
        .post(format!("{}/v3/kv/range", etcd.endpoints))
        .json(&body)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(r["kvs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|kv| {
            let key = String::from_utf8(unb64(kv["key"].as_str().unwrap())).unwrap();
            (key, unb64(kv["value"].as_str().unwrap_or_default()))
        })
        .collect())
}

pub async fn etcd_put(http: &reqwest::Client, etcd: &CalicoEtcd, key: &str, value: &serde_json::Value) {
    let body = json!({ "key": b64(key.as_bytes()), "value": b64(value.to_string().as_bytes()) });
    let r = http.post(format!("{}/v3/kv/put", etcd.endpoints)).json(&body).send().await.expect("etcd put");
    assert!(r.status().is_success(), "{:?}", r.text().await);
}

/// Writes `value` as it is (bytes that need not be JSON).
pub async fn etcd_put_raw(http: &reqwest::Client, etcd: &CalicoEtcd, key: &str, value: &[u8]) {
    let body = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
    let r = http.post(format!("{}/v3/kv/put", etcd.endpoints)).json(&body).send().await.expect("etcd put");
    assert!(r.status().is_success(), "{:?}", r.text().await);
}

pub const RESERVATIONS_KEY: &str = "/calico/resources/v3/projectcalico.org/ipreservations/";

pub async fn etcd_delete(http: &reqwest::Client, etcd: &CalicoEtcd, key: &str) {
    let body = json!({ "key": b64(key.as_bytes()) });
    let r = http.post(format!("{}/v3/kv/deleterange", etcd.endpoints)).json(&body).send().await.expect("etcd delete");
    assert!(r.status().is_success(), "{:?}", r.text().await);
}
