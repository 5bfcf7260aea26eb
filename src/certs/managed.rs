//! Self-managed certificates: capo keeps its own CA and the serving certificate that CA
//! signs in a Secret of its namespace, creates them on first start and rotates both
//! before they expire, with no moment at which the API server cannot verify what any
//! replica serves:
//!
//! - the serving certificate is renewed when two thirds of its life have passed, by the
//!   same CA (the trusted bundle does not change);
//! - when two thirds of the CA's life have passed, a next CA is made and added to the
//!   bundle (`ca.crt`), which [`super::inject`] writes into the webhook configuration;
//! - at five sixths, once the injected bundle holds the next CA (or at eleven twelfths
//!   whatever happens), the next CA becomes the signer and a new serving certificate is
//!   issued by it; the old CA stays in the bundle until it expires.
//!
//! Every replica runs this. They never fight: each write is a create or a replace at the
//! resourceVersion it read, the losers of a race re-read and find nothing to do, and every
//! replica serves whatever the Secret holds. [`plan`] decides; [`run`] reads and writes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tracing::{info, warn};

use super::pki::{self, CertInfo, KeyedCert, PkiError};
use super::{CA_FILE, CERT_FILE, KEY_FILE, ServingCert};
use crate::metrics::TlsMetrics;

pub const SIGNER_CERT: &str = "signer.crt";
pub const SIGNER_KEY: &str = "signer.key";
pub const NEXT_CERT: &str = "next-signer.crt";
pub const NEXT_KEY: &str = "next-signer.key";

#[derive(Clone, Debug)]
pub struct ManagedSettings {
    /// The Secret, in `namespace`.
    pub secret: String,
    pub namespace: String,
    /// Host names and IPs of the serving certificate.
    pub hosts: Vec<String>,
    pub cert_validity: Duration,
    pub ca_validity: Duration,
}

/// The default SANs in a cluster: capo's Service.
pub fn service_hosts(namespace: &str) -> Vec<String> {
    vec![format!("capo.{namespace}.svc"), format!("capo.{namespace}.svc.cluster.local")]
}

/// What the Secret holds, parsed.
#[derive(Clone, Debug)]
pub struct Material {
    pub leaf: KeyedCert,
    pub signer: KeyedCert,
    pub next: Option<KeyedCert>,
    /// `ca.crt`: what clients must trust.
    pub bundle: String,
    leaf_info: CertInfo,
    signer_info: CertInfo,
    next_info: Option<CertInfo>,
    bundle_info: Vec<CertInfo>,
}

impl Material {
    fn new(leaf: KeyedCert, signer: KeyedCert, next: Option<KeyedCert>, bundle: String) -> Result<Self, PkiError> {
        pki::check_key(KEY_FILE, &leaf.key_pem)?;
        pki::check_key(SIGNER_KEY, &signer.key_pem)?;
        if let Some(n) = &next {
            pki::check_key(NEXT_KEY, &n.key_pem)?;
        }
        Ok(Self {
            leaf_info: pki::parse_one(CERT_FILE, &leaf.cert_pem)?,
            signer_info: pki::parse_one(SIGNER_CERT, &signer.cert_pem)?,
            next_info: next.as_ref().map(|n| pki::parse_one(NEXT_CERT, &n.cert_pem)).transpose()?,
            bundle_info: pki::parse_bundle(CA_FILE, &bundle)?,
            leaf,
            signer,
            next,
            bundle,
        })
    }

    pub fn leaf_info(&self) -> &CertInfo {
        &self.leaf_info
    }

    pub fn signer_info(&self) -> &CertInfo {
        &self.signer_info
    }

    pub fn next_info(&self) -> Option<&CertInfo> {
        self.next_info.as_ref()
    }

    pub fn bundle_info(&self) -> &[CertInfo] {
        &self.bundle_info
    }

