//! The review endpoint: parse, decide, hold if the Pod is selected, answer.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use capo_api::{HoldFailureAction, HoldTrigger};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::core::admission::AdmissionResponse;
use tracing::{debug, info, warn};

use super::deadline::budget;
use super::intake::{Intake, ReviewLimits};
use super::respond::{allow, deny};
use super::review::{self, ClaimedPod, ReviewRequest};
use crate::calico::pools::PoolStore;
use crate::calico::shards;
use crate::health::Readiness;
use crate::hold::rule::{self, Origin};
use crate::hold::{HoldError, HoldRequest, HoldWriter, RecordOutcome};
use crate::metrics::Metrics;
use crate::pod::PodFacts;
use crate::policy::{Decision, HoldPlan, SharedMatcher};
use crate::store::{NamespaceFacts, NamespaceStore, PodStore};

#[derive(Clone, Debug)]
pub struct AdmissionSettings {
    /// Namespaces capo never holds in (kube-system, its own).
    pub excluded_namespaces: Vec<String>,
    /// The most time spent on one review, whatever the API server allows.
    pub max_review_time: Duration,
    /// The bytes of reviews in flight, and load shedding past them.
    pub limits: ReviewLimits,
}

/// The address a review came from (the webhook server puts it on each request).
#[derive(Clone, Copy, Debug)]
pub struct Caller(pub SocketAddr);

/// Why a DELETE review's Pod is not the cluster's.
#[derive(Debug, thiserror::Error)]
enum Unconfirmed {
    #[error("its oldObject names another Pod than the request")]
    OtherPod,
    #[error("its oldObject has no uid")]
    NoUid,
    #[error("no such Pod")]
    NoSuchPod,
    #[error("the Pod of that name has another uid")]
    OtherUid,
    #[error("the Pod could not be read: {0}")]
    Unreadable(String),
}

impl Unconfirmed {
    fn reason(&self) -> &'static str {
        match self {
            Self::OtherPod => "other_pod",
            Self::NoUid => "no_uid",
            Self::NoSuchPod => "no_such_pod",
            Self::OtherUid => "other_uid",
            Self::Unreadable(_) => "unreadable",
        }
    }
}

/// Remembers what was logged, so a caller repeating a review is logged once (bounded: past
/// [`LOGGED_AT_MOST`] keys it starts over).
#[derive(Default)]
struct LoggedOnce(std::sync::Mutex<std::collections::HashSet<(Option<std::net::IpAddr>, String, String)>>);

const LOGGED_AT_MOST: usize = 4096;

impl LoggedOnce {
    fn first(&self, key: (Option<std::net::IpAddr>, String, String)) -> bool {
        let mut seen = self.0.lock().expect("logged lock");
        if seen.len() >= LOGGED_AT_MOST {
            seen.clear();
        }
        seen.insert(key)
    }
}

pub struct Admission {
    pub matcher: SharedMatcher,
    pub pods: Arc<PodStore>,
    pub namespaces: Arc<NamespaceStore>,
    pub store: HoldWriter,
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub readiness: Arc<Readiness>,
    pub settings: AdmissionSettings,
    /// Calico's IP pools: an address outside all of them is never held.
    pub(super) pools: Option<Arc<PoolStore>>,
    logged: LoggedOnce,
    intake: Intake,
}

