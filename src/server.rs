//! The webhook's HTTPS server. Every accepted socket gets `TCP_NODELAY` (without it
//! Nagle's algorithm and the API server's delayed ACKs add ~40 ms to an answer written in
//! more than one segment). The certificate comes from a [`ServingCert`] on each
//! handshake, and handshakes are counted. When the certificate changes, connections made
//! with the old one are closed gracefully (HTTP/2 GOAWAY, or after the answer in flight
//! for HTTP/1.1): the API server keeps its connections open for as long as they work, so
//! without this it would meet a new certificate — or a CA it does not trust — only
//! whenever it happened to reconnect.
//!
//! What one client may cost is bounded ([`ConnectionLimits`]): a connection must send the
//! headers of its first request within the header timeout (TLS handshake included), is
//! closed once it has had no request in flight for the idle timeout, and past the
//! connection cap new connections are closed at once. Each close is counted by reason.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use crate::caller_auth::{AuthError, CallerAuth, TokenCheck, client_verifier};
use crate::certs::ServingCert;
use crate::metrics::ConnectionMetrics;

/// What one client may cost the webhook server.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// From accepting a connection to the headers of its first request, TLS handshake
    /// included: a client that sends nothing is closed after this long.
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed (the API server
    /// opens a new one when it next calls).
    pub idle_timeout: Duration,
    /// Connections open at once; past it a new connection is closed at once.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self { header_timeout: Duration::from_secs(10), idle_timeout: Duration::from_secs(90), max_connections: 1024 }
    }
}

/// Once the idle timeout has closed a connection gracefully, how long its client may take
/// to finish before the socket is dropped.
const CLOSING_GRACE: Duration = Duration::from_secs(1);

pub struct WebhookServer {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    accepting: Option<JoinHandle<()>>,
    /// One clone per open connection.
    open: Arc<()>,
}

/// The requests of one connection: how many started, how many are in flight, when the
/// last one ended.
struct Activity {
    started: AtomicUsize,
    in_flight: AtomicUsize,
    last_end: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self { started: AtomicUsize::new(0), in_flight: AtomicUsize::new(0), last_end: Mutex::new(Instant::now()) }
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// Since when the connection has had nothing in flight (`None`: a request is).
    fn idle_since(&self) -> Option<Instant> {
        (self.in_flight.load(Ordering::Acquire) == 0).then(|| *self.last_end.lock().expect("activity lock"))
    }
}