    /// Reads the Secret's data; `Err` says what is wrong with it.
    pub fn from_secret(secret: &Secret) -> Result<Self, String> {
        let data = secret.data.clone().unwrap_or_default();
        let text = |key: &str| -> Result<String, String> {
            let bytes = data.get(key).ok_or_else(|| format!("it has no {key}"))?;
            String::from_utf8(bytes.0.clone()).map_err(|_| format!("{key} is not text"))
        };
        let pair = |cert: &str, key: &str| -> Result<KeyedCert, String> {
            Ok(KeyedCert { cert_pem: text(cert)?, key_pem: text(key)? })
        };
        let next = match data.contains_key(NEXT_CERT) {
            true => Some(pair(NEXT_CERT, NEXT_KEY)?),
            false => None,
        };
        Self::new(pair(CERT_FILE, KEY_FILE)?, pair(SIGNER_CERT, SIGNER_KEY)?, next, text(CA_FILE)?)
            .map_err(|e| e.to_string())
    }

    /// The Secret's data.
    pub fn data(&self) -> BTreeMap<String, ByteString> {
        let mut data = BTreeMap::new();
        let mut put = |k: &str, v: &str| data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
        put(CERT_FILE, &self.leaf.cert_pem);
        put(KEY_FILE, &self.leaf.key_pem);
        put(SIGNER_CERT, &self.signer.cert_pem);
        put(SIGNER_KEY, &self.signer.key_pem);
        put(CA_FILE, &self.bundle);
        if let Some(n) = &self.next {
            put(NEXT_CERT, &n.cert_pem);
            put(NEXT_KEY, &n.key_pem);
        }
        data
    }
}

/// The Secret as capo last saw it.
#[derive(Clone, Debug)]
pub enum SecretState {
    Missing,
    /// Not labelled as capo's: capo never writes it.
    Foreign,
    /// capo's, but not usable: why.
    Unusable(String),
    Valid(Box<Material>),
}

impl SecretState {
    pub fn of(secret: Option<&Secret>) -> Self {
        let Some(secret) = secret else { return SecretState::Missing };
        let managed = secret.labels().get(capo_api::keys::MANAGED_BY_LABEL).map(String::as_str)
            == Some(capo_api::keys::MANAGED_BY_VALUE);
        if !managed {
            return SecretState::Foreign;
        }
        match Material::from_secret(secret) {
            Ok(m) => SecretState::Valid(Box::new(m)),
            Err(why) => SecretState::Unusable(why),
        }
    }
}

/// What the webhook configuration trusts now, as far as capo can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Injected {
    /// capo does not inject: the CA rotation goes by time alone.
    NotInjecting,
    /// The configuration has not been seen (yet).
    Unknown,
    /// The DER of every certificate that all webhooks of the configuration trust.
    Bundle(Vec<Vec<u8>>),
}

impl Injected {
    fn trusts(&self, cert: &CertInfo) -> bool {
        match self {
            Injected::NotInjecting => true,
            Injected::Unknown => false,
            Injected::Bundle(ders) => ders.contains(&cert.der),
        }
    }
}

/// Why capo writes the Secret (also the `action` label of `capo_certificate_writes_total`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    Created,
    /// The Secret was unusable, or its CA had expired: everything made anew.
    Replaced(String),
    LeafRenewed,
    /// The serving certificate no longer fits (other hosts, another signer).
    LeafReissued(String),
    CaStaged,
    CaPromoted,
    /// Expired CAs left the bundle.
    BundleTidied,
}

impl Why {
    pub fn action(&self) -> &'static str {
        match self {
            Why::Created => "created",
            Why::Replaced(_) => "replaced",
            Why::LeafRenewed => "certificate_renewed",
            Why::LeafReissued(_) => "certificate_reissued",
            Why::CaStaged => "ca_staged",
            Why::CaPromoted => "ca_promoted",
            Why::BundleTidied => "bundle_tidied",
        }
    }
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Replaced(why) | Why::LeafReissued(why) => write!(f, "{}: {why}", self.action()),
            other => f.write_str(other.action()),
        }
    }
}

