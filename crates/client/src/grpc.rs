//! The Open Inference Protocol over gRPC (tonic).
//!
//! ```no_run
//! # async fn f() -> kairos_client::Result<()> {
//! use kairos_client::{InferOptions, grpc::GrpcClient};
//! let client = GrpcClient::connect("http://127.0.0.1:8001").await?;
//! let meta = client.model_metadata("resnet18", "").await?;
//! let x = kairos_core::Tensor::zeros(kairos_core::DType::F32, vec![1, 3, 224, 224]);
//! let r = client.infer("resnet18", "", &[(&meta.inputs[0].name, &x)], &InferOptions::default()).await?;
//! println!("{:?} in {} ns of engine time", r.outputs[0].1.shape, r.timing.engine_ns);
//! # Ok(()) }
//! ```

use crate::pb::{self, grpc_inference_service_client::GrpcInferenceServiceClient, infer_parameter::ParameterChoice};
use crate::{ClientError, Code, InferOptions, InferResult, ModelMetadata, Result, ServerTiming, TensorMetadata};
use kairos_core::Tensor;
use std::collections::HashMap;
use tonic::transport::Channel;

/// A gRPC client; cheap to clone (clones share one HTTP/2 connection). [`GrpcClient::connect`] for
/// plain HTTP/2; [`GrpcClient::builder`] for TLS (a CA certificate to trust) or a model-control key.
#[derive(Clone)]
pub struct GrpcClient {
    inner: GrpcInferenceServiceClient<Channel>,
    control_key: Option<tonic::metadata::AsciiMetadataValue>,
}

impl std::fmt::Debug for GrpcClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("GrpcClient").field("control_key", &self.control_key.is_some()).finish_non_exhaustive()
    }
}

/// Options of a [`GrpcClient`]: see [`GrpcClient::builder`].
#[derive(Clone, Default)]
pub struct GrpcClientBuilder {
    url: String,
    remote: crate::tls::RemoteOptions,
    tls_domain: Option<String>,
}

impl GrpcClientBuilder {
    /// Sends `key` in the `x-kairos-control-key` metadata of the model-control calls (repository
    /// index, load, unload), for servers started with `--control-api KEY`.
    pub fn control_key(mut self, key: impl Into<String>) -> Self {
        self.remote.control_key = Some(key.into());
        self
    }

    /// Trusts the CA certificate(s) in `pem` (PEM text) for an `https://` url; only these, not the
    /// system's roots.
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.remote.ca_pem = Some(pem.into());
        self
    }

    /// [`GrpcClientBuilder::tls_ca_pem`] with the contents of a file.
    pub fn tls_ca_file(self, path: impl AsRef<std::path::Path>) -> Result<Self> {
        Ok(self.tls_ca_pem(crate::tls::RemoteOptions::read_ca_file(path.as_ref())?))
    }

    /// The name the server's certificate must carry (default: the url's host).
    pub fn tls_domain(mut self, name: impl Into<String>) -> Self {
        self.tls_domain = Some(name.into());
        self
    }

    /// Connects (and, over TLS, shakes hands): fails if the server cannot be reached or its
    /// certificate is not signed by the given CA.
    pub async fn connect(mut self) -> Result<GrpcClient> {
        let url = self.url;
        let control_key = self.remote.take_control_key::<tonic::metadata::AsciiMetadataValue>("metadata")?;
        let mut endpoint = tonic::transport::Endpoint::from_shared(url.clone())
            .map_err(|e| ClientError::Usage(format!("bad url '{url}': {e}")))?
            .tcp_nodelay(true);
        if let Some(pem) = self.remote.take_ca_for(&url, "GrpcClient")? {
            // Checked here for a clear error; tonic parses it again.
            crate::tls::ca_certificates(&pem)?;
            let mut tls = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pem));
            if let Some(d) = self.tls_domain {
                tls = tls.domain_name(d);
            }
            endpoint = endpoint.tls_config(tls).map_err(|e| ClientError::Usage(format!("TLS for '{url}': {e}")))?;
        }
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| ClientError::Transport(format!("connect to {url}: {}", crate::error_chain(&e))))?;
        Ok(GrpcClient { inner: GrpcInferenceServiceClient::new(channel).max_decoding_message_size(usize::MAX), control_key })
    }
}

fn status(s: tonic::Status) -> ClientError {
    let code = Code::from_u32(s.code() as i32 as u32);
    ClientError::Server { code, message: s.message().to_string() }
}

fn int_param(v: i64) -> pb::InferParameter {
    pb::InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(v)) }
}

