//! Writes the CA bundle capo serves under into `clientConfig.caBundle` of every webhook
//! of capo's ValidatingWebhookConfiguration (and of its MutatingWebhookConfiguration, the
//! sticky IPs' webhook, of the same name), and writes it back whenever someone else
//! changes it (a re-created configuration, a `kubectl replace`). It applies only that
//! field, server-side, as its own field manager, so Helm, kustomize and Argo CD never
//! carry a caBundle and never see it as drift (Argo CD: `ignoreDifferences` on it).
//!
//! It also reports what the configuration trusts, so the CA rotation in [`super::managed`]
//! waits until the next CA is trusted.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

use super::managed::Injected;
use super::pki;
use crate::metrics::TlsMetrics;

/// The field manager of the caBundle.
pub const FIELD_MANAGER: &str = "capo-ca-injector";

/// A webhook configuration capo injects its CA bundle into.
pub trait WebhookConfiguration:
    kube::Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + serde::Serialize
    + Send
    + Sync
    + 'static
{
    const KIND: &'static str;
    /// Each webhook's name and client configuration.
    fn webhooks(&self) -> Vec<(&str, &WebhookClientConfig)>;
}

impl WebhookConfiguration for ValidatingWebhookConfiguration {
    const KIND: &'static str = "ValidatingWebhookConfiguration";
    fn webhooks(&self) -> Vec<(&str, &WebhookClientConfig)> {
        self.webhooks.as_deref().unwrap_or_default().iter().map(|w| (w.name.as_str(), &w.client_config)).collect()
    }
}

impl WebhookConfiguration for MutatingWebhookConfiguration {
    const KIND: &'static str = "MutatingWebhookConfiguration";
    fn webhooks(&self) -> Vec<(&str, &WebhookClientConfig)> {
        self.webhooks.as_deref().unwrap_or_default().iter().map(|w| (w.name.as_str(), &w.client_config)).collect()
    }
}

/// What every webhook of `config` trusts: the certificates all their caBundles share.
pub fn trusted<C: WebhookConfiguration>(config: Option<&C>) -> Injected {
    let Some(config) = config else { return Injected::Unknown };
    let mut common: Option<Vec<Vec<u8>>> = None;
    for (_, client_config) in config.webhooks() {
        let pem = client_config.ca_bundle.as_ref().map(|b| String::from_utf8_lossy(&b.0).to_string());
        let ders: Vec<Vec<u8>> = pem
            .and_then(|p| pki::parse_bundle("caBundle", &p).ok())
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.der)
            .collect();
        common = Some(match common {
            None => ders,
            Some(prev) => prev.into_iter().filter(|d| ders.contains(d)).collect(),
        });
    }
    Injected::Bundle(common.unwrap_or_default())
}

/// The webhooks whose caBundle is not exactly `bundle`.
fn stale<'a, C: WebhookConfiguration>(config: &'a C, bundle: &str) -> Vec<&'a str> {
    config
        .webhooks()
        .into_iter()
        .filter(|(_, c)| c.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(bundle.as_bytes()))
        .map(|(name, _)| name)
        .collect()
}

/// Keeps the caBundle of configuration `name` equal to `bundle`; reports what it trusts
/// on `trust`. Runs until the task is dropped.
pub async fn run<C: WebhookConfiguration>(
    client: Client,
    name: String,
    mut bundle: watch::Receiver<Option<Arc<str>>>,
    trust: watch::Sender<Injected>,
    metrics: Option<TlsMetrics>,
) {
    let api = Api::<C>::all(client);
    let mut configs = super::watch_named(api.clone(), &name).boxed();
    let mut seen: Option<C> = None;
    let mut synced = false;
    let mut missing_logged = false;
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            latest = configs.next() => match latest {
                Some(latest) => (seen, synced) = (latest, true),
                None => return,
            },
            changed = bundle.changed() => if changed.is_err() { return },
            _ = async { tokio::time::sleep_until(retry_at.expect("guarded")).await }, if retry_at.is_some() => retry_at = None,
        }
        if !synced {
            continue;
        }
        trust.send_if_modified(|t| {
            let new = trusted(seen.as_ref());
            let changed = *t != new;
            *t = new;
            changed
        });
        let Some(config) = &seen else {
            if !missing_logged {
                info!(webhook = %name, kind = C::KIND, "no webhook configuration to inject the CA bundle into yet");
                missing_logged = true;
            }
            continue;
        };
        missing_logged = false;
        let Some(want) = bundle.borrow_and_update().clone() else { continue };
        let webhooks = stale(config, &want);
        if webhooks.is_empty() {
            continue;
        }
        let encoded = base64::engine::general_purpose::STANDARD.encode(want.as_bytes());
        let patch = json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": C::KIND,
            "metadata": { "name": name },
            "webhooks": config.webhooks().iter()
                .map(|(name, _)| json!({ "name": name, "clientConfig": { "caBundle": encoded } }))
                .collect::<Vec<_>>(),
        });
        match api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await {
            Ok(updated) => {
                info!(webhook = %name, kind = C::KIND, stale = ?webhooks, "injected the CA bundle");
                if let Some(m) = &metrics {
                    m.ca_injections.with_label_values(&["ok"]).inc();
                }
                seen = Some(updated);
                trust.send_replace(trusted(seen.as_ref()));
            }
            Err(e) => {
                warn!(webhook = %name, kind = C::KIND, error = %e, "could not inject the CA bundle; retrying");
                if let Some(m) = &metrics {
                    m.ca_injections.with_label_values(&["failed"]).inc();
                }
                retry_at = Some(tokio::time::Instant::now() + Duration::from_secs(2));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(bundles: &[Option<&str>]) -> ValidatingWebhookConfiguration {
        let webhooks: Vec<_> = bundles
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let mut client_config = json!({ "url": "https://127.0.0.1:9443/x" });
                if let Some(b) = b {
                    client_config["caBundle"] = json!(base64::engine::general_purpose::STANDARD.encode(b));
                }
                json!({ "name": format!("w{i}.capo.io"), "clientConfig": client_config, "sideEffects": "None",
                        "admissionReviewVersions": ["v1"] })
            })
            .collect();
        serde_json::from_value(json!({ "metadata": { "name": "capo" }, "webhooks": webhooks })).unwrap()
    }

    #[test]
    fn what_every_webhook_trusts() {
        let now = std::time::SystemTime::now();
        let a = pki::new_ca(now, Duration::from_secs(60)).unwrap().cert_pem;
        let b = pki::new_ca(now, Duration::from_secs(60)).unwrap().cert_pem;
        let der = |pem: &str| pki::parse_one("x", pem).unwrap().der;
        assert_eq!(trusted::<ValidatingWebhookConfiguration>(None), Injected::Unknown);
        let both = format!("{a}{b}");
        assert_eq!(trusted(Some(&config(&[Some(&both), Some(&both)]))), Injected::Bundle(vec![der(&a), der(&b)]));
        assert_eq!(trusted(Some(&config(&[Some(&both), Some(&a)]))), Injected::Bundle(vec![der(&a)]));
        assert_eq!(trusted(Some(&config(&[Some(&both), None]))), Injected::Bundle(vec![]));
        assert_eq!(stale(&config(&[Some(&both), Some(&a)]), &both), vec!["w1.capo.io"]);
        assert!(stale(&config(&[Some(&both), Some(&both)]), &both).is_empty());
    }
}
