//! Cold starts on the GPU (DeepPlan): under a weight budget that holds one instance, two instances
//! of a model are asked in turn, so every request is a cold start, under every strategy —
//! load-then-run, pipelined (each launch behind `Gpu::wait_copy` for its layer's copy) and
//! deepplan (a measured layer profile, layers read in place from pinned host memory) — and every
//! answer is byte for byte the answer of the model resident from its load. With two GPUs or more,
//! also parallel and parallel-deepplan with GPU 1 attached as GPU 0's secondary (DeepPlan's
//! parallel transmission: the later layers copied by GPU 1 and forwarded). `#[ignore]`d
//! without a GPU; scripts/gpu-suite.sh and scripts/parallel-bench.sh run it with `--include-ignored`.

use kairos_cuda::CudaGpu;
use kairos_gpu::profile::ModelProfile;
use kairos_gputest as suite;
use kairos_ir::DType;
use kairos_sched::cold::ColdStrategy;
use kairos_sched::{Config, ModelSpec, PolicyConfig, RequestOptions, ResidencyState, VirtualDriver};
use std::sync::Arc;

fn answer(d: &mut VirtualDriver<CudaGpu>, name: &str, inputs: &[kairos_ir::Tensor]) -> Vec<u8> {
    let now = d.now_ns();
    let id = d.submit_at(now, name, inputs.to_vec(), RequestOptions::default());
    d.run_until_idle().unwrap();
    let r = d.take_records().into_iter().find(|r| r.id == id).unwrap();
    r.result.unwrap_or_else(|e| panic!("{name}: {e}"));
    r.outputs.iter().flat_map(|t| t.to_bytes()).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-suite.sh runs it with --include-ignored"]
fn cold_starts_answer_what_resident_models_answer() {
    kairos_cuda::settings::configure_from_env();
    for (model, dtype) in [("resnet18", DType::F16), ("distilbert", DType::F16), ("distilbert", DType::F32)] {
        let m = suite::zoo_model(model, dtype, 1, 32).unwrap();
        let plan = Arc::new(m.plan);
        let layers = {
            let mut gpu = CudaGpu::new(0).unwrap();
            kairos_gpu::exec::profile_layers(&mut gpu, &plan, 3).unwrap()
        };
        let profile = ModelProfile {
            model: plan.model.clone(),
            dtype,
            batch: 1,
            device: String::new(),
            sm_count: 0,
            latency_ns: 0,
            kernels: vec![],
            layers: Some(layers),
            placements: None,
        };
        for policy in ["fifo", "paella"] {
            let resident = {
                let cfg = Config::default().with_policy(PolicyConfig::by_name(policy).unwrap());
                let mut d = VirtualDriver::new(cfg, CudaGpu::new(0).unwrap()).unwrap();
                d.load_model(ModelSpec { name: "m".into(), plan: plan.clone(), profile: None }).unwrap();
                answer(&mut d, "m", &m.inputs)
            };
            let gpus = kairos_cuda::driver::device_count().unwrap_or(1);
            for strategy in ColdStrategy::ALL {
                if strategy.is_parallel() && gpus < 2 {
                    println!("{model} {dtype:?} {policy} {strategy}: one GPU, no secondary: skipped");
                    continue;
                }
                let what = format!("{model} {dtype:?} {policy} {strategy}");
                let mut gpu = CudaGpu::new(0).unwrap();
                if strategy.is_parallel() {
                    let path = gpu.attach_peer(1, 8 << 20).unwrap();
                    println!("{what}: secondary GPU 1: {path:?}");
                }
                let mut cfg = Config::default().with_policy(PolicyConfig::by_name(policy).unwrap());
                // Room for one instance's loaded layers, never two.
                let input = kairos_sched::cold::ColdInput::measured(&plan, profile.layers.as_ref().unwrap())
                    .unwrap()
                    .with_peers(&kairos_gpu::Gpu::peer_paths(&gpu));
                let load_bytes = kairos_sched::cold::plan(&input, strategy).load_bytes;
                cfg.weight_budget_bytes = Some(load_bytes + load_bytes / 2 + (64 << 10));
                cfg.cold_strategy = strategy;
                cfg.cold_chunk_bytes = 1 << 20;
                let mut d = VirtualDriver::new(cfg, gpu).unwrap();
                for name in ["a", "b"] {
                    d.load_model(ModelSpec { name: name.into(), plan: plan.clone(), profile: Some(profile.clone()) }).unwrap();
                }
                assert_eq!(d.dispatcher().residency_of("b"), Some(ResidencyState::HostOnly), "{what}");
                let host_layers = d.dispatcher().cold_plan_of("a").unwrap().host.iter().filter(|&&h| h).count();
                let forwarded = d.dispatcher().cold_plan_of("a").unwrap().forwarded_bytes;
                assert_eq!(forwarded > 0, strategy.is_parallel(), "{what}: {forwarded} bytes through the secondary");
                for (k, name) in ["b", "a", "b", "a"].into_iter().enumerate() {
                    let got = answer(&mut d, name, &m.inputs);
                    assert_eq!(got, resident, "{what}: cold start {k} ({name}) answered other bytes than the resident model");
                }
                let s = d.dispatcher().stats();
                assert_eq!((s.cold_starts, s.evictions, s.loads_completed), (4, 4, 4), "{what}: {s:?}");
                println!(
                    "{what}: 4 cold starts, answers identical to the resident model's; {host_layers} layers read from host \
                     memory, {forwarded} bytes through GPU 1"
                );
            }
        }
    }
}
