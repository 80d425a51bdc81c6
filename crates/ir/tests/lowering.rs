//! Structural properties of lowering: fusion happens, layouts and views avoid copies, weight layers
//! tile the blob, arenas are reused, and dependencies cover every hazard.

use kairos_ir::lower::{LowerOptions, lower, optimized};
use kairos_ir::plan::{Kernel, Plan, Space};
use kairos_ir::zoo::ZooOptions;
use kairos_ir::{DType, graph::Op};

fn plan_of(name: &str, dtype: DType) -> (kairos_ir::graph::Graph, Plan) {
    let bytes = kairos_ir::zoo::build(name, &ZooOptions { seq_len: 16, ..Default::default() }).unwrap();
    let g = kairos_ir::onnx::load_bytes(name, &bytes, &Default::default()).unwrap();
    let p = lower(&g, &LowerOptions::new(dtype)).unwrap();
    (g, p)
}

#[test]
fn batchnorm_relu_and_residuals_fuse_into_convolutions() {
    let (g, p) = plan_of("resnet50", DType::F32);
    let opt = optimized(&g);
    assert!(
        !opt.nodes.iter().any(|n| matches!(n.op, Op::Binary(_) | Op::Unary(_) | Op::Affine { .. })),
        "resnet50 keeps element-wise nodes after fusion"
    );
    let convs = p.launches.iter().filter(|l| matches!(l.kernel, Kernel::Conv2d(_))).count();
    assert_eq!(convs, 53);
    let with_residual = p.launches.iter().filter(|l| matches!(l.kernel, Kernel::Conv2d(c) if c.epilogue.residual)).count();
    assert_eq!(with_residual, 16, "one residual add per bottleneck");
}

#[test]
fn transformer_layers_are_gemms_softmax_and_layernorms() {
    let (g, p) = plan_of("bert_base", DType::F16);
    let h = p.kernel_histogram();
    // Per layer: the query, key and value projections as one product (merged siblings), the two
    // attention products, the output projection and the two feed-forward products.
    assert_eq!(h.iter().find(|(k, _)| *k == "gemm").unwrap().1, 72, "{h:?}");
    let qkv = p.launches.iter().filter(|l| matches!(&l.kernel, Kernel::Gemm(q) if q.n == 3 * 768)).count();
    assert_eq!(qkv, 12, "one query-key-value product per layer");
    // Its slices are read in place: no copy launch anywhere in the plan.
    let copies: Vec<_> = p.launches.iter().filter(|l| l.name.ends_with(".contiguous")).map(|l| &l.name).collect();
    assert!(copies.is_empty(), "{copies:?}");
    assert_eq!(h.iter().find(|(k, _)| *k == "softmax").unwrap().1, 12);
    assert!(p.launches.len() <= 140, "bert_base lowered to {} launches: {h:?}", p.launches.len());
    // With split-K, each layer's second feed-forward product (K = 3072) is split, finished by a sum.
    let split = kairos_ir::lower::lower(&g, &kairos_ir::lower::LowerOptions { dtype: DType::F16, split_k: true }).unwrap();
    let sums = split.launches.iter().filter(|l| l.kernel.name() == "splitk_sum").count();
    assert_eq!(sums, 12, "{:?}", split.kernel_histogram());
    assert_eq!(split.launches.len(), p.launches.len() + sums);
    // The fp16 plan keeps every weight operand K-major (the tensor-core tiles' fast layout); the
    // fp32 plan keeps ONNX's [K][N].
    let weight_b = |p: &Plan| -> Vec<(u64, u64)> {
        let gemms = p.launches.iter().filter_map(|l| match &l.kernel {
            Kernel::Gemm(g) if l.args[1].space == Space::Weights => Some((g.b_stride_k, g.b_stride_n)),
            _ => None,
        });
        gemms.collect()
    };
    let f16 = weight_b(&p);
    assert_eq!(f16.len(), 48, "four weight products per layer");
    assert!(f16.iter().all(|&(sk, sn)| sk == 1 && (sn == 768 || sn == 2304 || sn == 3072)), "{f16:?}");
    let (_, p32) = plan_of("bert_base", DType::F32);
    assert!(weight_b(&p32).iter().all(|&(_, sn)| sn == 1));
    let (_, gpt) = plan_of("gpt2", DType::F32);
    let causal = gpt.launches.iter().filter(|l| matches!(l.kernel, Kernel::Softmax(s) if s.causal)).count();
    assert_eq!(causal, 12, "GPT-2's masks fold into causal softmaxes");
}

