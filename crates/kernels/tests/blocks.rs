//! Property tests of the CPU kernels and the lowering's views, against the naive graph interpreter,
//! and of the logical-block contract: any split of a launch's blocks, run in any order, writes the
//! same bytes as running them all at once (what preemption and resumption rely on).

use kairos_ir::graph::*;
use kairos_ir::lower::{LowerOptions, lower};
use kairos_ir::plan::AlignedBytes;
use kairos_ir::tensor::relative_l2_error;
use kairos_ir::{DType, Tensor};
use kairos_kernels::cpu::{PlanMemory, execute_plan, run_blocks};
use proptest::prelude::*;

fn values(shape: &[usize], seed: u64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 4001) as f32 / 1000.0 - 2.0
        })
        .collect()
}

/// One-op graph: input x, optional constants, the op under test.
fn one_op(op: Op, x_shape: &[usize], consts: Vec<Tensor>, out_shape: &[usize]) -> Graph {
    let mut g = Graph::new("prop");
    let x = g.add("x", Op::Input { index: 0 }, vec![], x_shape.to_vec(), DType::F32);
    g.inputs.push(GraphInput { name: "x".into(), node: x });
    let mut ins = vec![x];
    for (i, c) in consts.into_iter().enumerate() {
        ins.push(g.add_const(format!("c{i}"), c));
    }
    let y = g.add("y", op, ins, out_shape.to_vec(), DType::F32);
    g.outputs.push(GraphOutput { name: "y".into(), node: y });
    g
}

/// Plan on the CPU vs the naive interpreter.
fn agree(g: &Graph, seed: u64) -> Result<(), TestCaseError> {
    let x = Tensor::f32(g.nodes[0].shape.clone(), values(&g.nodes[0].shape, seed));
    let expected = kairos_ir::interp::run(g, std::slice::from_ref(&x));
    let plan = lower(g, &LowerOptions::new(DType::F32)).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let got = execute_plan(&plan, &[x]).map_err(TestCaseError::fail)?;
    let err = relative_l2_error(&got[0].to_f32_vec(), &expected[0].to_f32_vec());
    prop_assert!(err <= 1e-5, "relative error {err:.3e} for {:?}", g.nodes.last().unwrap().op);
    Ok(())
}

