//! `capo-testenv up|down|status|route`: the local control plane by hand (`make testenv-up`).
//!
//! `up` starts a detached supervisor (`serve`) that owns the component processes and
//! returns once the API server is ready and the kwok nodes are Ready. `route` points a
//! Service at a process on this machine (capo running outside the cluster, installed
//! from the chart or the manifests).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use capo_testenv::{ControlPlane, Options};

const USAGE: &str = "usage: capo-testenv <up|down|status|serve> [--state-dir DIR] [--nodes N]
       capo-testenv route <namespace>/<service> <port-name>=<local port> [--state-dir DIR]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut state_dir = PathBuf::from(".testenv");
    let mut nodes = 2usize;
    let mut cmd = None;
    let mut operands = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--state-dir" => state_dir = PathBuf::from(it.next().unwrap_or_else(|| fail(USAGE))),
            "--nodes" => nodes = it.next().and_then(|n| n.parse().ok()).unwrap_or_else(|| fail(USAGE)),
            "up" | "down" | "status" | "serve" | "route" if cmd.is_none() => cmd = Some(a.clone()),
            _ if cmd.as_deref() == Some("route") => operands.push(a.clone()),
            _ => fail(USAGE),
        }
    }
    match cmd.as_deref() {
        Some("route") => route(&state_dir, &operands),
        Some("up") => up(&state_dir, nodes),
        Some("down") => down(&state_dir),
        Some("status") => status(&state_dir),
        Some("serve") => serve(&state_dir, nodes),
        _ => fail(USAGE),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("capo-testenv: {msg}");
    std::process::exit(2)
}

fn supervisor_pid(state_dir: &Path) -> Option<i32> {
    let pid = std::fs::read_to_string(state_dir.join("supervisor.pid")).ok()?.trim().parse().ok()?;
    // SAFETY: signal 0 only checks that the process exists.
    (unsafe { libc::kill(pid, 0) } == 0).then_some(pid)
}

fn up(state_dir: &Path, nodes: usize) {
    if supervisor_pid(state_dir).is_some() {
        println!("export KUBECONFIG={}", abs(state_dir).join("kubeconfig").display());
        eprintln!("capo-testenv: already running in {}", state_dir.display());
        return;
    }
    let _ = std::fs::remove_dir_all(state_dir);
    std::fs::create_dir_all(state_dir).unwrap_or_else(|e| fail(&format!("{}: {e}", state_dir.display())));
    let state_dir = abs(state_dir);
    let log_path = state_dir.join("supervisor.log");
    let log = std::fs::File::create(&log_path).unwrap_or_else(|e| fail(&e.to_string()));
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(&e.to_string()));
    let mut child = {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(exe);
        c.args(["serve", "--state-dir"]).arg(&state_dir).args(["--nodes", &nodes.to_string()]);
        c.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
        c.process_group(0);
        c.spawn().unwrap_or_else(|e| fail(&format!("starting the supervisor: {e}")))
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs(30 * 60); // a cold build of the binaries included
    loop {
        if state_dir.join("ready").exists() {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            fail(&format!("the control plane did not start ({status}):\n{log}"));
        }
        if Instant::now() > deadline {
            fail(&format!("timed out; see {}", log_path.display()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "capo-testenv: control plane ready in {:.1}s; logs in {}",
        started.elapsed().as_secs_f64(),
        state_dir.display()
    );
    println!("export KUBECONFIG={}", state_dir.join("kubeconfig").display());
}

fn serve(state_dir: &Path, nodes: usize) {
    std::fs::write(state_dir.join("supervisor.pid"), std::process::id().to_string())
        .unwrap_or_else(|e| fail(&e.to_string()));
    let cp = ControlPlane::start(Options::new(state_dir, nodes)).unwrap_or_else(|e| fail(&e.to_string()));
    for (name, pid) in cp.pids() {
        eprintln!("{name}: pid {pid}");
    }
    std::fs::write(state_dir.join("ready"), &cp.server).unwrap_or_else(|e| fail(&e.to_string()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        let client = cp.client().await.unwrap_or_else(|e| fail(&e.to_string()));
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
            _ = capo_testenv::ipam::run(client) => {},
        }
    });
    eprintln!("stopping");
    drop(cp);
}

fn down(state_dir: &Path) {
    if let Some(pid) = supervisor_pid(state_dir) {
        // SAFETY: signalling the supervisor we started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while supervisor_pid(state_dir).is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        if supervisor_pid(state_dir).is_some() {
            // SAFETY: as above; its children die with it (PR_SET_PDEATHSIG).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        eprintln!("capo-testenv: stopped");
    } else {
        eprintln!("capo-testenv: not running");
    }
    let _ = std::fs::remove_dir_all(state_dir);
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