impl Admission {
    /// The admission path over capo's stores.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        matcher: SharedMatcher,
        pods: Arc<PodStore>,
        namespaces: Arc<NamespaceStore>,
        store: HoldWriter,
        client: Client,
        metrics: Arc<Metrics>,
        readiness: Arc<Readiness>,
        settings: AdmissionSettings,
    ) -> Self {
        Self {
            matcher,
            pods,
            namespaces,
            store,
            client,
            metrics,
            readiness,
            intake: Intake::new(&settings.limits),
            settings,
            pools: None,
            logged: Default::default(),
        }
    }

    /// Holds only addresses inside one of Calico's IP pools, as `pools` shows them.
    pub fn with_pools(mut self, pools: Arc<PoolStore>) -> Self {
        self.pools = Some(pools);
        self
    }

    /// Drops the addresses outside every Calico IP pool (another IPAM's, or a status no
    /// CNI wrote): a reservation cannot keep them from anyone, and writing them would let
    /// whoever sets a Pod's status fill capo's reservations. Counted and logged once.
    fn within_pools(&self, mut pod: PodFacts, caller: Option<SocketAddr>) -> PodFacts {
        let Some(pools) = &self.pools else { return pod };
        let outside: Vec<IpAddr> =
            pod.ips.iter().copied().filter(|ip| pools.outside_every_pool(*ip) == Some(true)).collect();
        if outside.is_empty() {
            return pod;
        }
        pod.ips.retain(|ip| !outside.contains(ip));
        self.metrics.unconfirmed.with_label_values(&["outside_pools"]).inc_by(outside.len() as u64);
        let key = (caller.map(|c| c.ip()), pod.namespace.clone(), pod.name.clone());
        if self.logged.first(key) {
            let list = outside.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
            warn!(
                namespace = %pod.namespace, pod = %pod.name, ips = %list,
                "addresses outside every Calico IP pool are not held"
            );
        }
        pod
    }

    /// The admission path on its own: empty stores, an empty watched copy of the
    /// reservations, holds written in `group`, ready at once (tests and benchmarks fill the
    /// stores by hand; capo itself is wired by [`crate::App`]).
    pub fn standalone(
        client: Client,
        matcher: SharedMatcher,
        group: capo_api::CalicoApiGroup,
        settings: AdmissionSettings,
    ) -> Self {
        let readiness = Arc::new(Readiness::default());
        readiness.set_policies_synced();
        readiness.set_namespaces_synced();
        readiness.set_pods_synced();
        let index = Arc::new(crate::calico::ReservationIndex::default());
        let reservations = crate::calico::Reservations::new(client.clone(), group, index);
        Self::new(
            matcher,
            Default::default(),
            Default::default(),
            HoldWriter::new(client.clone(), reservations),
            client,
            Default::default(),
            readiness,
            settings,
        )
    }
}

/// Where the API server sends its reviews of Pod deletions and evictions.
pub const REVIEW_PATH: &str = "/review-pod-deletion";

pub fn router(admission: Arc<Admission>) -> Router {
    Router::new().route(REVIEW_PATH, post(serve)).route(super::STICKY_PATH, post(serve)).with_state(admission)
}

/// Which review an endpoint answers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Endpoint {
    /// Pod DELETE and `pods/eviction` CREATE (validating).
    Deletion,
    /// Pod CREATE (mutating, sticky IPs).
    Sticky,
}

/// What is being reviewed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PodOperation {
    Delete,
    Eviction,
}

impl PodOperation {
    fn as_str(self) -> &'static str {
        match self {
            PodOperation::Delete => "delete",
            PodOperation::Eviction => "eviction",
        }
    }
    fn trigger(self) -> HoldTrigger {
        match self {
            PodOperation::Delete => HoldTrigger::Delete,
            PodOperation::Eviction => HoldTrigger::Eviction,
        }
    }
    /// The code of a denial: eviction clients (`kubectl drain`) retry on 429.
    fn deny_code(self) -> u16 {
        match self {
            PodOperation::Delete => 503,
            PodOperation::Eviction => 429,
        }
    }
}

fn bad_request(message: String) -> Response {
    (StatusCode::BAD_REQUEST, message).into_response()
}

/// The largest AdmissionReview capo reads: a Pod and its old version are each at most
/// about 1.5 MiB (etcd's object limit).
pub(super) const MAX_REVIEW_BYTES: usize = 4 << 20;
/// Past the limit the rest of the body is still read (and dropped), up to this much, so
/// the client gets the 413 and its reason instead of a reset connection.
const MAX_DRAIN_BYTES: usize = 64 << 20;

/// Reads the request body (`length`: as announced), or answers 413 when it is larger than
/// any AdmissionReview.
async fn read_review(body: Body, length: Option<usize>) -> Result<Bytes, Response> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::with_capacity(length.unwrap_or(0).min(MAX_REVIEW_BYTES));
    let mut total = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad_request(format!("reading the AdmissionReview: {e}")))?;
        total += chunk.len();
        if total <= MAX_REVIEW_BYTES {
            buf.extend_from_slice(&chunk);
        } else if total > MAX_DRAIN_BYTES {
            break;
        }
    }
    if total > MAX_REVIEW_BYTES {
        let message =
            format!("request body of {total} bytes or more: an AdmissionReview is at most {MAX_REVIEW_BYTES} bytes");
        return Err((StatusCode::PAYLOAD_TOO_LARGE, message).into_response());
    }
    Ok(Bytes::from(buf))
}