fn conv_out(input: usize, k: usize, s: usize, p: usize, d: usize) -> usize {
    (input + 2 * p - d * (k - 1) - 1) / s + 1
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn conv_matches_naive(
        batch in 1usize..3, cin_g in 1usize..5, cout_g in 1usize..6, groups in 1usize..4,
        k in 1usize..4, stride in 1usize..3, pad in 0usize..2, dil in 1usize..3, hw in 4usize..9,
        act in prop::sample::select(vec![Act::None, Act::Relu, Act::Sigmoid, Act::Gelu]),
        bias in any::<bool>(), seed in any::<u64>(),
    ) {
        let (cin, cout) = (cin_g * groups, cout_g * groups);
        prop_assume!(hw + 2 * pad > dil * (k - 1));
        let o = conv_out(hw, k, stride, pad, dil);
        let window = Window { kernel: [k, k], stride: [stride, stride], dilation: [dil, dil], pad_begin: [pad, pad], pad_end: [pad, pad] };
        let mut consts = vec![Tensor::f32(vec![cout, cin_g, k, k], values(&[cout, cin_g, k, k], seed ^ 1))];
        if bias {
            consts.push(Tensor::f32(vec![cout], values(&[cout], seed ^ 2)));
        }
        let ep = Epilogue { bias, residual: false, act: ActOpt(act) };
        let g = one_op(Op::Conv { window, groups, epilogue: ep }, &[batch, cin, hw, hw], consts, &[batch, cout, o, o]);
        agree(&g, seed)?;
    }

    #[test]
    fn matmul_matches_naive(b0 in 1usize..3, m in 1usize..70, k in 1usize..40, n in 1usize..70, bias in any::<bool>(), seed in any::<u64>()) {
        let mut consts = vec![Tensor::f32(vec![b0, k, n], values(&[b0, k, n], seed ^ 3))];
        if bias {
            consts.push(Tensor::f32(vec![n], values(&[n], seed ^ 4)));
        }
        let ep = Epilogue { bias, residual: false, act: ActOpt(Act::None) };
        let g = one_op(Op::MatMul { epilogue: ep, alpha: 1.0 }, &[b0, m, k], consts, &[b0, m, n]);
        agree(&g, seed)?;
    }

    #[test]
    fn pooling_matches_naive(c in 1usize..6, hw in 3usize..10, k in 1usize..4, s in 1usize..3, pad in 0usize..2,
                             kind in prop::sample::select(vec![PoolKind::Max, PoolKind::Avg { count_include_pad: true }, PoolKind::Avg { count_include_pad: false }]),
                             seed in any::<u64>()) {
        prop_assume!(pad < k && hw + 2 * pad >= k);
        let o = conv_out(hw, k, s, pad, 1);
        let window = Window { kernel: [k, k], stride: [s, s], dilation: [1, 1], pad_begin: [pad, pad], pad_end: [pad, pad] };
        let g = one_op(Op::Pool { kind, window }, &[2, c, hw, hw], vec![], &[2, c, o, o]);
        agree(&g, seed)?;
    }

    #[test]
    fn softmax_layernorm_reduce_match_naive(rows in 1usize..6, cols in 1usize..50, scale in 0.1f32..2.0, seed in any::<u64>()) {
        let g = one_op(Op::Softmax { axis: 1, scale, causal: false, zero_nan: false }, &[rows, cols], vec![], &[rows, cols]);
        agree(&g, seed)?;
        let ln = one_op(Op::LayerNorm { eps: 1e-5, rms: false }, &[rows, cols],
            vec![Tensor::f32(vec![cols], values(&[cols], seed ^ 5)), Tensor::f32(vec![cols], values(&[cols], seed ^ 6))], &[rows, cols]);
        agree(&ln, seed)?;
        let r = one_op(Op::Reduce { op: ReduceOp::Mean, axes: vec![0] }, &[rows, cols], vec![], &[1, cols]);
        agree(&r, seed)?;
    }

    #[test]
    fn broadcast_binary_matches_naive(a in 1usize..5, b in 1usize..5, c in 1usize..9,
                                      op in prop::sample::select(vec![BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Max]),
                                      seed in any::<u64>()) {
        let g = one_op(Op::Binary(op), &[a, b, c], vec![Tensor::f32(vec![b, 1], values(&[b, 1], seed ^ 7))], &[a, b, c]);
        agree(&g, seed)?;
    }

    #[test]
    fn transposed_views_feed_kernels(a in 1usize..4, b in 1usize..6, c in 1usize..6, seed in any::<u64>()) {
        // Transpose then matmul: the kernel reads a strided view, no copy.
        let mut g = Graph::new("views");
        let x = g.add("x", Op::Input { index: 0 }, vec![], vec![a, b, c], DType::F32);
        g.inputs.push(GraphInput { name: "x".into(), node: x });
        let t = g.add("t", Op::Transpose { perm: vec![0, 2, 1] }, vec![x], vec![a, c, b], DType::F32);
        let w = g.add_const("w", Tensor::f32(vec![a, b, 3], values(&[a, b, 3], seed ^ 8)));
        let y = g.add("y", Op::MatMul { epilogue: Epilogue::default(), alpha: 1.0 }, vec![t, w], vec![a, c, 3], DType::F32);
        g.outputs.push(GraphOutput { name: "y".into(), node: y });
        agree(&g, seed)?;
    }

    /// Running a launch's logical blocks in any split and order gives the bytes of one full run.
    #[test]
    fn any_block_split_writes_the_same_bytes(cuts in prop::collection::vec(0u32..64, 0..6), reverse in any::<bool>(), seed in any::<u64>()) {
        let bytes = kairos_ir::zoo::build("squeezenet1_1", &kairos_ir::zoo::ZooOptions::default()).unwrap();
        let g = kairos_ir::onnx::load_bytes("squeezenet1_1", &bytes, &Default::default()).unwrap();
        let squeezenet = lower(&g, &LowerOptions::new(DType::F16)).unwrap();
        // And a split-K product (slices of K as logical blocks, then their sum).
        let long_k = lower(&long_matmul(40, 2304, 72, seed), &LowerOptions { dtype: DType::F16, split_k: true }).unwrap();
        prop_assert!(long_k.launches.iter().any(|l| l.kernel.is_split_k()));
        for plan in [squeezenet, long_k] {
        let x = Tensor::f32(plan.inputs[0].shape.clone(), values(&plan.inputs[0].shape, seed)).cast(DType::F32);
        let input = AlignedBytes::from_slice(&x.to_bytes());
        let run = |split: bool| {
            let mut arena = AlignedBytes::zeroed(plan.arena_bytes as usize);
            let mut out = AlignedBytes::zeroed(plan.outputs[0].len_bytes() as usize);
            let mut mem = PlanMemory { arena: arena.as_mut_slice(), weights: plan.weights.as_slice(), inputs: vec![input.as_slice()],
                                       outputs: vec![out.as_mut_slice()], args: Vec::new() };
            for l in &plan.launches {
                mem.args = l.args.clone();
                let n = l.shape.logical_blocks;
                if !split {
                    run_blocks(&l.kernel, l.dtype, &mut mem, 0..n);
                    continue;
                }
                let mut points: Vec<u32> = cuts.iter().map(|c| c % (n + 1)).collect();
                points.push(0);
                points.push(n);
                points.sort();
                points.dedup();
                let mut ranges: Vec<_> = points.windows(2).map(|w| w[0]..w[1]).collect();
                if reverse {
                    ranges.reverse();
                }
                for r in ranges {
                    run_blocks(&l.kernel, l.dtype, &mut mem, r);
                }
            }
            drop(mem);
            out.as_slice().to_vec()
        };
        prop_assert_eq!(run(false), run(true));
        }
    }
}

