use kairos_ir::{DType, Tensor};
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = if std::env::var("F16").is_ok() { DType::F16 } else { DType::F32 };
    for name in args {
        let opts = kairos_ir::zoo::ZooOptions { seq_len: 16, ..Default::default() };
        let bytes = kairos_ir::zoo::build(&name, &opts).unwrap();
        let t0 = std::time::Instant::now();
        let g = kairos_ir::onnx::load_bytes(&name, &bytes, &Default::default()).unwrap();
        let plan = match kairos_ir::lower::lower(&g, &kairos_ir::lower::LowerOptions { dtype }) {
            Ok(p) => p,
            Err(e) => {
                println!("{name}: {e}");
                continue;
            }
        };
        let lower_t = t0.elapsed();
        let inputs: Vec<Tensor> = plan
            .inputs
            .iter()
            .map(|i| match i.dtype {
                DType::I64 => Tensor::i64(
                    i.shape.clone(),
                    (0..i.shape.iter().product::<usize>()).map(|j| (j * 7919 % 30000) as i64).collect(),
                ),
                _ => Tensor::f32(
                    i.shape.clone(),
                    (0..i.shape.iter().product::<usize>()).map(|j| ((j * 37 % 101) as f32 / 50.0) - 1.0).collect(),
                ),
            })
            .collect();
        let t1 = std::time::Instant::now();
        let ours = kairos_kernels::cpu::execute_plan(&plan, &inputs).unwrap();
        let run_t = t1.elapsed();
        let theirs = kairos_ir::onnx::tract_reference(&bytes, &inputs).unwrap();
        let err = kairos_ir::tensor::relative_l2_error(&ours[0].to_f32_vec(), &theirs[0].to_f32_vec());
        if std::env::var("NAMES").is_ok() {
            for l in &plan.launches {
                if l.kernel.name() == "eltwise" {
                    if let kairos_ir::plan::Kernel::Eltwise(p) = &l.kernel {
                        println!("   {} {:?} {:?} {:?}", l.name, p.func, p.act, p.shape);
                    }
                }
            }
        }
        println!(
            "{name:14} launches {:4} {:?} arena {:.1} MB weights {:.1} MB layers {} lower {:?} run {:?} rel err {:.2e} rms {:.3}",
            plan.launches.len(),
            plan.kernel_histogram(),
            plan.arena_bytes as f64 / 1e6,
            plan.weight_bytes as f64 / 1e6,
            plan.layers.len(),
            lower_t,
            run_t,
            err,
            kairos_ir::tensor::rms(&theirs[0].to_f32_vec())
        );
    }
}
