//! Command-line flags; every one can also be set through its environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use capo_api::CalicoApiGroup;
use clap::Parser;

use crate::admission::ReviewLimits;
use crate::app::{ReleaseSettings, SelfRegister, Settings, TlsSource, WebhookLimits};
use crate::calico::etcd::EtcdConfig;
use crate::certs::managed::ManagedSettings;
use crate::leader::LeaderSettings;
use crate::release::{EngineSettings, PlanSettings};
use crate::server::ConnectionLimits;

/// `capo run` runs the controller; the other subcommands are the operator's tools (they use
/// the kubeconfig, like kubectl, and work as the kubectl plugin `kubectl capo`).
#[derive(Parser, Debug, Clone)]
#[command(
    name = "capo",
    version,
    about = "Holds the IPs of deleted stateful Pods in Calico IPReservations",
    arg_required_else_help = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub kube: KubeFlags,
}

/// Which cluster to talk to, as kubectl takes it.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct KubeFlags {
    /// The kubeconfig file (default: $KUBECONFIG, then ~/.kube/config; in a Pod, its
    /// ServiceAccount).
    #[arg(long, global = true, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current context).
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
}

impl KubeFlags {
    pub fn target(&self) -> crate::client::Target {
        crate::client::Target { kubeconfig: self.kubeconfig.clone(), context: self.context.clone() }
    }
}

/// Which Pods' holds a command shows: `-n` one namespace, `-A` (or neither) all of them —
/// holds are cluster-scoped, as in `kubectl get reservedips`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PodScope {
    /// Only the holds of Pods in this namespace.
    #[arg(short, long, value_name = "NAMESPACE", conflicts_with = "all_namespaces")]
    pub namespace: Option<String>,
    /// The holds of Pods in every namespace (the default).
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
}

