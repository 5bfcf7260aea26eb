//! The workspace's test targets (`cargo metadata`, before anything is built) and the
//! executables the `cargo-tests` build made of them (its JSON messages).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde::Deserialize;

/// A target `cargo test` runs: a lib's or bin's unit tests, or a file of `tests/`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TestTarget {
    pub package: String,
    pub package_dir: String,
    pub target: String,
    /// `lib`, `bin` or `test`.
    pub kind: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CargoError {
    #[error("running `cargo metadata` in {dir}: {message}")]
    Metadata { dir: String, message: String },
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
}

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
    workspace_members: Vec<String>,
}

#[derive(Deserialize)]
struct Package {
    id: String,
    name: String,
    manifest_path: String,
    targets: Vec<Target>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    kind: Vec<String>,
    #[serde(default = "yes")]
    test: bool,
}

fn yes() -> bool {
    true
}

/// The workspace's test targets, sorted.
pub fn test_targets(root: &Path) -> Result<Vec<TestTarget>, CargoError> {
    let out = Command::new("cargo")
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .map_err(|e| CargoError::Metadata { dir: root.display().to_string(), message: e.to_string() })?;
    if !out.status.success() {
        return Err(CargoError::Metadata {
            dir: root.display().to_string(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let meta: Metadata = serde_json::from_slice(&out.stdout)
        .map_err(|e| CargoError::Metadata { dir: root.display().to_string(), message: e.to_string() })?;
    Ok(targets_of(&meta))
}

fn targets_of(meta: &Metadata) -> Vec<TestTarget> {
    let mut out = Vec::new();
    for p in meta.packages.iter().filter(|p| meta.workspace_members.contains(&p.id)) {
        let dir = Path::new(&p.manifest_path).parent().map(|d| d.display().to_string()).unwrap_or_default();
        for t in p.targets.iter().filter(|t| t.test) {
            let Some(kind) = t.kind.iter().find(|k| ["lib", "bin", "test", "proc-macro"].contains(&k.as_str())) else {
                continue;
            };
            let kind = if kind == "proc-macro" { "lib" } else { kind.as_str() };
            out.push(TestTarget {
                package: p.name.clone(),
                package_dir: dir.clone(),
                target: t.name.clone(),
                kind: kind.into(),
            });
        }
    }
    out.sort();
    out
}

#[derive(Deserialize)]
struct Message {
    reason: String,
    #[serde(default)]
    package_id: String,
    target: Option<MessageTarget>,
    profile: Option<Profile>,
    executable: Option<String>,
}

#[derive(Deserialize)]
struct MessageTarget {
    name: String,
    kind: Vec<String>,
}

#[derive(Deserialize)]
struct Profile {
    test: bool,
}

/// `(package, target, kind)` → the test executable, from the JSON messages of
/// `cargo test --no-run --message-format=json` in `path`.
pub fn executables(path: &Path) -> Result<BTreeMap<(String, String, String), String>, CargoError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| CargoError::Read { path: path.display().to_string(), source })?;
    Ok(executables_in(&text))
}

fn executables_in(text: &str) -> BTreeMap<(String, String, String), String> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with('{')) {
        let Ok(m) = serde_json::from_str::<Message>(line) else {
            continue;
        };
        let (Some(t), Some(p), Some(exe)) = (m.target, m.profile, m.executable) else {
            continue;
        };
        if m.reason != "compiler-artifact" || !p.test {
            continue;
        }
        let kind = match t.kind.first().map(String::as_str) {
            Some("proc-macro") | Some("lib") | Some("rlib") => "lib",
            Some(k) => k,
            None => continue,
        };
        out.insert((package_name(&m.package_id), t.name, kind.to_string()), exe);
    }
    out
}

/// The package name in a package id: `path+file:///x/capo#0.1.0` → `capo`,
/// `path+file:///x/hack/testenv#capo-testenv@0.1.0` → `capo-testenv`.
fn package_name(id: &str) -> String {
    let fragment = id.rsplit_once('#');
    match fragment {
        Some((_, frag)) if frag.contains('@') => frag.split('@').next().unwrap_or(frag).to_string(),
        Some((url, _)) => url.rsplit('/').next().unwrap_or(url).to_string(),
        None => id.split(' ').next().unwrap_or(id).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_names_come_from_either_form_of_package_id() {
        assert_eq!(package_name("path+file:///work/main#0.1.0"), "main");
        assert_eq!(package_name("path+file:///work/main/hack/testenv#capo-testenv@0.1.0"), "capo-testenv");
        assert_eq!(package_name("capo 0.1.0 (path+file:///work/main)"), "capo");
    }

    #[test]
    fn executables_are_the_test_profiles_artifacts() {
        let text = r#"{"reason":"compiler-artifact","package_id":"path+file:///r#capo@0.1.0","target":{"name":"holds","kind":["test"]},"profile":{"test":true},"executable":"/r/target/debug/deps/holds-1"}
{"reason":"compiler-artifact","package_id":"path+file:///r#capo@0.1.0","target":{"name":"capo","kind":["bin"]},"profile":{"test":false},"executable":"/r/target/debug/capo"}
{"reason":"compiler-artifact","package_id":"path+file:///r#capo@0.1.0","target":{"name":"capo","kind":["lib"]},"profile":{"test":true},"executable":"/r/target/debug/deps/capo-2"}
{"reason":"build-finished","success":true}
not json"#;
        let exes = executables_in(text);
        assert_eq!(exes.len(), 2, "{exes:?}");
        assert_eq!(exes[&("capo".into(), "holds".into(), "test".into())], "/r/target/debug/deps/holds-1");
        assert_eq!(exes[&("capo".into(), "capo".into(), "lib".into())], "/r/target/debug/deps/capo-2");
    }

    #[test]
    fn only_workspace_members_targets_with_tests_count() {
        let meta: Metadata = serde_json::from_str(
            r#"{"workspace_members":["a"],"packages":[
              {"id":"a","name":"capo","manifest_path":"/r/Cargo.toml","targets":[
                {"name":"capo","kind":["lib"]},{"name":"holds","kind":["test"]},
                {"name":"e2e","kind":["bench"]},{"name":"crdgen","kind":["bin"],"test":false}]},
              {"id":"b","name":"dep","manifest_path":"/d/Cargo.toml","targets":[{"name":"dep","kind":["lib"]}]}]}"#,
        )
        .unwrap();
        let names: Vec<String> = targets_of(&meta).into_iter().map(|t| format!("{}:{}", t.kind, t.target)).collect();
        assert_eq!(names, ["lib:capo", "test:holds"]);
    }
}
