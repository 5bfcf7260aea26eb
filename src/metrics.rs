//! Prometheus metrics, per policy where it matters.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

pub struct Metrics {
    pub registry: Registry,
    /// The standard `process_*` metrics (CPU, resident memory, open files, start time),
    /// unprefixed as every Prometheus client names them.
    process: Registry,
    /// Admission reviews answered, by operation (delete, eviction) and outcome.
    pub admission_requests: IntCounterVec,
    /// Time to answer an admission review, by operation and outcome.
    pub admission_duration: HistogramVec,
    /// IPs written into a reservation, by policy and trigger.
    pub holds: IntCounterVec,
    /// Holds that could not be written, by policy, action taken (deny, allow) and reason
    /// (forbidden, calico_not_served, not_owned, timeout, ...).
    pub hold_failures: IntCounterVec,
    /// Requests capo decided not to hold, by reason.
    pub skipped: IntCounterVec,
    /// DELETE reviews whose Pod the cluster does not confirm (no such Pod, another uid,
    /// another name than the request's, unreadable): allowed without a hold, by reason.
    pub unconfirmed: IntCounterVec,
    /// Loaded policies by state (ready, invalid).
    pub policies: IntGaugeVec,
    /// CapoPolicy status patches this replica sent.
    pub policy_status_writes: prometheus::IntCounter,
    /// CapoPolicy watch events this replica handled (changes and deletions).
    pub policy_events: prometheus::IntCounter,
    /// Pod watch events the Pod store handled (changes and deletions, of every Pod).
    pub pod_events: prometheus::IntCounter,
    /// Hold writes that finished after their review was answered, by outcome (kept: the
    /// deletion was allowed; taken_back: it was denied; failed).
    pub late_hold_writes: IntCounterVec,
    /// Evictions whose Pod was not in the cache and had to be read from the API server.
    pub pod_cache_misses: IntCounterVec,
    /// Reviews whose Namespace was not in the cache yet and was read from the API server.
    pub namespace_cache_misses: IntCounterVec,
    /// Sticky IPs: recreated Pods reviewed by the sticky webhook, by policy and outcome
    /// (claimed, or why nothing was handed back).
    pub sticky_claims: IntCounterVec,
    /// The leader's release engine, repair and safety net.
    pub release: ReleaseMetrics,
    /// The webhook's certificates and TLS handshakes.
    pub tls: TlsMetrics,
    /// The webhook's connections: open, and closed by capo's limits.
    pub connections: ConnectionMetrics,
    /// What Calico's datastore looks like to capo (see [`crate::calico::follow`]).
    pub calico: crate::calico::FollowGauges,
}

/// The webhook's connections (see [`crate::server::ConnectionLimits`]).
#[derive(Clone)]
pub struct ConnectionMetrics {
    /// Connections open on the webhook port.
    pub open: prometheus::IntGauge,
    /// Connections capo closed on its own, by reason: `refused` (at the connection cap),
    /// `header_timeout` (no request within the header timeout), `idle` (no request for the
    /// idle timeout).
    pub closed: IntCounterVec,
    /// Requests refused for want of the bearer token, by reason (`no_token`, `wrong_token`).
    pub unauthenticated: IntCounterVec,
}

impl ConnectionMetrics {
    fn new(registry: &Registry) -> Self {
        let open = prometheus::IntGauge::new("webhook_connections_open", "Connections open on the webhook port.")
            .expect("static metric");
        registry.register(Box::new(open.clone())).expect("unique metric");
        let closed = IntCounterVec::new(
            Opts::new("webhook_connections_closed_total", "Webhook connections capo closed on its own, by reason."),
            &["reason"],
        )
        .expect("static metric");
        registry.register(Box::new(closed.clone())).expect("unique metric");
        let unauthenticated = IntCounterVec::new(
            Opts::new(
                "webhook_unauthenticated_total",
                "Webhook requests refused for want of the bearer token, by reason.",
            ),
            &["reason"],
        )
        .expect("static metric");
        registry.register(Box::new(unauthenticated.clone())).expect("unique metric");
        Self { open, closed, unauthenticated }
    }
}

