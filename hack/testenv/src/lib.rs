//! capo's local test control plane: a real etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler and kwok (fake nodes and kubelets), built from the Go module proxy by
//! `hack/build-controlplane.sh` and started on 127.0.0.1 with free ports, plus Calico's
//! IPAM: `capo-calico-ipam` (`hack/calico-ipam`, Calico's own IPAM library at v3.28.5,
//! built by `hack/build-calico-ipam.sh`) gives Pods their IPs and finishes their
//! deletions, as calico-ipam and a kubelet would (see docs/calico.md).
//!
//! - Tests call [`shared`] to get the control plane of their test binary (started once,
//!   gone when the binary exits, even after a panic), or set `CAPO_TEST_KUBECONFIG` to
//!   attach to one that is already running (`make testenv-up`).
//! - [`TestNamespace`] gives each test its own namespace.
//! - The `capo-testenv` binary behind `make testenv-up`/`testenv-down` runs the same code.

pub mod argocd;
mod binaries;
mod calico_apiserver;
mod etcd_cluster;
mod kubeconfig;
mod nodes;
mod pki;
mod process;
pub mod real_node;
pub mod route;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kube::Client;

pub use binaries::{locate_calico_apiserver, locate_calico_ipam};
pub use etcd_cluster::EtcdCluster;
pub use nodes::{KWOK_NODE_ANNOTATION, node_names};
use process::Component;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("generating the {what}: {source}")]
    Certificate { what: &'static str, source: rcgen::Error },
    #[error("{script} failed ({status}); see its output above")]
    Build { script: PathBuf, status: String },
    #[error(
        "{path} is missing; run hack/build-controlplane.sh and hack/build-calico-ipam.sh, or unset CAPO_TESTENV_BIN and CAPO_CALICO_IPAM"
    )]
    MissingBinary { path: PathBuf },
    #[error("{component} exited ({status}); its log is {log}")]
    Exited { component: &'static str, status: String, log: PathBuf },
    #[error("timed out after {after:?} waiting for {what}; logs are in {state_dir}")]
    Timeout { what: String, after: Duration, state_dir: PathBuf },
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig { path: PathBuf, message: String },
    #[error("kwok stages {path}: {message}")]
    KwokStages { path: PathBuf, message: String },
    #[error("{program} {args}: {stderr}")]
    Command { program: PathBuf, args: String, stderr: String },
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// How to start a control plane.
#[derive(Clone, Debug)]
pub struct Options {
    /// Where certificates, etcd data, logs and the kubeconfig go.
    pub state_dir: PathBuf,
    /// How many kwok nodes to create (`kwok-node-0`, ...).
    pub nodes: usize,
    /// Write an audit log of every write to Calico's IPReservations, capo's records and
    /// Leases (`<state_dir>/audit.log`, JSON lines), so tests can count writes as the API
    /// server saw them.
    pub audit: bool,
    /// Further kube-apiserver flags (e.g. `--admission-control-config-file`).
    pub apiserver_args: Vec<String>,
    /// A real node beside the kwok nodes (see [`real_node`]): containerd, a real kubelet
    /// and Calico's own CNI plugin (Calico on the Kubernetes or etcd datastore).
    pub real_node: bool,
}

/// Calico in the control plane: which datastore Calico's IPAM library uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Calico {
    /// No Calico at all: no Calico CRDs and no IPAM driver; kwok runs its own "fast" stages
    /// (it gives Pods IPs and finishes deletions itself, by name).
    Off,
    /// The Kubernetes datastore (`crd.projectcalico.org/v1` CRDs in the API server), as
    /// most clusters run Calico. The default.
    #[default]
    Kubernetes,
    /// Calico's etcd datastore: a separate etcd with TLS and client certificates, as
    /// kubeasz-style installs run it (see [`CalicoEtcd`]).
    Etcd,
    /// The Kubernetes datastore with calico-apiserver (Calico's aggregated API server,
    /// v3.28.5) serving `projectcalico.org/v3` behind an APIService, as a view of the
    /// `crd.projectcalico.org/v1` objects: the arrangement of clusters installed by
    /// Calico's operator before 3.32 (see `calico_apiserver.rs`).
    ApiServer,
}

