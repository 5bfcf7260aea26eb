//! A control plane of a test's own (with an audit log if asked), whose components can be
//! restarted. Its components die with the thread that started them, so that thread owns
//! it and takes restart requests until the handle is dropped.

use std::path::PathBuf;

use capo_testenv::{Calico, CalicoEtcd};

type Request = (String, std::sync::mpsc::Sender<Result<(), String>>);

pub struct PrivatePlane {
    pub kubeconfig: PathBuf,
    pub state_dir: PathBuf,
    /// Calico's etcd, with [`Calico::Etcd`].
    pub calico_etcd: Option<CalicoEtcd>,
    requests: Option<std::sync::mpsc::Sender<Request>>,
    owner: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PrivatePlane {
    /// Stops the components and removes the state before the test ends.
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(owner) = self.owner.take() {
            let _ = owner.join();
        }
    }
}

/// Starts a control plane named `name` with one kwok node; `audit` writes
/// `<state_dir>/audit.log` (see [`super::audit`]).
pub fn private_plane(name: &str, audit: bool) -> PrivatePlane {
    private_plane_with(name, audit, Calico::Kubernetes)
}

/// [`private_plane`] with Calico's IPAM on the given datastore.
pub fn private_plane_with(name: &str, audit: bool, calico: Calico) -> PrivatePlane {
    private_plane_configured(name, audit, calico, Vec::new())
}

/// [`private_plane_with`] whose kube-apiserver gets the further flags `apiserver_args`.
pub fn private_plane_configured(name: &str, audit: bool, calico: Calico, apiserver_args: Vec<String>) -> PrivatePlane {
    start(name, calico, move |opts| {
        opts.audit = audit;
        opts.apiserver_args = apiserver_args;
    })
}

/// A control plane with an audit log, one kwok node and the real node
/// ([`capo_testenv::real_node`]): containerd, a kubelet and Calico's CNI plugin.
pub fn private_plane_with_real_node(name: &str, calico: Calico) -> PrivatePlane {
    start(name, calico, |opts| {
        opts.audit = true;
        opts.real_node = true;
    })
}

fn start(
    name: &str,
    calico: Calico,
    configure: impl FnOnce(&mut capo_testenv::Options) + Send + 'static,
) -> PrivatePlane {
    let (requests, rx) = std::sync::mpsc::channel::<Request>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let dir = std::env::temp_dir().join(format!("capo-private-{name}-{}", std::process::id()));
    let state_dir = dir.clone();
    let owner = std::thread::spawn(move || {
        let mut opts = capo_testenv::Options::new(dir.clone(), 1);
        configure(&mut opts);
        let mut cp = match capo_testenv::ControlPlane::start_with(opts, calico) {
            Ok(cp) => cp,
            Err(e) => {
                let _ = ready_tx.send(Err(e.to_string()));
                return;
            }
        };
        let _ = ready_tx.send(Ok((cp.kubeconfig.clone(), cp.calico_etcd.clone())));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        while let Ok((component, reply)) = rx.recv() {
            let _ = reply.send(rt.block_on(cp.restart(&component)).map_err(|e| e.to_string()));
        }
        cp.stop();
        let _ = std::fs::remove_dir_all(&dir);
    });
    let (kubeconfig, calico_etcd) = ready_rx.recv().unwrap().unwrap_or_else(|e| panic!("private control plane: {e}"));
    PrivatePlane { kubeconfig, state_dir, calico_etcd, requests: Some(requests), owner: Some(owner) }
}

impl PrivatePlane {
    pub async fn restart(&self, component: &str) {
        let (tx, rx) = std::sync::mpsc::channel();
        self.requests.as_ref().unwrap().send((component.to_string(), tx)).unwrap();
        tokio::task::spawn_blocking(move || rx.recv().unwrap()).await.unwrap().expect("restart");
    }

    pub async fn client(&self) -> kube::Client {
        capo_testenv::client_from_kubeconfig(&self.kubeconfig).await.unwrap()
    }

    pub fn audit(&self) -> Vec<super::audit::AuditEvent> {
        super::audit::read(&self.state_dir.join("audit.log"))
    }
}