#[test]
fn concatenations_are_written_in_place() {
    for name in ["densenet121", "googlenet", "inception_v3", "squeezenet1_1"] {
        let (_, p) = plan_of(name, DType::F32);
        let copies = p
            .launches
            .iter()
            .filter(|l| matches!(l.kernel, Kernel::Eltwise(e) if e.func == kairos_ir::plan::EltFunc::Copy && e.act == kairos_ir::graph::Act::None))
            .count();
        assert!(copies <= 2, "{name}: {copies} copy kernels (input layout and output only expected)");
    }
}

#[test]
fn weight_layers_tile_the_blob_in_launch_order() {
    for name in ["resnet18", "gpt2"] {
        let (_, p) = plan_of(name, DType::F16);
        let mut end = 0;
        for layer in &p.layers {
            assert!(layer.offset_bytes >= end, "{name}: layers overlap");
            end = layer.offset_bytes + layer.len_bytes;
        }
        assert!(end <= p.weight_bytes);
        // Each launch's weights are in its own layer or an earlier one (cold starts load in order).
        for (i, l) in p.launches.iter().enumerate() {
            for a in l.args.iter().filter(|a| a.space == Space::Weights) {
                let layer = p
                    .layers
                    .iter()
                    .position(|ly| a.offset_bytes >= ly.offset_bytes && a.offset_bytes < ly.offset_bytes + ly.len_bytes);
                let layer = layer.unwrap_or_else(|| panic!("{name}: launch {i} reads weights outside every layer"));
                assert!(l.layer.is_none_or(|own| layer as u32 <= own), "{name}: launch {i} reads a later layer");
            }
        }
    }
}

#[test]
#[allow(clippy::needless_range_loop)] // a relation matrix, indexed both ways
fn arena_is_reused_and_hazards_are_dependencies() {
    let (_, p) = plan_of("resnet50", DType::F32);
    let total: u64 = p.launches.iter().flat_map(|l| l.args.last()).filter(|a| a.space == Space::Arena).map(|a| a.len_bytes).sum();
    assert!(p.arena_bytes * 4 < total, "arena {} bytes for {} bytes of activations: no reuse", p.arena_bytes, total);
    // Any two launches touching overlapping arena bytes, one of them writing, are ordered by deps (transitively).
    let n = p.launches.len();
    let mut before = vec![vec![false; n]; n];
    for i in 0..n {
        for &d in &p.launches[i].deps {
            before[i][d as usize] = true;
            for k in 0..n {
                if before[d as usize][k] {
                    before[i][k] = true;
                }
            }
        }
    }
    for j in 0..n {
        let wj = p.launches[j].args.last().unwrap();
        for i in 0..j {
            let li = &p.launches[i];
            let touches = li.args.iter().any(|a| a.space == wj.space && a.overlaps(wj));
            let wi = li.args.last().unwrap();
            let reads_mine = p.launches[j].args.iter().any(|a| a.space == wi.space && a.overlaps(wi));
            if (touches || reads_mine) && wj.space == Space::Arena {
                assert!(
                    before[j][i],
                    "launch {j} ({}) and {i} ({}) touch the same arena bytes unordered",
                    p.launches[j].name, li.name
                );
            }
        }
    }
}

#[test]
fn plans_serialize_for_inspection() {
    let (_, p) = plan_of("mobilenet_v2", DType::F16);
    let json = serde_json::to_string(&p).unwrap();
    let back: Plan = serde_json::from_str(&json).unwrap();
    assert_eq!(back.launches.len(), p.launches.len());
    assert!(json.contains("\"kernel\":\"dwconv2d\""));
}
