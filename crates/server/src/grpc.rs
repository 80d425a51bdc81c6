//! The Open Inference Protocol over gRPC (tonic): `inference.GRPCInferenceService` as written in
//! `proto/inference.proto`, including Triton's configuration, statistics and repository calls.
//! Inputs come as `raw_input_contents` (any datatype) or typed `contents` (FP32, INT64); outputs go
//! back as `raw_output_contents`. A message above the configured limit is refused by tonic before
//! it is read whole, with tonic's code for it (`OUT_OF_RANGE`, "decoded message length too
//! large"); a message that is not valid protobuf is `INVALID_ARGUMENT` (see [`codec`]). The
//! repository calls answer `PERMISSION_DENIED` when [`Service::control`] refuses the request (see
//! [`crate::control`]).

use crate::control::{CONTROL_KEY_HEADER, ControlAccess};
use crate::decode::{self, Param, Params, RequestedOutput};
use crate::error::{Outcome, ServeError};
use crate::metrics::Protocol;
use crate::state::{CancelOnDrop, ModelEntry, State, SubmitOptions};
use kairos_ir::{DType, Tensor};
use kairos_sched::Class;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tonic::{Request, Response, Status};

pub mod pb {
    tonic::include_proto!("inference");
}

/// prost's codec with one change: a request that is not valid protobuf is INVALID_ARGUMENT (the
/// client sent it) where tonic answers INTERNAL.
pub mod codec {
    use prost::Message;
    use std::marker::PhantomData;
    use tonic::Status;
    use tonic::codec::{BufferSettings, DecodeBuf};

    #[derive(Debug, Clone)]
    pub struct Codec<T, U>(PhantomData<(T, U)>);

    impl<T, U> Default for Codec<T, U> {
        fn default() -> Self {
            Codec(PhantomData)
        }
    }

    impl<T, U> tonic::codec::Codec for Codec<T, U>
    where
        T: Message + Send + 'static,
        U: Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = tonic_prost::ProstEncoder<T>;
        type Decoder = Decoder<U>;

        fn encoder(&mut self) -> Self::Encoder {
            tonic_prost::ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
        }

        fn decoder(&mut self) -> Self::Decoder {
            Decoder(PhantomData)
        }
    }

    #[derive(Debug)]
    pub struct Decoder<U>(PhantomData<U>);

    impl<U: Message + Default> tonic::codec::Decoder for Decoder<U> {
        type Item = U;
        type Error = Status;

        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
            U::decode(buf).map(Some).map_err(|e| Status::invalid_argument(format!("malformed protobuf message: {e}")))
        }
    }
}

use pb::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use pb::infer_parameter::ParameterChoice;

pub fn status(e: &ServeError) -> Status {
    Status::new(tonic::Code::from_i32(e.status().grpc.as_u32() as i32), e.to_string())
}

#[derive(Clone)]
pub struct Service {
    pub state: Arc<State>,
    /// Who may use the repository (model-control) calls.
    pub control: Arc<ControlAccess>,
}

/// The tonic service with the message size limit applied.
pub fn service(state: Arc<State>, message_bytes_max: usize, control: ControlAccess) -> GrpcInferenceServiceServer<Service> {
    GrpcInferenceServiceServer::new(Service { state, control: Arc::new(control) })
        .max_decoding_message_size(message_bytes_max)
        .max_encoding_message_size(usize::MAX)
}

/// An `InferParameter` map in the decoder's neutral form.
fn params_of(p: &HashMap<String, pb::InferParameter>) -> Params {
    let param = |v: &pb::InferParameter| match &v.parameter_choice {
        None => Param::Null,
        Some(ParameterChoice::BoolParam(b)) => Param::Bool(*b),
        Some(ParameterChoice::Int64Param(i)) => Param::Int(*i),
        Some(ParameterChoice::Uint64Param(u)) => Param::Uint(*u),
        Some(ParameterChoice::DoubleParam(f)) => Param::Float(*f),
        Some(ParameterChoice::StringParam(s)) => Param::Str(s.clone()),
    };
    p.iter().map(|(k, v)| (k.clone(), param(v))).collect()
}

/// A decoded `ModelInferRequest`.
#[derive(Debug)]
pub struct Decoded {
    pub options: SubmitOptions,
    /// In the model's input order.
    pub inputs: Vec<Tensor>,
    /// Indices of the outputs to send back.
    pub outputs: Vec<usize>,
}

