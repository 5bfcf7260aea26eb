//! Who may call the webhook, besides whoever can reach its port: optionally only clients
//! with a certificate from a given CA (mTLS), and optionally only requests carrying a
//! bearer token read from a file. The API server presents either when its
//! `AdmissionConfiguration` names a kubeconfig for capo's webhook (docs/install.md).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::http::{HeaderMap, header};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::server::danger::ClientCertVerifier;

/// What a caller must present.
#[derive(Clone, Debug, Default)]
pub struct CallerAuth {
    /// Require a client certificate signed by a CA in this PEM file.
    pub client_ca_file: Option<PathBuf>,
    /// Require `Authorization: Bearer <the file's content, trimmed>`; the file is read
    /// again when it changes.
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("the webhook's client CA {path}: {message}")]
    ClientCa { path: PathBuf, message: String },
    #[error("the webhook's token file {path}: {message}")]
    TokenFile { path: PathBuf, message: String },
}

/// The verifier of client certificates for `path`'s CAs.
pub fn client_verifier(path: &Path) -> Result<Arc<dyn ClientCertVerifier>, AuthError> {
    let fail = |message: String| AuthError::ClientCa { path: path.to_path_buf(), message };
    let pem = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.map_err(|e| fail(e.to_string()))?).map_err(|e| fail(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(fail("no certificate in it".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| fail(e.to_string()))
}

/// Checks the bearer token of each request against the token file.
pub struct TokenCheck {
    path: PathBuf,
    /// The token as last read, and the file's modification time then.
    cached: Mutex<(Option<SystemTime>, Vec<u8>)>,
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    NoToken,
    WrongToken,
}

impl Refused {
    pub fn reason(self) -> &'static str {
        match self {
            Self::NoToken => "no_token",
            Self::WrongToken => "wrong_token",
        }
    }
}

impl TokenCheck {
    /// Reads the token now: a missing or empty file is an error at start.
    pub fn new(path: PathBuf) -> Result<Self, AuthError> {
        let check = Self { path, cached: Mutex::new((None, Vec::new())) };
        if check.token().is_empty() {
            let message = match std::fs::read(&check.path) {
                Ok(_) => "it is empty".to_string(),
                Err(e) => e.to_string(),
            };
            return Err(AuthError::TokenFile { path: check.path, message });
        }
        Ok(check)
    }

    /// The token, read again when the file's modification time changed (a rotated
    /// Secret). A file that cannot be read keeps the token last read.
    fn token(&self) -> Vec<u8> {
        let mut cached = self.cached.lock().expect("token lock");
        let modified = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if (modified.is_none() || modified != cached.0)
            && let Ok(raw) = std::fs::read(&self.path)
        {
            let token = String::from_utf8_lossy(&raw).trim().as_bytes().to_vec();
            if !token.is_empty() {
                *cached = (modified, token);
            }
        }
        cached.1.clone()
    }

    pub fn check(&self, headers: &HeaderMap) -> Result<(), Refused> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(Refused::NoToken)?;
        if equal(presented.as_bytes(), &self.token()) { Ok(()) } else { Err(Refused::WrongToken) }
    }
}

/// Compares in time that depends on the lengths only.
fn equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, format!("Bearer {t}").parse().unwrap());
        h
    }

    #[test]
    fn the_token_is_checked_and_read_again_when_the_file_changes() {
        let dir = std::env::temp_dir().join(format!("capo-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "first\n").unwrap();
        let check = TokenCheck::new(path.clone()).unwrap();
        assert_eq!(check.check(&bearer("first")), Ok(()));
        assert_eq!(check.check(&bearer("firs")), Err(Refused::WrongToken));
        assert_eq!(check.check(&HeaderMap::new()), Err(Refused::NoToken));
        // A rotation: a new file renamed into place (a new modification time).
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(dir.join("next"), "second").unwrap();
        std::fs::rename(dir.join("next"), &path).unwrap();
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options().write(true).open(&path).unwrap().set_modified(later).unwrap();
        assert_eq!(check.check(&bearer("second")), Ok(()));
        assert_eq!(check.check(&bearer("first")), Err(Refused::WrongToken));
        std::fs::write(&path, "").unwrap();
        assert!(TokenCheck::new(path).is_err(), "an empty token file is refused at start");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_client_ca_file_without_a_certificate_is_refused() {
        let path = std::env::temp_dir().join(format!("capo-empty-ca-{}", std::process::id()));
        std::fs::write(&path, "").unwrap();
        let err = client_verifier(&path).err().unwrap().to_string();
        assert!(err.contains("no certificate"), "{err}");
        let _ = std::fs::remove_file(&path);
    }
}
