//! What `make test` runs, and what each step needs: the builds (each a script of `hack/`
//! that prints what it built on its last line), lint, every test binary of the workspace
//! on each Kubernetes version it proves something on, and the try-install paths.
//!
//! The table [`BINARIES`] holds what differs between test binaries; a binary it does not
//! name runs on both versions with the defaults, and a name it holds that the workspace
//! has no test binary for is an error (so the table cannot drift from `tests/`).

use std::path::Path;
use std::time::Duration;

use crate::cargo::TestTarget;

/// The Kubernetes versions the suite runs on: the default one, and the oldest capo
/// supports (its webhook needs `matchConditions`, GA in 1.30).
pub const LATEST: &str = "1.35";
pub const COMPAT: &str = "1.30";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Build,
    Lint,
    Test,
    Try,
}

/// What a step runs: a command, or a test binary the `cargo-tests` build names.
#[derive(Clone, Debug)]
pub enum Program {
    Command { program: String, args: Vec<String> },
    TestBinary { package: String, target: String, kind: String },
}

#[derive(Clone, Debug)]
pub struct Step {
    /// Unique: `holds@1.35`, `build controlplane@1.30`, `try-helm`.
    pub id: String,
    pub kind: Kind,
    /// What `--only` matches: the test binary's name and its group, `build`, `lint`, `try`, `unit`.
    pub areas: Vec<String>,
    pub version: Option<&'static str>,
    pub program: Program,
    pub env: Vec<(String, String)>,
    /// The package directory a test binary runs in (as `cargo test` runs it).
    pub cwd: Option<String>,
    /// Ids of the build steps that must have succeeded first.
    pub needs: Vec<String>,
    /// The environment variable a build's last line of output is handed on in.
    pub provides: Option<&'static str>,
    /// Test slots taken while it runs (see `--jobs`).
    pub weight: u32,
    /// A machine resource only one step may hold at a time.
    pub hold: Option<&'static str>,
    pub timeout: Duration,
}

/// What differs for one test binary of `tests/`.
pub struct Binary {
    pub name: &'static str,
    /// The group `make test-<group>` runs.
    pub group: &'static str,
    /// `Some(why)`: runs on [`LATEST`] only, for that reason.
    pub latest_only: Option<&'static str>,
    /// Builds it needs besides the cargo build, the control plane, Calico's IPAM driver
    /// and `make tools`.
    pub needs: &'static [&'static str],
    pub weight: u32,
    pub hold: Option<&'static str>,
    /// Runs with no other test binary beside it (it measures time or memory under a
    /// bound a loaded machine would break): after all the others.
    pub alone: bool,
}

const fn bin(name: &'static str, group: &'static str) -> Binary {
    Binary { name, group, latest_only: None, needs: &[], weight: 1, hold: None, alone: false }
}

/// The machine has one `kubernetes` Service address (10.0.0.1 on `lo`) and one set of
/// the host paths containerd and the kubelet hard-code: one real node at a time.
pub const REAL_NODE: &str = "real-node";

const NO_API_SERVER: &str = "talks to no API server";

/// Measured on 1.30: the API server refuses the CRD (422, "undeclared reference to 'cidr'").
const NATIVE_V3: &str = "Calico 3.32.1's native v3 IPPool CRD validates with CEL's IP and CIDR library, which API servers before 1.31 refuse";

