//! NVRTC: compiling the kernel library for the device, with an on-disk cache and prebuilt images.
//!
//! The library is compiled in [`Unit`]s (`kairos_kernels::source`): the small modules whole, the
//! two tensor-core modules one entry kind per unit, so the units compile in parallel on every core
//! and a model compiles only the units its plan launches ([`KernelCache::images`]). Each unit is
//! compiled to CUBIN for the device's own architecture (`sm_90` on H100/H200); only when this
//! NVRTC cannot target the device does it fall back to PTX for the newest architecture it knows,
//! which the driver then JIT-compiles.
//!
//! Where an image comes from, first hit wins: the cache folder (`$KAIROS_CACHE_DIR`, default
//! `~/.cache/kairos/cubin`), then the images embedded in the binary at build time
//! ([`register_prebuilt`]; `scripts/build-release.sh`), then NVRTC. The file name is the key: a
//! hash of the unit's source and headers, the compile options (the unit's entry selection among
//! them) and the target. A CUBIN is machine code for its architecture and depends on nothing
//! else, so its key names neither the driver nor the NVRTC that made it (a cache filled by
//! `kairos kernels compile` on a machine without a GPU, or embedded in the binary, serves any
//! machine of that architecture); should a driver refuse an image (one from a newer toolkit than
//! the driver), the GPU recompiles it with its own NVRTC ([`KernelCache::image_forced`]). PTX is
//! JIT-compiled by the driver, so its key names the driver and NVRTC versions. Writes are atomic
//! (a temporary file renamed into place), so processes sharing a folder never read half an image
//! and two writers of one key write the same bytes. A failed compilation reports NVRTC's log.

use crate::progress::CompileProgress;
use cudarc::nvrtc::sys;
use kairos_kernels::source::{HEADERS, Module, QUICK_BUILD_OPTION, Unit};
use std::ffi::{CString, c_char};
use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// How a module's kernels are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    /// Under the kernel protocol (what every launch uses).
    Protocol,
    /// The same kernels as plain grids (`KAIROS_PROTOCOL_OFF`): the baseline for the protocol's cost.
    Plain,
}

/// Where an image came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Compiled by NVRTC now.
    Compiled,
    /// Read from the cache folder.
    Cache,
    /// Embedded in the binary at build time.
    Prebuilt,
}

/// A compiled unit image.
#[derive(Clone, Debug)]
pub struct Image {
    /// CUBIN, or NUL-terminated PTX when `cubin` is false.
    pub bytes: Vec<u8>,
    pub cubin: bool,
    /// NVRTC's log (ptxas resource lines when compiled with `verbose`); empty unless compiled now.
    pub log: String,
    pub origin: Origin,
    pub compile_ms: f64,
}

impl Image {
    pub fn from_cache(&self) -> bool {
        self.origin != Origin::Compiled
    }
}

/// Whether libnvrtc can be loaded.
pub fn is_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library by its candidate names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Files embedded in the binary (unit images, autotuning tables): (cache file name, bytes; gzip
/// when the name ends in `.gz`).
static PREBUILT: OnceLock<&'static [(&'static str, &'static [u8])]> = OnceLock::new();

/// Registers the images a binary embeds (the `kairos` binary's build script embeds the folder
/// `KAIROS_PREBUILT_KERNELS` names). Once per process; later calls are ignored.
pub fn register_prebuilt(images: &'static [(&'static str, &'static [u8])]) {
    let _ = PREBUILT.set(images);
}

/// The names of the embedded images.
pub fn prebuilt_names() -> Vec<&'static str> {
    PREBUILT.get().map(|v| v.iter().map(|(n, _)| *n).collect()).unwrap_or_default()
}

/// An embedded file (image or autotuning table) by its cache file name, decompressed.
pub(crate) fn prebuilt(file: &str) -> Option<Vec<u8>> {
    let images = PREBUILT.get()?;
    if let Some((_, bytes)) = images.iter().find(|(n, _)| *n == file) {
        return Some(bytes.to_vec());
    }
    let gz = format!("{file}.gz");
    images.iter().find(|(n, _)| *n == gz).and_then(|(_, bytes)| gunzip(bytes))
}

/// Whether the binary embeds `file` (plain or gzipped).
fn is_embedded(file: &str) -> bool {
    prebuilt_names().iter().any(|n| n.strip_suffix(".gz").unwrap_or(n) == file)
}

/// Reads an image of the cache folder (`file`, or `file.gz` as `kairos kernels compile --gzip`
/// writes for shipping).
fn cached(dir: &std::path::Path, file: &str) -> Option<Vec<u8>> {
    if let Ok(bytes) = std::fs::read(dir.join(file))
        && !bytes.is_empty()
    {
        return Some(bytes);
    }
    gunzip(&std::fs::read(dir.join(format!("{file}.gz"))).ok()?).filter(|out| !out.is_empty())
}

