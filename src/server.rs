//! The webhook's HTTPS server. Every accepted socket gets `TCP_NODELAY` (without it
//! Nagle's algorithm and the API server's delayed ACKs add ~40 ms to an answer written in
//! more than one segment). The certificate comes from a [`ServingCert`] on each
//! handshake, and handshakes are counted. When the certificate changes, connections made
//! with the old one are closed gracefully (HTTP/2 GOAWAY, or after the answer in flight
//! for HTTP/1.1): the API server keeps its connections open for as long as they work, so
//! without this it would meet a new certificate — or a CA it does not trust — only
//! whenever it happened to reconnect.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use crate::certs::ServingCert;

/// How long a client may take to complete the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub struct WebhookServer {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    accepting: Option<JoinHandle<()>>,
    /// One clone per open connection.
    open: Arc<()>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding the webhook server on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("the webhook's TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
}

fn tls_config(serving: Arc<ServingCert>) -> Result<rustls::ServerConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(serving);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

impl WebhookServer {
    /// Listens on `addr` and serves `router` over TLS with the certificate of `serving`.
    pub async fn start(addr: SocketAddr, router: Router, serving: Arc<ServingCert>) -> Result<Self, ServerError> {
        let listener = TcpListener::bind(addr).await.map_err(|source| ServerError::Bind { addr, source })?;
        let addr = listener.local_addr().map_err(|source| ServerError::Bind { addr, source })?;
        let acceptor = TlsAcceptor::from(Arc::new(tls_config(serving.clone())?));
        let (stop, stopped) = watch::channel(false);
        let open = Arc::new(());
        let accepting = tokio::spawn(accept(listener, acceptor, router, serving, stopped, open.clone()));
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

async fn accept(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    router: Router,
    serving: Arc<ServingCert>,
    mut stop: watch::Receiver<bool>,
    open: Arc<()>,
) {
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
        if let Err(e) = tcp.set_nodelay(true) {
            debug!(%peer, error = %e, "could not set TCP_NODELAY");
        }
        tokio::spawn(connection(
            tcp,
            peer,
            acceptor.clone(),
            router.clone(),
            serving.clone(),
            stop.clone(),
            open.clone(),
        ));
    }
}

async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    router: Router,
    serving: Arc<ServingCert>,
    mut stop: watch::Receiver<bool>,
    _open: Arc<()>,
) {
    let before = serving.generation();
    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
    let tls = match handshake.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())) {
        Ok(tls) => tls,
        Err(e) => {
            debug!(%peer, error = %e, "TLS handshake failed");
            serving.handshake_failed();
            return;
        }
    };
    let generation = serving.generation();
    serving.handshake_ok((before == generation).then_some(generation));
    let builder = auto::Builder::new(TokioExecutor::new());
    // Each request carries the address it came from (the webhook logs who sent a review
    // it does not believe).
    let router = router.layer(axum::Extension(crate::admission::Caller(peer)));
    let conn = builder.serve_connection(TokioIo::new(tls), TowerToHyperService::new(router));
    tokio::pin!(conn);
    let mut generations = serving.generations();
    let mut closing = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    debug!(%peer, error = %e, "webhook connection ended with an error");
                }
                return;
            }
            _ = until(&mut generations, |g| *g != generation), if !closing => {
                debug!(%peer, "the serving certificate changed: closing this connection gracefully");
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = until(&mut stop, |s| *s), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
}

/// Waits until the watched value satisfies `f` (or its sender is gone).
async fn until<T>(rx: &mut watch::Receiver<T>, f: impl FnMut(&T) -> bool) {
    let _ = rx.wait_for(f).await;
}
