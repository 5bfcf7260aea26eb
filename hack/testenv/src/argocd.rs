//! A real Argo CD next to the test control plane: redis, the repo server and the
//! application controller, built by `hack/build-argocd.sh` and run out of cluster on
//! 127.0.0.1 with free ports. The controller's in-cluster destination
//! (`https://kubernetes.default.svc`) is the control plane of the kubeconfig it is given
//! (`ARGOCD_FAKE_IN_CLUSTER`). Like the control plane's, every process dies with the
//! thread that started it (`PR_SET_PDEATHSIG`).
//!
//! - [`locate`] finds (or builds) the binaries; [`install`] writes what Argo CD's own
//!   install manifests would (its CRDs, the namespace, `argocd-cm`, `argocd-secret`, the
//!   `default` AppProject); [`ArgoCd::start`] runs the processes.
//! - Tests call [`shared`]: started once per test binary, on the binary's control plane.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tracing::info;

use crate::Error;
use crate::process::{Component, Launch};

/// What `hack/build-argocd.sh` leaves in its cache directory.
pub const PARTS: [&str; 6] = ["argocd", "kustomize", "helm", "git-verify-wrapper.sh", "crds", "version"];

/// The label Argo CD reads its settings ConfigMap and Secret by.
const PART_OF: (&str, &str) = ("app.kubernetes.io/part-of", "argocd");

/// The directory of the Argo CD build: `CAPO_ARGOCD_DIR`, or what `hack/build-argocd.sh`
/// prints (it builds on first use, then answers from its cache).
pub fn locate() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("CAPO_ARGOCD_DIR") {
        let dir = PathBuf::from(dir);
        check(&dir)?;
        return Ok(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../build-argocd.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|source| Error::Io { path: script.clone(), source })?;
    if !out.status.success() {
        return Err(Error::Build { script, status: out.status.to_string() });
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim());
    check(&dir)?;
    Ok(dir)
}

fn check(dir: &Path) -> Result<(), Error> {
    PARTS.iter().map(|p| dir.join(p)).find(|p| !p.exists()).map_or(Ok(()), |path| Err(Error::MissingBinary { path }))
}

/// The Argo CD version of a build directory (`v3.6.1`).
pub fn version(dir: &Path) -> Result<String, Error> {
    let path = dir.join("version");
    std::fs::read_to_string(&path).map(|v| v.trim().to_string()).map_err(|source| Error::Io { path, source })
}

/// How to run Argo CD.
#[derive(Clone, Debug)]
pub struct Options {
    /// The build directory ([`locate`]).
    pub dir: PathBuf,
    /// The admin kubeconfig of the control plane Argo CD manages (and runs against).
    pub kubeconfig: PathBuf,
    /// Where logs, the repo server's checkouts and redis's files go.
    pub state_dir: PathBuf,
    /// Argo CD's namespace (Applications, AppProjects, settings).
    pub namespace: String,
    /// How often the controller refreshes every Application (`--app-resync`, whole
    /// seconds; 3 minutes in a default install).
    pub resync: Duration,
}

