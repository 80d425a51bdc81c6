//! The server end to end on the simulated GPU: every protocol answers like the CPU reference,
//! metadata and Triton's extensions, load and unload at run time, request parameters, metrics.

mod common;

use common::*;
use kairos_client::grpc::GrpcClient;
use kairos_client::rest::RestClient;
use kairos_client::shm::{ConnectOptions, ShmClient, Wait};
use kairos_client::{Code, InferOptions};
use kairos_ir::Tensor;

fn named<'a>(names: &'a [String], ts: &'a [Tensor]) -> Vec<(&'a str, &'a Tensor)> {
    names.iter().map(String::as_str).zip(ts.iter()).collect()
}

#[test]
fn every_protocol_answers_like_the_cpu_reference() {
    let s = start("answers");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let mut shm = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
    for model in MODELS {
        let names = s.input_names(model);
        for seed in 0..3 {
            let inputs = s.inputs(model, seed);
            let want = s.reference(model, &inputs);
            let outs = s.output_names(model);
            let opts = InferOptions::default();
            for binary in [true, false] {
                let r = rt.block_on(rest.infer(model, "", &named(&names, &inputs), &opts, binary)).unwrap();
                assert_eq!(r.outputs.len(), want.len());
                for (i, w) in want.iter().enumerate() {
                    let got = r.output(&outs[i]).unwrap();
                    // JSON carries shortest round-trip decimals of f32: exact too.
                    assert_same(got, w, &format!("REST {model} binary={binary} output {i}"));
                }
                assert!(r.timing.engine_ns > 0 && r.timing.gpu_ns > 0, "{:?}", r.timing);
            }
            let r = rt.block_on(grpc.infer(model, "", &named(&names, &inputs), &opts)).unwrap();
            for (i, w) in want.iter().enumerate() {
                assert_same(r.output(&outs[i]).unwrap(), w, &format!("gRPC {model} output {i}"));
            }
            let m = shm.open_model(model, "").unwrap();
            for how in [Wait::Poll, Wait::Hybrid] {
                let (got, timing) = shm.infer(&m, &inputs, how, &opts).unwrap();
                for (i, w) in want.iter().enumerate() {
                    assert_same(&got[i], w, &format!("shm {how:?} {model} output {i}"));
                }
                assert!(timing.engine_ns > 0);
            }
            let (got, _) = shm.infer_socket(&m, &inputs, &opts).unwrap();
            for (i, w) in want.iter().enumerate() {
                assert_same(&got[i], w, &format!("shm socket {model} output {i}"));
            }
        }
    }
}

