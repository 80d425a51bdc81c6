//! Tiny models for tests, examples and benchmarks: built as ONNX with the zoo's builder (seeded
//! weights), written into a model repository with their `config.toml`.
//!
//! | model | inputs | outputs | config |
//! |---|---|---|---|
//! | `mlp` | `x` FP32 [1, 64] | `y` FP32 [1, 10] | real-time, priority 5 |
//! | `mlp_f16` | `x` FP32 [1, 64] | `y` FP32 [1, 10] | the same file, an f16 plan |
//! | `pair` | `a`, `b` FP32 [1, 16] | `y` FP32 [1, 8], `relu` FP32 [1, 16] | best-effort, tenant 3 |
//! | `embed` | `ids` INT64 [1, 8] | `emb` FP32 [1, 8, 16] | best-effort |

use kairos_ir::DType;
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

fn write(dir: &Path, name: &str, onnx: &[u8], file: &str, config: &str) -> std::io::Result<()> {
    let d = dir.join(name);
    std::fs::create_dir_all(&d)?;
    std::fs::write(d.join(file), onnx)?;
    std::fs::write(d.join(crate::repository::CONFIG_FILE), config)
}

/// Writes the four tiny models into `dir` (a model repository); returns their names.
pub fn write_tiny_repository(dir: &Path) -> std::io::Result<Vec<String>> {
    write(dir, "mlp", &mlp_onnx(), "mlp.onnx", "model = \"mlp.onnx\"\nclass = \"real-time\"\npriority = 5\n")?;
    write(dir, "mlp_f16", &mlp_onnx(), "mlp.onnx", "model = \"mlp.onnx\"\ndtype = \"f16\"\n")?;
    write(dir, "pair", &pair_onnx(), "pair.onnx", "tenant = 3\n")?;
    write(dir, "embed", &embed_onnx(), "embed.onnx", "# defaults\n")?;
    Ok(vec!["embed".into(), "mlp".into(), "mlp_f16".into(), "pair".into()])
}