async fn serve(
    State(adm): State<Arc<Admission>>,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let endpoint = if uri.path() == super::STICKY_PATH { Endpoint::Sticky } else { Endpoint::Deletion };
    let started = Instant::now();
    let deadline = started + budget(query.get("timeout").map(String::as_str), adm.settings.max_review_time);
    let length =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    // A body announced larger than any review is drained unbuffered for its 413; every
    // other takes its room first, or is shed at once.
    let _room = match length {
        Some(n) if n > MAX_REVIEW_BYTES => None,
        _ => match adm.intake.admit(length) {
            Ok(room) => Some(room),
            Err(busy) => {
                adm.metrics.admission_requests.with_label_values(&["unknown", "shed"]).inc();
                debug!(lane = busy.lane, in_flight_kib = busy.in_flight, "review shed");
                return (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, "1")], busy.to_string()).into_response();
            }
        },
    };
    let body = match tokio::time::timeout_at(deadline.into(), read_review(body, length)).await {
        Ok(Ok(b)) => b,
        Ok(Err(too_large)) => {
            adm.metrics.admission_requests.with_label_values(&["unknown", "too_large"]).inc();
            return too_large;
        }
        Err(_) => {
            adm.metrics.admission_requests.with_label_values(&["unknown", "body_timeout"]).inc();
            let message = format!("the AdmissionReview's body did not arrive within {:?}", deadline - started);
            return (StatusCode::REQUEST_TIMEOUT, message).into_response();
        }
    };
    let request = match review::parse(&body) {
        Ok(r) => r,
        Err(e) => {
            adm.metrics.admission_requests.with_label_values(&["unknown", "malformed"]).inc();
            return bad_request(e.to_string());
        }
    };
    if !adm.readiness.is_ready() {
        // Not an answer capo can give yet: the API server applies the webhook's
        // failurePolicy, exactly as when capo is unreachable.
        adm.metrics.admission_requests.with_label_values(&["unknown", "not_ready"]).inc();
        let missing = adm.readiness.missing().join(", ");
        return (StatusCode::SERVICE_UNAVAILABLE, format!("capo is starting: waiting for {missing}")).into_response();
    }
    let caller = caller.map(|Extension(Caller(addr))| addr);
    let answered = match endpoint {
        Endpoint::Deletion => adm
            .review(&request, deadline, caller)
            .await
            .map(|(kind, o, r)| (kind.map_or("other", PodOperation::as_str), o, r)),
        Endpoint::Sticky => adm.sticky(&request, response_to(&request), deadline).await.map(|(o, r)| ("create", o, r)),
    };
    let (op, outcome, response) = match answered {
        Ok(r) => r,
        Err(message) => {
            adm.metrics.admission_requests.with_label_values(&["unknown", "malformed"]).inc();
            return bad_request(message);
        }
    };
    adm.metrics.admission_requests.with_label_values(&[op, outcome]).inc();
    adm.metrics.admission_duration.with_label_values(&[op, outcome]).observe(started.elapsed().as_secs_f64());
    axum::Json(response.into_review()).into_response()
}

/// An answer to `req`: allowed, no warnings, until said otherwise.
fn response_to(req: &ReviewRequest<'_>) -> AdmissionResponse {
    let mut resp = AdmissionResponse::invalid("");
    resp.types = kube::core::TypeMeta { api_version: review::API_VERSION.into(), kind: review::KIND.into() };
    resp.uid = req.uid.clone();
    resp.result = Default::default();
    allow(resp, vec![])
}

