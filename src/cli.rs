//! Command-line flags; every one can also be set through its environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use capo_api::CalicoApiGroup;
use clap::Parser;

use crate::app::{SelfRegister, Settings, TlsSource};

#[derive(Parser, Debug, Clone)]
#[command(name = "capo", version, about = "Holds the IPs of deleted stateful Pods in Calico IPReservations")]
pub struct Args {
    /// Address the admission webhook (HTTPS) listens on.
    #[arg(long, env = "CAPO_WEBHOOK_ADDR", default_value = "0.0.0.0:9443")]
    pub webhook_addr: SocketAddr,

    /// Address of /healthz, /readyz and /metrics (plain HTTP).
    #[arg(long, env = "CAPO_PROBE_ADDR", default_value = "0.0.0.0:8081")]
    pub probe_addr: SocketAddr,

    /// Directory with tls.crt and tls.key (a mounted Secret); reloaded when it changes.
    #[arg(long, env = "CAPO_TLS_DIR", default_value = "/tmp/k8s-webhook-server/serving-certs")]
    pub tls_dir: PathBuf,

    /// Local mode: make a CA and serving certificate, and register a
    /// ValidatingWebhookConfiguration pointing at this URL (e.g. https://127.0.0.1:9443).
    #[arg(long, env = "CAPO_SELF_REGISTER_URL")]
    pub self_register_url: Option<String>,

    /// Name of the self-registered ValidatingWebhookConfiguration.
    #[arg(long, env = "CAPO_WEBHOOK_CONFIG_NAME", default_value = "capo")]
    pub webhook_config_name: String,

    /// Calico API for IPReservations: auto, crd.projectcalico.org/v1 or projectcalico.org/v3.
    #[arg(long, env = "CAPO_CALICO_API", default_value = "auto")]
    pub calico_api: String,

    /// capo's own namespace (never held in).
    #[arg(long, env = "POD_NAMESPACE", default_value = "capo-system")]
    pub namespace: String,

    /// Further namespaces capo never holds in, comma-separated.
    #[arg(long, env = "CAPO_EXCLUDED_NAMESPACES", default_value = "kube-system", value_delimiter = ',')]
    pub excluded_namespaces: Vec<String>,

    /// The most time one admission review may take, whatever the API server allows.
    #[arg(long, env = "CAPO_MAX_REVIEW_TIME", default_value = "10s")]
    pub max_review_time: capo_api::Duration,

    /// Log format: text or json.
    #[arg(long, env = "CAPO_LOG_FORMAT", default_value = "text")]
    pub log_format: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    #[error("--calico-api: {0}")]
    CalicoApi(#[from] capo_api::calico::UnknownCalicoApi),
    #[error("--self-register-url {0:?} is not an https://host[:port] URL")]
    Url(String),
}

impl Args {
    pub fn settings(&self) -> Result<Settings, ArgsError> {
        let calico_api = match self.calico_api.as_str() {
            "auto" | "" => None,
            other => Some(other.parse::<CalicoApiGroup>()?),
        };
        let mut excluded = self.excluded_namespaces.clone();
        excluded.push(self.namespace.clone());
        excluded.retain(|n| !n.is_empty());
        excluded.sort();
        excluded.dedup();
        let (tls, self_register) = match &self.self_register_url {
            Some(url) => {
                let host = url_host(url).ok_or_else(|| ArgsError::Url(url.clone()))?;
                (
                    TlsSource::SelfSigned { hosts: vec![host], write_to: None },
                    Some(SelfRegister {
                        name: self.webhook_config_name.clone(),
                        url: Some(url.clone()),
                        only_namespaces: None,
                        timeout_seconds: 5,
                    }),
                )
            }
            None => (TlsSource::Dir(self.tls_dir.clone()), None),
        };
        Ok(Settings {
            webhook_addr: self.webhook_addr,
            probe_addr: Some(self.probe_addr),
            tls,
            self_register,
            calico_api,
            excluded_namespaces: excluded,
            max_review_time: self.max_review_time.as_std(),
            field_manager: "capo".into(),
            sync_timeout: Duration::from_secs(120),
        })
    }
}

/// The host of `https://host[:port][/path]` (brackets stripped from IPv6 literals).
fn url_host(url: &str) -> Option<String> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next()?;
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next()?
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    (!host.is_empty()).then(|| host.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_has_an_env_var() {
        use clap::CommandFactory;
        for arg in Args::command().get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(arg.get_env().is_some(), "--{id} has no environment variable");
        }
    }

    #[test]
    fn settings_from_flags() {
        let args = Args::parse_from([
            "capo",
            "--self-register-url",
            "https://127.0.0.1:9443",
            "--calico-api",
            "projectcalico.org/v3",
            "--namespace",
            "ip-reserve",
        ]);
        let s = args.settings().unwrap();
        assert_eq!(s.calico_api, Some(CalicoApiGroup::V3));
        assert_eq!(s.excluded_namespaces, vec!["ip-reserve".to_string(), "kube-system".to_string()]);
        assert!(matches!(s.tls, TlsSource::SelfSigned { ref hosts, .. } if hosts == &["127.0.0.1".to_string()]));
        let bad = Args::parse_from(["capo", "--calico-api", "v2"]).settings().unwrap_err();
        assert!(bad.to_string().contains("unknown Calico API"), "{bad}");
        assert!(Args::parse_from(["capo", "--self-register-url", "http://x"]).settings().is_err());
    }

    #[test]
    fn url_hosts() {
        assert_eq!(url_host("https://127.0.0.1:9443").as_deref(), Some("127.0.0.1"));
        assert_eq!(url_host("https://[::1]:9443/x").as_deref(), Some("::1"));
        assert_eq!(url_host("https://capo.svc").as_deref(), Some("capo.svc"));
        assert_eq!(url_host("https://"), None);
    }
}
