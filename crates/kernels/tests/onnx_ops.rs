//! Every ONNX op kairos claims, through the real front door: a small model per case is built as
//! ONNX, imported, lowered (fp32 and fp16), run with the CPU reference kernels and compared with
//! tract, the independent oracle. One `check` serves every case.

use kairos_ir::tensor::relative_l2_error;
use kairos_ir::zoo::builder::{Attr, OnnxBuilder};
use kairos_ir::{DType, Tensor};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

/// fp32 plans against tract (relative L2).
const TOLERANCE_F32: f64 = 1e-4;
/// fp16 plans (fp32 accumulation) against tract in fp32.
const TOLERANCE_F16: f64 = 1e-2;

struct Input {
    name: &'static str,
    dtype: DType,
    shape: Vec<usize>,
    /// For int64 inputs: values in [0, range).
    range: i64,
}

fn f32_input(name: &'static str, shape: &[usize]) -> Input {
    Input { name, dtype: DType::F32, shape: shape.to_vec(), range: 0 }
}

fn random_inputs(inputs: &[Input], seed: u64) -> Vec<Tensor> {
    let mut rng = SmallRng::seed_from_u64(seed);
    inputs
        .iter()
        .map(|i| {
            let n: usize = i.shape.iter().product();
            match i.dtype {
                DType::I64 => Tensor::i64(i.shape.clone(), (0..n).map(|_| rng.random_range(0..i.range)).collect()),
                _ => Tensor::f32(i.shape.clone(), (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()),
            }
        })
        .collect()
}

/// Builds the model with `body`, runs it through kairos (fp32 and fp16) and tract, compares;
/// returns tract's output.
fn check(case: &str, inputs: Vec<Input>, out_shape: &[usize], body: impl Fn(&mut OnnxBuilder, &[String]) -> String) -> Tensor {
    check_opset(case, 17, inputs, out_shape, body)
}

fn check_opset(
    case: &str,
    opset: i64,
    inputs: Vec<Input>,
    out_shape: &[usize],
    body: impl Fn(&mut OnnxBuilder, &[String]) -> String,
) -> Tensor {
    let mut b = OnnxBuilder::new(case, opset, 7);
    let names: Vec<String> = inputs.iter().map(|i| b.input(i.name, i.dtype, &i.shape)).collect();
    let y = body(&mut b, &names);
    b.output(&y, "y", DType::F32, out_shape);
    let bytes = b.finish_bytes();
    let graph =
        kairos_ir::onnx::load_bytes(case, &bytes, &Default::default()).unwrap_or_else(|e| panic!("{case}: import failed: {e}"));
    let values = random_inputs(&inputs, 11);
    let reference = kairos_ir::onnx::tract_reference(&bytes, &values).unwrap_or_else(|e| panic!("{case}: tract failed: {e}"));
    for (dtype, tol) in [(DType::F32, TOLERANCE_F32), (DType::F16, TOLERANCE_F16)] {
        let plan = kairos_ir::lower::lower(&graph, &kairos_ir::lower::LowerOptions::new(dtype))
            .unwrap_or_else(|e| panic!("{case} ({dtype}): lowering failed: {e}"));
        let out = kairos_kernels::cpu::execute_plan(&plan, &values).unwrap();
        assert_eq!(out[0].shape, reference[0].shape, "{case} ({dtype}): output shape");
        let err = relative_l2_error(&out[0].to_f32_vec(), &reference[0].to_f32_vec());
        assert!(err <= tol, "{case} ({dtype}): relative L2 error {err:.3e} > {tol:.0e} ({} launches)", plan.launches.len());
    }
    reference.into_iter().next().expect("one output")
}

/// The plan kairos lowers the model `body` builds (as `check_opset` builds it) to, at `dtype`.
fn lowered(
    case: &str,
    opset: i64,
    inputs: &[Input],
    out_shape: &[usize],
    dtype: DType,
    body: impl Fn(&mut OnnxBuilder, &[String]) -> String,
) -> kairos_ir::plan::Plan {
    let mut b = OnnxBuilder::new(case, opset, 7);
    let names: Vec<String> = inputs.iter().map(|i| b.input(i.name, i.dtype, &i.shape)).collect();
    let y = body(&mut b, &names);
    b.output(&y, "y", DType::F32, out_shape);
    let graph = kairos_ir::onnx::load_bytes(case, &b.finish_bytes(), &Default::default()).unwrap();
    kairos_ir::lower::lower(&graph, &kairos_ir::lower::LowerOptions::new(dtype)).unwrap()
}

/// Each launch of a plan as a line: what `describe` says of it, else its kernel and name.
fn launch_lines(plan: &kairos_ir::plan::Plan, describe: impl Fn(&kairos_ir::plan::Launch) -> Option<String>) -> Vec<String> {
    plan.launches.iter().map(|l| describe(l).unwrap_or_else(|| format!("{} {}", l.kernel.name(), l.name))).collect()
}

/// Element-wise launches that compute something: neither a layout copy (`.contiguous`) nor the
/// copy into an output tensor (`.output`).
fn computing_eltwise(plan: &kairos_ir::plan::Plan) -> usize {
    plan.launches
        .iter()
        .filter(|l| l.kernel.name() == "eltwise" && !l.name.ends_with(".contiguous") && !l.name.ends_with(".output"))
        .count()
}

#[allow(clippy::too_many_arguments)]
fn conv_case(
    name: &str,
    cin: usize,
    cout: usize,
    k: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    dil: (usize, usize),
    groups: usize,
    hw: usize,
) {
    let span = |d: usize, kk: usize, s: usize, p: usize| (hw + 2 * p - d * (kk - 1) - 1) / s + 1;
    let oh = span(dil.0, k.0, stride.0, pad.0);
    let ow = span(dil.1, k.1, stride.1, pad.1);
    check(name, vec![f32_input("x", &[2, cin, hw, hw])], &[2, cout, oh, ow], |b, i| {
        b.conv_full(&i[0], "conv", cin, cout, k, stride, pad, dil, groups, true)
    });
}

#[test]
fn conv_plain_strided_padded_dilated_grouped_depthwise() {
    conv_case("conv3x3", 5, 7, (3, 3), (1, 1), (1, 1), (1, 1), 1, 9);
    conv_case("conv_stride2", 4, 6, (3, 3), (2, 2), (1, 1), (1, 1), 1, 11);
    conv_case("conv_asym_kernel", 6, 8, (1, 7), (1, 1), (0, 3), (1, 1), 1, 9);
    conv_case("conv_dilated", 3, 4, (3, 3), (1, 1), (2, 2), (2, 2), 1, 10);
    conv_case("conv_grouped", 8, 12, (3, 3), (1, 1), (1, 1), (1, 1), 4, 7);
    conv_case("conv_depthwise", 16, 16, (3, 3), (2, 2), (1, 1), (1, 1), 16, 9);
    conv_case("conv1x1_strided", 8, 16, (1, 1), (2, 2), (0, 0), (1, 1), 1, 8);
}

#[test]
fn silu_as_exporters_write_it_fuses_and_matches() {
    let body = |b: &mut OnnxBuilder, i: &[String]| {
        let c = b.conv(&i[0], "c1", 8, 12, (3, 3), 1, (1, 1), 1, true);
        let s = b.node("Sigmoid", "", &[&c], vec![]);
        let y = b.mul(&c, &s);
        // Operands the other way round, on a value that is not a convolution's.
        let t = b.node("Sigmoid", "", &[&y], vec![]);
        let z = b.mul(&t, &y);
        b.add(&z, &y)
    };
    check("conv_silu", vec![f32_input("x", &[1, 8, 6, 6])], &[1, 12, 6, 6], body);
    // Lowered: the first SiLU is the convolution's epilogue, the second one element-wise launch
    // (with the layout copies in and out and the addition: five, against eight unfused).
    let plan = lowered("conv_silu", 17, &[f32_input("x", &[1, 8, 6, 6])], &[1, 12, 6, 6], DType::F16, body);
    let conv_act = plan.launches.iter().find_map(|l| match &l.kernel {
        kairos_ir::plan::Kernel::Conv2d(p) => Some(p.epilogue.act),
        _ => None,
    });
    assert_eq!(conv_act, Some(kairos_ir::graph::Act::Silu), "the convolution's epilogue");
    let names: Vec<&str> = plan.launches.iter().map(|l| l.kernel.name()).collect();
    assert!(names.len() <= 5, "SiLU left element-wise launches behind: {names:?}");
}

#[test]
fn quick_gelu_as_clip_writes_it_fuses_and_matches() {
    let body = |b: &mut OnnxBuilder, i: &[String]| {
        let y = b.matmul_linear(&i[0], "fc1", 16, 24, 0.3);
        let c = b.const_f32_scalar(1.702);
        let scaled = b.mul(&c, &y);
        let s = b.node("Sigmoid", "", &[&scaled], vec![]);
        b.mul(&y, &s)
    };
    check("quick_gelu", vec![f32_input("x", &[1, 5, 16])], &[1, 5, 24], body);
    let plan = lowered("quick_gelu", 17, &[f32_input("x", &[1, 5, 16])], &[1, 5, 24], DType::F32, body);
    let acts = launch_lines(&plan, |l| match &l.kernel {
        kairos_ir::plan::Kernel::Gemm(p) => Some(format!("gemm {:?}", p.epilogue.act)),
        _ => None,
    });
    assert_eq!(acts, ["gemm QuickGelu"], "the product's epilogue, nothing else");
}

#[test]
fn gpt2_conv1d_reshapes_keep_epilogues_fused() {
    // Hugging Face's GPT-2 `Conv1D`: Reshape [B, S, C] -> [B S, C], Gemm, Reshape back; the GELU
    // (tanh form) and the residual add read the second reshape. Both join the products' epilogues.
    let body = |b: &mut OnnxBuilder, i: &[String]| {
        let conv1d = |b: &mut OnnxBuilder, x: &str, name: &str, fin: usize, fout: usize| {
            let flat = b.reshape(x, &[-1, fin as i64]);
            let y = b.gemm_linear(&flat, name, fin, fout);
            b.reshape(&y, &[2, 5, fout as i64])
        };
        let h = conv1d(b, &i[0], "c_fc", 16, 24);
        let h = b.gelu_tanh(&h);
        let h = conv1d(b, &h, "c_proj", 24, 16);
        b.add(&i[0], &h)
    };
    check("gpt2_conv1d", vec![f32_input("x", &[2, 5, 16])], &[2, 5, 16], body);
    let plan = lowered("gpt2_conv1d", 17, &[f32_input("x", &[2, 5, 16])], &[2, 5, 16], DType::F32, body);
    let launches = launch_lines(&plan, |l| match &l.kernel {
        kairos_ir::plan::Kernel::Gemm(p) => Some(format!("gemm {:?} residual {}", p.epilogue.act, p.epilogue.residual)),
        _ => None,
    });
    // (and the copy into the output tensor)
    assert_eq!(launches, ["gemm GeluTanh residual false", "gemm None residual true", "eltwise y.output"]);
}

fn sibling_projections_body(b: &mut OnnxBuilder, i: &[String]) -> String {
    // BERT's self-attention projections: three nn.Linear on the same input (MatMul + Add each),
    // split into 2 heads of 8; a fourth linear of another width on the same input is
    // concatenated to the attention's output.
    let q = b.matmul_linear(&i[0], "query", 16, 16, 0.3);
    let k = b.matmul_linear(&i[0], "key", 16, 16, 0.3);
    let v = b.matmul_linear(&i[0], "value", 16, 16, 0.3);
    let extra = b.matmul_linear(&i[0], "extra", 16, 24, 0.3);
    let heads = |b: &mut OnnxBuilder, x: &str, perm: &[i64]| {
        let x = b.reshape(x, &[2, 6, 2, 8]);
        b.transpose(&x, perm)
    };
    let q = heads(b, &q, &[0, 2, 1, 3]);
    let kt = heads(b, &k, &[0, 2, 3, 1]);
    let v = heads(b, &v, &[0, 2, 1, 3]);
    let s = b.node("MatMul", "scores", &[&q, &kt], vec![]);
    let p = b.softmax(&s, -1);
    let o = b.node("MatMul", "context", &[&p, &v], vec![]);
    let o = b.transpose(&o, &[0, 2, 1, 3]);
    let o = b.reshape(&o, &[2, 6, 16]);
    b.concat(&[&o, &extra], -1)
}

#[test]
fn sibling_projections_merge_into_one_product_and_match() {
    let inputs = || vec![f32_input("x", &[2, 6, 16])];
    check("sibling_projections", inputs(), &[2, 6, 40], sibling_projections_body);
    for dtype in [DType::F32, DType::F16] {
        let plan = lowered("sibling_projections", 17, &inputs(), &[2, 6, 40], dtype, sibling_projections_body);
        let launches = launch_lines(&plan, |l| match &l.kernel {
            kairos_ir::plan::Kernel::Gemm(p) => Some(format!("gemm n {} bias {}", p.n, p.epilogue.bias)),
            _ => None,
        });
        // The four projections as one product of 16 + 16 + 16 + 24 columns with their biases;
        // the heads read its slices in place.
        let gemms: Vec<_> = launches.iter().filter(|l| l.starts_with("gemm")).collect();
        assert_eq!(gemms, ["gemm n 72 bias true", "gemm n 6 bias false", "gemm n 8 bias false"], "{dtype}: {launches:#?}");
        // No copy of a slice; in fp16 the model's f32 input is converted once, for the merged product.
        let copies = launches.iter().filter(|l| l.ends_with(".contiguous")).count();
        assert_eq!(copies, usize::from(dtype == DType::F16), "{dtype}: {launches:#?}");
    }
}

#[test]
fn convnext_block_end_fuses_through_the_permute() {
    // torchvision's CNBlock: channels-last linear layers between two permutes, then the layer
    // scale [C, 1, 1] and the residual add on the channels-first result. Both join the second
    // product's epilogue (the scale folded into its weights, the input as its residual).
    let body = |b: &mut OnnxBuilder, i: &[String]| {
        let t = b.transpose(&i[0], &[0, 2, 3, 1]);
        let h = b.matmul_linear(&t, "pw1", 8, 32, 0.3);
        let h = b.gelu_erf(&h);
        let h = b.matmul_linear(&h, "pw2", 32, 8, 0.3);
        let h = b.transpose(&h, &[0, 3, 1, 2]);
        let gamma = b.uniform_range("gamma", &[8, 1, 1], 0.5, 1.5);
        let h = b.mul(&gamma, &h);
        b.add(&h, &i[0])
    };
    check("convnext_block_end", vec![f32_input("x", &[1, 8, 5, 5])], &[1, 8, 5, 5], body);
    let plan = lowered("convnext_block_end", 17, &[f32_input("x", &[1, 8, 5, 5])], &[1, 8, 5, 5], DType::F16, body);
    let launches = launch_lines(&plan, |l| match &l.kernel {
        kairos_ir::plan::Kernel::Gemm(p) => Some(format!("gemm {} residual {}", l.name, p.epilogue.residual)),
        _ => None,
    });
    let residual_products = launches.iter().filter(|l| l.ends_with("residual true")).count();
    assert_eq!((residual_products, computing_eltwise(&plan)), (1, 0), "{launches:#?}");
}

#[test]
fn t5_rms_norm_fuses_and_matches() {
    // T5LayerNorm as exported: x * (1 / sqrt(mean(x^2) + eps)) * weight, with Pow and Div.
    let body = |b: &mut OnnxBuilder, i: &[String]| {
        let two = b.const_f32_scalar(2.0);
        let sq = b.node("Pow", "", &[&i[0], &two], vec![]);
        let axes = b.const_i64(&[-1]);
        let var = b.node("ReduceMean", "", &[&sq, &axes], vec![("keepdims", Attr::Int(1))]);
        let eps = b.const_f32_scalar(1e-6);
        let var = b.add(&var, &eps);
        let root = b.node("Sqrt", "", &[&var], vec![]);
        let one = b.const_f32_scalar(1.0);
        let inv = b.node("Div", "", &[&one, &root], vec![]);
        let y = b.mul(&i[0], &inv);
        let w = b.uniform_range("weight", &[24], 0.5, 1.5);
        b.mul(&w, &y)
    };
    check_opset("t5_rms_norm", 18, vec![f32_input("x", &[2, 5, 24])], &[2, 5, 24], body);
    let plan = lowered("t5_rms_norm", 18, &[f32_input("x", &[2, 5, 24])], &[2, 5, 24], DType::F32, body);
    let launches = launch_lines(&plan, |l| match &l.kernel {
        kairos_ir::plan::Kernel::LayerNorm(p) => Some(format!("layernorm rms {}", p.rms)),
        _ => None,
    });
    assert_eq!(launches, ["layernorm rms true"]);
}

#[test]
fn patch_embedding_conv_runs_as_a_product() {
    // A vision transformer's patch embedding: a 4x4 convolution of stride 4 with bias, flattened
    // to tokens [N, P, C]. Lowered: one transposed copy of the input into patches and one product.
    let body = |b: &mut OnnxBuilder, i: &[String]| {
        let c = b.conv(&i[0], "patch", 3, 8, (4, 4), 4, (0, 0), 1, true);
        let flat = b.reshape(&c, &[2, 8, 9]);
        b.transpose(&flat, &[0, 2, 1])
    };
    check("patch_embedding", vec![f32_input("x", &[2, 3, 12, 12])], &[2, 9, 8], body);
    let plan = lowered("patch_embedding", 17, &[f32_input("x", &[2, 3, 12, 12])], &[2, 9, 8], DType::F16, body);
    let kinds: Vec<&str> = plan.launches.iter().map(|l| l.kernel.name()).collect();
    assert!(kinds.contains(&"gemm") && !kinds.iter().any(|k| k.contains("conv")), "{kinds:?}");
}

#[test]
fn conv_batchnorm_relu_residual_fuses_and_matches() {
    check("conv_bn_relu_res", vec![f32_input("x", &[1, 8, 6, 6])], &[1, 8, 6, 6], |b, i| {
        let c = b.conv(&i[0], "c1", 8, 8, (3, 3), 1, (1, 1), 1, false);
        let n = b.bn(&c, "bn1", 8, 1e-5, (0.5, 1.5));
        let s = b.add(&n, &i[0]);
        b.relu(&s)
    });
}

#[test]
fn gemm_matmul_einsum() {
    check("gemm_transb", vec![f32_input("x", &[3, 20])], &[3, 9], |b, i| b.gemm_linear(&i[0], "fc", 20, 9));
    check("matmul_3d_bias_gelu_erf", vec![f32_input("x", &[2, 5, 16])], &[2, 5, 24], |b, i| {
        let y = b.matmul_linear(&i[0], "lin", 16, 24, 0.2);
        b.gelu_erf(&y)
    });
    check("matmul_batched_broadcast", vec![f32_input("a", &[2, 3, 4, 5]), f32_input("b", &[3, 5, 6])], &[2, 3, 4, 6], |b, i| {
        b.node("MatMul", "mm", &[&i[0], &i[1]], vec![])
    });
    // A weight shared over batch dims: the rows fold into one product (a sequence-first input as
    // `nn.MultiheadAttention` exports it, m = 1; a channels-last one, m = 5; a residual folded
    // with them; a transposed input whose rows do not continue across the batch, not folded).
    check("matmul_seq_first_shared_weight", vec![f32_input("x", &[7, 1, 16])], &[7, 1, 24], |b, i| {
        b.matmul_linear(&i[0], "lin", 16, 24, 0.2)
    });
    check("matmul_channels_last_shared_weight", vec![f32_input("x", &[1, 4, 5, 16])], &[1, 4, 5, 24], |b, i| {
        b.matmul_linear(&i[0], "lin", 16, 24, 0.2)
    });
    check(
        "matmul_seq_first_shared_weight_residual",
        vec![f32_input("x", &[6, 2, 16]), f32_input("r", &[6, 2, 24])],
        &[6, 2, 24],
        |b, i| {
            let y = b.matmul_linear(&i[0], "lin", 16, 24, 0.2);
            b.add(&y, &i[1])
        },
    );
    check("matmul_transposed_rows_shared_weight", vec![f32_input("x", &[5, 4, 16])], &[4, 5, 24], |b, i| {
        let t = b.transpose(&i[0], &[1, 0, 2]);
        b.matmul_linear(&t, "lin", 16, 24, 0.2)
    });
    check(
        "einsum_attention_scores",
        vec![f32_input("q", &[2, 3, 4, 8]), f32_input("k", &[2, 3, 5, 8])],
        &[2, 3, 4, 5],
        |b, i| b.node("Einsum", "e", &[&i[0], &i[1]], vec![("equation", Attr::Str("bhqd,bhkd->bhqk"))]),
    );
}

#[test]
fn elementwise_arithmetic_and_activations() {
    let x = || vec![f32_input("x", &[2, 3, 4]), f32_input("z", &[3, 1])];
    for op in ["Add", "Sub", "Mul", "Div"] {
        check(&format!("binary_{op}"), x(), &[2, 3, 4], |b, i| b.node(op, "", &[&i[0], &i[1]], vec![]));
    }
    check("pow_sqrt", vec![f32_input("x", &[4, 5])], &[4, 5], |b, i| {
        let s = b.node("Mul", "", &[&i[0], &i[0]], vec![]);
        let one = b.const_f32_scalar(1.0);
        let a = b.add(&s, &one);
        let r = b.node("Sqrt", "", &[&a], vec![]);
        let e = b.const_f32_scalar(1.5);
        b.node("Pow", "", &[&r, &e], vec![])
    });
    for act in ["Relu", "Sigmoid", "Tanh", "Erf", "HardSwish"] {
        check(&format!("unary_{act}"), vec![f32_input("x", &[3, 7])], &[3, 7], |b, i| b.node(act, "", &[&i[0]], vec![]));
    }
    check("clip_relu6", vec![f32_input("x", &[3, 7])], &[3, 7], |b, i| {
        let s = b.const_f32_scalar(4.0);
        let m = b.mul(&i[0], &s);
        b.relu6(&m)
    });
    check_opset("gelu_op", 20, vec![f32_input("x", &[3, 7])], &[3, 7], |b, i| b.node("Gelu", "", &[&i[0]], vec![]));
    check("gelu_tanh_decomposed", vec![f32_input("x", &[3, 7])], &[3, 7], |b, i| b.gelu_tanh(&i[0]));
}

#[test]
fn pooling() {
    check("maxpool_pad", vec![f32_input("x", &[1, 3, 9, 9])], &[1, 3, 5, 5], |b, i| b.maxpool(&i[0], 3, 2, 1, false));
    check("maxpool_ceil", vec![f32_input("x", &[1, 3, 10, 10])], &[1, 3, 5, 5], |b, i| b.maxpool(&i[0], 3, 2, 0, true));
    check("avgpool_include_pad", vec![f32_input("x", &[1, 4, 8, 8])], &[1, 4, 8, 8], |b, i| b.avgpool(&i[0], 3, 1, 1, true));
    check("avgpool_exclude_pad", vec![f32_input("x", &[1, 4, 8, 8])], &[1, 4, 8, 8], |b, i| b.avgpool(&i[0], 3, 1, 1, false));
    check("global_avgpool", vec![f32_input("x", &[2, 6, 5, 5])], &[2, 6, 1, 1], |b, i| b.global_avgpool(&i[0]));
}

#[test]
fn reductions_norms_softmax() {
    check("reduce_mean_keepdims", vec![f32_input("x", &[2, 3, 8])], &[2, 1, 8], |b, i| {
        b.node("ReduceMean", "", &[&i[0]], vec![("axes", Attr::Ints(vec![1])), ("keepdims", Attr::Int(1))])
    });
    check("layernorm_op", vec![f32_input("x", &[2, 5, 16])], &[2, 5, 16], |b, i| b.layer_norm_op(&i[0], "ln", 16, 1e-5));
    check("layernorm_decomposed", vec![f32_input("x", &[2, 5, 16])], &[2, 5, 16], |b, i| {
        b.layer_norm_decomposed(&i[0], "ln", 16, 1e-5)
    });
    check("softmax_last", vec![f32_input("x", &[2, 3, 10])], &[2, 3, 10], |b, i| b.softmax(&i[0], -1));
    check("softmax_middle_axis", vec![f32_input("x", &[2, 3, 10])], &[2, 3, 10], |b, i| b.softmax(&i[0], 1));
    check("batchnorm_standalone", vec![f32_input("x", &[2, 4, 3, 3])], &[2, 4, 3, 3], |b, i| {
        b.bn(&i[0], "bn", 4, 1e-5, (0.5, 1.5))
    });
}

#[test]
fn shapes_and_layouts() {
    check("concat_channels", vec![f32_input("a", &[1, 3, 4, 4]), f32_input("b", &[1, 5, 4, 4])], &[1, 8, 4, 4], |b, i| {
        let c1 = b.conv(&i[0], "c1", 3, 4, (3, 3), 1, (1, 1), 1, true);
        b.concat(&[&c1, &i[1]], 1)
    });
    check("flatten_gemm", vec![f32_input("x", &[2, 3, 4, 4])], &[2, 5], |b, i| {
        let c = b.conv(&i[0], "c", 3, 6, (3, 3), 1, (1, 1), 1, true);
        let f = b.flatten(&c);
        b.gemm_linear(&f, "fc", 96, 5)
    });
    check("reshape_transpose_squeeze_unsqueeze", vec![f32_input("x", &[2, 12])], &[3, 2, 4], |b, i| {
        let r = b.reshape(&i[0], &[2, 3, 4]);
        let t = b.transpose(&r, &[1, 0, 2]);
        let axes = b.const_i64(&[0]);
        let u = b.node("Unsqueeze", "", &[&t, &axes], vec![]);
        let s = b.node("Squeeze", "", &[&u, &axes], vec![]);
        let one = b.const_f32_scalar(1.0);
        b.add(&s, &one)
    });
}

#[test]
fn embeddings_and_folded_shape_subgraphs() {
    let ids = Input { name: "ids", dtype: DType::I64, shape: vec![2, 6], range: 50 };
    check("gather_embedding", vec![ids], &[2, 6, 16], |b, i| {
        let table = b.uniform("emb", &[50, 16], 1.0);
        b.node("Gather", "", &[&table, &i[0]], vec![("axis", Attr::Int(0))])
    });
    // Shape -> ConstantOfShape -> Equal -> Where -> Cast -> Expand, all folded with a fixed input shape.
    let ids = Input { name: "ids", dtype: DType::I64, shape: vec![2, 6], range: 50 };
    check("shape_mask_subgraph", vec![ids], &[2, 6, 16], |b, i| {
        let table = b.uniform("emb", &[50, 16], 1.0);
        let e = b.node("Gather", "", &[&table, &i[0]], vec![("axis", Attr::Int(0))]);
        let shape = b.node("Shape", "", &[&i[0]], vec![]);
        let ones = b.node("ConstantOfShape", "", &[&shape], vec![("value", Attr::Tensor(Tensor::i64(vec![1], vec![1])))]);
        let zero = b.const_i64(&[0]);
        let eq = b.node("Equal", "", &[&ones, &zero], vec![]);
        let big = b.const_f32_scalar(-5.0);
        let small = b.const_f32_scalar(0.5);
        let w = b.node("Where", "", &[&eq, &big, &small], vec![]);
        let c = b.node("Cast", "", &[&w], vec![("to", Attr::Int(1))]);
        let axes = b.const_i64(&[2]);
        let u = b.node("Unsqueeze", "", &[&c, &axes], vec![]);
        let target = b.const_i64(&[2, 6, 16]);
        let x = b.node("Expand", "", &[&u, &target], vec![]);
        b.add(&e, &x)
    });
}

#[test]
fn causal_attention_block() {
    // GPT-style: scores / sqrt(d), causal Where, softmax, times V.
    check(
        "causal_attention",
        vec![f32_input("q", &[1, 2, 6, 8]), f32_input("k", &[1, 2, 6, 8]), f32_input("v", &[1, 2, 6, 8])],
        &[1, 2, 6, 8],
        |b, i| {
            let kt = b.transpose(&i[1], &[0, 1, 3, 2]);
            let s = b.node("MatMul", "", &[&i[0], &kt], vec![]);
            let scale = b.const_f32_scalar(8f32.sqrt());
            let s = b.node("Div", "", &[&s, &scale], vec![]);
            let tri: Vec<bool> = (0..36).map(|j| j % 6 <= j / 6).collect();
            let m = b.init_bool("mask", &[1, 1, 6, 6], &tri);
            let neg = b.const_f32_scalar(f32::MIN);
            let s = b.node("Where", "", &[&m, &s, &neg], vec![]);
            let p = b.softmax(&s, -1);
            b.node("MatMul", "", &[&p, &i[2]], vec![])
        },
    );
}

#[test]
fn isnan_guarded_softmax() {
    // The guard exporters put after an attention softmax (Softmax -> IsNaN -> Where): a fully masked
    // row (-inf everywhere) makes its softmax row NaN, and the guard turns it into zeros.
    let masked_softmax = |b: &mut OnnxBuilder, x: &str| {
        let mut mask = vec![0f32; 32];
        for v in &mut mask[8..16] {
            *v = f32::NEG_INFINITY;
        }
        let m = b.init("mask", &Tensor::f32(vec![4, 8], mask));
        let s = b.node("Add", "", &[x, &m], vec![]);
        b.softmax(&s, -1)
    };
    // The flags themselves (a row of ones where tract sees NaN: the guard is exercised, not idle).
    let flags = check("isnan_flags", vec![f32_input("x", &[4, 8])], &[4, 8], |b, i| {
        let p = masked_softmax(b, &i[0]);
        let nan = b.node("IsNaN", "", &[&p], vec![]);
        b.node("Cast", "", &[&nan], vec![("to", Attr::Int(1))])
    });
    assert_eq!(flags.to_f32_vec().iter().sum::<f32>(), 8.0, "tract flags exactly the masked row");
    check("isnan_guarded_softmax", vec![f32_input("x", &[4, 8])], &[4, 8], |b, i| {
        let p = masked_softmax(b, &i[0]);
        let nan = b.node("IsNaN", "", &[&p], vec![]);
        let zero = b.const_f32_scalar(0.0);
        b.node("Where", "", &[&nan, &zero, &p], vec![])
    });
}

/// Two attention layers as the TorchScript exporter writes PyTorch's scaled-dot-product attention
/// with a padding mask: queries and keys each times the fourth root of 1 / d, the additive mask
/// (Where on the padding mask) built again in every layer, Softmax -> IsNaN -> Where.
fn sdpa_export_body(b: &mut OnnxBuilder, i: &[String]) -> String {
    let pad = b.const_i64(&[0]);
    let masked = b.node("Equal", "", &[&i[3], &pad], vec![]);
    let shape = b.const_i64(&[1, 1, 1, 6]);
    let masked = b.node("Reshape", "", &[&masked, &shape], vec![]);
    let mut x = i[0].clone();
    for layer in 0..2 {
        let root = b.const_f32_scalar(8f32.powf(-0.25));
        let q = b.mul(&x, &root);
        // Keys: the input in the first layer, the first layer's output in the second.
        let kt = b.transpose(if layer == 0 { &i[1] } else { &x }, &[0, 1, 3, 2]);
        let root2 = b.const_f32_scalar(8f32.powf(-0.25));
        let kt = b.mul(&kt, &root2);
        let s = b.node("MatMul", &format!("scores{layer}"), &[&q, &kt], vec![]);
        let (zero, neg) = (b.const_f32_scalar(0.0), b.const_f32_scalar(f32::NEG_INFINITY));
        let add_mask = b.node("Where", "", &[&masked, &neg, &zero], vec![]);
        let s = b.node("Add", "", &[&s, &add_mask], vec![]);
        let p = b.softmax(&s, -1);
        let nan = b.node("IsNaN", "", &[&p], vec![]);
        let zero = b.const_f32_scalar(0.0);
        let p = b.node("Where", "", &[&nan, &zero, &p], vec![]);
        x = b.node("MatMul", "", &[&p, &i[2]], vec![]);
    }
    x
}

#[test]
fn sdpa_export_attention_fuses_and_matches() {
    let inputs = || {
        vec![
            f32_input("q", &[1, 2, 6, 8]),
            f32_input("k", &[1, 2, 6, 8]),
            f32_input("v", &[1, 2, 6, 8]),
            Input { name: "keep", dtype: DType::I64, shape: vec![1, 6], range: 2 },
        ]
    };
    check("sdpa_export_attention", inputs(), &[1, 2, 6, 8], sdpa_export_body);
    // Lowered: per layer the scores product (both scales as its alpha, the mask as its residual,
    // broadcast over heads and queries), the softmax (the NaN guard in it) and the product with V;
    // the additive mask is built once. Unfused: 2 scalings, mask, add, IsNaN and Where per layer.
    let plan = lowered("sdpa_export_attention", 17, &inputs(), &[1, 2, 6, 8], DType::F16, sdpa_export_body);
    let launches = launch_lines(&plan, |_| None);
    let count = |kind: &str| plan.launches.iter().filter(|l| l.kernel.name() == kind).count();
    assert_eq!((count("gemm"), count("softmax")), (4, 2), "{launches:#?}");
    let scores: Vec<_> = plan
        .launches
        .iter()
        .filter_map(|l| match &l.kernel {
            kairos_ir::plan::Kernel::Gemm(p) if l.name.starts_with("scores") => Some(p),
            _ => None,
        })
        .collect();
    assert_eq!(scores.len(), 2, "{launches:#?}");
    for p in scores {
        assert!((p.alpha - 8f32.powf(-0.5)).abs() < 1e-6 && p.epilogue.residual, "scores product: {p:?} {launches:#?}");
    }
    assert!(
        plan.launches.iter().all(|l| match &l.kernel {
            kairos_ir::plan::Kernel::Softmax(p) => p.zero_nan,
            _ => true,
        }),
        "{launches:#?}"
    );
    // Besides the fp16 conversions of the fp32 inputs and output: the mask (Equal, Where) only.
    assert_eq!(computing_eltwise(&plan), 2, "element-wise launches: {launches:#?}");
}

/// 0/1 outputs of a boolean graph, as floats (the cast exporters write before arithmetic).
fn as_float(b: &mut OnnxBuilder, x: &str) -> String {
    b.node("Cast", "", &[x], vec![("to", Attr::Int(1))])
}

#[test]
fn comparisons_and_logic_at_run_time() {
    // Masks built from token ids and values at run time (nothing folds): Equal, Less, Greater,
    // their negations, And, Or, Xor, Not, each weighted so a wrong bit shows in the output.
    let ids = Input { name: "ids", dtype: DType::I64, shape: vec![2, 8], range: 4 };
    check("comparisons_logic", vec![ids, f32_input("x", &[2, 8]), f32_input("z", &[2, 8])], &[2, 8], |b, i| {
        let two = b.const_i64(&[2]);
        let eq = b.node("Equal", "", &[&i[0], &two], vec![]);
        let lt = b.node("Less", "", &[&i[1], &i[2]], vec![]);
        let zero = b.const_f32_scalar(0.0);
        let gt = b.node("Greater", "", &[&i[1], &zero], vec![]);
        let ge = b.node("GreaterOrEqual", "", &[&i[2], &zero], vec![]);
        let le = b.node("LessOrEqual", "", &[&i[1], &i[2]], vec![]);
        let not_gt = b.node("Not", "", &[&gt], vec![]);
        let and = b.node("And", "", &[&lt, &not_gt], vec![]);
        let or = b.node("Or", "", &[&eq, &ge], vec![]);
        let xor = b.node("Xor", "", &[&le, &eq], vec![]);
        let mut acc = as_float(b, &and);
        for (k, term) in [or, xor, ge, le].iter().enumerate() {
            let f = as_float(b, term);
            let w = b.const_f32_scalar((2 << k) as f32);
            let f = b.node("Mul", "", &[&f, &w], vec![]);
            acc = b.add(&acc, &f);
        }
        acc
    });
}

#[test]
fn position_ids_by_cumulative_sum() {
    // RoBERTa's position ids: non-padding tokens counted along the sequence (CumSum of an int
    // mask), times the mask, plus the padding index, then looked up; exclusive and reversed sums too.
    let ids = Input { name: "ids", dtype: DType::I64, shape: vec![2, 7], range: 3 };
    check("cumsum_positions", vec![ids, f32_input("x", &[2, 7])], &[2, 7, 4], |b, i| {
        let pad = b.const_i64(&[1]);
        let is_pad = b.node("Equal", "", &[&i[0], &pad], vec![]);
        let keep = b.node("Not", "", &[&is_pad], vec![]);
        // (tract, the oracle here, cannot sum an int64 mask: summed as floats, cast back to int64 for
        // the lookup; RoBERTa's int64 form is checked against onnxruntime in the exporter corpus.)
        let mask = as_float(b, &keep);
        let axis = b.init("axis", &Tensor::i64(vec![], vec![1]));
        let counted = b.node("CumSum", "", &[&mask, &axis], vec![]);
        let counted = b.node("Mul", "", &[&counted, &mask], vec![]);
        let one = b.const_f32_scalar(1.0);
        let positions = b.node("Add", "", &[&counted, &one], vec![]);
        let positions = b.node("Cast", "", &[&positions], vec![("to", Attr::Int(7))]);
        let table = b.uniform("positions", &[9, 4], 1.0);
        let emb = b.node("Gather", "", &[&table, &positions], vec![("axis", Attr::Int(0))]);
        let excl = b.node("CumSum", "", &[&i[1], &axis], vec![("exclusive", Attr::Int(1))]);
        let rev = b.node("CumSum", "", &[&i[1], &axis], vec![("reverse", Attr::Int(1))]);
        let both = b.add(&excl, &rev);
        let axes = b.const_i64(&[2]);
        let both = b.node("Unsqueeze", "", &[&both, &axes], vec![]);
        b.add(&emb, &both)
    });
}

#[test]
fn gathers_of_constant_and_run_time_indices() {
    // GatherND with constant index tuples, GatherND with tuples computed from an input (CLIP's
    // end-token pick), Gather of a few and of many constant indices from a computed tensor,
    // GatherElements of a constant table, and ArgMax.
    let sel = Input { name: "sel", dtype: DType::I64, shape: vec![3, 2], range: 2 };
    check("gathers", vec![f32_input("x", &[2, 3, 4]), sel], &[3, 4], |b, i| {
        let x = b.node("Relu", "", &[&i[0]], vec![]);
        let x = b.add(&x, &i[0]); // a computed tensor, not an input
        let tuples = b.init("tuples", &Tensor::i64(vec![3, 2], vec![0, 1, 1, 2, 1, 0]));
        let fixed = b.node("GatherND", "", &[&x, &tuples], vec![]);
        let picked = b.node("GatherND", "", &[&x, &i[1]], vec![]);
        let y = b.add(&fixed, &picked);
        // Gather along axis 2 of a [3, 4] view: 2 indices (slices), then 6 scattered (one lookup).
        let flat = b.reshape(&x, &[6, 4]);
        let few = b.init("few", &Tensor::i64(vec![4], vec![3, 0, 1, 2]));
        let g = b.node("Gather", "", &[&flat, &few], vec![("axis", Attr::Int(1))]);
        let many: Vec<i64> = vec![5, 0, 3, 1, 4, 2, 0, 5, 1, 3, 2, 4];
        let many_idx = b.init("many", &Tensor::i64(vec![12], many));
        let rows = b.node("Gather", "", &[&g, &many_idx], vec![("axis", Attr::Int(0))]);
        let rows = b.reshape(&rows, &[3, 4, 4]);
        let axes = b.const_i64(&[1]);
        let red = b.node("ReduceSum", "", &[&rows, &axes], vec![("keepdims", Attr::Int(0))]);
        let y = b.add(&y, &red);
        // ArgMax over each row of x's first plane, as a float, broadcast over columns.
        let plane = b.reshape(&x, &[6, 4]);
        let arg = b.node("ArgMax", "", &[&plane], vec![("axis", Attr::Int(1)), ("keepdims", Attr::Int(1))]);
        let arg = as_float(b, &arg);
        let arg = b.reshape(&arg, &[2, 3, 1]);
        let first = b.const_i64(&[0]);
        let arg = b.node("ReduceSum", "", &[&arg, &first], vec![("keepdims", Attr::Int(0))]);
        let y = b.add(&y, &arg);
        // GatherElements of a constant [1, 5] table by run-time positions.
        let table = b.init("table", &Tensor::f32(vec![1, 5], vec![0.5, -1.0, 2.0, 0.25, 3.0]));
        let pos = b.node("Concat", "", &[&i[1], &i[1]], vec![("axis", Attr::Int(1))]);
        let pos = b.reshape(&pos, &[1, 12]);
        let ge = b.node("GatherElements", "", &[&table, &pos], vec![("axis", Attr::Int(1))]);
        let ge = b.reshape(&ge, &[3, 4]);
        b.add(&y, &ge)
    });
}

#[test]
fn pads_and_strided_slices() {
    // Constant Pad (value 0.5) on two axes, then every other row and column from an odd start
    // (Swin's patch merging) and a reversed slice.
    check("pad_strided", vec![f32_input("x", &[1, 2, 5, 6])], &[1, 2, 4, 3], |b, i| {
        let pads = b.const_i64(&[0, 0, 1, 0, 0, 0, 2, 1]);
        let value = b.const_f32_scalar(0.5);
        let p = b.node("Pad", "", &[&i[0], &pads, &value], vec![]); // [1, 2, 8, 7]
        let starts = b.const_i64(&[1, 0]);
        let ends = b.const_i64(&[8, 7]);
        let axes = b.const_i64(&[2, 3]);
        let steps = b.const_i64(&[2, 2]);
        let s = b.node("Slice", "", &[&p, &starts, &ends, &axes, &steps], vec![]); // [1, 2, 4, 4]
        let rs = b.const_i64(&[-1]);
        let re = b.const_i64(&[i64::MIN]);
        let ra = b.const_i64(&[3]);
        let rstep = b.const_i64(&[-1]);
        let r = b.node("Slice", "", &[&s, &rs, &re, &ra, &rstep], vec![]); // reversed columns
        let sum = b.add(&s, &r);
        let st = b.const_i64(&[0]);
        let en = b.const_i64(&[3]);
        let ax = b.const_i64(&[3]);
        b.node("Slice", "", &[&sum, &st, &en, &ax], vec![])
    });
}

#[test]
fn onnx_attention_op_with_masks() {
    // The opset-23 Attention op (what the dynamo exporter writes for scaled_dot_product_attention):
    // an additive padding mask over keys, and the causal form. (tract's own attention takes float
    // masks only, so a boolean mask is checked through the exporter corpus.)
    let inputs = || vec![f32_input("q", &[2, 2, 5, 8]), f32_input("k", &[2, 2, 5, 8]), f32_input("v", &[2, 2, 5, 8])];
    check_opset("attention_mask", 23, inputs(), &[2, 2, 5, 8], |b, i| {
        // Batch 1 masks its last two keys, for every head and query.
        let bias: Vec<f32> = (0..100).map(|j| if j >= 50 && j % 5 >= 3 { -1e4 } else { 0.0 }).collect();
        let m = b.init("mask", &Tensor::f32(vec![2, 2, 5, 5], bias));
        b.node("Attention", "", &[&i[0], &i[1], &i[2], &m], vec![])
    });
    check_opset("attention_causal", 23, inputs(), &[2, 2, 5, 8], |b, i| {
        b.node("Attention", "", &[&i[0], &i[1], &i[2]], vec![("is_causal", Attr::Int(1))])
    });
}