/// Decodes a `ModelInferRequest` against `m` (the model it names): parameters, inputs (each checked
/// against the model's declaration before its data is looked at) and the outputs asked for. Never
/// panics; errors name what is wrong. The message's own size is bounded by tonic's decoding limit.
pub fn decode_infer_request(m: &ModelEntry, r: &mut pb::ModelInferRequest) -> Result<Decoded, ServeError> {
    let params = params_of(&r.parameters);
    let requested: Vec<RequestedOutput> =
        r.outputs.iter().map(|o| RequestedOutput { name: o.name.clone(), params: params_of(&o.parameters) }).collect();
    // Outputs go back as raw bytes whatever their binary flags say.
    let decode::Decoded { options, outputs } = decode::decode(m, &params, &requested)?;
    let inputs = decode_inputs(m, r)?;
    let outputs = outputs.iter().map(|o| o.index).collect();
    Ok(Decoded { options, inputs, outputs })
}

fn decode_inputs(m: &ModelEntry, r: &mut pb::ModelInferRequest) -> Result<Vec<Tensor>, ServeError> {
    let raw = std::mem::take(&mut r.raw_input_contents);
    if !raw.is_empty() && raw.len() != r.inputs.len() {
        return Err(ServeError::invalid(format!("{} raw_input_contents for {} inputs", raw.len(), r.inputs.len())));
    }
    let mut slots: Vec<Option<Tensor>> = vec![None; m.inputs.len()];
    for (i, input) in r.inputs.iter_mut().enumerate() {
        let (count, dtype) = m.check_declared(&input.name, &input.datatype, &input.shape)?;
        let shape: Vec<usize> = input.shape.iter().map(|&d| d as usize).collect();
        let t = if let Some(bytes) = raw.get(i) {
            if input.contents.is_some() {
                return Err(ServeError::invalid(format!("input '{}' has both contents and raw_input_contents", input.name)));
            }
            let want = count * dtype.size_bytes();
            if bytes.len() != want {
                return Err(ServeError::invalid(format!(
                    "input '{}' has {} raw bytes, its {} shape {shape:?} takes {want}",
                    input.name,
                    bytes.len(),
                    input.datatype
                )));
            }
            Tensor::from_bytes(dtype, shape, bytes).map_err(ServeError::Invalid)?
        } else {
            let c =
                input.contents.take().ok_or_else(|| ServeError::invalid(format!("input '{}' has no contents", input.name)))?;
            let check = |n: usize| {
                if n == count {
                    Ok(())
                } else {
                    Err(ServeError::invalid(format!(
                        "input '{}' has {n} values, its shape {:?} holds {count}",
                        input.name, input.shape
                    )))
                }
            };
            match dtype {
                DType::F32 => {
                    check(c.fp32_contents.len())?;
                    Tensor::f32(shape, c.fp32_contents)
                }
                DType::I64 => {
                    check(c.int64_contents.len())?;
                    Tensor::i64(shape, c.int64_contents)
                }
                DType::F16 => {
                    return Err(ServeError::invalid(format!(
                        "input '{}' is FP16: send it as raw_input_contents (the protocol has no FP16 contents field)",
                        input.name
                    )));
                }
            }
        };
        m.bind_input(&mut slots, &input.name, t)?;
    }
    m.finish_inputs(slots)
}

fn int_param(v: u64) -> pb::InferParameter {
    pb::InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(v.min(i64::MAX as u64) as i64)) }
}

fn metadata(m: &ModelEntry) -> pb::ModelMetadataResponse {
    // A dynamic axis (within shape bounds) is -1, as KServe v2 numbers it.
    let t = |v: &[kairos_ir::plan::IoTensor], dims: &dyn Fn(usize) -> Vec<i64>| {
        v.iter()
            .enumerate()
            .map(|(i, t)| pb::model_metadata_response::TensorMetadata {
                name: t.name.clone(),
                datatype: t.dtype.kserve_name().into(),
                shape: dims(i),
            })
            .collect()
    };
    pb::ModelMetadataResponse {
        name: m.name().into(),
        versions: vec![m.config.version.clone()],
        platform: "kairos".into(),
        inputs: t(&m.inputs, &|i| m.input_dims(i)),
        outputs: t(&m.outputs, &|i| m.output_dims(i)),
    }
}

fn data_type(d: DType) -> i32 {
    match d {
        DType::F32 => pb::DataType::TypeFp32 as i32,
        DType::F16 => pb::DataType::TypeFp16 as i32,
        DType::I64 => pb::DataType::TypeInt64 as i32,
    }
}

