//! `capo-testenv up|down|status|route|argocd-up`: the local control plane by hand (`make
//! testenv-up`). `--calico etcd` runs Calico's IPAM on its own etcd (TLS, client
//! certificates; the environment Calico's components get is written to
//! `<state-dir>/calico-etcd.env`).
//!
//! `up` starts a detached supervisor (`serve`) that owns the component processes and
//! returns once the API server is ready and the kwok nodes are Ready. `route` points a
//! Service at a process on this machine (capo running outside the cluster, installed
//! from the chart or the manifests). `argocd-up` starts a second supervisor
//! (`argocd-serve`) that installs Argo CD's objects and runs its redis, repo server and
//! application controller against the control plane (`make try-argocd`); `down` stops
//! both.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use capo_testenv::{Calico, ControlPlane, Options};

const USAGE: &str =
    "usage: capo-testenv <up|down|status|serve> [--state-dir DIR] [--nodes N] [--calico kubernetes|etcd|apiserver|off] [--real-node]
       capo-testenv route <namespace>/<service> <port-name>=<local port> [--state-dir DIR]
       capo-testenv <argocd-up|argocd-serve> [--state-dir DIR] [--resync SECONDS]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut state_dir = PathBuf::from(".testenv");
    let mut nodes = 2usize;
    let mut calico = Calico::default();
    let mut resync = 10u64;
    let mut real_node = false;
    let mut cmd = None;
    let mut operands = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--state-dir" => state_dir = PathBuf::from(it.next().unwrap_or_else(|| fail(USAGE))),
            "--nodes" => nodes = it.next().and_then(|n| n.parse().ok()).unwrap_or_else(|| fail(USAGE)),
            "--calico" => {
                calico = match it.next().map(String::as_str) {
                    Some("kubernetes") => Calico::Kubernetes,
                    Some("etcd") => Calico::Etcd,
                    Some("apiserver") => Calico::ApiServer,
                    Some("off") => Calico::Off,
                    _ => fail(USAGE),
                }
            }
            "--real-node" => real_node = true,
            "--resync" => resync = it.next().and_then(|n| n.parse().ok()).unwrap_or_else(|| fail(USAGE)),
            "up" | "down" | "status" | "serve" | "route" | "argocd-up" | "argocd-serve" if cmd.is_none() => {
                cmd = Some(a.clone())
            }
            _ if cmd.as_deref() == Some("route") => operands.push(a.clone()),
            _ => fail(USAGE),
        }
    }
    match cmd.as_deref() {
        Some("route") => route(&state_dir, &operands),
        Some("up") => up(&state_dir, nodes, calico, real_node),
        Some("down") => down(&state_dir),
        Some("status") => status(&state_dir),
        Some("serve") => serve(&state_dir, nodes, calico, real_node),
        Some("argocd-up") => argocd_up(&state_dir, resync),
        Some("argocd-serve") => argocd_serve(&state_dir, Duration::from_secs(resync)),
        _ => fail(USAGE),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("capo-testenv: {msg}");
    std::process::exit(2)
}

fn supervisor_pid(state_dir: &Path) -> Option<i32> {
    pid_alive(&state_dir.join("supervisor.pid"))
}

/// The Argo CD supervisor's directory inside the control plane's state directory.
fn argocd_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("argocd")
}

fn pid_alive(file: &Path) -> Option<i32> {
    let pid = std::fs::read_to_string(file).ok()?.trim().parse().ok()?;
    // SAFETY: signal 0 only checks that the process exists.
    (unsafe { libc::kill(pid, 0) } == 0).then_some(pid)
}

fn calico_arg(calico: Calico) -> &'static str {
    match calico {
        Calico::Kubernetes => "kubernetes",
        Calico::Etcd => "etcd",
        Calico::ApiServer => "apiserver",
        Calico::Off => "off",
    }
}

