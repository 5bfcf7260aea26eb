//! Wires capo together: watches, the policy controller, the webhook server, probes.
//! `main` and the integration tests start the same [`App`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use capo_api::CalicoApiGroup;
use kube::Client;
use tokio::task::JoinHandle;
use tracing::info;

use crate::admission::{Admission, AdmissionSettings};
use crate::calico::etcd::{Etcd, EtcdConfig, EtcdError};
use crate::calico::pools::{PoolStore, detect_ipam_api};
use crate::calico::{
    Datastore, Detected, Follow, ReservationIndex, Reservations, ShardView, WritingGroup, detect_calico_api,
};
use crate::certs::managed::{Injected, ManagedError, ManagedSettings};
use crate::certs::{self, CertError, ServingCert};
use crate::health::{self, Readiness};
use crate::hold::HoldWriter;
use crate::leader::{Election, Fence, LeaderError, LeaderSettings};
use crate::metrics::Metrics;
use crate::policy::{Matcher, PolicyController, SharedMatcher};
use crate::release::{EngineSettings, ReleaseEngine};
use crate::server::{ServerError, WebhookServer};
use crate::store::{NamespaceStore, PodStore};
use crate::webhook_config::{self, Registration};
use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};

/// Where the webhook's serving certificate comes from.
#[derive(Clone, Debug)]
pub enum TlsSource {
    /// `tls.crt`/`tls.key` in a directory (a mounted Secret), reloaded on change.
    Dir(PathBuf),
    /// Made at start for these hosts; the CA goes into the self-registered webhook.
    SelfSigned { hosts: Vec<String>, write_to: Option<PathBuf> },
    /// Self-managed: capo makes and rotates its CA and serving certificate in a Secret.
    Managed(ManagedSettings),
}

/// Self-registration of the webhook configuration (local runs and tests).
#[derive(Clone, Debug)]
pub struct SelfRegister {
    pub name: String,
    /// Base URL the API server calls; default `https://<webhook address>`.
    pub url: Option<String>,
    pub only_namespaces: Option<Vec<String>>,
    pub timeout_seconds: i32,
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub webhook_addr: SocketAddr,
    pub probe_addr: Option<SocketAddr>,
    pub tls: TlsSource,
    /// Write the CA bundle into this ValidatingWebhookConfiguration and keep it there.
    pub inject_ca_bundle: Option<String>,
    pub self_register: Option<SelfRegister>,
    /// `None`: detect it the way Calico does.
    pub calico_api: Option<CalicoApiGroup>,
    /// Calico's etcd datastore: reservations go there (`projectcalico.org/v3`), not to the
    /// API server. `None`: the Kubernetes datastore.
    pub calico_etcd: Option<EtcdConfig>,
    pub excluded_namespaces: Vec<String>,
    pub max_review_time: Duration,
    /// What one client may cost the webhook: connections, timeouts, reviews in flight.
    pub limits: WebhookLimits,
    /// What a caller of the webhook must present (a client certificate, a bearer token).
    pub caller_auth: crate::caller_auth::CallerAuth,
    pub field_manager: String,
    /// How long to wait for the caches before giving up at start.
    pub sync_timeout: Duration,
    /// Release held IPs (on the leader). `None`: this process only serves the webhook.
    pub release: Option<ReleaseSettings>,
    /// How long a watch the admission decision depends on may fail before capo reports
    /// itself not ready (and answers reviews 503, so the failurePolicy applies).
    pub watch_failure_grace: Duration,
}

/// What one client may cost the webhook.
#[derive(Clone, Debug, Default)]
pub struct WebhookLimits {
    pub connections: crate::server::ConnectionLimits,
    pub reviews: crate::admission::ReviewLimits,
}

