//! The vision models of the zoo, as torchvision defines them (same layer shapes, random weights).

use super::builder::{Attr, OnnxBuilder};
use crate::tensor::DType;

const BN_EPS: f32 = 1e-5;
/// Scale range of ordinary BatchNorms.
const GAMMA: (f32, f32) = (0.8, 1.2);
/// Scale range of the last BatchNorm in a residual branch: keeps deep residual stacks from growing.
const GAMMA_RESIDUAL: (f32, f32) = (0.1, 0.3);

#[allow(clippy::too_many_arguments)]
fn conv_bn(
    b: &mut OnnxBuilder,
    x: &str,
    name: &str,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    gamma: (f32, f32),
) -> String {
    let c = b.conv(x, &format!("{name}.conv"), cin, cout, (k, k), stride, (k / 2, k / 2), 1, false);
    b.bn(&c, &format!("{name}.bn"), cout, BN_EPS, gamma)
}

fn classifier_input(b: &mut OnnxBuilder, batch: usize, hw: usize) -> String {
    b.input("input", DType::F32, &[batch, 3, hw, hw])
}

fn finish_classifier(mut b: OnnxBuilder, x: &str, batch: usize, features: usize) -> Vec<u8> {
    let p = b.global_avgpool(x);
    let f = b.flatten(&p);
    let y = b.gemm_linear(&f, "fc", features, 1000);
    b.output(&y, "logits", DType::F32, &[batch, 1000]);
    b.finish_bytes()
}

fn resnet_stem(b: &mut OnnxBuilder, batch: usize) -> String {
    let x = classifier_input(b, batch, 224);
    let c = b.conv(&x, "conv1", 3, 64, (7, 7), 2, (3, 3), 1, false);
    let n = b.bn(&c, "bn1", 64, BN_EPS, GAMMA);
    let r = b.relu(&n);
    b.maxpool(&r, 3, 2, 1, false)
}

pub fn resnet(depth: usize, batch: usize, seed: u64) -> Vec<u8> {
    resnet_like(&format!("resnet{depth}"), depth, 1, 64, batch, seed)
}

/// ResNeXt (torchvision's `resnext101_32x8d` is depth 101, 32 groups of width 8): ResNet's
/// bottlenecks with a grouped 3x3 convolution `groups x width_per_group x planes / 64` wide.
pub fn resnext(depth: usize, groups: usize, width_per_group: usize, batch: usize, seed: u64) -> Vec<u8> {
    resnet_like(&format!("resnext{depth}_{groups}x{width_per_group}d"), depth, groups, width_per_group, batch, seed)
}

fn resnet_like(model: &str, depth: usize, groups: usize, width_per_group: usize, batch: usize, seed: u64) -> Vec<u8> {
    let (bottleneck, blocks): (bool, [usize; 4]) = match depth {
        18 => (false, [2, 2, 2, 2]),
        34 => (false, [3, 4, 6, 3]),
        50 => (true, [3, 4, 6, 3]),
        101 => (true, [3, 4, 23, 3]),
        152 => (true, [3, 8, 36, 3]),
        _ => panic!("no resnet{depth}"),
    };
    let mut b = OnnxBuilder::new(model, 13, seed);
    let mut x = resnet_stem(&mut b, batch);
    let expansion = if bottleneck { 4 } else { 1 };
    let mut cin = 64;
    for (stage, &count) in blocks.iter().enumerate() {
        let planes = 64 << stage;
        let width = planes * width_per_group / 64 * groups;
        let cout = planes * expansion;
        for i in 0..count {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            let name = format!("layer{}.{i}", stage + 1);
            let identity = if stride != 1 || cin != cout {
                let c = b.conv(&x, &format!("{name}.downsample.0"), cin, cout, (1, 1), stride, (0, 0), 1, false);
                b.bn(&c, &format!("{name}.downsample.1"), cout, BN_EPS, GAMMA_RESIDUAL)
            } else {
                x.clone()
            };
            let y = if bottleneck {
                let c1 = b.conv(&x, &format!("{name}.conv1"), cin, width, (1, 1), 1, (0, 0), 1, false);
                let n1 = b.bn(&c1, &format!("{name}.bn1"), width, BN_EPS, GAMMA);
                let r1 = b.relu(&n1);
                let c2 = b.conv(&r1, &format!("{name}.conv2"), width, width, (3, 3), stride, (1, 1), groups, false);
                let n2 = b.bn(&c2, &format!("{name}.bn2"), width, BN_EPS, GAMMA);
                let r2 = b.relu(&n2);
                let c3 = b.conv(&r2, &format!("{name}.conv3"), width, cout, (1, 1), 1, (0, 0), 1, false);
                b.bn(&c3, &format!("{name}.bn3"), cout, BN_EPS, GAMMA_RESIDUAL)
            } else {
                let c1 = b.conv(&x, &format!("{name}.conv1"), cin, width, (3, 3), stride, (1, 1), 1, false);
                let n1 = b.bn(&c1, &format!("{name}.bn1"), width, BN_EPS, GAMMA);
                let r1 = b.relu(&n1);
                let c2 = b.conv(&r1, &format!("{name}.conv2"), width, width, (3, 3), 1, (1, 1), 1, false);
                b.bn(&c2, &format!("{name}.bn2"), width, BN_EPS, GAMMA_RESIDUAL)
            };
            let s = b.add(&y, &identity);
            x = b.relu(&s);
            cin = cout;
        }
    }
    finish_classifier(b, &x, batch, cin)
}