/// The webhook's certificates: what is served, handshakes, rotations, the CA bundle.
#[derive(Clone)]
pub struct TlsMetrics {
    /// TLS handshakes on the webhook port, by result (ok, failed). Failures mean a client
    /// (normally the API server) does not trust the served certificate, or a probe that
    /// does not speak TLS.
    pub handshakes: IntCounterVec,
    /// When the served certificate expires (seconds since the epoch).
    pub certificate_expiry: prometheus::IntGauge,
    /// When the CA of self-managed certificates expires (seconds since the epoch).
    pub ca_expiry: prometheus::IntGauge,
    /// Writes of the self-managed certificate Secret, by action (created,
    /// certificate_renewed, ca_staged, ca_promoted, ...).
    pub certificate_writes: IntCounterVec,
    /// Self-managed certificates that could not be written or used, by reason.
    pub certificate_errors: IntCounterVec,
    /// caBundle writes into the webhook configuration, by result.
    pub ca_injections: IntCounterVec,
}

impl TlsMetrics {
    fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = prometheus::IntGauge::new(name, help).expect("static metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        Self {
            handshakes: counter(
                "webhook_tls_handshakes_total",
                "TLS handshakes on the webhook port, by result.",
                &["result"],
            ),
            certificate_expiry: gauge(
                "webhook_certificate_expiry_timestamp_seconds",
                "When the served certificate expires.",
            ),
            ca_expiry: gauge(
                "webhook_ca_expiry_timestamp_seconds",
                "When the CA of self-managed certificates expires.",
            ),
            certificate_writes: counter(
                "certificate_writes_total",
                "Writes of the self-managed certificate Secret, by action.",
                &["action"],
            ),
            certificate_errors: counter(
                "certificate_errors_total",
                "Self-managed certificates that could not be written or used, by reason.",
                &["reason"],
            ),
            ca_injections: counter(
                "ca_bundle_injections_total",
                "caBundle writes into the webhook configuration, by result.",
                &["result"],
            ),
        }
    }
}

/// What the leader does with held IPs.
pub struct ReleaseMetrics {
    /// IPs held now, by policy (records; set by the leader).
    pub held: IntGaugeVec,
    /// Holds whose Pod is gone and whose countdown runs, by policy (set by the leader).
    pub countdowns: IntGaugeVec,
    /// The policy's `maxReserved`.
    pub max_reserved: IntGaugeVec,
    /// Age of the oldest hold, by policy (computed at each scrape from `oldest`).
    pub oldest_age: prometheus::GaugeVec,
    oldest: std::sync::Mutex<std::collections::HashMap<String, k8s_openapi::jiff::Timestamp>>,
    /// Valid CIDRs capo did not write, found in a policy's reservations (left in place).
    pub foreign_entries: IntGaugeVec,
    /// Failed leader writes that are retried with backoff, by policy.
    pub retries: IntCounterVec,
    /// Reconciles by kind of key (record, policy, release, shard, pod).
    pub reconciles: IntCounterVec,
    /// Keys waiting in the leader's work queue.
    pub queue_depth: prometheus::IntGauge,
    /// Pods leaving without a hold that the safety net did not hold, by reason.
    pub safety_net_skipped: IntCounterVec,
    /// Releases by policy and reason (ttl, cap, manual, pod-kept, workload-gone, repair).
    pub releases: IntCounterVec,
    /// From a hold's due time to its entry leaving the reservation.
    pub lateness: HistogramVec,
    /// Release or repair writes that failed, by policy and reason.
    pub failures: IntCounterVec,
    /// Records the leader leaves alone because they are not what capo writes (counted once
    /// per record), by reason (ip, name, cidr, reservation, group).
    pub ignored_records: IntCounterVec,
    /// Repairs by action (adopted, written_back, garbage_removed, redundant_removed).
    pub repairs: IntCounterVec,
    /// 1 while this replica holds the Lease.
    pub leader: prometheus::IntGauge,
    /// Holds written by the safety net, by policy.
    pub safety_net_holds: IntCounterVec,
    /// Pods the safety net saw too late: their IP was already another Pod's.
    pub safety_net_lost_races: IntCounterVec,
    /// Claims that ended before a Pod came up with the handed-back addresses (taken back
    /// from the Pod, if there is one), by policy and reason (not_shown, bound_reached,
    /// released, workload_gone).
    pub sticky_fallbacks: IntCounterVec,
    /// Times read back later than the leader's clock plus the skew allowance, taken as
    /// now, by field (countdownStart, status.podGoneAt, spec.reservedAt, ...).
    pub clock_ahead: IntCounterVec,
    /// Pods the safety net remembers having dealt with (at most the Pods that exist).
    pub safety_net_remembered: prometheus::IntGauge,
    /// Kinds of Pod owners the leader watches, by state (watched, starting, unavailable:
    /// not served, or capo may not list them — their owners count as present).
    pub owner_kinds: IntGaugeVec,
    /// Per Calico IP pool (set by the leader's pool guard).
    pub pools: PoolMetrics,
}