fn config(m: &ModelEntry) -> pb::ModelConfig {
    pb::ModelConfig {
        name: m.name().into(),
        platform: "kairos".into(),
        backend: "kairos".into(),
        max_batch_size: 0,
        input: m
            .inputs
            .iter()
            .enumerate()
            .map(|(i, t)| pb::ModelInput { name: t.name.clone(), data_type: data_type(t.dtype), dims: m.input_dims(i) })
            .collect(),
        output: m
            .outputs
            .iter()
            .enumerate()
            .map(|(i, t)| pb::ModelOutput { name: t.name.clone(), data_type: data_type(t.dtype), dims: m.output_dims(i) })
            .collect(),
        instance_group: vec![pb::ModelInstanceGroup {
            name: format!("{}_0", m.name()),
            count: m.config.instances as i32,
            gpus: m.instance_gpus().iter().map(|&g| g as i32).collect(),
            kind: pb::model_instance_group::Kind::Gpu as i32,
        }],
        parameters: crate::rest::config_parameters(m)
            .into_iter()
            .map(|(k, v)| (k, pb::ModelParameter { string_value: v }))
            .collect(),
    }
}

fn statistics(m: &ModelEntry) -> pb::ModelStatistics {
    let s = &m.metrics;
    let d = |x: &crate::metrics::Duration| {
        let (count, ns) = x.get();
        Some(pb::StatisticDuration { count, ns })
    };
    let (count, _) = s.success.get();
    pb::ModelStatistics {
        name: m.name().into(),
        version: m.config.version.clone(),
        last_inference: s.last_inference_ms.load(std::sync::atomic::Ordering::Relaxed),
        inference_count: count,
        execution_count: count,
        inference_stats: Some(pb::InferStatistics {
            success: d(&s.success),
            fail: d(&s.fail),
            queue: d(&s.queue_stat),
            compute_input: d(&s.compute_input),
            compute_infer: d(&s.compute_infer),
            compute_output: d(&s.compute_output),
        }),
    }
}

impl Service {
    /// PERMISSION_DENIED with the reason when the control API refuses a request with this metadata.
    fn check_control<T>(&self, r: &Request<T>) -> Result<(), Status> {
        let key = r.metadata().get(CONTROL_KEY_HEADER).map(|v| v.as_bytes());
        self.control.check(key).map_err(Status::permission_denied)
    }