/// AlexNet as torchvision defines it (the variant with 64/192/384/256/256 channels); dropout is
/// the identity in inference and the adaptive 6x6 average pool is the identity at 224x224.
pub fn alexnet(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("alexnet", 13, seed);
    let x0 = classifier_input(&mut b, batch, 224);
    let c = b.conv(&x0, "features.0", 3, 64, (11, 11), 4, (2, 2), 1, true);
    let r = b.relu(&c);
    let x = b.maxpool(&r, 3, 2, 0, false);
    let c = b.conv(&x, "features.3", 64, 192, (5, 5), 1, (2, 2), 1, true);
    let r = b.relu(&c);
    let mut x = b.maxpool(&r, 3, 2, 0, false);
    let mut cin = 192;
    for (idx, cout) in [(6, 384), (8, 256), (10, 256)] {
        let c = b.conv(&x, &format!("features.{idx}"), cin, cout, (3, 3), 1, (1, 1), 1, true);
        x = b.relu(&c);
        cin = cout;
    }
    let x = b.maxpool(&x, 3, 2, 0, false);
    let f = b.flatten(&x);
    let h = b.gemm_linear(&f, "classifier.1", 256 * 6 * 6, 4096);
    let h = b.relu(&h);
    let h = b.gemm_linear(&h, "classifier.4", 4096, 4096);
    let h = b.relu(&h);
    let y = b.gemm_linear(&h, "classifier.6", 4096, 1000);
    b.output(&y, "logits", DType::F32, &[batch, 1000]);
    b.finish_bytes()
}

