//! NVRTC: compiling the kernel library for the device, with an on-disk cache.
//!
//! Each [`Module`] of `kairos_kernels::source` is compiled on first use to CUBIN for the device's
//! own architecture (`sm_90` on H100/H200); only when this NVRTC cannot target the device does it
//! fall back to PTX for the newest architecture it knows, which the driver then JIT-compiles.
//! Images are cached under `$KAIROS_CACHE_DIR` (default `~/.cache/kairos/cubin`), keyed by a hash
//! of the module's source and headers, the compile options, the target and the NVRTC version (and,
//! for PTX, the driver version that JIT-compiles it): editing a kernel, changing options or
//! upgrading NVRTC misses the cache, anything else hits it. CUBIN images do not depend on the
//! driver, so `kairos kernels compile` can fill the cache ahead of time on a machine without a GPU.
//! A failed compilation reports NVRTC's log.

use cudarc::nvrtc::sys;
use kairos_kernels::source::{HEADERS, Module};
use std::ffi::{CString, c_char};
use std::path::PathBuf;
use std::time::Instant;

/// How a module's kernels are built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    /// Under the kernel protocol (what every launch uses).
    Protocol,
    /// The same kernels as plain grids (`KAIROS_PROTOCOL_OFF`): the baseline for the protocol's cost.
    Plain,
}

/// A compiled module image.
#[derive(Clone, Debug)]
pub struct Image {
    /// CUBIN, or NUL-terminated PTX when `cubin` is false.
    pub bytes: Vec<u8>,
    pub cubin: bool,
    /// NVRTC's log (ptxas resource lines when compiled with `verbose`); empty from the cache.
    pub log: String,
    pub from_cache: bool,
    pub compile_ms: f64,
}

/// Whether libnvrtc can be loaded.
pub fn is_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { sys::is_culib_present() }
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
}

