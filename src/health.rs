//! Liveness and readiness: `/healthz` always answers while the process serves;
//! `/readyz` once policies, Namespaces and Pods are synced and the webhook serves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::Notify;

#[derive(Default)]
pub struct Readiness {
    policies: AtomicBool,
    namespaces: AtomicBool,
    pods: AtomicBool,
    changed: Notify,
}

impl Readiness {
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

    /// Everything the admission decision reads is loaded.
    pub fn is_ready(&self) -> bool {
        [&self.policies, &self.namespaces, &self.pods].iter().all(|f| f.load(Ordering::SeqCst))
    }

    /// What is still missing, for `/readyz` and logs.
    pub fn missing(&self) -> Vec<&'static str> {
        [("policies", &self.policies), ("namespaces", &self.namespaces), ("pods", &self.pods)]
            .into_iter()
            .filter(|(_, f)| !f.load(Ordering::SeqCst))
            .map(|(n, _)| n)
            .collect()
    }

    pub async fn wait(&self) {
        loop {
            let notified = self.changed.notified();
            if self.is_ready() {
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
