//! Writes capo's CRD YAML into `config/crd/bases/` and `charts/capo/crds/` (`make crds`).

use std::path::Path;

fn main() -> std::io::Result<()> {
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
    Ok(())
}