/// x [m, k] times constant weights [k, n] plus a bias, then ReLU.
fn long_matmul(m: usize, k: usize, n: usize, seed: u64) -> Graph {
    let consts = vec![Tensor::f32(vec![k, n], values(&[k, n], seed ^ 9)), Tensor::f32(vec![n], values(&[n], seed ^ 10))];
    let ep = Epilogue { bias: true, residual: false, act: ActOpt(Act::Relu) };
    one_op(Op::MatMul { epilogue: ep, alpha: 1.0 }, &[m, k], consts, &[m, n])
}

/// fp16 plans with split-K on cut long reductions into split-K slices (a gemm or conv2d writing f32 partial sums,
/// then a splitk_sum with the epilogue), and still match the naive interpreter.
#[test]
fn long_reductions_split_k_and_match_naive() {
    let check = |g: &Graph, seed: u64| {
        let plan = lower(g, &LowerOptions { dtype: DType::F16, split_k: true }).unwrap();
        plan.validate().unwrap();
        let whole = lower(g, &LowerOptions { dtype: DType::F16, split_k: false }).unwrap();
        assert!(!whole.launches.iter().any(|l| l.kernel.is_split_k()), "split_k: false still split");
        let split: Vec<_> = plan.launches.iter().filter(|l| l.kernel.is_split_k()).collect();
        assert_eq!(split.len(), 1, "{}: {:?}", g.name, plan.kernel_histogram());
        assert!(plan.launches.iter().any(|l| l.kernel.name() == "splitk_sum"));
        let x = Tensor::f32(g.nodes[0].shape.clone(), values(&g.nodes[0].shape, seed));
        let expected = kairos_ir::interp::run(g, std::slice::from_ref(&x));
        let got = execute_plan(&plan, &[x]).unwrap();
        let err = relative_l2_error(&got[0].to_f32_vec(), &expected[0].to_f32_vec());
        // fp16 storage of inputs, weights and output; f32 sums.
        assert!(err <= 1e-2, "{}: relative error {err:.3e}", g.name);
        err
    };
    for (m, k, n, seed) in [(40, 2304, 72, 1), (9, 3072, 24, 2), (130, 4100, 33, 3)] {
        check(&long_matmul(m, k, n, seed), seed);
    }
    // A 3x3 convolution over 512 channels (K = 4608), with a bias and ReLU.
    let (cin, cout, hw) = (512, 24, 5);
    let window = Window { kernel: [3, 3], stride: [1, 1], dilation: [1, 1], pad_begin: [1, 1], pad_end: [1, 1] };
    let consts =
        vec![Tensor::f32(vec![cout, cin, 3, 3], values(&[cout, cin, 3, 3], 11)), Tensor::f32(vec![cout], values(&[cout], 12))];
    let ep = Epilogue { bias: true, residual: false, act: ActOpt(Act::Relu) };
    let g = one_op(Op::Conv { window, groups: 1, epilogue: ep }, &[1, cin, hw, hw], consts, &[1, cout, hw, hw]);
    check(&g, 13);
}

