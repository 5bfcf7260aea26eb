//! Leader election on a `coordination.k8s.io/v1` Lease, and the fence every leader-only
//! write passes.
//!
//! Every replica serves the webhook; only the holder of the Lease releases, repairs, runs
//! the safety net and writes policy status.
//!
//! **Clocks.** No decision compares one machine's clock with another's. A follower takes
//! the Lease over only when it has seen no change of it for the Lease's whole duration,
//! measured on its own monotonic clock; the holder stops acting as leader when it has not
//! renewed for `duration - grace`, measured the same way from the start of its last
//! successful renewal. So two replicas whose wall clocks disagree by any amount never lead
//! at once because of it (`renewTime` and `acquireTime` are written for people to read).
//!
//! **Fencing.** Every acquisition raises the Lease's `leaseTransitions`; that number is
//! the leader's epoch. A new leader stamps it on every capo-owned reservation before its
//! first write, and every leader write to a reservation tests it ([`crate::calico`]): a
//! replica that lost the Lease — paused, cut off, or with a write still in flight — has
//! its writes refused by the API server. Record writes are conditional on the version the
//! leader read. Writes are never retried once the fence is closed.
//!
//! **Handover.** On shutdown the holder clears `holderIdentity`; the followers watch the
//! Lease and take it at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Error as KubeError};
use tokio::sync::{Notify, watch};
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
    /// How long a Lease stays valid without a renewal, as followers count it.
    pub duration: Duration,
    /// How much earlier than that the holder stops acting as leader if it cannot renew.
    pub grace: Duration,
}

impl LeaderSettings {
    /// How often the holder renews and a follower looks again without news.
    fn retry(&self) -> Duration {
        ((self.duration - self.grace) / 4).max(Duration::from_millis(100))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error(
        "Lease {namespace}/{name}: the namespace {namespace} does not exist. Create it, run capo with \
         --namespace (POD_NAMESPACE) naming its own namespace, or turn leader election off with \
         --leader-elect=false (a single replica)"
    )]
    NoNamespace { namespace: String, name: String },
    #[error("Lease {namespace}/{name}: {source}")]
    Lease { namespace: String, name: String, source: KubeError },
    #[error("lease duration {duration:?} must be longer than the renewal grace {grace:?}, both at least 1s")]
    Timing { duration: Duration, grace: Duration },
}

#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("this replica does not hold the Lease (or could not confirm it in time)")]
pub struct NotLeader;

struct FenceState {
    leading: watch::Sender<bool>,
    /// The holder acts as leader until then (monotonic).
    deadline: Mutex<Option<Instant>>,
    epoch: AtomicU64,
    /// Set when a write found a newer epoch: this replica stops leading at once.
    revoked: AtomicBool,
    /// Wakes the election when the fence is revoked.
    kick: Notify,
}

/// Whether this replica may do leader-only writes right now, and under which epoch.
#[derive(Clone)]
pub struct Fence {
    state: Arc<FenceState>,
}

impl Fence {
    fn new() -> Self {
        Self {
            state: Arc::new(FenceState {
                leading: watch::Sender::new(false),
                deadline: Mutex::new(None),
                epoch: AtomicU64::new(0),
                revoked: AtomicBool::new(false),
                kick: Notify::new(),
            }),
        }
    }

    pub fn check(&self) -> Result<(), NotLeader> {
        let s = &self.state;
        let in_time = s.deadline.lock().expect("fence lock").is_some_and(|d| Instant::now() < d);
        if *s.leading.borrow() && in_time && !s.revoked.load(Ordering::SeqCst) { Ok(()) } else { Err(NotLeader) }
    }

    pub fn is_leader(&self) -> bool {
        self.check().is_ok()
    }

    /// The epoch of this replica's leadership (the Lease's `leaseTransitions` it wrote).
    pub fn epoch(&self) -> u64 {
        self.state.epoch.load(Ordering::SeqCst)
    }

    /// A write found a newer leader: stop leading now.
    pub fn revoke(&self) {
        if !self.state.revoked.swap(true, Ordering::SeqCst) {
            warn!(epoch = self.epoch(), "a newer leader's epoch is on capo's reservations; this replica stops leading");
            self.state.kick.notify_one();
        }
    }

