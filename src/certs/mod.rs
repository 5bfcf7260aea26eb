//! The webhook's certificates. Three sources feed one [`ServingCert`], which the
//! webhook server reads on every TLS handshake:
//!
//! - [`managed`]: capo makes and rotates its own CA and serving certificate in a Secret
//!   of its namespace (the default install), every replica serving what the Secret holds;
//! - [`files`]: `tls.crt`/`tls.key` (and `ca.crt`) in a directory, a mounted Secret from
//!   cert-manager or the operator, reloaded when kubelet swaps it;
//! - [`self_signed`]: made in memory at start (local runs and tests).
//!
//! [`inject`] writes the CA bundle of the first two into capo's
//! ValidatingWebhookConfiguration, so the API server trusts what capo serves.

pub mod files;
pub mod inject;
pub mod managed;
pub mod pki;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;

pub use pki::{CertInfo, KeyedCert, PkiError};

/// The one object named `name`, as a watch (with kube's backoff) sees it: an item each
/// time it changes once the watch is synced — `Some(object)`, or `None` while it does not
/// exist. The first item says whether it exists at all. Watch errors are logged and
/// retried; they end nothing.
pub(crate) fn watch_named<K>(api: kube::Api<K>, name: &str) -> impl futures::Stream<Item = Option<K>> + Send + 'static
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default,
{
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let name = name.to_string();
    let (mut seen, mut synced) = (None::<K>, false);
    watcher::watcher(api, config).default_backoff().filter_map(move |event| {
        let item = match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                seen = Some(o);
                synced.then(|| seen.clone())
            }
            Ok(watcher::Event::Delete(_)) => {
                seen = None;
                synced.then_some(None)
            }
            Ok(watcher::Event::Init) => {
                (seen, synced) = (None, false);
                None
            }
            Ok(watcher::Event::InitDone) => {
                synced = true;
                Some(seen.clone())
            }
            Err(e) => {
                tracing::warn!(name, error = %e, "watch failed; retrying");
                None
            }
        };
        std::future::ready(item)
    })
}

use crate::metrics::TlsMetrics;

pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
pub const CA_FILE: &str = "ca.crt";

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("{what}: the private key does not fit the certificate, or rustls cannot use it: {source}")]
    Unusable { what: String, source: rustls::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("watching {dir} for certificate changes: {source}")]
    Watch { dir: PathBuf, source: notify::Error },
    #[error("no serving certificate yet: {0}")]
    NotYet(String),
}

/// The certificate being served now.
pub struct Served {
    pub key: Arc<CertifiedKey>,
    pub info: CertInfo,
    /// Counts up with every new certificate.
    pub generation: u64,
}

/// The certificate the webhook serves, swapped atomically when a new one arrives. Each
/// change bumps a generation: connections made with an older one are closed gracefully,
/// so clients (the API server keeps connections open) reconnect and meet the new one.
pub struct ServingCert {
    current: ArcSwapOption<Served>,
    generation: watch::Sender<u64>,
    /// The CA bundle clients should trust (what [`inject`] writes as caBundle).
    bundle: watch::Sender<Option<Arc<str>>>,
    /// Completed handshakes per served certificate (serial), the most recent few.
    handshakes: Mutex<VecDeque<(String, u64)>>,
    metrics: Option<TlsMetrics>,
}

impl std::fmt::Debug for ServingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert").field("generation", &*self.generation.borrow()).finish()
    }
}

impl ServingCert {
    pub fn new(metrics: Option<TlsMetrics>) -> Arc<Self> {
        Arc::new(Self {
            current: ArcSwapOption::empty(),
            generation: watch::Sender::new(0),
            bundle: watch::Sender::new(None),
            handshakes: Mutex::new(VecDeque::new()),
            metrics,
        })
    }