#[derive(Debug)]
pub enum Plan {
    /// Nothing to do until then (or until the Secret or the injected bundle changes).
    Keep {
        until: SystemTime,
    },
    Write {
        material: Box<Material>,
        why: Vec<Why>,
    },
}

fn normalized(hosts: &[String]) -> Vec<String> {
    let mut out: Vec<String> = hosts
        .iter()
        .map(|h| h.parse::<std::net::IpAddr>().map(|ip| ip.to_string()).unwrap_or_else(|_| h.to_ascii_lowercase()))
        .collect();
    out.sort();
    out.dedup();
    out
}

fn fresh(now: SystemTime, s: &ManagedSettings, why: Why) -> Result<Plan, PkiError> {
    let signer = pki::new_ca(now, s.ca_validity)?;
    let leaf = pki::new_leaf(&signer, &s.hosts, now, s.cert_validity)?;
    let bundle = signer.cert_pem.clone();
    Ok(Plan::Write { material: Box::new(Material::new(leaf, signer, None, bundle)?), why: vec![why] })
}

/// What to do with the Secret now. Pure apart from making keys.
pub fn plan(state: &SecretState, now: SystemTime, s: &ManagedSettings, injected: &Injected) -> Result<Plan, PkiError> {
    let m = match state {
        SecretState::Missing => return fresh(now, s, Why::Created),
        SecretState::Foreign => return Ok(Plan::Keep { until: now + Duration::from_secs(3600) }),
        SecretState::Unusable(why) => return fresh(now, s, Why::Replaced(why.clone())),
        SecretState::Valid(m) => m,
    };
    if m.signer_info.expired(now) {
        return fresh(now, s, Why::Replaced("its CA has expired".into()));
    }
    let mut why = Vec::new();
    let (mut signer, mut signer_info, mut next) = (m.signer.clone(), m.signer_info.clone(), m.next.clone());
    let mut next_info = m.next_info.clone();
    // The CA: stage a next one, then promote it once it is trusted.
    let promote_at = signer_info.at_fraction(5, 6);
    let deadline = signer_info.at_fraction(11, 12);
    let mut wake = vec![];
    match next_info.clone() {
        Some(n) if now >= promote_at && (injected.trusts(&n) || now >= deadline) => {
            signer = next.take().expect("next with its info");
            signer_info = n;
            next_info = None;
            why.push(Why::CaPromoted);
        }
        // Not trusted yet: an injection wakes capo up, the deadline at the latest.
        Some(n) if !n.expired(now) => wake.push(if now < promote_at { promote_at } else { deadline }),
        Some(_) => {
            // An expired next CA (never promoted): drop it and stage another.
            next = None;
            next_info = None;
        }
        None => {}
    }
    if next.is_none() && now >= signer_info.at_fraction(2, 3) && !why.contains(&Why::CaPromoted) {
        let n = pki::new_ca(now, s.ca_validity)?;
        next_info = Some(pki::parse_one(NEXT_CERT, &n.cert_pem)?);
        next = Some(n);
        why.push(Why::CaStaged);
    } else if next.is_none() {
        wake.push(signer_info.at_fraction(2, 3));
    }
    // The serving certificate.
    let mut leaf = m.leaf.clone();
    let reissue = if !m.leaf_info.signed_by(&signer_info) {
        Some(Why::LeafReissued("not signed by the current CA".into()))
    } else if normalized(&m.leaf_info.hosts) != normalized(&s.hosts) {
        Some(Why::LeafReissued(format!("its hosts {:?} are not {:?}", m.leaf_info.hosts, s.hosts)))
    } else if now >= m.leaf_info.at_fraction(2, 3) {
        Some(Why::LeafRenewed)
    } else {
        wake.push(m.leaf_info.at_fraction(2, 3));
        None
    };
    if let Some(reason) = reissue {
        leaf = pki::new_leaf(&signer, &s.hosts, now, s.cert_validity)?;
        if !why.contains(&Why::CaPromoted) {
            why.push(reason);
        }
    }
    // The bundle: the signer, the next CA, and earlier CAs until they expire.
    let mut bundle: Vec<&CertInfo> = vec![&signer_info];
    bundle.extend(next_info.as_ref());
    for c in &m.bundle_info {
        if !c.expired(now) && !bundle.iter().any(|b| b.der == c.der) {
            bundle.push(c);
        }
    }
    let changed = bundle.len() != m.bundle_info.len() || bundle.iter().zip(&m.bundle_info).any(|(a, b)| a.der != b.der);
    if changed && why.is_empty() {
        why.push(Why::BundleTidied);
    }
    if why.is_empty() {
        wake.extend(m.bundle_info.iter().map(|c| c.not_after));
        let until = wake.into_iter().min().unwrap_or(now + Duration::from_secs(3600));
        return Ok(Plan::Keep { until });
    }
    let bundle_pem = bundle.iter().map(|c| pem_of(&c.der)).collect::<String>();
    Ok(Plan::Write { material: Box::new(Material::new(leaf, signer, next, bundle_pem)?), why })
}

