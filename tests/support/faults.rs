//! A fault-injecting proxy between capo's kube client and the real API server: capo talks
//! plain HTTP to it, it forwards with the admin credentials, and for requests matching a
//! rule it answers a chosen error (with `Retry-After`), adds latency, or drops the
//! connection instead.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{Method, Request, Response, StatusCode};
use kube::Client;

#[derive(Clone, Debug)]
pub enum Fault {
    /// Answer this HTTP status (a Kubernetes `Status` body), with `Retry-After` seconds.
    Status(u16, Option<u32>),
    /// Forward after this long.
    Delay(Duration),
    /// Close the connection without an answer.
    Drop,
    /// Forward the request (it lands), then close the connection without its answer.
    DropAnswer,
}

#[derive(Clone, Debug)]
pub struct Rule {
    pub method: Method,
    /// A substring of the path (and query).
    pub path: String,
    pub fault: Fault,
    /// Fire this many times, then let requests through (`None`: always).
    pub times: Option<usize>,
}

impl Rule {
    pub fn new(method: Method, path: &str, fault: Fault) -> Self {
        Self { method, path: path.to_string(), fault, times: None }
    }

    /// The same rule, firing only `n` times.
    pub fn times(mut self, n: usize) -> Self {
        self.times = Some(n);
        self
    }
}

#[derive(Clone)]
struct Shared {
    upstream: Client,
    rules: Arc<Mutex<Vec<Rule>>>,
    injected: Arc<std::sync::atomic::AtomicUsize>,
    /// Every request that reached the proxy: (method, path and query).
    log: Arc<Mutex<Vec<(Method, String)>>>,
    /// Requests held back by a `Delay` fault and not answered yet.
    delayed: Arc<std::sync::atomic::AtomicUsize>,
}

pub struct FaultProxy {
    pub url: String,
    shared: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(State(s): State<Shared>, req: Request<Body>) -> Response<Body> {
    let path = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
    s.log.lock().unwrap().push((req.method().clone(), path.clone()));
    let rule = {
        let mut rules = s.rules.lock().unwrap();
        let hit = rules.iter_mut().find(|r| r.method == req.method() && path.contains(&r.path) && r.times != Some(0));
        hit.map(|r| {
            if let Some(n) = r.times.as_mut() {
                *n -= 1;
            }
            r.clone()
        })
    };
    if let Some(rule) = &rule {
        s.injected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match &rule.fault {
            Fault::Status(code, retry_after) => {
                let body = serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": code,
                    "message": format!("injected fault: {code} for {} {path}", req.method()),
                    "reason": match code { 409 => "Conflict", 422 => "Invalid", 429 => "TooManyRequests", 503 => "ServiceUnavailable", _ => "InternalError" },
                });
                let mut resp = Response::builder().status(*code).header("content-type", "application/json");
                if let Some(s) = retry_after {
                    resp = resp.header("retry-after", s.to_string());
                }
                return resp.body(Body::from(body.to_string())).unwrap();
            }
            Fault::Delay(d) => {
                // The request is on the wire: it reaches the API server after the delay even
                // if its sender has given up on it meanwhile.
                s.delayed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (d, shared) = (*d, s.clone());
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let _done = DelayDone(shared.delayed.clone());
                    tokio::time::sleep(d).await;
                    let _ = tx.send(send(&shared, req, path).await);
                });
                return rx.await.unwrap_or_else(|_| Response::builder().status(502).body(Body::empty()).unwrap());
            }
            Fault::Drop | Fault::DropAnswer => {
                if matches!(rule.fault, Fault::DropAnswer) {
                    let _ = send(&s, req, path).await;
                }
                // A body that fails at once: the server aborts the connection.
                let failing =
                    futures::stream::once(async { Err::<axum::body::Bytes, _>(std::io::Error::other("dropped")) });
                return Response::builder().status(200).body(Body::from_stream(failing)).unwrap();
            }
        }
    }
    send(&s, req, path).await
}

/// Counts a delayed request as answered when dropped.
struct DelayDone(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for DelayDone {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn send(s: &Shared, req: Request<Body>, path: String) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    parts.headers.remove("host");
    parts.uri = path.parse().unwrap();
    let bytes = match http_body_util::BodyExt::collect(body).await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Response::builder().status(StatusCode::BAD_REQUEST).body(Body::empty()).unwrap(),
    };
    let upstream = Request::from_parts(parts, kube::client::Body::from(bytes.to_vec()));
    match s.upstream.send(upstream).await {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => Response::builder().status(StatusCode::BAD_GATEWAY).body(Body::from(e.to_string())).unwrap(),
    }
}

impl FaultProxy {
    pub async fn start(upstream: Client) -> FaultProxy {
        let shared = Shared {
            upstream,
            rules: Default::default(),
            injected: Default::default(),
            log: Default::default(),
            delayed: Default::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(forward).with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FaultProxy { url, shared, task }
    }

    /// A client that talks to the API server through the proxy, with kube's usual
    /// behaviour (its automatic retry of 429/503 included), as capo's own client.
    pub fn client(&self) -> Client {
        let config = kube::Config::new(self.url.parse().unwrap());
        Client::try_from(config).unwrap()
    }

    pub fn set(&self, rules: Vec<Rule>) {
        *self.shared.rules.lock().unwrap() = rules;
    }

    pub fn clear(&self) {
        self.shared.rules.lock().unwrap().clear();
    }

    /// The requests seen so far, as (method, path and query).
    pub fn requests(&self) -> Vec<(Method, String)> {
        self.shared.log.lock().unwrap().clone()
    }

    /// Forgets the requests seen so far.
    pub fn clear_requests(&self) {
        self.shared.log.lock().unwrap().clear();
    }

    /// How many requests a `Delay` fault holds back right now.
    pub fn delayed(&self) -> usize {
        self.shared.delayed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many requests got a fault.
    pub fn injected(&self) -> usize {
        self.shared.injected.load(std::sync::atomic::Ordering::Relaxed)
    }
}
