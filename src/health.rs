//! Liveness and readiness: `/healthz` always answers while the process serves;
//! `/readyz` once policies, Namespaces and Pods are synced and the webhook serves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::Notify;

pub struct Readiness {
    policies: AtomicBool,
    namespaces: AtomicBool,
    pods: AtomicBool,
    changed: Notify,
    /// Watches failing now, with since when.
    failing: Mutex<HashMap<&'static str, Instant>>,
    /// How long a watch may fail before capo stops calling itself ready.
    failure_grace: Duration,
}

/// The default of `--watch-failure-grace`.
pub const WATCH_FAILURE_GRACE: Duration = Duration::from_secs(30);

impl Default for Readiness {
    fn default() -> Self {
        Self::new(WATCH_FAILURE_GRACE)
    }
}

impl Readiness {
    pub fn new(failure_grace: Duration) -> Self {
        Self {
            policies: AtomicBool::new(false),
            namespaces: AtomicBool::new(false),
            pods: AtomicBool::new(false),
            changed: Notify::new(),
            failing: Mutex::new(HashMap::new()),
            failure_grace,
        }
    }

    /// A watch (`pods`, `namespaces`, `policies`) failed; it counts against readiness once it
    /// has kept failing for the grace period.
    pub fn watch_failed(&self, watch: &'static str) {
        self.failing.lock().expect("readiness lock").entry(watch).or_insert_with(Instant::now);
    }

    /// A watch delivered an event again.
    pub fn watch_ok(&self, watch: &'static str) {
        let mut failing = self.failing.lock().expect("readiness lock");
        if !failing.is_empty() {
            failing.remove(watch);
        }
    }

    /// Watches that have failed for longer than the grace, with for how long.
    fn stale(&self) -> Vec<(&'static str, Duration)> {
        let failing = self.failing.lock().expect("readiness lock");
        let mut stale: Vec<_> =
            failing.iter().map(|(w, since)| (*w, since.elapsed())).filter(|(_, d)| *d >= self.failure_grace).collect();
        stale.sort();
        stale
    }

    pub fn set_policies_synced(&self) {
        self.set(&self.policies);
    }
    pub fn set_namespaces_synced(&self) {
        self.set(&self.namespaces);
    }
    pub fn set_pods_synced(&self) {
        self.set(&self.pods);
    }
    fn set(&self, flag: &AtomicBool) {
        if !flag.swap(true, Ordering::SeqCst) {
            self.changed.notify_waiters();
        }
    }

    /// Everything the admission decision reads is loaded, and no watch that keeps it
    /// current has been failing for longer than the grace.
    pub fn is_ready(&self) -> bool {
        self.synced() && self.stale().is_empty()
    }

    fn synced(&self) -> bool {
        [&self.policies, &self.namespaces, &self.pods].iter().all(|f| f.load(Ordering::SeqCst))
    }

    /// What is still missing, for `/readyz` and logs.
    pub fn missing(&self) -> Vec<String> {
        let mut missing: Vec<String> =
            [("policies", &self.policies), ("namespaces", &self.namespaces), ("pods", &self.pods)]
                .into_iter()
                .filter(|(_, f)| !f.load(Ordering::SeqCst))
                .map(|(n, _)| n.to_string())
                .collect();
        missing.extend(self.stale().into_iter().map(|(w, d)| format!("the {w} watch (failing for {}s)", d.as_secs())));
        missing
    }

    /// Waits until the first full sync.
    pub async fn wait(&self) {
        loop {
            let notified = self.changed.notified();
            if self.synced() {
                return;
            }
            notified.await;
        }
    }
}

/// `/healthz`, `/readyz` and (when given) `/metrics` on the probe port.
pub fn router(readiness: Arc<Readiness>, metrics: Option<Arc<crate::metrics::Metrics>>) -> Router {
    let mut router =
        Router::new().route("/healthz", get(|| async { "ok" })).route("/readyz", get(readyz)).with_state(readiness);
    if let Some(metrics) = metrics {
        router = router.merge(crate::metrics::router(metrics));
    }
    router
}

async fn readyz(State(r): State<Arc<Readiness>>) -> (StatusCode, String) {
    if r.is_ready() {
        (StatusCode::OK, "ok".into())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("waiting for: {}", r.missing().join(", ")))
    }
}