impl Admission {
    /// `Err` only for a request that is not a well-formed review of what capo handles.
    async fn review(
        &self,
        req: &ReviewRequest<'_>,
        deadline: Instant,
        caller: Option<SocketAddr>,
    ) -> Result<(Option<PodOperation>, &'static str, AdmissionResponse), String> {
        let resp = response_to(req);
        let kind = match (req.operation.as_str(), req.sub_resource.as_deref(), req.resource.as_str()) {
            ("DELETE", None, "pods") => PodOperation::Delete,
            ("CREATE", Some("eviction"), "pods") => PodOperation::Eviction,
            // Not something capo registers for; never stand in the way.
            _ => return Ok((None, "ignored", allow(resp, vec![]))),
        };
        let namespace = req.namespace.clone().unwrap_or_default();
        if self.settings.excluded_namespaces.contains(&namespace) {
            // Decided before the Pod is even read (the rule says the same).
            return Ok((Some(kind), "excluded", allow(resp, vec![])));
        }
        let pod = match kind {
            PodOperation::Delete => {
                let old = req.old_object.ok_or("a Pod DELETE review without oldObject")?;
                let claimed = ClaimedPod::parse(old).map_err(|e| format!("oldObject: not a Pod object: {e}"))?;
                match self.confirm(&namespace, &req.name, &claimed, deadline).await {
                    Ok(pod) => pod,
                    Err(why) => {
                        self.unconfirmed(why, &claimed, caller);
                        return Ok((Some(kind), "unconfirmed", allow(resp, vec![])));
                    }
                }
            }
            PodOperation::Eviction => match self.evicted_pod(&namespace, &req.name, deadline).await {
                Ok(Some(p)) => p,
                Ok(None) => return Ok((Some(kind), "no_pod", allow(resp, vec![]))),
                Err(e) => {
                    // Without the Pod there is nothing to decide on; the safety net
                    // catches it if it was selected.
                    warn!(namespace, pod = %req.name, error = %e, "could not read the evicted Pod");
                    let msg = format!("capo: could not read Pod {namespace}/{}: {e}", req.name);
                    return Ok((Some(kind), "pod_unreadable", allow(resp, vec![msg])));
                }
            },
        };
        let ns = match self.namespace(&namespace, deadline).await {
            Ok(Some(ns)) => ns,
            Ok(None) => return Ok((Some(kind), "no_namespace", allow(resp, vec![]))),
            Err(e) => {
                // Without the namespace's labels there is nothing to decide on; the
                // safety net catches the Pod if it was selected.
                warn!(namespace, pod = %pod.name, error = %e, "could not read the Pod's namespace");
                let msg = format!("capo: could not read Namespace {namespace}: {e}");
                return Ok((Some(kind), "namespace_unreadable", allow(resp, vec![msg])));
            }
        };
        let origin = Origin::Request { user: req.username.as_deref() };
        let dry_run = req.dry_run || (kind == PodOperation::Eviction && req.eviction_dry_run);
        let matcher = self.matcher.load();
        let plan = match rule::decide(&matcher, &pod, &ns, origin, &self.settings.excluded_namespaces) {
            Decision::Skip(reason) => {
                self.metrics.skipped.with_label_values(&[reason.as_str()]).inc();
                debug!(namespace, pod = %pod.name, reason = reason.as_str(), "not holding");
                // A dry run asks what would happen: say why not, where a policy comes near.
                let warnings = if dry_run {
                    matcher
                        .why_not(&reason, &pod, &ns.labels)
                        .into_iter()
                        .map(|w| format!("capo: dry run; not held: {w}"))
                        .collect()
                } else {
                    vec![]
                };
                return Ok((Some(kind), "skipped", allow(resp, warnings)));
            }
            Decision::Hold(plan) => plan,
        };
        // Only for a Pod about to be held: an unselected or host-network Pod's addresses
        // are nobody's concern here (a drain evicts those too).
        let had_ips = !pod.ips.is_empty();
        let pod = self.within_pools(pod, caller);
        if had_ips && pod.ips.is_empty() {
            let msg = format!("capo: {}/{}: no address in a Calico IP pool; nothing held", namespace, pod.name);
            return Ok((Some(kind), "outside_pools", allow(resp, vec![msg])));
        }
        if dry_run {
            let mut warnings = plan.warnings.clone();
            let count = shards::count(plan.policy.max_reserved);
            let mut to: Vec<String> = pod
                .ips
                .iter()
                .map(|ip| {
                    self.store.reservations().foresee(&plan.policy.name, count, &crate::calico::entry::canonical(*ip))
                })
                .collect();
            to.dedup();
            warnings.push(format!("capo: dry run; would hold {} in {}", ips(&pod), to.join(", ")));
            return Ok((Some(kind), "dry_run", allow(resp, warnings)));
        }
        // Grace 0 matters only for a Pod placed on a node: the API server deletes a Pod no
        // node ever ran at once, with grace 0, and no container of it can hold the address.
        let forced = req.forced && pod.node.is_some();
        Ok(self.hold(kind, &pod, plan, resp, deadline, forced).await)
    }