fn gunzip(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut out).ok()?;
    Some(out)
}

/// Where a unit's image is, without compiling anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// In the cache folder (plain or gzipped).
    pub cache_dir: bool,
    /// Embedded in this binary.
    pub embedded: bool,
}

fn nvrtc_check(call: &str, r: sys::nvrtcResult) -> Result<(), String> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS { Ok(()) } else { Err(format!("{call} failed with {r:?}")) }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both out-pointers are live locals; callers check is_present() first.
    nvrtc_check("nvrtcVersion", unsafe { sys::nvrtcVersion(&mut major, &mut minor) })?;
    Ok((major, minor))
}

/// The SM architectures (e.g. 90) this NVRTC can emit CUBIN for.
pub fn supported_archs() -> Result<Vec<i32>, String> {
    let mut n = 0;
    // SAFETY: the out-pointer is a live local.
    nvrtc_check("nvrtcGetNumSupportedArchs", unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) })?;
    let mut v = vec![0i32; n.max(0) as usize];
    // SAFETY: v holds exactly the number of entries NVRTC reported.
    nvrtc_check("nvrtcGetSupportedArchs", unsafe { sys::nvrtcGetSupportedArchs(v.as_mut_ptr()) })?;
    Ok(v)
}

/// Owns an nvrtcProgram and destroys it on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 was created by nvrtcCreateProgram and is destroyed only here.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

impl Program {
    fn log(&self) -> String {
        let mut n = 0usize;
        // SAFETY: the program is live; the out-pointer is a live local.
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut n) } != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        // SAFETY: buf holds the n bytes NVRTC asked for.
        unsafe { sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr() as *mut c_char) };
        String::from_utf8_lossy(&buf).trim_end_matches('\0').trim().to_string()
    }

    fn output(&self, cubin: bool) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        let mut buf;
        if cubin {
            // SAFETY: the program is live and compiled; the out-pointer is a live local.
            nvrtc_check("nvrtcGetCUBINSize", unsafe { sys::nvrtcGetCUBINSize(self.0, &mut n) })?;
            buf = vec![0u8; n];
            // SAFETY: buf holds the n bytes NVRTC reported.
            nvrtc_check("nvrtcGetCUBIN", unsafe { sys::nvrtcGetCUBIN(self.0, buf.as_mut_ptr() as *mut c_char) })?;
        } else {
            // SAFETY: as above, for PTX (whose size includes the terminating NUL).
            nvrtc_check("nvrtcGetPTXSize", unsafe { sys::nvrtcGetPTXSize(self.0, &mut n) })?;
            buf = vec![0u8; n];
            // SAFETY: buf holds the n bytes NVRTC reported.
            nvrtc_check("nvrtcGetPTX", unsafe { sys::nvrtcGetPTX(self.0, buf.as_mut_ptr() as *mut c_char) })?;
        }
        Ok(buf)
    }
}

/// Compiles one source with named headers. Errors carry NVRTC's log.
pub fn compile(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
    cubin: bool,
) -> Result<(Vec<u8>, String), String> {
    let c = |s: &str| CString::new(s).map_err(|_| format!("{name}: NUL byte in source, header or option"));
    let src = c(source)?;
    let cname = c(name)?;
    let hsrc: Vec<CString> = headers.iter().map(|h| c(h.1)).collect::<Result<_, _>>()?;
    let hname: Vec<CString> = headers.iter().map(|h| c(h.0)).collect::<Result<_, _>>()?;
    let hsrc_p: Vec<*const c_char> = hsrc.iter().map(|s| s.as_ptr()).collect();
    let hname_p: Vec<*const c_char> = hname.iter().map(|s| s.as_ptr()).collect();
    let opts: Vec<CString> = options.iter().map(|o| c(o)).collect::<Result<_, _>>()?;
    let opts_p: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every string is a live NUL-terminated CString, the header arrays hold
    // headers.len() entries each, and the out-pointer is a live local.
    nvrtc_check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(&mut raw, src.as_ptr(), cname.as_ptr(), headers.len() as i32, hsrc_p.as_ptr(), hname_p.as_ptr())
    })?;
    let prog = Program(raw);
    // SAFETY: the program is live; opts_p holds opts.len() live NUL-terminated strings.
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, opts_p.len() as i32, opts_p.as_ptr()) };
    let log = prog.log();
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(if log.is_empty() { format!("nvrtcCompileProgram failed with {r:?}") } else { log });
    }
    Ok((prog.output(cubin)?, log))
}