/// What the pool guard sees of each Calico IP pool.
pub struct PoolMetrics {
    /// Addresses in the pool's CIDR.
    pub addresses: prometheus::GaugeVec,
    /// Addresses a new Pod could get now: neither allocated by Calico's IPAM nor held by capo.
    pub free: prometheus::GaugeVec,
    /// Addresses of the pool capo holds (their Pods gone, so IPAM has them unallocated).
    pub held: prometheus::GaugeVec,
    /// capo's holds as a share (0–1) of the pool's unallocated addresses.
    pub held_ratio: prometheus::GaugeVec,
}

impl PoolMetrics {
    fn new(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            let g = prometheus::GaugeVec::new(Opts::new(name, help), &["pool"]).expect("static metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        Self {
            addresses: gauge("pool_addresses", "Addresses in the Calico IP pool's CIDR."),
            free: gauge(
                "pool_free_addresses",
                "Addresses of the pool a new Pod could get: not allocated by Calico's IPAM, not held by capo.",
            ),
            held: gauge("pool_held_ips", "Addresses of the pool capo holds."),
            held_ratio: gauge(
                "pool_held_ratio",
                "capo's holds as a share (0-1) of the pool's addresses Calico's IPAM has not allocated.",
            ),
        }
    }

    pub fn set(&self, pool: &str, addresses: u128, free: u128, held: usize) {
        self.addresses.with_label_values(&[pool]).set(addresses as f64);
        self.free.with_label_values(&[pool]).set(free as f64);
        self.held.with_label_values(&[pool]).set(held as f64);
        let unused = free + held as u128;
        let ratio = if unused == 0 { 0.0 } else { held as f64 / unused as f64 };
        self.held_ratio.with_label_values(&[pool]).set(ratio);
    }

    pub fn forget(&self, pool: &str) {
        for g in [&self.addresses, &self.free, &self.held, &self.held_ratio] {
            let _ = g.remove_label_values(&[pool]);
        }
    }
}