#[derive(Clone, Debug)]
pub struct ReleaseSettings {
    /// `None`: no election, this replica always leads (a single replica).
    pub election: Option<LeaderSettings>,
    pub engine: EngineSettings,
    /// This replica's name in Events and the Lease.
    pub identity: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error(transparent)]
    ManagedCert(#[from] ManagedError),
    #[error("no serving certificate in Secret {secret} after {after:?}: see the warnings above")]
    NoCertificate { secret: String, after: Duration },
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("binding {what} on {addr}: {source}")]
    Bind { what: &'static str, addr: SocketAddr, source: std::io::Error },
    #[error("caches did not sync within {after:?} (still waiting for {missing})")]
    SyncTimeout { after: Duration, missing: String },
    #[error("a self-signed certificate needs a webhook URL host; use --webhook-url")]
    NoHost,
    #[error("writing ValidatingWebhookConfiguration {name}: {source}")]
    Register { name: String, source: kube::Error },
    #[error(transparent)]
    Leader(#[from] LeaderError),
    #[error("Calico's etcd datastore: {0}")]
    Etcd(#[from] EtcdError),
}

pub struct App {
    pub webhook_addr: SocketAddr,
    pub probe_addr: Option<SocketAddr>,
    /// The group capo held in when it started.
    pub calico_api: CalicoApiGroup,
    /// The group new holds go to now (moved by a datastore migration).
    pub writing: WritingGroup,
    pub metrics: Arc<Metrics>,
    pub readiness: Arc<Readiness>,
    pub matcher: SharedMatcher,
    /// The one Pod store (admission and leader).
    pub pods: Arc<PodStore>,
    /// Calico's IP pools as the webhook sees them (None: not served here).
    pub pools: Option<Arc<PoolStore>>,
    client: Client,
    registered: Option<String>,
    server: Option<WebhookServer>,
    /// The certificate the webhook serves (tests look at its handshakes).
    pub serving: Arc<ServingCert>,
    tasks: Tasks,
    /// Tells the release engine capo stops (it writes its last countdowns), and its task.
    leading: Option<(tokio::sync::watch::Sender<bool>, Tasks)>,
    election: Option<Election>,
    /// Whether this replica may do leader-only work now (None: it never does).
    pub fence: Option<Fence>,
    _cert_watcher: Option<notify::RecommendedWatcher>,
    _etcd_certificates: Option<notify::RecommendedWatcher>,
}

impl App {
    /// Starts everything and returns once the caches are synced and the webhook serves
    /// (and, when self-registering, is registered).
    pub async fn start(client: Client, settings: Settings) -> Result<App, AppError> {
        Self::start_with_leader_client(client.clone(), client, settings).await
    }

    /// As [`App::start`], with a second client for the leader's writes: one without kube's
    /// retry layer, so that no write is re-sent after this replica stopped leading.
    pub async fn start_with_leader_client(
        client: Client,
        leader_client: Client,
        settings: Settings,
    ) -> Result<App, AppError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let metrics = Arc::new(Metrics::new());
        let readiness = Arc::new(Readiness::new(settings.watch_failure_grace));
        let pods = Arc::new(PodStore::default());
        let namespaces = Arc::new(NamespaceStore::default());
        let matcher: SharedMatcher = Arc::new(ArcSwap::from_pointee(Matcher::default()));
        let calico = calico_datastore(&client, &leader_client, &settings).await?;
        let index = Arc::new(ReservationIndex::with_alias(calico.detected.alias()));
        let calico_api = calico.detected.chosen;
        let watched = calico.watched();
        let mut tasks = Tasks(vec![
            tokio::spawn(namespaces.clone().watch(client.clone(), readiness.clone())),
            tokio::spawn(pods.clone().watch(client.clone(), readiness.clone(), metrics.pod_events.clone())),
        ]);
        watch_reservations(&client, &calico, &watched, &index, &mut tasks);
        // Where new holds go: the detected group, moved when a datastore migration moves
        // what Calico reads (on Calico's etcd there is one group).
        let writing = WritingGroup::new(calico_api);
        if matches!(calico.store, Datastore::Kubernetes(_)) {
            tasks.push(tokio::spawn(crate::calico::follow(Follow {
                client: client.clone(),
                writing: writing.clone(),
                index: index.clone(),
                watched: watched.clone(),
                forced: settings.calico_api.is_some(),
                gauges: metrics.calico.clone(),
            })));
        }
        // The epoch a new leader takes is above every epoch on capo's reservations (of the
        // policies it acts on: with a test's policy prefix, other capos' shards on the same
        // cluster carry epochs of other Leases).
        let floor: crate::leader::EpochFloor = {
            let index = index.clone();
            let prefix = settings.release.as_ref().and_then(|r| r.engine.policy_prefix.clone());
            Arc::new(move || {
                let ours = |v: &ShardView| {
                    prefix.as_deref().is_none_or(|p| v.policy.as_deref().is_some_and(|n| n.starts_with(p)))
                };
                index.all().values().filter(|(_, v)| ours(v)).filter_map(|(_, v)| v.epoch).max().unwrap_or(0)
            })
        };
        let (election, fence) = elect(&settings, &leader_client, &index, &watched, floor.clone()).await?;
        // A shard the webhook creates starts with the newest epoch this replica knows, so
        // that a leader deposed before it cannot write it.
        let epoch_seen: crate::leader::EpochFloor = {
            let lease = election.as_ref().map(Election::epoch_seen);
            let fence = fence.clone();
            Arc::new(move || {
                let lease = lease.as_ref().map_or(0, |l| l());
                floor().max(lease).max(fence.as_ref().map_or(0, Fence::epoch))
            })
        };
        let (policy_changes, _) = tokio::sync::broadcast::channel(64);
        tasks.push(tokio::spawn(
            PolicyController::new(
                client.clone(),
                matcher.clone(),
                readiness.clone(),
                metrics.clone(),
                settings.field_manager.clone(),
                fence.clone(),
                policy_changes.clone(),
            )
            .run(),
        ));

        let (serving, ca_pem, cert_watcher) = serving_cert(&client, &settings, &metrics, &mut tasks).await?;

        let restored = metrics.release.repairs.with_label_values(&["labels_restored"]);
        let reservations = Reservations::writing_to(calico.store.clone(), writing.clone(), index.clone())
            .counting_restores(restored.clone())
            .with_epoch_seen(epoch_seen);
        let pools = watch_pools(&client, &calico, &writing, &mut tasks).await;
        let admission = Admission::new(
            matcher.clone(),
            pods.clone(),
            namespaces.clone(),
            HoldWriter::new(client.clone(), reservations).with_pods(pods.clone()),
            client.clone(),
            metrics.clone(),
            readiness.clone(),
            AdmissionSettings {
                excluded_namespaces: settings.excluded_namespaces.clone(),
                max_review_time: settings.max_review_time,
                limits: settings.limits.reviews.clone(),
            },
        );
        let admission = Arc::new(match &pools {
            Some(pools) => admission.with_pools(pools.clone()),
            None => admission,
        });
        let router = crate::admission::router(admission);
        let server = WebhookServer::start(
            settings.webhook_addr,
            router,
            serving.clone(),
            settings.limits.connections.clone(),
            metrics.connections.clone(),
            &settings.caller_auth,
        )
        .await?;
        let webhook_addr = server.addr;
        info!(addr = %webhook_addr, calico = %calico_api, "webhook serving");

        let probe_addr = match settings.probe_addr {
            Some(addr) => Some(serve_probes(addr, &readiness, &metrics, &mut tasks).await?),
            None => None,
        };

        if tokio::time::timeout(settings.sync_timeout, readiness.wait()).await.is_err() {
            return Err(AppError::SyncTimeout {
                after: settings.sync_timeout,
                missing: readiness.missing().join(", "),
            });
        }
        info!("caches synced; ready");

        let mut leading = None;
        if let (Some(release), Some(fence)) = (&settings.release, &fence) {
            let (stop, stopping) = tokio::sync::watch::channel(false);
            let engine = ReleaseEngine {
                client: leader_client.clone(),
                reservations: Reservations::writing_to(calico.leader_store.clone(), writing.clone(), index.clone())
                    .counting_restores(restored),
                served: watched,
                pods: pods.clone(),
                namespaces,
                matcher: matcher.clone(),
                policy_changes,
                settings: release.engine.clone(),
                metrics: metrics.clone(),
                identity: release.identity.clone(),
                stopping,
            };
            let task = tokio::spawn(lead(Arc::new(engine), fence.clone(), metrics.clone()));
            leading = Some((stop, Tasks(vec![task])));
        }

        let registered = register(&client, &settings, webhook_addr, ca_pem).await?;
        Ok(App {
            webhook_addr,
            probe_addr,
            calico_api,
            writing,
            metrics,
            readiness,
            matcher,
            pods,
            pools,
            client,
            registered,
            server: Some(server),
            serving,
            tasks,
            leading,
            election,
            fence,
            _cert_watcher: cert_watcher,
            _etcd_certificates: calico.certificates,
        })
    }

    /// Gives up the Lease, removes a self-registered webhook configuration and stops
    /// serving.
    pub async fn shutdown(mut self) {
        if let Some((stop, mut task)) = self.leading.take() {
            // The leader writes the countdowns it has not written yet while it still holds
            // the Lease (bounded: a stuck API server does not hold the shutdown up).
            let _ = stop.send(true);
            if let Some(t) = task.0.pop() {
                let abort = t.abort_handle();
                if tokio::time::timeout(LAST_FLUSH_LIMIT, t).await.is_err() {
                    abort.abort();
                    tracing::warn!(limit = ?LAST_FLUSH_LIMIT, "the leader's last countdown write did not end in time");
                }
            }
        }
        drop(std::mem::take(&mut self.tasks));
        self.metrics.release.leader.set(0);
        if let Some(election) = self.election.take() {
            election.stop().await;
        }
        if let Some(name) = self.registered.take()
            && let Err(e) = webhook_config::delete(&self.client, &name).await
        {
            tracing::warn!(name, error = %e, "could not remove the webhook configuration");
        }
        if let Some(server) = self.server.take() {
            server.shutdown(Duration::from_secs(5)).await;
        }
    }
}

/// Where capo's reservations are, and in which Calico API group.
struct CalicoDatastore {
    /// For holds (every replica).
    store: Datastore,
    /// For the leader's writes (its client has no retry layer).
    leader_store: Datastore,
    detected: Detected,
    /// Reloads Calico's etcd certificates when their files change (etcd only).
    certificates: Option<notify::RecommendedWatcher>,
}

impl CalicoDatastore {
    /// The groups watched: each store once (see [`Detected::watched`]).
    fn watched(&self) -> Vec<CalicoApiGroup> {
        self.detected.watched()
    }
}

/// Calico's etcd when configured (it keeps `projectcalico.org/v3` objects only), else the
/// API server with the group detected the way Calico detects it.
/// Watches capo's reservations into `index`: through the API server, each served Calico
/// API group, or in Calico's etcd.
fn watch_reservations(
    client: &Client,
    calico: &CalicoDatastore,
    watched: &[CalicoApiGroup],
    index: &Arc<ReservationIndex>,
    tasks: &mut Tasks,
) {
    match &calico.store {
        Datastore::Etcd(etcd) => tasks.push(tokio::spawn(index.clone().watch_etcd(etcd.clone()))),
        Datastore::Kubernetes(_) => {
            for group in watched {
                tasks.push(tokio::spawn(index.clone().watch(client.clone(), *group)));
            }
        }
    }
}

/// Calico's IP pools, watched on every replica for the webhook (an address outside all
/// of them is never held). `None` where Calico's pools are not served.
async fn watch_pools(
    client: &Client,
    calico: &CalicoDatastore,
    writing: &WritingGroup,
    tasks: &mut Tasks,
) -> Option<Arc<PoolStore>> {
    let store = Arc::new(PoolStore::default());
    match &calico.store {
        Datastore::Etcd(etcd) => tasks.0.extend(store.watch_etcd_pools(etcd)),
        Datastore::Kubernetes(_) => {
            detect_ipam_api(client).await?;
            tasks.push(store.follow(client, writing, false));
        }
    }
    Some(store)
}

async fn calico_datastore(
    client: &Client,
    leader_client: &Client,
    settings: &Settings,
) -> Result<CalicoDatastore, AppError> {
    Ok(match &settings.calico_etcd {
        Some(config) => {
            let etcd = Etcd::new(config)?;
            info!(endpoints = %etcd.endpoints(), "Calico's datastore: etcd");
            let certificates = etcd.reload_on_change(config)?;
            CalicoDatastore {
                store: Datastore::Etcd(etcd.clone()),
                leader_store: Datastore::Etcd(etcd),
                detected: Detected::only(CalicoApiGroup::V3),
                certificates,
            }
        }
        None => CalicoDatastore {
            store: Datastore::Kubernetes(client.clone()),
            leader_store: Datastore::Kubernetes(leader_client.clone()),
            detected: detect_calico_api(client, settings.calico_api).await,
            certificates: None,
        },
    })
}

/// Takes part in the election (or, without one, leads once the reservations are read).
async fn elect(
    settings: &Settings,
    leader_client: &Client,
    index: &Arc<ReservationIndex>,
    served: &[CalicoApiGroup],
    floor: crate::leader::EpochFloor,
) -> Result<(Option<Election>, Option<Fence>), AppError> {
    // Every replica takes part in the election; only the leader releases and writes
    // policy status.
    Ok(match settings.release.as_ref().map(|r| &r.election) {
        None => (None, None),
        Some(Some(leader)) => {
            let election = Election::start(leader_client.clone(), leader.clone(), floor).await?;
            let fence = election.fence.clone();
            (Some(election), Some(fence))
        }
        Some(None) => {
            let synced = async {
                for g in served {
                    index.synced(*g).await;
                }
            };
            let _ = tokio::time::timeout(settings.sync_timeout, synced).await;
            (None, Some(Fence::always(floor() + 1)))
        }
    })
}

/// The webhook's serving certificate, from wherever `settings.tls` says; the CA to
/// register (self-signed only) and the watcher that reloads mounted files.
async fn serving_cert(
    client: &Client,
    settings: &Settings,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Result<(Arc<ServingCert>, Option<String>, Option<notify::RecommendedWatcher>), AppError> {
    let serving = ServingCert::new(Some(metrics.tls.clone()));
    let (trust, trusted) = tokio::sync::watch::channel(match settings.inject_ca_bundle {
        Some(_) => Injected::Unknown,
        None => Injected::NotInjecting,
    });
    if let Some(name) = &settings.inject_ca_bundle {
        let metrics = Some(metrics.tls.clone());
        tasks.push(tokio::spawn(certs::inject::run::<ValidatingWebhookConfiguration>(
            client.clone(),
            name.clone(),
            serving.bundle(),
            trust,
            metrics.clone(),
        )));
        // The sticky webhook's configuration gets the same bundle at the same moment; the
        // CA rotation waits on the validating one (the hold's guarantee).
        let (sticky_trust, _) = tokio::sync::watch::channel(Injected::Unknown);
        tasks.push(tokio::spawn(certs::inject::run::<MutatingWebhookConfiguration>(
            client.clone(),
            name.clone(),
            serving.bundle(),
            sticky_trust,
            metrics,
        )));
    }
    let mut ca_pem = None;
    let mut cert_watcher = None;
    match &settings.tls {
        TlsSource::Dir(dir) => {
            certs::files::load(dir, &serving)?;
            cert_watcher = Some(certs::files::watch(dir.clone(), serving.clone())?);
        }
        TlsSource::SelfSigned { hosts, write_to } => {
            let made = certs::self_signed(hosts)?;
            if let Some(dir) = write_to {
                made.write(dir)?;
            }
            serving.set("the generated certificate", &made.cert_pem, &made.key_pem)?;
            serving.set_bundle(Some(&made.ca_pem));
            ca_pem = Some(made.ca_pem);
        }
        TlsSource::Managed(managed) => {
            let (first, outcome) = tokio::sync::oneshot::channel();
            let metrics = Some(metrics.tls.clone());
            let run = certs::managed::run(client.clone(), managed.clone(), serving.clone(), trusted, metrics, first);
            tasks.push(tokio::spawn(run));
            match tokio::time::timeout(settings.sync_timeout, outcome).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => return Err(e.into()),
                _ => {
                    return Err(AppError::NoCertificate {
                        secret: format!("{}/{}", managed.namespace, managed.secret),
                        after: settings.sync_timeout,
                    });
                }
            }
        }
    }
    Ok((serving, ca_pem, cert_watcher))
}

/// The probe and metrics server; returns the address it listens on.
async fn serve_probes(
    addr: SocketAddr,
    readiness: &Arc<Readiness>,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Result<SocketAddr, AppError> {
    let bind_error = |source| AppError::Bind { what: "the probe server", addr, source };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    let router = health::router(readiness.clone(), Some(metrics.clone()));
    tasks.push(tokio::spawn(async move {
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, router).await;
    }));
    Ok(bound)
}

/// Writes the webhook configuration when self-registering; returns its name.
async fn register(
    client: &Client,
    settings: &Settings,
    webhook_addr: SocketAddr,
    ca_pem: Option<String>,
) -> Result<Option<String>, AppError> {
    let Some(reg) = &settings.self_register else { return Ok(None) };
    // Without a CA of its own (self-managed or mounted certificates) the configuration is
    // written without caBundle, and the injector fills it in.
    let registration = Registration {
        name: reg.name.clone(),
        url: reg.url.clone().unwrap_or_else(|| format!("https://{webhook_addr}")),
        ca_pem,
        excluded_namespaces: settings.excluded_namespaces.clone(),
        only_namespaces: reg.only_namespaces.clone(),
        timeout_seconds: reg.timeout_seconds,
    };
    webhook_config::apply(client, &registration)
        .await
        .map_err(|source| AppError::Register { name: reg.name.clone(), source })?;
    info!(name = %reg.name, url = %registration.url, "registered the webhook configuration");
    Ok(Some(reg.name.clone()))
}

/// How long a shutdown waits for the leader's last countdown write.
const LAST_FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// Runs the release engine whenever this replica leads, and stops it the moment it does not
/// (or, once capo stops, after its last countdown write).
async fn lead(engine: Arc<ReleaseEngine>, fence: Fence, metrics: Arc<Metrics>) {
    let mut stopping = engine.stopping.clone();
    loop {
        tokio::select! {
            _ = fence.acquired() => {}
            _ = stopping.wait_for(|s| *s) => return,
        }
        metrics.release.leader.set(1);
        info!(identity = %engine.identity, "leading: releasing, repairing, safety net");
        tokio::select! {
            _ = engine.run(fence.clone()) => {}
            _ = fence.lost() => {}
        }
        metrics.release.leader.set(0);
        info!(identity = %engine.identity, "not leading");
        if *engine.stopping.borrow() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl Drop for App {
    fn drop(&mut self) {
        drop(self.server.take());
    }
}

/// capo's background tasks, aborted when dropped — also when `start` gives up half way,
/// so a start that fails leaves nothing running.
#[derive(Default)]
struct Tasks(Vec<JoinHandle<()>>);

impl Tasks {
    fn push(&mut self, task: JoinHandle<()>) {
        self.0.push(task);
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}