#[test]
fn output_selection_and_request_ids() {
    let s = start("outputs");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let inputs = s.inputs("pair", 1);
    let want = s.reference("pair", &inputs);
    // Ask for `relu` only, as binary, with an id.
    let body = serde_json::json!({
        "id": "req-42",
        "inputs": [
            { "name": "a", "datatype": "FP32", "shape": [1, 16], "data": inputs[0].to_f32_vec() },
            { "name": "b", "datatype": "FP32", "shape": [1, 16], "data": inputs[1].to_f32_vec() },
        ],
        "outputs": [{ "name": "relu", "parameters": { "binary_data": true } }],
    });
    let reply = rt.block_on(rest.request("POST", "/v2/models/pair/infer", serde_json::to_vec(&body).unwrap(), None)).unwrap();
    assert!(reply.header_length.is_some(), "binary output means a binary response");
    let r = kairos_client::rest::decode_infer_reply(&reply).unwrap();
    assert_eq!(r.id, "req-42");
    assert_eq!(r.outputs.len(), 1);
    assert_same(r.output("relu").unwrap(), &want[1], "relu");
    // Nested JSON arrays are accepted (row-major).
    let rows: Vec<Vec<f32>> = vec![inputs[0].to_f32_vec()];
    let body = serde_json::json!({
        "inputs": [
            { "name": "b", "datatype": "FP32", "shape": [1, 16], "data": [inputs[1].to_f32_vec()] },
            { "name": "a", "datatype": "FP32", "shape": [1, 16], "data": rows },
        ],
    });
    let r = rt.block_on(rest.post_json("/v2/models/pair/versions/1/infer", &body)).unwrap();
    assert_eq!(r["model_version"], "1");
    assert_eq!(r["outputs"][0]["name"], "y");
    let y: Vec<f32> = r["outputs"][0]["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert_eq!(y, want[0].to_f32_vec());
}

#[test]
fn metadata_configuration_statistics_and_index() {
    let s = start("meta");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    assert!(rt.block_on(rest.server_live()).unwrap());
    assert!(rt.block_on(rest.server_ready()).unwrap());
    assert!(rt.block_on(grpc.server_live()).unwrap() && rt.block_on(grpc.server_ready()).unwrap());
    let sm = rt.block_on(rest.server_metadata()).unwrap();
    assert_eq!(sm["name"], "kairos");
    assert!(sm["extensions"].as_array().unwrap().iter().any(|e| e == "binary_tensor_data"));
    assert_eq!(rt.block_on(grpc.server_metadata()).unwrap().name, "kairos");
    for model in MODELS {
        let plan = s.plan(model);
        for meta in [rt.block_on(rest.model_metadata(model, "")).unwrap(), rt.block_on(grpc.model_metadata(model, "1")).unwrap()]
        {
            assert_eq!(meta.name, model);
            assert_eq!(meta.versions, vec!["1".to_string()]);
            assert_eq!(meta.inputs.len(), plan.inputs.len());
            for (m, p) in meta.inputs.iter().zip(&plan.inputs) {
                assert_eq!((m.name.as_str(), m.datatype.as_str()), (p.name.as_str(), p.dtype.kserve_name()));
                assert_eq!(m.shape, kairos_client::shape_i64(&p.shape));
            }
            assert_eq!(meta.outputs.len(), plan.outputs.len());
        }
        assert!(rt.block_on(rest.model_ready(model, "1")).unwrap());
        assert!(rt.block_on(grpc.model_ready(model, "")).unwrap());
    }
    assert!(!rt.block_on(rest.model_ready("mlp", "7")).unwrap());
    assert!(!rt.block_on(grpc.model_ready("nope", "")).unwrap());
    // Configuration: kairos' settings of the fixture configs.
    let c = rt.block_on(rest.model_config("mlp", "")).unwrap();
    assert_eq!(c["input"][0]["data_type"], "TYPE_FP32");
    assert_eq!(c["parameters"]["class"]["string_value"], "real-time");
    assert_eq!(c["parameters"]["priority_level"]["string_value"], "995");
    let c = rt.block_on(grpc.model_config("pair", "")).unwrap();
    assert_eq!(c.input.len(), 2);
    assert_eq!(c.parameters["tenant"].string_value, "3");
    assert_eq!(c.instance_group[0].count, 1);
    let c = rt.block_on(grpc.model_config("mlp_f16", "")).unwrap();
    assert_eq!(c.parameters["dtype"].string_value, "f16");
    // Statistics count requests.
    let inputs = s.inputs("mlp", 0);
    for _ in 0..3 {
        rt.block_on(rest.infer("mlp", "", &[("x", &inputs[0])], &InferOptions::default(), true)).unwrap();
    }
    let st = rt.block_on(rest.model_statistics("mlp", "")).unwrap();
    assert_eq!(st["model_stats"][0]["inference_count"], 3);
    assert_eq!(st["model_stats"][0]["inference_stats"]["success"]["count"], 3);
    assert!(st["model_stats"][0]["inference_stats"]["compute_infer"]["ns"].as_u64().unwrap() > 0);
    let st = rt.block_on(grpc.model_statistics("", "")).unwrap();
    assert_eq!(st.model_stats.len(), 4);
    let mlp = st.model_stats.iter().find(|m| m.name == "mlp").unwrap();
    assert_eq!(mlp.inference_count, 3);
    assert!(mlp.last_inference > 0);
    // Index.
    let idx = rt.block_on(rest.repository_index(false)).unwrap();
    let states: Vec<(String, String)> = idx
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().into(), r["state"].as_str().unwrap().into()))
        .collect();
    assert_eq!(states.len(), 4);
    assert!(states.iter().all(|(_, st)| st == "READY"), "{states:?}");
    let idx = rt.block_on(grpc.repository_index(true)).unwrap();
    assert_eq!(idx.models.len(), 4);
}

