//! The shared-memory channel's zero-copy path on the simulated GPU: the client's data area is
//! mapped into the GPU, requests whose buffers suit it are served in place (the completion says
//! so, `/metrics` counts it) with the copy path's answers; spans that do not suit it fall back to
//! copies; a client that disconnects with requests in flight keeps its region mapped until they
//! have completed.

mod common;

use common::*;
use kairos_client::InferOptions;
use kairos_client::rest::RestClient;
use kairos_client::shm::layout::Span;
use kairos_client::shm::ring::RingMemory;
use kairos_client::shm::{Buffer, ConnectOptions, ShmClient, Wait};
use kairos_ir::Tensor;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
}

fn outputs_at(c: &ShmClient, specs: &[kairos_client::shm::TensorSpec], bufs: &[Buffer]) -> Vec<Tensor> {
    specs
        .iter()
        .zip(bufs)
        .map(|(s, b)| {
            let span = Span { offset: b.span.offset, len: s.len_bytes() };
            Tensor::from_bytes(s.dtype, s.shape.clone(), &c.region().read_data_vec(span).unwrap()).unwrap()
        })
        .collect()
}

#[test]
fn shm_requests_run_zero_copy_and_fall_back_to_copies() {
    let s = start("zero-copy");
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let mut c = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 16, cq_entries: 16, data_bytes: 1 << 20 }).unwrap();
    let opts = InferOptions::default();
    let mut zero_copy = 0;
    for model in MODELS {
        let m = c.open_model(model, "").unwrap();
        for seed in 0..2 {
            let inputs = s.inputs(model, seed);
            let want = s.reference(model, &inputs);
            let (got, _) = c.infer(&m, &inputs, Wait::Hybrid, &opts).unwrap();
            zero_copy += 1;
            assert_eq!(c.data_paths(), (zero_copy, 0), "{model}: the client's own buffers go zero-copy");
            for (i, w) in want.iter().enumerate() {
                assert_same(&got[i], w, &format!("{model} zero-copy output {i}"));
            }
        }
    }
    // Spans off the GPU's alignment, and an output on top of its input: copied, same answers.
    let m = c.open_model("mlp", "").unwrap();
    let inputs = s.inputs("mlp", 5);
    let want = s.reference("mlp", &inputs);
    let (isz, osz) = (m.inputs[0].len_bytes(), m.outputs[0].len_bytes());
    let a = c.alloc(isz + 512).unwrap();
    let b = c.alloc(osz + 512).unwrap();
    let misaligned_in = Buffer { span: Span { offset: a.span.offset + 4, len: isz } };
    let misaligned_out = Buffer { span: Span { offset: b.span.offset + 8, len: osz } };
    c.buffer_mut(&misaligned_in).unwrap().copy_from_slice(&inputs[0].to_bytes());
    let tag = c.submit(&m, &[misaligned_in], &[misaligned_out], &opts).unwrap();
    let r = c.wait(tag, Wait::Poll).unwrap();
    assert!(!r.zero_copy, "misaligned spans cannot be read in place");
    assert_same(&outputs_at(&c, &m.outputs, &[misaligned_out])[0], &want[0], "mlp misaligned (copied)");
    let in_place = Buffer { span: Span { offset: a.span.offset, len: isz } };
    c.buffer_mut(&in_place).unwrap().copy_from_slice(&inputs[0].to_bytes());
    let tag = c.submit(&m, &[in_place], &[in_place], &opts).unwrap();
    let r = c.wait(tag, Wait::Hybrid).unwrap();
    assert!(!r.zero_copy, "an output over its input is copied");
    assert_eq!(r.output_lens, vec![osz]);
    assert_same(&outputs_at(&c, &m.outputs, &[in_place])[0], &want[0], "mlp in place (copied)");
    assert_eq!(c.data_paths(), (zero_copy, 2));

    let text = rt.block_on(rest.metrics()).unwrap();
    assert_eq!(metric(&text, "kairos_shm_requests_total{path=\"zero_copy\"}"), Some(zero_copy), "{text}");
    assert_eq!(metric(&text, "kairos_shm_requests_total{path=\"copy\"}"), Some(2), "{text}");
    assert_eq!(metric(&text, "kairos_shm_mapped_regions"), Some(1), "{text}");
    drop(c);
    let t = Instant::now();
    while metric(&rt.block_on(rest.metrics()).unwrap(), "kairos_shm_mapped_regions") != Some(0) {
        assert!(t.elapsed() < Duration::from_secs(30), "the region stays mapped after its client left");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client leaves with requests in flight: its region stays mapped until every one of them has
/// completed, so they all finish correctly (the simulator refuses to unmap memory a running
/// launch uses, and a launch on an unmapped address fails).
#[test]
fn a_disconnect_with_requests_in_flight_does_not_unmap_early() {
    // A model slow enough on the CPU reference kernels that requests are still queued when the
    // client goes.
    let s = start_with("zero-copy-leave", |cfg, _| {
        // squeezenet's image (301 KB) is above the default zero-copy limit.
        cfg.shm.as_mut().unwrap().zero_copy_bytes_max = u64::MAX;
        let d = cfg.state.repository.join("squeeze");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(kairos_server::repository::CONFIG_FILE), "model = \"squeezenet1_1\"\ndtype = \"f16\"\n").unwrap();
    });
    let rt = runtime();
    let rest = RestClient::new(&s.http).unwrap();
    let mut c = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 8, cq_entries: 8, data_bytes: 8 << 20 }).unwrap();
    let m = c.open_model("squeeze", "").unwrap();
    let inputs = kairos_bench_free_inputs(&m);
    const N: u64 = 6;
    let mut tags = Vec::new();
    for _ in 0..N {
        let i = c.alloc(m.inputs[0].len_bytes()).unwrap();
        let o = c.alloc(m.outputs[0].len_bytes()).unwrap();
        c.buffer_mut(&i).unwrap().copy_from_slice(&inputs[0].to_bytes());
        tags.push(c.submit(&m, &[i], &[o], &InferOptions::default()).unwrap());
    }
    // Leave once the server has taken all six from the submission ring (its head caught up with
    // the tail), long before their kernels have run.
    let t = Instant::now();
    loop {
        let sq = c.region().sq();
        if sq.head().load(Ordering::Acquire) == sq.tail().load(Ordering::Acquire) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "the server never took the submissions");
        std::thread::yield_now();
    }
    assert_eq!(tags.len() as u64, N);
    drop(c);
    let text = rt.block_on(rest.metrics()).unwrap();
    let ok_at_leave =
        metric(&text, "kairos_requests_total{model=\"squeeze\",class=\"best-effort\",protocol=\"shm\",outcome=\"ok\"}");
    let t = Instant::now();
    let text = loop {
        let text = rt.block_on(rest.metrics()).unwrap();
        if metric(&text, "kairos_shm_mapped_regions") == Some(0) {
            break text;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the region stays mapped after its client left");
        std::thread::sleep(Duration::from_millis(20));
    };
    let ok = metric(&text, "kairos_requests_total{model=\"squeeze\",class=\"best-effort\",protocol=\"shm\",outcome=\"ok\"}");
    // A client that leaves has its requests cancelled (their GPU work stopped); either way each is
    // answered — served or cancelled — before the region it reads and writes is unmapped.
    let cancelled =
        metric(&text, "kairos_requests_total{model=\"squeeze\",class=\"best-effort\",protocol=\"shm\",outcome=\"cancelled\"}");
    println!("ok when the client left: {ok_at_leave:?}; when its region was unmapped: {ok:?} ok, {cancelled:?} cancelled");
    assert_eq!(metric(&text, "kairos_shm_requests_total{path=\"zero_copy\"}"), Some(N), "{text}");
    assert_eq!(
        ok.unwrap_or(0) + cancelled.unwrap_or(0),
        N,
        "every request in flight was answered before the region went\n{text}"
    );
    assert!(ok_at_leave.unwrap_or(0) < N, "the client left after all requests were done: the test proves nothing");
}

