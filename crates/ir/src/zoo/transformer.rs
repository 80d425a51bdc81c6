//! The transformer models of the zoo: BERT-base, DistilBERT, ALBERT-base and GPT-2, one forward pass at a given
//! sequence length, written the way PyTorch's exporters write them (including the shape and mask
//! subgraphs that fold to constants once the input shape is fixed).

use super::builder::{Attr, OnnxBuilder};
use crate::tensor::{DType, Tensor};

const STD: f32 = 0.02;

pub struct TransformerConfig {
    pub name: &'static str,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub max_positions: usize,
}

pub const BERT_BASE: TransformerConfig =
    TransformerConfig { name: "bert_base", layers: 12, hidden: 768, heads: 12, ffn: 3072, vocab: 30522, max_positions: 512 };
/// BERT-large (DeepPlan's evaluation): 24 layers, hidden 1024.
pub const BERT_LARGE: TransformerConfig =
    TransformerConfig { name: "bert_large", layers: 24, hidden: 1024, heads: 16, ffn: 4096, vocab: 30522, max_positions: 512 };
/// RoBERTa-base's shape on BERT's encoder: its 50265-token vocabulary and 514 positions (random
/// weights; position ids count from 0, not from RoBERTa's padding offset: same cost).
pub const ROBERTA_BASE: TransformerConfig =
    TransformerConfig { name: "roberta_base", layers: 12, hidden: 768, heads: 12, ffn: 3072, vocab: 50265, max_positions: 514 };
pub const DISTILBERT: TransformerConfig =
    TransformerConfig { name: "distilbert", layers: 6, hidden: 768, heads: 12, ffn: 3072, vocab: 30522, max_positions: 512 };
pub const ALBERT_BASE: TransformerConfig =
    TransformerConfig { name: "albert", layers: 12, hidden: 768, heads: 12, ffn: 3072, vocab: 30000, max_positions: 512 };
/// ALBERT's factorized embedding width.
pub const ALBERT_EMBEDDING: usize = 128;
pub const GPT2: TransformerConfig =
    TransformerConfig { name: "gpt2", layers: 12, hidden: 768, heads: 12, ffn: 3072, vocab: 50257, max_positions: 1024 };

fn embedding(b: &mut OnnxBuilder, name: &str, rows: usize, cols: usize) -> String {
    b.uniform(name, &[rows, cols], STD * 3f32.sqrt())
}

/// Position ids as exporters compute them: Range(0, Shape(ids)[1]) unsqueezed and expanded to the ids' shape.
fn position_ids(b: &mut OnnxBuilder, ids: &str) -> String {
    let shape = b.node("Shape", "", &[ids], vec![]);
    let one = b.const_i64(&[1]);
    let seq = b.node("Gather", "", &[&shape, &one], vec![("axis", Attr::Int(0))]);
    let seq_scalar = b.node("Squeeze", "", &[&seq], vec![]);
    let zero = b.init("pos_start", &Tensor::i64(vec![], vec![0]));
    let step = b.init("pos_step", &Tensor::i64(vec![], vec![1]));
    let range = b.node("Range", "", &[&zero, &seq_scalar, &step], vec![]);
    let axes0 = b.const_i64(&[0]);
    let un = b.node("Unsqueeze", "", &[&range, &axes0], vec![]);
    b.node("Expand", "", &[&un, &shape], vec![])
}

/// Splits heads: [B, S, H*D] -> [B, H, S, D].
fn split_heads(b: &mut OnnxBuilder, x: &str, batch: usize, seq: usize, heads: usize, dim: usize) -> String {
    let r = b.reshape(x, &[batch as i64, seq as i64, heads as i64, dim as i64]);
    b.transpose(&r, &[0, 2, 1, 3])
}

