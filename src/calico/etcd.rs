//! A small etcd v3 client for Calico's etcd datastore, over etcd's JSON gateway
//! (`/v3/kv/range`, `/v3/kv/txn`, `/v3/watch` on the client port, served by every etcd
//! since 3.4 unless `--enable-grpc-gateway=false`) with the same settings Calico's own
//! components take: endpoints, CA, client certificate and key.
//!
//! capo needs only four things from etcd: read a key, list a prefix, write a key only if it
//! is unchanged (or absent), and follow a prefix. The gateway gives them through hyper and
//! rustls, which capo already has, instead of a gRPC stack.
//!
//! Every call goes to the endpoint that last answered, then the others in turn; a call
//! that reaches no endpoint is tried again with backoff for a few seconds (a restarting
//! etcd), which is safe because every write capo makes is conditional on what it read.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::Bytes;
use futures::Stream;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use tracing::{debug, info, warn};

/// How long one call keeps trying when no endpoint answers.
const UNREACHABLE_FOR: Duration = Duration::from_secs(6);
/// How long one request (not a watch) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request waits for one member before it asks the next, on its first round of
/// a cluster: a member that stopped answering (a stalled network, a paused process) must
/// not cost a webhook's hold more than this. Once every member was given this much, they
/// get [`REQUEST_TIMEOUT`] each (a slow cluster still answers a large list).
const MEMBER_TIMEOUT: Duration = Duration::from_secs(2);
/// A watch that hears nothing for this long is checked: its member must answer a
/// linearizable read (which needs a leader and a quorum) within [`PROBE_TIMEOUT`], or the
/// watch is dropped and the prefix listed and watched again at the next member.
const WATCH_IDLE: Duration = Duration::from_secs(10);
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where Calico's etcd is and how to reach it: Calico's `ETCD_ENDPOINTS`,
/// `ETCD_CA_CERT_FILE`, `ETCD_CERT_FILE` and `ETCD_KEY_FILE`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub ca_cert_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd endpoints: set --etcd-endpoints (ETCD_ENDPOINTS)")]
    NoEndpoints,
    #[error("etcd endpoint {0:?} is not an http:// or https:// URL")]
    Endpoint(String),
    #[error("https etcd endpoints need --etcd-ca-cert-file (ETCD_CA_CERT_FILE)")]
    NoCa,
    #[error("--etcd-cert-file and --etcd-key-file go together")]
    HalfClientCert,
    #[error(
        "etcd endpoint {0} is plain http:// while a client certificate is configured: it would be sent unencrypted to a server nobody verified; use https://"
    )]
    PlainWithClientCert(String),
    #[error("reading {what} {path}: {message}")]
    File { what: &'static str, path: PathBuf, message: String },
    #[error("TLS settings for etcd: {0}")]
    Tls(#[from] rustls::Error),
    #[error("etcd did not answer {op} at any of {endpoints}: {message}")]
    Unreachable { op: &'static str, endpoints: String, message: String },
    #[error("etcd refused {op}: {message}")]
    Refused { op: &'static str, message: String },
    #[error("etcd's answer to {op} is not what capo reads: {message}")]
    Decode { op: &'static str, message: String },
    #[error("the watch of {prefix} was compacted at revision {revision}: list again")]
    Compacted { prefix: String, revision: i64 },
    #[error("watching {dir} for new etcd certificates: {message}")]
    Watch { dir: PathBuf, message: String },
}

impl EtcdError {
    /// etcd refuses a value past its request size limit (`--max-request-bytes`, 1.5 MiB).
    pub fn is_too_large(&self) -> bool {
        matches!(self, Self::Refused { message, .. } if message.contains("too large"))
    }
}

/// One key as etcd holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// What a conditional write must find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// The key does not exist.
    Absent,
    /// The key was last written at this revision.
    ModRevision(i64),
}

/// The outcome of a conditional write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Written {
    /// Written; the key's new revision.
    At(i64),
    /// Not written: the key is not as expected; how it is now (`None`: absent).
    Changed(Option<Kv>),
}

/// What following a prefix reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefixEvent {
    /// Every key under the prefix, listed afresh (first, and after a lost watch).
    Listed(Vec<Kv>),
    Put(Kv),
    Deleted(String),
}

type Https = HttpsConnector<HttpConnector>;

/// A client of one etcd cluster.
#[derive(Clone)]
pub struct Etcd {
    /// Swapped for a new client when the certificate files change ([`Etcd::reload_on_change`]).
    http: Arc<arc_swap::ArcSwap<Client<Https, Full<Bytes>>>>,
    endpoints: Arc<Vec<String>>,
    /// The endpoint that answered last.
    current: Arc<AtomicUsize>,
}

fn read_file(what: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|e| EtcdError::File { what, path: path.to_path_buf(), message: e.to_string() })
}