/// Calico's own etcd (with [`Calico::Etcd`]): what Calico's components are given as
/// `ETCD_ENDPOINTS`, `ETCD_CA_CERT_FILE`, `ETCD_CERT_FILE` and `ETCD_KEY_FILE`.
#[derive(Clone, Debug)]
pub struct CalicoEtcd {
    pub endpoints: String,
    /// Beside a real node: the endpoints its Pods use (this machine's address; Pods cannot
    /// reach its loopback).
    pub pod_endpoints: Option<String>,
    pub ca_cert_file: PathBuf,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

impl CalicoEtcd {
    /// The environment Calico's components (and `capo-calico-ipam`) read.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("DATASTORE_TYPE".into(), "etcdv3".into()),
            ("ETCD_ENDPOINTS".into(), self.endpoints.clone()),
            ("ETCD_CA_CERT_FILE".into(), self.ca_cert_file.display().to_string()),
            ("ETCD_CERT_FILE".into(), self.cert_file.display().to_string()),
            ("ETCD_KEY_FILE".into(), self.key_file.display().to_string()),
        ]
    }
}

impl Options {
    pub fn new(state_dir: impl Into<PathBuf>, nodes: usize) -> Self {
        Self { state_dir: state_dir.into(), nodes, audit: false, apiserver_args: Vec::new(), real_node: false }
    }
}

/// What the audit log records (see [`Options::audit`]).
const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Request
  verbs: ["create", "update", "patch", "delete"]
  resources:
  - group: "crd.projectcalico.org"
    resources: ["ipreservations"]
  - group: "projectcalico.org"
    resources: ["ipreservations"]
  - group: "capo.io"
    resources: ["reservedips", "reservedips/status"]
  - group: "coordination.k8s.io"
    resources: ["leases"]
- level: None
"#;

/// A running control plane. Its processes stop when it is dropped, or when the thread
/// that started it exits.
pub struct ControlPlane {
    pub state_dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub server: String,
    pub calico: Calico,
    /// Calico's etcd, with [`Calico::Etcd`].
    pub calico_etcd: Option<CalicoEtcd>,
    components: Vec<Component>,
    /// The `kubernetes` Service's address on this machine, for Pods on the real node.
    api_forwarder: Option<real_node::Forwarder>,
}

/// The name of the IPAM driver's component (and log, `capo-calico-ipam.log`).
pub const CALICO_IPAM: &str = "capo-calico-ipam";

/// Ports handed out by [`free_port`] lie here: below Linux's ephemeral range (32768 and up
/// by default), where the kernel picks the local port of every outgoing connection. A
/// port asked of the kernel (`:0`) comes from that range, and a client connecting before
/// the component binds it could take it: a CI run failed on exactly that
/// ("kube-scheduler … bind: address already in use").
const PORTS: std::ops::Range<u16> = 20_000..32_000;

/// The ports this process may hand out: `CAPO_TESTENV_PORTS` (`<first>-<last>`), which
/// the suite runner (hack/suite) sets to a range of its own for each test binary it runs
/// at the same time as others, or [`PORTS`].
fn port_range() -> std::ops::Range<u16> {
    static RANGE: OnceLock<std::ops::Range<u16>> = OnceLock::new();
    RANGE
        .get_or_init(|| {
            let Some(spec) = std::env::var("CAPO_TESTENV_PORTS").ok() else {
                return PORTS;
            };
            match parse_port_range(&spec) {
                Some(range) => range,
                None => panic!("CAPO_TESTENV_PORTS={spec:?}: expected <first>-<last>, e.g. 20000-20999"),
            }
        })
        .clone()
}

fn parse_port_range(spec: &str) -> Option<std::ops::Range<u16>> {
    let (first, last) = spec.split_once('-')?;
    let (first, last): (u16, u16) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first > 0 && first < last && last < u16::MAX).then(|| first..last + 1)
}

