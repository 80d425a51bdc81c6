//! Tiny models for tests, examples and benchmarks: built as ONNX with the zoo's builder (seeded
//! weights), written into a model repository with their `config.toml`.
//!
//! | model | inputs | outputs | config |
//! |---|---|---|---|
//! | `mlp` | `x` FP32 [1, 64] | `y` FP32 [1, 10] | real-time, priority level 995 |
//! | `mlp_f16` | `x` FP32 [1, 64] | `y` FP32 [1, 10] | the same file, an f16 plan |
//! | `pair` | `a`, `b` FP32 [1, 16] | `y` FP32 [1, 8], `relu` FP32 [1, 16] | best-effort, tenant 3 |
//! | `embed` | `ids` INT64 [1, 8] | `emb` FP32 [1, 8, 16] | best-effort |
//!
//! [`dyn_seq_onnx`] (not in the tiny repository; tests of dynamic shapes write it): `x` FP32
//! [batch, seq, 16] -> `y` FP32 [batch, seq, 8], symbolic batch and sequence axes.

use kairos_ir::DType;
use kairos_ir::signature::Dim;
use kairos_ir::zoo::builder::{Attr, OnnxBuilder};
use std::path::Path;

pub const SEED: u64 = 0x5eed;

/// `mlp`: Gemm(64->128) + ReLU + Gemm(128->10).
pub fn mlp_onnx() -> Vec<u8> {
    let mut b = OnnxBuilder::new("mlp", 17, SEED);
    let x = b.input("x", DType::F32, &[1, 64]);
    let h = b.gemm_linear(&x, "fc1", 64, 128);
    let h = b.relu(&h);
    let y = b.gemm_linear(&h, "fc2", 128, 10);
    b.output(&y, "y", DType::F32, &[1, 10]);
    b.finish_bytes()
}

/// `pair`: s = a + b; y = Gemm(s, 16->8); relu = ReLU(s).
pub fn pair_onnx() -> Vec<u8> {
    let mut b = OnnxBuilder::new("pair", 17, SEED + 1);
    let a = b.input("a", DType::F32, &[1, 16]);
    let c = b.input("b", DType::F32, &[1, 16]);
    let s = b.add(&a, &c);
    let y = b.gemm_linear(&s, "fc", 16, 8);
    let r = b.relu(&s);
    b.output(&y, "y", DType::F32, &[1, 8]);
    b.output(&r, "relu", DType::F32, &[1, 16]);
    b.finish_bytes()
}

/// `embed`: a [100, 16] embedding table gathered by 8 token ids.
pub fn embed_onnx() -> Vec<u8> {
    let mut b = OnnxBuilder::new("embed", 17, SEED + 2);
    let ids = b.input("ids", DType::I64, &[1, 8]);
    let table = b.uniform("table", &[100, 16], 1.0);
    let e = b.node("Gather", "gather", &[&table, &ids], vec![("axis", Attr::Int(0))]);
    b.output(&e, "emb", DType::F32, &[1, 8, 16]);
    b.finish_bytes()
}

/// `dyn_seq`: MatMul(16->8) + bias + ReLU per token, on `x` [batch, seq, 16] with symbolic
/// `batch` and `seq` axes (the shape of a BERT-style model's hidden states).
pub fn dyn_seq_onnx() -> Vec<u8> {
    let mut b = OnnxBuilder::new("dyn_seq", 17, SEED + 4);
    let dims = |last: usize| [Dim::Symbol("batch".into()), Dim::Symbol("seq".into()), Dim::Fixed(last)];
    let x = b.input_dims("x", DType::F32, &dims(16));
    let h = b.matmul_linear(&x, "fc", 16, 8, 0.5);
    let y = b.relu(&h);
    b.output_dims(&y, "y", DType::F32, &dims(8));
    b.finish_bytes()
}

/// Writes one model folder: `file` with `onnx`, and `config.toml` with `config`.
pub fn write_model(dir: &Path, name: &str, onnx: &[u8], file: &str, config: &str) -> std::io::Result<()> {
    write(dir, name, onnx, file, config)
}

fn write(dir: &Path, name: &str, onnx: &[u8], file: &str, config: &str) -> std::io::Result<()> {
    let d = dir.join(name);
    std::fs::create_dir_all(&d)?;
    std::fs::write(d.join(file), onnx)?;
    std::fs::write(d.join(crate::repository::CONFIG_FILE), config)
}

/// Writes the four tiny models into `dir` (a model repository); returns their names.
pub fn write_tiny_repository(dir: &Path) -> std::io::Result<Vec<String>> {
    write(dir, "mlp", &mlp_onnx(), "mlp.onnx", "model = \"mlp.onnx\"\nclass = \"real-time\"\npriority_level = 995\n")?;
    write(dir, "mlp_f16", &mlp_onnx(), "mlp.onnx", "model = \"mlp.onnx\"\ndtype = \"f16\"\n")?;
    write(dir, "pair", &pair_onnx(), "pair.onnx", "tenant = 3\n")?;
    write(dir, "embed", &embed_onnx(), "embed.onnx", "# defaults\n")?;
    Ok(vec!["embed".into(), "mlp".into(), "mlp_f16".into(), "pair".into()])
}

/// An MLP of `depth` hidden layers of `width` (Gemm + ReLU) on a [1, width] input, 10 outputs: its
/// compute (and so its time on the simulator with computation on) grows with width² x depth.
pub fn mlp_sized_onnx(name: &str, width: usize, depth: usize) -> Vec<u8> {
    let mut b = OnnxBuilder::new(name, 17, SEED + width as u64 + depth as u64);
    let mut h = b.input("x", DType::F32, &[1, width]);
    for i in 0..depth {
        h = b.gemm_linear(&h, &format!("fc{i}"), width, width);
        h = b.relu(&h);
    }
    let y = b.gemm_linear(&h, "out", width, 10);
    b.output(&y, "y", DType::F32, &[1, 10]);
    b.finish_bytes()
}

/// `gap224`: a global average pool over an ImageNet-sized input ([1, 3, 224, 224] FP32, 602 KB
/// in, 12 bytes out): little compute, a large tensor to carry.
pub fn gap224_onnx() -> Vec<u8> {
    let mut b = OnnxBuilder::new("gap224", 17, SEED + 3);
    let x = b.input("x", DType::F32, &[1, 3, 224, 224]);
    let p = b.global_avgpool(&x);
    let y = b.flatten(&p);
    b.output(&y, "y", DType::F32, &[1, 3]);
    b.finish_bytes()
}

/// The benchmark repository: `mlp`, `gap224`, and MLPs `mlp_w{width}_d{depth}` of growing compute.
pub fn write_bench_repository(dir: &Path, sized: &[(usize, usize)]) -> std::io::Result<Vec<String>> {
    write(dir, "mlp", &mlp_onnx(), "mlp.onnx", "class = \"real-time\"\n")?;
    write(dir, "gap224", &gap224_onnx(), "gap224.onnx", "# defaults\n")?;
    let mut names = vec!["mlp".to_string(), "gap224".to_string()];
    for &(w, d) in sized {
        let name = format!("mlp_w{w}_d{d}");
        write(dir, &name, &mlp_sized_onnx(&name, w, d), "model.onnx", "# defaults\n")?;
        names.push(name);
    }
    Ok(names)
}