fn up(state_dir: &Path, nodes: usize, calico: Calico, real_node: bool) {
    if supervisor_pid(state_dir).is_some() {
        println!("export KUBECONFIG={}", abs(state_dir).join("kubeconfig").display());
        eprintln!("capo-testenv: already running in {}", state_dir.display());
        return;
    }
    let _ = std::fs::remove_dir_all(state_dir);
    std::fs::create_dir_all(state_dir).unwrap_or_else(|e| fail(&format!("{}: {e}", state_dir.display())));
    let state_dir = abs(state_dir);
    let mut args =
        vec!["serve".to_string(), "--nodes".into(), nodes.to_string(), "--calico".into(), calico_arg(calico).into()];
    if real_node {
        args.push("--real-node".into());
    }
    // A cold build of the binaries included.
    let took = detach(&state_dir, &state_dir, &args, Duration::from_secs(30 * 60), "the control plane");
    eprintln!("capo-testenv: control plane ready in {:.1}s; logs in {}", took.as_secs_f64(), state_dir.display());
    println!("export KUBECONFIG={}", state_dir.join("kubeconfig").display());
}

/// Starts `capo-testenv <args> --state-dir <state_dir>` as a detached supervisor logging
/// to `<dir>/supervisor.log`, and waits until it writes `<dir>/ready`; returns how long
/// that took.
fn detach(state_dir: &Path, dir: &Path, args: &[String], limit: Duration, what: &str) -> Duration {
    let log_path = dir.join("supervisor.log");
    let log = std::fs::File::create(&log_path).unwrap_or_else(|e| fail(&e.to_string()));
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(&e.to_string()));
    let mut child = {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(exe);
        c.args(args).arg("--state-dir").arg(state_dir);
        c.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        c.process_group(0);
        c.spawn().unwrap_or_else(|e| fail(&format!("starting the supervisor: {e}")))
    };
    let started = Instant::now();
    let deadline = started + limit;
    loop {
        if dir.join("ready").exists() {
            return started.elapsed();
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            fail(&format!("{what} did not start ({status}):\n{log}"));
        }
        if Instant::now() > deadline {
            fail(&format!("timed out; see {}", log_path.display()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn serve(state_dir: &Path, nodes: usize, calico: Calico, real_node: bool) {
    std::fs::write(state_dir.join("supervisor.pid"), std::process::id().to_string())
        .unwrap_or_else(|e| fail(&e.to_string()));
    let mut opts = Options::new(state_dir, nodes);
    opts.real_node = real_node;
    let cp = ControlPlane::start_with(opts, calico).unwrap_or_else(|e| fail(&e.to_string()));
    for (name, pid) in cp.pids() {
        eprintln!("{name}: pid {pid}");
    }
    if let Some(etcd) = &cp.calico_etcd {
        // What Calico's components (and capo, for the etcd datastore) are given.
        let env: String = etcd.env().iter().map(|(k, v)| format!("export {k}={v}\n")).collect();
        std::fs::write(state_dir.join("calico-etcd.env"), env).unwrap_or_else(|e| fail(&e.to_string()));
    }
    std::fs::write(state_dir.join("ready"), &cp.server).unwrap_or_else(|e| fail(&e.to_string()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    });
    eprintln!("stopping");
    drop(cp);
}

fn down(state_dir: &Path) {
    if let Some(pid) = pid_alive(&argocd_dir(state_dir).join("supervisor.pid")) {
        stop_supervisor(pid);
        eprintln!("capo-testenv: Argo CD stopped");
    }
    if let Some(pid) = supervisor_pid(state_dir) {
        stop_supervisor(pid);
        eprintln!("capo-testenv: stopped");
    } else {
        eprintln!("capo-testenv: not running");
    }
    // A supervisor that was killed (SIGKILL) could not clean up after a real node.
    capo_testenv::real_node::clean(&abs(state_dir));
    let _ = std::fs::remove_dir_all(state_dir);
}

/// SIGTERM to a supervisor we started, SIGKILL after 30 s; its children die with it
/// (PR_SET_PDEATHSIG).
fn stop_supervisor(pid: i32) {
    // SAFETY: signalling the supervisor we started (signal 0 only checks it exists).
    let alive = || unsafe { libc::kill(pid, 0) } == 0;
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    if alive() {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Installs Argo CD's objects on the running control plane and starts a detached
/// supervisor for its processes; prints where its logs are.
fn argocd_up(state_dir: &Path, resync: u64) {
    let state_dir = abs(state_dir);
    if supervisor_pid(&state_dir).is_none() {
        fail("the control plane is not running (make testenv-up)");
    }
    let dir = argocd_dir(&state_dir);
    if pid_alive(&dir.join("supervisor.pid")).is_some() {
        eprintln!("capo-testenv: Argo CD already running; logs in {}", dir.display());
        return;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(&format!("{}: {e}", dir.display())));
    let args = ["argocd-serve".to_string(), "--resync".into(), resync.to_string()];
    // A cold build of Argo CD included.
    let took = detach(&state_dir, &dir, &args, Duration::from_secs(45 * 60), "Argo CD");
    let version = std::fs::read_to_string(dir.join("ready")).unwrap_or_default();
    eprintln!("capo-testenv: Argo CD {version} ready in {:.1}s; logs in {}", took.as_secs_f64(), dir.display());
}

/// The Argo CD supervisor: installs Argo CD's objects, runs its processes until SIGTERM.
fn argocd_serve(state_dir: &Path, resync: Duration) {
    let dir = argocd_dir(state_dir);
    std::fs::write(dir.join("supervisor.pid"), std::process::id().to_string()).unwrap_or_else(|e| fail(&e.to_string()));
    let build = capo_testenv::argocd::locate().unwrap_or_else(|e| fail(&e.to_string()));
    let kubeconfig = state_dir.join("kubeconfig");
    let namespace = capo_testenv::argocd::TEST_NAMESPACE.to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let client = capo_testenv::client_from_kubeconfig(&kubeconfig).await.unwrap_or_else(|e| fail(&e.to_string()));
        capo_testenv::argocd::install(&client, &build, &namespace).await.unwrap_or_else(|e| fail(&e.to_string()));
    });
    let opts = capo_testenv::argocd::Options { dir: build, kubeconfig, state_dir: dir.clone(), namespace, resync };
    let argo = capo_testenv::argocd::ArgoCd::start(opts).unwrap_or_else(|e| fail(&e.to_string()));
    for (name, pid) in argo.pids() {
        eprintln!("{name}: pid {pid}");
    }
    std::fs::write(dir.join("ready"), &argo.version).unwrap_or_else(|e| fail(&e.to_string()));
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    });
    eprintln!("stopping");
    drop(argo);
}

fn status(state_dir: &Path) {
    match supervisor_pid(state_dir) {
        Some(pid) => println!(
            "running (supervisor pid {pid}); export KUBECONFIG={}",
            abs(state_dir).join("kubeconfig").display()
        ),
        None => {
            println!("not running");
            std::process::exit(1)
        }
    }
}

/// `route capo-system/capo webhook=9443`: the Service's port `webhook` reaches port 9443
/// of this machine.
fn route(state_dir: &Path, operands: &[String]) {
    let [service, port] = operands else { fail(USAGE) };
    let (Some((namespace, service)), Some((port_name, port))) = (service.split_once('/'), port.split_once('=')) else {
        fail(USAGE)
    };
    let port: u16 = port.parse().unwrap_or_else(|_| fail(USAGE));
    let ip = capo_testenv::route::host_ip()
        .unwrap_or_else(|| fail("this machine has no non-loopback IPv4 address to route the Service to"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let client = capo_testenv::client_from_kubeconfig(&state_dir.join("kubeconfig"))
            .await
            .unwrap_or_else(|e| fail(&format!("is the control plane up (make testenv-up)? {e}")));
        let to = std::net::SocketAddr::new(ip, port);
        capo_testenv::route::route_service(&client, namespace, service, port_name, to)
            .await
            .unwrap_or_else(|e| fail(&format!("routing {namespace}/{service}: {e}")));
        println!("Service {namespace}/{service} port {port_name} -> {to}");
    });
}

fn abs(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}
