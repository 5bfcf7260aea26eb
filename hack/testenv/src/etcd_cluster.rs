//! A three-member (or any size) etcd cluster of its own, plain http on loopback, for tests
//! of what capo does when one member stops answering while the others go on: a member can
//! be paused (SIGSTOP: its connections stay open and silent, as a member cut off behind a
//! stalled network looks to a client) and resumed, or isolated from its peers while it
//! still answers its clients (a network partition).
//!
//! Isolation: every member advertises a peer URL that is a proxy in front of its real peer
//! port. etcd's peer transport names the sending member on each connection it opens
//! (`X-Server-From`, its member ID in hex), so the proxy of the receiving member can refuse
//! the connections of an isolated member, and every connection to an isolated member.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

use crate::process::{Component, Launch};
use crate::{Error, binaries, free_port};

pub struct EtcdCluster {
    members: Vec<Component>,
    endpoints: Vec<String>,
    state_dir: PathBuf,
    peers: Arc<Peers>,
    proxies: Vec<JoinHandle<()>>,
}

/// What the peer proxies share: which members are cut off, who is who, and the
/// connections open between members.
#[derive(Default)]
struct Peers {
    isolated: Mutex<HashSet<usize>>,
    /// Member ID (hex, as `X-Server-From` gives it) → member index.
    ids: Mutex<HashMap<String, usize>>,
    /// The proxied connections (some may have ended).
    open: Mutex<Vec<AbortHandle>>,
}

impl Peers {
    fn refused(&self, from: Option<usize>, to: usize) -> bool {
        let isolated = self.isolated.lock().expect("peers lock");
        isolated.contains(&to) || from.is_some_and(|f| isolated.contains(&f))
    }
}

/// The head of the first request on a peer connection (up to its blank line), and the
/// sending member's ID from its `X-Server-From` header.
async fn read_head(stream: &mut TcpStream) -> Option<(Vec<u8>, Option<String>)> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > 16 * 1024 {
            return None;
        }
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let from = text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim().eq_ignore_ascii_case("x-server-from").then(|| value.trim().to_ascii_lowercase())
    });
    Some((head, from))
}