impl ReleaseMetrics {
    fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["policy"]).expect("static metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let oldest_age = prometheus::GaugeVec::new(
            Opts::new("oldest_hold_age_seconds", "Age of the oldest hold, by policy."),
            &["policy"],
        )
        .expect("static metric");
        registry.register(Box::new(oldest_age.clone())).expect("unique metric");
        let lateness = HistogramVec::new(
            HistogramOpts::new(
                "release_lateness_seconds",
                "From a hold's due time to its entry leaving the reservation.",
            )
            .buckets(vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0]),
            &["policy"],
        )
        .expect("static metric");
        registry.register(Box::new(lateness.clone())).expect("unique metric");
        let leader =
            prometheus::IntGauge::new("leader", "1 while this replica holds the Lease.").expect("static metric");
        registry.register(Box::new(leader.clone())).expect("unique metric");
        let queue_depth = prometheus::IntGauge::new(
            "release_queue_depth",
            "Keys due now in the leader's work queue (holds waiting for their due time are not counted).",
        )
        .expect("static metric");
        registry.register(Box::new(queue_depth.clone())).expect("unique metric");
        let safety_net_remembered = prometheus::IntGauge::new(
            "safety_net_remembered_pods",
            "Leaving Pods the safety net has dealt with and remembers until they are gone.",
        )
        .expect("static metric");
        registry.register(Box::new(safety_net_remembered.clone())).expect("unique metric");
        let owner_kinds = IntGaugeVec::new(
            Opts::new(
                "owner_kinds",
                "Kinds of Pod owners the leader watches, by state (watched, starting, unavailable).",
            ),
            &["state"],
        )
        .expect("static metric");
        registry.register(Box::new(owner_kinds.clone())).expect("unique metric");
        Self {
            owner_kinds,
            held: gauge("held_ips", "IPs held now, by policy (set by the leader)."),
            countdowns: gauge(
                "countdowns_running",
                "Holds whose Pod is gone and whose countdown runs, by policy (set by the leader).",
            ),
            max_reserved: gauge("max_reserved", "The policy's maxReserved."),
            oldest_age,
            oldest: Default::default(),
            foreign_entries: gauge(
                "foreign_entries",
                "Valid CIDRs capo did not write, in a policy's reservations (left in place).",
            ),
            retries: counter("release_retries_total", "Failed leader writes retried with backoff.", &["policy"]),
            reconciles: counter("reconciles_total", "Leader reconciles by kind of key.", &["kind"]),
            queue_depth,
            safety_net_skipped: counter(
                "safety_net_skipped_total",
                "Pods leaving without a hold that the safety net did not hold, by reason.",
                &["reason"],
            ),
            releases: counter("releases_total", "Held IPs released, by policy and reason.", &["policy", "reason"]),
            lateness,
            ignored_records: counter(
                "records_ignored_total",
                "ReservedIPs the leader leaves alone because they are not what capo writes, by reason.",
                &["reason"],
            ),
            failures: counter(
                "release_failures_total",
                "Release or repair writes that failed, by policy and reason.",
                &["policy", "reason"],
            ),
            repairs: counter("repairs_total", "Repairs of reservations and records, by action.", &["action"]),
            leader,
            safety_net_holds: counter("safety_net_holds_total", "Holds written by the safety net.", &["policy"]),
            sticky_fallbacks: counter(
                "sticky_fallbacks_total",
                "Claims that ended before a Pod came up with the handed-back addresses (taken back from the Pod, if there is one), by reason.",
                &["policy", "reason"],
            ),
            clock_ahead: counter(
                "clock_ahead_total",
                "Times read back later than the leader's clock plus the skew allowance (taken as now), by field.",
                &["field"],
            ),
            safety_net_lost_races: counter(
                "safety_net_lost_races_total",
                "Pods the safety net saw after their IP was already another Pod's.",
                &["policy"],
            ),
            safety_net_remembered,
            pools: PoolMetrics::new(registry),
        }
    }
}

impl ReleaseMetrics {
    /// A policy's gauges: holds, cap, the oldest hold's reservedAt.
    pub fn set_policy(
        &self,
        policy: &str,
        held: usize,
        max_reserved: Option<u32>,
        oldest: Option<k8s_openapi::jiff::Timestamp>,
    ) {
        self.held.with_label_values(&[policy]).set(held as i64);
        if let Some(max) = max_reserved {
            self.max_reserved.with_label_values(&[policy]).set(i64::from(max));
        } else {
            let _ = self.max_reserved.remove_label_values(&[policy]);
        }
        let mut o = self.oldest.lock().expect("oldest lock");
        match oldest {
            Some(t) => {
                o.insert(policy.to_string(), t);
            }
            None => {
                o.remove(policy);
                self.oldest_age.with_label_values(&[policy]).set(0.0);
            }
        }
    }

    /// A policy with no holds and no object any more: its series go.
    pub fn forget_policy(&self, policy: &str) {
        let _ = self.held.remove_label_values(&[policy]);
        let _ = self.max_reserved.remove_label_values(&[policy]);
        let _ = self.oldest_age.remove_label_values(&[policy]);
        let _ = self.foreign_entries.remove_label_values(&[policy]);
        self.oldest.lock().expect("oldest lock").remove(policy);
    }

