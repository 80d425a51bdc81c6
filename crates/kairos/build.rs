//! Embeds prebuilt kernel images in the binary: when `KAIROS_PREBUILT_KERNELS` names a folder of
//! `*.cubin` / `*.cubin.gz` files (as `kairos kernels compile --cache-dir DIR --gzip` writes them;
//! scripts/build-release.sh does both steps), every image in it becomes part of the binary, and a
//! GPU of those architectures serves without compiling anything; `autotune-*.json` tables in the
//! folder (copied from a GPU's cache folder) are embedded too. Without it nothing is embedded.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=KAIROS_PREBUILT_KERNELS");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("prebuilt_kernels.rs");
    let mut code =
        String::from("/// Kernel images embedded at build time (file name, bytes).\npub static IMAGES: &[(&str, &[u8])] = &[\n");
    if let Some(dir) = std::env::var_os("KAIROS_PREBUILT_KERNELS").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        println!("cargo:rerun-if-changed={}", dir.display());
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("KAIROS_PREBUILT_KERNELS={}: cannot read the folder: {e}", dir.display()));
        let mut files: Vec<(String, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .filter(|(n, _)| {
                n.ends_with(".cubin") || n.ends_with(".cubin.gz") || (n.starts_with("autotune-") && n.ends_with(".json"))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            panic!("KAIROS_PREBUILT_KERNELS={} holds no .cubin or .cubin.gz images", dir.display());
        }
        for (name, path) in files {
            let path = path.canonicalize().unwrap_or(path);
            println!("cargo:rerun-if-changed={}", path.display());
            code.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", path.display().to_string()));
        }
    }
    code.push_str("];\n");
    std::fs::write(&out, code).expect("write prebuilt_kernels.rs");
}