/// ShuffleNet V2 1.0x as torchvision defines it: stages of 4, 8 and 4 units (116, 232, 464
/// channels); a unit splits its channels in two halves (stride 1) or feeds both branches
/// (stride 2), concatenates the branches and shuffles channels in two groups (Reshape,
/// Transpose, Reshape, as PyTorch's exporter writes `channel_shuffle`).
pub fn shufflenet_v2(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("shufflenet_v2_x1_0", 13, seed);
    let x0 = classifier_input(&mut b, batch, 224);
    let c = conv_bn(&mut b, &x0, "conv1.0", 3, 24, 3, 2, GAMMA);
    let r = b.relu(&c);
    let mut x = b.maxpool(&r, 3, 2, 1, false);
    let (mut cin, mut hw) = (24, 56);
    for (stage, (units, cout)) in [(4usize, 116usize), (8, 232), (4, 464)].into_iter().enumerate() {
        let half = cout / 2;
        for u in 0..units {
            let name = format!("stage{}.{u}", stage + 2);
            let stride = if u == 0 { 2 } else { 1 };
            // branch2: 1x1, depthwise 3x3 (stride), 1x1; branch1 (stride 2 only): depthwise 3x3, 1x1.
            let branch2 = |b: &mut OnnxBuilder, x: &str, c_in: usize| -> String {
                let p = conv_bn(b, x, &format!("{name}.branch2.0"), c_in, half, 1, 1, GAMMA);
                let p = b.relu(&p);
                let d = b.conv(&p, &format!("{name}.branch2.3"), half, half, (3, 3), stride, (1, 1), half, false);
                let d = b.bn(&d, &format!("{name}.branch2.4"), half, BN_EPS, GAMMA);
                let q = conv_bn(b, &d, &format!("{name}.branch2.5"), half, half, 1, 1, GAMMA);
                b.relu(&q)
            };
            let y = if stride == 2 {
                let d = b.conv(&x, &format!("{name}.branch1.0"), cin, cin, (3, 3), 2, (1, 1), cin, false);
                let d = b.bn(&d, &format!("{name}.branch1.1"), cin, BN_EPS, GAMMA);
                let p = conv_bn(&mut b, &d, &format!("{name}.branch1.2"), cin, half, 1, 1, GAMMA);
                let p = b.relu(&p);
                let q = branch2(&mut b, &x, cin);
                b.concat(&[&p, &q], 1)
            } else {
                let (x1, x2) = (b.fresh("split_a"), b.fresh("split_b"));
                let sizes = b.const_i64(&[half as i64, half as i64]);
                b.node_multi("Split", &format!("{name}.split"), &[&x, &sizes], &[&x1, &x2], vec![("axis", Attr::Int(1))]);
                let q = branch2(&mut b, &x2, half);
                b.concat(&[&x1, &q], 1)
            };
            if stride == 2 {
                hw /= 2;
            }
            let n = batch as i64;
            let g = b.reshape(&y, &[n, 2, half as i64, hw as i64, hw as i64]);
            let t = b.transpose(&g, &[0, 2, 1, 3, 4]);
            x = b.reshape(&t, &[n, cout as i64, hw as i64, hw as i64]);
            cin = cout;
        }
    }
    let c = conv_bn(&mut b, &x, "conv5.0", cin, 1024, 1, 1, GAMMA);
    let x = b.relu(&c);
    finish_classifier(b, &x, batch, 1024)
}

pub fn mobilenet_v2(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("mobilenet_v2", 13, seed);
    let x0 = classifier_input(&mut b, batch, 224);
    let c = conv_bn(&mut b, &x0, "features.0", 3, 32, 3, 2, GAMMA);
    let mut x = b.relu6(&c);
    let settings: [(usize, usize, usize, usize); 7] =
        [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)];
    let mut cin = 32;
    let mut idx = 1;
    for (t, c, n, s) in settings {
        for i in 0..n {
            let stride = if i == 0 { s } else { 1 };
            let hidden = cin * t;
            let name = format!("features.{idx}.conv");
            let mut h = x.clone();
            if t != 1 {
                let e = conv_bn(&mut b, &h, &format!("{name}.expand"), cin, hidden, 1, 1, GAMMA);
                h = b.relu6(&e);
            }
            let d = b.conv(&h, &format!("{name}.dw.conv"), hidden, hidden, (3, 3), stride, (1, 1), hidden, false);
            let dn = b.bn(&d, &format!("{name}.dw.bn"), hidden, BN_EPS, GAMMA);
            let dr = b.relu6(&dn);
            let residual = stride == 1 && cin == c;
            let gamma = if residual { GAMMA_RESIDUAL } else { GAMMA };
            let p = conv_bn(&mut b, &dr, &format!("{name}.project"), hidden, c, 1, 1, gamma);
            x = if residual { b.add(&x, &p) } else { p };
            cin = c;
            idx += 1;
        }
    }
    let c = conv_bn(&mut b, &x, &format!("features.{idx}"), cin, 1280, 1, 1, GAMMA);
    let x = b.relu6(&c);
    finish_classifier(b, &x, batch, 1280)
}