/// Every test binary of `tests/`. Weights: how many of the `--jobs` slots a binary takes
/// (measured: CPU time of the binary and its control plane against its wall time, in
/// `make test`'s table; 1 is about a fifth of this machine's two cores).
pub const BINARIES: &[Binary] = &[
    Binary {
        latest_only: Some("its kubelet is built from the 1.35 module only (hack/build-real-node.sh)"),
        needs: &["real-node", "image"],
        hold: Some(REAL_NODE),
        ..bin("real_node", "real-node")
    },
    Binary {
        latest_only: Some(
            "Argo CD's behaviour against capo's manifests; one pass on the default version, as before this runner",
        ),
        needs: &["argocd"],
        ..bin("gitops", "install")
    },
    Binary { weight: 3, ..bin("correctness", "release") },
    Binary { weight: 2, ..bin("calico_ipam", "calico") },
    Binary { needs: &["calico-apiserver"], ..bin("calico_apiserver", "calico") },
    Binary { latest_only: Some(NATIVE_V3), needs: &["calico-apiserver"], ..bin("calico_migration", "calico") },
    Binary { latest_only: Some(NATIVE_V3), ..bin("calico_v3", "calico") },
    bin("release", "release"),
    Binary { weight: 2, ..bin("failover", "release") },
    // Every one of 2,000 releases within 10 s of its due time (all within 1 s alone, a
    // debug build): beside five other binaries and the lint, with the deletions 4.4 times
    // slower (52 s), 72 came 10–30 s late (CI of 871810a).
    Binary { alone: true, ..bin("scale", "release") },
    bin("calico_etcd", "calico"),
    bin("certificates", "install"),
    bin("sticky", "sticky"),
    bin("etcd_members", "calico"),
    bin("policies", "policies"),
    bin("faults", "admission"),
    bin("holds", "admission"),
    bin("pool_guard", "calico"),
    Binary { weight: 2, ..bin("safety_net", "release") },
    bin("install", "install"),
    bin("migrate", "policies"),
    bin("owners", "release"),
    bin("chart", "install"),
    // `/readyz` within a second (the kubelet's default probe timeout) during a flood of
    // 4 MiB reviews: on a machine other binaries keep busy it took 1.04 s.
    Binary { alone: true, ..bin("webhook_limits", "admission") },
    bin("admission", "admission"),
    bin("fuzz", "admission"),
    bin("cost", "admission"),
    bin("webhook_auth", "admission"),
    bin("smoke", "admission"),
    bin("calico_missing", "calico"),
    Binary { latest_only: Some(NO_API_SERVER), ..bin("argocd", "install") },
    Binary { latest_only: Some(NO_API_SERVER), ..bin("prometheus", "install") },
];

/// The try-install paths `make test` runs as a newcomer would (hack/test-try.sh).
struct Try {
    name: &'static str,
    needs: &'static [&'static str],
    hold: Option<&'static str>,
    weight: u32,
}

const TRIES: &[Try] = &[
    Try { name: "try-real-node", needs: &["real-node", "image"], hold: Some(REAL_NODE), weight: 2 },
    Try { name: "try-sticky", needs: &["real-node", "image"], hold: Some(REAL_NODE), weight: 1 },
    Try { name: "try-argocd", needs: &["argocd"], hold: None, weight: 1 },
    Try { name: "try-helm", needs: &[], hold: None, weight: 1 },
];

struct Build {
    id: &'static str,
    script: &'static str,
    env: &'static [(&'static str, &'static str)],
    provides: Option<&'static str>,
    needs: &'static [&'static str],
}

/// The builds, in the order the build lane takes them (what unblocks most tests first).
/// `cargo-tests` and `lint` are added by [`plan`].
const BUILDS: &[Build] = &[
    Build {
        id: "image",
        script: "hack/build-image.sh",
        env: &[("CAPO_BIN", "target/debug/capo")],
        provides: Some("CAPO_IMAGE"),
        needs: &["cargo-tests"],
    },
    Build { id: "tools", script: "hack/tools.sh", env: &[], provides: None, needs: &[] },
    Build {
        id: "calico-ipam",
        script: "hack/build-calico-ipam.sh",
        env: &[],
        provides: Some("CAPO_CALICO_IPAM"),
        needs: &[],
    },
    Build {
        id: "controlplane@1.35",
        script: "hack/build-controlplane.sh",
        env: &[],
        provides: Some("CAPO_TESTENV_BIN"),
        needs: &[],
    },
    Build {
        id: "real-node",
        script: "hack/build-real-node.sh",
        env: &[],
        provides: Some("CAPO_REAL_NODE"),
        needs: &[],
    },
    Build {
        id: "calico-apiserver",
        script: "hack/build-calico-apiserver.sh",
        env: &[],
        provides: Some("CAPO_CALICO_APISERVER"),
        needs: &["calico-ipam"],
    },
    Build {
        id: "controlplane@1.30",
        script: "hack/build-controlplane.sh",
        env: &[("CAPO_K8S", "1.30")],
        provides: Some("CAPO_TESTENV_BIN"),
        needs: &[],
    },
    Build { id: "argocd", script: "hack/build-argocd.sh", env: &[], provides: Some("CAPO_ARGOCD_DIR"), needs: &[] },
];

/// What to run.
pub struct Selection {
    /// Areas (`--only`); empty: everything.
    pub only: Vec<String>,
    /// Versions to run the test binaries on.
    pub versions: Vec<&'static str>,
    pub lint: bool,
    pub test_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("hack/suite's table names test binary {0:?}, which the workspace does not have (tests/{0}.rs?)")]
    UnknownBinary(String),
    #[error("two steps are named {0:?}")]
    Duplicate(String),
    #[error("--only {0:?} matches no step; areas: {1}")]
    UnknownArea(String, String),
}