/// Merges heads: [B, H, S, D] -> [B, S, H*D].
fn merge_heads(b: &mut OnnxBuilder, x: &str, batch: usize, seq: usize, hidden: usize) -> String {
    let t = b.transpose(x, &[0, 2, 1, 3]);
    b.reshape(&t, &[batch as i64, seq as i64, hidden as i64])
}

/// BERT's extended attention mask from an all-ones mask of the ids' shape:
/// Where(Equal(mask, 0), -10000, 0) unsqueezed to [B, 1, 1, S]. It folds to a constant.
fn bert_mask(b: &mut OnnxBuilder, ids: &str) -> String {
    let shape = b.node("Shape", "", &[ids], vec![]);
    let ones =
        b.node("ConstantOfShape", "attention_mask", &[&shape], vec![("value", Attr::Tensor(Tensor::i64(vec![1], vec![1])))]);
    let zero = b.init("mask_zero", &Tensor::i64(vec![], vec![0]));
    let one_f = b.init("mask_one_f", &Tensor::f32(vec![], vec![1.0]));
    let is_pad = b.node("Equal", "", &[&ones, &zero], vec![]);
    let cast = b.node("Cast", "", &[&is_pad], vec![("to", Attr::Int(1))]);
    let keep = b.node("Sub", "", &[&one_f, &cast], vec![]);
    let big = b.init("mask_big", &Tensor::f32(vec![], vec![-10000.0]));
    let inv = b.node("Sub", "", &[&one_f, &keep], vec![]);
    let m = b.node("Mul", "", &[&inv, &big], vec![]);
    let axes = b.const_i64(&[1, 2]);
    b.node("Unsqueeze", "", &[&m, &axes], vec![])
}

pub fn bert(cfg: &TransformerConfig, batch: usize, seq: usize, seed: u64) -> Vec<u8> {
    assert!(seq <= cfg.max_positions, "sequence length {seq} exceeds {}'s {} positions", cfg.name, cfg.max_positions);
    let distil = cfg.name == "distilbert";
    // DistilBERT: opset 20 (Gelu op, decomposed LayerNorm, Einsum); BERT: opset 17 (LayerNormalization op, erf GELU).
    let opset = if distil { 20 } else { 17 };
    let mut b = OnnxBuilder::new(cfg.name, opset, seed);
    let (h, heads) = (cfg.hidden, cfg.heads);
    let dim = h / heads;
    let ids = b.input("input_ids", DType::I64, &[batch, seq]);
    let wte = embedding(&mut b, "embeddings.word_embeddings.weight", cfg.vocab, h);
    let wpe = embedding(&mut b, "embeddings.position_embeddings.weight", cfg.max_positions, h);
    let we = b.node("Gather", "embeddings.word", &[&wte, &ids], vec![("axis", Attr::Int(0))]);
    let pos = position_ids(&mut b, &ids);
    let pe = b.node("Gather", "embeddings.position", &[&wpe, &pos], vec![("axis", Attr::Int(0))]);
    let mut x = b.add(&we, &pe);
    if !distil {
        let tte = embedding(&mut b, "embeddings.token_type_embeddings.weight", 2, h);
        let tt = b.init("token_type_ids", &Tensor::i64(vec![batch, seq], vec![0; batch * seq]));
        let te = b.node("Gather", "embeddings.token_type", &[&tte, &tt], vec![("axis", Attr::Int(0))]);
        x = b.add(&x, &te);
    }
    let ln = |b: &mut OnnxBuilder, x: &str, name: &str| {
        if distil { b.layer_norm_decomposed(x, name, h, 1e-12) } else { b.layer_norm_op(x, name, h, 1e-12) }
    };
    x = ln(&mut b, &x, "embeddings.LayerNorm");
    let mask = if distil { None } else { Some(bert_mask(&mut b, &ids)) };
    let scale = b.init("attention_scale", &Tensor::f32(vec![], vec![(dim as f32).sqrt()]));
    for l in 0..cfg.layers {
        let p = format!("encoder.layer.{l}");
        let q = b.matmul_linear(&x, &format!("{p}.attention.query"), h, h, STD);
        let k = b.matmul_linear(&x, &format!("{p}.attention.key"), h, h, STD);
        let v = b.matmul_linear(&x, &format!("{p}.attention.value"), h, h, STD);
        let q = split_heads(&mut b, &q, batch, seq, heads, dim);
        let k = split_heads(&mut b, &k, batch, seq, heads, dim);
        let v = split_heads(&mut b, &v, batch, seq, heads, dim);
        let scores = if distil {
            b.node("Einsum", &format!("{p}.attention.scores"), &[&q, &k], vec![("equation", Attr::Str("bhqd,bhkd->bhqk"))])
        } else {
            let kt = b.transpose(&k, &[0, 1, 3, 2]);
            b.node("MatMul", &format!("{p}.attention.scores"), &[&q, &kt], vec![])
        };
        let mut scores = b.node("Div", "", &[&scores, &scale], vec![]);
        if let Some(m) = &mask {
            scores = b.add(&scores, m);
        }
        let probs = b.softmax(&scores, -1);
        let ctx = b.node("MatMul", &format!("{p}.attention.context"), &[&probs, &v], vec![]);
        let ctx = merge_heads(&mut b, &ctx, batch, seq, h);
        let o = b.matmul_linear(&ctx, &format!("{p}.attention.output.dense"), h, h, STD);
        let r = b.add(&o, &x);
        let a = ln(&mut b, &r, &format!("{p}.attention.output.LayerNorm"));
        let f = b.matmul_linear(&a, &format!("{p}.intermediate.dense"), h, cfg.ffn, STD);
        let g = if distil { b.node("Gelu", "", &[&f], vec![]) } else { b.gelu_erf(&f) };
        let o = b.matmul_linear(&g, &format!("{p}.output.dense"), cfg.ffn, h, STD);
        let r = b.add(&o, &a);
        x = ln(&mut b, &r, &format!("{p}.output.LayerNorm"));
    }
    b.output(&x, "last_hidden_state", DType::F32, &[batch, seq, h]);
    b.finish_bytes()
}

