//! `kairos kernels compile`: fill the CUBIN cache ahead of time, without a GPU.
//!
//! A server compiles the kernel units its models need with NVRTC the first time it meets a device
//! and caches the images under `$KAIROS_CACHE_DIR`. A CUBIN depends only on the sources, the
//! options and the architecture, not on the GPU, the driver or the NVRTC version, so a deployment
//! can compile once, on any machine with libnvrtc, and ship the folder (a container image layer, a
//! shared volume) or embed it in the binary (`scripts/build-release.sh`). Units compile in
//! parallel on every core (`--jobs`).

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use kairos_cuda::Variant;
use kairos_cuda::nvrtc::{self, KernelCache};
use kairos_kernels::source::{Module, Unit};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum KernelsCommand {
    /// Compile the kernel library with NVRTC into the CUBIN cache (no GPU needed).
    Compile(CompileArgs),
    /// Where each kernel unit's image is for an architecture: the cache folder, embedded in this
    /// binary, or nowhere (compiled on first use).
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Compute capability as major * 10 + minor.
    #[arg(long, default_value_t = 90)]
    pub arch: u32,
    /// Cache folder (default: ~/.cache/kairos/cubin).
    #[arg(long, env = "KAIROS_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Variants {
    /// The protocol build every launch uses.
    Protocol,
    /// The plain-grid build (only the protocol-cost measurements and GPU tests use it).
    Plain,
    Both,
}

#[derive(Args, Debug)]
pub struct CompileArgs {
    /// Compute capabilities as major * 10 + minor, comma-separated (90: H100 and H200, the only one
    /// tested; 80: A100 and 89: L4/L40S compile but have never run).
    #[arg(long, value_delimiter = ',', default_value = "90")]
    pub arch: Vec<u32>,
    /// Cache folder (default: ~/.cache/kairos/cubin; servers read $KAIROS_CACHE_DIR).
    #[arg(long, env = "KAIROS_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Variants::Protocol)]
    pub variants: Variants,
    /// Units compiled at once (default: every core, or $KAIROS_COMPILE_JOBS; a tensor-core unit
    /// takes up to ~1 GB of memory while it compiles).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Only these modules or units (comma-separated: conv, gemm, eltwise, gemm_f16w_relu, ...; default:
    /// all).
    #[arg(long, value_delimiter = ',')]
    pub modules: Vec<String>,
    /// Also write each image gzipped (`NAME.cubin.gz`, what scripts/build-release.sh embeds; the
    /// runtime reads both) and remove the uncompressed one.
    #[arg(long)]
    pub gzip: bool,
    /// Print ptxas' report of every entry function (registers, spill bytes, stack frame): the way to
    /// see register pressure without a GPU. Always compiles (the report is not cached); the images
    /// land under their own cache key and are never what a server loads.
    #[arg(long)]
    pub ptxas: bool,
}

pub fn run(cmd: KernelsCommand) -> Result<()> {
    match cmd {
        KernelsCommand::Compile(a) => compile(a),
        KernelsCommand::Status(a) => status(a),
    }
}

/// The units `--modules` names (a module names all its units; all of them when it names none),
/// or an error naming the unknown ones.
fn select_units(names: &[String]) -> Result<Vec<Unit>> {
    let of_name = |n: &str| -> Option<Vec<Unit>> {
        if let Some(m) = Module::ALL.iter().find(|m| m.name() == n) {
            return Some(Unit::of_module(*m));
        }
        Unit::by_name(n).map(|u| vec![u])
    };
    let unknown: Vec<&String> = names.iter().filter(|n| of_name(n).is_none()).collect();
    if !unknown.is_empty() {
        let known: Vec<String> = Unit::all().iter().map(|u| u.name()).collect();
        bail!("unknown module(s) or unit(s) {unknown:?}: the library has {}", known.join(", "));
    }
    if names.is_empty() {
        return Ok(Unit::all());
    }
    let mut units: Vec<Unit> = names.iter().flat_map(|n| of_name(n).unwrap_or_default()).collect();
    units.sort();
    units.dedup();
    Ok(units)
}

