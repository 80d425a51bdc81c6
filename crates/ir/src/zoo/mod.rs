//! The model zoo: the architectures of the papers' experiments with seeded random weights, built as
//! ONNX so the same front door loads them and user files.

pub mod builder;
pub mod transformer;
pub mod vision;

/// The seed zoo weights use unless told otherwise.
pub const DEFAULT_SEED: u64 = 0x6b61_6972_6f73;
/// Sequence length of the transformer models unless told otherwise.
pub const DEFAULT_SEQ_LEN: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZooKind {
    /// An image classifier on [batch, 3, resolution, resolution] f32 input.
    Vision { resolution: usize },
    /// A transformer on [batch, seq] i64 token ids.
    Transformer,
}

#[derive(Clone, Copy, Debug)]
pub struct ZooEntry {
    pub name: &'static str,
    pub kind: ZooKind,
    pub description: &'static str,
}

pub const ZOO: &[ZooEntry] = &[
    ZooEntry { name: "resnet18", kind: ZooKind::Vision { resolution: 224 }, description: "ResNet-18, basic blocks [2,2,2,2]" },
    ZooEntry { name: "resnet34", kind: ZooKind::Vision { resolution: 224 }, description: "ResNet-34, basic blocks [3,4,6,3]" },
    ZooEntry { name: "resnet50", kind: ZooKind::Vision { resolution: 224 }, description: "ResNet-50, bottlenecks [3,4,6,3]" },
    ZooEntry { name: "resnet101", kind: ZooKind::Vision { resolution: 224 }, description: "ResNet-101, bottlenecks [3,4,23,3]" },
    ZooEntry { name: "resnet152", kind: ZooKind::Vision { resolution: 224 }, description: "ResNet-152, bottlenecks [3,8,36,3]" },
    ZooEntry {
        name: "mobilenet_v2",
        kind: ZooKind::Vision { resolution: 224 },
        description: "MobileNetV2, inverted residuals with depthwise convolutions, ReLU6",
    },
    ZooEntry { name: "squeezenet1_1", kind: ZooKind::Vision { resolution: 224 }, description: "SqueezeNet 1.1, fire modules" },
    ZooEntry { name: "vgg19", kind: ZooKind::Vision { resolution: 224 }, description: "VGG-19 without batch norm" },
    ZooEntry { name: "densenet121", kind: ZooKind::Vision { resolution: 224 }, description: "DenseNet-121, growth 32" },
    ZooEntry { name: "densenet201", kind: ZooKind::Vision { resolution: 224 }, description: "DenseNet-201, growth 32" },
    ZooEntry {
        name: "googlenet",
        kind: ZooKind::Vision { resolution: 224 },
        description: "GoogLeNet (Inception v1), no aux heads",
    },
    ZooEntry {
        name: "inception_v3",
        kind: ZooKind::Vision { resolution: 299 },
        description: "Inception v3 at 299x299, no aux head",
    },
    ZooEntry {
        name: "alexnet",
        kind: ZooKind::Vision { resolution: 224 },
        description: "AlexNet (torchvision), five convolutions and three fully connected layers",
    },
    ZooEntry {
        name: "resnext101_32x8d",
        kind: ZooKind::Vision { resolution: 224 },
        description: "ResNeXt-101 32x8d, bottlenecks [3,4,23,3] with grouped 3x3 convolutions",
    },
    ZooEntry {
        name: "shufflenet_v2",
        kind: ZooKind::Vision { resolution: 224 },
        description: "ShuffleNet V2 1.0x, channel split and shuffle (Split, Reshape, Transpose)",
    },
    ZooEntry {
        name: "bert_base",
        kind: ZooKind::Transformer,
        description: "BERT-base encoder, 12 layers, hidden 768 (LayerNormalization op, erf GELU, folded mask subgraph)",
    },
    ZooEntry {
        name: "bert_large",
        kind: ZooKind::Transformer,
        description: "BERT-large encoder, 24 layers, hidden 1024 (DeepPlan's cold-start models)",
    },
    ZooEntry {
        name: "roberta_base",
        kind: ZooKind::Transformer,
        description: "RoBERTa-base's shape on the BERT encoder: 12 layers, 50265-token vocabulary, 514 positions",
    },
    ZooEntry {
        name: "distilbert",
        kind: ZooKind::Transformer,
        description: "DistilBERT encoder, 6 layers (decomposed LayerNorm, Gelu op, Einsum)",
    },
    ZooEntry {
        name: "albert",
        kind: ZooKind::Transformer,
        description: "ALBERT-base v2 encoder, 12 layers sharing one set of weights, 128-wide factorized embeddings",
    },
    ZooEntry {
        name: "gpt2",
        kind: ZooKind::Transformer,
        description: "GPT-2 small, 12 layers, one forward pass with causal mask and tied LM head",
    },
];

