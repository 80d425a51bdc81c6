//! Where the installation's data lives, whatever the working directory: the measured kernel
//! profiles under `data/profiles/<gpu>/` that the simulator and the dispatcher's estimates read.
//!
//! The data folder is, in this order: `$KAIROS_DATA_DIR`; `./data` when it holds `profiles/`; the
//! first `data/` with `profiles/` beside the executable or above it (a build inside the repository:
//! `target/release/kairos` finds the repository's `data/`); `share/kairos/data` above the executable
//! (an installed layout); else `./data` (and models without a profile fall back to roofline times).

use std::path::{Path, PathBuf};

/// The data folder (see the module documentation for the search order).
pub fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KAIROS_DATA_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().ok().and_then(|e| e.canonicalize().ok());
    find_data_dir(Path::new("."), exe.as_deref()).unwrap_or_else(|| PathBuf::from("data"))
}

fn find_data_dir(cwd: &Path, exe: Option<&Path>) -> Option<PathBuf> {
    let has_profiles = |d: &Path| d.join("profiles").is_dir();
    let local = cwd.join("data");
    if has_profiles(&local) {
        return Some(local);
    }
    for dir in exe?.ancestors().skip(1) {
        for candidate in [dir.join("data"), dir.join("share").join("kairos").join("data")] {
            if has_profiles(&candidate) {
                return Some(candidate);
            }
        }
    }
    None
}

/// The profile folder of a GPU description key (`h100_sxm`, `h100_pcie`, `h200`).
pub fn profile_dir(key: &str) -> PathBuf {
    data_dir().join("profiles").join(key)
}

/// The profile folder for a real GPU, by its name as the driver reports it: an H200's, an H100
/// PCIe's, else an H100 SXM's (the only GPUs kairos has profiles of).
pub fn profile_dir_for_device(name: &str) -> PathBuf {
    let n = name.to_ascii_uppercase();
    profile_dir(if n.contains("H200") {
        "h200"
    } else if n.contains("H100") && n.contains("PCIE") {
        "h100_pcie"
    } else {
        "h100_sxm"
    })
}

/// The profile folder of the first CUDA device, when the driver answers (else the H100 SXM's).
pub fn cuda_profile_dir(device: u32) -> PathBuf {
    use kairos_cuda::driver;
    let name = (driver::is_present() && driver::init().is_ok())
        .then(|| driver::device_get(device as i32).and_then(driver::device_name).ok())
        .flatten();
    profile_dir_for_device(name.as_deref().unwrap_or("H100"))
}

/// Whether `serve` and `run` start kernel units on their quick builds (on unless
/// `KAIROS_QUICK_BUILDS=0`, which makes them wait for the optimized build of every kernel unit
/// they need: `CudaGpu::set_quick_builds`; the value was checked at start-up, `crate::env`).
pub fn quick_builds_wanted() -> bool {
    crate::env::flag("KAIROS_QUICK_BUILDS", true).unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_data_folder_beside_or_above_the_executable() {
        let root = std::env::temp_dir().join(format!("kairos-paths-{}", std::process::id()));
        let exe = root.join("target").join("release").join("kairos");
        std::fs::create_dir_all(root.join("data").join("profiles")).unwrap();
        std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
        let elsewhere = root.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        assert_eq!(find_data_dir(&elsewhere, Some(&exe)), Some(root.join("data")));
        assert_eq!(find_data_dir(&elsewhere, None), None);
        // An installed layout: PREFIX/bin/kairos and PREFIX/share/kairos/data.
        let prefix = root.join("prefix");
        std::fs::create_dir_all(prefix.join("share").join("kairos").join("data").join("profiles")).unwrap();
        assert_eq!(
            find_data_dir(&elsewhere, Some(&prefix.join("bin").join("kairos"))),
            Some(prefix.join("share").join("kairos").join("data"))
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn device_names_pick_their_profiles() {
        assert!(profile_dir_for_device("NVIDIA H100 80GB HBM3").ends_with("profiles/h100_sxm"));
        assert!(profile_dir_for_device("NVIDIA H100 PCIe").ends_with("profiles/h100_pcie"));
        assert!(profile_dir_for_device("NVIDIA H200").ends_with("profiles/h200"));
    }
}