/// A request in flight on its connection.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.last_end.lock().expect("activity lock") = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An open connection, counted in the gauge while it lives.
struct Slot {
    _permit: OwnedSemaphorePermit,
    _open: Arc<()>,
    metrics: ConnectionMetrics,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.open.dec();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding the webhook server on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("the webhook's TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Auth(#[from] AuthError),
}

fn tls_config(
    serving: Arc<ServingCert>,
    clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
    let builder = match clients {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(serving);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

impl WebhookServer {
    /// Listens on `addr` and serves `router` over TLS with the certificate of `serving`.
    /// Connections are bounded by `limits` and counted in `metrics`; callers must present
    /// what `auth` asks for.
    pub async fn start(
        addr: SocketAddr,
        router: Router,
        serving: Arc<ServingCert>,
        limits: ConnectionLimits,
        metrics: ConnectionMetrics,
        auth: &CallerAuth,
    ) -> Result<Self, ServerError> {
        let clients = auth.client_ca_file.as_deref().map(client_verifier).transpose()?;
        let token = auth.token_file.clone().map(TokenCheck::new).transpose()?.map(Arc::new);
        let listener = TcpListener::bind(addr).await.map_err(|source| ServerError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| ServerError::Bind { addr, source })?;
        let acceptor = TlsAcceptor::from(Arc::new(tls_config(serving.clone(), clients)?));
        let (stop, stopped) = watch::channel(false);
        let open = Arc::new(());
        let router = match token {
            Some(token) => with_token(router, token, metrics.clone()),
            None => router,
        };
        let server = Server { acceptor, router, serving, limits, metrics, stop: stopped, open: open.clone() };
        let accepting = tokio::spawn(server.accept(listener));
        Ok(Self { addr, stop, accepting: Some(accepting), open })
    }

    /// Stops accepting, closes every connection gracefully, and waits up to `grace` for
    /// the answers in flight.
    pub async fn shutdown(mut self, grace: Duration) {
        self.stop.send_replace(true);
        if let Some(accepting) = self.accepting.take() {
            let _ = accepting.await;
        }
        let deadline = tokio::time::Instant::now() + grace;
        while Arc::strong_count(&self.open) > 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for WebhookServer {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        if let Some(accepting) = &self.accepting {
            accepting.abort();
        }
    }
}

/// What every connection shares.
#[derive(Clone)]
struct Server {
    acceptor: TlsAcceptor,
    router: Router,
    serving: Arc<ServingCert>,
    limits: ConnectionLimits,
    metrics: ConnectionMetrics,
    stop: watch::Receiver<bool>,
    open: Arc<()>,
}

impl Server {
    async fn accept(self, listener: TcpListener) {
        let slots = Arc::new(Semaphore::new(self.limits.max_connections));
        let mut stop = self.stop.clone();
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: do not spin.
                        warn!(error = %e, "accepting a webhook connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                _ = until(&mut stop, |s| *s) => return,
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                // At the cap: closing at once tells the client more than a queue would.
                self.metrics.closed.with_label_values(&["refused"]).inc();
                debug!(%peer, max = self.limits.max_connections, "webhook connection refused: at the connection cap");
                drop(tcp);
                continue;
            };
            self.metrics.open.inc();
            let slot = Slot { _permit: permit, _open: self.open.clone(), metrics: self.metrics.clone() };
            if let Err(e) = tcp.set_nodelay(true) {
                debug!(%peer, error = %e, "could not set TCP_NODELAY");
            }
            tokio::spawn(self.clone().connection(tcp, peer, slot));
        }
    }

    async fn connection(self, tcp: TcpStream, peer: SocketAddr, _slot: Slot) {
        let accepted = Instant::now();
        let header_deadline = accepted + self.limits.header_timeout;
        let serving = &self.serving;
        let before = serving.generation();
        let handshake = tokio::time::timeout_at(header_deadline, self.acceptor.accept(tcp)).await;
        let tls = match handshake {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                debug!(%peer, error = %e, "TLS handshake failed");
                serving.handshake_failed();
                return;
            }
            Err(_) => {
                debug!(%peer, "no TLS handshake within the header timeout");
                serving.handshake_failed();
                self.metrics.closed.with_label_values(&["header_timeout"]).inc();
                return;
            }
        };
        let generation = serving.generation();
        serving.handshake_ok((before == generation).then_some(generation));
        let builder = auto::Builder::new(TokioExecutor::new());
        // Each request carries the address it came from (the webhook logs who sent a review
        // it does not believe), and is counted on its connection while it is in flight.
        let activity = Arc::new(Activity::new());
        let router = {
            let activity = activity.clone();
            self.router.clone().layer(axum::Extension(crate::admission::Caller(peer))).layer(axum::middleware::from_fn(
                move |req: axum::extract::Request, next: axum::middleware::Next| {
                    let busy = activity.begin();
                    async move {
                        let response = next.run(req).await;
                        drop(busy);
                        response
                    }
                },
            ))
        };
        let conn = builder.serve_connection(TokioIo::new(tls), TowerToHyperService::new(router));
        tokio::pin!(conn);
        let mut generations = serving.generations();
        let mut stop = self.stop.clone();
        let mut closing: Option<Instant> = None;
        let tick = (self.limits.header_timeout.min(self.limits.idle_timeout) / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut ticks = tokio::time::interval(tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                done = conn.as_mut() => {
                    if let Err(e) = done {
                        debug!(%peer, error = %e, "webhook connection ended with an error");
                    }
                    return;
                }
                _ = until(&mut generations, |g| *g != generation), if closing.is_none() => {
                    debug!(%peer, "the serving certificate changed: closing this connection gracefully");
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now() + self.limits.idle_timeout);
                }
                _ = until(&mut stop, |s| *s), if closing.is_none() => {
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now() + self.limits.idle_timeout);
                }
                _ = ticks.tick() => {
                    let now = Instant::now();
                    if closing.is_some_and(|by| now >= by) {
                        return;
                    }
                    if activity.started.load(Ordering::Relaxed) == 0 {
                        if now >= header_deadline {
                            debug!(%peer, "no request within the header timeout: closing the connection");
                            self.metrics.closed.with_label_values(&["header_timeout"]).inc();
                            return;
                        }
                    } else if closing.is_none()
                        && activity.idle_since().is_some_and(|since| now >= since + self.limits.idle_timeout)
                    {
                        debug!(%peer, "idle: closing the connection gracefully");
                        self.metrics.closed.with_label_values(&["idle"]).inc();
                        conn.as_mut().graceful_shutdown();
                        closing = Some(now + CLOSING_GRACE);
                    }
                }
            }
        }
    }
}

/// Answers 401 to a request without the bearer token, before anything else reads it.
fn with_token(router: Router, token: Arc<TokenCheck>, metrics: ConnectionMetrics) -> Router {
    router.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
        let refused = token.check(req.headers()).err();
        let metrics = metrics.clone();
        async move {
            match refused {
                None => next.run(req).await,
                Some(why) => {
                    metrics.unauthenticated.with_label_values(&[why.reason()]).inc();
                    let message = "capo's webhook needs the bearer token it was given (--webhook-token-file)";
                    let mut response =
                        axum::response::IntoResponse::into_response((axum::http::StatusCode::UNAUTHORIZED, message));
                    response
                        .headers_mut()
                        .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
                    response
                }
            }
        }
    }))
}

/// Waits until the watched value satisfies `f` (or its sender is gone).
async fn until<T>(rx: &mut watch::Receiver<T>, f: impl FnMut(&T) -> bool) {
    let _ = rx.wait_for(f).await;
}