#[test]
fn load_and_unload_at_run_time() {
    let s = start("load");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let x = s.inputs("mlp", 3);
    let want = s.reference("mlp", &x);
    rt.block_on(rest.unload_model("mlp")).unwrap();
    assert!(!rt.block_on(rest.model_ready("mlp", "")).unwrap());
    let e = rt.block_on(grpc.infer("mlp", "", &[("x", &x[0])], &InferOptions::default())).unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    let idx = rt.block_on(grpc.repository_index(false)).unwrap();
    let row = idx.models.iter().find(|m| m.name == "mlp").unwrap();
    assert_eq!((row.state.as_str(), row.reason.as_str()), ("UNAVAILABLE", "unloaded"));
    // Unloading twice is an error; the rest keeps serving.
    assert_eq!(rt.block_on(grpc.unload_model("mlp")).unwrap_err().code(), Some(Code::NotFound));
    rt.block_on(grpc.infer("pair", "", &named(&s.input_names("pair"), &s.inputs("pair", 0)), &InferOptions::default())).unwrap();
    rt.block_on(grpc.load_model("mlp")).unwrap();
    let r = rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &InferOptions::default(), true)).unwrap();
    assert_same(&r.outputs[0].1, &want[0], "reloaded mlp");
    // A folder added after start loads on request, with its config (two instances).
    let repo = s.repository();
    std::fs::create_dir_all(repo.join("mlp2")).unwrap();
    std::fs::copy(repo.join("mlp/mlp.onnx"), repo.join("mlp2/mlp.onnx")).unwrap();
    std::fs::write(repo.join("mlp2/config.toml"), "instances = 2\nversion = \"3\"\n").unwrap();
    let idx = rt.block_on(rest.repository_index(false)).unwrap();
    assert!(idx.as_array().unwrap().iter().any(|r| r["name"] == "mlp2" && r["state"] == "UNAVAILABLE"));
    rt.block_on(rest.load_model("mlp2")).unwrap();
    for _ in 0..4 {
        let r = rt.block_on(grpc.infer("mlp2", "3", &[("x", &x[0])], &InferOptions::default())).unwrap();
        assert_same(&r.outputs[0].1, &want[0], "mlp2");
    }
    assert_eq!(rt.block_on(grpc.model_config("mlp2", "")).unwrap().instance_group[0].count, 2);
    // Reloading a loaded model works; a folder that is not there is NOT_FOUND; a bad config is 400.
    rt.block_on(rest.load_model("mlp2")).unwrap();
    assert_eq!(rt.block_on(rest.load_model("ghost")).unwrap_err().code(), Some(Code::NotFound));
    std::fs::create_dir_all(repo.join("broken")).unwrap();
    std::fs::write(repo.join("broken/config.toml"), "batch = many\n").unwrap();
    let e = rt.block_on(grpc.load_model("broken")).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("config.toml:1"), "{e}");
    let e = rt.block_on(rest.load_model("../models")).unwrap_err();
    assert!(matches!(e.code(), Some(Code::InvalidArgument | Code::NotFound)), "{e}");
}