pub fn squeezenet1_1(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("squeezenet1_1", 13, seed);
    let x0 = classifier_input(&mut b, batch, 224);
    let c = b.conv(&x0, "features.0", 3, 64, (3, 3), 2, (0, 0), 1, true);
    let r = b.relu(&c);
    let mut x = b.maxpool(&r, 3, 2, 0, true);
    let fire = |b: &mut OnnxBuilder, x: &str, idx: usize, cin: usize, s: usize, e: usize| -> String {
        let name = format!("features.{idx}");
        let sq = b.conv(x, &format!("{name}.squeeze"), cin, s, (1, 1), 1, (0, 0), 1, true);
        let sq = b.relu(&sq);
        let e1 = b.conv(&sq, &format!("{name}.expand1x1"), s, e, (1, 1), 1, (0, 0), 1, true);
        let e1 = b.relu(&e1);
        let e3 = b.conv(&sq, &format!("{name}.expand3x3"), s, e, (3, 3), 1, (1, 1), 1, true);
        let e3 = b.relu(&e3);
        b.concat(&[&e1, &e3], 1)
    };
    x = fire(&mut b, &x, 3, 64, 16, 64);
    x = fire(&mut b, &x, 4, 128, 16, 64);
    x = b.maxpool(&x, 3, 2, 0, true);
    x = fire(&mut b, &x, 6, 128, 32, 128);
    x = fire(&mut b, &x, 7, 256, 32, 128);
    x = b.maxpool(&x, 3, 2, 0, true);
    x = fire(&mut b, &x, 9, 256, 48, 192);
    x = fire(&mut b, &x, 10, 384, 48, 192);
    x = fire(&mut b, &x, 11, 384, 64, 256);
    x = fire(&mut b, &x, 12, 512, 64, 256);
    let c = b.conv(&x, "classifier.1", 512, 1000, (1, 1), 1, (0, 0), 1, true);
    let r = b.relu(&c);
    let p = b.global_avgpool(&r);
    let f = b.flatten(&p);
    b.output(&f, "logits", DType::F32, &[batch, 1000]);
    b.finish_bytes()
}

pub fn vgg19(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("vgg19", 13, seed);
    let mut x = classifier_input(&mut b, batch, 224);
    let cfg: [usize; 21] = [64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0, 512, 512, 512, 512, 0];
    let mut cin = 3;
    for (i, &c) in cfg.iter().enumerate() {
        if c == 0 {
            x = b.maxpool(&x, 2, 2, 0, false);
        } else {
            let y = b.conv(&x, &format!("features.{i}"), cin, c, (3, 3), 1, (1, 1), 1, true);
            x = b.relu(&y);
            cin = c;
        }
    }
    let f = b.flatten(&x);
    let h = b.gemm_linear(&f, "classifier.0", 512 * 7 * 7, 4096);
    let h = b.relu(&h);
    let h = b.gemm_linear(&h, "classifier.3", 4096, 4096);
    let h = b.relu(&h);
    let y = b.gemm_linear(&h, "classifier.6", 4096, 1000);
    b.output(&y, "logits", DType::F32, &[batch, 1000]);
    b.finish_bytes()
}

pub fn densenet(depth: usize, batch: usize, seed: u64) -> Vec<u8> {
    let blocks: [usize; 4] = match depth {
        121 => [6, 12, 24, 16],
        169 => [6, 12, 32, 32],
        201 => [6, 12, 48, 32],
        _ => panic!("no densenet{depth}"),
    };
    let growth = 32;
    let bn_size = 4;
    let mut b = OnnxBuilder::new(&format!("densenet{depth}"), 13, seed);
    let x0 = classifier_input(&mut b, batch, 224);
    let c = b.conv(&x0, "features.conv0", 3, 64, (7, 7), 2, (3, 3), 1, false);
    let n = b.bn(&c, "features.norm0", 64, BN_EPS, GAMMA);
    let r = b.relu(&n);
    let mut x = b.maxpool(&r, 3, 2, 1, false);
    let mut c_in = 64;
    for (bi, &count) in blocks.iter().enumerate() {
        let mut features = vec![x.clone()];
        for li in 0..count {
            let name = format!("features.denseblock{}.denselayer{}", bi + 1, li + 1);
            let cat = if features.len() == 1 {
                features[0].clone()
            } else {
                let refs: Vec<&str> = features.iter().map(|s| s.as_str()).collect();
                b.concat(&refs, 1)
            };
            let cin = c_in + li * growth;
            let n1 = b.bn(&cat, &format!("{name}.norm1"), cin, BN_EPS, GAMMA);
            let r1 = b.relu(&n1);
            let c1 = b.conv(&r1, &format!("{name}.conv1"), cin, bn_size * growth, (1, 1), 1, (0, 0), 1, false);
            let n2 = b.bn(&c1, &format!("{name}.norm2"), bn_size * growth, BN_EPS, GAMMA);
            let r2 = b.relu(&n2);
            let c2 = b.conv(&r2, &format!("{name}.conv2"), bn_size * growth, growth, (3, 3), 1, (1, 1), 1, false);
            features.push(c2);
        }
        let refs: Vec<&str> = features.iter().map(|s| s.as_str()).collect();
        x = b.concat(&refs, 1);
        c_in += count * growth;
        if bi != 3 {
            let name = format!("features.transition{}", bi + 1);
            let n = b.bn(&x, &format!("{name}.norm"), c_in, BN_EPS, GAMMA);
            let r = b.relu(&n);
            let c = b.conv(&r, &format!("{name}.conv"), c_in, c_in / 2, (1, 1), 1, (0, 0), 1, false);
            x = b.avgpool(&c, 2, 2, 0, true);
            c_in /= 2;
        }
    }
    let n = b.bn(&x, "features.norm5", c_in, BN_EPS, GAMMA);
    let x = b.relu(&n);
    finish_classifier(b, &x, batch, c_in)
}