/// ALBERT-base v2 as Hugging Face's `AlbertModel` defines it: 128-wide factorized embeddings
/// projected to the 768-wide hidden size, and one transformer layer whose weights all 12 layers
/// share (the ONNX file holds them once; every layer's nodes read the same initializers), tanh GELU.
pub fn albert(batch: usize, seq: usize, seed: u64) -> Vec<u8> {
    let cfg = &ALBERT_BASE;
    assert!(seq <= cfg.max_positions, "sequence length {seq} exceeds albert's {} positions", cfg.max_positions);
    let mut b = OnnxBuilder::new("albert", 17, seed);
    let (h, heads, e) = (cfg.hidden, cfg.heads, ALBERT_EMBEDDING);
    let dim = h / heads;
    let ids = b.input("input_ids", DType::I64, &[batch, seq]);
    let wte = embedding(&mut b, "embeddings.word_embeddings.weight", cfg.vocab, e);
    let wpe = embedding(&mut b, "embeddings.position_embeddings.weight", cfg.max_positions, e);
    let tte = embedding(&mut b, "embeddings.token_type_embeddings.weight", 2, e);
    let we = b.node("Gather", "embeddings.word", &[&wte, &ids], vec![("axis", Attr::Int(0))]);
    let pos = position_ids(&mut b, &ids);
    let pe = b.node("Gather", "embeddings.position", &[&wpe, &pos], vec![("axis", Attr::Int(0))]);
    let tt = b.init("token_type_ids", &Tensor::i64(vec![batch, seq], vec![0; batch * seq]));
    let te = b.node("Gather", "embeddings.token_type", &[&tte, &tt], vec![("axis", Attr::Int(0))]);
    let x = b.add(&we, &pe);
    let x = b.add(&x, &te);
    let x = b.layer_norm_op(&x, "embeddings.LayerNorm", e, 1e-12);
    let mut x = b.matmul_linear(&x, "encoder.embedding_hidden_mapping_in", e, h, STD);
    let mask = bert_mask(&mut b, &ids);
    let scale = b.init("attention_scale", &Tensor::f32(vec![], vec![(dim as f32).sqrt()]));
    // The shared layer's weights, once.
    let p = "encoder.albert_layer_groups.0.albert_layers.0";
    let bound = STD * 3f32.sqrt();
    let dense = |b: &mut OnnxBuilder, name: &str, fin: usize, fout: usize| {
        (b.uniform(&format!("{p}.{name}.weight"), &[fin, fout], bound), b.uniform(&format!("{p}.{name}.bias"), &[fout], 0.02))
    };
    let wq = dense(&mut b, "attention.query", h, h);
    let wk = dense(&mut b, "attention.key", h, h);
    let wv = dense(&mut b, "attention.value", h, h);
    let wo = dense(&mut b, "attention.dense", h, h);
    let w1 = dense(&mut b, "ffn", h, cfg.ffn);
    let w2 = dense(&mut b, "ffn_output", cfg.ffn, h);
    let norm = |b: &mut OnnxBuilder, name: &str| {
        (b.uniform_range(&format!("{p}.{name}.weight"), &[h], 0.8, 1.2), b.uniform(&format!("{p}.{name}.bias"), &[h], 0.1))
    };
    let ln_attn = norm(&mut b, "attention.LayerNorm");
    let ln_full = norm(&mut b, "full_layer_layer_norm");
    let linear = |b: &mut OnnxBuilder, x: &str, name: &str, w: &(String, String)| {
        let y = b.node("MatMul", &format!("{name}.matmul"), &[x, &w.0], vec![]);
        b.node("Add", &format!("{name}.bias_add"), &[&y, &w.1], vec![])
    };
    let layer_norm = |b: &mut OnnxBuilder, x: &str, name: &str, w: &(String, String)| {
        b.node("LayerNormalization", name, &[x, &w.0, &w.1], vec![("axis", Attr::Int(-1)), ("epsilon", Attr::Float(1e-12))])
    };
    for l in 0..cfg.layers {
        let n = format!("encoder.layer.{l}");
        let q = linear(&mut b, &x, &format!("{n}.query"), &wq);
        let k = linear(&mut b, &x, &format!("{n}.key"), &wk);
        let v = linear(&mut b, &x, &format!("{n}.value"), &wv);
        let q = split_heads(&mut b, &q, batch, seq, heads, dim);
        let k = split_heads(&mut b, &k, batch, seq, heads, dim);
        let v = split_heads(&mut b, &v, batch, seq, heads, dim);
        let kt = b.transpose(&k, &[0, 1, 3, 2]);
        let scores = b.node("MatMul", &format!("{n}.scores"), &[&q, &kt], vec![]);
        let scores = b.node("Div", "", &[&scores, &scale], vec![]);
        let scores = b.add(&scores, &mask);
        let probs = b.softmax(&scores, -1);
        let ctx = b.node("MatMul", &format!("{n}.context"), &[&probs, &v], vec![]);
        let ctx = merge_heads(&mut b, &ctx, batch, seq, h);
        let o = linear(&mut b, &ctx, &format!("{n}.attention_dense"), &wo);
        let r = b.add(&o, &x);
        let a = layer_norm(&mut b, &r, &format!("{n}.attention_norm"), &ln_attn);
        let f = linear(&mut b, &a, &format!("{n}.ffn"), &w1);
        let g = b.gelu_tanh(&f);
        let o = linear(&mut b, &g, &format!("{n}.ffn_output"), &w2);
        let r = b.add(&o, &a);
        x = layer_norm(&mut b, &r, &format!("{n}.full_norm"), &ln_full);
    }
    b.output(&x, "last_hidden_state", DType::F32, &[batch, seq, h]);
    b.finish_bytes()
}

