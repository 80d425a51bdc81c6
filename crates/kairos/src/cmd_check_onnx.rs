//! `kairos check-onnx DIR`: the exporter corpus (`scripts/onnx_corpus.py`) against onnxruntime.
//!
//! Every export in the corpus' `manifest.json` is loaded at each case's input shapes (its dynamic
//! batch and sequence axes fixed to the case's values), lowered, run on the CPU reference or the GPU,
//! and each output compared with onnxruntime's by relative L2 error. A model either matches, or
//! fails at load with an error naming the op and the node (`unsupported`), or fails (a wrong
//! result, a run error, a load error that does not name an op): the last is a bug.

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use kairos_ir::onnx::LoadOptions;
use kairos_ir::tensor::relative_l2_error;
use kairos_ir::{DType, Tensor, npy};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The zoo's thresholds: the f32 CPU reference within 1e-4 of onnxruntime, f16 on the GPU within 2e-3.
pub const TOLERANCE_F32: f64 = 1e-4;
pub const TOLERANCE_F16: f64 = 2e-3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CheckBackend {
    /// The CPU reference kernels.
    Cpu,
    /// A real NVIDIA GPU, kernel by kernel on one stream.
    Cuda,
}

#[derive(Args, Debug)]
pub struct CheckOnnxArgs {
    /// The corpus folder (holding manifest.json), as written by scripts/onnx_corpus.py.
    pub dir: PathBuf,
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: CheckBackend,
    /// Storage type of activations and weights (default: f32 on the CPU, f16 on the GPU).
    #[arg(long, value_parser = crate::model_args::parse_dtype)]
    pub dtype: Option<DType>,
    /// Only exports whose file name contains one of these comma-separated words.
    #[arg(long)]
    pub only: Option<String>,
    /// Relative L2 error allowed (default: 1e-4 for f32, 2e-3 for f16).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Where to write every result as JSON (default DIR/check-<backend>-<dtype>.json).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Exit with an error when any export fails (wrong result, run error, or a load error that
    /// names no op); `unsupported` ops are reported, not failures.
    #[arg(long)]
    pub strict: bool,
    /// CUDA device ordinal.
    #[arg(long, env = "KAIROS_DEVICE", default_value_t = 0)]
    pub device: u32,
}

/// What became of one export.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    /// Every case within tolerance.
    Pass,
    /// The load stopped at an op kairos does not take, named with its node.
    Unsupported(String),
    /// A wrong result, a run error or an unnamed load error.
    Fail(String),
    /// The exporter itself refused (recorded by the generator; not a kairos result).
    ExportFailed(String),
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Unsupported(_) => "unsupported",
            Outcome::Fail(_) => "FAIL",
            Outcome::ExportFailed(_) => "export-failed",
        }
    }
    fn note(&self) -> &str {
        match self {
            Outcome::Pass => "",
            Outcome::Unsupported(s) | Outcome::Fail(s) | Outcome::ExportFailed(s) => s,
        }
    }
}

trait Runner {
    fn run(&mut self, plan: &kairos_ir::plan::Plan, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
}

struct CpuRunner;

impl Runner for CpuRunner {
    fn run(&mut self, plan: &kairos_ir::plan::Plan, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        kairos_kernels::cpu::execute_plan(plan, inputs).map_err(anyhow::Error::msg)
    }
}

struct CudaRunner(kairos_cuda::CudaGpu);

impl Runner for CudaRunner {
    fn run(&mut self, plan: &kairos_ir::plan::Plan, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        Ok(crate::cmd_run::run_on(&mut self.0, plan, inputs)?.0)
    }
}

fn str_field<'a>(v: &'a Value, key: &str) -> Result<&'a str> {
    v.get(key).and_then(Value::as_str).with_context(|| format!("manifest entry lacks '{key}'"))
}