/// Where and for what the library is compiled.
#[derive(Clone, Debug)]
pub struct KernelCache {
    /// None: no disk cache (directory not creatable).
    pub dir: Option<PathBuf>,
    /// Compute capability as major * 10 + minor (90 for sm_90).
    pub arch: u32,
    pub driver_version: i32,
    /// Ask ptxas for its resource report (registers, spills) in the log.
    pub verbose: bool,
    /// Quick builds ([`KernelCache::quick_builds`]): the units that have one
    /// ([`Unit::has_quick_build`]) compile with [`QUICK_BUILD_OPTION`], under keys of their own.
    pub quick: bool,
}

/// Extra NVRTC options for every build ([`crate::settings::Settings::nvrtc_options`]); they enter
/// the cache keys, so images built with and without them never mix. For measuring what an option
/// does to compile time and kernel speed.
fn extra_options() -> &'static [String] {
    &crate::settings::settings().nvrtc_options
}

/// The cache folder of the settings in force ([`crate::settings::Settings::cache_dir`]).
pub fn default_cache_dir() -> Option<PathBuf> {
    crate::settings::settings().cache_dir.clone()
}

/// 128-bit FNV-1a (two 64-bit lanes with different offsets), hex: a content key, not a MAC.
pub(crate) fn content_hash(parts: &[&[u8]]) -> String {
    let mut h = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64];
    for part in parts {
        for lane in h.iter_mut() {
            for &b in part.iter().chain(&[0xffu8]) {
                *lane ^= b as u64;
                *lane = lane.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    format!("{:016x}{:016x}", h[0], h[1])
}

impl KernelCache {
    pub fn new(arch: u32, driver_version: i32) -> KernelCache {
        let dir = default_cache_dir().filter(|d| std::fs::create_dir_all(d).is_ok());
        KernelCache { dir, arch, driver_version, verbose: false, quick: false }
    }

    /// The same cache for quick builds (see [`KernelCache::quick`]).
    pub fn quick_builds(&self) -> KernelCache {
        KernelCache { quick: true, ..self.clone() }
    }

    /// Whether this cache builds `unit` quick.
    pub fn is_quick(&self, unit: Unit) -> bool {
        self.quick && unit.has_quick_build()
    }

    /// The NVRTC target: CUBIN for the device when NVRTC supports its architecture, else PTX for
    /// the newest architecture not above it. Without NVRTC: CUBIN for the device (the cache and
    /// the embedded images may hold it; compiling then fails with a clear error).
    pub fn target(&self) -> Result<(u32, bool), String> {
        if !is_present() {
            return Ok((self.arch, true));
        }
        let archs = supported_archs()?;
        if archs.contains(&(self.arch as i32)) {
            return Ok((self.arch, true));
        }
        archs
            .iter()
            .filter(|&&a| a as u32 <= self.arch)
            .max()
            .map(|&a| (a as u32, false))
            .ok_or_else(|| format!("NVRTC supports none of the architectures up to sm_{}", self.arch))
    }

    /// NVRTC's options for a unit (its entry selection included).
    pub fn options(&self, unit: Unit, target: u32, cubin: bool, variant: Variant) -> Vec<String> {
        // sm_90 is compiled as sm_90a, its architecture-specific target: the tile engine's
        // warpgroup MMA (wgmma, tile.cuh) exists only there; such an image loads on sm_90 devices only.
        let suffix = if target == 90 { "a" } else { "" };
        let mut o = vec![
            format!("--gpu-architecture={}_{target}{suffix}", if cubin { "sm" } else { "compute" }),
            "--std=c++17".to_string(),
        ];
        if variant == Variant::Plain {
            o.push("-DKAIROS_PROTOCOL_OFF".to_string());
        }
        o.extend(unit.define());
        o.extend(extra_options().iter().cloned());
        if self.is_quick(unit) {
            o.push(QUICK_BUILD_OPTION.to_string());
        }
        if self.verbose {
            o.push("--ptxas-options=-v".to_string());
        }
        o
    }

    /// Where the autotuner keeps its choices for this device: next to the CUBIN images, keyed by
    /// the sources of the tuned kernels (conv and gemm modules and every header), the target, the
    /// driver and NVRTC versions, plus the device's name and SM count (an H100 and an H200 share
    /// sm_90 but not their best tiles). None without a cache folder.
    pub fn tuning_file(&self, device_name: &str, sm_count: u32) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let (target, cubin) = self.target().ok()?;
        let mut parts: Vec<&[u8]> = vec![Module::Conv.source().as_bytes(), Module::Gemm.source().as_bytes()];
        for h in HEADERS.iter() {
            parts.push(h.0.as_bytes());
            parts.push(h.1.as_bytes());
        }
        let opt_text = self.options(Unit { module: Module::Gemm, entry: None }, target, cubin, Variant::Protocol).join(" ");
        // Like the CUBIN keys: the machine code, and so the timings, depend on the sources, the
        // options and the target, not on the driver or the NVRTC that compiled them; a table made
        // on one H100 SXM serves every other (and can be shipped or embedded like the images).
        let versions = if cubin {
            format!("device {device_name} sms {sm_count}")
        } else {
            let nvrtc = version().ok()?;
            format!("driver {} nvrtc {}.{} device {device_name} sms {sm_count}", self.driver_version, nvrtc.0, nvrtc.1)
        };
        parts.push(opt_text.as_bytes());
        parts.push(versions.as_bytes());
        Some(dir.join(format!("autotune-sm{target}-{}.json", content_hash(&parts))))
    }

    /// The cache file name of a unit's image for `target` (CUBIN or PTX); `nvrtc` enters only PTX
    /// keys (see the module doc).
    pub fn image_file(&self, unit: Unit, variant: Variant, target: u32, cubin: bool, nvrtc: (i32, i32)) -> String {
        let options = self.options(unit, target, cubin, variant);
        let mut parts: Vec<&[u8]> = vec![unit.module.source().as_bytes()];
        for h in HEADERS.iter() {
            parts.push(h.0.as_bytes());
            parts.push(h.1.as_bytes());
        }
        let opt_text = options.join(" ");
        let versions =
            if cubin { "cubin".to_string() } else { format!("driver {} nvrtc {}.{}", self.driver_version, nvrtc.0, nvrtc.1) };
        parts.push(opt_text.as_bytes());
        parts.push(versions.as_bytes());
        let key = content_hash(&parts);
        let variant_name = if variant == Variant::Plain { "plain" } else { "proto" };
        let build = if self.is_quick(unit) { "-quick" } else { "" };
        format!("{}-{variant_name}{build}-sm{target}-{key}.{}", unit.name(), if cubin { "cubin" } else { "ptx" })
    }

    /// The cache file name of a unit's image for this device and this NVRTC.
    pub fn file_of(&self, unit: Unit, variant: Variant) -> Result<String, String> {
        self.resolve(unit, variant).map(|r| r.2)
    }

    /// Where a unit's image is: the cache folder, the binary, both or neither.
    pub fn location(&self, unit: Unit, variant: Variant) -> Result<Location, String> {
        let file = self.file_of(unit, variant)?;
        let cache_dir = self.dir.as_ref().is_some_and(|d| d.join(&file).is_file() || d.join(format!("{file}.gz")).is_file());
        Ok(Location { cache_dir, embedded: is_embedded(&file) })
    }

    /// Whether a unit's image is at hand without compiling (cache folder or embedded).
    pub fn is_ready(&self, unit: Unit, variant: Variant) -> bool {
        !self.verbose && self.location(unit, variant).is_ok_and(|l| l.cache_dir || l.embedded)
    }

    /// A unit's image: from the cache folder or the embedded images when present, else compiled
    /// (and cached).
    pub fn image(&self, unit: Unit, variant: Variant) -> Result<Image, String> {
        let (target, cubin, file) = self.resolve(unit, variant)?;
        if !self.verbose {
            if let Some(bytes) = self.dir.as_ref().and_then(|d| cached(d, &file)) {
                return Ok(Image { bytes, cubin, log: String::new(), origin: Origin::Cache, compile_ms: 0.0 });
            }
            if let Some(bytes) = prebuilt(&file) {
                return Ok(Image { bytes, cubin, log: String::new(), origin: Origin::Prebuilt, compile_ms: 0.0 });
            }
        }
        self.compile_unit(unit, variant, target, cubin, &file)
    }

    /// A unit's image compiled now by this NVRTC, replacing the cached one (for an image the
    /// driver refused).
    pub fn image_forced(&self, unit: Unit, variant: Variant) -> Result<Image, String> {
        let (target, cubin, file) = self.resolve(unit, variant)?;
        self.compile_unit(unit, variant, target, cubin, &file)
    }

    /// The target (architecture, CUBIN or PTX) and the cache file name of a unit.
    fn resolve(&self, unit: Unit, variant: Variant) -> Result<(u32, bool, String), String> {
        let (target, cubin) = self.target()?;
        let nvrtc = if cubin { (0, 0) } else { version()? };
        Ok((target, cubin, self.image_file(unit, variant, target, cubin, nvrtc)))
    }

    fn compile_unit(&self, unit: Unit, variant: Variant, target: u32, cubin: bool, file: &str) -> Result<Image, String> {
        if !is_present() {
            return Err(format!(
                "kernel unit {} is neither in the cache ({}) nor embedded in this binary, and libnvrtc cannot be loaded to \
                 compile it: install NVRTC (`pip install nvidia-cuda-nvrtc`, LD_LIBRARY_PATH at its lib folder), fill the \
                 cache elsewhere with `kairos kernels compile --arch {}`, or use a binary built by scripts/build-release.sh",
                unit.name(),
                self.dir.as_ref().map_or("none".to_string(), |d| d.display().to_string()),
                self.arch
            ));
        }
        // One compilation per image and process: a second caller waits for the first and reads
        // its result from the cache folder.
        let _claim = match &self.dir {
            Some(dir) if !self.verbose => match Claim::take(dir.join(file)) {
                Some(c) => Some(c),
                None => {
                    if let Some(bytes) = cached(dir, file) {
                        return Ok(Image { bytes, cubin, log: String::new(), origin: Origin::Cache, compile_ms: 0.0 });
                    }
                    Claim::take(dir.join(file))
                }
            },
            _ => None,
        };
        let options = self.options(unit, target, cubin, variant);
        let t = Instant::now();
        let (bytes, log) = compile(&format!("{}.cu", unit.module.name()), unit.module.source(), &HEADERS, &options, cubin)?;
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Some(dir) = &self.dir
            && !self.verbose
        {
            // Write then rename, so a concurrent reader never sees half a file; a failure only
            // costs the next run a compilation.
            static SEQ: AtomicUsize = AtomicUsize::new(0);
            let tmp = dir.join(format!("{file}.{}-{}.tmp", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
            if std::fs::write(&tmp, &bytes).is_ok() && std::fs::rename(&tmp, dir.join(file)).is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        Ok(Image { bytes, cubin, log, origin: Origin::Compiled, compile_ms })
    }

    /// The images of several units, those not at hand compiled in parallel on up to `workers`
    /// threads, with progress on stderr when anything is compiled. Results in the order asked.
    pub fn images(&self, jobs: &[(Unit, Variant)], workers: usize, what: &str) -> Vec<Result<Image, String>> {
        let builds: Vec<(Unit, Variant, bool)> = jobs.iter().map(|&(u, v)| (u, v, self.quick)).collect();
        self.images_of(&builds, workers, what)
    }

    /// [`KernelCache::images`] with each job's build chosen: `(unit, variant, quick)`.
    pub fn images_of(&self, jobs: &[(Unit, Variant, bool)], workers: usize, what: &str) -> Vec<Result<Image, String>> {
        let (quick, optimized) = (self.quick_builds(), KernelCache { quick: false, ..self.clone() });
        let cache = |q: bool| if q { &quick } else { &optimized };
        let (ready, mut todo): (Vec<usize>, Vec<usize>) =
            (0..jobs.len()).partition(|&i| cache(jobs[i].2).is_ready(jobs[i].0, jobs[i].1));
        // Longest first, so that no long unit starts late behind short ones (Unit::compile_cost_s).
        todo.sort_by_key(|&i| std::cmp::Reverse(jobs[i].0.compile_cost_s()));
        let mut out: Vec<Option<Result<Image, String>>> = (0..jobs.len()).map(|_| None).collect();
        for i in ready {
            out[i] = Some(cache(jobs[i].2).image(jobs[i].0, jobs[i].1));
        }
        if !todo.is_empty() {
            let names: Vec<String> = todo
                .iter()
                .map(|&i| format!("{}{}", jobs[i].0.name(), if cache(jobs[i].2).is_quick(jobs[i].0) { " (quick)" } else { "" }))
                .collect();
            let progress = CompileProgress::start(what, self.arch, &names, workers.clamp(1, todo.len()));
            let next = AtomicUsize::new(0);
            let done: Vec<(usize, Result<Image, String>)> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..workers.clamp(1, todo.len()))
                    .map(|_| {
                        s.spawn(|| {
                            let mut mine = Vec::new();
                            loop {
                                let k = next.fetch_add(1, Ordering::Relaxed);
                                let Some(&i) = todo.get(k) else { break };
                                let (unit, variant, q) = jobs[i];
                                progress.begin(k);
                                let r = cache(q).image(unit, variant);
                                let outcome = r.as_ref().map(|img| (!img.from_cache()).then_some(img.compile_ms));
                                progress.end(k, outcome.map_err(|_| ()));
                                mine.push((i, r));
                            }
                            mine
                        })
                    })
                    .collect();
                handles.into_iter().flat_map(|h| h.join().expect("an NVRTC compile thread panicked")).collect()
            });
            progress.finish();
            for (i, r) in done {
                out[i] = Some(r);
            }
        }
        out.into_iter().map(|r| r.expect("every job has a result")).collect()
    }
}

/// Compilations running in the background (optimized builds replacing quick ones, units a later
/// load will need), so a short-lived command can let them finish ([`finish_background`]).
static BACKGROUND: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>> = std::sync::Mutex::new(Vec::new());

/// Runs `work` on a background compile thread (named `kairos-nvrtc`); false if the thread could
/// not be started.
pub fn spawn_background(work: impl FnOnce() + Send + 'static) -> bool {
    match std::thread::Builder::new().name("kairos-nvrtc".into()).spawn(work) {
        Ok(h) => {
            let mut v = BACKGROUND.lock().unwrap_or_else(|e| e.into_inner());
            v.retain(|h| !h.is_finished());
            v.push(h);
            true
        }
        Err(_) => false,
    }
}

/// Waits for the background compilations of this process (their images land in the cache folder
/// for the next run); returns how many were still running. `note` is printed first when any is.
pub fn finish_background(note: &str) -> usize {
    let handles: Vec<_> = std::mem::take(&mut *BACKGROUND.lock().unwrap_or_else(|e| e.into_inner()));
    let running = handles.iter().filter(|h| !h.is_finished()).count();
    if running > 0 && !note.is_empty() {
        eprintln!("kairos: {note}");
    }
    for h in handles {
        let _ = h.join();
    }
    running
}

/// The images being compiled in this process (their cache paths).
static IN_FLIGHT: (std::sync::Mutex<Vec<PathBuf>>, std::sync::Condvar) =
    (std::sync::Mutex::new(Vec::new()), std::sync::Condvar::new());

/// The right to compile one image in this process, released (and waiters woken) on drop.
struct Claim(PathBuf);

impl Claim {
    /// Claims `path`; when another thread holds it, waits until it is released and returns None
    /// (the image should then be in the cache folder).
    fn take(path: PathBuf) -> Option<Claim> {
        let (lock, cv) = &IN_FLIGHT;
        let mut v = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !v.contains(&path) {
            v.push(path.clone());
            return Some(Claim(path));
        }
        while v.contains(&path) {
            v = cv.wait(v).unwrap_or_else(|e| e.into_inner());
        }
        None
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let (lock, cv) = &IN_FLIGHT;
        lock.lock().unwrap_or_else(|e| e.into_inner()).retain(|p| p != &self.0);
        cv.notify_all();
    }
}

/// Threads for parallel compilation: the settings' `compile_jobs`, else every core.
pub fn compile_workers() -> usize {
    crate::settings::settings().compile_jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1)
}