/// The request parameters that carry `opts`.
pub fn request_parameters(opts: &InferOptions) -> HashMap<String, pb::InferParameter> {
    let mut p = HashMap::new();
    if opts.priority != 0 {
        p.insert("priority".to_string(), int_param(opts.priority as i64));
    }
    if opts.deadline_us != 0 {
        p.insert("kairos_deadline_us".to_string(), int_param(opts.deadline_us.min(i64::MAX as u64) as i64));
    }
    if opts.timeout_us != 0 {
        p.insert("timeout".to_string(), int_param(opts.timeout_us as i64));
    }
    if let Some(rt) = opts.real_time {
        let class = if rt { "real-time" } else { "best-effort" };
        p.insert(
            "kairos_class".to_string(),
            pb::InferParameter { parameter_choice: Some(ParameterChoice::StringParam(class.into())) },
        );
    }
    if let Some(t) = opts.tenant {
        p.insert("kairos_tenant".to_string(), int_param(t as i64));
    }
    p
}

/// The server's timing parameters of a response.
pub fn timing_of(p: &HashMap<String, pb::InferParameter>) -> ServerTiming {
    let int = |k: &str| match p.get(k).and_then(|v| v.parameter_choice.as_ref()) {
        Some(ParameterChoice::Int64Param(v)) => *v as u64,
        Some(ParameterChoice::Uint64Param(v)) => *v,
        _ => 0,
    };
    ServerTiming {
        engine_ns: int("kairos_engine_ns"),
        gpu_ns: int("kairos_gpu_ns"),
        queue_ns: int("kairos_queue_ns"),
        deadline_missed: matches!(
            p.get("kairos_deadline_missed").and_then(|v| v.parameter_choice.as_ref()),
            Some(ParameterChoice::BoolParam(true))
        ),
    }
}

/// A request with raw input contents for `inputs` (name, tensor), asking for every output.
pub fn infer_request(model: &str, version: &str, inputs: &[(&str, &Tensor)], opts: &InferOptions) -> pb::ModelInferRequest {
    pb::ModelInferRequest {
        model_name: model.to_string(),
        model_version: version.to_string(),
        id: String::new(),
        parameters: request_parameters(opts),
        inputs: inputs
            .iter()
            .map(|(name, t)| pb::model_infer_request::InferInputTensor {
                name: name.to_string(),
                datatype: t.dtype().kserve_name().to_string(),
                shape: crate::shape_i64(&t.shape),
                parameters: HashMap::new(),
                contents: None,
            })
            .collect(),
        outputs: Vec::new(),
        raw_input_contents: inputs.iter().map(|(_, t)| bytes::Bytes::from(t.to_bytes())).collect(),
    }
}

/// The outputs of a response, decoded.
pub fn decode_response(r: pb::ModelInferResponse) -> Result<InferResult> {
    let mut outputs = Vec::with_capacity(r.outputs.len());
    for (i, o) in r.outputs.iter().enumerate() {
        let dtype = crate::dtype_of(&o.datatype)
            .ok_or_else(|| ClientError::Protocol(format!("output '{}' has datatype {}", o.name, o.datatype)))?;
        let shape = crate::shape_usize(&o.shape).map_err(ClientError::Protocol)?;
        let t = if let Some(raw) = r.raw_output_contents.get(i) {
            Tensor::from_bytes(dtype, shape, raw).map_err(ClientError::Protocol)?
        } else if let Some(c) = &o.contents {
            match dtype {
                kairos_core::DType::I64 => Tensor::i64(shape, c.int64_contents.clone()),
                _ => Tensor::f32(shape, c.fp32_contents.clone()).cast(dtype),
            }
        } else {
            return Err(ClientError::Protocol(format!("output '{}' has no data", o.name)));
        };
        outputs.push((o.name.clone(), t));
    }
    Ok(InferResult {
        model_name: r.model_name,
        model_version: r.model_version,
        id: r.id,
        timing: timing_of(&r.parameters),
        outputs,
    })
}

impl GrpcClient {
    /// Connects to `url` (for example `http://127.0.0.1:8001`), plain HTTP/2, no control key.
    pub async fn connect(url: &str) -> Result<GrpcClient> {
        GrpcClient::builder(url).connect().await
    }

    /// Options for a client of `url`: `https://` with [`GrpcClientBuilder::tls_ca_pem`], and
    /// [`GrpcClientBuilder::control_key`]. Finish with [`GrpcClientBuilder::connect`].
    ///
    /// ```no_run
    /// # async fn f(ca_pem: &[u8]) -> kairos_client::Result<()> {
    /// let client = kairos_client::grpc::GrpcClient::builder("https://kairos.local:8001")
    ///     .tls_ca_pem(ca_pem)
    ///     .control_key("a-key-of-16-characters-or-more")
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(url: &str) -> GrpcClientBuilder {
        GrpcClientBuilder { url: url.to_string(), ..GrpcClientBuilder::default() }
    }