/// Accepts peer connections for member `to` on `listener` and passes each to `target`
/// unless the sender or `to` is isolated.
async fn proxy(listener: TcpListener, to: usize, target: String, peers: Arc<Peers>) {
    while let Ok((mut inbound, _)) = listener.accept().await {
        let (peers, target) = (peers.clone(), target.clone());
        let task = tokio::spawn({
            let peers = peers.clone();
            async move {
                let Some((head, from)) = read_head(&mut inbound).await else { return };
                let from = from.and_then(|id| peers.ids.lock().expect("peers lock").get(&id).copied());
                if peers.refused(from, to) {
                    return;
                }
                let Ok(mut outbound) = TcpStream::connect(&target).await else { return };
                if outbound.write_all(&head).await.is_err() {
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
        let mut open = peers.open.lock().expect("peers lock");
        open.retain(|t| !t.is_finished());
        open.push(task.abort_handle());
    }
}

/// Names of the members' log files (`<state_dir>/<name>.log`).
const NAMES: [&str; 5] = ["etcd-m0", "etcd-m1", "etcd-m2", "etcd-m3", "etcd-m4"];

impl EtcdCluster {
    /// Starts `size` members (at most 5) under `state_dir` and waits until the cluster
    /// answers a linearizable read at every member.
    pub async fn start(state_dir: &Path, size: usize) -> Result<Self, Error> {
        assert!((1..=NAMES.len()).contains(&size), "1 to {} members", NAMES.len());
        std::fs::create_dir_all(state_dir).map_err(|source| Error::Io { path: state_dir.to_path_buf(), source })?;
        let bin = binaries::locate()?;
        let mut ports = Vec::new();
        for _ in 0..size {
            ports.push((free_port()?, free_port()?, free_port()?));
        }
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, _, advertised))| format!("{}=http://127.0.0.1:{advertised}", NAMES[i]))
            .collect::<Vec<_>>()
            .join(",");
        let peers = Arc::new(Peers::default());
        let mut proxies = Vec::new();
        for (i, (_, peer, advertised)) in ports.iter().enumerate() {
            let addr = format!("127.0.0.1:{advertised}");
            let listener = TcpListener::bind(&addr)
                .await
                .map_err(|source| Error::Io { path: PathBuf::from(format!("peer proxy {addr}")), source })?;
            proxies.push(tokio::spawn(proxy(listener, i, format!("127.0.0.1:{peer}"), peers.clone())));
        }
        let mut members = Vec::new();
        let mut endpoints = Vec::new();
        for (i, (client, peer, advertised)) in ports.iter().enumerate() {
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let advertised_url = format!("http://127.0.0.1:{advertised}");
            let launch = Launch {
                program: bin.join("etcd"),
                args: vec![
                    format!("--name={}", NAMES[i]),
                    format!("--data-dir={}", state_dir.join(NAMES[i]).display()),
                    format!("--listen-client-urls={url}"),
                    format!("--advertise-client-urls={url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={advertised_url}"),
                    format!("--initial-cluster={initial}"),
                    "--initial-cluster-state=new".into(),
                    "--initial-cluster-token=capo-test".into(),
                    "--heartbeat-interval=100".into(),
                    "--election-timeout=1000".into(),
                    "--unsafe-no-fsync=true".into(),
                    "--log-level=warn".into(),
                ],
                env: Vec::new(),
            };
            members.push(Component::launch(NAMES[i], launch, state_dir)?);
            endpoints.push(url);
        }
        let cluster = Self { members, endpoints, state_dir: state_dir.to_path_buf(), peers, proxies };
        cluster.wait_ready(Duration::from_secs(30)).await?;
        cluster.learn_ids().await?;
        Ok(cluster)
    }

    /// Reads the members' IDs, so that the proxies can tell who sends.
    async fn learn_ids(&self) -> Result<(), Error> {
        let addr = self.endpoints[0].trim_start_matches("http://");
        let answer = post(addr, "/v3/cluster/member/list", "{}").await.ok_or_else(|| Error::Timeout {
            what: "the etcd cluster's member list".into(),
            after: Duration::from_secs(2),
            state_dir: self.state_dir.clone(),
        })?;
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        let list: serde_json::Value = serde_json::from_str(body.trim()).unwrap_or_default();
        let mut ids = self.peers.ids.lock().expect("peers lock");
        for m in list["members"].as_array().into_iter().flatten() {
            let id = m["ID"].as_str().and_then(|s| s.parse::<u64>().ok()).or_else(|| m["ID"].as_u64());
            let index = NAMES.iter().position(|n| m["name"].as_str() == Some(*n));
            if let (Some(id), Some(index)) = (id, index) {
                ids.insert(format!("{id:x}"), index);
            }
        }
        if ids.len() != self.members.len() {
            return Err(Error::Timeout {
                what: format!("the IDs of all members (got {body})"),
                after: Duration::from_secs(2),
                state_dir: self.state_dir.clone(),
            });
        }
        Ok(())
    }

    /// Cuts member `i` off from its peers (both ways) while it goes on answering its
    /// clients: it loses its leader (or its followers) after an election timeout.
    pub fn isolate(&self, i: usize) {
        self.peers.isolated.lock().expect("peers lock").insert(i);
        let mut open = self.peers.open.lock().expect("peers lock");
        // Connections to `i`, and every connection whose sender may be `i` (the sender of
        // an open connection is not kept): the others reconnect at once, and `i`'s are
        // refused from now on.
        for task in open.drain(..) {
            task.abort();
        }
    }

    /// Lets member `i` reach its peers again.
    pub fn heal(&self, i: usize) {
        self.peers.isolated.lock().expect("peers lock").remove(&i);
    }

    /// The members' client URLs, in member order.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Stops member `i` where it is (SIGSTOP): its sockets stay open, nothing answers.
    pub fn pause(&self, i: usize) {
        signal(self.members[i].pid(), libc::SIGSTOP);
    }

    /// Lets member `i` go on (SIGCONT).
    pub fn resume(&self, i: usize) {
        signal(self.members[i].pid(), libc::SIGCONT);
    }

    async fn wait_ready(&self, limit: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + limit;
        for endpoint in &self.endpoints {
            let addr = endpoint.trim_start_matches("http://").to_string();
            loop {
                if linearizable_read(&addr).await {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(Error::Timeout {
                        what: format!("etcd cluster member {endpoint} to answer"),
                        after: limit,
                        state_dir: self.state_dir.clone(),
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for p in &self.proxies {
            p.abort();
        }
        for task in self.peers.open.lock().expect("peers lock").drain(..) {
            task.abort();
        }
        for m in &mut self.members {
            signal(m.pid(), libc::SIGCONT);
            m.stop(Duration::from_secs(5));
        }
        // The members' logs stay when a test failed.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        } else {
            for name in &NAMES[..self.members.len()] {
                let _ = std::fs::remove_dir_all(self.state_dir.join(name));
            }
        }
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A linearizable range read through the member's JSON gateway answers 200.
async fn linearizable_read(addr: &str) -> bool {
    post(addr, "/v3/kv/range", r#"{"key":"AA==","count_only":true}"#)
        .await
        .is_some_and(|a| a.starts_with("HTTP/1.1 200"))
}

/// POSTs `body` to `path` at `addr` (plain HTTP/1.1 by hand: the test environment has no
/// HTTP client of its own); the whole answer, if one came within 2 s.
async fn post(addr: &str, path: &str, body: &str) -> Option<String> {
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.ok()?;
        Some(String::from_utf8_lossy(&answer).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), attempt).await.ok().flatten()
}