fn command(program: &str, args: &[&str]) -> Program {
    Program::Command { program: program.into(), args: args.iter().map(|a| a.to_string()).collect() }
}

fn build_step(b: &Build) -> Step {
    Step {
        id: format!("build {}", b.id),
        kind: Kind::Build,
        areas: vec!["build".into(), b.id.into()],
        version: None,
        program: command("bash", &[b.script]),
        env: b.env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        cwd: None,
        needs: b.needs.iter().map(|n| format!("build {n}")).collect(),
        provides: b.provides,
        weight: 0,
        hold: None,
        timeout: Duration::from_secs(60 * 60),
    }
}

/// Every step of the suite for the workspace's `targets`, before `--only` is applied.
pub fn all_steps(targets: &[TestTarget], sel: &Selection) -> Result<Vec<Step>, PlanError> {
    for b in BINARIES {
        if !targets.iter().any(|t| t.kind == "test" && t.target == b.name) {
            return Err(PlanError::UnknownBinary(b.name.into()));
        }
    }
    let mut steps = Vec::new();
    steps.push(Step {
        id: "build cargo-tests".into(),
        kind: Kind::Build,
        areas: vec!["build".into(), "cargo-tests".into()],
        version: None,
        // The test executables and every binary (capo, crdgen, capo-testenv for the try
        // paths) in one build: a build of the binaries alone would compile their
        // dependencies again without the dev-dependencies' features.
        program: command(
            "cargo",
            &["build", "--workspace", "--lib", "--bins", "--tests", "--message-format=json-render-diagnostics"],
        ),
        env: vec![],
        cwd: None,
        needs: vec![],
        provides: None,
        weight: 0,
        hold: None,
        timeout: Duration::from_secs(60 * 60),
    });
    steps.extend(BUILDS.iter().map(build_step));
    if sel.lint {
        steps.push(Step {
            id: "lint".into(),
            kind: Kind::Lint,
            areas: vec!["lint".into()],
            version: None,
            program: command(
                "bash",
                &["-c", "cargo fmt --all -- --check && cargo clippy --workspace --all-targets -- -D warnings"],
            ),
            env: vec![],
            cwd: None,
            needs: vec!["build cargo-tests".into()],
            provides: None,
            weight: 0,
            hold: None,
            timeout: Duration::from_secs(30 * 60),
        });
    }

    // Integration test binaries, in the table's order (slowest first), then any the table
    // does not name; each on the versions it runs on.
    let mut integration: Vec<(&TestTarget, Option<&Binary>)> = Vec::new();
    for b in BINARIES {
        let t = targets.iter().find(|t| t.kind == "test" && t.target == b.name).expect("checked above");
        integration.push((t, Some(b)));
    }
    for t in targets.iter().filter(|t| t.kind == "test" && !BINARIES.iter().any(|b| b.name == t.target)) {
        integration.push((t, None));
    }
    let mut alone = Vec::new();
    for &version in &sel.versions {
        for (t, b) in &integration {
            if version != LATEST && b.is_some_and(|b| b.latest_only.is_some()) {
                continue;
            }
            let mut needs = vec![
                "build cargo-tests".to_string(),
                "build tools".into(),
                "build calico-ipam".into(),
                format!("build controlplane@{version}"),
            ];
            needs.extend(b.map(|b| b.needs).unwrap_or_default().iter().map(|n| format!("build {n}")));
            let mut areas = vec![t.target.clone(), format!("{}@{version}", t.target)];
            if let Some(b) = b {
                areas.push(b.group.into());
            }
            let queue = if b.is_some_and(|b| b.alone) { &mut alone } else { &mut steps };
            queue.push(Step {
                id: format!("{}@{version}", t.target),
                kind: Kind::Test,
                areas,
                version: Some(version),
                program: Program::TestBinary {
                    package: t.package.clone(),
                    target: t.target.clone(),
                    kind: t.kind.clone(),
                },
                env: vec![],
                cwd: Some(t.package_dir.clone()),
                needs,
                provides: None,
                weight: match b {
                    Some(b) if b.alone => u32::MAX,
                    Some(b) => b.weight,
                    None => 1,
                },
                hold: b.and_then(|b| b.hold),
                timeout: sel.test_timeout,
            });
        }
    }

    // Unit tests (a crate's lib and bins) and the try-install paths: with the default
    // version (unit tests talk to no API server, so once).
    let with_latest = sel.versions.contains(&LATEST);
    for t in targets.iter().filter(|t| t.kind != "test" && with_latest) {
        steps.push(Step {
            id: format!(
                "unit {}{}",
                t.package,
                if t.kind == "lib" { String::new() } else { format!(" ({})", t.target) }
            ),
            kind: Kind::Test,
            areas: vec!["unit".into(), t.package.clone()],
            version: None,
            program: Program::TestBinary { package: t.package.clone(), target: t.target.clone(), kind: t.kind.clone() },
            env: vec![],
            cwd: Some(t.package_dir.clone()),
            needs: vec!["build cargo-tests".into()],
            provides: None,
            weight: 1,
            hold: None,
            timeout: sel.test_timeout,
        });
    }

    if with_latest {
        steps.push(Step {
            id: "unit doc-tests".into(),
            kind: Kind::Test,
            areas: vec!["unit".into(), "doc-tests".into()],
            version: None,
            program: command("cargo", &["test", "--workspace", "--doc"]),
            env: vec![],
            cwd: None,
            needs: vec!["build cargo-tests".into()],
            provides: None,
            weight: 1,
            hold: None,
            timeout: sel.test_timeout,
        });
    }

    for t in TRIES.iter().filter(|_| with_latest) {
        let mut needs: Vec<String> = ["cargo-tests", "tools", "calico-ipam", "calico-apiserver", "controlplane@1.35"]
            .iter()
            .chain(t.needs)
            .map(|n| format!("build {n}"))
            .collect();
        needs.dedup();
        steps.push(Step {
            id: t.name.into(),
            kind: Kind::Try,
            areas: vec!["try".into(), t.name.into()],
            version: Some(LATEST),
            program: command("bash", &["hack/test-try.sh", t.name]),
            env: vec![("CAPO_PREBUILT".into(), "1".into())],
            cwd: None,
            needs,
            provides: None,
            weight: t.weight,
            hold: t.hold,
            timeout: Duration::from_secs(15 * 60),
        });
    }
    steps.extend(alone);
    let mut ids: Vec<&str> = steps.iter().map(|s| s.id.as_str()).collect();
    ids.sort();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(PlanError::Duplicate(w[0].to_string()));
    }
    Ok(steps)
}

