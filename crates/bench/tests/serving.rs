//! The serving-overhead measurement against a server on the simulated GPU: every transport answers
//! the same tensors, the numbers are consistent with each other, and a transport that cannot carry
//! a model is reported as such instead of stopping the run.

use kairos_backends::SimBackend;
use kairos_bench::serving::{self, Endpoints, Options, Transport};
use kairos_server::{RunningServer, ServerConfig, ShmConfig, fixtures};
use std::net::SocketAddr;

fn start(tag: &str) -> (RunningServer, Endpoints, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kairos-bench-serving-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let repo = dir.join("models");
    std::fs::create_dir_all(&repo).unwrap();
    fixtures::write_bench_repository(&repo, &[]).unwrap();
    let mut cfg = ServerConfig::new(&repo);
    cfg.http = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.grpc = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.shm = Some(ShmConfig { socket: dir.join("kairos.sock"), ..ShmConfig::default() });
    let server = RunningServer::start(cfg, Box::new(SimBackend::new(kairos_sim::GpuDesc::h100_sxm(), 3))).unwrap();
    server.wait_until_ready(std::time::Duration::from_secs(60)).expect("the bench repository loads");
    let at = Endpoints {
        http: server.http_addr().map(|a| format!("http://{a}")),
        grpc: server.grpc_addr().map(|a| format!("http://{a}")),
        shm: server.shm_socket().map(|p| p.to_path_buf()),
    };
    (server, at, dir)
}

#[test]
fn every_transport_measures_the_small_model() {
    let (server, at, dir) = start("mlp");
    let model = serving::describe_model(&at, "mlp").unwrap();
    let opts = Options { requests: 40, warmup: 5, seed: 9 };
    let mut seen = Vec::new();
    let results = serving::measure_model(&at, &model, &Transport::ALL, opts, |r| seen.push(r.transport)).unwrap();
    assert_eq!(seen, Transport::ALL.to_vec(), "progress hears of every transport in order");
    for r in &results {
        assert_eq!(r.error, None, "{:?}", r.transport);
        assert_eq!(r.requests, 40);
        assert!(r.client.p50_us > 0.0 && r.client.p50_us <= r.client.p99_us, "{r:?}");
        assert!(r.gpu.p50_us > 0.0, "the server reports GPU time: {r:?}");
        // The engine's time is part of what the client waited for.
        assert!(r.over_engine.p50_us >= 0.0, "{r:?}");
        assert!(r.client_cpu_per_request_us > 0.0 && r.client_cpu_fraction <= 1.05, "{r:?}");
        assert!(r.throughput_per_s > 0.0);
        // The simulator maps the client's region, so the ring goes zero-copy unless the buffers
        // are placed to prevent it.
        let want = match r.transport {
            Transport::ShmHybrid | Transport::ShmPoll => Some("zero-copy"),
            Transport::ShmCopy => Some("copy"),
            _ => None,
        };
        assert_eq!(r.data_path.as_deref(), want, "{:?}", r.transport);
    }
    let md = serving::markdown(&results);
    assert_eq!(md.lines().count(), 2 + Transport::ALL.len());
    server.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_transport_that_cannot_carry_the_model_is_reported() {
    let (server, at, dir) = start("gap");
    // gap224's 602 KB input is larger than a socket message may be.
    let model = serving::describe_model(&at, "gap224").unwrap();
    let opts = Options { requests: 5, warmup: 1, seed: 1 };
    let results = serving::measure_model(&at, &model, &[Transport::ShmHybrid, Transport::Socket], opts, |_| {}).unwrap();
    assert_eq!(results[0].error, None);
    let e = results[1].error.as_deref().expect("the socket refuses the tensor");
    assert!(e.contains("exceeds"), "{e}");
    assert!(serving::markdown(&results).contains("not measured"));
    assert!(serving::describe_model(&at, "no-such-model").is_err());
    let bad = serving::measure_model(&at, &model, &[Transport::Grpc], Options { requests: 0, warmup: 0, seed: 1 }, |_| {});
    assert!(bad.is_err(), "zero requests is refused");
    server.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_load_generator_drives_a_server_over_every_front_end() {
    use kairos_bench::experiment::{Quiet, SweepOptions, run_preset};
    use kairos_bench::presets::{Length, Preset};
    use kairos_bench::remote::{Launched, RemoteTarget};
    use kairos_bench::runner::Catalog;
    use kairos_sched::{EngineConfig, ModelSpec};
    use std::sync::Arc;

    let mut ir = kairos_ir::model::ModelSpec::new("squeezenet1_1");
    ir.dtype = kairos_ir::DType::F16;
    let mut catalog = Catalog::default();
    catalog.insert(ModelSpec { name: "squeezenet1_1".into(), plan: Arc::new(ir.plan().unwrap()), profile: None });
    for transport in [Transport::RestBinary, Transport::Grpc, Transport::ShmHybrid] {
        let mut runs = 0;
        let launcher = Box::new(move |cfg: &kairos_sched::Config| {
            runs += 1;
            let dir =
                std::env::temp_dir().join(format!("kairos-bench-remote-{}-{}-{runs}", transport.name(), std::process::id()));
            let repo = dir.join("models").join("squeezenet1_1");
            std::fs::create_dir_all(&repo).unwrap();
            std::fs::write(repo.join("config.toml"), "model = \"squeezenet1_1\"\ndtype = \"f16\"\n").unwrap();
            let mut c = ServerConfig::new(dir.join("models"));
            c.http = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
            c.grpc = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
            c.shm = Some(ShmConfig { socket: dir.join("kairos.sock"), ..ShmConfig::default() });
            let backend = SimBackend {
                compute: false,
                engine: EngineConfig { dispatcher: cfg.clone(), ..EngineConfig::default() },
                ..SimBackend::new(kairos_sim::GpuDesc::h200(), 5)
            };
            let server = RunningServer::start(c, Box::new(backend)).map_err(|e| kairos_bench::Error::Invalid(e.to_string()))?;
            server
                .wait_until_ready(std::time::Duration::from_secs(120))
                .map_err(|e| kairos_bench::Error::Invalid(e.to_string()))?;
            let endpoints = Endpoints {
                http: server.http_addr().map(|a| format!("http://{a}")),
                grpc: server.grpc_addr().map(|a| format!("http://{a}")),
                shm: server.shm_socket().map(|p| p.to_path_buf()),
            };
            Ok(Launched {
                endpoints,
                device: server.state.device_names().join(", "),
                stop: Box::new(move || {
                    server.shutdown();
                    let _ = std::fs::remove_dir_all(dir);
                }),
            })
        });
        let mut target = RemoteTarget::new(transport, 4, 1, launcher).unwrap();
        let mut opts = SweepOptions {
            policies: Some(vec!["paella".into()]),
            loads: Some(vec![1.0]),
            length: Some(Length::DurationNs(300_000_000)),
            seed: 1,
            isolated_repeats: 1,
            ..SweepOptions::default()
        };
        opts.preset.custom.models = vec!["squeezenet1_1".into()];
        opts.preset.custom.rate_per_s = 100.0;
        let r = run_preset(&mut target, &Preset::Custom, &catalog, &opts, &mut Quiet).unwrap();
        let o = &r.points[0].metrics.overall;
        assert!(o.requests > 10 && o.completed == o.requests, "{}: {o:?}", transport.name());
        assert!(o.latency.p50_ns > 0 && o.latency.p50_ns <= o.latency.p99_ns, "{}: {o:?}", transport.name());
        assert!(r.points[0].metrics.overall.gpu.p50_ns > 0, "the server's GPU time comes back");
    }
}