fn pem_of(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

#[derive(Debug, thiserror::Error)]
pub enum ManagedError {
    #[error(
        "Secret {namespace}/{name} exists but is not capo's (no label app.kubernetes.io/managed-by=capo); capo will not overwrite it: delete it, or serve it with --tls-dir"
    )]
    Foreign { namespace: String, name: String },
    #[error(transparent)]
    Pki(#[from] PkiError),
}

/// Serves what the Secret holds and keeps it current, until the task is dropped.
/// `injected` says what the webhook configuration trusts (the injector's reports; a
/// sender that is gone leaves the last value, `NotInjecting` when nobody injects).
/// `first` gets the outcome of the first attempt: a served certificate, or the reason
/// there is none (a Secret that is not capo's).
pub async fn run(
    client: Client,
    s: ManagedSettings,
    serving: Arc<ServingCert>,
    mut injected: watch::Receiver<Injected>,
    metrics: Option<TlsMetrics>,
    first: tokio::sync::oneshot::Sender<Result<(), ManagedError>>,
) {
    let api = Api::<Secret>::namespaced(client, &s.namespace);
    let mut secrets = super::watch_named(api.clone(), &s.secret).boxed();
    let mut first = Some(first);
    let mut seen: Option<Secret> = None;
    let mut synced = false;
    let mut injector_alive = true;
    let mut backoff = Duration::from_millis(500);
    let mut sleep_until = tokio::time::Instant::now();
    loop {
        // Wait for news: the Secret changed, the injected bundle changed, or the due time.
        tokio::select! {
            latest = secrets.next() => match latest {
                Some(latest) => (seen, synced) = (latest, true),
                None => return,
            },
            changed = injected.changed(), if injector_alive => injector_alive = changed.is_ok(),
            _ = tokio::time::sleep_until(sleep_until), if synced => {}
        }
        if !synced {
            continue;
        }
        let state = SecretState::of(seen.as_ref());
        if let SecretState::Valid(m) = &state {
            serve(&serving, m, metrics.as_ref());
        }
        if matches!(state, SecretState::Foreign) {
            let err = ManagedError::Foreign { namespace: s.namespace.clone(), name: s.secret.clone() };
            warn!(error = %err, "not serving a certificate");
            if let Some(m) = &metrics {
                m.certificate_errors.with_label_values(&["foreign_secret"]).inc();
            }
            if let Some(tx) = first.take() {
                let _ = tx.send(Err(err));
            }
            sleep_until = tokio::time::Instant::now() + Duration::from_secs(3600);
            continue;
        }
        let now = SystemTime::now();
        let plan = match plan(&state, now, &s, &injected.borrow_and_update().clone()) {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %e, "could not make certificates");
                sleep_until = tokio::time::Instant::now() + backoff;
                backoff = (backoff * 2).min(Duration::from_secs(60));
                continue;
            }
        };
        match plan {
            Plan::Keep { until } => {
                let wait = until.duration_since(now).unwrap_or_default() + Duration::from_millis(50);
                sleep_until = tokio::time::Instant::now() + wait;
                if serving.current().is_some()
                    && let Some(tx) = first.take()
                {
                    let _ = tx.send(Ok(()));
                }
            }
            Plan::Write { material, why } => match write(&api, &s, seen.as_ref(), &material).await {
                Ok(written) => {
                    let reasons: Vec<String> = why.iter().map(ToString::to_string).collect();
                    info!(secret = %s.secret, why = ?reasons, serial = %material.leaf_info.serial, "wrote the webhook certificates");
                    if let Some(m) = &metrics {
                        for w in &why {
                            m.certificate_writes.with_label_values(&[w.action()]).inc();
                        }
                    }
                    seen = Some(written);
                    backoff = Duration::from_millis(500);
                    sleep_until = tokio::time::Instant::now();
                }
                Err(e) if matches!(&e, kube::Error::Api(s) if s.code == 409) => {
                    // Another replica wrote first: read what it wrote and start over.
                    seen = api.get_opt(&s.secret).await.ok().flatten().or(seen);
                    sleep_until = tokio::time::Instant::now();
                }
                Err(e) => {
                    warn!(secret = %s.secret, error = %e, "could not write the webhook certificates; retrying");
                    if let Some(m) = &metrics {
                        m.certificate_errors.with_label_values(&["write_failed"]).inc();
                    }
                    sleep_until = tokio::time::Instant::now() + backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                }
            },
        }
    }
}

