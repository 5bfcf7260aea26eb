//! The admin kubeconfig: certificates embedded, so the file can be copied anywhere.

use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::Error;
use crate::pki::Pki;

pub fn write(path: &Path, server: &str, pki: &Pki) -> Result<(), Error> {
    write_with(path, server, &pki.ca_pem, "admin", &pki.admin_cert_pem, &pki.admin_key_pem)
}

/// The real node's kubelet's kubeconfig, from `node.{crt,key}` in `pki_dir`.
pub fn write_node(path: &Path, server: &str, pki_dir: &Path) -> Result<(), Error> {
    let read = |name: &str| {
        let p = pki_dir.join(name);
        std::fs::read_to_string(&p).map_err(|source| Error::Io { path: p, source })
    };
    write_with(path, server, &read("ca.crt")?, "node", &read("node.crt")?, &read("node.key")?)
}

fn write_with(path: &Path, server: &str, ca: &str, user: &str, cert: &str, key: &str) -> Result<(), Error> {
    let b64 = |s: &str| STANDARD.encode(s.as_bytes());
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "capo-testenv", "cluster": {
            "server": server,
            "certificate-authority-data": b64(ca),
        }}],
        "users": [{ "name": user, "user": {
            "client-certificate-data": b64(cert),
            "client-key-data": b64(key),
        }}],
        "contexts": [{ "name": "capo-testenv", "context": { "cluster": "capo-testenv", "user": user } }],
        "current-context": "capo-testenv",
    });
    let yaml = serde_saphyr::to_string(&config).expect("kubeconfig serializes");
    std::fs::write(path, yaml).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}
