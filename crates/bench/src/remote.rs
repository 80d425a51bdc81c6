//! [`RemoteTarget`]: the load generator against a kairos server, over REST, gRPC or the
//! shared-memory channel, through `kairos-client`.
//!
//! A pool of client threads (each with its own connection: one request in flight per thread, as a
//! client library's users would have) takes the generator's requests from one bounded queue. A
//! request waiting for a free client thread waits on the generator's clock, so too small a pool
//! shows as latency, never as fewer requests (no coordinated omission). Inputs are seeded tensors
//! of the model plan's input shapes.
//!
//! Where the server comes from is the caller's [`Launcher`]: the `kairos` binary starts a fresh
//! in-process server per run with that run's dispatcher configuration, so policies can be swept
//! through the network path; a launcher that returns a running server's endpoints measures that
//! server as it is configured (its own policy).
//!
//! Request options travel as the protocol's parameters: the class, the deadline
//! (`kairos_deadline_us`, µs: scheduled for and reported as missed, never cancelled, so that a late
//! result counts as a miss and not a loss) and the tenant; the priority is left to the model's configuration (kairos' signed priorities do
//! not map onto Triton's levels one to one).

use crate::Error;
use crate::serving::{Client, Endpoints, Transport, seeded_inputs};
use crate::target::{Completion, Target};
use kairos_client::shm::{ShmModel, TensorSpec};
use kairos_client::{ClientError, Code, InferOptions};
use kairos_ir::Tensor;
use kairos_sched::{Class, Config, ModelInfo, ModelSpec, RequestOptions, Timing};
use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Requests waiting for a client thread at most; beyond, a request is refused (as overload).
pub const QUEUE_MAX: usize = 65_536;
/// Client threads at most.
pub const CLIENTS_MAX: usize = 1024;

/// A server the target talks to: its endpoints, its device's name, and how to stop it.
pub struct Launched {
    pub endpoints: Endpoints,
    pub device: String,
    /// Called at the end of a run (stops an in-process server; a no-op for a running one).
    pub stop: Box<dyn FnOnce() + Send>,
}

/// Starts (or finds) the server for one run with the run's dispatcher configuration.
pub type Launcher = Box<dyn FnMut(&Config) -> Result<Launched, Error> + Send>;

struct Job {
    tag: u64,
    model: Arc<ShmModel>,
    inputs: Arc<Vec<Tensor>>,
    options: InferOptions,
}

struct Run {
    jobs: Option<SyncSender<Job>>,
    workers: Vec<JoinHandle<()>>,
    stop: Option<Box<dyn FnOnce() + Send>>,
    endpoints: Endpoints,
}

/// The generator's requests sent to a server by a pool of client threads.
pub struct RemoteTarget {
    transport: Transport,
    clients: usize,
    launcher: Launcher,
    seed: u64,
    epoch: Instant,
    device: String,
    run: Option<Run>,
    models: HashMap<String, (Arc<ShmModel>, Arc<Vec<Tensor>>)>,
    tx: Sender<Completion>,
    rx: Receiver<Completion>,
    pending: Vec<Completion>,
}

impl RemoteTarget {
    pub fn new(transport: Transport, clients: usize, seed: u64, launcher: Launcher) -> Result<RemoteTarget, Error> {
        if clients == 0 || clients > CLIENTS_MAX {
            return Err(Error::Invalid(format!("client threads must be 1..={CLIENTS_MAX}, got {clients}")));
        }
        let (tx, rx) = mpsc::channel();
        Ok(RemoteTarget {
            transport,
            clients,
            launcher,
            seed,
            epoch: Instant::now(),
            device: String::new(),
            run: None,
            models: HashMap::new(),
            tx,
            rx,
            pending: Vec::new(),
        })
    }

    fn run(&self) -> Result<&Run, Error> {
        self.run.as_ref().ok_or_else(|| Error::Invalid("the target was not started (begin)".into()))
    }
}

/// The scheduler's error a client error stands for (the generator classifies outcomes by it).
fn outcome_of(e: ClientError) -> kairos_sched::Error {
    match e.code() {
        Some(Code::ResourceExhausted) => kairos_sched::Error::Overloaded { what: "the server's queue", max: 0 },
        Some(Code::NotFound) => kairos_sched::Error::UnknownModel(e.to_string()),
        Some(Code::InvalidArgument) => kairos_sched::Error::InvalidInput(e.to_string()),
        Some(Code::Cancelled) => kairos_sched::Error::Cancelled,
        Some(Code::Unavailable) => kairos_sched::Error::ShuttingDown,
        _ => kairos_sched::Error::Gpu(format!("remote: {e}")),
    }
}

fn worker(transport: Transport, at: Endpoints, epoch: Instant, jobs: Arc<Mutex<Receiver<Job>>>, done: Sender<Completion>) {
    let mut client: Option<Client> = None;
    loop {
        let job = {
            let rx = jobs.lock().unwrap_or_else(|e| e.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return, // the run ended
            }
        };
        if client.is_none() {
            match Client::connect(transport, &at) {
                Ok(c) => client = Some(c),
                Err(e) => {
                    let done_ns = epoch.elapsed().as_nanos() as u64;
                    let result = Err(kairos_sched::Error::Gpu(format!("remote: {e}")));
                    let _ = done.send(Completion { tag: job.tag, done_ns, result });
                    continue;
                }
            }
        }
        let c = client.as_mut().expect("connected above");
        let r = c.infer(&job.model, &job.inputs, &job.options);
        let done_ns = epoch.elapsed().as_nanos() as u64;
        let result = match r {
            // The server's clock is not ours: only its queue and GPU durations carry over.
            Ok((_, t)) => Ok(Timing {
                arrival_ns: 0,
                admitted_ns: 0,
                first_issue_ns: t.queue_ns,
                done_ns: t.queue_ns + t.gpu_ns,
                launches: 0,
                chained: 0,
                deadline_missed: t.deadline_missed,
                ..Timing::default()
            }),
            Err(e) => {
                if e.code().is_none() {
                    // A transport or protocol failure: reconnect for the next request.
                    client = None;
                }
                Err(outcome_of(e))
            }
        };
        if done.send(Completion { tag: job.tag, done_ns, result }).is_err() {
            return;
        }
    }
}