#[test]
fn request_parameters_map_onto_engine_options() {
    let s = start("params");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let x = s.inputs("mlp", 0);
    // A 1 us timeout is a deadline no request meets: the request is cancelled (504 /
    // DEADLINE_EXCEEDED), or, when it finished before the server's timeout thread looked, its
    // response says the deadline was missed.
    let tight = InferOptions { timeout_us: 1, priority: 1, ..Default::default() };
    let mut missed = 0;
    for r in [
        rt.block_on(grpc.infer("mlp", "", &[("x", &x[0])], &tight)),
        rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &tight, false)),
    ] {
        match r {
            Ok(r) => {
                assert!(r.timing.deadline_missed, "{:?}", r.timing);
                missed += 1;
            }
            Err(e) => assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}"),
        }
    }
    let loose = InferOptions { timeout_us: 60_000_000, real_time: Some(false), tenant: Some(9), ..Default::default() };
    let r = rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &loose, true)).unwrap();
    assert!(!r.timing.deadline_missed);
    let metrics = rt.block_on(rest.metrics()).unwrap();
    assert!(metrics.contains(&format!(r#"kairos_deadline_misses_total{{model="mlp",class="real-time"}} {missed}"#)), "{metrics}");
    assert!(
        metrics.contains(r#"kairos_requests_total{model="mlp",class="best-effort",protocol="http",outcome="ok"} 1"#),
        "{metrics}"
    );
    // Out-of-range parameters are refused.
    for opts in
        [InferOptions { priority: 5000, ..Default::default() }, InferOptions { timeout_us: u64::MAX / 2, ..Default::default() }]
    {
        let e = rt.block_on(grpc.infer("mlp", "", &[("x", &x[0])], &opts)).unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
        let e = rt.block_on(rest.infer("mlp", "", &[("x", &x[0])], &opts, true)).unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    }
}

#[test]
fn metrics_are_prometheus_text() {
    let s = start("metrics");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let x = s.inputs("mlp", 0);
    for _ in 0..2 {
        rt.block_on(grpc.infer("mlp", "", &[("x", &x[0])], &InferOptions::default())).unwrap();
    }
    let _ = rt.block_on(grpc.infer("nope", "", &[("x", &x[0])], &InferOptions::default()));
    let mut shm = ShmClient::connect(&s.shm, ConnectOptions::default()).unwrap();
    let m = shm.open_model("mlp", "").unwrap();
    shm.infer(&m, &x, Wait::Hybrid, &InferOptions::default()).unwrap();
    let text = rt.block_on(rest.metrics()).unwrap();
    for want in [
        r#"kairos_requests_total{model="mlp",class="real-time",protocol="grpc",outcome="ok"} 2"#,
        r#"kairos_requests_total{model="mlp",class="real-time",protocol="shm",outcome="ok"} 1"#,
        r#"kairos_requests_total{model="",class="best-effort",protocol="grpc",outcome="not_found"} 1"#,
        r#"kairos_request_duration_seconds_count{model="mlp",class="real-time"} 3"#,
        r#"kairos_request_queue_seconds_bucket{le="+Inf",model="mlp",class="real-time"} 3"#,
        r#"kairos_request_gpu_seconds_count{model="mlp",class="real-time"} 3"#,
        "# TYPE kairos_gpu_busy_ratio gauge",
        "kairos_preemptions_total{gpu=\"0\"",
        "kairos_models_ready 4",
        "kairos_shm_clients 1",
    ] {
        assert!(text.contains(want), "missing {want}\n{text}");
    }
    assert!(text.lines().any(|l| l.starts_with("kairos_launches_total{gpu=\"0\"") && !l.ends_with(" 0")), "{text}");
}

/// `gpus = "auto"`: on two GPUs, instances go to the GPU with the fewest weight bytes placed (the
/// tiny repository's models all sit on GPU 0 by default), answer like the CPU reference, and the
/// model configuration lists the GPUs they went to.
#[test]
fn auto_placement_balances_weight_bytes_over_the_gpus() {
    let s = start_with("auto", |cfg, _| cfg.state.gpus = 2);
    let state = s.server.as_ref().unwrap().state.clone();
    let before = state.placed_weight_bytes();
    assert_eq!(before.len(), 2);
    assert!(before[0] > 0 && before[1] == 0, "the repository's models default to GPU 0: {before:?}");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    let repo = s.repository();
    std::fs::create_dir_all(repo.join("mlp_auto")).unwrap();
    std::fs::copy(repo.join("mlp/mlp.onnx"), repo.join("mlp_auto/mlp.onnx")).unwrap();
    std::fs::write(repo.join("mlp_auto/config.toml"), "instances = 3\ngpus = \"auto\"\n").unwrap();
    rt.block_on(rest.load_model("mlp_auto")).unwrap();
    let w = s.plan("mlp").weight_bytes;
    let after = state.placed_weight_bytes();
    assert_eq!(after.iter().sum::<u64>(), before.iter().sum::<u64>() + 3 * w);
    // Greedy: each instance went where the fewest bytes were, so GPU 1 got at least the first.
    assert!(after[1] >= w, "{before:?} -> {after:?}");
    let imbalance = after[0].abs_diff(after[1]);
    assert!(imbalance <= before[0].abs_diff(before[1]).max(w), "{before:?} -> {after:?}");
    let cfg = rt.block_on(grpc.model_config("mlp_auto", "")).unwrap();
    assert!(cfg.instance_group[0].gpus.contains(&1), "{:?}", cfg.instance_group[0].gpus);
    let x = s.inputs("mlp", 5);
    let want = s.reference("mlp", &x);
    for _ in 0..6 {
        let r = rt.block_on(grpc.infer("mlp_auto", "", &[("x", &x[0])], &InferOptions::default())).unwrap();
        assert_same(&r.outputs[0].1, &want[0], "mlp_auto");
    }
}