/// `capo explain`'s Pod: `NAMESPACE/NAME`, or `NAME` in `namespace` (`-n`).
pub fn explain_target(pod: &str, namespace: &str) -> (String, String) {
    match pod.split_once('/') {
        Some((ns, name)) => (ns.to_string(), name.to_string()),
        None => (namespace.to_string(), pod.to_string()),
    }
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum Command {
    /// Run the controller: the admission webhook on every replica, releases on the leader.
    Run(Box<Args>),
    /// List held IPs: IP, Pod, policy, trigger, held for, due in.
    Holds {
        #[command(flatten)]
        scope: PodScope,
        /// Output format.
        #[arg(short, long, value_enum, default_value = "table")]
        output: crate::ops::Output,
        /// capo's own namespace: where its leader keeps the countdowns (when each hold's
        /// Pod was seen gone).
        #[arg(long, env = "POD_NAMESPACE", default_value = "capo-system", value_name = "NAMESPACE")]
        capo_namespace: String,
    },
    /// Release held IPs now (the leader does it, paced by the policy's releaseInterval).
    Release {
        #[arg(required = true)]
        ips: Vec<std::net::IpAddr>,
        /// How long to wait for the leader to release them.
        #[arg(long, default_value = "60s")]
        wait: capo_api::Duration,
    },
    /// Keep a held IP for longer: until now + --for.
    Extend {
        ip: std::net::IpAddr,
        /// How long from now, e.g. 2h.
        #[arg(long = "for")]
        for_: capo_api::Duration,
        /// How long to wait for the leader to take the new release time.
        #[arg(long, default_value = "60s")]
        wait: capo_api::Duration,
    },
    /// List policies: state, holds, cap.
    Policies {
        /// Output format.
        #[arg(short, long, value_enum, default_value = "table")]
        output: crate::ops::Output,
    },
    /// Why a Pod's addresses would be held on deletion (which policy, for how long, what
    /// the cap does), or why not; for a Pod that is gone, its holds and when each is due.
    Explain {
        /// The Pod: NAMESPACE/NAME, or NAME with -n.
        pod: String,
        /// The Pod's namespace (when not given as NAMESPACE/NAME).
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// Output format: table is the text explanation; json and yaml the same as data.
        #[arg(short, long, value_enum, default_value = "table")]
        output: crate::ops::Output,
        /// capo's own namespace (where its leader keeps the countdowns; never held in).
        #[arg(long, env = "POD_NAMESPACE", default_value = "capo-system", value_name = "NAMESPACE")]
        capo_namespace: String,
    },
    /// Take over the IPs the original capo holds, with their original reserve times
    /// (after `capo migrate`, before uninstalling the original; see docs/migration.md).
    TakeOver(TakeOverArgs),
    /// Print the CapoPolicies equivalent to the original capo's capo_config.yaml.
    Migrate {
        /// The original's configuration file (`-`: standard input), e.g. from
        /// `kubectl get cm -n ip-reserve capo-manager-config -o jsonpath='{.data.capo_config\.yaml}'`.
        #[arg(short, long, default_value = "-")]
        file: std::path::PathBuf,
    },
}

impl Cli {
    /// The command line as given, with two allowances: started as the kubectl plugin
    /// (`kubectl-capo`), help names it `kubectl capo`; and controller flags without a
    /// subcommand (`capo --webhook-addr=…`, manifests of capo before `run` existed) mean
    /// `capo run …`.
    pub fn parse_args() -> Self {
        use clap::{CommandFactory, FromArgMatches};
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        let plugin = args
            .first()
            .and_then(|a| std::path::Path::new(a).file_name())
            .is_some_and(|n| n.to_string_lossy().starts_with("kubectl-"));
        let mut command = Self::command();
        if plugin {
            command = command.bin_name("kubectl capo").display_name("kubectl capo");
        }
        let matches = command.get_matches_from(legacy_run(args));
        Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

impl Cli {
    /// `capo run`'s flags, if this is `capo run`.
    pub fn into_run(self) -> Option<Args> {
        match self.command {
            Command::Run(args) => Some(*args),
            _ => None,
        }
    }
}

/// `capo --flag …` (a flag that is not one of `capo`'s own first) is `capo run --flag …`.
pub fn legacy_run(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let first = args.get(1).map(|a| a.to_string_lossy().into_owned());
    let own = ["-h", "--help", "-V", "--version", "--kubeconfig", "--context"];
    if let Some(first) = first
        && first.starts_with('-')
        && !own.iter().any(|o| first == *o || first.starts_with(&format!("{o}=")))
    {
        args.insert(1, "run".into());
    }
    args
}

/// `capo take-over`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct TakeOverArgs {
    /// The CapoPolicy whose reservation takes the IPs over (e.g. one `capo migrate` printed).
    #[arg(long)]
    policy: String,
    /// The original's namespace.
    #[arg(long, default_value = "ip-reserve")]
    namespace: String,
    /// The original's IPReservation (projectcalico.org/v3).
    #[arg(long, default_value = "ip-reserve-delay-release")]
    reservation: String,
    /// The original's ConfigMap of reserve times, in --namespace.
    #[arg(long, default_value = "ip-reserve-delay-release")]
    config_map: String,
    /// The UTC offset of the original's container clock (its times carry no zone),
    /// e.g. +08:00 when it ran with TZ=Asia/Shanghai.
    #[arg(long, default_value = "UTC")]
    original_utc_offset: String,
    /// Calico API of capo's reservation: auto, crd.projectcalico.org/v1 or projectcalico.org/v3.
    #[arg(long, default_value = "auto")]
    calico_api: String,
    /// Print what would be taken over; write nothing.
    #[arg(long)]
    dry_run: bool,
}

impl TakeOverArgs {
    pub fn settings(&self) -> Result<crate::migrate::takeover::TakeOverSettings, String> {
        Ok(crate::migrate::takeover::TakeOverSettings {
            policy: self.policy.clone(),
            namespace: self.namespace.clone(),
            reservation: self.reservation.clone(),
            config_map: self.config_map.clone(),
            offset: crate::migrate::takeover::parse_offset(&self.original_utc_offset)
                .map_err(|e| format!("--original-utc-offset: {e}"))?,
            calico_api: calico_api(&self.calico_api).map_err(|e| format!("--calico-api: {e}"))?,
            dry_run: self.dry_run,
        })
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Address the admission webhook (HTTPS) listens on.
    #[arg(long, env = "CAPO_WEBHOOK_ADDR", default_value = "0.0.0.0:9443")]
    pub webhook_addr: SocketAddr,

    /// Address of /healthz, /readyz and /metrics (plain HTTP).
    #[arg(long, env = "CAPO_PROBE_ADDR", default_value = "0.0.0.0:8081")]
    pub probe_addr: SocketAddr,

    /// Directory with tls.crt and tls.key, and ca.crt when capo injects the CA bundle (a
    /// mounted Secret, e.g. cert-manager's); reloaded when it changes. Not used with
    /// --tls-secret.
    #[arg(long, env = "CAPO_TLS_DIR", default_value = "/tmp/k8s-webhook-server/serving-certs")]
    pub tls_dir: PathBuf,

    /// Self-managed certificates: capo creates its CA and serving certificate in this
    /// Secret of --namespace and rotates them before they expire (every replica serves
    /// what the Secret holds).
    #[arg(long, env = "CAPO_TLS_SECRET")]
    pub tls_secret: Option<String>,

    /// Host names and IPs of the self-managed serving certificate, comma-separated.
    /// Default: capo.<namespace>.svc and capo.<namespace>.svc.cluster.local.
    #[arg(long, env = "CAPO_TLS_HOSTS", value_delimiter = ',')]
    pub tls_hosts: Vec<String>,

    /// Lifetime of a self-managed serving certificate (renewed when two thirds have passed).
    #[arg(long, env = "CAPO_TLS_CERT_VALIDITY", default_value = "2160h")]
    pub tls_cert_validity: capo_api::Duration,

    /// Lifetime of the self-managed CA (a next CA is trusted from two thirds of it and
    /// signs from five sixths).
    #[arg(long, env = "CAPO_TLS_CA_VALIDITY", default_value = "43800h")]
    pub tls_ca_validity: capo_api::Duration,

    /// Write the CA bundle (the Secret's, or ca.crt of --tls-dir) into the
    /// ValidatingWebhookConfiguration --webhook-config-name and keep it there. Default:
    /// on with --tls-secret, off otherwise.
    #[arg(long, env = "CAPO_INJECT_CA_BUNDLE", action = clap::ArgAction::Set)]
    pub inject_ca_bundle: Option<bool>,

    /// Local mode: make a CA and serving certificate, and register a
    /// ValidatingWebhookConfiguration pointing at this URL (e.g. https://127.0.0.1:9443).
    #[arg(long, env = "CAPO_SELF_REGISTER_URL")]
    pub self_register_url: Option<String>,

    /// Name of capo's ValidatingWebhookConfiguration (the one the CA bundle is injected
    /// into, or the one written with --self-register-url).
    #[arg(long, env = "CAPO_WEBHOOK_CONFIG_NAME", default_value = "capo")]
    pub webhook_config_name: String,

    /// Calico API for IPReservations: auto, crd.projectcalico.org/v1 or projectcalico.org/v3.
    #[arg(long, env = "CAPO_CALICO_API", default_value = "auto")]
    pub calico_api: String,

    /// Calico's datastore, as Calico's own components take it: kubernetes (IPReservations
    /// are objects in the API server) or etcdv3 (in Calico's etcd; see the --etcd-* flags).
    #[arg(long, env = "DATASTORE_TYPE", default_value = "kubernetes")]
    pub calico_datastore: String,

    /// Calico's etcd endpoints, comma-separated (with --calico-datastore etcdv3).
    #[arg(long, env = "ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    /// The CA that signed Calico's etcd's serving certificate (https endpoints).
    #[arg(long, env = "ETCD_CA_CERT_FILE")]
    pub etcd_ca_cert_file: Option<PathBuf>,

    /// capo's client certificate for Calico's etcd.
    #[arg(long, env = "ETCD_CERT_FILE")]
    pub etcd_cert_file: Option<PathBuf>,

    /// The key of --etcd-cert-file.
    #[arg(long, env = "ETCD_KEY_FILE")]
    pub etcd_key_file: Option<PathBuf>,

    /// capo's own namespace (never held in).
    #[arg(long, env = "POD_NAMESPACE", default_value = "capo-system")]
    pub namespace: String,

    /// Further namespaces capo never holds in, comma-separated.
    #[arg(long, env = "CAPO_EXCLUDED_NAMESPACES", default_value = "kube-system", value_delimiter = ',')]
    pub excluded_namespaces: Vec<String>,

    /// The most time one admission review may take, whatever the API server allows.
    #[arg(long, env = "CAPO_MAX_REVIEW_TIME", default_value = "10s")]
    pub max_review_time: capo_api::Duration,

    /// How long a webhook client may take from connecting (TLS handshake included) to the
    /// headers of its first request; a connection that sends nothing is closed after it.
    #[arg(long, env = "CAPO_WEBHOOK_HEADER_TIMEOUT", default_value = "10s")]
    pub webhook_header_timeout: capo_api::Duration,

    /// A webhook connection with no request in flight for this long is closed.
    #[arg(long, env = "CAPO_WEBHOOK_IDLE_TIMEOUT", default_value = "90s")]
    pub webhook_idle_timeout: capo_api::Duration,

    /// Webhook connections open at once; past it new connections are closed at once.
    #[arg(long, env = "CAPO_WEBHOOK_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub webhook_max_connections: u32,

    /// MiB of review bodies held at once, half for reviews up to 256 KiB and half for
    /// larger ones; a review that finds no room is answered 429 at once.
    #[arg(long, env = "CAPO_REVIEW_MEMORY_MIB", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(2..))]
    pub review_memory_mib: u32,

    /// Accept webhook connections only with a client certificate signed by a CA in this
    /// PEM file (the API server's, from its AdmissionConfiguration; docs/install.md).
    #[arg(long, env = "CAPO_WEBHOOK_CLIENT_CA_FILE")]
    pub webhook_client_ca_file: Option<PathBuf>,

    /// Accept reviews only with `Authorization: Bearer <this file's content>` (read again
    /// when it changes).
    #[arg(long, env = "CAPO_WEBHOOK_TOKEN_FILE")]
    pub webhook_token_file: Option<PathBuf>,

    /// Log format: text or json.
    #[arg(long, env = "CAPO_LOG_FORMAT", default_value = "text")]
    pub log_format: String,

    /// Log level (error, warn, info, debug, trace) or `tracing` directives, e.g.
    /// `info,capo::admission=debug` (debug says why each deletion was or was not held).
    /// RUST_LOG, when set, wins.
    #[arg(long, env = "CAPO_LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// Elect a leader among replicas through a Lease (off: this replica always leads).
    #[arg(long, env = "CAPO_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,

    /// Name of the Lease (in --namespace) the replicas elect their leader with.
    #[arg(long, env = "CAPO_LEASE_NAME", default_value = "capo")]
    pub lease_name: String,

    /// How long a leader's Lease is valid without renewal.
    #[arg(long, env = "CAPO_LEASE_DURATION", default_value = "15s")]
    pub lease_duration: capo_api::Duration,

    /// How long before its Lease expires the leader renews it.
    #[arg(long, env = "CAPO_LEASE_RENEW_GRACE", default_value = "5s")]
    pub lease_renew_grace: capo_api::Duration,

    /// This replica's identity in the Lease and in Events (the Pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// A hold whose Pod is still running and not being deleted (an eviction refused by a
    /// PodDisruptionBudget) is dropped after this long.
    #[arg(long, env = "CAPO_KEPT_POD_GRACE", default_value = "10m")]
    pub kept_pod_grace: capo_api::Duration,

    /// How many holds, policies and reservations the leader works on at once (status
    /// writes, releases, repairs); the safety net looks at as many leaving Pods at once.
    #[arg(long, env = "CAPO_RELEASE_WORKERS", default_value_t = 8)]
    pub workers: usize,

    /// The most of a Calico IP pool's unallocated addresses capo's holds may take, all
    /// policies together, in percent (1–100); past it the oldest holds in that pool are
    /// released first. 50: a new Pod always finds at least as many free addresses as capo
    /// holds. A policy's `maxPoolShare` bounds that policy alone.
    #[arg(long, env = "CAPO_MAX_POOL_SHARE", default_value_t = crate::release::DEFAULT_MAX_POOL_SHARE,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_pool_share: u32,

    /// How long a record without its reservation entry (or an entry without a record)
    /// must stay so before the leader repairs it.
    #[arg(long, env = "CAPO_REPAIR_SETTLE", default_value = "5s")]
    pub repair_settle: capo_api::Duration,

    /// Only release holds of policies whose name starts with this (several capos on one
    /// test cluster). Empty: every policy.
    #[arg(long, env = "CAPO_POLICY_PREFIX", default_value = "", hide = true)]
    pub policy_prefix: String,

    /// How long a watch (Pods, Namespaces, CapoPolicies) may keep failing before capo
    /// reports itself not ready.
    #[arg(long, env = "CAPO_WATCH_FAILURE_GRACE", default_value = "30s")]
    pub watch_failure_grace: capo_api::Duration,

    /// How often, at most, the leader writes one shard's countdown starts (tests of the last
    /// flush on shutdown set it long).
    #[arg(long, env = "CAPO_COUNTDOWN_FLUSH_INTERVAL", default_value = "1s", hide = true)]
    pub countdown_flush_interval: capo_api::Duration,

    /// TCP_NODELAY on the connections to the API server (off only to measure it: make bench).
    #[arg(long, env = "CAPO_API_TCP_NODELAY", default_value_t = true, action = clap::ArgAction::Set, hide = true)]
    pub api_tcp_nodelay: bool,

    /// Restrict a self-registered webhook to these namespaces (tests). Empty: all.
    #[arg(long, env = "CAPO_WEBHOOK_NAMESPACES", value_delimiter = ',', hide = true)]
    pub webhook_namespaces: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    #[error("--calico-api: {0}")]
    CalicoApi(#[from] capo_api::calico::UnknownCalicoApi),
    #[error("--self-register-url {0:?} is not an https://host[:port] URL")]
    Url(String),
    #[error("--lease-duration must be longer than --lease-renew-grace, and the grace at least 1s")]
    LeaseTiming,
    #[error("--tls-cert-validity and --tls-ca-validity must be at least 3s, and the CA's at least the certificate's")]
    CertValidity,
    #[error("--inject-ca-bundle with --self-register-url: capo registers its own CA already")]
    InjectWithSelfRegister,
    #[error("--log-level {0:?}: {1}")]
    LogLevel(String, String),
    #[error("--calico-datastore {0:?}: kubernetes or etcdv3")]
    Datastore(String),
    #[error("--calico-datastore etcdv3 needs --etcd-endpoints (ETCD_ENDPOINTS)")]
    NoEtcdEndpoints,
    #[error("--calico-datastore etcdv3 keeps projectcalico.org/v3 objects only; --calico-api {0} does not apply")]
    EtcdGroup(CalicoApiGroup),
}

/// `auto` (or empty): detect the group as Calico does; otherwise the named group.
pub fn calico_api(flag: &str) -> Result<Option<CalicoApiGroup>, capo_api::calico::UnknownCalicoApi> {
    match flag {
        "auto" | "" => Ok(None),
        other => other.parse().map(Some),
    }
}

/// The host name and process id: unique among replicas when POD_NAME is not set.
pub fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    format!("{}-{}", if host.is_empty() { "capo" } else { &host }, std::process::id())
}

impl Args {
    /// This replica's identity: `--identity`, or the host name and process id.
    pub fn identity(&self) -> String {
        self.identity.clone().filter(|i| !i.is_empty()).unwrap_or_else(default_identity)
    }

    pub fn settings(&self) -> Result<Settings, ArgsError> {
        crate::telemetry::filter(&self.log_level)
            .map_err(|e| ArgsError::LogLevel(self.log_level.clone(), e.to_string()))?;
        let calico_api = calico_api(&self.calico_api)?;
        let calico_etcd = self.calico_etcd(calico_api)?;
        let mut excluded = self.excluded_namespaces.clone();
        excluded.push(self.namespace.clone());
        excluded.retain(|n| !n.is_empty());
        excluded.sort();
        excluded.dedup();
        // Local runs register their own webhook configuration at the URL, and serve a
        // certificate for its host: made in memory, or self-managed with --tls-secret
        // (registered without caBundle; the injector fills it in).
        let local_host = match &self.self_register_url {
            Some(url) => Some(url_host(url).ok_or_else(|| ArgsError::Url(url.clone()))?),
            None => None,
        };
        let self_register = self.self_register_url.as_ref().map(|url| SelfRegister {
            name: self.webhook_config_name.clone(),
            url: Some(url.clone()),
            only_namespaces: (!self.webhook_namespaces.is_empty()).then(|| self.webhook_namespaces.clone()),
            timeout_seconds: 5,
        });
        let tls = match (&self.tls_secret, local_host) {
            (Some(_), Some(host)) => TlsSource::Managed(self.managed(vec![host])?),
            (Some(_), None) => TlsSource::Managed(self.managed(self.tls_hosts.clone())?),
            (None, Some(host)) => TlsSource::SelfSigned { hosts: vec![host], write_to: None },
            (None, None) => TlsSource::Dir(self.tls_dir.clone()),
        };
        let inject = self.inject_ca_bundle.unwrap_or(self.tls_secret.is_some());
        if inject && self.self_register_url.is_some() && self.tls_secret.is_none() {
            return Err(ArgsError::InjectWithSelfRegister);
        }
        Ok(Settings {
            webhook_addr: self.webhook_addr,
            probe_addr: Some(self.probe_addr),
            tls,
            inject_ca_bundle: inject.then(|| self.webhook_config_name.clone()),
            self_register,
            calico_api,
            calico_etcd,
            release: Some(self.release_settings(&excluded)?),
            excluded_namespaces: excluded,
            max_review_time: self.max_review_time.as_std(),
            limits: WebhookLimits {
                connections: ConnectionLimits {
                    header_timeout: self.webhook_header_timeout.as_std(),
                    idle_timeout: self.webhook_idle_timeout.as_std(),
                    max_connections: self.webhook_max_connections as usize,
                },
                reviews: ReviewLimits { bytes_in_flight: (self.review_memory_mib as usize) << 20 },
            },
            caller_auth: crate::caller_auth::CallerAuth {
                client_ca_file: self.webhook_client_ca_file.clone(),
                token_file: self.webhook_token_file.clone(),
            },
            field_manager: "capo".into(),
            sync_timeout: Duration::from_secs(120),
            watch_failure_grace: self.watch_failure_grace.as_std(),
        })
    }

    /// Calico's etcd, with `--calico-datastore etcdv3` (`None`: the Kubernetes datastore).
    fn calico_etcd(&self, group: Option<CalicoApiGroup>) -> Result<Option<EtcdConfig>, ArgsError> {
        match self.calico_datastore.as_str() {
            "kubernetes" | "" => Ok(None),
            "etcdv3" => {
                if let Some(g) = group.filter(|g| *g != CalicoApiGroup::V3) {
                    return Err(ArgsError::EtcdGroup(g));
                }
                let endpoints: Vec<String> =
                    self.etcd_endpoints.iter().filter(|e| !e.trim().is_empty()).cloned().collect();
                if endpoints.is_empty() {
                    return Err(ArgsError::NoEtcdEndpoints);
                }
                Ok(Some(EtcdConfig {
                    endpoints,
                    ca_cert_file: self.etcd_ca_cert_file.clone(),
                    cert_file: self.etcd_cert_file.clone(),
                    key_file: self.etcd_key_file.clone(),
                }))
            }
            other => Err(ArgsError::Datastore(other.to_string())),
        }
    }

    /// Self-managed certificates for `hosts` (default: capo's Service).
    fn managed(&self, hosts: Vec<String>) -> Result<ManagedSettings, ArgsError> {
        let (cert, ca) = (self.tls_cert_validity.as_std(), self.tls_ca_validity.as_std());
        if cert < Duration::from_secs(3) || ca < cert {
            return Err(ArgsError::CertValidity);
        }
        let hosts = match hosts.is_empty() {
            true => crate::certs::managed::service_hosts(&self.namespace),
            false => hosts,
        };
        Ok(ManagedSettings {
            secret: self.tls_secret.clone().unwrap_or_default(),
            namespace: self.namespace.clone(),
            hosts,
            cert_validity: cert,
            ca_validity: ca,
        })
    }

    fn release_settings(&self, excluded: &[String]) -> Result<ReleaseSettings, ArgsError> {
        let identity = self.identity();
        let election = self.leader_elect.then(|| LeaderSettings {
            lease_name: self.lease_name.clone(),
            namespace: self.namespace.clone(),
            identity: identity.clone(),
            duration: self.lease_duration.as_std(),
            grace: self.lease_renew_grace.as_std(),
        });
        if let Some(e) = &election
            && (e.grace.as_secs() == 0 || e.duration <= e.grace)
        {
            return Err(ArgsError::LeaseTiming);
        }
        Ok(ReleaseSettings {
            election,
            identity,
            engine: EngineSettings {
                plan: PlanSettings {
                    kept_pod_grace: self.kept_pod_grace.as_std(),
                    settle: self.repair_settle.as_std(),
                    hold_in_flight: self.max_review_time.as_std(),
                    ..Default::default()
                },
                policy_prefix: (!self.policy_prefix.is_empty()).then(|| self.policy_prefix.clone()),
                excluded_namespaces: excluded.to_vec(),
                namespace: self.namespace.clone(),
                workers: self.workers.max(1),
                max_pool_share: self.max_pool_share,
                flush_every: self.countdown_flush_interval.as_std(),
            },
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

    /// `capo run <args>`'s flags.
    fn run_from<'a>(args: impl IntoIterator<Item = &'a str>) -> Args {
        let mut args: Vec<&str> = args.into_iter().collect();
        args.insert(1, "run");
        Cli::parse_from(args).into_run().expect("capo run")
    }

    #[test]
    fn controller_flags_without_a_subcommand_mean_run_and_capos_own_flags_do_not() {
        let args = |a: &[&str]| legacy_run(a.iter().map(std::ffi::OsString::from).collect());
        let strs = |a: Vec<std::ffi::OsString>| a.into_iter().map(|s| s.into_string().unwrap()).collect::<Vec<_>>();
        assert_eq!(
            strs(args(&["capo", "--webhook-addr=0.0.0.0:9443"])),
            ["capo", "run", "--webhook-addr=0.0.0.0:9443"]
        );
        for own in
            [&["capo", "--help"][..], &["capo", "-V"], &["capo", "--context=x", "holds"], &["capo", "holds"], &["capo"]]
        {
            assert_eq!(strs(args(own)), own, "{own:?}");
        }
        let cli = Cli::parse_from(args(&["capo", "--leader-elect", "false"]));
        assert!(!cli.into_run().expect("run").leader_elect);
        let cli = Cli::parse_from(["capo", "holds", "-n", "shop", "--context", "prod", "-o", "yaml"]);
        assert_eq!(cli.kube.context.as_deref(), Some("prod"));
        let Command::Holds { scope, output, .. } = cli.command else { panic!("holds") };
        assert_eq!((scope.namespace.as_deref(), output), (Some("shop"), crate::ops::Output::Yaml));
        assert!(Cli::try_parse_from(["capo", "holds", "-n", "shop", "-A"]).is_err(), "-n or -A");
        assert!(Cli::try_parse_from(["capo"]).is_err(), "a bare capo prints help");
        let cli = Cli::parse_from(["capo", "explain", "shop/redis-0"]);
        let Command::Explain { pod, namespace, .. } = cli.command else { panic!("explain") };
        assert_eq!(explain_target(&pod, &namespace), ("shop".into(), "redis-0".into()));
        assert_eq!(explain_target("redis-0", "shop"), ("shop".into(), "redis-0".into()));
    }

    #[test]
    fn every_flag_has_an_env_var() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let run = cli.find_subcommand("run").expect("capo run");
        for arg in run.get_arguments() {
            let id = arg.get_id().as_str();
            // --kubeconfig and --context are kubectl's (KUBECONFIG is read as kubectl does).
            if ["help", "version", "kubeconfig", "context"].contains(&id) {
                continue;
            }
            assert!(arg.get_env().is_some(), "--{id} has no environment variable");
        }
    }

    #[test]
    fn settings_from_flags() {
        let args = run_from([
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
        let bad = run_from(["capo", "--log-level", "loud!"]).settings().unwrap_err();
        assert!(bad.to_string().starts_with("--log-level \"loud!\""), "{bad}");
        let bad = run_from(["capo", "--calico-api", "v2"]).settings().unwrap_err();
        assert!(bad.to_string().contains("unknown Calico API"), "{bad}");
        assert!(run_from(["capo", "--self-register-url", "http://x"]).settings().is_err());
        let bad = run_from(["capo", "--lease-duration", "5s", "--lease-renew-grace", "5s"]).settings();
        assert!(matches!(bad, Err(ArgsError::LeaseTiming)));
        let release = s.release.unwrap();
        let election = release.election.unwrap();
        assert_eq!((election.lease_name.as_str(), election.namespace.as_str()), ("capo", "ip-reserve"));
        let off = run_from(["capo", "--leader-elect", "false"]).settings().unwrap();
        assert!(off.release.unwrap().election.is_none(), "no election: this replica leads");
    }

    #[test]
    fn certificate_settings_from_flags() {
        let files = run_from(["capo", "--tls-dir", "/tls"]).settings().unwrap();
        assert!(matches!(files.tls, TlsSource::Dir(ref d) if d == std::path::Path::new("/tls")));
        assert_eq!(files.inject_ca_bundle, None, "files: no injection unless asked");
        let files = run_from(["capo", "--inject-ca-bundle", "true"]).settings().unwrap();
        assert_eq!(files.inject_ca_bundle.as_deref(), Some("capo"));
        let managed = run_from(["capo", "--tls-secret", "capo-webhook-tls", "--namespace", "ip-reserve"]).settings();
        let managed = managed.unwrap();
        let TlsSource::Managed(m) = &managed.tls else { panic!("{:?}", managed.tls) };
        assert_eq!(m.hosts, vec!["capo.ip-reserve.svc".to_string(), "capo.ip-reserve.svc.cluster.local".to_string()]);
        assert_eq!((m.secret.as_str(), m.namespace.as_str()), ("capo-webhook-tls", "ip-reserve"));
        assert_eq!(m.cert_validity, Duration::from_secs(90 * 86400));
        assert_eq!(m.ca_validity, Duration::from_secs(5 * 365 * 86400));
        assert_eq!(managed.inject_ca_bundle.as_deref(), Some("capo"), "self-managed: injected by default");
        let local = run_from([
            "capo",
            "--tls-secret",
            "t",
            "--self-register-url",
            "https://127.0.0.1:9443",
            "--webhook-config-name",
            "mine",
        ])
        .settings()
        .unwrap();
        assert!(matches!(&local.tls, TlsSource::Managed(m) if m.hosts == ["127.0.0.1"]));
        assert_eq!(local.inject_ca_bundle.as_deref(), Some("mine"));
        let bad = run_from(["capo", "--tls-secret", "t", "--tls-cert-validity", "48h", "--tls-ca-validity", "24h"]);
        assert!(matches!(bad.settings(), Err(ArgsError::CertValidity)));
        let bad = run_from(["capo", "--self-register-url", "https://127.0.0.1:9443", "--inject-ca-bundle", "true"]);
        assert!(matches!(bad.settings(), Err(ArgsError::InjectWithSelfRegister)));
    }

    #[test]
    fn calicos_etcd_settings() {
        let kube = run_from(["capo"]).settings().unwrap();
        assert_eq!(kube.calico_etcd, None);
        let etcd = run_from([
            "capo",
            "--calico-datastore",
            "etcdv3",
            "--etcd-endpoints",
            "https://10.0.0.1:2379,https://10.0.0.2:2379",
            "--etcd-ca-cert-file",
            "/etc/calico/ca.pem",
            "--etcd-cert-file",
            "/etc/calico/cert.pem",
            "--etcd-key-file",
            "/etc/calico/key.pem",
        ])
        .settings()
        .unwrap();
        let cfg = etcd.calico_etcd.unwrap();
        assert_eq!(cfg.endpoints, vec!["https://10.0.0.1:2379".to_string(), "https://10.0.0.2:2379".to_string()]);
        assert_eq!(cfg.key_file.as_deref(), Some(std::path::Path::new("/etc/calico/key.pem")));
        let none = run_from(["capo", "--calico-datastore", "etcdv3"]).settings();
        assert!(matches!(none, Err(ArgsError::NoEtcdEndpoints)), "{none:?}");
        let v1 = run_from([
            "capo",
            "--calico-datastore",
            "etcdv3",
            "--etcd-endpoints",
            "http://127.0.0.1:2379",
            "--calico-api",
            "crd.projectcalico.org/v1",
        ]);
        assert!(matches!(v1.settings(), Err(ArgsError::EtcdGroup(_))));
        let bad = run_from(["capo", "--calico-datastore", "etcd"]).settings().unwrap_err();
        assert!(bad.to_string().contains("kubernetes or etcdv3"), "{bad}");
    }

    #[test]
    fn url_hosts() {
        assert_eq!(url_host("https://127.0.0.1:9443").as_deref(), Some("127.0.0.1"));
        assert_eq!(url_host("https://[::1]:9443/x").as_deref(), Some("::1"));
        assert_eq!(url_host("https://capo.svc").as_deref(), Some("capo.svc"));
        assert_eq!(url_host("https://"), None);
    }
}
