//! Compiles the whole kernel library with NVRTC for sm_90 (H100/H200) and checks ptxas' resource
//! report: every function present, within its launch bound's registers, and no register spills
//! outside the tensor-core entries. Needs only libnvrtc, no GPU or driver (`pip install
//! nvidia-cuda-nvrtc` gives one; point LD_LIBRARY_PATH at its lib folder); skipped with a note when
//! NVRTC cannot be loaded.

use kairos_cuda::nvrtc::{self, KernelCache, Variant, parse_ptxas_log};
use kairos_kernels::source::Unit;

/// Registers a function may use: 65536 / (threads x CTAs per SM) of its `__launch_bounds__`
/// (common.cuh: the narrow tensor-core entries `_f16n` and `_gvn` are (128, 3), the wide ones `_f16w_*` (128, 2),
/// everything else (256, 2)); ptxas allocates at most 255.
fn register_bound(function: &str) -> u32 {
    if function.ends_with("_f16n") || function.ends_with("_gvn") {
        168
    } else if function.contains("_f16w_") {
        255
    } else {
        128
    }
}

/// Whether a function may spill: the tensor-core entries (tile.cuh; the largest warp tiles keep
/// 64 accumulators per thread plus fragments in the 128-register entries), the split-K entries
/// (the slice bookkeeping on top of the SIMT engine) and the small-M entries (at 128 registers
/// `conv2d_gv` spills 56 bytes and `gemm_gv` 156, stores and loads; the same code ran inside `_f16`
/// before it had entries of its own; `_gvn`, at 168, spills none). Their inner loops were checked in SASS when the engine last changed (the small-M ones
/// by batch-1 latency only); this test only reports the bytes.
fn may_spill(function: &str) -> bool {
    (function.starts_with("gemm") || function.starts_with("conv2d"))
        && (function.contains("_f16") || function.contains("_sk_") || function.ends_with("_gv") || function.ends_with("_gvn"))
}

#[test]
#[ignore = "needs libnvrtc 13: LD_LIBRARY_PATH=<its lib folder> cargo test -p kairos-cuda --test nvrtc_compile -- --include-ignored"]
fn library_compiles_for_sm90_within_its_register_bounds() {
    assert!(nvrtc::is_present(), "libnvrtc not found (set LD_LIBRARY_PATH to an NVRTC 13 lib folder)");
    let cache = KernelCache { dir: None, arch: 90, driver_version: 0, verbose: true, quick: false };
    assert_eq!(cache.target().expect("NVRTC lists its architectures"), (90, true), "NVRTC 13 emits CUBIN for sm_90");
    let mut rows = Vec::new();
    for variant in [Variant::Protocol, Variant::Plain] {
        for m in Unit::all() {
            let image =
                cache.image(m, variant).unwrap_or_else(|log| panic!("unit {} ({variant:?}) failed to compile:\n{log}", m.name()));
            assert!(image.cubin && image.bytes.starts_with(b"\x7fELF"), "unit {} is not a CUBIN", m.name());
            // Exactly the unit's functions: a unit that compiled another's entries too would
            // cost every model that loads it the other's compile time.
            let reports_all = parse_ptxas_log(&image.log);
            let mut defined: Vec<&str> = reports_all.iter().map(|r| r.function.as_str()).collect();
            defined.sort();
            let mut expected = m.functions();
            expected.sort();
            assert_eq!(defined, expected, "unit {} defines other functions than its own", m.name());
            let reports = parse_ptxas_log(&image.log);
            for f in m.functions() {
                let r =
                    reports.iter().find(|r| r.function == f).unwrap_or_else(|| panic!("no ptxas report for {f}:\n{}", image.log));
                let spills = r.spill_store_bytes + r.spill_load_bytes;
                if !may_spill(&f) {
                    assert_eq!(spills, 0, "{f} ({variant:?}) spills registers: {r:?}");
                }
                assert!(
                    r.registers <= register_bound(&f),
                    "{f} ({variant:?}) needs {} registers, more than its launch bound allows ({})",
                    r.registers,
                    register_bound(&f)
                );
                rows.push(format!(
                    "{:<16} {:<9} {:>4} regs {:>6} B smem {:>4} B stack {:>5} B spilled",
                    f,
                    format!("{variant:?}"),
                    r.registers,
                    r.shared_mem_bytes,
                    r.stack_frame_bytes,
                    spills
                ));
            }
        }
    }
    println!("{}", rows.join("\n"));
}

/// The quick builds (what serves while the optimized builds compile) define the same functions
/// within the same register bounds, so the occupancy worked out for them holds for both builds.
#[test]
#[ignore = "needs libnvrtc 13: LD_LIBRARY_PATH=<its lib folder> cargo test -p kairos-cuda --test nvrtc_compile -- --include-ignored"]
fn quick_builds_compile_within_the_same_register_bounds() {
    assert!(nvrtc::is_present(), "libnvrtc not found (set LD_LIBRARY_PATH to an NVRTC 13 lib folder)");
    let cache = KernelCache { dir: None, arch: 90, driver_version: 0, verbose: true, quick: true };
    for u in Unit::all().into_iter().filter(|u| u.has_quick_build()) {
        let t = std::time::Instant::now();
        let image = cache.image(u, Variant::Protocol).unwrap_or_else(|log| panic!("quick build of {} failed:\n{log}", u.name()));
        let reports = parse_ptxas_log(&image.log);
        let mut defined: Vec<&str> = reports.iter().map(|r| r.function.as_str()).collect();
        defined.sort();
        let mut expected = u.functions();
        expected.sort();
        assert_eq!(defined, expected, "quick build of {}", u.name());
        for r in &reports {
            let budget = u.entry.map(|k| k.registers_max()).unwrap();
            assert_eq!(budget, register_bound(&r.function), "{}: EntryKind::registers_max against the launch bounds", r.function);
            assert!(r.registers <= budget, "{} (quick) needs {} registers, above {budget}", r.function, r.registers);
            println!("{:<16} quick {:>4} regs, compiled in {:.1} s", r.function, r.registers, t.elapsed().as_secs_f64());
        }
    }
}

#[test]
#[ignore = "needs libnvrtc 13: LD_LIBRARY_PATH=<its lib folder> cargo test -p kairos-cuda --test nvrtc_compile -- --include-ignored"]
fn compile_errors_carry_the_nvrtc_log() {
    assert!(nvrtc::is_present(), "libnvrtc not found (set LD_LIBRARY_PATH to an NVRTC 13 lib folder)");
    let err = nvrtc::compile(
        "broken.cu",
        "extern \"C\" __global__ void k() { undefined_thing(); }",
        &[],
        &["--gpu-architecture=sm_90".into()],
        true,
    )
    .expect_err("a call to an undeclared function must not compile");
    assert!(err.contains("undefined_thing"), "log does not name the problem: {err}");
}