/// Conv (no bias) + BatchNorm(eps 1e-3) + ReLU: torchvision's BasicConv2d of GoogLeNet and Inception v3.
#[allow(clippy::too_many_arguments)]
fn basic_conv(
    b: &mut OnnxBuilder,
    x: &str,
    name: &str,
    cin: usize,
    cout: usize,
    k: (usize, usize),
    stride: usize,
    pad: (usize, usize),
) -> String {
    let c = b.conv(x, &format!("{name}.conv"), cin, cout, k, stride, pad, 1, false);
    let n = b.bn(&c, &format!("{name}.bn"), cout, 1e-3, GAMMA);
    b.relu(&n)
}

pub fn googlenet(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("googlenet", 13, seed);
    let x0 = classifier_input(&mut b, batch, 224);
    let mut x = basic_conv(&mut b, &x0, "conv1", 3, 64, (7, 7), 2, (3, 3));
    x = b.maxpool(&x, 3, 2, 0, true);
    x = basic_conv(&mut b, &x, "conv2", 64, 64, (1, 1), 1, (0, 0));
    x = basic_conv(&mut b, &x, "conv3", 64, 192, (3, 3), 1, (1, 1));
    x = b.maxpool(&x, 3, 2, 0, true);
    #[allow(clippy::too_many_arguments)]
    fn inception(
        b: &mut OnnxBuilder,
        x: &str,
        name: &str,
        cin: usize,
        c1: usize,
        c3r: usize,
        c3: usize,
        c5r: usize,
        c5: usize,
        pp: usize,
    ) -> String {
        let b1 = basic_conv(b, x, &format!("{name}.branch1"), cin, c1, (1, 1), 1, (0, 0));
        let b2 = basic_conv(b, x, &format!("{name}.branch2.0"), cin, c3r, (1, 1), 1, (0, 0));
        let b2 = basic_conv(b, &b2, &format!("{name}.branch2.1"), c3r, c3, (3, 3), 1, (1, 1));
        let b3 = basic_conv(b, x, &format!("{name}.branch3.0"), cin, c5r, (1, 1), 1, (0, 0));
        let b3 = basic_conv(b, &b3, &format!("{name}.branch3.1"), c5r, c5, (3, 3), 1, (1, 1));
        let p = b.maxpool(x, 3, 1, 1, true);
        let b4 = basic_conv(b, &p, &format!("{name}.branch4.1"), cin, pp, (1, 1), 1, (0, 0));
        b.concat(&[&b1, &b2, &b3, &b4], 1)
    }
    x = inception(&mut b, &x, "inception3a", 192, 64, 96, 128, 16, 32, 32);
    x = inception(&mut b, &x, "inception3b", 256, 128, 128, 192, 32, 96, 64);
    x = b.maxpool(&x, 3, 2, 0, true);
    x = inception(&mut b, &x, "inception4a", 480, 192, 96, 208, 16, 48, 64);
    x = inception(&mut b, &x, "inception4b", 512, 160, 112, 224, 24, 64, 64);
    x = inception(&mut b, &x, "inception4c", 512, 128, 128, 256, 24, 64, 64);
    x = inception(&mut b, &x, "inception4d", 512, 112, 144, 288, 32, 64, 64);
    x = inception(&mut b, &x, "inception4e", 528, 256, 160, 320, 32, 128, 128);
    x = b.maxpool(&x, 2, 2, 0, true);
    x = inception(&mut b, &x, "inception5a", 832, 256, 160, 320, 32, 128, 128);
    x = inception(&mut b, &x, "inception5b", 832, 384, 192, 384, 48, 128, 128);
    finish_classifier(b, &x, batch, 1024)
}

