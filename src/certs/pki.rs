//! The certificates capo makes — a CA, and the serving certificate that CA signs — and
//! what capo reads back from a PEM: serial, validity, host names, issuer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SerialNumber,
};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("generating {what}: {source}")]
    Generate { what: &'static str, source: rcgen::Error },
    #[error("{what} is not a PEM certificate: {reason}")]
    NotACertificate { what: String, reason: String },
    #[error("{what} holds no certificate")]
    Empty { what: String },
    #[error("{what} is not a usable private key: {source}")]
    Key { what: String, source: rcgen::Error },
}

/// A certificate and its private key, both PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyedCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// What capo needs to know of a certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// Hex, as `openssl x509 -serial` prints it.
    pub serial: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub is_ca: bool,
    /// DNS names and IP addresses it is valid for.
    pub hosts: Vec<String>,
    pub der: Vec<u8>,
}

impl CertInfo {
    pub fn lifetime(&self) -> Duration {
        self.not_after.duration_since(self.not_before).unwrap_or_default()
    }

    /// The moment a given fraction of its lifetime has passed.
    pub fn at_fraction(&self, numerator: u32, denominator: u32) -> SystemTime {
        self.not_before + self.lifetime() * numerator / denominator
    }

    pub fn expired(&self, now: SystemTime) -> bool {
        now >= self.not_after
    }

    /// Whether `ca` signed this certificate (the signature checks out with its key).
    pub fn signed_by(&self, ca: &CertInfo) -> bool {
        let (Ok((_, me)), Ok((_, ca))) = (X509Certificate::from_der(&self.der), X509Certificate::from_der(&ca.der))
        else {
            return false;
        };
        me.issuer() == ca.subject() && me.verify_signature(Some(ca.public_key())).is_ok()
    }

    /// Seconds since the epoch of `not_after` (for metrics).
    pub fn not_after_unix(&self) -> i64 {
        unix(self.not_after)
    }
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Every certificate of a PEM bundle, in order. `what` names it in errors.
pub fn parse_bundle(what: &str, pem: &str) -> Result<Vec<CertInfo>, PkiError> {
    let bad = |reason: String| PkiError::NotACertificate { what: what.to_string(), reason };
    let mut out = Vec::new();
    for block in x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes()) {
        let block = block.map_err(|e| bad(e.to_string()))?;
        if block.label != "CERTIFICATE" {
            continue;
        }
        let (_, cert) = X509Certificate::from_der(&block.contents).map_err(|e| bad(e.to_string()))?;
        out.push(info(&cert, block.contents.clone()));
    }
    if out.is_empty() {
        return Err(PkiError::Empty { what: what.to_string() });
    }
    Ok(out)
}

/// The first certificate of a PEM (a serving certificate's chain starts with the leaf).
pub fn parse_one(what: &str, pem: &str) -> Result<CertInfo, PkiError> {
    Ok(parse_bundle(what, pem)?.remove(0))
}

/// Checks that `key_pem` is a private key rcgen and rustls can use.
pub fn check_key(what: &str, key_pem: &str) -> Result<(), PkiError> {
    KeyPair::from_pem(key_pem).map(|_| ()).map_err(|source| PkiError::Key { what: what.to_string(), source })
}

fn info(cert: &X509Certificate<'_>, der: Vec<u8>) -> CertInfo {
    let validity = cert.validity();
    let at = |t: i64| UNIX_EPOCH + Duration::from_secs(t.max(0) as u64);
    let mut hosts = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(d) => hosts.push(d.to_string()),
                GeneralName::IPAddress(bytes) => {
                    let ip = match bytes.len() {
                        4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(&bytes[..]).expect("4 bytes"))),
                        16 => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(&bytes[..]).expect("16 bytes"))),
                        _ => None,
                    };
                    hosts.extend(ip.map(|ip| ip.to_string()));
                }
                _ => {}
            }
        }
    }
    CertInfo {
        serial: cert.raw_serial_as_string().replace(':', ""),
        not_before: at(validity.not_before.timestamp()),
        not_after: at(validity.not_after.timestamp()),
        is_ca: cert.is_ca(),
        hosts,
        der,
    }
}

