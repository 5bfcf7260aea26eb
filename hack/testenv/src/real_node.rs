//! A real node beside the kwok nodes (`Options::real_node`): containerd (v2.4.2, Debian's
//! runc) and a real kubelet built from the control plane's own Kubernetes module, whose
//! Pods get their network from Calico's own CNI plugin and IPAM (v3.28.5), configured
//! the way Calico's install writes `/etc/cni/net.d`. Built by `hack/build-real-node.sh`.
//!
//! Everything it makes lives under `<state_dir>/real-node` (containerd's root and state,
//! network namespaces, the kubelet's root, CNI configuration and logs) or in a cgroup of
//! its own (`/capo-<hash of the state dir>` in every controller); [`clean`] takes it all
//! away (processes, mounts, cgroups, and the few host paths containerd and the kubelet
//! hard-code, when they made them), so the machine is left as it was found. Stop, `down`,
//! the sweep of stale test state and a test binary's exit all call it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

use crate::{Calico, ControlPlane, Error, free_port, path_arg};

/// The real node's name (and its kubelet's certificate's `system:node:<name>`).
pub const REAL_NODE: &str = "real-node-0";
/// The sandbox image every Pod of the real node starts with.
pub const PAUSE_IMAGE: &str = "capo.local/pause:1";
/// A workload that listens on TCP (`LISTEN_ADDR`, default `:6379`) and answers each
/// connection with `$POD_NAME`: a stand-in for Redis or ZooKeeper.
pub const LISTEN_IMAGE: &str = "capo.local/listen:1";

/// capo's own image on the real node (`hack/build-image.sh`, imported at start).
pub const CAPO_IMAGE_REPOSITORY: &str = "capo.local/capo";

/// Paths containerd and the kubelet use whatever they are told: made by them when missing,
/// removed by [`clean`] when they were missing before the real node started.
const HARD_CODED: [&str; 4] = ["/run/containerd", "/var/lib/kubelet", "/run/calico", "/var/log/pods"];

