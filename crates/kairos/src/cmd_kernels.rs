//! `kairos kernels compile`: fill the CUBIN cache ahead of time, without a GPU.
//!
//! A server compiles the kernel library with NVRTC the first time it meets a device (minutes for
//! the tensor-core modules) and caches the images under `$KAIROS_CACHE_DIR`. A CUBIN depends only
//! on the sources, the options, the architecture and the NVRTC version, not on the GPU or driver,
//! so a deployment can compile once, on any machine with libnvrtc, and ship the folder (a
//! container image layer, a shared volume): servers started with the same `KAIROS_CACHE_DIR` and
//! the same NVRTC version then load the images in milliseconds.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use kairos_cuda::Variant;
use kairos_cuda::nvrtc::{self, KernelCache};
use kairos_kernels::source::Module;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum KernelsCommand {
    /// Compile the kernel library with NVRTC into the CUBIN cache (no GPU needed).
    Compile(CompileArgs),
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
    /// Compute capability as major * 10 + minor (90: H100 and H200).
    #[arg(long, default_value_t = 90)]
    pub arch: u32,
    /// Cache folder (default: ~/.cache/kairos/cubin; servers read $KAIROS_CACHE_DIR).
    #[arg(long, env = "KAIROS_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Variants::Protocol)]
    pub variants: Variants,
    /// Modules compiled at once (each tensor-core module takes ~1.5 GB of memory while it
    /// compiles; default: the number of cores, at most 8).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Only these modules (comma-separated names: conv, gemm, eltwise, ...; default: all).
    #[arg(long, value_delimiter = ',')]
    pub modules: Vec<String>,
    /// Print ptxas' report of every entry function (registers, spill bytes, stack frame): the way to
    /// see register pressure without a GPU. Always compiles (the report is not cached); the images
    /// land under their own cache key and are never what a server loads.
    #[arg(long)]
    pub ptxas: bool,
}

pub fn run(cmd: KernelsCommand) -> Result<()> {
    match cmd {
        KernelsCommand::Compile(a) => compile(a),
    }
}

/// The modules `--modules` names (all of them when it names none), or an error naming the unknown ones.
fn select_modules(names: &[String]) -> Result<Vec<Module>> {
    let unknown: Vec<&String> = names.iter().filter(|n| !Module::ALL.iter().any(|m| m.name() == n.as_str())).collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = Module::ALL.iter().map(|m| m.name()).collect();
        bail!("unknown module(s) {unknown:?}: the library has {}", known.join(", "));
    }
    Ok(Module::ALL.into_iter().filter(|m| names.is_empty() || names.iter().any(|n| n == m.name())).collect())
}

fn compile(a: CompileArgs) -> Result<()> {
    let modules = select_modules(&a.modules)?;
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
    // The driver version only enters the key of PTX images; for CUBIN it is not used.
    // (Not verbose: ptxas' report is an option, and options are part of the key.)
    let cache = KernelCache { dir: Some(dir.clone()), arch: a.arch, driver_version: 0, verbose: a.ptxas };
    let (target, cubin) = cache.target().map_err(anyhow::Error::msg)?;
    if !cubin {
        bail!(
            "this NVRTC cannot emit CUBIN for sm_{} (newest it knows: sm_{target}); a PTX image is JIT-compiled by the \
             driver and its cache key names the driver, so it cannot be prepared without the GPU",
            a.arch
        );
    }
    let (major, minor) = nvrtc::version().map_err(anyhow::Error::msg)?;
    let variants: &[Variant] = match a.variants {
        Variants::Protocol => &[Variant::Protocol],
        Variants::Plain => &[Variant::Plain],
        Variants::Both => &[Variant::Protocol, Variant::Plain],
    };
    let jobs: Vec<(Module, Variant)> = variants.iter().flat_map(|&v| modules.iter().map(move |&m| (m, v))).collect();
    let workers = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)).max(1);
    eprintln!(
        "compiling {} module images for sm_{target} with NVRTC {major}.{minor} into {} ({} at a time)",
        jobs.len(),
        dir.display(),
        workers
    );
    let t0 = Instant::now();
    let next = AtomicUsize::new(0);
    let results: Vec<Vec<(usize, Result<String>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(m, v)) = jobs.get(i) else { break };
                        let r = cache
                            .image(m, v)
                            .map_err(|log| anyhow::anyhow!("module {} ({v:?}) failed to compile:\n{log}", m.name()))
                            .map(|img| {
                                let mut text = describe(m, v, &img);
                                if a.ptxas {
                                    for r in nvrtc::parse_ptxas_log(&img.log) {
                                        text.push_str(&format!(
                                            "\n    {:<20} {:>3} registers, spills {:>5} B stored / {:>5} B loaded, stack {:>5} B",
                                            r.function, r.registers, r.spill_store_bytes, r.spill_load_bytes, r.stack_frame_bytes
                                        ));
                                    }
                                }
                                text
                            });
                        if let Ok(line) = &r {
                            eprintln!("  {line}");
                        }
                        done.push((i, r));
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a compile thread panicked")).collect()
    });
    let mut results: Vec<(usize, Result<String>)> = results.into_iter().flatten().collect();
    results.sort_by_key(|r| r.0);
    let mut failed = 0;
    for (_, r) in &results {
        if let Err(e) = r {
            eprintln!("{e:#}");
            failed += 1;
        }
    }
    if failed > 0 {
        bail!("{failed} of {} module images failed to compile", jobs.len());
    }
    println!("{} module images ready in {} ({:.1} s)", jobs.len(), dir.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

fn describe(m: Module, v: Variant, img: &nvrtc::Image) -> String {
    let head = format!("{:<8} {:<9} {:>8.1} KB", m.name(), format!("{v:?}"), img.bytes.len() as f64 / 1024.0);
    if img.from_cache { format!("{head}  already cached") } else { format!("{head}  compiled in {:.1} s", img.compile_ms / 1e3) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_selection_names_the_unknown_ones() {
        assert_eq!(select_modules(&[]).unwrap().len(), Module::ALL.len());
        let picked: Vec<&str> =
            select_modules(&["gemm".to_string(), "conv".to_string()]).unwrap().iter().map(|m| m.name()).collect();
        assert_eq!(picked.len(), 2);
        assert!(picked.contains(&"gemm") && picked.contains(&"conv"), "{picked:?}");
        let err = select_modules(&["gemm".to_string(), "wgmma".to_string()]).unwrap_err().to_string();
        assert!(err.contains("wgmma") && err.contains("gemm"), "{err}");
    }
}