    #[allow(clippy::type_complexity)]
    async fn infer(
        &self,
        mut r: pb::ModelInferRequest,
    ) -> Result<(pb::ModelInferResponse, Arc<ModelEntry>, Class), (Option<Arc<ModelEntry>>, Class, ServeError)> {
        let state = &self.state;
        let m = state.resolve(&r.model_name, &r.model_version).map_err(|e| (None, Class::BestEffort, e))?;
        let fail = |class: Class, e: ServeError| (Some(m.clone()), class, e);
        let t_in = Instant::now();
        // A request that does not decode is counted under the model's class (on every protocol),
        // one that does under the class it runs as.
        let Decoded { options, inputs, outputs: wanted } =
            decode_infer_request(&m, &mut r).map_err(|e| fail(m.config.class, e))?;
        let class = options.engine.class;
        m.metrics.compute_input.add(t_in.elapsed().as_nanos() as u64);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let ticket = state
            .submit(&m, inputs, options, move |r| {
                let _ = tx.send(r);
            })
            .map_err(|e| fail(class, e))?;
        // Dropped with this future when the client cancels the call or goes away: the request
        // is cancelled, its GPU work stopped.
        let guard = CancelOnDrop::new(state.clone(), ticket);
        let done = rx.await;
        guard.disarm();
        let done = done
            .map_err(|_| fail(class, ServeError::Internal("the engine dropped the request".into())))?
            .map_err(|e| fail(class, e))?;
        let t_out = Instant::now();
        let mut outputs = Vec::with_capacity(wanted.len());
        let mut raw = Vec::with_capacity(wanted.len());
        for &i in &wanted {
            let t = &done.outputs[i];
            outputs.push(pb::model_infer_response::InferOutputTensor {
                name: m.outputs[i].name.clone(),
                datatype: t.dtype().kserve_name().into(),
                shape: t.shape.iter().map(|&d| d as i64).collect(),
                parameters: HashMap::new(),
                contents: None,
            });
            raw.push(bytes::Bytes::from(t.to_bytes()));
        }
        let mut parameters = HashMap::new();
        parameters.insert("kairos_engine_ns".to_string(), int_param(done.engine_ns));
        parameters.insert("kairos_gpu_ns".to_string(), int_param(done.gpu_ns()));
        parameters.insert("kairos_queue_ns".to_string(), int_param(done.timing.queue_ns()));
        parameters.insert(
            "kairos_deadline_missed".to_string(),
            pb::InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(done.timing.deadline_missed)) },
        );
        m.metrics.compute_output.add(t_out.elapsed().as_nanos() as u64);
        let resp = pb::ModelInferResponse {
            model_name: m.name().into(),
            model_version: m.config.version.clone(),
            id: r.id,
            parameters,
            outputs,
            raw_output_contents: raw,
        };
        Ok((resp, m, class))
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(&self, _: Request<pb::ServerLiveRequest>) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: self.state.not_live_reason().is_none() }))
    }

    async fn server_ready(&self, _: Request<pb::ServerReadyRequest>) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse { ready: self.state.is_ready() }))
    }

    async fn model_ready(&self, r: Request<pb::ModelReadyRequest>) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let r = r.into_inner();
        Ok(Response::new(pb::ModelReadyResponse { ready: self.state.resolve(&r.name, &r.version).is_ok() }))
    }

    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        Ok(Response::new(pb::ServerMetadataResponse {
            name: "kairos".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: crate::rest::EXTENSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn model_metadata(&self, r: Request<pb::ModelMetadataRequest>) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let r = r.into_inner();
        let m = self.state.resolve(&r.name, &r.version).map_err(|e| status(&e))?;
        Ok(Response::new(metadata(&m)))
    }

    async fn model_infer(&self, r: Request<pb::ModelInferRequest>) -> Result<Response<pb::ModelInferResponse>, Status> {
        match self.infer(r.into_inner()).await {
            Ok((resp, m, class)) => {
                self.state.count(Some(&m), class, Protocol::Grpc, Outcome::Ok);
                Ok(Response::new(resp))
            }
            Err((m, class, e)) => {
                self.state.count(m.as_deref(), class, Protocol::Grpc, e.status().outcome);
                Err(status(&e))
            }
        }
    }

    async fn model_config(&self, r: Request<pb::ModelConfigRequest>) -> Result<Response<pb::ModelConfigResponse>, Status> {
        let r = r.into_inner();
        let m = self.state.resolve(&r.name, &r.version).map_err(|e| status(&e))?;
        Ok(Response::new(pb::ModelConfigResponse { config: Some(config(&m)) }))
    }

    async fn model_statistics(
        &self,
        r: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        let r = r.into_inner();
        let model_stats = if r.name.is_empty() {
            self.state.ready_models().iter().map(|m| statistics(m)).collect()
        } else {
            let m = self.state.resolve(&r.name, &r.version).map_err(|e| status(&e))?;
            vec![statistics(&m)]
        };
        Ok(Response::new(pb::ModelStatisticsResponse { model_stats }))
    }

    async fn repository_index(
        &self,
        r: Request<pb::RepositoryIndexRequest>,
    ) -> Result<Response<pb::RepositoryIndexResponse>, Status> {
        self.check_control(&r)?;
        let r = r.into_inner();
        let models = self
            .state
            .index(r.ready)
            .into_iter()
            .map(|row| pb::repository_index_response::ModelIndex {
                name: row.name,
                version: row.version,
                state: row.state.into(),
                reason: row.reason,
            })
            .collect();
        Ok(Response::new(pb::RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        r: Request<pb::RepositoryModelLoadRequest>,
    ) -> Result<Response<pb::RepositoryModelLoadResponse>, Status> {
        self.check_control(&r)?;
        let r = r.into_inner();
        if !r.parameters.is_empty() {
            return Err(status(&ServeError::Unsupported(
                "load parameters (configuration or file overrides) are not supported: edit the repository folder".into(),
            )));
        }
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || state.load(&r.model_name))
            .await
            .map_err(|e| Status::internal(format!("the load task failed: {e}")))?
            .map_err(|e| status(&e))?;
        Ok(Response::new(pb::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        r: Request<pb::RepositoryModelUnloadRequest>,
    ) -> Result<Response<pb::RepositoryModelUnloadResponse>, Status> {
        self.check_control(&r)?;
        let r = r.into_inner();
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || state.unload(&r.model_name))
            .await
            .map_err(|e| Status::internal(format!("the unload task failed: {e}")))?
            .map_err(|e| status(&e))?;
        Ok(Response::new(pb::RepositoryModelUnloadResponse {}))
    }
}
