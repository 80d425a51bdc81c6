//! The ONNX front door's contract with users: bad files are errors (never panics), unsupported ops
//! are named with their node and model, dynamic dimensions get values or a clear error, and every
//! zoo model is a file tract can load.

use kairos_ir::Error;
use kairos_ir::onnx::{LoadOptions, load_bytes};
use kairos_ir::zoo::builder::OnnxBuilder;
use kairos_ir::zoo::{ZOO, ZooOptions};
use kairos_ir::{DType, Tensor};

fn tiny_model() -> Vec<u8> {
    let mut b = OnnxBuilder::new("tiny", 13, 1);
    let x = b.input("x", DType::F32, &[1, 3, 8, 8]);
    let c = b.conv(&x, "conv", 3, 4, (3, 3), 1, (1, 1), 1, true);
    let r = b.relu(&c);
    b.output(&r, "y", DType::F32, &[1, 4, 8, 8]);
    b.finish_bytes()
}

#[test]
fn truncated_and_garbage_files_are_errors_not_panics() {
    let bytes = tiny_model();
    for cut in [0, 1, 7, bytes.len() / 3, bytes.len() / 2, bytes.len() - 1] {
        match load_bytes("tiny", &bytes[..cut], &LoadOptions::default()) {
            Err(Error::Malformed { .. }) | Err(Error::Invalid(_)) => {}
            Err(e) => panic!("cut at {cut}: unexpected error kind: {e}"),
            Ok(_) if cut == 0 => panic!("an empty file loaded"),
            Ok(g) => assert!(!g.nodes.is_empty(), "cut at {cut} loaded an empty graph"),
        }
    }
    let mut s = 0x9e3779b97f4a7c15u64;
    for len in [3usize, 64, 1000, 100_000] {
        let garbage: Vec<u8> = (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        assert!(load_bytes("garbage", &garbage, &LoadOptions::default()).is_err(), "{len} random bytes loaded as a model");
    }
}

#[test]
fn unsupported_op_names_the_op_the_node_and_the_model() {
    let mut b = OnnxBuilder::new("has_lstm", 13, 1);
    let x = b.input("x", DType::F32, &[1, 3, 8]);
    let y = b.node("NoSuchOp", "weird_node", &[&x], vec![]);
    b.output(&y, "y", DType::F32, &[1, 3, 8]);
    let err = load_bytes("has_lstm", &b.finish_bytes(), &LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Unsupported { .. }), "{msg}");
    assert!(msg.contains("NoSuchOp") && msg.contains("weird_node") && msg.contains("has_lstm"), "{msg}");

    // An op tract parses but kairos has no kernel for: TopK.
    let mut b = OnnxBuilder::new("has_topk", 13, 1);
    let x = b.input("x", DType::F32, &[1, 10]);
    let k = b.const_i64(&[3]);
    b.node_multi("TopK", "top3", &[&x, &k], &["vals", "idx"], vec![]);
    b.output("vals", "y", DType::F32, &[1, 3]);
    let err = load_bytes("has_topk", &b.finish_bytes(), &LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Unsupported { .. }), "{msg}");
    assert!(msg.contains("top3") && msg.contains("has_topk"), "{msg}");
}

#[test]
fn dynamic_dims_take_batch_and_sequence_values() {
    use tract_onnx::pb;
    let mut b = OnnxBuilder::new("dyn", 13, 1);
    let x = b.input("x", DType::F32, &[1, 5]);
    let y = b.relu(&x);
    b.output(&y, "y", DType::F32, &[1, 5]);
    let mut proto = b.finish();
    // Make both input dims symbolic, as exporters with dynamic axes do.
    let g = proto.graph.as_mut().unwrap();
    for vi in [&mut g.input[0], &mut g.output[0]] {
        if let Some(pb::type_proto::Value::TensorType(t)) = vi.r#type.as_mut().unwrap().value.as_mut() {
            for (d, name) in t.shape.as_mut().unwrap().dim.iter_mut().zip(["batch", "seq"]) {
                d.value = Some(pb::tensor_shape_proto::dimension::Value::DimParam(name.into()));
            }
        }
    }
    let bytes = prost::Message::encode_to_vec(&proto);
    let err = load_bytes("dyn", &bytes, &LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("seq"), "{err}");
    let graph = load_bytes("dyn", &bytes, &LoadOptions { batch: Some(4), seq_len: Some(7) }).unwrap();
    assert_eq!(graph.nodes[graph.inputs[0].node].shape, vec![4, 7]);
}

#[test]
fn every_zoo_model_is_an_onnx_file_tract_loads() {
    use tract_onnx::prelude::*;
    for entry in ZOO {
        let bytes = kairos_ir::zoo::build(entry.name, &ZooOptions { seq_len: 16, ..Default::default() }).unwrap();
        let model = tract_onnx::onnx().model_for_read(&mut &bytes[..]).unwrap_or_else(|e| panic!("{}: {e}", entry.name));
        model.into_typed().unwrap_or_else(|e| panic!("{}: {e}", entry.name));
        let g = load_bytes(entry.name, &bytes, &LoadOptions::default()).unwrap();
        assert!(!g.outputs.is_empty());
    }
}

#[test]
fn zoo_rejects_bad_options() {
    assert!(kairos_ir::zoo::build("resnet18", &ZooOptions { batch: 0, ..Default::default() }).is_err());
    assert!(kairos_ir::zoo::build("gpt2", &ZooOptions { seq_len: 5000, ..Default::default() }).is_err());
    assert!(matches!(kairos_ir::zoo::build("no_such_net", &ZooOptions::default()), Err(Error::UnknownModel(_))));
}

#[test]
fn zoo_weights_are_seeded() {
    let a = kairos_ir::zoo::build("squeezenet1_1", &ZooOptions { seed: 3, ..Default::default() }).unwrap();
    let b = kairos_ir::zoo::build("squeezenet1_1", &ZooOptions { seed: 3, ..Default::default() }).unwrap();
    let c = kairos_ir::zoo::build("squeezenet1_1", &ZooOptions { seed: 4, ..Default::default() }).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn import_matches_tract_through_the_naive_interpreter() {
    for name in ["squeezenet1_1", "distilbert"] {
        let bytes = kairos_ir::zoo::build(name, &ZooOptions { seq_len: 8, ..Default::default() }).unwrap();
        let g = load_bytes(name, &bytes, &LoadOptions::default()).unwrap();
        let inputs: Vec<Tensor> = g
            .inputs
            .iter()
            .map(|i| {
                let n = &g.nodes[i.node];
                let len: usize = n.shape.iter().product();
                match n.dtype {
                    DType::I64 => Tensor::i64(n.shape.clone(), (0..len).map(|j| (j * 31 % 1000) as i64).collect()),
                    _ => Tensor::f32(n.shape.clone(), (0..len).map(|j| (j % 17) as f32 / 8.0 - 1.0).collect()),
                }
            })
            .collect();
        let ours = kairos_ir::interp::run(&g, &inputs);
        let theirs = kairos_ir::onnx::tract_reference(&bytes, &inputs).unwrap();
        let err = kairos_ir::tensor::relative_l2_error(&ours[0].to_f32_vec(), &theirs[0].to_f32_vec());
        assert!(err < 1e-5, "{name}: {err:.3e}");
    }
}
