//! Certificates from a directory — a mounted Secret (cert-manager's, or the operator's):
//! `tls.crt` and `tls.key`, and `ca.crt` when the CA bundle is to be injected. Reloaded
//! when the directory changes: kubelet updates a mounted Secret by writing a new
//! timestamped directory and swapping the `..data` symlink, so capo watches the
//! directory, not the files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tracing::{info, warn};

use super::{CA_FILE, CERT_FILE, CertError, KEY_FILE, ServingCert};

fn read(path: PathBuf) -> Result<String, CertError> {
    std::fs::read_to_string(&path).map_err(|source| CertError::Io { path, source })
}

/// Loads the directory into `serving`: the certificate and key, and `ca.crt` as the
/// bundle when it is there. Returns whether the served certificate changed.
pub fn load(dir: &Path, serving: &ServingCert) -> Result<bool, CertError> {
    let cert = read(dir.join(CERT_FILE))?;
    let key = read(dir.join(KEY_FILE))?;
    let changed = serving.set(&dir.join(CERT_FILE).display().to_string(), &cert, &key)?;
    let ca_path = dir.join(CA_FILE);
    let bundle = match std::fs::read_to_string(&ca_path) {
        Ok(pem) => {
            super::pki::parse_bundle(&ca_path.display().to_string(), &pem)?;
            Some(pem)
        }
        Err(_) => None,
    };
    serving.set_bundle(bundle.as_deref());
    Ok(changed)
}

/// Reloads `dir` into `serving` whenever something in it changes; a bad update is
/// logged and the certificate served so far is kept.
pub fn watch(dir: PathBuf, serving: Arc<ServingCert>) -> Result<notify::RecommendedWatcher, CertError> {
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
            match load(&dir, &serving) {
                Ok(true) => info!(dir = %dir.display(), "reloaded the serving certificate"),
                Ok(false) => {}
                Err(e) => {
                    warn!(dir = %dir.display(), error = %e, "could not reload the serving certificate; keeping the old one")
                }
            }
        }
    });
    Ok(watcher)
}
