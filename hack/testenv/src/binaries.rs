//! Finds the control-plane binaries, building them with `hack/build-controlplane.sh`
//! (which caches them by pinned version) when `CAPO_TESTENV_BIN` does not name a directory,
//! and the Calico IPAM driver with `hack/build-calico-ipam.sh` when `CAPO_CALICO_IPAM` does
//! not.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;

pub const COMPONENTS: [&str; 6] =
    ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kwok-stages.yaml"];

/// The driver binary and the CRD directory under the directory `build-calico-ipam.sh` prints.
pub const CALICO_IPAM_BINARY: &str = "bin/capo-calico-ipam";
pub const CALICO_CRDS: &str = "crds";

pub fn locate() -> Result<PathBuf, Error> {
    let dir = match std::env::var_os("CAPO_TESTENV_BIN") {
        Some(dir) => PathBuf::from(dir),
        None => run_build_script("build-controlplane.sh")?,
    };
    check(&dir, &COMPONENTS)?;
    Ok(dir)
}

/// The directory of the Calico IPAM driver (`bin/capo-calico-ipam`, `crds/`).
pub fn locate_calico_ipam() -> Result<PathBuf, Error> {
    let dir = match std::env::var_os("CAPO_CALICO_IPAM") {
        Some(dir) => PathBuf::from(dir),
        None => run_build_script("build-calico-ipam.sh")?,
    };
    check(&dir, &[CALICO_IPAM_BINARY, "crds/.done"])?;
    Ok(dir)
}

/// The calico-apiserver binary (`bin/calico-apiserver` under the directory
/// `build-calico-apiserver.sh` prints, or `CAPO_CALICO_APISERVER`).
pub fn locate_calico_apiserver() -> Result<PathBuf, Error> {
    let dir = match std::env::var_os("CAPO_CALICO_APISERVER") {
        Some(dir) => PathBuf::from(dir),
        None => run_build_script("build-calico-apiserver.sh")?,
    };
    check(&dir, &["bin/calico-apiserver"])?;
    Ok(dir.join("bin/calico-apiserver"))
}

/// The real node's directory (`bin/kubelet`, `bin/containerd`, `cni/calico`,
/// `images/*.tar`): `CAPO_REAL_NODE`, or what `build-real-node.sh` prints.
pub fn locate_real_node() -> Result<PathBuf, Error> {
    let dir = match std::env::var_os("CAPO_REAL_NODE") {
        Some(dir) => PathBuf::from(dir),
        None => run_build_script("build-real-node.sh")?,
    };
    check(
        &dir,
        &[
            "bin/kubelet",
            "bin/containerd",
            "bin/containerd-shim-runc-v2",
            "bin/ctr",
            "cni/calico",
            "images/pause.tar",
            "images/listen.tar",
        ],
    )?;
    Ok(dir)
}

/// capo's own image, an OCI archive the real node imports: `CAPO_IMAGE`, or what
/// `build-image.sh` prints (a release build of capo; cached).
pub fn locate_capo_image() -> Result<PathBuf, Error> {
    let archive = match std::env::var_os("CAPO_IMAGE") {
        Some(path) => PathBuf::from(path),
        None => run_build_script("build-image.sh")?,
    };
    if !archive.is_file() {
        return Err(Error::MissingBinary { path: archive });
    }
    Ok(archive)
}

/// Runs a build script of `hack/` and returns the path it prints last.
fn run_build_script(name: &str) -> Result<PathBuf, Error> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name);
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|source| Error::Io { path: script.clone(), source })?;
    if !out.status.success() {
        return Err(Error::Build { script, status: out.status.to_string() });
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    Ok(PathBuf::from(stdout.lines().last().unwrap_or_default().trim()))
}

fn check(dir: &Path, names: &[&str]) -> Result<(), Error> {
    for name in names {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(Error::MissingBinary { path });
        }
    }
    Ok(())
}