    fn refresh_ages(&self) {
        let now = k8s_openapi::jiff::Timestamp::now();
        for (policy, t) in self.oldest.lock().expect("oldest lock").iter() {
            let age = now.duration_since(*t).as_secs_f64().max(0.0);
            self.oldest_age.with_label_values(&[policy]).set(age);
        }
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("capo".into()), None).expect("static prefix");
        let process = Registry::new();
        process.register(Box::new(prometheus::process_collector::ProcessCollector::for_self())).expect("unique metric");
        let build_info =
            IntGaugeVec::new(Opts::new("build_info", "1, labelled with the version of capo that runs."), &["version"])
                .expect("static metric");
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        registry.register(Box::new(build_info)).expect("unique metric");
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let admission_requests = counter(
            "admission_requests_total",
            "Admission reviews answered, by operation and outcome.",
            &["operation", "outcome"],
        );
        let holds = counter("holds_total", "IPs written into a capo-owned reservation.", &["policy", "trigger"]);
        let hold_failures =
            counter("hold_failures_total", "Holds that could not be written.", &["policy", "action", "reason"]);
        let skipped = counter("admission_skipped_total", "Deletions capo did not hold, by reason.", &["reason"]);
        let unconfirmed = counter(
            "admission_unconfirmed_total",
            "DELETE reviews whose Pod the cluster does not confirm, allowed without a hold, by reason.",
            &["reason"],
        );
        let late_hold_writes = counter(
            "late_hold_writes_total",
            "Hold writes that finished after their review was answered, by outcome.",
            &["outcome"],
        );
        let pod_cache_misses =
            counter("pod_cache_misses_total", "Evictions whose Pod had to be read from the API server.", &["result"]);
        let namespace_cache_misses = counter(
            "namespace_cache_misses_total",
            "Reviews whose Namespace had to be read from the API server.",
            &["result"],
        );
        let sticky_claims = counter(
            "sticky_claims_total",
            "Recreated Pods the sticky webhook reviewed, by policy and outcome (claimed, or why nothing was handed back).",
            &["policy", "outcome"],
        );
        let admission_duration = HistogramVec::new(
            HistogramOpts::new("admission_duration_seconds", "Time to answer an admission review.")
                .buckets(vec![0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            &["operation", "outcome"],
        )
        .expect("static metric");
        registry.register(Box::new(admission_duration.clone())).expect("unique metric");
        let policies = IntGaugeVec::new(Opts::new("policies", "Loaded CapoPolicies by state."), &["state"])
            .expect("static metric");
        registry.register(Box::new(policies.clone())).expect("unique metric");
        let policy_status_writes =
            prometheus::IntCounter::new("policy_status_writes_total", "CapoPolicy status patches sent.")
                .expect("static metric");
        registry.register(Box::new(policy_status_writes.clone())).expect("unique metric");
        let policy_events = prometheus::IntCounter::new("policy_events_total", "CapoPolicy watch events handled.")
            .expect("static metric");
        registry.register(Box::new(policy_events.clone())).expect("unique metric");
        let pod_events =
            prometheus::IntCounter::new("pod_events_total", "Pod watch events handled.").expect("static metric");
        registry.register(Box::new(pod_events.clone())).expect("unique metric");
        let release = ReleaseMetrics::new(&registry);
        let tls = TlsMetrics::new(&registry);
        let connections = ConnectionMetrics::new(&registry);
        let gauge = |name: &str, help: &str| {
            let g = prometheus::IntGauge::new(name, help).expect("static metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let calico = crate::calico::FollowGauges {
            locked: gauge(
                "calico_datastore_locked",
                "1 while a Calico datastore migration holds Calico's datastore locked.",
            ),
            moved: gauge(
                "calico_api_moved",
                "1 while Calico's components read another API group than the one capo writes holds to (restart capo).",
            ),
        };
        Self {
            process,
            calico,
            release,
            tls,
            connections,
            registry,
            admission_requests,
            admission_duration,
            holds,
            hold_failures,
            skipped,
            unconfirmed,
            late_hold_writes,
            policies,
            policy_status_writes,
            policy_events,
            pod_events,
            pod_cache_misses,
            namespace_cache_misses,
            sticky_claims,
        }
    }

    pub fn render(&self) -> String {
        self.release.refresh_ages();
        let mut buf = Vec::new();
        let mut families = self.registry.gather();
        families.extend(self.process.gather());
        TextEncoder::new().encode(&families, &mut buf).expect("text encoding");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new().route("/metrics", get(serve)).with_state(metrics)
}

async fn serve(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], m.render())
}