pub fn inception_v3(batch: usize, seed: u64) -> Vec<u8> {
    let mut b = OnnxBuilder::new("inception_v3", 13, seed);
    let x0 = classifier_input(&mut b, batch, 299);
    let mut x = basic_conv(&mut b, &x0, "Conv2d_1a_3x3", 3, 32, (3, 3), 2, (0, 0));
    x = basic_conv(&mut b, &x, "Conv2d_2a_3x3", 32, 32, (3, 3), 1, (0, 0));
    x = basic_conv(&mut b, &x, "Conv2d_2b_3x3", 32, 64, (3, 3), 1, (1, 1));
    x = b.maxpool(&x, 3, 2, 0, false);
    x = basic_conv(&mut b, &x, "Conv2d_3b_1x1", 64, 80, (1, 1), 1, (0, 0));
    x = basic_conv(&mut b, &x, "Conv2d_4a_3x3", 80, 192, (3, 3), 1, (0, 0));
    x = b.maxpool(&x, 3, 2, 0, false);

    let incep_a = |b: &mut OnnxBuilder, x: &str, name: &str, cin: usize, pf: usize| -> String {
        let b1 = basic_conv(b, x, &format!("{name}.branch1x1"), cin, 64, (1, 1), 1, (0, 0));
        let b5 = basic_conv(b, x, &format!("{name}.branch5x5_1"), cin, 48, (1, 1), 1, (0, 0));
        let b5 = basic_conv(b, &b5, &format!("{name}.branch5x5_2"), 48, 64, (5, 5), 1, (2, 2));
        let b3 = basic_conv(b, x, &format!("{name}.branch3x3dbl_1"), cin, 64, (1, 1), 1, (0, 0));
        let b3 = basic_conv(b, &b3, &format!("{name}.branch3x3dbl_2"), 64, 96, (3, 3), 1, (1, 1));
        let b3 = basic_conv(b, &b3, &format!("{name}.branch3x3dbl_3"), 96, 96, (3, 3), 1, (1, 1));
        let p = b.avgpool(x, 3, 1, 1, true);
        let bp = basic_conv(b, &p, &format!("{name}.branch_pool"), cin, pf, (1, 1), 1, (0, 0));
        b.concat(&[&b1, &b5, &b3, &bp], 1)
    };
    x = incep_a(&mut b, &x, "Mixed_5b", 192, 32);
    x = incep_a(&mut b, &x, "Mixed_5c", 256, 64);
    x = incep_a(&mut b, &x, "Mixed_5d", 288, 64);

    // InceptionB
    {
        let name = "Mixed_6a";
        let b3 = basic_conv(&mut b, &x, &format!("{name}.branch3x3"), 288, 384, (3, 3), 2, (0, 0));
        let d = basic_conv(&mut b, &x, &format!("{name}.branch3x3dbl_1"), 288, 64, (1, 1), 1, (0, 0));
        let d = basic_conv(&mut b, &d, &format!("{name}.branch3x3dbl_2"), 64, 96, (3, 3), 1, (1, 1));
        let d = basic_conv(&mut b, &d, &format!("{name}.branch3x3dbl_3"), 96, 96, (3, 3), 2, (0, 0));
        let p = b.maxpool(&x, 3, 2, 0, false);
        x = b.concat(&[&b3, &d, &p], 1);
    }

    let incep_c = |b: &mut OnnxBuilder, x: &str, name: &str, c7: usize| -> String {
        let b1 = basic_conv(b, x, &format!("{name}.branch1x1"), 768, 192, (1, 1), 1, (0, 0));
        let s = basic_conv(b, x, &format!("{name}.branch7x7_1"), 768, c7, (1, 1), 1, (0, 0));
        let s = basic_conv(b, &s, &format!("{name}.branch7x7_2"), c7, c7, (1, 7), 1, (0, 3));
        let s = basic_conv(b, &s, &format!("{name}.branch7x7_3"), c7, 192, (7, 1), 1, (3, 0));
        let d = basic_conv(b, x, &format!("{name}.branch7x7dbl_1"), 768, c7, (1, 1), 1, (0, 0));
        let d = basic_conv(b, &d, &format!("{name}.branch7x7dbl_2"), c7, c7, (7, 1), 1, (3, 0));
        let d = basic_conv(b, &d, &format!("{name}.branch7x7dbl_3"), c7, c7, (1, 7), 1, (0, 3));
        let d = basic_conv(b, &d, &format!("{name}.branch7x7dbl_4"), c7, c7, (7, 1), 1, (3, 0));
        let d = basic_conv(b, &d, &format!("{name}.branch7x7dbl_5"), c7, 192, (1, 7), 1, (0, 3));
        let p = b.avgpool(x, 3, 1, 1, true);
        let bp = basic_conv(b, &p, &format!("{name}.branch_pool"), 768, 192, (1, 1), 1, (0, 0));
        b.concat(&[&b1, &s, &d, &bp], 1)
    };
    x = incep_c(&mut b, &x, "Mixed_6b", 128);
    x = incep_c(&mut b, &x, "Mixed_6c", 160);
    x = incep_c(&mut b, &x, "Mixed_6d", 160);
    x = incep_c(&mut b, &x, "Mixed_6e", 192);

    // InceptionD
    {
        let name = "Mixed_7a";
        let b3 = basic_conv(&mut b, &x, &format!("{name}.branch3x3_1"), 768, 192, (1, 1), 1, (0, 0));
        let b3 = basic_conv(&mut b, &b3, &format!("{name}.branch3x3_2"), 192, 320, (3, 3), 2, (0, 0));
        let s = basic_conv(&mut b, &x, &format!("{name}.branch7x7x3_1"), 768, 192, (1, 1), 1, (0, 0));
        let s = basic_conv(&mut b, &s, &format!("{name}.branch7x7x3_2"), 192, 192, (1, 7), 1, (0, 3));
        let s = basic_conv(&mut b, &s, &format!("{name}.branch7x7x3_3"), 192, 192, (7, 1), 1, (3, 0));
        let s = basic_conv(&mut b, &s, &format!("{name}.branch7x7x3_4"), 192, 192, (3, 3), 2, (0, 0));
        let p = b.maxpool(&x, 3, 2, 0, false);
        x = b.concat(&[&b3, &s, &p], 1);
    }

    let incep_e = |b: &mut OnnxBuilder, x: &str, name: &str, cin: usize| -> String {
        let b1 = basic_conv(b, x, &format!("{name}.branch1x1"), cin, 320, (1, 1), 1, (0, 0));
        let t = basic_conv(b, x, &format!("{name}.branch3x3_1"), cin, 384, (1, 1), 1, (0, 0));
        let ta = basic_conv(b, &t, &format!("{name}.branch3x3_2a"), 384, 384, (1, 3), 1, (0, 1));
        let tb = basic_conv(b, &t, &format!("{name}.branch3x3_2b"), 384, 384, (3, 1), 1, (1, 0));
        let t = b.concat(&[&ta, &tb], 1);
        let d = basic_conv(b, x, &format!("{name}.branch3x3dbl_1"), cin, 448, (1, 1), 1, (0, 0));
        let d = basic_conv(b, &d, &format!("{name}.branch3x3dbl_2"), 448, 384, (3, 3), 1, (1, 1));
        let da = basic_conv(b, &d, &format!("{name}.branch3x3dbl_3a"), 384, 384, (1, 3), 1, (0, 1));
        let db = basic_conv(b, &d, &format!("{name}.branch3x3dbl_3b"), 384, 384, (3, 1), 1, (1, 0));
        let d = b.concat(&[&da, &db], 1);
        let p = b.avgpool(x, 3, 1, 1, true);
        let bp = basic_conv(b, &p, &format!("{name}.branch_pool"), cin, 192, (1, 1), 1, (0, 0));
        b.concat(&[&b1, &t, &d, &bp], 1)
    };
    x = incep_e(&mut b, &x, "Mixed_7b", 1280);
    x = incep_e(&mut b, &x, "Mixed_7c", 2048);
    finish_classifier(b, &x, batch, 2048)
}