/// Pods reach the API server at the `kubernetes` Service's address (their in-cluster
/// configuration: `KUBERNETES_SERVICE_HOST`, port 443). Without kube-proxy, this machine
/// takes that address on `lo` and a thread forwards its port 443 to the API server: what
/// kube-proxy's DNAT does in a cluster, as a userspace proxy. The address is removed by
/// [`clean`] (when the real node added it); the thread stops when dropped.
pub(crate) struct Forwarder {
    listener: std::net::TcpListener,
    stopped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Forwarder {
    async fn start(client: &Client, rn: &Path, server: &str) -> Result<Self, Error> {
        use std::net::{IpAddr, SocketAddr, TcpListener};
        let svc =
            Api::<k8s_openapi::api::core::v1::Service>::namespaced(client.clone(), "default").get("kubernetes").await?;
        let ip: IpAddr =
            svc.spec.and_then(|s| s.cluster_ip).and_then(|ip| ip.parse().ok()).ok_or_else(|| Error::Command {
                program: "kube-apiserver".into(),
                args: String::new(),
                stderr: "the kubernetes Service has no clusterIP".into(),
            })?;
        let port: u16 = server.rsplit(':').next().and_then(|p| p.trim_end_matches('/').parse().ok()).unwrap_or(443);
        let to = SocketAddr::from(([127, 0, 0, 1], port));
        let added = std::process::Command::new("ip")
            .args(["addr", "add", &format!("{ip}/32"), "dev", "lo"])
            .output()
            .map_err(|source| Error::Io { path: "ip".into(), source })?;
        if added.status.success() {
            write(&rn.join("api-address"), &ip.to_string())?;
        }
        let from = SocketAddr::new(ip, 443);
        let io = |source| Error::Io { path: format!("listening on {from}").into(), source };
        let listener = TcpListener::bind(from).map_err(io)?;
        let accepting = listener.try_clone().map_err(io)?;
        let stopped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = stopped.clone();
        std::thread::spawn(move || {
            for conn in accepting.incoming() {
                match conn {
                    Ok(conn) => {
                        std::thread::spawn(move || pipe(conn, to));
                    }
                    Err(_) if stop.load(std::sync::atomic::Ordering::SeqCst) => return,
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        Ok(Self { listener, stopped })
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        self.stopped.store(true, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: shutdown(2) on the listening socket this value owns wakes its accept.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// Copies one connection to `to` and back until either side closes.
fn pipe(conn: std::net::TcpStream, to: std::net::SocketAddr) {
    let Ok(upstream) = std::net::TcpStream::connect(to) else { return };
    let (Ok(mut up_r), Ok(mut down_w)) = (upstream.try_clone(), conn.try_clone()) else { return };
    let back = std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_r, &mut down_w);
        let _ = down_w.shutdown(std::net::Shutdown::Write);
    });
    let (mut down_r, mut up_w) = (conn, upstream);
    let _ = std::io::copy(&mut down_r, &mut up_w);
    let _ = up_w.shutdown(std::net::Shutdown::Write);
    let _ = back.join();
}

/// Where the real node keeps its state, under a control plane's state directory.
pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("real-node")
}

/// The log of Calico's CNI plugin (both `calico` and `calico-ipam`), with a millisecond
/// timestamp on each line.
pub fn cni_log(state_dir: &Path) -> PathBuf {
    dir(state_dir).join("cni").join("calico.log")
}

/// The cgroup (in every controller) the real node's Pods live under.
fn cgroup_root(state_dir: &Path) -> String {
    // FNV-1a: a short, stable name per state directory.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state_dir.as_os_str().as_encoded_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("capo-{:012x}", h & 0xffff_ffff_ffff)
}

/// The mount points of every cgroup hierarchy (v1 controllers and the v2 `unified` one).
fn cgroup_mounts() -> Vec<PathBuf> {
    mounts().into_iter().filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2").map(|m| m.point).collect()
}

struct Mount {
    point: PathBuf,
    fstype: String,
}

fn mounts() -> Vec<Mount> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = fields.get(4)?;
            let sep = fields.iter().position(|f| *f == "-")?;
            let fstype = fields.get(sep + 1)?;
            Some(Mount { point: PathBuf::from(unescape(point)), fstype: fstype.to_string() })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            if let Ok(n) = u8::from_str_radix(&code, 8) {
                out.push(n as char);
                continue;
            }
            out.push('\\');
            out.push_str(&code);
        } else {
            out.push(c);
        }
    }
    out
}

/// This machine's own address (the source of its default route), given to the kubelet as
/// `--node-ip`: the API server reaches kubelets there, never on loopback.
pub(crate) fn node_ip() -> Result<std::net::IpAddr, Error> {
    let io = |source| Error::Io { path: "udp socket".into(), source };
    let s = std::net::UdpSocket::bind("0.0.0.0:0").map_err(io)?;
    s.connect("192.0.2.255:9").or_else(|_| s.connect("10.255.255.255:9")).map_err(io)?;
    Ok(s.local_addr().map_err(io)?.ip())
}

fn runc() -> Result<PathBuf, Error> {
    for candidate in ["/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"] {
        if Path::new(candidate).is_file() {
            return Ok(candidate.into());
        }
    }
    Err(Error::MissingBinary { path: "runc (Debian's runc: make tools)".into() })
}

/// Runs a command to its end; its standard error is the error when it fails.
fn run(cmd: &mut std::process::Command) -> Result<(), Error> {
    let program = PathBuf::from(cmd.get_program());
    let args = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
    let out = cmd.output().map_err(|source| Error::Io { path: program.clone(), source })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Command { program, args, stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() })
}