/// Inputs for a model described by the channel (floats in [-1, 1]).
fn kairos_bench_free_inputs(m: &kairos_client::shm::ShmModel) -> Vec<Tensor> {
    m.inputs
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            Tensor::f32(t.shape.clone(), (0..n).map(|k| ((k * 37 % 2001) as f32) / 1000.0 - 1.0).collect()).cast(t.dtype)
        })
        .collect()
}

/// Requests above the configured zero-copy size take the copy path (kernels reading large
/// tensors over PCIe are slower than one copy), with the same answers.
#[test]
fn requests_above_the_zero_copy_limit_are_copied() {
    let s = start_with("zero-copy-limit", |cfg, _| {
        cfg.shm.as_mut().unwrap().zero_copy_bytes_max = 0;
    });
    let mut c = ShmClient::connect(&s.shm, ConnectOptions { sq_entries: 16, cq_entries: 16, data_bytes: 1 << 20 }).unwrap();
    let opts = InferOptions::default();
    let m = c.open_model("mlp", "").unwrap();
    let inputs = s.inputs("mlp", 3);
    let want = s.reference("mlp", &inputs);
    let (got, _) = c.infer(&m, &inputs, Wait::Hybrid, &opts).unwrap();
    assert_eq!(c.data_paths(), (0, 1), "a request above the limit is copied");
    assert_same(&got[0], &want[0], "mlp above the zero-copy limit (copied)");
}