    /// `msg` as a request carrying the control key (if this client has one).
    fn control_request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(k) = &self.control_key {
            r.metadata_mut().insert(crate::CONTROL_KEY_HEADER, k.clone());
        }
        r
    }

    /// The generated client, for calls this wrapper does not cover.
    pub fn raw(&self) -> GrpcInferenceServiceClient<Channel> {
        self.inner.clone()
    }

    pub async fn server_live(&self) -> Result<bool> {
        Ok(self.raw().server_live(pb::ServerLiveRequest {}).await.map_err(status)?.into_inner().live)
    }

    pub async fn server_ready(&self) -> Result<bool> {
        Ok(self.raw().server_ready(pb::ServerReadyRequest {}).await.map_err(status)?.into_inner().ready)
    }

    pub async fn model_ready(&self, name: &str, version: &str) -> Result<bool> {
        let r = pb::ModelReadyRequest { name: name.into(), version: version.into() };
        Ok(self.raw().model_ready(r).await.map_err(status)?.into_inner().ready)
    }

    pub async fn server_metadata(&self) -> Result<pb::ServerMetadataResponse> {
        Ok(self.raw().server_metadata(pb::ServerMetadataRequest {}).await.map_err(status)?.into_inner())
    }

    pub async fn model_metadata(&self, name: &str, version: &str) -> Result<ModelMetadata> {
        let r = pb::ModelMetadataRequest { name: name.into(), version: version.into() };
        let m = self.raw().model_metadata(r).await.map_err(status)?.into_inner();
        let conv = |v: Vec<pb::model_metadata_response::TensorMetadata>| {
            v.into_iter().map(|t| TensorMetadata { name: t.name, datatype: t.datatype, shape: t.shape }).collect()
        };
        Ok(ModelMetadata {
            name: m.name,
            versions: m.versions,
            platform: m.platform,
            inputs: conv(m.inputs),
            outputs: conv(m.outputs),
        })
    }

    pub async fn model_config(&self, name: &str, version: &str) -> Result<pb::ModelConfig> {
        let r = pb::ModelConfigRequest { name: name.into(), version: version.into() };
        self.raw()
            .model_config(r)
            .await
            .map_err(status)?
            .into_inner()
            .config
            .ok_or_else(|| ClientError::Protocol("a ModelConfig response without a config".into()))
    }

    pub async fn model_statistics(&self, name: &str, version: &str) -> Result<pb::ModelStatisticsResponse> {
        let r = pb::ModelStatisticsRequest { name: name.into(), version: version.into() };
        Ok(self.raw().model_statistics(r).await.map_err(status)?.into_inner())
    }

    pub async fn repository_index(&self, ready_only: bool) -> Result<pb::RepositoryIndexResponse> {
        let r = pb::RepositoryIndexRequest { repository_name: String::new(), ready: ready_only };
        Ok(self.raw().repository_index(self.control_request(r)).await.map_err(status)?.into_inner())
    }

    pub async fn load_model(&self, name: &str) -> Result<()> {
        let r = pb::RepositoryModelLoadRequest {
            repository_name: String::new(),
            model_name: name.into(),
            parameters: HashMap::new(),
        };
        self.raw().repository_model_load(self.control_request(r)).await.map_err(status)?;
        Ok(())
    }

    pub async fn unload_model(&self, name: &str) -> Result<()> {
        let r = pb::RepositoryModelUnloadRequest {
            repository_name: String::new(),
            model_name: name.into(),
            parameters: HashMap::new(),
        };
        self.raw().repository_model_unload(self.control_request(r)).await.map_err(status)?;
        Ok(())
    }

    /// One request: inputs as (name, tensor) with raw contents; every output comes back.
    pub async fn infer(
        &self,
        model: &str,
        version: &str,
        inputs: &[(&str, &Tensor)],
        opts: &InferOptions,
    ) -> Result<InferResult> {
        self.infer_raw(infer_request(model, version, inputs, opts)).await
    }

    /// A request built by the caller (see [`infer_request`]).
    pub async fn infer_raw(&self, request: pb::ModelInferRequest) -> Result<InferResult> {
        let r = self.raw().model_infer(request).await.map_err(status)?.into_inner();
        decode_response(r)
    }
}