#[derive(Clone, Copy, Debug)]
pub struct ZooOptions {
    pub batch: usize,
    pub seq_len: usize,
    pub seed: u64,
}

impl Default for ZooOptions {
    fn default() -> Self {
        ZooOptions { batch: 1, seq_len: DEFAULT_SEQ_LEN, seed: DEFAULT_SEED }
    }
}

pub fn find(name: &str) -> Option<&'static ZooEntry> {
    ZOO.iter().find(|e| e.name == name)
}

/// Builds a zoo model as serialized ONNX bytes.
pub fn build(name: &str, opts: &ZooOptions) -> Result<Vec<u8>, crate::Error> {
    if opts.batch == 0 {
        return Err(crate::Error::Invalid("batch size must be at least 1".into()));
    }
    let entry = find(name).ok_or_else(|| crate::Error::UnknownModel(name.to_string()))?;
    if entry.kind == ZooKind::Transformer && opts.seq_len == 0 {
        return Err(crate::Error::Invalid("sequence length must be at least 1".into()));
    }
    let (b, s, seed) = (opts.batch, opts.seq_len, opts.seed);
    let max_positions = match name {
        "gpt2" => transformer::GPT2.max_positions,
        "roberta_base" => transformer::ROBERTA_BASE.max_positions,
        _ => transformer::BERT_BASE.max_positions,
    };
    if entry.kind == ZooKind::Transformer && s > max_positions {
        return Err(crate::Error::Invalid(format!("{name} supports sequences of at most {max_positions} tokens, not {s}")));
    }
    Ok(match name {
        "resnet18" => vision::resnet(18, b, seed),
        "resnet34" => vision::resnet(34, b, seed),
        "resnet50" => vision::resnet(50, b, seed),
        "resnet101" => vision::resnet(101, b, seed),
        "resnet152" => vision::resnet(152, b, seed),
        "mobilenet_v2" => vision::mobilenet_v2(b, seed),
        "squeezenet1_1" => vision::squeezenet1_1(b, seed),
        "vgg19" => vision::vgg19(b, seed),
        "densenet121" => vision::densenet(121, b, seed),
        "densenet201" => vision::densenet(201, b, seed),
        "googlenet" => vision::googlenet(b, seed),
        "inception_v3" => vision::inception_v3(b, seed),
        "alexnet" => vision::alexnet(b, seed),
        "resnext101_32x8d" => vision::resnext(101, 32, 8, b, seed),
        "shufflenet_v2" => vision::shufflenet_v2(b, seed),
        "bert_base" => transformer::bert(&transformer::BERT_BASE, b, s, seed),
        "bert_large" => transformer::bert(&transformer::BERT_LARGE, b, s, seed),
        "roberta_base" => transformer::bert(&transformer::ROBERTA_BASE, b, s, seed),
        "distilbert" => transformer::bert(&transformer::DISTILBERT, b, s, seed),
        "gpt2" => transformer::gpt2(b, s, seed),
        "albert" => transformer::albert(b, s, seed),
        _ => unreachable!("zoo entry {name} has no builder"),
    })
}
