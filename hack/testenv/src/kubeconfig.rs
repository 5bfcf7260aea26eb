//! The admin kubeconfig: certificates embedded, so the file can be copied anywhere.

use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::Error;
use crate::pki::Pki;

pub fn write(path: &Path, server: &str, pki: &Pki) -> Result<(), Error> {
    let b64 = |s: &str| STANDARD.encode(s.as_bytes());
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "capo-testenv", "cluster": {
            "server": server,
            "certificate-authority-data": b64(&pki.ca_pem),
        }}],
        "users": [{ "name": "admin", "user": {
            "client-certificate-data": b64(&pki.admin_cert_pem),
            "client-key-data": b64(&pki.admin_key_pem),
        }}],
        "contexts": [{ "name": "capo-testenv", "context": { "cluster": "capo-testenv", "user": "admin" } }],
        "current-context": "capo-testenv",
    });
    let yaml = serde_saphyr::to_string(&config).expect("kubeconfig serializes");
    std::fs::write(path, yaml).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}