/// Running Argo CD processes; they stop when this is dropped, or when the thread that
/// started them exits.
pub struct ArgoCd {
    pub namespace: String,
    pub resync: Duration,
    pub version: String,
    pub state_dir: PathBuf,
    pub redis: SocketAddr,
    pub repo_server: SocketAddr,
    components: Vec<Component>,
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl ArgoCd {
    /// Starts redis, the repo server and the application controller, and returns once
    /// each listens. Argo CD's objects must be installed first ([`install`]).
    pub fn start(opts: Options) -> Result<Self, Error> {
        let state = &opts.state_dir;
        for dir in [state.join("tmp"), state.join("home"), state.join("redis")] {
            std::fs::create_dir_all(&dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
        }
        let (redis, repo_server) = (local(crate::free_port()?), local(crate::free_port()?));
        let mut argo = ArgoCd {
            namespace: opts.namespace.clone(),
            resync: opts.resync,
            version: version(&opts.dir)?,
            state_dir: state.clone(),
            redis,
            repo_server,
            components: vec![],
        };
        argo.launch("redis-server", redis_launch(state, redis), redis)?;
        argo.launch("argocd-repo-server", repo_server_launch(&opts, redis, repo_server), repo_server)?;
        let metrics = local(crate::free_port()?);
        argo.launch("argocd-application-controller", controller_launch(&opts, redis, repo_server, metrics), metrics)?;
        info!(version = %argo.version, %redis, %repo_server, "Argo CD is running");
        Ok(argo)
    }

    /// Starts one process and waits until it accepts connections on `addr`.
    fn launch(&mut self, name: &'static str, launch: Launch, addr: SocketAddr) -> Result<(), Error> {
        let mut c = Component::launch(name, launch, &self.state_dir)?;
        let limit = Duration::from_secs(60);
        let deadline = Instant::now() + limit;
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            c.ensure_running(&self.state_dir)?;
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("{name} to listen on {addr}"),
                    after: limit,
                    state_dir: self.state_dir.clone(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.components.push(c);
        Ok(())
    }

    /// Pids of the running processes, in start order.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        self.components.iter().map(|c| (c.name, c.pid())).collect()
    }

    /// Fails if a process has exited.
    pub fn ensure_running(&mut self) -> Result<(), Error> {
        let state = self.state_dir.clone();
        self.components.iter_mut().try_for_each(|c| c.ensure_running(&state))
    }

    /// Stops every process, newest first.
    pub fn stop(&mut self) {
        while let Some(mut c) = self.components.pop() {
            c.stop(Duration::from_secs(5));
        }
    }
}

impl Drop for ArgoCd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn set(key: &str, value: impl Into<String>) -> (String, Option<String>) {
    (key.to_string(), Some(value.into()))
}

/// redis as Argo CD's cache: loopback only, nothing written to disk.
fn redis_launch(state: &Path, addr: SocketAddr) -> Launch {
    let args = ["--bind", "127.0.0.1", "--port", &addr.port().to_string(), "--save", "", "--appendonly", "no"];
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    args.extend(["--dir".into(), state.join("redis").display().to_string()]);
    Launch { program: "redis-server".into(), args, env: vec![] }
}

/// What both Argo CD processes share: the multi-call binary, the build directory first on
/// PATH (kustomize, helm, `git-verify-wrapper.sh` and `argocd` itself, which git calls as
/// its credential helper), a home and a temporary directory of their own, plain-text logs.
fn argocd_launch(opts: &Options, component: &str, args: Vec<String>) -> Launch {
    let path = std::env::var("PATH").unwrap_or_default();
    let env = vec![
        set("ARGOCD_BINARY_NAME", component),
        set("PATH", format!("{}:{path}", opts.dir.display())),
        set("KUBECONFIG", opts.kubeconfig.display().to_string()),
        set("HOME", opts.state_dir.join("home").display().to_string()),
        set("TMPDIR", opts.state_dir.join("tmp").display().to_string()),
        // No user or system git configuration leaks into the repo server's git.
        set("GIT_CONFIG_NOSYSTEM", "1"),
    ];
    let mut all: Vec<String> = vec!["--logformat".into(), "text".into(), "--loglevel".into(), "info".into()];
    all.extend(args);
    Launch { program: opts.dir.join("argocd"), args: all, env }
}

fn repo_server_launch(opts: &Options, redis: SocketAddr, addr: SocketAddr) -> Launch {
    let metrics = crate::free_port().unwrap_or(0);
    let args = vec![
        format!("--address={}", addr.ip()),
        format!("--port={}", addr.port()),
        "--metrics-address=127.0.0.1".into(),
        format!("--metrics-port={metrics}"),
        format!("--redis={redis}"),
        // Plain gRPC on loopback (the controller is told so), so no client CA either.
        "--disable-tls".into(),
        "--client-ca-path=".into(),
    ];
    let mut launch = argocd_launch(opts, "argocd-repo-server", args);
    // No GnuPG keyring to set up (signature verification is an AppProject option).
    launch.env.push(set("ARGOCD_GPG_ENABLED", "false"));
    launch
}

fn controller_launch(opts: &Options, redis: SocketAddr, repo_server: SocketAddr, metrics: SocketAddr) -> Launch {
    let args = vec![
        format!("--namespace={}", opts.namespace),
        format!("--repo-server={repo_server}"),
        "--repo-server-plaintext".into(),
        format!("--redis={redis}"),
        format!("--metrics-port={}", metrics.port()),
        format!("--app-resync={}", opts.resync.as_secs().max(1)),
        "--app-resync-jitter=0".into(),
        // Resource health in the Application's status (Argo CD 3 keeps it in redis by
        // default), where kubectl and the tests can read it.
        "--persist-resource-health=true".into(),
    ];
    let mut launch = argocd_launch(opts, "argocd-application-controller", args);
    launch.env.extend([set("ARGOCD_FAKE_IN_CLUSTER", "true"), set("ARGOCD_CONTROLLER_REPLICAS", "1")]);
    launch
}

/// Writes what Argo CD's install manifests would: its CRDs (from the build directory),
/// the namespace, an `argocd-cm` and an `argocd-secret` labelled as Argo CD's settings
/// (left alone if they exist: users patch argocd-cm), and the `default` AppProject.
pub async fn install(client: &Client, dir: &Path, namespace: &str) -> Result<(), Error> {
    install_crds(client, &dir.join("crds")).await?;
    create_if_absent(
        &Api::<Namespace>::all(client.clone()),
        serde_json::from_value(json!({ "metadata": { "name": namespace } })).expect("namespace"),
    )
    .await?;
    let labels = json!({ PART_OF.0: PART_OF.1 });
    let cm = json!({ "metadata": { "name": "argocd-cm", "labels": labels } });
    create_if_absent(&Api::<ConfigMap>::namespaced(client.clone(), namespace), serde_json::from_value(cm).expect("cm"))
        .await?;
    // argocd-server writes server.secretkey on its first start; there is no argocd-server here.
    let secret = json!({ "metadata": { "name": "argocd-secret", "labels": labels },
                         "stringData": { "server.secretkey": random_key()? } });
    create_if_absent(
        &Api::<Secret>::namespaced(client.clone(), namespace),
        serde_json::from_value(secret).expect("secret"),
    )
    .await?;
    let projects = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &app_project());
    let default = json!({ "apiVersion": "argoproj.io/v1alpha1", "kind": "AppProject",
        "metadata": { "name": "default", "namespace": namespace },
        "spec": { "sourceRepos": ["*"], "destinations": [{ "server": "*", "namespace": "*" }],
                  "clusterResourceWhitelist": [{ "group": "*", "kind": "*" }] } });
    create_if_absent(&projects, serde_json::from_value(default).expect("project")).await
}

async fn create_if_absent<K>(api: &Api<K>, obj: K) -> Result<(), Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn random_key() -> Result<String, Error> {
    use base64::Engine;
    let mut bytes = [0u8; 32];
    let path = PathBuf::from("/dev/urandom");
    std::fs::File::open(&path)
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| Error::Io { path, source })?;
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// The `AppProject` resource.
pub fn app_project() -> kube::api::ApiResource {
    argo_resource("AppProject", "appprojects")
}

/// The `Application` resource.
pub fn application() -> kube::api::ApiResource {
    argo_resource("Application", "applications")
}

fn argo_resource(kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "argoproj.io".into(),
        version: "v1alpha1".into(),
        api_version: "argoproj.io/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Applies (server side) every CRD in `dir` and waits until each is Established.
async fn install_crds(client: &Client, dir: &Path) -> Result<(), Error> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let mut names = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).map_err(io(dir))?.flatten().map(|e| e.path()).collect();
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let crd: CustomResourceDefinition = serde_saphyr::from_str(&text)
            .map_err(|e| Error::Kubeconfig { path: path.clone(), message: format!("not a CRD: {e}") })?;
        let name = crd.name_any();
        api.patch(&name, &PatchParams::apply("capo-testenv").force(), &Patch::Apply(crd)).await?;
        names.push(name);
    }
    let limit = Duration::from_secs(60);
    let deadline = Instant::now() + limit;
    for name in names {
        loop {
            let crd = api.get(&name).await?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Established" && c.status == "True"));
            if established {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: format!("CRD {name} Established"),
                    after: limit,
                    state_dir: dir.into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// The Argo CD of a test binary.
pub struct Shared {
    pub namespace: String,
    pub resync: Duration,
    pub version: String,
    pub state_dir: PathBuf,
}

static SHARED: OnceLock<Shared> = OnceLock::new();

/// The namespace the tests' Argo CD works in.
pub const TEST_NAMESPACE: &str = "argocd";

/// The test binary's Argo CD, on the test binary's control plane ([`crate::shared`]):
/// installed and started on first use by a dedicated thread that lives as long as the
/// process, so its processes die with the test binary however it ends. It refreshes
/// every Application every `resync` (the first caller's value counts).
pub fn shared(resync: Duration) -> &'static Shared {
    SHARED.get_or_init(|| {
        let cp = crate::shared();
        let kubeconfig = cp.kubeconfig.clone();
        let state_dir = match &cp.state_dir {
            Some(dir) => dir.join("argocd"),
            None => crate::attached_state_dir("argocd"),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let thread_state = state_dir.clone();
        std::thread::Builder::new()
            .name("capo-testenv-argocd".into())
            .spawn(move || {
                let started = start_installed(kubeconfig, thread_state, resync);
                let _ = tx.send(started.as_ref().map(|a| a.version.clone()).map_err(|e| e.to_string()));
                // The processes' parent thread lives as long as the process.
                let _keep = started;
                loop {
                    std::thread::park();
                }
            })
            .expect("spawn the Argo CD thread");
        let version = rx.recv().expect("Argo CD thread").unwrap_or_else(|e| panic!("Argo CD: {e}"));
        Shared { namespace: TEST_NAMESPACE.into(), resync, version, state_dir }
    })
}

fn start_installed(kubeconfig: PathBuf, state_dir: PathBuf, resync: Duration) -> Result<ArgoCd, Error> {
    let dir = locate()?;
    std::fs::create_dir_all(&state_dir).map_err(|source| Error::Io { path: state_dir.clone(), source })?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Io { path: state_dir.clone(), source })?;
    rt.block_on(async {
        let client = crate::client_from_kubeconfig(&kubeconfig).await?;
        install(&client, &dir, TEST_NAMESPACE).await
    })?;
    ArgoCd::start(Options { dir, kubeconfig, state_dir, namespace: TEST_NAMESPACE.into(), resync })
}