/// A port nothing listens on now, not handed out before by this process.
fn free_port() -> Result<u16, Error> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let mut x = (seed as u64)
        ^ ((std::process::id() as u64) << 32)
        ^ (given.len() as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let range = port_range();
    let span = (range.end - range.start) as u64;
    for _ in 0..1_000 {
        // xorshift64: enough to spread the picks of concurrent test processes.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = range.start + (x % span) as u16;
        if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return Ok(port);
        }
    }
    let l = TcpListener::bind("127.0.0.1:0").map_err(|source| Error::Io { path: "127.0.0.1:0".into(), source })?;
    Ok(l.local_addr().map_err(|source| Error::Io { path: "127.0.0.1:0".into(), source })?.port())
}

fn path_arg(flag: &str, path: &Path) -> String {
    format!("--{flag}={}", path.display())
}

impl ControlPlane {
    /// Builds (or finds cached) binaries and starts every component with Calico's IPAM on
    /// the Kubernetes datastore, returning once the API server is ready, the IPAM driver
    /// serves and every kwok node is `Ready`.
    pub fn start(opts: Options) -> Result<Self, Error> {
        Self::start_with(opts, Calico::default())
    }

    /// [`ControlPlane::start`] with the given Calico.
    pub fn start_with(opts: Options, calico: Calico) -> Result<Self, Error> {
        let state = opts.state_dir.clone();
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        std::fs::create_dir_all(&state).map_err(io(&state))?;
        let state = std::fs::canonicalize(&state).map_err(io(&state))?;
        std::fs::write(state.join("pid"), std::process::id().to_string()).map_err(io(&state))?;
        let bin = binaries::locate()?;
        let calico_dir = match calico {
            Calico::Off => None,
            _ => Some(binaries::locate_calico_ipam()?),
        };
        let pki_dir = state.join("pki");
        std::fs::create_dir_all(&pki_dir).map_err(io(&pki_dir))?;
        let pki = pki::write(&pki_dir)?;
        let p = |name: &str| pki_dir.join(name);

        let (etcd_port, etcd_peer, api_port) = (free_port()?, free_port()?, free_port()?);
        let server = format!("https://127.0.0.1:{api_port}");
        let kubeconfig = state.join("kubeconfig");
        kubeconfig::write(&kubeconfig, &server, &pki)?;
        let mut cp = ControlPlane {
            state_dir: state.clone(),
            kubeconfig: kubeconfig.clone(),
            server,
            calico,
            calico_etcd: None,
            components: vec![],
            api_forwarder: None,
        };

        let mut audit_args = opts.apiserver_args.clone();
        if opts.audit {
            let policy = state.join("audit-policy.yaml");
            std::fs::write(&policy, AUDIT_POLICY).map_err(io(&policy))?;
            audit_args.extend([
                path_arg("audit-policy-file", &policy),
                path_arg("audit-log-path", &state.join("audit.log")),
                "--audit-log-format=json".into(),
                "--audit-log-mode=blocking".into(),
                "--audit-log-maxsize=1024".into(),
            ]);
        }
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        cp.spawn(
            "etcd",
            &bin.join("etcd"),
            vec![
                path_arg("data-dir", &state.join("etcd")),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
        )?;
        cp.spawn(
            "kube-apiserver",
            &bin.join("kube-apiserver"),
            audit_args
                .into_iter()
                .chain([
                    format!("--etcd-servers={etcd_url}"),
                    format!("--secure-port={api_port}"),
                    "--bind-address=127.0.0.1".into(),
                    "--advertise-address=127.0.0.1".into(),
                    path_arg("tls-cert-file", &p("apiserver.crt")),
                    path_arg("tls-private-key-file", &p("apiserver.key")),
                    path_arg("client-ca-file", &p("ca.crt")),
                    path_arg("cert-dir", &pki_dir),
                    "--authorization-mode=Node,RBAC".into(),
                    "--service-cluster-ip-range=10.0.0.0/24".into(),
                    "--service-account-issuer=https://kubernetes.default.svc".into(),
                    path_arg("service-account-key-file", &p("sa.pub")),
                    path_arg("service-account-signing-key-file", &p("sa.key")),
                    "--endpoint-reconciler-type=none".into(),
                    // Webhooks behind a Service are called at the Service's endpoints, so a
                    // capo outside the cluster can be reached through the manifests' Service
                    // (see route.rs).
                    "--enable-aggregator-routing=true".into(),
                    // Namespaces are created by tests right before their Pods; do not race the
                    // service-account controller for the default ServiceAccount. Pods on the
                    // real node run with their ServiceAccount's token, as in any cluster.
                    if opts.real_node {
                        "--enable-admission-plugins=ServiceAccount".into()
                    } else {
                        "--disable-admission-plugins=ServiceAccount".into()
                    },
                    "--allow-privileged=true".into(),
                    // The front proxy, as kubeadm sets it up: aggregated API servers
                    // (calico-apiserver) learn who is asking from these headers.
                    path_arg("proxy-client-cert-file", &p("front-proxy-client.crt")),
                    path_arg("proxy-client-key-file", &p("front-proxy-client.key")),
                    path_arg("requestheader-client-ca-file", &p("front-proxy-ca.crt")),
                    format!("--requestheader-allowed-names={}", pki::FRONT_PROXY_CLIENT),
                    "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
                    "--requestheader-group-headers=X-Remote-Group".into(),
                    "--requestheader-username-headers=X-Remote-User".into(),
                    // The real node's kubelet is reached at its address, not its name, and
                    // trusts the CA's certificates (logs, exec).
                    "--kubelet-preferred-address-types=InternalIP".into(),
                    path_arg("kubelet-client-certificate", &p("admin.crt")),
                    path_arg("kubelet-client-key", &p("admin.key")),
                    "--v=1".into(),
                ])
                .collect(),
        )?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(io(&state))?;
        rt.block_on(cp.wait_api_ready(Duration::from_secs(90)))?;

        let kcm_port = free_port()?;
        cp.spawn(
            "kube-controller-manager",
            &bin.join("kube-controller-manager"),
            vec![
                path_arg("kubeconfig", &kubeconfig),
                path_arg("authentication-kubeconfig", &kubeconfig),
                path_arg("authorization-kubeconfig", &kubeconfig),
                format!("--secure-port={kcm_port}"),
                "--bind-address=127.0.0.1".into(),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=true".into(),
                path_arg("service-account-private-key-file", &p("sa.key")),
                path_arg("root-ca-file", &p("ca.crt")),
                format!(
                    "--controllers=namespace-controller,garbage-collector-controller,statefulset-controller,\
                     replicaset-controller,deployment-controller,disruption-controller,serviceaccount-controller,\
                     serviceaccount-token-controller,pod-garbage-collector-controller,job-controller,\
                     daemonset-controller,node-lifecycle-controller,taint-eviction-controller{}",
                    // Services of Pods on the real node get their endpoints, and its Pods the
                    // cluster CA (kube-root-ca.crt), as in a cluster
                    // (elsewhere tests write them: route.rs).
                    if opts.real_node {
                        ",endpoints-controller,endpointslice-controller,root-ca-certificate-publisher-controller"
                    } else {
                        ""
                    }
                ),
                "--concurrent-gc-syncs=5".into(),
                "--v=1".into(),
            ],
        )?;
        let sched_port = free_port()?;
        cp.spawn(
            "kube-scheduler",
            &bin.join("kube-scheduler"),
            vec![
                path_arg("kubeconfig", &kubeconfig),
                path_arg("authentication-kubeconfig", &kubeconfig),
                path_arg("authorization-kubeconfig", &kubeconfig),
                format!("--secure-port={sched_port}"),
                "--bind-address=127.0.0.1".into(),
                "--leader-elect=false".into(),
                "--v=1".into(),
            ],
        )?;
        if let Some(dir) = &calico_dir {
            cp.start_calico_ipam(dir, opts.real_node)?;
        }
        let stages = state.join("kwok-stages.yaml");
        if calico == Calico::Off {
            // No Calico: kwok's own stages, so kwok gives Pods IPs (and deletes them) itself.
            std::fs::copy(bin.join("kwok-stages.yaml"), &stages).map_err(io(&stages))?;
        } else {
            kwok_stages(&bin.join("kwok-stages.yaml"), &stages)?;
        }
        let kwok_port = free_port()?;
        cp.spawn(
            "kwok",
            &bin.join("kwok"),
            vec![
                path_arg("kubeconfig", &kubeconfig),
                path_arg("config", &stages),
                "--manage-all-nodes=false".into(),
                format!("--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"),
                format!("--server-address=127.0.0.1:{kwok_port}"),
                "--node-lease-duration-seconds=40".into(),
            ],
        )?;
        rt.block_on(async {
            let client = cp.client().await?;
            nodes::create(&client, opts.nodes).await?;
            if calico_dir.is_some() {
                cp.wait_calico_ipam(Duration::from_secs(90)).await?;
            }
            if calico == Calico::ApiServer {
                cp.start_calico_apiserver(&client).await?;
            }
            cp.wait_nodes_ready(&client, opts.nodes, Duration::from_secs(60)).await?;
            if opts.real_node {
                cp.start_real_node(&client).await?;
            }
            Ok::<_, Error>(())
        })?;
        Ok(cp)
    }

    fn spawn(&mut self, name: &'static str, program: &Path, args: Vec<String>) -> Result<(), Error> {
        self.spawn_with_env(name, program, args, &[])
    }

    fn spawn_with_env(
        &mut self,
        name: &'static str,
        program: &Path,
        args: Vec<String>,
        env: &[(String, String)],
    ) -> Result<(), Error> {
        let launch = process::Launch {
            program: program.to_path_buf(),
            args,
            env: env.iter().map(|(k, v)| (k.clone(), Some(v.clone()))).collect(),
        };
        let c = Component::launch(name, launch, &self.state_dir)?;
        self.components.push(c);
        Ok(())
    }

    /// Starts the IPAM driver (and, for [`Calico::Etcd`], Calico's etcd first). It installs
    /// Calico's CRDs (Kubernetes datastore) and the IP pools, then serves Pods.
    /// With a real node its garbage collection runs every 2 s (not 30 s), so a test sees
    /// within seconds that it leaves the real node's handles alone.
    fn start_calico_ipam(&mut self, dir: &Path, real_node: bool) -> Result<(), Error> {
        let state = self.state_dir.clone();
        let mut args = vec![
            "run".to_string(),
            path_arg("kubeconfig", &self.kubeconfig),
            path_arg("ready-file", &state.join(format!("{CALICO_IPAM}.ready"))),
        ];
        if real_node {
            args.push("--gc-interval=2s".into());
        }
        let mut env = vec![];
        match self.calico {
            Calico::Off => return Ok(()),
            Calico::Kubernetes | Calico::ApiServer => {
                args.push("--datastore=kubernetes".into());
                args.push(path_arg("crds", &dir.join(binaries::CALICO_CRDS)));
            }
            Calico::Etcd => {
                let etcd = self.start_calico_etcd(real_node)?;
                env = etcd.env();
                args.push("--datastore=etcdv3".into());
                self.calico_etcd = Some(etcd);
            }
        }
        self.spawn_with_env(CALICO_IPAM, &dir.join(binaries::CALICO_IPAM_BINARY), args, &env)
    }

    /// A second etcd, for Calico only, serving TLS and requiring client certificates.
    /// Beside a real node it also listens on this machine's address, for capo's Pods.
    fn start_calico_etcd(&mut self, real_node: bool) -> Result<CalicoEtcd, Error> {
        let state = self.state_dir.clone();
        let dir = state.join("pki").join("calico-etcd");
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
        let node_ip = if real_node { Some(real_node::node_ip()?) } else { None };
        let pki = pki::write_etcd(&dir, node_ip)?;
        let bin = binaries::locate()?;
        let (port, peer) = (free_port()?, free_port()?);
        let loopback = format!("https://127.0.0.1:{port}");
        let pod_endpoints = node_ip.map(|ip| format!("https://{ip}:{port}"));
        let url = match &pod_endpoints {
            Some(pods) => format!("{loopback},{pods}"),
            None => loopback.clone(),
        };
        let peer_url = format!("http://127.0.0.1:{peer}");
        self.spawn(
            "calico-etcd",
            &bin.join("etcd"),
            vec![
                "--name=calico".into(),
                path_arg("data-dir", &state.join("calico-etcd")),
                format!("--listen-client-urls={url}"),
                format!("--advertise-client-urls={url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=calico={peer_url}"),
                path_arg("cert-file", &pki.server_cert),
                path_arg("key-file", &pki.server_key),
                path_arg("trusted-ca-file", &pki.ca),
                "--client-cert-auth=true".into(),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
        )?;
        Ok(CalicoEtcd {
            endpoints: loopback,
            pod_endpoints,
            ca_cert_file: pki.ca,
            cert_file: pki.client_cert,
            key_file: pki.client_key,
        })
    }

    /// Waits until the IPAM driver has set Calico up and its informers are synced.
    async fn wait_calico_ipam(&mut self, limit: Duration) -> Result<(), Error> {
        let ready = self.state_dir.join(format!("{CALICO_IPAM}.ready"));
        let deadline = Instant::now() + limit;
        loop {
            self.check_components()?;
            if ready.exists() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.timeout("capo-calico-ipam to set Calico IPAM up", limit));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Pids of the running components, in start order.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        self.components.iter().map(|c| (c.name, c.pid())).collect()
    }

    pub async fn client(&self) -> Result<Client, Error> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    fn check_components(&mut self) -> Result<(), Error> {
        let state = self.state_dir.clone();
        self.components.iter_mut().try_for_each(|c| c.ensure_running(&state))
    }

    fn timeout(&self, what: &str, after: Duration) -> Error {
        Error::Timeout { what: what.to_string(), after, state_dir: self.state_dir.clone() }
    }

    async fn wait_api_ready(&mut self, limit: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + limit;
        loop {
            self.check_components()?;
            if let Ok(client) = self.client().await {
                let req = http::Request::get("/readyz").body(Vec::new()).expect("static request");
                if client.request_text(req).await.is_ok_and(|body| body.trim() == "ok") {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(self.timeout("kube-apiserver /readyz", limit));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn wait_nodes_ready(&mut self, client: &Client, count: usize, limit: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + limit;
        loop {
            self.check_components()?;
            if nodes::ready_count(client).await? >= count {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.timeout("kwok nodes to become Ready", limit));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Restarts one component (e.g. `kube-apiserver`) with the same flags and, for the API
    /// server, waits until it is ready again.
    pub async fn restart(&mut self, name: &str) -> Result<(), Error> {
        let state = self.state_dir.clone();
        let c = self.components.iter_mut().find(|c| c.name == name).ok_or_else(|| Error::Timeout {
            what: format!("no component {name}"),
            after: Duration::ZERO,
            state_dir: state.clone(),
        })?;
        if name == CALICO_IPAM {
            let _ = std::fs::remove_file(state.join(format!("{CALICO_IPAM}.ready")));
        }
        c.restart(&state)?;
        match name {
            "kube-apiserver" => self.wait_api_ready(Duration::from_secs(90)).await?,
            CALICO_IPAM => self.wait_calico_ipam(Duration::from_secs(90)).await?,
            _ => {}
        }
        Ok(())
    }

    /// Stops every component, newest first, and takes away what a real node made.
    pub fn stop(&mut self) {
        self.api_forwarder = None;
        while let Some(mut c) = self.components.pop() {
            if c.name == "kubelet" {
                // Its Pods' containers would outlive it: clean() stops them all at once.
                real_node::clean(&self.state_dir);
            }
            c.stop(Duration::from_secs(5));
        }
        real_node::clean(&self.state_dir);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A client for the admin kubeconfig at `path`.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client, Error> {
    Ok(Client::try_from(config_from_kubeconfig(path).await?)?)
}

/// The client configuration for the kubeconfig at `path`. Tests see every answer as the
/// server gave it: the client's automatic retry of 429/503 answers is off.
pub async fn config_from_kubeconfig(path: &Path) -> Result<kube::Config, Error> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .map_err(|e| Error::Kubeconfig { path: path.to_path_buf(), message: e.to_string() })?;
    let mut config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| Error::Kubeconfig { path: path.to_path_buf(), message: e.to_string() })?;
    config.default_retry = false;
    Ok(config)
}

/// Where a test binary's control plane keeps its state; stale ones (their test binary is
/// gone) are removed when the next one starts.
fn test_state_root() -> PathBuf {
    std::env::var_os("CAPO_TESTENV_STATE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("capo-testenv"))
}

fn sweep_stale(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let pid = std::fs::read_to_string(entry.path().join("pid")).ok().and_then(|s| s.trim().parse::<i32>().ok());
        if pid.is_none_or(|pid| !process::alive(pid)) {
            real_node::clean(&entry.path());
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A state directory for something a test binary starts next to a control plane it is
/// attached to (`CAPO_TEST_KUBECONFIG`); removed by the next start's sweep once the test
/// binary is gone.
fn attached_state_dir(what: &str) -> PathBuf {
    let root = test_state_root();
    sweep_stale(&root);
    let dir = root.join(format!("{}-{what}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("pid"), std::process::id().to_string());
    dir
}

/// The control plane a test binary talks to.
pub struct Shared {
    pub kubeconfig: PathBuf,
    /// Present when this test binary started it (absent when attached).
    pub state_dir: Option<PathBuf>,
    /// The Calico it was started with (attached: assumed the default).
    pub calico: Calico,
}

impl Shared {
    pub async fn client(&self) -> Client {
        client_from_kubeconfig(&self.kubeconfig).await.expect("client for the test control plane")
    }
}

static SHARED: OnceLock<Shared> = OnceLock::new();
static STATE_DIR: OnceLock<PathBuf> = OnceLock::new();
/// The shared control plane's processes, stopped and reaped at exit.
static SHARED_PIDS: OnceLock<Vec<libc::pid_t>> = OnceLock::new();

/// At exit: kills the shared control plane's processes and waits for them, so that their
/// CPU time counts in this test binary's own (what the suite runner reports, read with
/// `wait4`), then removes the state.
extern "C" fn remove_state_at_exit() {
    for &pid in SHARED_PIDS.get().into_iter().flatten() {
        // SAFETY: kill(2) and waitpid(2) on this process's own children.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
    }
    if let Some(dir) = STATE_DIR.get() {
        real_node::clean(dir);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The control plane of this test binary: attached through `CAPO_TEST_KUBECONFIG`, or
/// started on first use by a dedicated thread that lives as long as the process, so the
/// components die with the test binary however it ends. Started with Calico's IPAM on the
/// Kubernetes datastore, unless [`shared_with`] started it first.
pub fn shared() -> &'static Shared {
    SHARED.get().unwrap_or_else(|| shared_with(Calico::default()))
}

/// [`shared`] started with the given Calico; a test binary that needs another Calico than
/// the default calls this first.
pub fn shared_with(calico: Calico) -> &'static Shared {
    let shared = SHARED.get_or_init(|| {
        if let Some(path) = std::env::var_os("CAPO_TEST_KUBECONFIG") {
            return Shared { kubeconfig: PathBuf::from(path), state_dir: None, calico: Calico::default() };
        }
        let root = test_state_root();
        sweep_stale(&root);
        let state_dir = root.join(format!("{}", std::process::id()));
        let (tx, rx) = std::sync::mpsc::channel();
        let opts = Options::new(state_dir.clone(), 2);
        std::thread::Builder::new()
            .name("capo-testenv".into())
            .spawn(move || {
                // A component can lose its port to another control plane starting in the
                // same test binary at the same moment (ports are picked free, then bound
                // by the component): start again, up to three times.
                let mut started = ControlPlane::start_with(opts.clone(), calico);
                for attempt in 2..=3 {
                    let Err(e) = &started else { break };
                    eprintln!("capo-testenv: the control plane did not start ({e}); attempt {attempt}");
                    let _ = std::fs::remove_dir_all(&opts.state_dir);
                    started = ControlPlane::start_with(opts.clone(), calico);
                }
                if let Ok(cp) = &started {
                    let _ = SHARED_PIDS.set(cp.pids().into_iter().map(|(_, pid)| pid as libc::pid_t).collect());
                }
                let result = started.as_ref().map(|cp| cp.kubeconfig.clone()).map_err(|e| e.to_string());
                let _ = tx.send(result);
                // Keep the processes' parent thread alive for the life of the process;
                // PR_SET_PDEATHSIG kills them when it goes.
                let _keep = started;
                loop {
                    std::thread::park();
                }
            })
            .expect("spawn the testenv thread");
        let kubeconfig = rx.recv().expect("testenv thread").unwrap_or_else(|e| panic!("test control plane: {e}"));
        let _ = STATE_DIR.set(state_dir.clone());
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe {
            libc::atexit(remove_state_at_exit);
        }
        Shared { kubeconfig, state_dir: Some(state_dir), calico }
    });
    assert!(
        shared.state_dir.is_none() || shared.calico == calico,
        "this test binary's control plane runs with Calico {:?}, not {calico:?}",
        shared.calico
    );
    shared
}

/// A namespace of the test's own, named `<prefix>-<n>`; labelled so a test can select it.
pub struct TestNamespace {
    pub name: String,
}

impl TestNamespace {
    pub async fn create(client: &Client, prefix: &str) -> TestNamespace {
        Self::create_with_labels(client, prefix, &[]).await
    }

    pub async fn create_with_labels(client: &Client, prefix: &str, labels: &[(&str, &str)]) -> TestNamespace {
        use k8s_openapi::api::core::v1::Namespace;
        use kube::api::{Api, PostParams};
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id() % 100_000);
        let mut all: std::collections::BTreeMap<String, String> =
            labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        all.insert("capo-test".into(), "true".into());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "labels": all }
        }))
        .expect("namespace");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        TestNamespace { name }
    }
}

/// capo's Pod stages for kwok: Pods run, but get no IPs from kwok and are not deleted by
/// kwok (capo-calico-ipam does both, see the file).
const KWOK_POD_STAGES: &str = include_str!("../kwok-pod-stages.yaml");

/// Writes kwok's stage configuration to `to`: the Node stages of kwok's own "fast" set
/// (`from`, written by hack/build-controlplane.sh) and capo's Pod stages.
/// `CAPO_TESTENV_KWOK_STAGES` names a file to use instead, as it is (to compare with
/// kwok's own Pod stages, say).
fn kwok_stages(from: &Path, to: &Path) -> Result<(), Error> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    if let Some(file) = std::env::var_os("CAPO_TESTENV_KWOK_STAGES") {
        std::fs::copy(&file, to).map_err(io(Path::new(&file)))?;
        return Ok(());
    }
    let kwok = std::fs::read_to_string(from).map_err(io(from))?;
    let mut out = String::new();
    let stages: Vec<serde_json::Value> = serde_saphyr::from_str_multiple(&kwok)
        .map_err(|e| Error::KwokStages { path: from.to_path_buf(), message: e.to_string() })?;
    for stage in stages {
        if stage["spec"]["resourceRef"]["kind"] == "Node" {
            let yaml = serde_saphyr::to_string(&stage).expect("a JSON value serializes");
            out.push_str("---\n");
            out.push_str(&yaml);
        }
    }
    out.push_str("---\n");
    out.push_str(KWOK_POD_STAGES);
    std::fs::write(to, out).map_err(io(to))
}

#[cfg(test)]
mod port_tests {
    use super::*;

    #[test]
    fn a_port_range_is_two_ports_in_order() {
        assert_eq!(parse_port_range("20000-20999"), Some(20_000..21_000));
        assert_eq!(parse_port_range(" 21000 - 21001 "), Some(21_000..21_002));
        for bad in ["", "20000", "20999-20000", "0-10", "20000-65535", "a-b", "20000-"] {
            assert_eq!(parse_port_range(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_port().unwrap()).collect();
        assert!(ports.iter().all(|p| port_range().contains(p)), "{ports:?}");
        let distinct: std::collections::BTreeSet<&u16> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}
