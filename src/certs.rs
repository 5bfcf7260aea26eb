//! Webhook serving certificates: made by capo itself for local runs (its own CA, whose
//! certificate goes into the webhook configuration's `caBundle`), or read from a mounted
//! Secret and reloaded when kubelet swaps it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use notify::{RecursiveMode, Watcher};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use tracing::{info, warn};

pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("generating {what}: {source}")]
    Generate { what: &'static str, source: rcgen::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("loading the serving certificate from {dir}: {source}")]
    Load { dir: PathBuf, source: std::io::Error },
    #[error("watching {dir} for certificate changes: {source}")]
    Watch { dir: PathBuf, source: notify::Error },
}

/// A self-made CA and a serving certificate it signed.
pub struct SelfSigned {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Makes a CA and a serving certificate for `hosts` (IP addresses or DNS names).
pub fn self_signed(hosts: &[String]) -> Result<SelfSigned, CertError> {
    let err = |what| move |source| CertError::Generate { what, source };
    let ca_key = KeyPair::generate().map_err(err("the CA key"))?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err("the CA"))?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "capo webhook CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca.self_signed(&ca_key).map_err(err("the CA certificate"))?;
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().map_err(err("the serving key"))?;
    let mut leaf = CertificateParams::new(hosts.to_vec()).map_err(err("the serving certificate"))?;
    leaf.distinguished_name.push(DnType::CommonName, "capo webhook");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = leaf.signed_by(&key, &issuer).map_err(err("the serving certificate"))?;
    Ok(SelfSigned { ca_pem: ca_cert.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

impl SelfSigned {
    /// Writes `tls.crt`, `tls.key` and `ca.crt` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), CertError> {
        let io = |path: PathBuf| move |source| CertError::Io { path, source };
        std::fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;
        for (name, pem) in [(CERT_FILE, &self.cert_pem), (KEY_FILE, &self.key_pem), ("ca.crt", &self.ca_pem)] {
            let path = dir.join(name);
            std::fs::write(&path, pem).map_err(io(path.clone()))?;
        }
        Ok(())
    }
}

/// Loads `tls.crt`/`tls.key` from `dir`.
pub async fn load(dir: &Path) -> Result<RustlsConfig, CertError> {
    RustlsConfig::from_pem_file(dir.join(CERT_FILE), dir.join(KEY_FILE))
        .await
        .map_err(|source| CertError::Load { dir: dir.to_path_buf(), source })
}

/// Reloads `config` whenever something in `dir` changes. Watches the directory, not the
/// files: kubelet updates a mounted Secret by swapping a `..data` symlink.
pub fn watch(dir: PathBuf, config: RustlsConfig) -> Result<notify::RecommendedWatcher, CertError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = tx.send(());
        }
    })
    .map_err(|source| CertError::Watch { dir: dir.clone(), source })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive).map_err(|source| CertError::Watch { dir: dir.clone(), source })?;
    tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // A Secret update is several filesystem events; let them settle.
            tokio::time::sleep(Duration::from_millis(250)).await;
            while rx.try_recv().is_ok() {}
            match config.reload_from_pem_file(dir.join(CERT_FILE), dir.join(KEY_FILE)).await {
                Ok(()) => info!(dir = %dir.display(), "reloaded the serving certificate"),
                Err(e) => {
                    warn!(dir = %dir.display(), error = %e, "could not reload the serving certificate; keeping the old one")
                }
            }
        }
    });
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_certificates_are_pem() {
        let s = self_signed(&["127.0.0.1".into(), "capo.capo-system.svc".into()]).unwrap();
        assert!(s.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.key_pem.contains("PRIVATE KEY"));
        assert_ne!(s.ca_pem, s.cert_pem);
    }
}