pub fn gpt2(batch: usize, seq: usize, seed: u64) -> Vec<u8> {
    let cfg = &GPT2;
    assert!(seq <= cfg.max_positions, "sequence length {seq} exceeds gpt2's {} positions", cfg.max_positions);
    let mut b = OnnxBuilder::new("gpt2", 17, seed);
    let (h, heads) = (cfg.hidden, cfg.heads);
    let dim = h / heads;
    let ids = b.input("input_ids", DType::I64, &[batch, seq]);
    let wte = embedding(&mut b, "wte.weight", cfg.vocab, h);
    let wpe = embedding(&mut b, "wpe.weight", cfg.max_positions, h);
    let we = b.node("Gather", "wte", &[&wte, &ids], vec![("axis", Attr::Int(0))]);
    let pos = position_ids(&mut b, &ids);
    let pe = b.node("Gather", "wpe", &[&wpe, &pos], vec![("axis", Attr::Int(0))]);
    let mut x = b.add(&we, &pe);
    // The causal mask: a lower-triangular boolean constant; masked scores become the most negative float.
    let tri: Vec<bool> = (0..seq * seq).map(|i| i % seq <= i / seq).collect();
    let causal = b.init_bool("causal_mask", &[1, 1, seq, seq], &tri);
    let neg = b.init("mask_value", &Tensor::f32(vec![], vec![f32::MIN]));
    let scale = b.init("attention_scale", &Tensor::f32(vec![], vec![(dim as f32).sqrt()]));
    let split_sizes = b.const_i64(&[h as i64, h as i64, h as i64]);
    for l in 0..cfg.layers {
        let p = format!("h.{l}");
        let a = b.layer_norm_op(&x, &format!("{p}.ln_1"), h, 1e-5);
        let qkv = b.matmul_linear(&a, &format!("{p}.attn.c_attn"), h, 3 * h, STD);
        let (q, k, v) = (format!("{p}.q"), format!("{p}.k"), format!("{p}.v"));
        b.node_multi("Split", &format!("{p}.attn.split"), &[&qkv, &split_sizes], &[&q, &k, &v], vec![("axis", Attr::Int(2))]);
        let q = split_heads(&mut b, &q, batch, seq, heads, dim);
        let k = split_heads(&mut b, &k, batch, seq, heads, dim);
        let v = split_heads(&mut b, &v, batch, seq, heads, dim);
        let kt = b.transpose(&k, &[0, 1, 3, 2]);
        let s = b.node("MatMul", &format!("{p}.attn.scores"), &[&q, &kt], vec![]);
        let s = b.node("Div", "", &[&s, &scale], vec![]);
        let s = b.node("Where", "", &[&causal, &s, &neg], vec![]);
        let pr = b.softmax(&s, -1);
        let c = b.node("MatMul", &format!("{p}.attn.context"), &[&pr, &v], vec![]);
        let c = merge_heads(&mut b, &c, batch, seq, h);
        let o = b.matmul_linear(&c, &format!("{p}.attn.c_proj"), h, h, STD);
        x = b.add(&x, &o);
        let m = b.layer_norm_op(&x, &format!("{p}.ln_2"), h, 1e-5);
        let f = b.matmul_linear(&m, &format!("{p}.mlp.c_fc"), h, cfg.ffn, STD);
        let g = b.gelu_tanh(&f);
        let o = b.matmul_linear(&g, &format!("{p}.mlp.c_proj"), cfg.ffn, h, STD);
        x = b.add(&x, &o);
    }
    let x = b.layer_norm_op(&x, "ln_f", h, 1e-5);
    let wte_t = b.transpose(&wte, &[1, 0]);
    let logits = b.node("MatMul", "lm_head", &[&x, &wte_t], vec![]);
    b.output(&logits, "logits", DType::F32, &[batch, seq, cfg.vocab]);
    b.finish_bytes()
}