    /// Waits until this replica leads.
    pub async fn acquired(&self) {
        let mut rx = self.state.leading.subscribe();
        loop {
            if self.is_leader() {
                return;
            }
            tokio::select! {
                _ = rx.changed() => {}
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// Waits until this replica no longer leads.
    pub async fn lost(&self) {
        let mut rx = self.state.leading.subscribe();
        loop {
            if !self.is_leader() {
                return;
            }
            let until = self.state.deadline.lock().expect("fence lock").unwrap_or_else(Instant::now);
            tokio::select! {
                _ = rx.changed() => {}
                _ = tokio::time::sleep_until(until.into()) => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Leader election is off (`--leader-elect=false`, a single replica): this replica
    /// leads, under an epoch above every epoch on capo's reservations (`epoch`).
    pub fn always(epoch: u64) -> Self {
        let fence = Self::new();
        fence.state.epoch.store(epoch, Ordering::SeqCst);
        *fence.state.deadline.lock().expect("fence lock") =
            Some(Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600));
        fence.state.leading.send_replace(true);
        fence
    }

    fn lead(&self, epoch: u64, deadline: Instant) {
        self.state.epoch.store(epoch, Ordering::SeqCst);
        self.state.revoked.store(false, Ordering::SeqCst);
        *self.state.deadline.lock().expect("fence lock") = Some(deadline);
        self.state.leading.send_replace(true);
    }

    fn extend(&self, deadline: Instant) {
        *self.state.deadline.lock().expect("fence lock") = Some(deadline);
    }

    fn step_down(&self) {
        *self.state.deadline.lock().expect("fence lock") = None;
        self.state.leading.send_replace(false);
    }

    fn revoked(&self) -> bool {
        self.state.revoked.load(Ordering::SeqCst)
    }
}

/// What this replica last saw of the Lease, and when (its own monotonic clock).
struct Seen {
    lease: Option<Lease>,
    changed_at: Instant,
}

impl Seen {
    fn holder(&self) -> Option<&str> {
        self.lease.as_ref()?.spec.as_ref()?.holder_identity.as_deref().filter(|h| !h.is_empty())
    }

    fn version(&self) -> Option<String> {
        self.lease.as_ref()?.metadata.resource_version.clone()
    }
}

/// The running election: the fence, and what to stop on shutdown.
pub struct Election {
    pub fence: Fence,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<Notify>,
    task: JoinHandle<()>,
    watch: JoinHandle<()>,
}

/// The lowest epoch a new leader may take: above every epoch already on capo's objects.
pub type EpochFloor = Arc<dyn Fn() -> u64 + Send + Sync>;

impl Election {
    /// Checks the Lease can be used, then competes for it in the background.
    pub async fn start(client: Client, settings: LeaderSettings, floor: EpochFloor) -> Result<Election, LeaderError> {
        if settings.grace < Duration::from_secs(1) || settings.duration <= settings.grace {
            return Err(LeaderError::Timing { duration: settings.duration, grace: settings.grace });
        }
        let api = Api::<Lease>::namespaced(client.clone(), &settings.namespace);
        let err = |source: KubeError| match &source {
            KubeError::Api(s) if s.code == 404 && s.details.as_ref().is_some_and(|d| d.kind == "namespaces") => {
                LeaderError::NoNamespace { namespace: settings.namespace.clone(), name: settings.lease_name.clone() }
            }
            _ => {
                LeaderError::Lease { namespace: settings.namespace.clone(), name: settings.lease_name.clone(), source }
            }
        };
        let first = api.get_opt(&settings.lease_name).await.map_err(err)?;
        if first.is_none() {
            // Create it unheld, so that a missing namespace says so now, not in a retry loop.
            let lease = Lease {
                metadata: ObjectMeta { name: Some(settings.lease_name.clone()), ..Default::default() },
                spec: Some(LeaseSpec { lease_transitions: Some(0), ..Default::default() }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => {}
                Err(KubeError::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(err(e)),
            }
        }
        let fence = Fence::new();
        let seen = Arc::new(Mutex::new(Seen { lease: first, changed_at: Instant::now() }));
        let news = Arc::new(Notify::new());
        let stop = Arc::new(Notify::new());
        let watch = tokio::spawn(watch_lease(api.clone(), settings.clone(), seen.clone(), news.clone()));
        let task = tokio::spawn(
            Campaign {
                api,
                settings: settings.clone(),
                fence: fence.clone(),
                seen: seen.clone(),
                news,
                stop: stop.clone(),
                floor,
            }
            .run(),
        );
        info!(lease = %settings.lease_name, namespace = %settings.namespace, identity = %settings.identity, "leader election started");
        Ok(Election { fence, seen, stop, task, watch })
    }

    /// The epoch of the newest Lease this replica has seen (its `leaseTransitions`, which
    /// each acquisition raises): the current leader's, as far as this replica knows.
    pub fn epoch_seen(&self) -> EpochFloor {
        let seen = self.seen.clone();
        Arc::new(move || {
            let s = seen.lock().expect("lease lock");
            s.lease.as_ref().and_then(|l| l.spec.as_ref()?.lease_transitions).map_or(0, |t| t.max(0) as u64)
        })
    }

    /// Gives the Lease up (another replica takes over at once) and stops.
    pub async fn stop(mut self) {
        self.stop.notify_one();
        match tokio::time::timeout(Duration::from_secs(5), &mut self.task).await {
            Ok(_) => {}
            Err(_) => warn!("leader election did not stop in time; the Lease expires by itself"),
        }
        self.watch.abort();
    }
}

impl Drop for Election {
    /// Dropped without [`Election::stop`] (a crash, a failed start): the campaign ends and
    /// the Lease expires by itself.
    fn drop(&mut self) {
        self.watch.abort();
        self.task.abort();
    }
}

/// Keeps [`Seen`] current; wakes the campaign on every change.
async fn watch_lease(api: Api<Lease>, settings: LeaderSettings, seen: Arc<Mutex<Seen>>, news: Arc<Notify>) {
    let config = watcher::Config::default().fields(&format!("metadata.name={}", settings.lease_name));
    let mut events = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
    while let Some(event) = events.next().await {
        match event {
            Ok(lease) => {
                observe(&seen, Some(lease));
                news.notify_one();
            }
            Err(e) => warn!(error = %e, "watching the Lease failed; retrying"),
        }
    }
}

/// Whether `version` is older than `held` (both as the API server writes them for one
/// object: etcd revisions, which only grow; anything else is not compared).
fn older(version: Option<&str>, held: Option<&str>) -> bool {
    match (version.and_then(|v| v.parse::<u64>().ok()), held.and_then(|h| h.parse::<u64>().ok())) {
        (Some(v), Some(h)) => v < h,
        _ => false,
    }
}

/// Records a read of the Lease; the clock restarts only if it changed. A Lease older than
/// the one already seen (a watch event delivered after this replica's own write) is
/// ignored: it would make the holder look like someone else and step down for nothing.
fn observe(seen: &Mutex<Seen>, lease: Option<Lease>) {
    let mut s = seen.lock().expect("lease lock");
    let version = lease.as_ref().and_then(|l| l.metadata.resource_version.clone());
    if lease.is_some() && older(version.as_deref(), s.version().as_deref()) {
        return;
    }
    if version != s.version() || version.is_none() {
        s.changed_at = Instant::now();
    }
    s.lease = lease;
}

struct Campaign {
    api: Api<Lease>,
    settings: LeaderSettings,
    fence: Fence,
    seen: Arc<Mutex<Seen>>,
    news: Arc<Notify>,
    stop: Arc<Notify>,
    floor: EpochFloor,
}

impl Campaign {
    async fn run(self) {
        let retry = self.settings.retry();
        loop {
            let leading = self.fence.is_leader() && !self.fence.revoked();
            if !leading && *self.fence.state.leading.borrow() {
                self.fence.step_down();
                info!(identity = %self.settings.identity, "stopped leading");
            }
            let outcome = if leading { self.renew().await } else { self.try_acquire().await };
            if let Err(e) = outcome {
                warn!(error = %e, "the Lease could not be written; trying again");
            }
            tokio::select! {
                _ = self.stop.notified() => {
                    self.release().await;
                    return;
                }
                _ = self.news.notified(), if !self.fence.is_leader() => {}
                _ = self.fence.state.kick.notified() => {}
                _ = tokio::time::sleep(retry) => {}
            }
        }
    }

    fn now() -> MicroTime {
        MicroTime(k8s_openapi::jiff::Timestamp::now())
    }

    /// Takes the Lease if nobody holds it, or its holder has not renewed it for a whole
    /// `duration` by this replica's clock.
    async fn try_acquire(&self) -> Result<(), KubeError> {
        let (lease, free) = {
            let s = self.seen.lock().expect("lease lock");
            let expired = s.changed_at.elapsed() >= self.settings.duration;
            let mine = s.holder() == Some(self.settings.identity.as_str());
            (s.lease.clone(), s.holder().is_none() || expired || mine)
        };
        let Some(mut lease) = lease else {
            self.refresh().await?;
            return Ok(());
        };
        if !free {
            return Ok(());
        }
        let transitions = lease.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
        let epoch = (i64::from(transitions) + 1).max((self.floor)() as i64 + 1).min(i64::from(i32::MAX)) as i32;
        let started = Instant::now();
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.settings.identity.clone()),
            lease_duration_seconds: Some(self.settings.duration.as_secs().max(1) as i32),
            acquire_time: Some(Self::now()),
            renew_time: Some(Self::now()),
            lease_transitions: Some(epoch),
            ..Default::default()
        });
        match self.api.replace(&self.settings.lease_name, &PostParams::default(), &lease).await {
            Ok(written) => {
                observe(&self.seen, Some(written));
                self.fence.lead(epoch as u64, started + (self.settings.duration - self.settings.grace));
                info!(identity = %self.settings.identity, epoch, "leading");
                Ok(())
            }
            Err(KubeError::Api(s)) if s.code == 409 => self.refresh().await,
            Err(KubeError::Api(s)) if s.code == 404 => self.refresh().await,
            Err(e) => Err(e),
        }
    }

    /// Renews the Lease; steps down if someone else holds it now.
    async fn renew(&self) -> Result<(), KubeError> {
        let lease = self.seen.lock().expect("lease lock").lease.clone();
        let Some(mut lease) = lease else { return self.refresh().await };
        if lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(self.settings.identity.as_str()) {
            self.fence.step_down();
            info!(identity = %self.settings.identity, "the Lease is someone else's now; stopped leading");
            return Ok(());
        }
        let started = Instant::now();
        if let Some(spec) = lease.spec.as_mut() {
            spec.renew_time = Some(Self::now());
        }
        match self.api.replace(&self.settings.lease_name, &PostParams::default(), &lease).await {
            Ok(written) => {
                observe(&self.seen, Some(written));
                self.fence.extend(started + (self.settings.duration - self.settings.grace));
                Ok(())
            }
            Err(KubeError::Api(s)) if s.code == 409 || s.code == 404 => self.refresh().await,
            Err(e) => Err(e),
        }
    }

    async fn refresh(&self) -> Result<(), KubeError> {
        let lease = self.api.get_opt(&self.settings.lease_name).await?;
        if lease.is_none() {
            let fresh = Lease {
                metadata: ObjectMeta { name: Some(self.settings.lease_name.clone()), ..Default::default() },
                spec: Some(LeaseSpec { lease_transitions: Some(0), ..Default::default() }),
            };
            match self.api.create(&PostParams::default(), &fresh).await {
                Ok(l) => observe(&self.seen, Some(l)),
                Err(KubeError::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e),
            }
            return Ok(());
        }
        observe(&self.seen, lease);
        Ok(())
    }

    /// Gives the Lease up, if this replica holds it.
    async fn release(&self) {
        self.fence.step_down();
        let lease = self.seen.lock().expect("lease lock").lease.clone();
        let Some(mut lease) = lease else { return };
        if lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(self.settings.identity.as_str()) {
            return;
        }
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.acquire_time = None;
            spec.renew_time = None;
        }
        match self.api.replace(&self.settings.lease_name, &PostParams::default(), &lease).await {
            Ok(_) => info!(identity = %self.settings.identity, "released the Lease"),
            Err(e) => warn!(error = %e, "could not release the Lease; it expires by itself"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(version: &str, holder: &str) -> Lease {
        Lease {
            metadata: ObjectMeta { resource_version: Some(version.into()), ..Default::default() },
            spec: Some(LeaseSpec { holder_identity: Some(holder.into()), ..Default::default() }),
        }
    }

    #[test]
    fn a_lease_event_older_than_the_lease_held_does_not_replace_it() {
        let seen = Mutex::new(Seen { lease: None, changed_at: Instant::now() });
        observe(&seen, Some(lease("120", "b")));
        // This replica's own write, then the watch's late event of the write before it.
        observe(&seen, Some(lease("125", "a")));
        observe(&seen, Some(lease("120", "b")));
        assert_eq!(seen.lock().unwrap().holder(), Some("a"), "the older event is ignored");
        observe(&seen, Some(lease("131", "c")));
        assert_eq!(seen.lock().unwrap().holder(), Some("c"), "a newer one is taken");
        // Versions that are not numbers are not compared: the event is taken.
        observe(&seen, Some(lease("x", "d")));
        assert_eq!(seen.lock().unwrap().holder(), Some("d"));
        assert!(!older(Some("9"), Some("10x")) && older(Some("9"), Some("10")) && !older(None, Some("10")));
    }
}