/// Threads for compilations in the background while the process serves: every core but
/// [`BACKGROUND_SPARE_CORES`] (at least one), or `$KAIROS_COMPILE_JOBS`.
pub fn background_workers() -> usize {
    if crate::settings::settings().compile_jobs.is_some() {
        return compile_workers();
    }
    compile_workers().saturating_sub(BACKGROUND_SPARE_CORES).max(1)
}

/// Cores a background compilation leaves to the dispatcher, its launcher threads and the front
/// ends.
pub const BACKGROUND_SPARE_CORES: usize = 4;

/// ptxas' resource report of one function, parsed from a verbose compile log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasReport {
    pub function: String,
    pub registers: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    pub stack_frame_bytes: u32,
    pub shared_mem_bytes: u32,
}

/// Parses the `--ptxas-options=-v` lines of a log into one report per entry function.
pub fn parse_ptxas_log(log: &str) -> Vec<PtxasReport> {
    let num_before = |line: &str, word: &str| -> Option<u32> {
        let i = line.find(word)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<PtxasReport> = Vec::new();
    let mut current: Option<PtxasReport> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(r) = current.take() {
                out.push(r);
            }
            current = Some(PtxasReport { function: rest.split('\'').next().unwrap_or("").to_string(), ..Default::default() });
        } else if let Some(r) = current.as_mut() {
            if line.contains("bytes stack frame") && r.registers == 0 {
                r.stack_frame_bytes = num_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_store_bytes = num_before(line, "bytes spill stores").unwrap_or(0);
                r.spill_load_bytes = num_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("registers") {
                r.registers = num_before(line, "registers").unwrap_or(0);
                r.shared_mem_bytes = num_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out.extend(current);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_every_part() {
        let a = content_hash(&[b"x", b"y"]);
        assert_eq!(a, content_hash(&[b"x", b"y"]));
        assert_ne!(a, content_hash(&[b"xy"]));
        assert_ne!(a, content_hash(&[b"x", b"z"]));
        assert_eq!(a.len(), 32);
    }

    #[test]
    fn cubin_keys_leave_driver_and_nvrtc_out_and_ptx_keys_do_not() {
        use kairos_kernels::source::EntryKind;
        let at = |driver_version| KernelCache { dir: None, arch: 90, driver_version, verbose: false, quick: false };
        let (a, b) = (at(12080), at(13000));
        let gemm_w = Unit { module: Module::Gemm, entry: Some(EntryKind::F16wRelu) };
        let file = |c: &KernelCache, cubin| c.image_file(gemm_w, Variant::Protocol, 90, cubin, (13, 0));
        assert_eq!(file(&a, true), file(&b, true), "a CUBIN loads on any driver for its architecture");
        assert_eq!(file(&a, true), a.image_file(gemm_w, Variant::Protocol, 90, true, (12, 8)), "nor does NVRTC matter");
        assert_ne!(file(&a, false), file(&b, false), "PTX is JIT-compiled by the driver");
        assert_ne!(file(&a, false), a.image_file(gemm_w, Variant::Protocol, 90, false, (12, 8)), "and by that NVRTC's PTX");
        assert!(file(&a, true).starts_with("gemm_f16w_relu-proto-sm90-") && file(&a, true).ends_with(".cubin"));
        let other = |f: &dyn Fn(&KernelCache) -> String| assert_ne!(file(&a, true), f(&a));
        other(&|c| c.image_file(gemm_w, Variant::Plain, 90, true, (13, 0)));
        other(&|c| c.image_file(gemm_w, Variant::Protocol, 100, true, (13, 0)));
        other(&|c| {
            c.image_file(Unit { module: Module::Gemm, entry: Some(EntryKind::F16) }, Variant::Protocol, 90, true, (13, 0))
        });
        other(&|c| {
            c.image_file(Unit { module: Module::Conv, entry: Some(EntryKind::F16wRelu) }, Variant::Protocol, 90, true, (13, 0))
        });
        // Every unit has its own file, and so has every quick build.
        let q = a.quick_builds();
        let names: std::collections::HashSet<String> = Unit::all()
            .into_iter()
            .flat_map(|u| {
                [a.image_file(u, Variant::Protocol, 90, true, (13, 0)), q.image_file(u, Variant::Protocol, 90, true, (13, 0))]
            })
            .collect();
        let quick = Unit::all().into_iter().filter(|u| u.has_quick_build()).count();
        assert_eq!(names.len(), Unit::all().len() + quick);
        assert!(q.image_file(gemm_w, Variant::Protocol, 90, true, (13, 0)).starts_with("gemm_f16w_relu-proto-quick-sm90-"));
        assert!(q.options(gemm_w, 90, true, Variant::Protocol).contains(&QUICK_BUILD_OPTION.to_string()));
        assert!(!a.options(gemm_w, 90, true, Variant::Protocol).contains(&QUICK_BUILD_OPTION.to_string()));
        // sm_90 builds target sm_90a (wgmma); other architectures their plain target.
        assert_eq!(a.options(gemm_w, 90, true, Variant::Protocol)[0], "--gpu-architecture=sm_90a");
        assert_eq!(a.options(gemm_w, 90, false, Variant::Protocol)[0], "--gpu-architecture=compute_90a");
        assert_eq!(a.options(gemm_w, 100, true, Variant::Protocol)[0], "--gpu-architecture=sm_100");
        let util = Unit { module: Module::Util, entry: None };
        assert_eq!(
            q.image_file(util, Variant::Protocol, 90, true, (13, 0)),
            a.image_file(util, Variant::Protocol, 90, true, (13, 0))
        );
    }

    #[test]
    fn a_claimed_image_makes_the_second_caller_wait() {
        let path = std::env::temp_dir().join(format!("kairos-claim-{}.cubin", std::process::id()));
        let first = Claim::take(path.clone()).expect("nobody holds it");
        let (tx, rx) = std::sync::mpsc::channel();
        let p2 = path.clone();
        let waiter = std::thread::spawn(move || {
            let second = Claim::take(p2);
            tx.send(second.is_none()).unwrap();
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200)).is_err(),
            "the second caller must wait while the first compiles"
        );
        drop(first);
        assert!(rx.recv_timeout(std::time::Duration::from_secs(10)).expect("released"), "it waited, then did not compile");
        waiter.join().unwrap();
        assert!(Claim::take(path).is_some(), "free again");
    }

    #[test]
    fn images_come_from_the_cache_folder_in_the_order_asked() {
        let dir = std::env::temp_dir().join(format!("kairos-images-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cache = KernelCache { dir: Some(dir.clone()), arch: 90, driver_version: 0, verbose: false, quick: false };
        let units = Unit::all();
        let jobs: Vec<(Unit, Variant)> = units.iter().map(|&u| (u, Variant::Protocol)).collect();
        if is_present() && cache.target().map(|t| t.1) != Ok(true) {
            eprintln!("note: this NVRTC cannot emit sm_90 CUBIN; skipping");
            return;
        }
        // Fake images for every unit: each must come back as its own file, marked cached.
        for (i, &(u, v)) in jobs.iter().enumerate() {
            std::fs::write(dir.join(cache.file_of(u, v).unwrap()), format!("image {i}")).unwrap();
            assert!(cache.is_ready(u, v));
        }
        let got = cache.images(&jobs, 4, "a test");
        for (i, r) in got.iter().enumerate() {
            let img = r.as_ref().unwrap();
            assert_eq!(img.bytes, format!("image {i}").into_bytes());
            assert_eq!(img.origin, Origin::Cache);
        }
        if !is_present() {
            // Without NVRTC a missing unit is a clear error, not a panic.
            std::fs::remove_file(dir.join(cache.file_of(units[0], Variant::Protocol).unwrap())).unwrap();
            let got = cache.images(&jobs[..2], 2, "a test");
            let err = got[0].as_ref().unwrap_err();
            assert!(err.contains("libnvrtc cannot be loaded") && err.contains(&units[0].name()), "{err}");
            assert!(got[1].is_ok());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn quick_and_optimized_builds_come_from_their_own_files() {
        let dir = std::env::temp_dir().join(format!("kairos-quick-images-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cache = KernelCache { dir: Some(dir.clone()), arch: 90, driver_version: 0, verbose: false, quick: false };
        if is_present() && cache.target().map(|t| t.1) != Ok(true) {
            eprintln!("note: this NVRTC cannot emit sm_90 CUBIN; skipping");
            return;
        }
        let quick = cache.quick_builds();
        let jobs: Vec<(Unit, Variant, bool)> =
            Unit::all().into_iter().flat_map(|u| [(u, Variant::Protocol, false), (u, Variant::Protocol, true)]).collect();
        for &(u, v, q) in &jobs {
            let c = if q { &quick } else { &cache };
            let build = if c.is_quick(u) { "quick" } else { "optimized" };
            std::fs::write(dir.join(c.file_of(u, v).unwrap()), format!("{} {build}", u.name())).unwrap();
        }
        let got = cache.images_of(&jobs, 3, "a test");
        for (&(u, _, q), r) in jobs.iter().zip(&got) {
            // A unit without a quick build reads its one image either way.
            let build = if q && u.has_quick_build() { "quick" } else { "optimized" };
            assert_eq!(String::from_utf8(r.as_ref().unwrap().bytes.clone()).unwrap(), format!("{} {build}", u.name()));
        }
        // A quick image alone does not make the unit's optimized build ready.
        let conv_f16 = Unit { module: Module::Conv, entry: Some(kairos_kernels::source::EntryKind::F16) };
        std::fs::remove_file(dir.join(cache.file_of(conv_f16, Variant::Protocol).unwrap())).unwrap();
        assert!(!cache.is_ready(conv_f16, Variant::Protocol) && quick.is_ready(conv_f16, Variant::Protocol));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_plain_and_gzipped_cache_files() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("kairos-nvrtc-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.cubin"), b"plain").unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"zipped").unwrap();
        std::fs::write(dir.join("b.cubin.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(dir.join("c.cubin"), b"").unwrap();
        assert_eq!(cached(&dir, "a.cubin").as_deref(), Some(&b"plain"[..]));
        assert_eq!(cached(&dir, "b.cubin").as_deref(), Some(&b"zipped"[..]));
        assert_eq!(cached(&dir, "c.cubin"), None, "an empty file is no image");
        assert_eq!(cached(&dir, "d.cubin"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parses_ptxas_reports() {
        let log = "ptxas info    : Compiling entry function 'gemm_f16' for 'sm_90'\n\
                   ptxas info    : Function properties for gemm_f16\n\
                   ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 127 registers, used 1 barriers, 16912 bytes smem\n\
                   ptxas info    : Compiling entry function 'gemm_f32' for 'sm_90'\n\
                   ptxas info    : Used 40 registers, used 1 barriers\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            PtxasReport {
                function: "gemm_f16".into(),
                registers: 127,
                spill_store_bytes: 4,
                spill_load_bytes: 12,
                stack_frame_bytes: 8,
                shared_mem_bytes: 16912
            }
        );
        assert_eq!(r[1].registers, 40);
        assert_eq!(r[1].shared_mem_bytes, 0);
    }
}