    /// The Pod a DELETE review names, as the cluster has it: the body is a claim. Confirmed
    /// when the Pod in the store (or, when the store lags, one read inside the review's
    /// budget) has the request's namespace, name and the body's uid; its facts (labels,
    /// addresses) are the cluster's, not the body's.
    async fn confirm(
        &self,
        namespace: &str,
        name: &str,
        claimed: &ClaimedPod,
        deadline: Instant,
    ) -> Result<PodFacts, Unconfirmed> {
        // A DeleteCollection (the namespace controller's) is reviewed Pod by Pod with no
        // name in the request: the oldObject names it, and the store must confirm it.
        if claimed.namespace != namespace || claimed.name.is_empty() || (!name.is_empty() && claimed.name != name) {
            return Err(Unconfirmed::OtherPod);
        }
        let name = claimed.name.as_str();
        if claimed.uid.is_empty() {
            return Err(Unconfirmed::NoUid);
        }
        if let Some(p) = self.pods.get(namespace, name)
            && p.uid == claimed.uid
        {
            return Ok((*p).clone());
        }
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let got = within(deadline, api.get_opt(name)).await;
        let result = if got.is_ok() { "read" } else { "error" };
        self.metrics.pod_cache_misses.with_label_values(&[result]).inc();
        match got {
            Ok(Some(pod)) => {
                let facts = PodFacts::from_pod(&pod);
                if facts.uid == claimed.uid { Ok(facts) } else { Err(Unconfirmed::OtherUid) }
            }
            Ok(None) => Err(Unconfirmed::NoSuchPod),
            Err(e) => Err(Unconfirmed::Unreadable(e)),
        }
    }

    /// Counts a review the cluster did not confirm, and logs it once per caller and Pod.
    fn unconfirmed(&self, why: Unconfirmed, claimed: &ClaimedPod, caller: Option<SocketAddr>) {
        self.metrics.unconfirmed.with_label_values(&[why.reason()]).inc();
        let key = (caller.map(|c| c.ip()), claimed.namespace.clone(), claimed.name.clone());
        if self.logged.first(key) {
            let caller = caller.map_or_else(|| "unknown".to_string(), |c| c.to_string());
            warn!(
                %caller, namespace = %claimed.namespace, pod = %claimed.name, uid = %claimed.uid, ips = %list(&claimed.ips),
                reason = why.reason(), detail = %why,
                "a DELETE review names a Pod the cluster does not confirm: allowed, nothing held"
            );
        }
    }

    async fn evicted_pod(&self, namespace: &str, name: &str, deadline: Instant) -> Result<Option<PodFacts>, String> {
        if let Some(p) = self.pods.get(namespace, name) {
            return Ok(Some((*p).clone()));
        }
        // Not cached: no IP yet when last seen, or created a moment ago. Read it, inside
        // the review's budget (the client's own read timeout is minutes).
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let got = within(deadline, api.get_opt(name)).await;
        let result = if got.is_ok() { "read" } else { "error" };
        self.metrics.pod_cache_misses.with_label_values(&[result]).inc();
        Ok(got?.map(|p| PodFacts::from_pod(&p)))
    }

    /// The Namespace from the cache, or, for one the watch has not delivered yet (created
    /// a moment ago), from the API server inside the review's budget. Never a guess: a
    /// namespace's labels decide whether its Pods are selected.
    async fn namespace(&self, name: &str, deadline: Instant) -> Result<Option<Arc<NamespaceFacts>>, String> {
        if let Some(ns) = self.namespaces.get(name) {
            return Ok(Some(ns));
        }
        let api = Api::<PartialObjectMeta<Namespace>>::all(self.client.clone());
        let got = within(deadline, api.get_metadata_opt(name)).await;
        let result = if got.is_ok() { "read" } else { "error" };
        self.metrics.namespace_cache_misses.with_label_values(&[result]).inc();
        Ok(got?.map(|ns| {
            Arc::new(NamespaceFacts::from_meta(
                name,
                ns.metadata.labels.as_ref(),
                ns.metadata.deletion_timestamp.is_some(),
            ))
        }))
    }

