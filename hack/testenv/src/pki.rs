//! The control plane's certificates: one CA that signs the API server's serving
//! certificate and the admin client certificate, plus the service-account signing key.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

use crate::Error;

pub struct Pki {
    pub ca_pem: String,
    pub admin_cert_pem: String,
    pub admin_key_pem: String,
}

fn cert_err(what: &'static str) -> impl Fn(rcgen::Error) -> Error {
    move |source| Error::Certificate { what, source }
}

/// Writes `ca.crt`, `apiserver.{crt,key}`, `admin.{crt,key}` and `sa.{key,pub}` into `dir`.
pub fn write(dir: &Path) -> Result<Pki, Error> {
    let ca_key = KeyPair::generate().map_err(cert_err("CA key"))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA params"))?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "capo-testenv-ca");
    ca_params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(cert_err("CA certificate"))?;
    let ca = Issuer::new(ca_params, ca_key);

    let serving_key = KeyPair::generate().map_err(cert_err("serving key"))?;
    let mut serving = CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "localhost".to_string(),
        "10.0.0.1".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
    ])
    .map_err(cert_err("serving params"))?;
    serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving_cert = serving.signed_by(&serving_key, &ca).map_err(cert_err("serving certificate"))?;

    let admin_key = KeyPair::generate().map_err(cert_err("admin key"))?;
    let mut admin = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("admin params"))?;
    admin.distinguished_name.push(DnType::CommonName, "capo-testenv-admin");
    admin.distinguished_name.push(DnType::OrganizationName, "system:masters");
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let admin_cert = admin.signed_by(&admin_key, &ca).map_err(cert_err("admin certificate"))?;

    let sa_key = KeyPair::generate().map_err(cert_err("service-account key"))?;

    let pki = Pki { ca_pem: ca_cert.pem(), admin_cert_pem: admin_cert.pem(), admin_key_pem: admin_key.serialize_pem() };
    let files = [
        ("ca.crt", pki.ca_pem.clone()),
        ("apiserver.crt", serving_cert.pem()),
        ("apiserver.key", serving_key.serialize_pem()),
        ("admin.crt", pki.admin_cert_pem.clone()),
        ("admin.key", pki.admin_key_pem.clone()),
        ("sa.key", sa_key.serialize_pem()),
        ("sa.pub", sa_key.public_key_pem()),
    ];
    for (name, pem) in files {
        let path = dir.join(name);
        std::fs::write(&path, pem).map_err(|source| Error::Io { path: path.clone(), source })?;
    }
    Ok(pki)
}
