//! The control plane's certificates: one CA that signs the API server's serving
//! certificate, the admin client certificate and calico-apiserver's serving certificate,
//! the service-account signing key, and the front-proxy CA and client certificate with
//! which kube-apiserver tells aggregated API servers who is asking (as kubeadm sets up).

use std::path::{Path, PathBuf};

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

/// The Service (namespace, name) behind which calico-apiserver serves; its serving
/// certificate names it.
pub const CALICO_APISERVER_SERVICE: (&str, &str) = ("calico-apiserver", "calico-api");
/// The common name of the front-proxy client certificate (`--requestheader-allowed-names`).
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

/// A new CA named `name`: its certificate's PEM and the issuer that signs with it.
fn new_ca(name: &str) -> Result<(String, Issuer<'static, KeyPair>), Error> {
    let key = KeyPair::generate().map_err(cert_err("CA key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA params"))?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key).map_err(cert_err("CA certificate"))?;
    Ok((cert.pem(), Issuer::new(params, key)))
}

/// Writes `ca.crt`, `apiserver.{crt,key}`, `admin.{crt,key}`, `sa.{key,pub}`,
/// `front-proxy-ca.crt`, `front-proxy-client.{crt,key}`, `calico-apiserver.{crt,key}` and
/// the real node's `node.{crt,key}` into `dir`.
pub fn write(dir: &Path) -> Result<Pki, Error> {
    let (ca_pem, ca) = new_ca("capo-testenv-ca")?;

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

    let (namespace, service) = CALICO_APISERVER_SERVICE;
    let calico_key = KeyPair::generate().map_err(cert_err("calico-apiserver key"))?;
    let mut calico = CertificateParams::new(vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ])
    .map_err(cert_err("calico-apiserver params"))?;
    calico.distinguished_name.push(DnType::CommonName, "calico-apiserver");
    calico.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let calico_cert = calico.signed_by(&calico_key, &ca).map_err(cert_err("calico-apiserver certificate"))?;

    let (proxy_ca_pem, proxy_ca) = new_ca("capo-testenv-front-proxy-ca")?;
    let proxy_key = KeyPair::generate().map_err(cert_err("front-proxy client key"))?;
    let mut proxy = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("front-proxy client params"))?;
    proxy.distinguished_name.push(DnType::CommonName, FRONT_PROXY_CLIENT);
    proxy.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let proxy_cert = proxy.signed_by(&proxy_key, &proxy_ca).map_err(cert_err("front-proxy client certificate"))?;

    // The real node's kubelet (crate::real_node): a node's identity, as the Node
    // authorizer knows it.
    let node_key = KeyPair::generate().map_err(cert_err("node key"))?;
    let mut node = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("node params"))?;
    node.distinguished_name.push(DnType::CommonName, format!("system:node:{}", crate::real_node::REAL_NODE));
    node.distinguished_name.push(DnType::OrganizationName, "system:nodes");
    node.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let node_cert = node.signed_by(&node_key, &ca).map_err(cert_err("node certificate"))?;

    let pki =
        Pki { ca_pem: ca_pem.clone(), admin_cert_pem: admin_cert.pem(), admin_key_pem: admin_key.serialize_pem() };
    let files = [
        ("ca.crt", pki.ca_pem.clone()),
        ("apiserver.crt", serving_cert.pem()),
        ("apiserver.key", serving_key.serialize_pem()),
        ("admin.crt", pki.admin_cert_pem.clone()),
        ("admin.key", pki.admin_key_pem.clone()),
        ("sa.key", sa_key.serialize_pem()),
        ("sa.pub", sa_key.public_key_pem()),
        ("front-proxy-ca.crt", proxy_ca_pem.clone()),
        ("front-proxy-client.crt", proxy_cert.pem()),
        ("front-proxy-client.key", proxy_key.serialize_pem()),
        ("calico-apiserver.crt", calico_cert.pem()),
        ("calico-apiserver.key", calico_key.serialize_pem()),
        ("node.crt", node_cert.pem()),
        ("node.key", node_key.serialize_pem()),
    ];
    for (name, pem) in files {
        let path = dir.join(name);
        std::fs::write(&path, pem).map_err(|source| Error::Io { path: path.clone(), source })?;
    }
    Ok(pki)
}

/// The files of Calico's etcd: its own CA, a serving certificate for 127.0.0.1 (and,
/// beside a real node, this machine's address, where its Pods reach it) and a
/// client certificate for Calico's components (what a kubeasz-style install hands
/// calico-node and the CNI plugin).
#[derive(Clone, Debug)]
pub struct EtcdPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// Writes `ca.crt`, `server.{crt,key}` and `client.{crt,key}` into `dir`.
pub fn write_etcd(dir: &Path, also: Option<std::net::IpAddr>) -> Result<EtcdPki, Error> {
    let (ca_pem, ca) = new_ca("capo-testenv-calico-etcd-ca")?;

    let server_key = KeyPair::generate().map_err(cert_err("etcd serving key"))?;
    let mut names = vec!["127.0.0.1".to_string(), "localhost".to_string()];
    names.extend(also.map(|ip| ip.to_string()));
    let mut server = CertificateParams::new(names).map_err(cert_err("etcd serving params"))?;
    server.distinguished_name.push(DnType::CommonName, "calico-etcd");
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let server_cert = server.signed_by(&server_key, &ca).map_err(cert_err("etcd serving certificate"))?;

    let client_key = KeyPair::generate().map_err(cert_err("etcd client key"))?;
    let mut client = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("etcd client params"))?;
    client.distinguished_name.push(DnType::CommonName, "calico");
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client.signed_by(&client_key, &ca).map_err(cert_err("etcd client certificate"))?;

    let pki = EtcdPki {
        ca: dir.join("ca.crt"),
        server_cert: dir.join("server.crt"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.crt"),
        client_key: dir.join("client.key"),
    };
    let files = [
        (&pki.ca, ca_pem.clone()),
        (&pki.server_cert, server_cert.pem()),
        (&pki.server_key, server_key.serialize_pem()),
        (&pki.client_cert, client_cert.pem()),
        (&pki.client_key, client_key.serialize_pem()),
    ];
    for (path, pem) in files {
        std::fs::write(path, pem).map_err(|source| Error::Io { path: path.clone(), source })?;
    }
    Ok(pki)
}
