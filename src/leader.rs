//! Leader election on a `coordination.k8s.io/v1` Lease (kube-lease-manager), and the
//! fence every leader-only write passes.
//!
//! Every replica serves the webhook; only the holder of the Lease releases, repairs, runs
//! the safety net and writes policy status. The fence is stricter than "the lease
//! manager said so": a replica counts as leader only while it has read the Lease back
//! with itself as holder within the last `duration - grace`, so a replica cut off from the
//! API server stops writing before anyone else can take the Lease over.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct LeaderSettings {
    /// The Lease's name (default `capo`).
    pub lease_name: String,
    /// The Lease's namespace: capo's own.
    pub namespace: String,
    /// This replica's identity (the Pod name).
    pub identity: String,
    /// How long a Lease is valid without renewal.
    pub duration: Duration,
    /// How long before expiry the holder renews.
    pub grace: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("Lease {namespace}/{name}: {source}")]
    Lease { namespace: String, name: String, source: kube_lease_manager::LeaseManagerError },
    #[error("lease duration {duration:?} must be longer than the renewal grace {grace:?}, both at least 1s")]
    Timing { duration: Duration, grace: Duration },
}

#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("this replica does not hold the Lease (or could not confirm it in time)")]
pub struct NotLeader;

/// Whether this replica may do leader-only writes right now.
#[derive(Clone)]
pub struct Fence {
    leading: watch::Receiver<bool>,
    confirmed_until: Arc<Mutex<Option<Instant>>>,
    /// The sender of a [`Fence::always`] fence, kept alive with it.
    _fixed: Option<Arc<watch::Sender<bool>>>,
}

impl Fence {
    pub fn check(&self) -> Result<(), NotLeader> {
        let confirmed = self.confirmed_until.lock().expect("fence lock").is_some_and(|t| Instant::now() < t);
        if *self.leading.borrow() && confirmed { Ok(()) } else { Err(NotLeader) }
    }

    pub fn is_leader(&self) -> bool {
        self.check().is_ok()
    }

    /// Waits until this replica leads (and has confirmed it).
    pub async fn acquired(&mut self) {
        loop {
            if self.is_leader() {
                return;
            }
            tokio::select! {
                _ = self.leading.changed() => {}
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// Waits until this replica no longer leads.
    pub async fn lost(&mut self) {
        loop {
            if !self.is_leader() {
                return;
            }
            tokio::select! {
                _ = self.leading.changed() => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// An always-open fence: leader election is off (`--leader-elect=false`, a single
    /// replica), so this replica leads.
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        let forever = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        Self { leading: rx, confirmed_until: Arc::new(Mutex::new(Some(forever))), _fixed: Some(Arc::new(tx)) }
    }
}

/// The running election: the fence, and what to stop on shutdown.
pub struct Election {
    pub fence: Fence,
    leading: Option<watch::Receiver<bool>>,
    manager: JoinHandle<Result<LeaseManager, kube_lease_manager::LeaseManagerError>>,
    confirm: JoinHandle<()>,
}

impl Election {
    pub async fn start(client: Client, settings: LeaderSettings) -> Result<Election, LeaderError> {
        let (d, g) = (settings.duration.as_secs(), settings.grace.as_secs());
        if g == 0 || d <= g {
            return Err(LeaderError::Timing { duration: settings.duration, grace: settings.grace });
        }
        let manager = LeaseManagerBuilder::new(client.clone(), &settings.lease_name)
            .with_namespace(&settings.namespace)
            .with_identity(&settings.identity)
            .with_duration(d)
            .with_grace(g)
            .build()
            .await
            .map_err(|source| LeaderError::Lease {
                namespace: settings.namespace.clone(),
                name: settings.lease_name.clone(),
                source,
            })?;
        let (leading, manager) = manager.watch().await;
        let confirmed_until = Arc::new(Mutex::new(None));
        let confirm = tokio::spawn(confirm_loop(client, settings.clone(), leading.clone(), confirmed_until.clone()));
        info!(lease = %settings.lease_name, namespace = %settings.namespace, identity = %settings.identity, "leader election started");
        let fence = Fence { leading: leading.clone(), confirmed_until, _fixed: None };
        Ok(Election { fence, leading: Some(leading), manager, confirm })
    }

    /// Gives the Lease up (so another replica takes over at once) and stops.
    pub async fn stop(mut self) {
        self.confirm.abort();
        *self.fence.confirmed_until.lock().expect("fence lock") = None;
        // The lease manager releases the Lease once every receiver is gone.
        drop(self.leading.take());
        drop(std::mem::replace(&mut self.fence.leading, watch::channel(false).1));
        match tokio::time::timeout(Duration::from_secs(5), &mut self.manager).await {
            Ok(Ok(Ok(_))) => info!("released the Lease"),
            Ok(Ok(Err(e))) => warn!(error = %e, "could not release the Lease; it expires by itself"),
            _ => warn!("the lease manager did not stop in time; the Lease expires by itself"),
        }
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        self.confirm.abort();
    }
}

/// Watches the Lease and extends the fence to `renewTime + duration - grace / 2` (in
/// local time) whenever it shows this replica as holder: the holder renews `grace` before
/// expiry, so a healthy leader's fence never closes, and one that cannot renew stops
/// writing before any other replica can take the Lease (at `renewTime + duration`).
async fn confirm_loop(
    client: Client,
    settings: LeaderSettings,
    _leading: watch::Receiver<bool>,
    confirmed_until: Arc<Mutex<Option<Instant>>>,
) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let api = Api::<Lease>::namespaced(client, &settings.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", settings.lease_name));
    let margin = settings.grace / 2;
    let mut leases = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
    while let Some(event) = leases.next().await {
        let lease = match event {
            Ok(lease) => lease,
            Err(e) => {
                warn!(error = %e, "watching the Lease failed; the fence closes when it expires");
                continue;
            }
        };
        let spec = lease.spec.unwrap_or_default();
        let until = (spec.holder_identity.as_deref() == Some(settings.identity.as_str()))
            .then_some(spec.renew_time)
            .flatten()
            .map(|t| {
                let renewed = std::time::SystemTime::from(t.0);
                let age = std::time::SystemTime::now().duration_since(renewed).unwrap_or_default();
                let valid = settings.duration.saturating_sub(margin).saturating_sub(age);
                Instant::now() + valid
            });
        *confirmed_until.lock().expect("fence lock") = until;
    }
}
