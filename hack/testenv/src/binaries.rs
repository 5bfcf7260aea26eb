//! Finds the control-plane binaries, building them with `hack/build-controlplane.sh`
//! (which caches them by pinned version) when `CAPO_TESTENV_BIN` does not name a directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;

pub const COMPONENTS: [&str; 6] =
    ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kwok-stages.yaml"];

pub fn locate() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("CAPO_TESTENV_BIN") {
        let dir = PathBuf::from(dir);
        check(&dir)?;
        return Ok(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../build-controlplane.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|source| Error::Io { path: script.clone(), source })?;
    if !out.status.success() {
        return Err(Error::Build { script, status: out.status.to_string() });
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    check(&dir)?;
    Ok(dir)
}

fn check(dir: &Path) -> Result<(), Error> {
    for name in COMPONENTS {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(Error::MissingBinary { path });
        }
    }
    Ok(())
}
