//! Dispatcher cost on one core, against a null GPU that completes every launch at once, so
//! nearly all the time measured is the dispatcher's own.
//!
//! 1. Cost of one scheduling decision (`Policy::decide` on the dispatcher's view) with J admitted
//!    jobs, per policy.
//! 2. Sustained launches per second end to end (commands, event processing, policy, launch
//!    bookkeeping): J jobs of 100 one-CTA kernels each, as fast as the dispatcher can go.
//!
//! Run: `cargo run --release -p kairos-sched --example dispatch_cost`

use kairos_gpu::synthetic::chain_plan;
use kairos_gpu::*;
use kairos_ir::DType;
use kairos_ir::plan::{Kernel, LaunchShape};
use kairos_sched::policy::PolicyConfig;
use kairos_sched::*;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// A GPU that runs every launch instantly: its CTAs are placed on (and leave) the first SMs, and
/// the launch is done, all reported at the next poll. Launches on one stream do not wait for each
/// other (there is nothing to wait for).
struct NullGpu {
    info: DeviceInfo,
    now: u64,
    next: u64,
    streams: u32,
    ready: VecDeque<GpuEvent>,
}

impl NullGpu {
    fn new() -> NullGpu {
        let limits = SmLimits { threads_max: 2048, registers_max: 65536, shared_mem_bytes_max: 228 * 1024, ctas_max: 32 };
        NullGpu {
            info: DeviceInfo {
                name: "null".into(),
                arch: "sm_90".into(),
                sm_count: 132,
                sm_limits: limits,
                memory_bytes: 80 << 30,
                partitions: vec![Partition { id: PartitionId::WHOLE, sms: SmMask::first(132) }],
                partition_granularity_sms: 8,
                hardware_queues: 32,
                h2d_bytes_per_s: 55e9,
                d2h_bytes_per_s: 55e9,
                device_mem_bytes_per_s: 3.3e12,
                host_mapped_read_bytes_per_s: 51e9,
                launches_in_flight_max: 0,
            },
            now: 0,
            next: 1,
            streams: 0,
            ready: VecDeque::new(),
        }
    }
}

impl Gpu for NullGpu {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn now_ns(&self) -> u64 {
        self.now
    }
    fn alloc(&mut self, bytes: u64, kind: MemKind) -> Result<Allocation> {
        self.next += 1;
        Ok(Allocation { ptr: DevicePtr(self.next << 32), bytes, kind })
    }
    fn free(&mut self, _a: Allocation) -> Result<()> {
        Ok(())
    }
    fn write(&mut self, _dst: DevicePtr, _data: &[u8]) -> Result<()> {
        Ok(())
    }
    fn read(&mut self, _src: DevicePtr, out: &mut [u8]) -> Result<()> {
        out.fill(0);
        Ok(())
    }
    fn copy_async(&mut self, _dst: DevicePtr, _src: DevicePtr, _bytes: u64, _stream: StreamId) -> Result<CopyId> {
        Err(GpuError::Invalid("no copies".into()))
    }
    fn create_stream(&mut self, _priority: i32) -> Result<StreamId> {
        self.streams += 1;
        Ok(StreamId(self.streams - 1))
    }
    fn destroy_stream(&mut self, _stream: StreamId) -> Result<()> {
        Ok(())
    }
    fn kernel_resources(&mut self, _k: &Kernel, _d: DType, s: &LaunchShape) -> Result<KernelResources> {
        Ok(KernelResources {
            threads_per_cta: s.threads_per_block,
            registers_per_thread: 32,
            shared_mem_bytes: s.shared_mem_bytes,
            ctas_per_sm_max: KernelResources::occupancy(s.threads_per_block, 32, s.shared_mem_bytes, &self.info.sm_limits),
        })
    }
    fn launch(&mut self, r: &LaunchRequest<'_>) -> Result<LaunchId> {
        let id = LaunchId(self.next);
        self.next += 1;
        let sms = r.ctas.min(self.info.sm_count);
        for sm in 0..sms {
            let ctas = r.ctas / sms + u32::from(sm < r.ctas % sms);
            self.ready.push_back(GpuEvent::CtasPlaced { launch: id, sm, ctas, at_ns: self.now });
        }
        let blocks = r.shape.logical_blocks - r.first_block;
        for sm in 0..sms {
            let ctas = r.ctas / sms + u32::from(sm < r.ctas % sms);
            let b = blocks / sms + u32::from(sm < blocks % sms);
            self.ready.push_back(GpuEvent::CtasFinished { launch: id, sm, ctas, blocks: b, at_ns: self.now });
        }
        self.ready.push_back(GpuEvent::LaunchDone {
            launch: id,
            next_block: r.shape.logical_blocks,
            preempted: false,
            at_ns: self.now,
        });
        Ok(id)
    }
    fn preempt(&mut self, _launch: LaunchId) -> Result<()> {
        Ok(())
    }
    fn poll(&mut self, events: &mut Vec<GpuEvent>) -> Result<()> {
        events.extend(self.ready.drain(..));
        Ok(())
    }
    fn wait(&mut self, until_ns: u64) -> Result<()> {
        if self.ready.is_empty() {
            self.now = self.now.max(until_ns);
        }
        Ok(())
    }
}

