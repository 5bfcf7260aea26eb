//! A three-member (or any size) etcd cluster of its own, plain http on loopback, for tests
//! of what capo does when one member stops answering while the others go on: a member can
//! be paused (SIGSTOP: its connections stay open and silent, as a member cut off behind a
//! stalled network looks to a client) and resumed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::process::{Component, Launch};
use crate::{Error, binaries, free_port};

pub struct EtcdCluster {
    members: Vec<Component>,
    endpoints: Vec<String>,
    state_dir: PathBuf,
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
            ports.push((free_port()?, free_port()?));
        }
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("{}=http://127.0.0.1:{peer}", NAMES[i]))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        let mut endpoints = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let launch = Launch {
                program: bin.join("etcd"),
                args: vec![
                    format!("--name={}", NAMES[i]),
                    format!("--data-dir={}", state_dir.join(NAMES[i]).display()),
                    format!("--listen-client-urls={url}"),
                    format!("--advertise-client-urls={url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
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
        let cluster = Self { members, endpoints, state_dir: state_dir.to_path_buf() };
        cluster.wait_ready(Duration::from_secs(30)).await?;
        Ok(cluster)
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

/// A linearizable range read through the member's JSON gateway (plain HTTP/1.1 by hand:
/// the test environment has no HTTP client of its own).
async fn linearizable_read(addr: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = r#"{"key":"AA==","count_only":true}"#;
    let request = format!(
        "POST /v3/kv/range HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.ok()?;
        Some(answer.starts_with(b"HTTP/1.1 200"))
    };
    tokio::time::timeout(Duration::from_secs(2), attempt).await.ok().flatten().unwrap_or(false)
}