fn serve(serving: &ServingCert, m: &Material, metrics: Option<&TlsMetrics>) {
    if let Err(e) = serving.set(CERT_FILE, &m.leaf.cert_pem, &m.leaf.key_pem) {
        warn!(error = %e, "the Secret's serving certificate cannot be served");
        return;
    }
    serving.set_bundle(Some(&m.bundle));
    if let Some(metrics) = metrics {
        metrics.ca_expiry.set(m.signer_info.not_after_unix());
    }
}

/// Creates the Secret, or replaces it at the version capo read.
async fn write(
    api: &Api<Secret>,
    s: &ManagedSettings,
    seen: Option<&Secret>,
    material: &Material,
) -> Result<Secret, kube::Error> {
    // Not app.kubernetes.io/instance: Argo CD would take the Secret for part of its
    // Application, find it missing from git and prune it.
    let labels = BTreeMap::from([
        (capo_api::keys::MANAGED_BY_LABEL.to_string(), capo_api::keys::MANAGED_BY_VALUE.to_string()),
        ("app.kubernetes.io/name".to_string(), "capo".to_string()),
        ("app.kubernetes.io/component".to_string(), "webhook-certificates".to_string()),
    ]);
    let mut secret = Secret {
        metadata: ObjectMeta {
            name: Some(s.secret.clone()),
            namespace: Some(s.namespace.clone()),
            labels: Some(labels),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(material.data()),
        ..Default::default()
    };
    match seen {
        None => api.create(&PostParams::default(), &secret).await,
        Some(old) => {
            secret.metadata.resource_version = old.resource_version();
            secret.metadata.annotations = old.metadata.annotations.clone();
            api.replace(&s.secret, &PostParams::default(), &secret).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn settings() -> ManagedSettings {
        ManagedSettings {
            secret: "capo-webhook-tls".into(),
            namespace: "capo-system".into(),
            hosts: vec!["capo.capo-system.svc".into(), "127.0.0.1".into()],
            cert_validity: 90 * S,
            ca_validity: 600 * S,
        }
    }

    fn written(plan: Plan) -> (Material, Vec<Why>) {
        match plan {
            Plan::Write { material, why } => (*material, why),
            Plan::Keep { until } => panic!("expected a write, got Keep until {until:?}"),
        }
    }

    fn kept(plan: Plan) -> SystemTime {
        match plan {
            Plan::Keep { until } => until,
            Plan::Write { why, .. } => panic!("expected nothing to do, got a write: {why:?}"),
        }
    }

    fn valid(m: &Material) -> SecretState {
        SecretState::Valid(Box::new(m.clone()))
    }

    fn trusting(m: &Material) -> Injected {
        Injected::Bundle(m.bundle_info.iter().map(|c| c.der.clone()).collect())
    }

    #[test]
    fn a_missing_secret_is_created_and_then_kept_until_the_certificate_is_two_thirds_through() {
        let t0 = SystemTime::now();
        let s = settings();
        let (m, why) = written(plan(&SecretState::Missing, t0, &s, &Injected::Unknown).unwrap());
        assert_eq!(why, vec![Why::Created]);
        assert!(m.leaf_info.signed_by(&m.signer_info));
        assert_eq!(normalized(&m.leaf_info.hosts), normalized(&s.hosts));
        assert_eq!(m.bundle_info.len(), 1);
        assert!(m.next.is_none());
        let until = kept(plan(&valid(&m), t0 + S, &s, &trusting(&m)).unwrap());
        assert_eq!(until, m.leaf_info.at_fraction(2, 3));
    }

    #[test]
    fn the_serving_certificate_is_renewed_by_the_same_ca_with_the_bundle_unchanged() {
        let t0 = SystemTime::now();
        let s = settings();
        let (m, _) = written(plan(&SecretState::Missing, t0, &s, &Injected::Unknown).unwrap());
        let later = m.leaf_info.at_fraction(2, 3) + S;
        let (renewed, why) = written(plan(&valid(&m), later, &s, &trusting(&m)).unwrap());
        assert_eq!(why, vec![Why::LeafRenewed]);
        assert_ne!(renewed.leaf_info.serial, m.leaf_info.serial);
        assert!(renewed.leaf_info.signed_by(&m.signer_info));
        assert_eq!(renewed.bundle, m.bundle, "same trust: nothing to inject");
        assert!(renewed.leaf_info.not_after > m.leaf_info.not_after);
    }

    #[test]
    fn the_ca_is_staged_then_promoted_only_once_the_next_ca_is_trusted() {
        let t0 = SystemTime::now();
        let s = ManagedSettings { cert_validity: 600 * S, ..settings() };
        let (m, _) = written(plan(&SecretState::Missing, t0, &s, &Injected::Unknown).unwrap());
        // Two thirds through the CA's life: a next CA joins the bundle, the leaf stays.
        let t1 = m.signer_info.at_fraction(2, 3) + S;
        let (staged, why) = written(plan(&valid(&m), t1, &s, &trusting(&m)).unwrap());
        assert!(why.contains(&Why::CaStaged), "{why:?}");
        let next = staged.next_info.clone().unwrap();
        assert_eq!(staged.bundle_info.len(), 2);
        assert_eq!(staged.signer_info, m.signer_info, "still the old signer");
        assert!(staged.leaf_info.signed_by(&m.signer_info));
        // Five sixths through, but the webhook configuration does not trust the next CA yet.
        let t2 = m.signer_info.at_fraction(5, 6) + S;
        let before = trusting(&m);
        let until = kept(plan(&valid(&staged), t2, &s, &before).unwrap());
        let deadline = m.signer_info.at_fraction(11, 12);
        assert_eq!(until, deadline.min(staged.leaf_info.at_fraction(2, 3)), "waits for the injection, or the deadline");
        // Once it does: promoted, a new leaf by the new CA, the old CA still trusted.
        let (promoted, why) = written(plan(&valid(&staged), t2, &s, &trusting(&staged)).unwrap());
        assert_eq!(why, vec![Why::CaPromoted]);
        assert_eq!(promoted.signer_info, next);
        assert!(promoted.leaf_info.signed_by(&next));
        assert!(promoted.next.is_none());
        let bundle: Vec<_> = promoted.bundle_info.iter().map(|c| c.serial.clone()).collect();
        assert_eq!(bundle, vec![next.serial.clone(), m.signer_info.serial.clone()]);
        // When the old CA expires it leaves the bundle.
        let t3 = m.signer_info.not_after + S;
        let (tidied, why) = written(plan(&valid(&promoted), t3, &s, &trusting(&promoted)).unwrap());
        assert_eq!(why, vec![Why::BundleTidied]);
        assert_eq!(tidied.bundle_info.len(), 1);
        assert_eq!(tidied.leaf, promoted.leaf);
        // Past the deadline the promotion happens even without the injection.
        let t4 = m.signer_info.at_fraction(11, 12) + S;
        let (_, why) = written(plan(&valid(&staged), t4, &s, &Injected::Unknown).unwrap());
        assert_eq!(why, vec![Why::CaPromoted]);
        // Without injection, time alone decides.
        let (_, why) = written(plan(&valid(&staged), t2, &s, &Injected::NotInjecting).unwrap());
        assert_eq!(why, vec![Why::CaPromoted]);
    }

    #[test]
    fn other_hosts_an_expired_ca_and_garbage_are_repaired() {
        let t0 = SystemTime::now();
        let s = settings();
        let (m, _) = written(plan(&SecretState::Missing, t0, &s, &Injected::Unknown).unwrap());
        let moved = ManagedSettings { hosts: vec!["capo.other.svc".into()], ..settings() };
        let (re, why) = written(plan(&valid(&m), t0 + S, &moved, &trusting(&m)).unwrap());
        assert!(matches!(&why[..], [Why::LeafReissued(r)] if r.contains("capo.other.svc")), "{why:?}");
        assert_eq!(re.leaf_info.hosts, vec!["capo.other.svc".to_string()]);
        assert_eq!(re.signer, m.signer);
        let (_, why) = written(plan(&valid(&m), m.signer_info.not_after + S, &s, &trusting(&m)).unwrap());
        assert_eq!(why, vec![Why::Replaced("its CA has expired".into())]);
        let (_, why) =
            written(plan(&SecretState::Unusable("it has no tls.key".into()), t0, &s, &Injected::Unknown).unwrap());
        assert_eq!(why, vec![Why::Replaced("it has no tls.key".into())]);
        assert!(matches!(plan(&SecretState::Foreign, t0, &s, &Injected::Unknown).unwrap(), Plan::Keep { .. }));
    }

    #[test]
    fn secrets_are_read_back_and_judged() {
        let t0 = SystemTime::now();
        let (m, _) = written(plan(&SecretState::Missing, t0, &settings(), &Injected::Unknown).unwrap());
        let mut secret = Secret {
            metadata: ObjectMeta {
                labels: Some(BTreeMap::from([("app.kubernetes.io/managed-by".into(), "capo".into())])),
                ..Default::default()
            },
            data: Some(m.data()),
            ..Default::default()
        };
        assert!(matches!(SecretState::of(Some(&secret)), SecretState::Valid(v) if v.leaf == m.leaf));
        secret.data.as_mut().unwrap().remove(KEY_FILE);
        assert!(matches!(SecretState::of(Some(&secret)), SecretState::Unusable(w) if w == "it has no tls.key"));
        secret.data.as_mut().unwrap().insert(KEY_FILE.into(), ByteString(b"nope".to_vec()));
        assert!(
            matches!(SecretState::of(Some(&secret)), SecretState::Unusable(w) if w.contains("tls.key is not a usable private key"))
        );
        secret.metadata.labels = None;
        assert!(matches!(SecretState::of(Some(&secret)), SecretState::Foreign));
        assert!(matches!(SecretState::of(None), SecretState::Missing));
    }

    #[test]
    fn pem_round_trips() {
        let ca = pki::new_ca(SystemTime::now(), 60 * S).unwrap();
        let info = pki::parse_one("ca", &ca.cert_pem).unwrap();
        assert_eq!(pki::parse_one("again", &pem_of(&info.der)).unwrap(), info);
    }
}