/// The steps `sel` asks for and the builds they need.
pub fn plan(targets: &[TestTarget], sel: &Selection) -> Result<Vec<Step>, PlanError> {
    let all = all_steps(targets, sel)?;
    if sel.only.is_empty() {
        return Ok(all);
    }
    let mut wanted: Vec<bool> = all.iter().map(|s| sel.only.iter().any(|a| s.areas.contains(a))).collect();
    for area in &sel.only {
        if !all.iter().any(|s| s.areas.contains(area)) {
            let mut names: Vec<&str> =
                all.iter().filter(|s| s.kind != Kind::Build).flat_map(|s| s.areas.iter().map(String::as_str)).collect();
            names.sort();
            names.dedup();
            return Err(PlanError::UnknownArea(area.clone(), names.join(" ")));
        }
    }
    // Pull in what the wanted steps need, transitively.
    loop {
        let mut changed = false;
        for i in 0..all.len() {
            if !wanted[i] {
                continue;
            }
            for need in &all[i].needs {
                if let Some(j) = all.iter().position(|s| &s.id == need)
                    && !wanted[j]
                {
                    wanted[j] = true;
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    Ok(all.into_iter().zip(wanted).filter_map(|(s, w)| w.then_some(s)).collect())
}

/// docs/testing.md's list of what runs on one version only, and why; a test keeps it in
/// step with [`BINARIES`].
pub fn latest_only_table() -> String {
    let mut out = String::from("| test binary | runs on | why |\n| --- | --- | --- |\n");
    for b in BINARIES.iter().filter(|b| b.latest_only.is_some()) {
        out.push_str(&format!("| `tests/{}.rs` | {LATEST} only | {} |\n", b.name, b.latest_only.unwrap_or_default()));
    }
    out.push_str(&format!("| unit tests (`src/`, `api/`, `hack/*/src`) | once | {NO_API_SERVER} |\n"));
    out
}

/// The repository root: where `Cargo.toml` with the workspace is.
pub fn repo_root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root")
}