/// The cache folder: `$KAIROS_CACHE_DIR`, else `~/.cache/kairos/cubin`.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KAIROS_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kairos").join("cubin"))
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
        KernelCache { dir, arch, driver_version, verbose: false }
    }

    /// The NVRTC target: CUBIN for the device when NVRTC supports its architecture, else PTX for
    /// the newest architecture not above it.
    pub fn target(&self) -> Result<(u32, bool), String> {
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

    pub fn options(&self, target: u32, cubin: bool, variant: Variant) -> Vec<String> {
        let mut o =
            vec![format!("--gpu-architecture={}_{target}", if cubin { "sm" } else { "compute" }), "--std=c++17".to_string()];
        if variant == Variant::Plain {
            o.push("-DKAIROS_PROTOCOL_OFF".to_string());
        }
        if self.verbose {
            o.push("--ptxas-options=-v".to_string());
        }
        o
    }

    /// Where the autotuner keeps its choices for this device: next to the CUBIN images, keyed like
    /// them by the sources of the tuned kernels (conv and gemm modules and every header), the
    /// target, the driver and NVRTC versions, plus the device's name and SM count (an H100 and an
    /// H200 share sm_90 but not their best tiles). None without a cache folder.
    pub fn tuning_file(&self, device_name: &str, sm_count: u32) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let (target, cubin) = self.target().ok()?;
        let nvrtc = version().ok()?;
        let mut parts: Vec<&[u8]> = vec![Module::Conv.source().as_bytes(), Module::Gemm.source().as_bytes()];
        for h in HEADERS.iter() {
            parts.push(h.0.as_bytes());
            parts.push(h.1.as_bytes());
        }
        let opt_text = self.options(target, cubin, Variant::Protocol).join(" ");
        let versions =
            format!("driver {} nvrtc {}.{} device {device_name} sms {sm_count}", self.driver_version, nvrtc.0, nvrtc.1);
        parts.push(opt_text.as_bytes());
        parts.push(versions.as_bytes());
        Some(dir.join(format!("autotune-sm{target}-{}.json", content_hash(&parts))))
    }

    /// The cache file name of a module's image for `target` (CUBIN or PTX) under NVRTC `nvrtc`.
    pub fn image_file(&self, module: Module, variant: Variant, target: u32, cubin: bool, nvrtc: (i32, i32)) -> String {
        let options = self.options(target, cubin, variant);
        let mut parts: Vec<&[u8]> = vec![module.source().as_bytes()];
        for h in HEADERS.iter() {
            parts.push(h.0.as_bytes());
            parts.push(h.1.as_bytes());
        }
        let opt_text = options.join(" ");
        // A CUBIN is machine code for its architecture: any driver that runs sm_XX loads it, so
        // its key leaves the driver out (`kairos kernels compile` fills the cache on a machine
        // without a GPU). PTX is JIT-compiled by the driver, so its key names the driver.
        let versions = if cubin {
            format!("nvrtc {}.{}", nvrtc.0, nvrtc.1)
        } else {
            format!("driver {} nvrtc {}.{}", self.driver_version, nvrtc.0, nvrtc.1)
        };
        parts.push(opt_text.as_bytes());
        parts.push(versions.as_bytes());
        let key = content_hash(&parts);
        let variant_name = if variant == Variant::Plain { "plain" } else { "proto" };
        format!("{}-{variant_name}-sm{target}-{key}.{}", module.name(), if cubin { "cubin" } else { "ptx" })
    }

    /// A module's image: from the cache when present, else compiled (and cached).
    pub fn image(&self, module: Module, variant: Variant) -> Result<Image, String> {
        let (target, cubin) = self.target()?;
        let options = self.options(target, cubin, variant);
        let file = self.image_file(module, variant, target, cubin, version()?);
        if !self.verbose
            && let Some(dir) = &self.dir
            && let Ok(bytes) = std::fs::read(dir.join(&file))
            && !bytes.is_empty()
        {
            return Ok(Image { bytes, cubin, log: String::new(), from_cache: true, compile_ms: 0.0 });
        }
        let t = Instant::now();
        let (bytes, log) = compile(&format!("{}.cu", module.name()), module.source(), &HEADERS, &options, cubin)?;
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Some(dir) = &self.dir {
            // Write then rename, so a concurrent reader never sees half a file; a failure only
            // costs the next run a compilation.
            let tmp = dir.join(format!("{file}.{}.tmp", std::process::id()));
            if std::fs::write(&tmp, &bytes).is_ok() {
                let _ = std::fs::rename(&tmp, dir.join(&file));
            }
        }
        Ok(Image { bytes, cubin, log, from_cache: false, compile_ms })
    }
}

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
    fn cubin_keys_leave_the_driver_out_and_ptx_keys_do_not() {
        let at = |driver_version| KernelCache { dir: None, arch: 90, driver_version, verbose: false };
        let (a, b) = (at(12080), at(13000));
        let file = |c: &KernelCache, cubin| c.image_file(Module::Gemm, Variant::Protocol, 90, cubin, (13, 0));
        assert_eq!(file(&a, true), file(&b, true), "a CUBIN loads on any driver for its architecture");
        assert_ne!(file(&a, false), file(&b, false), "PTX is JIT-compiled by the driver");
        assert!(file(&a, true).starts_with("gemm-proto-sm90-") && file(&a, true).ends_with(".cubin"));
        let other = |f: &dyn Fn(&KernelCache) -> String| assert_ne!(file(&a, true), f(&a));
        other(&|c| c.image_file(Module::Gemm, Variant::Protocol, 90, true, (13, 1)));
        other(&|c| c.image_file(Module::Gemm, Variant::Plain, 90, true, (13, 0)));
        other(&|c| c.image_file(Module::Gemm, Variant::Protocol, 100, true, (13, 0)));
        other(&|c| c.image_file(Module::Conv, Variant::Protocol, 90, true, (13, 0)));
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