fn offset(t: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(unix(t)).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

/// A random positive 16-byte serial number.
fn serial() -> SerialNumber {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new().fill(&mut bytes).expect("the system's random source");
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

/// A little backdating, so an API server whose clock is slightly behind accepts a new
/// certificate at once: a tenth of the lifetime, at most an hour.
fn backdate(validity: Duration) -> Duration {
    (validity / 10).min(Duration::from_secs(3600))
}

/// A new CA, valid from about `now` for `validity`.
pub fn new_ca(now: SystemTime, validity: Duration) -> Result<KeyedCert, PkiError> {
    let err = |what| move |source| PkiError::Generate { what, source };
    let key = KeyPair::generate().map_err(err("the CA key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err("the CA"))?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.distinguished_name.push(DnType::CommonName, format!("capo webhook CA {}", unix(now)));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = offset(now - backdate(validity));
    params.not_after = offset(now + validity);
    params.serial_number = Some(serial());
    let cert = params.self_signed(&key).map_err(err("the CA certificate"))?;
    Ok(KeyedCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// A serving certificate for `hosts` signed by `ca`, valid for `validity` but never
/// beyond the CA's own expiry.
pub fn new_leaf(ca: &KeyedCert, hosts: &[String], now: SystemTime, validity: Duration) -> Result<KeyedCert, PkiError> {
    let err = |what| move |source| PkiError::Generate { what, source };
    let ca_key =
        KeyPair::from_pem(&ca.key_pem).map_err(|source| PkiError::Key { what: "the CA key".into(), source })?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(err("the CA issuer"))?;
    let ca_info = parse_one("the CA certificate", &ca.cert_pem)?;
    let key = KeyPair::generate().map_err(err("the serving key"))?;
    let mut params = CertificateParams::new(hosts.to_vec()).map_err(err("the serving certificate"))?;
    params.distinguished_name.push(DnType::CommonName, "capo webhook");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = offset((now - backdate(validity)).max(ca_info.not_before));
    params.not_after = offset((now + validity).min(ca_info.not_after));
    params.serial_number = Some(serial());
    let cert = params.signed_by(&key, &issuer).map_err(err("the serving certificate"))?;
    Ok(KeyedCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86400);

    #[test]
    fn a_leaf_is_signed_by_its_ca_and_not_by_another() {
        let now = SystemTime::now();
        let ca = new_ca(now, 365 * DAY).unwrap();
        let other = new_ca(now, 365 * DAY).unwrap();
        let hosts = vec!["127.0.0.1".to_string(), "capo.capo-system.svc".to_string()];
        let leaf = new_leaf(&ca, &hosts, now, 30 * DAY).unwrap();
        let (ca, other, leaf_info) = (
            parse_one("ca", &ca.cert_pem).unwrap(),
            parse_one("other", &other.cert_pem).unwrap(),
            parse_one("leaf", &leaf.cert_pem).unwrap(),
        );
        assert!(ca.is_ca && !leaf_info.is_ca);
        assert!(leaf_info.signed_by(&ca));
        assert!(!leaf_info.signed_by(&other));
        assert_eq!(leaf_info.hosts, hosts);
        assert_ne!(ca.serial, other.serial);
        check_key("leaf key", &leaf.key_pem).unwrap();
    }

    #[test]
    fn validity_is_backdated_a_little_and_a_leaf_never_outlives_its_ca() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let ca = new_ca(now, 10 * DAY).unwrap();
        let info = parse_one("ca", &ca.cert_pem).unwrap();
        assert_eq!(info.not_before, now - Duration::from_secs(3600));
        assert_eq!(info.not_after, now + 10 * DAY);
        let leaf = parse_one("leaf", &new_leaf(&ca, &["a".into()], now, 30 * DAY).unwrap().cert_pem).unwrap();
        assert_eq!(leaf.not_after, info.not_after, "capped at the CA's expiry");
        let short =
            parse_one("leaf", &new_leaf(&ca, &["a".into()], now, Duration::from_secs(20)).unwrap().cert_pem).unwrap();
        assert_eq!(short.not_before, now - Duration::from_secs(2));
        assert_eq!(short.at_fraction(2, 3), now - Duration::from_secs(2) + Duration::from_secs(44) / 3);
    }

    #[test]
    fn bundles_and_garbage() {
        let now = SystemTime::now();
        let (a, b) = (new_ca(now, DAY).unwrap(), new_ca(now, DAY).unwrap());
        let bundle = parse_bundle("ca.crt", &format!("{}{}", a.cert_pem, b.cert_pem)).unwrap();
        assert_eq!(bundle.len(), 2);
        let err = parse_bundle("ca.crt", "hello").unwrap_err();
        assert!(err.to_string().contains("ca.crt holds no certificate"), "{err}");
        let err =
            parse_bundle("tls.crt", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap_err();
        assert!(err.to_string().starts_with("tls.crt is not a PEM certificate"), "{err}");
        assert!(check_key("tls.key", "nope").unwrap_err().to_string().contains("tls.key is not a usable private key"));
    }
}
