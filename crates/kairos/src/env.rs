//! The binary's environment variables that belong to no one command's option (an option's variable
//! is named in `kairos <command> --help`). They are read here, once, at start-up and handed to the
//! libraries as settings: `kairos_cuda::configure`, `kairos_ir::lower::set_split_k_default` and
//! `kairos_ir::lower::set_fuse_acts_default`.
//! The libraries never read the environment themselves. The README's table "Environment
//! variables" lists these and the CUDA backend's (`kairos_cuda::settings::ENV_VARS`); a test
//! (tests/env_table.rs) checks that every variable any source reads is in that table.

use anyhow::Result;

/// One variable the binary reads.
pub struct EnvVar {
    pub name: &'static str,
    pub meaning: &'static str,
}

/// The binary's own process-wide variables (besides the CUDA backend's).
pub const ENV_VARS: &[EnvVar] = &[
    EnvVar { name: "KAIROS_DATA_DIR", meaning: "folder holding profiles/ and gpus/ (default: beside the installation)" },
    EnvVar { name: "KAIROS_QUICK_BUILDS", meaning: "0: serve and run wait for optimized kernel builds instead of quick ones" },
    EnvVar { name: "KAIROS_SPLIT_K", meaning: "1: lower long fp16 reductions with split-K" },
    EnvVar {
        name: "KAIROS_FUSE_ACTS",
        meaning: "0: only ReLU joins convolution and product epilogues; other activations run as element-wise launches",
    },
    EnvVar { name: "KAIROS_CPU_PROFILE", meaning: "PATH: write a sampled CPU profile at exit (build feature cpu-profile)" },
    EnvVar { name: "RUST_LOG", meaning: "log filter of kairos serve (overrides --log)" },
];

/// The table `kairos --help` ends with: these variables and the CUDA backend's.
pub fn help_text() -> String {
    let mut s = String::from("Environment variables (besides each option's, named in `kairos <command> --help`):\n");
    let rows = ENV_VARS.iter().map(|v| (v.name, v.meaning));
    for (name, meaning) in rows.chain(kairos_cuda::settings::ENV_VARS.iter().map(|v| (v.name, v.meaning))) {
        s.push_str(&format!("  {name:<28} {meaning}\n"));
    }
    s
}

/// Reads the process-wide variables and installs the libraries' settings. A value that does not
/// parse is an error naming the variable.
pub fn install() -> Result<()> {
    kairos_cuda::configure(kairos_cuda::Settings::from_env()?)?;
    kairos_ir::lower::set_split_k_default(flag("KAIROS_SPLIT_K", false)?);
    kairos_ir::lower::set_fuse_acts_default(flag("KAIROS_FUSE_ACTS", true)?);
    flag("KAIROS_QUICK_BUILDS", true)?;
    Ok(())
}

/// A 0/1 variable, `default` when unset or empty.
pub fn flag(name: &'static str, default: bool) -> Result<bool> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => Ok(kairos_cuda::settings::flag(name, &v)?),
        _ => Ok(default),
    }
}