fn tls_config(config: &EtcdConfig) -> Result<rustls::ClientConfig, EtcdError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = &config.ca_cert_file {
        let pem = read_file("the etcd CA", ca)?;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert =
                cert.map_err(|e| EtcdError::File { what: "the etcd CA", path: ca.clone(), message: e.to_string() })?;
            roots.add(cert)?;
        }
    }
    let builder = builder.with_root_certificates(roots);
    Ok(match (&config.cert_file, &config.key_file) {
        (Some(cert), Some(key)) => {
            let pem = read_file("the etcd client certificate", cert)?;
            let chain = CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>().map_err(|e| {
                EtcdError::File { what: "the etcd client certificate", path: cert.clone(), message: e.to_string() }
            })?;
            let key_pem = read_file("the etcd client key", key)?;
            let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| EtcdError::File {
                what: "the etcd client key",
                path: key.clone(),
                message: e.to_string(),
            })?;
            builder.with_client_auth_cert(chain, key_der)?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => return Err(EtcdError::HalfClientCert),
    })
}

/// The HTTP client for etcd, with `config`'s certificates.
fn http_client(config: &EtcdConfig) -> Result<Client<Https, Full<Bytes>>, EtcdError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_keepalive(Some(Duration::from_secs(30)));
    http.set_connect_timeout(Some(Duration::from_secs(3)));
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls_config(config)?)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// The contents of the certificate files, to tell a real change from a touch.
fn certificate_files(config: &EtcdConfig) -> Vec<Option<Vec<u8>>> {
    [&config.ca_cert_file, &config.cert_file, &config.key_file]
        .into_iter()
        .map(|f| f.as_ref().and_then(|f| std::fs::read(f).ok()))
        .collect()
}

/// The range end that makes a range request cover every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// An int64 of the gateway's JSON (proto3 JSON writes them as strings; 0 is left out).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn decode_kv(op: &'static str, v: &Value) -> Result<Kv, EtcdError> {
    let bytes = |field: &str| -> Result<Vec<u8>, EtcdError> {
        match v[field].as_str() {
            None => Ok(Vec::new()),
            Some(s) => B64.decode(s).map_err(|e| EtcdError::Decode { op, message: format!("{field}: {e}") }),
        }
    };
    let key = String::from_utf8(bytes("key")?).map_err(|e| EtcdError::Decode { op, message: e.to_string() })?;
    Ok(Kv { key, value: bytes("value")?, mod_revision: int(&v["mod_revision"]) })
}

fn decode_kvs(op: &'static str, v: &Value) -> Result<Vec<Kv>, EtcdError> {
    v["kvs"].as_array().into_iter().flatten().map(|kv| decode_kv(op, kv)).collect()
}

impl Etcd {
    pub fn new(config: &EtcdConfig) -> Result<Self, EtcdError> {
        let endpoints: Vec<String> = config
            .endpoints
            .iter()
            .map(|e| e.trim().trim_end_matches('/').to_string())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        for e in &endpoints {
            if !(e.starts_with("https://") || e.starts_with("http://")) || e.parse::<hyper::Uri>().is_err() {
                return Err(EtcdError::Endpoint(e.clone()));
            }
        }
        if endpoints.iter().any(|e| e.starts_with("https://")) && config.ca_cert_file.is_none() {
            return Err(EtcdError::NoCa);
        }
        if config.cert_file.is_some()
            && config.key_file.is_some()
            && let Some(plain) = endpoints.iter().find(|e| e.starts_with("http://"))
        {
            return Err(EtcdError::PlainWithClientCert(plain.clone()));
        }
        let http = http_client(config)?;
        Ok(Self {
            http: Arc::new(arc_swap::ArcSwap::from_pointee(http)),
            endpoints: Arc::new(endpoints),
            current: Arc::default(),
        })
    }

