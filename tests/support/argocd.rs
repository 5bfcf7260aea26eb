//! A real Argo CD for the GitOps tests (`tests/gitops.rs`): the test binary's Argo CD
//! (`capo_testenv::argocd`, started once with a short resync period, stopped with the
//! control plane), configured as docs/install.md says (capo's `argocd-cm` patch applied
//! with kubectl), a git repository of capo's layout served as a `file://` URL, and the
//! Applications' status as Argo CD reports it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

use super::{eventually, kubectl};

/// How often Argo CD refreshes every Application in these tests (3 minutes by default).
pub const RESYNC: Duration = Duration::from_secs(5);

/// The URL capo's Applications and AppProject point at, which a fork rewrites.
pub const UPSTREAM_REPO: &str = "https://github.com/capo-io/capo.git";

/// The test binary's Argo CD.
pub struct Argo {
    pub client: Client,
    pub namespace: String,
    pub resync: Duration,
    pub version: String,
}

fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Starts (once) the test binary's Argo CD and registers capo's health check in its
/// argocd-cm, with the command docs/install.md gives.
pub async fn argocd() -> Argo {
    let shared = capo_testenv::argocd::shared(RESYNC);
    static CONFIGURED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    CONFIGURED
        .get_or_init(|| async {
            let patch = repo_root().join("argocd/argocd-cm-patch.yaml");
            let args = ["-n", &shared.namespace, "patch", "configmap", "argocd-cm", "--patch-file"];
            let (ok, out) = kubectl(&[&args[..], &[patch.to_str().unwrap()]].concat(), None).await;
            assert!(ok, "patching argocd-cm as docs/install.md says: {out}");
        })
        .await;
    Argo {
        client: super::client().await,
        namespace: shared.namespace.clone(),
        resync: shared.resync,
        version: shared.version.clone(),
    }
}

/// A git repository holding capo's `argocd/`, `config/` and `charts/` as they are in this
/// worktree, with every `https://github.com/capo-io/capo.git` rewritten to its own
/// `file://` URL (what a user forking capo does), pushed to a bare repository Argo CD
/// reads. Removed when dropped.
pub struct GitRepo {
    dir: PathBuf,
    pub work: PathBuf,
    pub url: String,
}