    async fn hold(
        &self,
        kind: PodOperation,
        pod: &PodFacts,
        plan: HoldPlan,
        resp: AdmissionResponse,
        deadline: Instant,
        forced: bool,
    ) -> (Option<PodOperation>, &'static str, AdmissionResponse) {
        let policy = &plan.policy;
        let timeout = deadline.saturating_duration_since(Instant::now());
        // The writes run in their own task: if the deadline passes first, the answer is a
        // denial and the task, once its writes are done, takes back the records it made.
        let mut writing = {
            let (store, pod, policy, reserve_for) =
                (self.store.clone(), pod.clone(), policy.name.clone(), plan.reserve_for);
            let trigger = kind.trigger();
            let shards = shards::count(plan.policy.max_reserved);
            tokio::spawn(async move {
                store.hold(&HoldRequest { policy: &policy, shards, reserve_for, pod: &pod, trigger, forced }).await
            })
        };
        let outcome = match tokio::time::timeout(timeout, &mut writing).await {
            Ok(Ok(result)) => Ok(result),
            Ok(Err(panicked)) => Err(format!("the hold's writer failed: {panicked}")),
            Err(_) => {
                // The writes go on. A denied deletion must leave no record behind; an
                // allowed one (onHoldFailure: Allow) keeps its hold once it lands.
                let (store, metrics) = (self.store.clone(), self.metrics.clone());
                let deny = policy.on_hold_failure == HoldFailureAction::Deny;
                tokio::spawn(async move {
                    let outcome = match writing.await {
                        Ok(Ok(held)) if deny => {
                            store.take_back(&held).await;
                            "taken_back"
                        }
                        Ok(Ok(_)) => "kept",
                        _ => "failed",
                    };
                    metrics.late_hold_writes.with_label_values(&[outcome]).inc();
                });
                Err(format!("writing the hold took longer than the {timeout:?} the API server allows"))
            }
        };
        let (reason, failure) = match outcome {
            Ok(Ok(held)) => {
                let created = held.iter().filter(|h| h.is_new()).count();
                self.metrics.holds.with_label_values(&[&policy.name, kind.as_str()]).inc_by(created as u64);
                info!(
                    namespace = %pod.namespace, pod = %pod.name, policy = %policy.name, ips = %ips(pod),
                    trigger = kind.as_str(), new = created, "held"
                );
                let mut warnings = plan.warnings.clone();
                for h in &held {
                    if let RecordOutcome::HeldForOther { pod: other, .. } = &h.record {
                        warnings.push(format!(
                            "capo: {} is held for Pod {other}, which still has it; that hold is kept as it is",
                            h.ip
                        ));
                    }
                }
                warnings.push(format!(
                    "capo: {} held in IPReservation {} for {} after the Pod is gone",
                    ips(pod),
                    shards_of(&held),
                    capo_api::Duration::from_std(plan.reserve_for)
                ));
                return (Some(kind), "held", allow(resp, warnings));
            }
            Ok(Err(errors)) => (errors.first().map_or("unknown", HoldError::kind), describe(&errors)),
            Err(message) => ("timeout", message),
        };
        let action = match policy.on_hold_failure {
            HoldFailureAction::Deny => "deny",
            HoldFailureAction::Allow => "allow",
        };
        self.metrics.hold_failures.with_label_values(&[&policy.name, action, reason]).inc();
        let message = format!(
            "capo could not hold {} of Pod {}/{} (policy {}): {failure}",
            ips(pod),
            pod.namespace,
            pod.name,
            policy.name
        );
        warn!(namespace = %pod.namespace, pod = %pod.name, policy = %policy.name, error = %failure, action, "hold failed");
        match policy.on_hold_failure {
            HoldFailureAction::Deny => {
                let message =
                    format!("{message}; policy onHoldFailure=Deny refuses the request until the hold can be written");
                (Some(kind), "denied", deny(resp, kind.deny_code(), "HoldFailed", message))
            }
            HoldFailureAction::Allow => {
                let message = format!("{message}; allowed by policy onHoldFailure=Allow");
                (Some(kind), "hold_failed_allowed", allow(resp, vec![message]))
            }
        }
    }
}

/// Runs an API read with what is left of the review's budget.
pub(super) async fn within<T>(
    deadline: Instant,
    read: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), read).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("no answer from the API server within the review's deadline".into()),
    }
}

fn ips(pod: &PodFacts) -> String {
    list(&pod.ips)
}

fn list(ips: &[IpAddr]) -> String {
    ips.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// The reservations a hold went to, as one name or a list.
fn shards_of(held: &[crate::hold::Held]) -> String {
    let mut names: Vec<&str> = held.iter().map(|h| h.reservation.as_str()).collect();
    names.sort();
    names.dedup();
    names.join(", ")
}

fn describe(errors: &[HoldError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