    /// Serves `chain_pem` (leaf first) with `key_pem` from now on. Returns whether it is a
    /// different certificate from the one served so far; a bad pair changes nothing.
    pub fn set(&self, what: &str, chain_pem: &str, key_pem: &str) -> Result<bool, CertError> {
        let info = pki::parse_one(what, chain_pem)?;
        if self.current.load().as_ref().is_some_and(|c| c.info.der == info.der) {
            return Ok(false);
        }
        let unusable = |source| CertError::Unusable { what: what.to_string(), source };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| unusable(rustls::Error::General(e.to_string())))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| unusable(rustls::Error::General(format!("the private key: {e}"))))?;
        let certified =
            CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider()).map_err(unusable)?;
        let generation = *self.generation.borrow() + 1;
        if let Some(m) = &self.metrics {
            m.certificate_expiry.set(info.not_after_unix());
        }
        tracing::info!(serial = %info.serial, generation, not_after = info.not_after_unix(), "serving a new certificate");
        self.current.store(Some(Arc::new(Served { key: Arc::new(certified), info, generation })));
        self.generation.send_replace(generation);
        Ok(true)
    }

    /// Sets the CA bundle clients should trust (PEM); `None`: unknown (nothing to inject).
    pub fn set_bundle(&self, pem: Option<&str>) {
        self.bundle.send_if_modified(|b| {
            let new = pem.map(Arc::<str>::from);
            let changed = *b != new;
            *b = new;
            changed
        });
    }

    pub fn bundle(&self) -> watch::Receiver<Option<Arc<str>>> {
        self.bundle.subscribe()
    }

    pub fn current(&self) -> Option<Arc<Served>> {
        self.current.load_full()
    }

    pub fn generation(&self) -> u64 {
        *self.generation.borrow()
    }

    /// Changes of the generation (a new certificate).
    pub fn generations(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Waits until a certificate is served.
    pub async fn ready(&self) {
        let mut rx = self.generation.subscribe();
        let _ = rx.wait_for(|g| *g > 0).await;
    }

    /// A handshake completed with the certificate of `generation` (`None`: it changed
    /// during the handshake).
    pub(crate) fn handshake_ok(&self, generation: Option<u64>) {
        if let Some(m) = &self.metrics {
            m.handshakes.with_label_values(&["ok"]).inc();
        }
        let Some(served) = self.current.load_full().filter(|c| Some(c.generation) == generation) else {
            return;
        };
        let mut counts = self.handshakes.lock().expect("handshake counts");
        match counts.iter_mut().find(|(s, _)| *s == served.info.serial) {
            Some((_, n)) => *n += 1,
            None => {
                counts.push_back((served.info.serial.clone(), 1));
                if counts.len() > 32 {
                    counts.pop_front();
                }
            }
        }
    }

    pub(crate) fn handshake_failed(&self) {
        if let Some(m) = &self.metrics {
            m.handshakes.with_label_values(&["failed"]).inc();
        }
    }

    /// Completed TLS handshakes made with the certificate of this serial (the most recent
    /// few certificates are remembered).
    pub fn handshakes_with(&self, serial: &str) -> u64 {
        let counts = self.handshakes.lock().expect("handshake counts");
        counts.iter().find(|(s, _)| s == serial).map_or(0, |(_, n)| *n)
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.load().as_ref().map(|c| c.key.clone())
    }
}

/// A CA and a serving certificate it signed, made in memory (local runs and tests).
pub struct SelfSigned {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Makes a CA and a serving certificate for `hosts` (IP addresses or DNS names), valid
/// for a year.
pub fn self_signed(hosts: &[String]) -> Result<SelfSigned, CertError> {
    let now = std::time::SystemTime::now();
    let year = std::time::Duration::from_secs(365 * 86400);
    let ca = pki::new_ca(now, year)?;
    let leaf = pki::new_leaf(&ca, hosts, now, year)?;
    Ok(SelfSigned { ca_pem: ca.cert_pem, cert_pem: leaf.cert_pem, key_pem: leaf.key_pem })
}

impl SelfSigned {
    /// Writes `tls.crt`, `tls.key` and `ca.crt` into `dir`.
    pub fn write(&self, dir: &std::path::Path) -> Result<(), CertError> {
        let io = |path: PathBuf| move |source| CertError::Io { path, source };
        std::fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;
        for (name, pem) in [(CERT_FILE, &self.cert_pem), (KEY_FILE, &self.key_pem), (CA_FILE, &self.ca_pem)] {
            let path = dir.join(name);
            std::fs::write(&path, pem).map_err(io(path.clone()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_certificate_bumps_the_generation_and_a_bad_one_changes_nothing() {
        let serving = ServingCert::new(None);
        let a = self_signed(&["127.0.0.1".into()]).unwrap();
        assert!(serving.set("a", &a.cert_pem, &a.key_pem).unwrap());
        assert_eq!(serving.generation(), 1);
        assert!(!serving.set("a again", &a.cert_pem, &a.key_pem).unwrap(), "the same certificate");
        let b = self_signed(&["127.0.0.1".into()]).unwrap();
        let err = serving.set("mismatched", &b.cert_pem, &a.key_pem).unwrap_err();
        assert!(err.to_string().contains("mismatched: the private key does not fit"), "{err}");
        assert!(serving.set("garbage", "nope", &a.key_pem).is_err());
        assert_eq!(serving.generation(), 1, "still the first");
        assert!(serving.set("b", &b.cert_pem, &b.key_pem).unwrap());
        assert_eq!(serving.generation(), 2);
        let serial = serving.current().unwrap().info.serial.clone();
        serving.handshake_ok(Some(2));
        serving.handshake_ok(Some(1)); // made with the old one: not counted for b
        assert_eq!(serving.handshakes_with(&serial), 1);
    }

    #[test]
    fn self_signed_certificates_are_pem() {
        let s = self_signed(&["127.0.0.1".into(), "capo.capo-system.svc".into()]).unwrap();
        assert!(s.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.key_pem.contains("PRIVATE KEY"));
        assert_ne!(s.ca_pem, s.cert_pem);
    }
}