fn policies() -> Vec<PolicyConfig> {
    PolicyConfig::NAMES.iter().chain(&["reef+runs", "krisp:inf+runs+green"]).map(|n| PolicyConfig::by_name(n).unwrap()).collect()
}

fn main() {
    let plan = Arc::new(chain_plan("chain100", 100, 64));
    let spec = ModelSpec { name: "m".into(), plan: plan.clone(), profile: None };
    let opts = RequestOptions { skip_io: true, ..Default::default() };

    println!("## Cost of one decision (Policy::decide on the view), by admitted jobs\n");
    println!("| policy | jobs | real-time jobs | ns/decision |");
    println!("|---|---:|---:|---:|");
    // `reef` also in real-time mode: every tenth job real-time (the first one just arrived).
    let cases = policies().into_iter().filter(|p| p.is_kernel_level()).flat_map(|p| {
        let rt = matches!(p, PolicyConfig::Reef { .. });
        [(p.clone(), false)].into_iter().chain(rt.then_some((p, true)))
    });
    for (p, with_rt) in cases {
        for jobs in [1usize, 10, 100, 1000] {
            let cfg = Config {
                jobs_max: 4096,
                slots_per_model_max: 4096,
                tenants_max: 4096,
                ..Config::default().with_policy(p.clone())
            };
            let mut d = Dispatcher::new(cfg, NullGpu::new()).unwrap();
            let mut out = Vec::new();
            d.on_command(Command::LoadModel(spec.clone()), &mut out);
            for i in 0..jobs {
                let class = if with_rt && i % 10 == 0 { Class::RealTime } else { Class::BestEffort };
                let o = RequestOptions { tenant: TenantId((i % 8) as u32), class, ..opts.clone() };
                d.on_command(
                    Command::Submit(Request {
                        id: RequestId(i as u64),
                        model: "m".into(),
                        inputs: vec![],
                        options: o,
                        arrival_ns: None,
                    }),
                    &mut out,
                );
            }
            let policy = p.build();
            let view = d.view();
            let reps = 2_000_000 / jobs.max(1) + 1000;
            let t = Instant::now();
            let mut n = 0u64;
            for _ in 0..reps {
                if std::hint::black_box(policy.decide(std::hint::black_box(&view))).is_some() {
                    n += 1;
                }
            }
            let ns = t.elapsed().as_nanos() as f64 / reps as f64;
            assert_eq!(n as usize, reps);
            let rt_jobs = if with_rt { jobs.div_ceil(10) } else { 0 };
            println!("| {} | {jobs} | {rt_jobs} | {ns:.0} |", p.label());
        }
    }

    println!("\n## Sustained launches per second (null GPU, jobs of 100 one-CTA kernels, all submitted at once)\n");
    println!("| policy | jobs in flight | launches | launches/s | ns/launch | ns/decision |");
    println!("|---|---:|---:|---:|---:|---:|");
    for p in policies() {
        for concurrent in [1usize, 32, 256] {
            let total_jobs = 20_000 / concurrent.max(1) * concurrent;
            let cfg = Config {
                jobs_max: 4096,
                slots_per_model_max: 4096,
                launches_in_flight_max: 65_536,
                ..Config::default().with_policy(p.clone())
            };
            let mut driver = VirtualDriver::new(cfg, NullGpu::new()).unwrap();
            driver.load_model(spec.clone()).unwrap();
            let t = Instant::now();
            let mut done = 0;
            while done < total_jobs {
                let now = driver.now_ns();
                for _ in 0..concurrent {
                    driver.submit_at(now, "m", vec![], opts.clone());
                }
                driver.run_until_idle().unwrap();
                done += concurrent;
            }
            let secs = t.elapsed().as_secs_f64();
            let stats = driver.dispatcher().stats();
            assert_eq!(stats.completed as usize, total_jobs);
            println!(
                "| {} | {concurrent} | {} | {:.0} | {:.0} | {:.0} |",
                p.label(),
                stats.launches,
                stats.launches as f64 / secs,
                secs * 1e9 / stats.launches as f64,
                secs * 1e9 / stats.decisions as f64
            );
        }
    }
}