fn compile(a: CompileArgs) -> Result<()> {
    let units = select_units(&a.modules)?;
    if !nvrtc::is_present() {
        bail!(
            "libnvrtc cannot be loaded: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and point \
             LD_LIBRARY_PATH at its lib folder"
        );
    }
    let dir = match a.cache_dir.clone().or_else(nvrtc::default_cache_dir) {
        Some(d) => d,
        None => bail!("no cache folder: pass --cache-dir or set KAIROS_CACHE_DIR"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (major, minor) = nvrtc::version().map_err(anyhow::Error::msg)?;
    let variants: &[Variant] = match a.variants {
        Variants::Protocol => &[Variant::Protocol],
        Variants::Plain => &[Variant::Plain],
        Variants::Both => &[Variant::Protocol, Variant::Plain],
    };
    let workers = a.jobs.unwrap_or_else(nvrtc::compile_workers).max(1);
    let t0 = Instant::now();
    let mut images = 0;
    for &arch in &a.arch {
        // The driver version only enters the key of PTX images; for CUBIN it is not used.
        // (Not verbose: ptxas' report is an option, and options are part of the key.)
        let cache = KernelCache { dir: Some(dir.clone()), arch, driver_version: 0, verbose: a.ptxas, quick: false };
        let (target, cubin) = cache.target().map_err(anyhow::Error::msg)?;
        if !cubin {
            bail!(
                "this NVRTC cannot emit CUBIN for sm_{arch} (newest it knows: sm_{target}); a PTX image is JIT-compiled by \
                 the driver and its cache key names the driver, so it cannot be prepared without the GPU"
            );
        }
        let jobs: Vec<(Unit, Variant)> = variants.iter().flat_map(|&v| units.iter().map(move |&u| (u, v))).collect();
        eprintln!(
            "{} kernel unit images for sm_{target} with NVRTC {major}.{minor} into {} ({workers} at a time)",
            jobs.len(),
            dir.display()
        );
        let results = cache.images(&jobs, workers, "the library");
        let mut failed = 0;
        for (&(u, v), r) in jobs.iter().zip(&results) {
            match r {
                Err(log) => {
                    eprintln!("unit {} ({v:?}) failed to compile for sm_{target}:\n{log}", u.name());
                    failed += 1;
                }
                Ok(img) => {
                    let mut text = describe(u, v, img);
                    if a.ptxas {
                        for r in nvrtc::parse_ptxas_log(&img.log) {
                            text.push_str(&format!(
                                "\n    {:<20} {:>3} registers, spills {:>5} B stored / {:>5} B loaded, stack {:>5} B",
                                r.function, r.registers, r.spill_store_bytes, r.spill_load_bytes, r.stack_frame_bytes
                            ));
                        }
                        // ptxas' warnings too (e.g. wgmma serialized for want of registers).
                        for line in img.log.lines().filter(|l| l.contains("arning")) {
                            text.push_str(&format!("\n    {}", line.trim()));
                        }
                    }
                    eprintln!("  {text}");
                    if a.gzip && !a.ptxas {
                        gzip_in_place(&dir, &cache.file_of(u, v).map_err(anyhow::Error::msg)?, &img.bytes)?;
                    }
                }
            }
        }
        if failed > 0 {
            bail!("{failed} of {} unit images failed to compile for sm_{target}", jobs.len());
        }
        images += jobs.len();
    }
    println!("{images} kernel unit images ready in {} ({:.1} s)", dir.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

fn status(a: StatusArgs) -> Result<()> {
    let dir = a.cache_dir.clone().or_else(nvrtc::default_cache_dir);
    let cache = KernelCache { dir: dir.clone(), arch: a.arch, driver_version: 0, verbose: false, quick: false };
    let embedded = nvrtc::prebuilt_names();
    let mut out = String::new();
    out.push_str(&format!(
        "kernel units for sm_{}: cache folder {}; {} image(s) embedded in this binary; NVRTC {}",
        a.arch,
        dir.as_ref().map_or("none".to_string(), |d| d.display().to_string()),
        embedded.len(),
        if nvrtc::is_present() {
            nvrtc::version().map(|(a, b)| format!("{a}.{b}")).unwrap_or_else(|e| e)
        } else {
            "not found (units found nowhere cannot be compiled)".to_string()
        }
    ));
    out.push('\n');
    let mut missing = 0;
    for v in [Variant::Protocol, Variant::Plain] {
        for u in Unit::all() {
            let location = cache.location(u, v).map_err(anyhow::Error::msg)?;
            let (in_dir, in_binary) = (location.cache_dir, location.embedded);
            let at = match (in_dir, in_binary) {
                (true, true) => "cache folder, embedded",
                (true, false) => "cache folder",
                (false, true) => "embedded",
                (false, false) => {
                    missing += 1;
                    "missing: compiled on first use"
                }
            };
            if v == Variant::Protocol || in_dir || in_binary {
                out.push_str(&format!("  {:<14} {:<9} {at}\n", u.name(), format!("{v:?}")));
            }
        }
    }
    out.push_str(&format!("{missing} unit image(s) missing (the plain build is only for protocol-cost measurements)\n"));
    // A reader that stops early (`| head`, `grep -q`) is not an error.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
    Ok(())
}

/// Writes `file.gz` beside the cache folder's `file` (atomically) and removes `file`.
fn gzip_in_place(dir: &std::path::Path, file: &str, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(bytes)?;
    let tmp = dir.join(format!("{file}.gz.{}.tmp", std::process::id()));
    std::fs::write(&tmp, gz.finish()?).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(format!("{file}.gz")))?;
    let _ = std::fs::remove_file(dir.join(file));
    Ok(())
}

fn describe(u: Unit, v: Variant, img: &nvrtc::Image) -> String {
    let head = format!("{:<14} {:<9} {:>8.1} KB", u.name(), format!("{v:?}"), img.bytes.len() as f64 / 1024.0);
    if img.from_cache() {
        format!("{head}  already there ({:?})", img.origin)
    } else {
        format!("{head}  compiled in {:.1} s", img.compile_ms / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_selection_names_the_unknown_ones() {
        assert_eq!(select_units(&[]).unwrap().len(), Unit::all().len());
        let picked: Vec<String> =
            select_units(&["gemm".to_string(), "eltwise".to_string()]).unwrap().iter().map(|u| u.name()).collect();
        assert_eq!(picked.len(), Unit::of_module(Module::Gemm).len() + 1, "{picked:?}");
        assert!(picked.contains(&"gemm_gv".to_string()) && picked.contains(&"eltwise".to_string()), "{picked:?}");
        let one = select_units(&["conv_f16n".to_string(), "conv_f16n".to_string()]).unwrap();
        assert_eq!(one.len(), 1);
        let err = select_units(&["gemm".to_string(), "wgmma".to_string()]).unwrap_err().to_string();
        assert!(err.contains("wgmma") && err.contains("gemm_f16w_act"), "{err}");
    }
}