impl GitRepo {
    pub fn with_capo_layout(name: &str) -> GitRepo {
        sweep_stale_repos();
        let dir = std::env::temp_dir().join(format!("capo-gitops-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (work, bare) = (dir.join("work"), dir.join("capo.git"));
        std::fs::create_dir_all(&dir).expect("repository directory");
        let url = format!("file://{}", bare.display());
        let repo = GitRepo { dir, work, url };
        repo.git(&["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()]);
        repo.git(&["init", "-q", "-b", "main", repo.work.to_str().unwrap()]);
        repo.copy_layout();
        repo.commit_and_push("capo, as this worktree has it");
        repo
    }

    /// Runs git (no user or system configuration) in the work tree once it exists.
    fn git(&self, args: &[&str]) -> String {
        let mut cmd = Command::new("git");
        if self.work.exists() {
            cmd.current_dir(&self.work);
        }
        let out = cmd
            .args(["-c", "user.name=capo tests", "-c", "user.email=tests@capo.invalid", "-c", "commit.gpgsign=false"])
            .args(args)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .output()
            .expect("git");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "git {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
        text
    }

    fn copy_layout(&self) {
        let listed = Command::new("git")
            .current_dir(repo_root())
            .args(["ls-files", "-z", "argocd", "config", "charts"])
            .output()
            .expect("git ls-files");
        assert!(listed.status.success(), "git ls-files: {}", String::from_utf8_lossy(&listed.stderr));
        for file in listed.stdout.split(|b| *b == 0).filter(|f| !f.is_empty()) {
            let rel = Path::new(std::str::from_utf8(file).expect("utf-8 path"));
            let Ok(text) = std::fs::read(repo_root().join(rel)) else { continue }; // deleted in the worktree
            self.write_bytes(rel, &text);
        }
        for entry in std::fs::read_dir(self.work.join("argocd")).expect("argocd/") {
            let path = entry.expect("argocd/ entry").path();
            if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap().replace(UPSTREAM_REPO, &self.url);
                std::fs::write(&path, text).unwrap();
            }
        }
    }

    fn write_bytes(&self, rel: &Path, bytes: &[u8]) {
        let path = self.work.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }

    /// Writes a file of the work tree (committed by the next [`Self::commit_and_push`]).
    pub fn write(&self, rel: &str, text: &str) {
        self.write_bytes(Path::new(rel), text.as_bytes());
    }

    /// Removes a file of the work tree.
    pub fn remove(&self, rel: &str) {
        self.git(&["rm", "-q", rel]);
    }

    pub fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.work.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
    }

    /// A YAML file of the work tree as JSON.
    pub fn yaml(&self, rel: &str) -> Value {
        serde_saphyr::from_str(&self.read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
    }

    /// Commits everything and pushes it to `main`; returns the commit.
    pub fn commit_and_push(&self, message: &str) -> String {
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "-m", message]);
        let bare = self.dir.join("capo.git");
        self.git(&["push", "-q", bare.to_str().unwrap(), "main"]);
        self.git(&["rev-parse", "HEAD"]).trim().to_string()
    }
}

/// Removes the repositories of test binaries that are gone (killed before their Drop).
fn sweep_stale_repos() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("capo-gitops-").and_then(|r| r.split('-').next()?.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Drop for GitRepo {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Argo {
    pub fn applications(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.namespace, &capo_testenv::argocd::application())
    }

    /// Creates or replaces an Application or AppProject (a manifest of `argocd/`).
    pub async fn apply(&self, manifest: &Value) {
        let (ok, out) = kubectl(&["apply", "-n", &self.namespace, "-f", "-"], Some(&manifest.to_string())).await;
        assert!(ok, "kubectl apply {}: {out}", manifest["metadata"]["name"]);
    }

    /// The Application's `status` (Null until Argo CD wrote one).
    pub async fn status(&self, app: &str) -> Value {
        let obj = self.applications().get(app).await.unwrap_or_else(|e| panic!("Application {app}: {e}"));
        obj.data["status"].clone()
    }

    /// Polls the Application's status until `done` says yes; returns that status. On
    /// timeout the failure shows the last status seen.
    pub async fn wait(&self, app: &str, what: &str, limit: Duration, done: impl Fn(&Value) -> bool) -> Value {
        let apps = self.applications();
        let deadline = std::time::Instant::now() + limit;
        loop {
            let status = apps.get_opt(app).await.ok().flatten().map(|o| o.data["status"].clone()).unwrap_or_default();
            if done(&status) {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out after {limit:?} waiting for Application {app}: {what}; its status:\n{status:#}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until the Application is Synced and Healthy and its last sync succeeded — a
    /// sync of `revision`, if given (the comparison can show the new commit Synced before
    /// the sync's own result is written).
    pub async fn wait_synced_healthy(&self, app: &str, revision: Option<&str>, limit: Duration) -> Value {
        self.wait(app, "Synced and Healthy", limit, |s| {
            sync_status(s) == "Synced"
                && health(s).0 == "Healthy"
                && s["operationState"]["phase"] == "Succeeded"
                && revision
                    .is_none_or(|r| s["sync"]["revision"] == r && s["operationState"]["syncResult"]["revision"] == r)
        })
        .await
    }

    /// Asks Argo CD to compare the Application with git now, as its git webhook does on a
    /// push (without one Argo CD notices a commit at its next poll of the repository).
    pub async fn refresh(&self, app: &str) {
        let patch = json!({ "metadata": { "annotations": { "argocd.argoproj.io/refresh": "normal" } } });
        self.applications().patch(app, &PatchParams::default(), &Patch::Merge(patch)).await.expect("refresh");
    }

    /// Deletes the Application and everything it manages (`argocd app delete --cascade`:
    /// Argo CD's resources finalizer), and waits until it is gone. A sync still running
    /// (a failed one being retried) is terminated first (`argocd app terminate-op`), or
    /// Argo CD would not start the deletion.
    pub async fn delete_cascade(&self, app: &str) {
        let apps = self.applications();
        let Some(current) = apps.get_opt(app).await.expect("read Application") else { return };
        if current.data["status"]["operationState"]["phase"] == "Running" {
            let terminate = json!({ "status": { "operationState": { "phase": "Terminating" } } });
            apps.patch(app, &PatchParams::default(), &Patch::Merge(terminate)).await.expect("terminate the sync");
            eventually(&format!("Application {app}: sync terminated"), Duration::from_secs(60), || async {
                let phase = apps.get(app).await.ok()?.data["status"]["operationState"]["phase"].clone();
                (phase != "Running" && phase != "Terminating").then_some(())
            })
            .await;
        }
        let finalizer = json!({ "metadata": { "finalizers": ["resources-finalizer.argocd.argoproj.io"] } });
        if apps.patch(app, &PatchParams::default(), &Patch::Merge(finalizer)).await.is_err() {
            return; // already gone
        }
        let _ = apps.delete(app, &DeleteParams::default()).await;
        eventually(&format!("Application {app} and its resources deleted"), Duration::from_secs(90), || async {
            apps.get_opt(app).await.ok()?.is_none().then_some(())
        })
        .await;
    }
}

pub fn sync_status(status: &Value) -> &str {
    status["sync"]["status"].as_str().unwrap_or_default()
}

/// The Application's health: (status, message).
pub fn health(status: &Value) -> (&str, &str) {
    (status["health"]["status"].as_str().unwrap_or_default(), status["health"]["message"].as_str().unwrap_or_default())
}

/// A managed resource as the Application's status lists it (kind and name).
pub fn resource<'a>(status: &'a Value, kind: &str, name: &str) -> Option<&'a Value> {
    status["resources"].as_array()?.iter().find(|r| r["kind"] == kind && r["name"] == name)
}

/// A resource's health as Argo CD computed it: (status, message).
pub fn resource_health<'a>(status: &'a Value, kind: &str, name: &str) -> (&'a str, &'a str) {
    let Some(r) = resource(status, kind, name) else { return ("", "") };
    (r["health"]["status"].as_str().unwrap_or_default(), r["health"]["message"].as_str().unwrap_or_default())
}

/// The results of the last sync operation, in the order Argo CD ran them.
pub fn sync_results(status: &Value) -> Vec<Value> {
    status["operationState"]["syncResult"]["resources"].as_array().cloned().unwrap_or_default()
}