/// One case: load at its shapes, lower, run, compare. The largest error of its outputs.
fn check_case(
    runner: &mut dyn Runner,
    dir: &Path,
    bytes: &[u8],
    name: &str,
    case: &Value,
    dtype: DType,
) -> std::result::Result<f64, Outcome> {
    let fail = |s: String| Outcome::Fail(s);
    let batch = case.get("batch").and_then(Value::as_u64).map(|b| b as usize);
    let seq_len = case.get("seq_len").and_then(Value::as_u64).map(|s| s as usize);
    let shape_note = match seq_len {
        Some(s) => format!("batch {}, sequence {s}", batch.unwrap_or(1)),
        None => format!("batch {}", batch.unwrap_or(1)),
    };
    let graph = match kairos_ir::onnx::load_bytes(name, bytes, &LoadOptions { batch, seq_len }) {
        Ok(g) => g,
        Err(e @ kairos_ir::Error::Unsupported { .. }) => return Err(Outcome::Unsupported(e.to_string())),
        Err(e) => return Err(fail(format!("load at {shape_note}: {e}"))),
    };
    let plan = match kairos_ir::lower::lower(&graph, &kairos_ir::lower::LowerOptions::new(dtype)) {
        Ok(p) => p,
        Err(e @ kairos_ir::Error::Unsupported { .. }) => return Err(Outcome::Unsupported(e.to_string())),
        Err(e) => return Err(fail(format!("lowering at {shape_note}: {e}"))),
    };
    let files = case.get("inputs").and_then(Value::as_array).ok_or_else(|| fail("case lacks inputs".into()))?;
    let mut inputs = Vec::new();
    for (f, decl) in files.iter().zip(&plan.inputs) {
        let path = dir.join(f.as_str().unwrap_or_default());
        let t = npy::read(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        if t.shape != decl.shape {
            return Err(fail(format!(
                "input '{}' lowered to shape {:?}, the case's file holds {:?} ({shape_note})",
                decl.name, decl.shape, t.shape
            )));
        }
        let t = if t.dtype() == DType::I64 { t } else { t.cast(decl.dtype) };
        inputs.push(t);
    }
    if files.len() != plan.inputs.len() {
        return Err(fail(format!("the model takes {} inputs, the case gives {}", plan.inputs.len(), files.len())));
    }
    let outputs = runner.run(&plan, &inputs).map_err(|e| fail(format!("run at {shape_note}: {e:#}")))?;
    let expected = case.get("outputs").and_then(Value::as_array).ok_or_else(|| fail("case lacks outputs".into()))?;
    if expected.len() != outputs.len() {
        return Err(fail(format!("{} outputs, onnxruntime gave {}", outputs.len(), expected.len())));
    }
    let mut worst = 0.0f64;
    for (k, (o, f)) in outputs.iter().zip(expected).enumerate() {
        let path = dir.join(f.as_str().unwrap_or_default());
        let r = npy::read(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        if r.shape != o.shape {
            return Err(fail(format!("output {k} has shape {:?}, onnxruntime's {:?} ({shape_note})", o.shape, r.shape)));
        }
        worst = worst.max(relative_l2_error(&o.to_f32_vec(), &r.to_f32_vec()));
    }
    Ok(worst)
}

pub fn run(args: CheckOnnxArgs) -> Result<()> {
    let manifest_path = args.dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest_path)
        .with_context(|| format!("reading {} (make one with scripts/onnx_corpus.py)", manifest_path.display()))?;
    let manifest: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", manifest_path.display()))?;
    let entries = manifest.get("entries").and_then(Value::as_array).context("manifest has no 'entries'")?;
    let dtype = args.dtype.unwrap_or(if args.backend == CheckBackend::Cuda { DType::F16 } else { DType::F32 });
    let tolerance = args.tolerance.unwrap_or(if dtype == DType::F16 { TOLERANCE_F16 } else { TOLERANCE_F32 });
    let words: Vec<String> = args.only.iter().flat_map(|s| s.split(',')).map(str::to_string).collect();
    let mut runner: Box<dyn Runner> = match args.backend {
        CheckBackend::Cpu => Box::new(CpuRunner),
        CheckBackend::Cuda => {
            let mut gpu = kairos_cuda::CudaGpu::new(args.device).context("the cuda backend needs an NVIDIA GPU and driver")?;
            gpu.set_quick_builds(crate::paths::quick_builds_wanted());
            Box::new(CudaRunner(gpu))
        }
    };
    let started = Instant::now();
    let mut rows = Vec::new();
    let selected: Vec<&Value> = entries
        .iter()
        .filter(|e| {
            let file = e.get("file").and_then(Value::as_str).unwrap_or_default();
            words.is_empty() || words.iter().any(|w| file.contains(w.as_str()))
        })
        .collect();
    if selected.is_empty() {
        bail!("no export in {} matches --only {:?}", manifest_path.display(), args.only.unwrap_or_default());
    }
    for (i, e) in selected.iter().enumerate() {
        let file = str_field(e, "file")?;
        let t = Instant::now();
        let mut worst = 0.0f64;
        let outcome = if str_field(e, "status")? != "ok" {
            Outcome::ExportFailed(e.get("error").and_then(Value::as_str).unwrap_or_default().to_string())
        } else {
            let path = args.dir.join(file);
            let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            let name = file.trim_end_matches(".onnx");
            let cases = e.get("cases").and_then(Value::as_array).cloned().unwrap_or_default();
            let mut outcome = Outcome::Pass;
            for case in &cases {
                match check_case(runner.as_mut(), &args.dir, &bytes, name, case, dtype) {
                    Ok(err) => {
                        worst = worst.max(err);
                        if err > tolerance {
                            outcome = Outcome::Fail(format!("relative error {err:.2e} > {tolerance:.0e}"));
                        }
                    }
                    Err(o) => {
                        outcome = o;
                        break;
                    }
                }
            }
            if cases.is_empty() {
                outcome = Outcome::Fail("the manifest lists no cases".into());
            }
            outcome
        };
        eprintln!(
            "[{}/{}] {file}: {}{} ({:.1} s)",
            i + 1,
            selected.len(),
            outcome.label(),
            if outcome == Outcome::Pass { format!(", error {worst:.1e}") } else { format!(": {}", outcome.note()) },
            t.elapsed().as_secs_f64()
        );
        rows.push(json!({
            "file": file,
            "arch": e.get("arch"),
            "family": e.get("family"),
            "source": e.get("source"),
            "exporter": e.get("exporter"),
            "opset": e.get("opset"),
            "opset_written": e.get("opset_written"),
            "outcome": outcome.label(),
            "note": outcome.note(),
            "max_relative_error": if matches!(outcome, Outcome::Pass | Outcome::Fail(_)) && worst.is_finite() { json!(worst) } else { Value::Null },
            "seconds": t.elapsed().as_secs_f64(),
        }));
    }
    let count = |l: &str| rows.iter().filter(|r| r["outcome"] == l).count();
    let (pass, unsupported, fail, export_failed) = (count("pass"), count("unsupported"), count("FAIL"), count("export-failed"));
    println!("| model | exporter | opset | result | max rel. error | note |");
    println!("|---|---|---:|---|---:|---|");
    for r in &rows {
        let err = r["max_relative_error"].as_f64().map(|x| format!("{x:.1e}")).unwrap_or_else(|| "–".into());
        let note: String = r["note"].as_str().unwrap_or_default().chars().take(160).collect();
        println!(
            "| {} | {} | {} | {} | {err} | {} |",
            r["arch"].as_str().unwrap_or_default(),
            r["exporter"].as_str().unwrap_or_default(),
            r["opset"],
            r["outcome"].as_str().unwrap_or_default(),
            note.replace('|', "/")
        );
    }
    let backend = format!("{:?}", args.backend).to_lowercase();
    println!(
        "{} exports on {backend} ({dtype}, tolerance {tolerance:.0e}): {pass} pass, {unsupported} unsupported (named op), \
         {fail} FAIL, {export_failed} refused by the exporter; {:.0} s",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    let json_path = args.json.unwrap_or_else(|| args.dir.join(format!("check-{backend}-{dtype}.json")));
    let report = json!({
        "backend": backend,
        "dtype": dtype.to_string(),
        "tolerance": tolerance,
        "corpus": manifest.get("versions"),
        "tier": manifest.get("tier"),
        "summary": {"pass": pass, "unsupported": unsupported, "fail": fail, "export_failed": export_failed},
        "results": rows,
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    eprintln!("wrote {}", json_path.display());
    if args.backend == CheckBackend::Cuda {
        kairos_cuda::nvrtc::finish_background("letting the optimized kernel builds finish into the cache");
    }
    if args.strict && fail > 0 {
        bail!("{fail} of {} exports failed (see the table)", rows.len());
    }
    Ok(())
}
