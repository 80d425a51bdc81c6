//! ONNX files from PyTorch's real exporters (TorchScript at opsets 13 and 17, dynamo at opset 18):
//! each one imported, lowered (fp32 and fp16), run with the CPU reference kernels, and compared
//! with tract on the same file and with PyTorch's own output.

use kairos_ir::lower::{LowerOptions, lower};
use kairos_ir::onnx::{LoadOptions, load_path, tract_reference};
use kairos_ir::tensor::relative_l2_error;
use kairos_ir::{DType, npy};
use std::path::Path;

const TOLERANCE_F32: f64 = 1e-4;
const TOLERANCE_F16: f64 = 1e-2;

fn fixtures() -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut v: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_exported_file_matches_tract_and_pytorch() {
    let files = fixtures();
    assert!(files.len() >= 6, "expected both exporters' files for both models, found {files:?}");
    for path in files {
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        let base = file.split('_').take(2).collect::<Vec<_>>().join("_");
        let dir = path.parent().unwrap();
        let input = npy::read(&dir.join(format!("{base}.input.npy"))).unwrap();
        let torch_out = npy::read(&dir.join(format!("{base}.torch_output.npy"))).unwrap();
        let graph = load_path(&path, &LoadOptions::default()).unwrap_or_else(|e| panic!("{file}: {e}"));
        let bytes = std::fs::read(&path).unwrap();
        let tract_out = tract_reference(&bytes, std::slice::from_ref(&input)).unwrap();
        for (dtype, tol) in [(DType::F32, TOLERANCE_F32), (DType::F16, TOLERANCE_F16)] {
            let plan = lower(&graph, &LowerOptions::new(dtype)).unwrap_or_else(|e| panic!("{file} ({dtype}): {e}"));
            let out = kairos_kernels::cpu::execute_plan(&plan, std::slice::from_ref(&input)).unwrap();
            let ours = out[0].to_f32_vec();
            let vs_tract = relative_l2_error(&ours, &tract_out[0].to_f32_vec());
            let vs_torch = relative_l2_error(&ours, &torch_out.to_f32_vec());
            println!("{file:45} {dtype}: {:3} launches, vs tract {vs_tract:.2e}, vs PyTorch {vs_torch:.2e}", plan.launches.len());
            assert!(vs_tract <= tol && vs_torch <= tol, "{file} ({dtype}): vs tract {vs_tract:.3e}, vs PyTorch {vs_torch:.3e}");
        }
    }
}