/// A split-K launch plus its sum computes what the whole-K launch computes (f32, to rounding).
#[test]
fn split_k_blocks_sum_to_the_whole_product() {
    let g = long_matmul(33, 2080, 40, 7);
    let whole = lower(&g, &LowerOptions::new(DType::F32)).unwrap();
    assert!(!whole.launches.iter().any(|l| l.kernel.is_split_k()), "f32 plans are not split");
    let x = Tensor::f32(g.nodes[0].shape.clone(), values(&g.nodes[0].shape, 7));
    let want = execute_plan(&whole, std::slice::from_ref(&x)).unwrap()[0].to_f32_vec();
    for splits in [2u32, 3, 5] {
        // The same product by hand: a split gemm into a workspace at the arena's end, then the sum.
        let mut plan = whole.clone();
        let gi = plan.launches.iter().position(|l| l.kernel.name() == "gemm").unwrap();
        let l = plan.launches[gi].clone();
        let kairos_ir::plan::Kernel::Gemm(p) = l.kernel else { unreachable!() };
        let ws_bytes = (splits * p.m * p.n * 4) as u64;
        let ws =
            kairos_ir::plan::BufRef { space: kairos_ir::plan::Space::Arena, offset_bytes: plan.arena_bytes, len_bytes: ws_bytes };
        plan.arena_bytes += ws_bytes;
        let sum = kairos_ir::plan::SplitKSumParams {
            splits,
            batch0: 1,
            batch1: 1,
            m: p.m,
            n: p.n,
            c_stride0: 0,
            c_stride1: 0,
            c_stride_m: p.c_stride_m,
            r_stride0: 0,
            r_stride1: 0,
            r_stride_m: 0,
            alpha: p.alpha,
            epilogue: p.epilogue,
            elems_per_block: 100,
        };
        let mut split = l.clone();
        split.kernel = l.kernel.split_k_partials(splits);
        split.shape.logical_blocks = split.kernel.logical_blocks();
        split.args = vec![l.args[0], l.args[1], ws];
        let mut finish = l.clone();
        finish.kernel = kairos_ir::plan::Kernel::SplitKSum(sum);
        finish.shape.logical_blocks = finish.kernel.logical_blocks();
        finish.args = vec![ws, l.args[2], l.args[3]];
        finish.deps.push(gi as u32);
        plan.launches.splice(gi..gi + 1, [split, finish]);
        for later in plan.launches.iter_mut().skip(gi + 2) {
            for d in later.deps.iter_mut().filter(|d| **d as usize > gi) {
                *d += 1;
            }
        }
        plan.validate().unwrap();
        let got = execute_plan(&plan, std::slice::from_ref(&x)).unwrap()[0].to_f32_vec();
        let err = relative_l2_error(&got, &want);
        assert!(err <= 1e-6, "split_k {splits}: relative error {err:.3e}");
    }
}