fn write(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

fn mkdir(path: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

impl ControlPlane {
    /// Starts containerd and the kubelet of [`REAL_NODE`], imports the test images, and
    /// returns once the Node is `Ready`.
    pub(crate) async fn start_real_node(&mut self, client: &Client) -> Result<(), Error> {
        let build = crate::binaries::locate_real_node()?;
        let runc = runc()?;
        let state = self.state_dir.clone();
        let rn = dir(&state);
        // Which hard-coded host paths exist now: clean() removes the others.
        let existing: Vec<&str> = HARD_CODED.iter().copied().filter(|p| Path::new(p).exists()).collect();
        mkdir(&rn)?;
        write(&rn.join("preexisting"), &existing.join("\n"))?;
        for sub in ["containerd/root", "containerd/state", "cni/net.d", "cni/bin", "kubelet", "pods-logs"] {
            mkdir(&rn.join(sub))?;
        }
        let cgroup = cgroup_root(&state);
        for m in cgroup_mounts() {
            // The kubelet (cgroupfs driver, cgroup v1) wants its root in every controller.
            let _ = std::fs::create_dir_all(m.join(&cgroup));
        }

        if let Some(etcd) = self.calico_etcd.clone() {
            // On its etcd datastore Calico assigns only for hosts it knows: calico/node
            // registers its host when it starts; here the IPAM driver's `host` does.
            let driver = crate::binaries::locate_calico_ipam()?.join(crate::binaries::CALICO_IPAM_BINARY);
            let args = ["host", "--name", REAL_NODE, "--datastore=etcdv3"];
            run(std::process::Command::new(&driver).args(args).envs(etcd.env()))?;
        }
        // Calico's CNI plugin: one binary, installed as both plugins.
        for name in ["calico", "calico-ipam"] {
            let to = rn.join("cni/bin").join(name);
            std::fs::copy(build.join("cni/calico"), &to).map_err(|source| Error::Io { path: to.clone(), source })?;
        }
        write(&rn.join("cni/net.d/10-calico.conflist"), &self.cni_conflist(&rn))?;

        let sock = rn.join("containerd/containerd.sock");
        let config = rn.join("containerd/config.toml");
        write(&config, &containerd_config(&rn, &runc))?;
        let mut path = build.join("bin").display().to_string();
        path.push(':');
        path.push_str(&std::env::var("PATH").unwrap_or_default());
        self.spawn_with_env(
            "containerd",
            &build.join("bin/containerd"),
            vec![path_arg("config", &config), "--log-level=info".into()],
            &[("PATH".into(), path)],
        )?;
        self.wait_for("containerd's socket", Duration::from_secs(30), || sock.exists()).await?;
        let mut archives: Vec<PathBuf> =
            ["pause", "listen"].iter().map(|image| build.join("images").join(format!("{image}.tar"))).collect();
        // capo's own image (hack/build-image.sh), as [`CAPO_IMAGE_REPOSITORY`]`:<capo's version>`.
        archives.push(crate::binaries::locate_capo_image()?);
        for archive in archives {
            run(std::process::Command::new(build.join("bin/ctr"))
                .args(["--address", &sock.display().to_string(), "-n", "k8s.io", "images", "import"])
                .arg(&archive))?;
        }
        self.api_forwarder = Some(Forwarder::start(client, &rn, &self.server).await?);

        let kubelet_dir = rn.join("kubelet");
        let kubeconfig = rn.join("kubelet.kubeconfig");
        crate::kubeconfig::write_node(&kubeconfig, &self.server, &state.join("pki"))?;
        let kubelet_config = rn.join("kubelet-config.yaml");
        let port = free_port()?;
        write(&kubelet_config, &kubelet_config_yaml(&rn, &state, &sock, &cgroup, port))?;
        let ip = node_ip()?;
        self.spawn(
            "kubelet",
            &build.join("bin/kubelet"),
            vec![
                path_arg("config", &kubelet_config),
                path_arg("kubeconfig", &kubeconfig),
                path_arg("root-dir", &kubelet_dir),
                path_arg("cert-dir", &rn.join("kubelet-pki")),
                format!("--hostname-override={REAL_NODE}"),
                format!("--node-ip={ip}"),
                "--node-labels=type=real".into(),
                "--v=2".into(),
            ],
        )?;
        let nodes = Api::<Node>::all(client.clone());
        let limit = Duration::from_secs(60);
        let deadline = Instant::now() + limit;
        loop {
            self.check_components()?;
            let node = nodes.get_opt(REAL_NODE).await?;
            let ready = node
                .and_then(|n| n.status)
                .and_then(|s| s.conditions)
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.timeout("the real node to become Ready", limit));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn wait_for(&mut self, what: &str, limit: Duration, done: impl Fn() -> bool) -> Result<(), Error> {
        let deadline = Instant::now() + limit;
        loop {
            self.check_components()?;
            if done() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.timeout(what, limit));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Calico's CNI configuration as Calico's install writes it (`k8s-pod-network`,
    /// `calico` with `calico-ipam`), with the paths of this node. The `portmap` and
    /// `bandwidth` plugins Calico's manifest chains after it are left out: no test uses
    /// host ports or traffic shaping.
    fn cni_conflist(&self, rn: &Path) -> String {
        let mut calico = serde_json::json!({
            "type": "calico",
            "log_level": "debug",
            "log_file_path": rn.join("cni/calico.log"),
            "nodename": REAL_NODE,
            "nodename_file_optional": true,
            "mtu": 1440,
            "ipam": { "type": "calico-ipam" },
            "policy": { "type": "k8s" },
            "kubernetes": { "kubeconfig": self.kubeconfig },
            "ipam_lock_file": rn.join("cni/ipam.lock"),
        });
        match (&self.calico, &self.calico_etcd) {
            (Calico::Etcd, Some(etcd)) => {
                calico["datastore_type"] = "etcdv3".into();
                calico["etcd_endpoints"] = etcd.endpoints.clone().into();
                calico["etcd_ca_cert_file"] = etcd.ca_cert_file.display().to_string().into();
                calico["etcd_cert_file"] = etcd.cert_file.display().to_string().into();
                calico["etcd_key_file"] = etcd.key_file.display().to_string().into();
            }
            _ => calico["datastore_type"] = "kubernetes".into(),
        }
        serde_json::to_string_pretty(&serde_json::json!({
            "name": "k8s-pod-network",
            "cniVersion": "0.3.1",
            "plugins": [calico],
        }))
        .expect("JSON")
    }
}

/// containerd 2.x: every path under `rn`; the CRI plugin with Calico's CNI from `rn/cni`.
/// `restrict_oom_score_adj`: this machine cannot lower a process's `oom_score_adj` (the
/// kubelet asks -998 for sandboxes), and without it every sandbox fails in runc.
fn containerd_config(rn: &Path, runc: &Path) -> String {
    let d = |p: &str| rn.join(p).display().to_string();
    format!(
        r#"version = 3
root = "{root}"
state = "{state}"

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
    max_conf_num = 1
    use_internal_loopback = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
"#,
        root = d("containerd/root"),
        state = d("containerd/state"),
        sock = d("containerd/containerd.sock"),
        opt = d("containerd/opt"),
        pause = PAUSE_IMAGE,
        cni_bin = d("cni/bin"),
        cni_conf = d("cni/net.d"),
        runc = runc.display(),
    )
}

/// The kubelet: cgroupfs under its own cgroup root, cgroup v1 allowed (this machine has v1
/// controllers), swap allowed, no image garbage collection (the images are imported,
/// never pulled), no disk-pressure eviction, and the API server's CA for client
/// certificates (it reaches the kubelet for logs and exec).
fn kubelet_config_yaml(rn: &Path, state: &Path, sock: &Path, cgroup: &str, port: u16) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{sock}
podLogsDir: {logs}
port: {port}
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "0%", nodefs.available: "0%", imagefs.available: "0%"}}
resolvConf: ""
registerNode: true
syncFrequency: 5s
fileCheckFrequency: 5s
nodeStatusReportFrequency: 10s
serializeImagePulls: false
"#,
        sock = sock.display(),
        logs = rn.join("pods-logs").display(),
        ca = state.join("pki/ca.crt").display(),
    )
}

/// Takes away everything a real node under `state_dir` made, whatever state it is in
/// (running, crashed, half started): its processes (the kubelet, containerd and its
/// shims, by their command lines; the containers, by their cgroups), the mounts under its
/// directory (container root filesystems, network namespaces, volumes), its cgroups, and
/// the hard-coded host paths it made. Network interfaces and routes Calico's CNI plugin
/// made go with the network namespaces. Idempotent; nothing to do without a real node.
pub fn clean(state_dir: &Path) {
    let rn = dir(state_dir);
    if !rn.exists() {
        return;
    }
    let needle = rn.display().to_string();
    // The kubelet first, so it does not restart what goes next; then containerd and its
    // shims.
    for pass in ["kubelet", ""] {
        for pid in processes_mentioning(&needle, pass) {
            // SAFETY: kill(2) on a process whose command line names our own directory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    let cgroup = cgroup_root(state_dir);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut left = 0;
        for m in cgroup_mounts() {
            for pid in pids_in(&m.join(&cgroup)) {
                left += 1;
                // SAFETY: kill(2) on a process in the real node's own cgroup.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        left += processes_mentioning(&needle, "").len();
        if left == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Deepest first: a container's volumes lie inside its root filesystem.
    let mut under: Vec<PathBuf> = mounts().into_iter().map(|m| m.point).filter(|p| p.starts_with(&rn)).collect();
    under.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in under {
        if let Ok(c) = std::ffi::CString::new(point.as_os_str().as_encoded_bytes()) {
            // SAFETY: umount2 on a path under our own directory.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
    for m in cgroup_mounts() {
        remove_cgroup(&m.join(&cgroup));
    }
    if let Ok(ip) = std::fs::read_to_string(rn.join("api-address")) {
        let _ =
            std::process::Command::new("ip").args(["addr", "del", &format!("{}/32", ip.trim()), "dev", "lo"]).output();
    }
    let preexisting = std::fs::read_to_string(rn.join("preexisting")).unwrap_or_default();
    for path in HARD_CODED {
        if !preexisting.lines().any(|l| l == path) {
            let _ = std::fs::remove_dir_all(path);
        }
    }
    let _ = std::fs::remove_dir_all(&rn);
}

/// Pids whose command line contains `needle` (and, if not empty, whose program name is
/// `program`), this process excepted.
fn processes_mentioning(needle: &str, program: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<String> =
                cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
            let name_ok =
                program.is_empty() || args.first().and_then(|a| Path::new(a).file_name()).is_some_and(|n| n == program);
            name_ok && args.iter().any(|a| a.contains(needle))
        })
        .collect()
}

fn pids_in(cgroup: &Path) -> Vec<i32> {
    let mut pids = vec![];
    let mut stack = vec![cgroup.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            pids.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            stack.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
    }
    pids
}

/// Removes a cgroup and its children, deepest first (a cgroup directory goes with
/// rmdir(2), not with its files).
fn remove_cgroup(cgroup: &Path) {
    if let Ok(entries) = std::fs::read_dir(cgroup) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(cgroup);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_read_back() {
        assert_eq!(unescape(r"/a\040b\134c"), "/a b\\c");
        assert_eq!(unescape("/plain"), "/plain");
    }

    #[test]
    fn each_state_dir_has_its_own_cgroup() {
        let a = cgroup_root(Path::new("/tmp/capo-testenv/1"));
        let b = cgroup_root(Path::new("/tmp/capo-testenv/2"));
        assert_ne!(a, b);
        assert_eq!(a, cgroup_root(Path::new("/tmp/capo-testenv/1")));
    }
}
