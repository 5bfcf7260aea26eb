//! capo's client for the API server: kube's client stack (base URI, kube's retry of
//! 429/503, authentication, headers, the kubeconfig's timeouts and TLS) on a connector
//! that sets `TCP_NODELAY`. kube's own builder leaves Nagle's algorithm on; a request
//! written in two segments then waits for the API server's delayed ACK (~40 ms on Linux),
//! and every hold is written by such requests before the deletion may proceed.

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::client::retry::RetryPolicy;
use kube::{Client, Config};
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder};

/// A client for `config` whose connections set `TCP_NODELAY` (unless `nodelay` is false:
/// for measuring the difference). Falls back to kube's own builder when the kubeconfig
/// names a proxy (capo builds kube without proxy support).
pub fn client(config: Config, nodelay: bool) -> Result<Client, kube::Error> {
    if config.proxy_url.is_some() {
        return Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(nodelay);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let http_client = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| RetryLayer::new(RetryPolicy::server_retry())))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http_client);
    Ok(Client::new(service, config.default_namespace))
}

/// Which kubeconfig and context to use: `--kubeconfig` and `--context`, as kubectl takes
/// them. Neither given: the environment (in a Pod its ServiceAccount, else `$KUBECONFIG`
/// or `~/.kube/config`).
#[derive(Clone, Debug, Default)]
pub struct Target {
    pub kubeconfig: Option<std::path::PathBuf>,
    pub context: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("reading the kubeconfig {path}: {source}")]
    Read { path: String, source: kube::config::KubeconfigError },
    #[error("the kubeconfig's context {context}: {source}")]
    Context { context: String, source: kube::config::KubeconfigError },
    #[error("no cluster found (in-cluster or kubeconfig): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("building the client: {0}")]
    Client(#[from] kube::Error),
}

impl Target {
    pub async fn config(&self) -> Result<Config, TargetError> {
        use kube::config::{KubeConfigOptions, Kubeconfig};
        let options = KubeConfigOptions { context: self.context.clone(), ..Default::default() };
        let context = || self.context.clone().unwrap_or_else(|| "(current)".into());
        match (&self.kubeconfig, &self.context) {
            (None, None) => Ok(Config::infer().await?),
            (Some(path), _) => {
                let file = Kubeconfig::read_from(path)
                    .map_err(|source| TargetError::Read { path: path.display().to_string(), source })?;
                Config::from_custom_kubeconfig(file, &options)
                    .await
                    .map_err(|source| TargetError::Context { context: context(), source })
            }
            (None, Some(_)) => Config::from_kubeconfig(&options)
                .await
                .map_err(|source| TargetError::Context { context: context(), source }),
        }
    }
}

/// The client for `target`.
pub async fn infer(target: &Target, nodelay: bool) -> Result<Client, TargetError> {
    Ok(client(target.config().await?, nodelay)?)
}

/// capo's two clients: one for everything, and one for the leader's writes without kube's
/// retry of 429/503/504 — a write the leader decided must not be sent again after it
/// stopped leading. Both name the replica in their `User-Agent` (audit logs show who
/// wrote what).
pub async fn infer_pair(target: &Target, nodelay: bool, identity: &str) -> Result<(Client, Client), TargetError> {
    let mut config = target.config().await?;
    let agent = format!("capo/{} ({identity})", env!("CARGO_PKG_VERSION"));
    if let Ok(value) = axum::http::HeaderValue::from_str(&agent) {
        config.headers.push((axum::http::header::USER_AGENT, value));
    }
    let mut leader = config.clone();
    leader.default_retry = false;
    Ok((client(config, nodelay)?, client(leader, nodelay)?))
}

/// Whether `e` is a transport failure rather than an answer: the connection could not be
/// made, or closed before the API server answered (a pooled connection the server was
/// closing, a server under a storm shedding connections). kube's retry layer retries
/// answers (429/503/504), not these. A hold's writes are safe to send again after one —
/// the append is a set (a duplicate is refused and dropped) and a record of the same Pod
/// is kept — so they retry it themselves. Only the HTTP client's own failures count: an
/// error of Calico's etcd datastore (also a `Service` error) is not sent again here (its
/// client reconnects on its own, and a hold against an etcd that does not answer must
/// say so within the review's deadline, not spend it retrying).
/// The pause before attempt `attempt + 1` of a write the hold path sends again (after a
/// transport failure, or a conflict or throttling the API server answered): 10 ms,
/// doubling, at most 640 ms. The review's answer waits on it, and the API server's
/// deadline bounds the whole.
pub async fn pause_before_retry(attempt: usize) {
    tokio::time::sleep(std::time::Duration::from_millis(10 << attempt.min(6))).await;
}

pub fn is_transport(e: &kube::Error) -> bool {
    match e {
        kube::Error::HyperError(_) => true,
        kube::Error::Service(inner) => inner.downcast_ref::<hyper_util::client::legacy::Error>().is_some(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The HTTP client's own failure (here: nothing listens) is a transport error; another
    /// service error (Calico's etcd datastore reports its errors so) and an answer are not.
    #[tokio::test]
    async fn only_the_http_clients_own_failures_are_transport_errors() {
        let http: hyper_util::client::legacy::Client<HttpConnector, http_body_util::Empty<bytes::Bytes>> =
            hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let refused = http.get("http://127.0.0.1:1/".parse().unwrap()).await.expect_err("nothing listens");
        assert!(is_transport(&kube::Error::Service(Box::new(refused))));
        let etcd_like = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "etcd: connection refused");
        assert!(!is_transport(&kube::Error::Service(Box::new(etcd_like))));
        let answer = kube::core::Status::failure("conflict", "Conflict").with_code(409);
        assert!(!is_transport(&kube::Error::Api(Box::new(answer))));
    }
}
