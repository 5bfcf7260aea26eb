//! `crdgen`: writes capo's CRD YAML into `config/crd/bases/` and `charts/capo/crds/`, and
//! the webhook configuration into `config/webhook/manifests.yaml` (`make manifests`). `crdgen --calico` prints capo's bindings of Calico's IPReservation
//! CRDs (both API groups) instead, for clusters without Calico such as the local demo.

use std::path::Path;

fn main() -> std::io::Result<()> {
    if std::env::args().nth(1).as_deref() == Some("--calico") {
        for group in capo_api::CalicoApiGroup::ALL {
            print!("---\n{}", capo_api::crds::render(&group.ip_reservation_crd()));
        }
        return Ok(());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["config/crd/bases", "charts/capo/crds"] {
        let dir = root.join(dir);
        std::fs::create_dir_all(&dir)?;
        for (file, crd) in capo_api::crds::capo_crds() {
            let path = dir.join(file);
            std::fs::write(&path, capo_api::crds::render(&crd))?;
            println!("wrote {}", path.display());
        }
    }
    let path = root.join("config/webhook/manifests.yaml");
    std::fs::create_dir_all(path.parent().expect("a parent"))?;
    std::fs::write(&path, capo::webhook_config::in_cluster_yaml())?;
    println!("wrote {}", path.display());
    Ok(())
}
