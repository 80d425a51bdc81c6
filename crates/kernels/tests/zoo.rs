//! Every zoo model end to end: ONNX bytes -> import -> lower -> CPU reference kernels, against
//! tract on the same ONNX bytes. Also checks that outputs have sensible magnitudes (so relative
//! errors mean something) and that fusion keeps kernel counts low.

use kairos_ir::tensor::{relative_l2_error, rms};
use kairos_ir::zoo::{ZOO, ZooOptions};
use kairos_ir::{DType, Tensor};

const TOLERANCE_F32: f64 = 1e-4;
const TOLERANCE_F16: f64 = 1e-2;
/// Transformers run at a short sequence here to keep CI fast; `kairos` defaults to 128.
const TEST_SEQ_LEN: usize = 32;

fn inputs_for(plan: &kairos_ir::plan::Plan, seed: u64) -> Vec<Tensor> {
    plan.inputs
        .iter()
        .map(|i| {
            let n: usize = i.shape.iter().product();
            let mut s = seed;
            let mut next = move || {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 33) as u32
            };
            match i.dtype {
                DType::I64 => Tensor::i64(i.shape.clone(), (0..n).map(|_| (next() % 30000) as i64).collect()),
                _ => Tensor::f32(i.shape.clone(), (0..n).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect()),
            }
        })
        .collect()
}

fn check_model(name: &str, dtype: DType, tol: f64) -> usize {
    let opts = ZooOptions { seq_len: TEST_SEQ_LEN, ..Default::default() };
    let bytes = kairos_ir::zoo::build(name, &opts).unwrap();
    let graph = kairos_ir::onnx::load_bytes(name, &bytes, &Default::default()).unwrap();
    let plan = kairos_ir::lower::lower(&graph, &kairos_ir::lower::LowerOptions::new(dtype)).unwrap();
    plan.validate().unwrap();
    let inputs = inputs_for(&plan, 5);
    let ours = kairos_kernels::cpu::execute_plan(&plan, &inputs).unwrap();
    let theirs = kairos_ir::onnx::tract_reference(&bytes, &inputs).unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (a, b) in ours.iter().zip(&theirs) {
        assert_eq!(a.shape, b.shape, "{name}: output shape");
        let reference = b.to_f32_vec();
        let magnitude = rms(&reference);
        assert!(
            magnitude > 0.05,
            "{name}: reference output rms {magnitude:.4} is too close to zero for relative errors to mean much"
        );
        let err = relative_l2_error(&a.to_f32_vec(), &reference);
        println!("{name:14} {dtype}: {:4} launches, relative L2 error {err:.2e}, output rms {magnitude:.3}", plan.launches.len());
        assert!(err <= tol, "{name} ({dtype}): relative L2 error {err:.3e} exceeds {tol:.0e}");
    }
    plan.launches.len()
}

#[test]
fn every_zoo_model_matches_tract_in_fp32() {
    for entry in ZOO {
        let launches = check_model(entry.name, DType::F32, TOLERANCE_F32);
        if entry.name == "resnet50" {
            // PyTorch eager runs 336 kernels per resnet50 forward pass (fp16); fusion must need at most a quarter.
            assert!(launches <= 84, "resnet50 lowered to {launches} kernels");
        }
    }
}

#[test]
fn fp16_plans_match_tract_within_fp16_tolerance() {
    for name in ["resnet50", "mobilenet_v2", "densenet121", "inception_v3", "bert_base", "gpt2"] {
        check_model(name, DType::F16, TOLERANCE_F16);
    }
}