    /// Reads `config`'s certificate files again whenever something in their directories
    /// changes (kubelet updates a mounted Secret by swapping its `..data` symlink) and
    /// sends every later request with them; a bad update (a half-written key) is logged
    /// and the certificates in use are kept. `None` without certificate files. The watch
    /// lasts as long as the returned watcher.
    pub fn reload_on_change(&self, config: &EtcdConfig) -> Result<Option<notify::RecommendedWatcher>, EtcdError> {
        use notify::{RecursiveMode, Watcher};
        let mut dirs: Vec<PathBuf> = [&config.ca_cert_file, &config.cert_file, &config.key_file]
            .into_iter()
            .flatten()
            .map(|f| f.parent().map(Path::to_path_buf).unwrap_or_default())
            .collect();
        dirs.sort();
        dirs.dedup();
        if dirs.is_empty() {
            return Ok(None);
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            if event.is_ok() {
                let _ = tx.send(());
            }
        })
        .map_err(|e| EtcdError::Watch { dir: dirs[0].clone(), message: e.to_string() })?;
        for dir in &dirs {
            watcher
                .watch(dir, RecursiveMode::NonRecursive)
                .map_err(|e| EtcdError::Watch { dir: dir.clone(), message: e.to_string() })?;
        }
        let (config, http) = (config.clone(), self.http.clone());
        tokio::spawn(async move {
            let mut loaded = certificate_files(&config);
            while rx.recv().await.is_some() {
                // One update is several filesystem events; let them settle.
                tokio::time::sleep(Duration::from_millis(250)).await;
                while rx.try_recv().is_ok() {}
                let now = certificate_files(&config);
                if now == loaded {
                    continue;
                }
                match http_client(&config) {
                    Ok(client) => {
                        http.store(Arc::new(client));
                        loaded = now;
                        info!("reloaded the certificates for Calico's etcd");
                    }
                    Err(e) => {
                        warn!(error = %e, "could not reload the certificates for Calico's etcd; keeping those in use")
                    }
                }
            }
        });
        Ok(Some(watcher))
    }

    /// The endpoints, for messages.
    pub fn endpoints(&self) -> String {
        self.endpoints.join(",")
    }

    /// Sends `body` to `path` at one endpoint; the answer's status and body.
    async fn send(
        &self,
        endpoint: &str,
        path: &str,
        body: &Value,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        let request = hyper::Request::post(format!("{endpoint}{path}"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            // gRPC metadata `hasleader: true` through the gateway: a member that has lost
            // its leader refuses the request, and cancels a watch, instead of serving
            // what it last knew.
            .header("Grpc-Metadata-hasleader", "true")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        self.http.load_full().request(request).await.map_err(|e| {
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                message = format!("{message}: {s}");
                source = s.source();
            }
            message
        })
    }

    /// Answers `body` at `path` from the first endpoint that answers, trying again for a
    /// while when none does.
    async fn call(&self, op: &'static str, path: &str, body: Value) -> Result<Value, EtcdError> {
        let started = tokio::time::Instant::now();
        let mut delay = Duration::from_millis(50);
        let mut patience = if self.endpoints.len() > 1 { MEMBER_TIMEOUT } else { REQUEST_TIMEOUT };
        loop {
            let mut last = String::new();
            for i in 0..self.endpoints.len() {
                let at = (self.current.load(Ordering::Relaxed) + i) % self.endpoints.len();
                let endpoint = &self.endpoints[at];
                let answer = tokio::time::timeout(patience, async {
                    let response = self.send(endpoint, path, &body).await?;
                    let status = response.status();
                    let bytes = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
                    Ok::<_, String>((status, bytes))
                })
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {patience:?}")));
                match answer {
                    Ok((status, bytes)) => {
                        self.current.store(at, Ordering::Relaxed);
                        if status == hyper::StatusCode::NOT_FOUND {
                            return Err(EtcdError::Refused {
                                op,
                                message: format!(
                                    "{endpoint}{path} answered HTTP 404: is it etcd, with its JSON gateway on (etcd 3.4 or later, --enable-grpc-gateway)?"
                                ),
                            });
                        }
                        let value: Value = serde_json::from_slice(&bytes)
                            .map_err(|e| EtcdError::Decode { op, message: format!("{e} (HTTP {status})") })?;
                        if !status.is_success() {
                            let message = value["message"].as_str().or(value["error"].as_str()).unwrap_or_default();
                            // An etcd that is up but has no leader yet (just restarted) answers
                            // like one that is down: try again.
                            if message.contains("no leader") || message.contains("leader changed") {
                                last = format!("{endpoint}: {message}");
                                continue;
                            }
                            return Err(EtcdError::Refused { op, message: format!("{message} (HTTP {status})") });
                        }
                        return Ok(value);
                    }
                    Err(message) => {
                        debug!(endpoint, op, error = %message, "etcd endpoint did not answer");
                        last = format!("{endpoint}: {message}");
                    }
                }
            }
            // A round with the short wait is followed by one with the full wait, however
            // long the first took.
            if started.elapsed() + delay > UNREACHABLE_FOR && patience == REQUEST_TIMEOUT {
                return Err(EtcdError::Unreachable { op, endpoints: self.endpoints(), message: last });
            }
            patience = REQUEST_TIMEOUT;
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    /// The key `key`, if it exists.
    pub async fn get(&self, key: &str) -> Result<Option<Kv>, EtcdError> {
        let answer = self.call("get", "/v3/kv/range", json!({ "key": b64(key.as_bytes()) })).await?;
        Ok(decode_kvs("get", &answer)?.into_iter().next())
    }

    /// Every key under `prefix`, and the revision the list was read at.
    pub async fn list(&self, prefix: &str) -> Result<(Vec<Kv>, i64), EtcdError> {
        let body = json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)) });
        let answer = self.call("list", "/v3/kv/range", body).await?;
        Ok((decode_kvs("list", &answer)?, int(&answer["header"]["revision"])))
    }

    /// Writes `value` at `key` only if the key is as `expect` says, in one transaction; if
    /// it is not, the same transaction reads it as it is.
    pub async fn put_if(&self, key: &str, value: &[u8], expect: Expect) -> Result<Written, EtcdError> {
        let k = b64(key.as_bytes());
        let compare = match expect {
            Expect::Absent => json!({ "key": k, "result": "EQUAL", "target": "VERSION", "version": "0" }),
            Expect::ModRevision(rev) => {
                json!({ "key": k, "result": "EQUAL", "target": "MOD", "mod_revision": rev.to_string() })
            }
        };
        let body = json!({
            "compare": [compare],
            "success": [{ "request_put": { "key": k, "value": b64(value) } }],
            "failure": [{ "request_range": { "key": k } }],
        });
        let answer = self.call("put", "/v3/kv/txn", body).await?;
        if answer["succeeded"].as_bool().unwrap_or(false) {
            return Ok(Written::At(int(&answer["header"]["revision"])));
        }
        let now = answer["responses"][0]["response_range"].clone();
        Ok(Written::Changed(decode_kvs("put", &now)?.into_iter().next()))
    }

    /// Deletes `key` only if it was last written at `mod_revision`. `false`: it was not.
    pub async fn delete_if(&self, key: &str, mod_revision: i64) -> Result<bool, EtcdError> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [{ "key": k, "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision.to_string() }],
            "success": [{ "request_delete_range": { "key": k } }],
        });
        let answer = self.call("delete", "/v3/kv/txn", body).await?;
        Ok(answer["succeeded"].as_bool().unwrap_or(false))
    }

    /// Follows every key under `prefix`: a full listing first, then each change; after a
    /// lost or compacted watch, a fresh listing. Never ends while the stream is polled.
    pub fn follow(&self, prefix: String) -> impl Stream<Item = PrefixEvent> + Send + 'static {
        let etcd = self.clone();
        async_stream(move |tx| async move {
            let mut delay = Duration::from_millis(200);
            loop {
                let revision = match etcd.list(&prefix).await {
                    Ok((kvs, revision)) => {
                        if tx.send(PrefixEvent::Listed(kvs)).await.is_err() {
                            return;
                        }
                        revision
                    }
                    Err(e) => {
                        warn!(prefix, error = %e, "listing Calico's etcd failed; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(10));
                        continue;
                    }
                };
                delay = Duration::from_millis(200);
                match etcd.watch(&prefix, revision + 1, &tx).await {
                    Ok(()) => return, // nobody listens any more
                    Err(e) => warn!(prefix, error = %e, "watching Calico's etcd stopped; listing again"),
                }
            }
        })
    }

    /// Sends each change under `prefix` from `start` on to `tx` until the watch ends.
    /// `Ok`: the receiver is gone.
    async fn watch(
        &self,
        prefix: &str,
        start: i64,
        tx: &tokio::sync::mpsc::Sender<PrefixEvent>,
    ) -> Result<(), EtcdError> {
        let op = "watch";
        let body = json!({ "create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
            "start_revision": start.to_string(),
        }});
        let at = self.current.load(Ordering::Relaxed) % self.endpoints.len();
        let endpoint = &self.endpoints[at];
        let unreachable = |message: String| {
            // The next list and watch go to the next member.
            let _ = self.current.compare_exchange(
                at,
                (at + 1) % self.endpoints.len(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            EtcdError::Unreachable { op, endpoints: endpoint.clone(), message }
        };
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.send(endpoint, "/v3/watch", &body))
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}")))
            .map_err(&unreachable)?;
        if !response.status().is_success() {
            return Err(EtcdError::Refused { op, message: format!("HTTP {}", response.status()) });
        }
        let mut body = response.into_body();
        let mut buffer: Vec<u8> = Vec::new();
        loop {
            let frame = match tokio::time::timeout(WATCH_IDLE, body.frame()).await {
                Ok(Some(frame)) => frame.map_err(|e| unreachable(e.to_string()))?,
                Ok(None) => break,
                Err(_) => {
                    // Silence: nothing changed, or the member is cut off and its watch stale.
                    if let Err(message) = self.probe(endpoint, prefix).await {
                        warn!(endpoint, prefix, error = %message, "an etcd watch went silent and its member does not answer; watching at the next member");
                        return Err(unreachable(format!("silent for {WATCH_IDLE:?}, and {message}")));
                    }
                    continue;
                }
            };
            let Ok(data) = frame.into_data() else { continue };
            buffer.extend_from_slice(&data);
            let mut consumed = 0;
            let mut messages = serde_json::Deserializer::from_slice(&buffer).into_iter::<Value>();
            while let Some(message) = messages.next() {
                match message {
                    Ok(message) => {
                        consumed = messages.byte_offset();
                        for event in watch_events(prefix, &message)? {
                            if tx.send(event).await.is_err() {
                                return Ok(());
                            }
                        }
                    }
                    Err(e) if e.is_eof() => break,
                    Err(e) => return Err(EtcdError::Decode { op, message: e.to_string() }),
                }
            }
            buffer.drain(..consumed);
        }
        Err(unreachable("the watch ended".into()))
    }

    /// A linearizable read of `prefix` (count only) at `endpoint`: it answers only with a
    /// leader and a quorum behind it.
    async fn probe(&self, endpoint: &str, prefix: &str) -> Result<(), String> {
        let body = json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)), "count_only": true });
        let answer = tokio::time::timeout(PROBE_TIMEOUT, async {
            let response = self.send(endpoint, "/v3/kv/range", &body).await?;
            let status = response.status();
            let _ = response.into_body().collect().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(status)
        })
        .await
        .unwrap_or_else(|_| Err(format!("a linearizable read got no answer within {PROBE_TIMEOUT:?}")))?;
        if answer.is_success() { Ok(()) } else { Err(format!("a linearizable read was refused (HTTP {answer})")) }
    }
}