impl Target for RemoteTarget {
    fn label(&self) -> String {
        format!("kairos server over {} ({} client threads)", self.transport.name(), self.clients)
    }

    fn device(&self) -> String {
        self.device.clone()
    }

    fn simulated(&self) -> bool {
        false
    }

    fn begin(&mut self, config: &Config) -> Result<(), Error> {
        self.end()?;
        let launched = (self.launcher)(config)?;
        self.device = launched.device;
        let (jobs_tx, jobs_rx) = mpsc::sync_channel::<Job>(QUEUE_MAX);
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        // A fresh completion channel: nothing of an earlier run can leak into this one.
        let (tx, rx) = mpsc::channel();
        self.tx = tx;
        self.rx = rx;
        self.pending.clear();
        let mut workers = Vec::with_capacity(self.clients);
        for i in 0..self.clients {
            let (t, at, epoch, jobs, done) =
                (self.transport, launched.endpoints.clone(), self.epoch, jobs_rx.clone(), self.tx.clone());
            let h = std::thread::Builder::new()
                .name(format!("kairos-bench-client-{i}"))
                .spawn(move || worker(t, at, epoch, jobs, done))
                .map_err(|e| Error::Invalid(format!("cannot start a client thread: {e}")))?;
            workers.push(h);
        }
        self.run = Some(Run { jobs: Some(jobs_tx), workers, stop: Some(launched.stop), endpoints: launched.endpoints });
        Ok(())
    }

    fn end(&mut self) -> Result<(), Error> {
        if let Some(mut run) = self.run.take() {
            // Closing the queue lets every client thread finish its request and return.
            run.jobs.take();
            for h in run.workers.drain(..) {
                let _ = h.join();
            }
            if let Some(stop) = run.stop.take() {
                stop();
            }
        }
        self.models.clear();
        Ok(())
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn load_model(&mut self, spec: &ModelSpec) -> Result<ModelInfo, Error> {
        // The server loads models from its repository; the plan says what the requests carry.
        let _ = self.run()?;
        let specs = |v: &[kairos_ir::plan::IoTensor]| -> Vec<TensorSpec> {
            v.iter().map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() }).collect()
        };
        let model = ShmModel {
            handle: 0,
            name: spec.name.clone(),
            version: String::new(),
            inputs: specs(&spec.plan.inputs),
            outputs: specs(&spec.plan.outputs),
        };
        let inputs = seeded_inputs(&model.inputs, self.seed);
        self.models.insert(spec.name.clone(), (Arc::new(model), Arc::new(inputs)));
        Ok(ModelInfo {
            name: spec.name.clone(),
            launches: spec.plan.launches.len() as u32,
            weight_bytes: spec.plan.weight_bytes,
            arena_bytes: spec.plan.arena_bytes,
            estimated_ns: 0,
            estimate_source: kairos_sched::EstimateSource::Roofline,
        })
    }

    fn unload_model(&mut self, name: &str) -> Result<(), Error> {
        // The server keeps its repository's models; new requests for this one stop here.
        self.models.remove(name);
        Ok(())
    }

    fn submit(&mut self, tag: u64, model: &str, _arrival_ns: u64, options: RequestOptions) -> Result<(), Error> {
        let now = self.now_ns();
        let Some((m, inputs)) = self.models.get(model).cloned() else {
            self.pending.push(Completion { tag, done_ns: now, result: Err(kairos_sched::Error::UnknownModel(model.into())) });
            return Ok(());
        };
        let job = Job {
            tag,
            model: m,
            inputs,
            options: InferOptions {
                priority: 0,
                // The deadline only: a benchmark counts a late result as a miss, not a loss.
                timeout_us: 0,
                deadline_us: options.deadline_ns.map_or(0, |d| d.div_ceil(1000)),
                real_time: Some(options.class == Class::RealTime),
                tenant: Some(options.tenant.0),
            },
        };
        let jobs = self.run()?.jobs.as_ref().ok_or_else(|| Error::Invalid("the run is ending".into()))?;
        match jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(j)) => self.pending.push(Completion {
                tag: j.tag,
                done_ns: now,
                result: Err(kairos_sched::Error::Overloaded { what: "the client pool's queue", max: QUEUE_MAX as u64 }),
            }),
            Err(TrySendError::Disconnected(_)) => return Err(Error::Invalid("the client threads stopped".into())),
        }
        Ok(())
    }

    fn wait(&mut self, until_ns: u64, out: &mut Vec<Completion>) -> Result<(), Error> {
        let now = self.now_ns();
        crate::target::wait_on_channel(&self.rx, &mut self.pending, now, until_ns, out, "the client threads stopped")
    }
}

impl Drop for RemoteTarget {
    fn drop(&mut self) {
        let _ = self.end();
    }
}

impl RemoteTarget {
    /// The endpoints of the current run (for tests and diagnostics).
    pub fn endpoints(&self) -> Option<&Endpoints> {
        self.run.as_ref().map(|r| &r.endpoints)
    }
}