/// The events of one watch message of the gateway (`{"result": {...}}` or `{"error": ...}`).
fn watch_events(prefix: &str, message: &Value) -> Result<Vec<PrefixEvent>, EtcdError> {
    let op = "watch";
    if let Some(error) = message.get("error") {
        let text = error["message"].as_str().map(String::from).unwrap_or_else(|| error.to_string());
        return Err(EtcdError::Refused { op, message: text });
    }
    let result = &message["result"];
    let compacted = int(&result["compact_revision"]);
    if compacted != 0 {
        return Err(EtcdError::Compacted { prefix: prefix.to_string(), revision: compacted });
    }
    if result["canceled"].as_bool().unwrap_or(false) {
        let reason = result["cancel_reason"].as_str().unwrap_or("canceled").to_string();
        return Err(EtcdError::Refused { op, message: reason });
    }
    let mut events = Vec::new();
    for event in result["events"].as_array().into_iter().flatten() {
        let kv = decode_kv(op, &event["kv"])?;
        events.push(match event["type"].as_str() {
            Some("DELETE") => PrefixEvent::Deleted(kv.key),
            _ => PrefixEvent::Put(kv),
        });
    }
    Ok(events)
}

/// A stream fed by a task: the task ends when the stream is dropped.
fn async_stream<F, Fut>(body: F) -> impl Stream<Item = PrefixEvent> + Send + 'static
where
    F: FnOnce(tokio::sync::mpsc::Sender<PrefixEvent>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let task = tokio::spawn(body(tx));
    struct Abort(tokio::task::JoinHandle<()>);
    impl Drop for Abort {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let guard = Abort(task);
    futures::stream::unfold((rx, guard), |(mut rx, guard)| async move { rx.recv().await.map(|e| (e, (rx, guard))) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges() {
        assert_eq!(prefix_end("/calico/a/"), b"/calico/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), vec![b'a', 0x80]);
    }

    #[test]
    fn watch_messages_are_read_as_the_gateway_writes_them() {
        let put = json!({ "result": { "header": { "revision": "9" }, "events": [
            { "kv": { "key": b64(b"/p/a"), "value": b64(b"{}"), "mod_revision": "9" } },
            { "type": "DELETE", "kv": { "key": b64(b"/p/b"), "mod_revision": "9" } },
        ]}});
        assert_eq!(
            watch_events("/p/", &put).unwrap(),
            vec![
                PrefixEvent::Put(Kv { key: "/p/a".into(), value: b"{}".to_vec(), mod_revision: 9 }),
                PrefixEvent::Deleted("/p/b".into()),
            ]
        );
        let created = json!({ "result": { "header": { "revision": "9" }, "created": true } });
        assert!(watch_events("/p/", &created).unwrap().is_empty());
        let compacted = json!({ "result": { "compact_revision": "4", "canceled": true } });
        assert!(matches!(watch_events("/p/", &compacted), Err(EtcdError::Compacted { revision: 4, .. })));
        let error = json!({ "error": { "grpc_code": 14, "message": "etcdserver: no leader" } });
        assert!(matches!(watch_events("/p/", &error), Err(EtcdError::Refused { .. })));
    }

    #[test]
    fn settings_are_checked_before_anything_is_sent() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let cfg = |e: &str| EtcdConfig { endpoints: vec![e.into()], ..Default::default() };
        assert!(matches!(Etcd::new(&EtcdConfig::default()), Err(EtcdError::NoEndpoints)));
        assert!(matches!(Etcd::new(&cfg("127.0.0.1:2379")), Err(EtcdError::Endpoint(_))));
        assert!(matches!(Etcd::new(&cfg("https://127.0.0.1:2379")), Err(EtcdError::NoCa)));
        assert!(Etcd::new(&cfg("http://127.0.0.1:2379")).is_ok());
        let half = EtcdConfig { cert_file: Some("/x".into()), ..cfg("http://127.0.0.1:2379") };
        assert!(matches!(Etcd::new(&half), Err(EtcdError::HalfClientCert)));
        // A client certificate with a plain endpoint (one of several): refused, named.
        let plain = EtcdConfig {
            endpoints: vec!["https://10.0.0.1:2379".into(), "http://10.0.0.2:2379".into()],
            ca_cert_file: Some("/x/ca.pem".into()),
            cert_file: Some("/x/cert.pem".into()),
            key_file: Some("/x/key.pem".into()),
        };
        let err = Etcd::new(&plain).err().unwrap();
        assert!(matches!(&err, EtcdError::PlainWithClientCert(e) if e == "http://10.0.0.2:2379"), "{err}");
        let missing = EtcdConfig { ca_cert_file: Some("/nonexistent/ca.pem".into()), ..cfg("https://127.0.0.1:2379") };
        let err = Etcd::new(&missing).err().unwrap().to_string();
        assert!(err.contains("/nonexistent/ca.pem"), "{err}");
    }

    /// An endpoint that answers, but not as etcd's gateway does (the gateway switched off,
    /// or not etcd at all), gets a message that says so instead of a decoding error.
    #[tokio::test]
    async fn an_endpoint_without_the_gateway_is_named_as_such() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let _ =
                    conn.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 19\r\n\r\n404 page not found\n").await;
            }
        });
        let etcd = Etcd::new(&EtcdConfig { endpoints: vec![format!("http://{addr}")], ..Default::default() }).unwrap();
        let err = etcd.get("/x").await.unwrap_err().to_string();
        assert!(err.contains("gateway") && err.contains("404"), "{err}");
    }

    /// A call to an etcd that is not there says which endpoints it tried, within its bound.
    #[tokio::test]
    async fn an_unreachable_etcd_is_a_clear_error() {
        let etcd =
            Etcd::new(&EtcdConfig { endpoints: vec!["http://127.0.0.1:1".into()], ..Default::default() }).unwrap();
        let started = std::time::Instant::now();
        let err = etcd.get("/x").await.unwrap_err();
        assert!(matches!(err, EtcdError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("http://127.0.0.1:1"), "{err}");
        assert!(started.elapsed() < UNREACHABLE_FOR + Duration::from_secs(2));
    }
}
