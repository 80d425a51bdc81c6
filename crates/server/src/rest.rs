//! The Open Inference Protocol over HTTP/1.1 (axum): health, metadata, inference with JSON tensors
//! and with the binary tensor data extension, and Triton's repository, configuration and statistics
//! extensions; plus `/metrics`.
//!
//! | method | path | answer |
//! |---|---|---|
//! | GET | `/v2/health/live`, `/v2/health/ready` | 200; ready: 503 with the reason while the start-up models load, a GPU is being reset or the server drains; live: 503 with the reason once a GPU failed for good (restart the process) |
//! | GET | `/v2` | server metadata |
//! | GET | `/v2/models/{m}[/versions/{v}]` | model metadata |
//! | GET | `/v2/models/{m}[/versions/{v}]/ready` | 200 when ready, else 404/503 |
//! | GET | `/v2/models/{m}[/versions/{v}]/config` | Triton's model configuration (JSON) |
//! | GET | `/v2/models[/{m}[/versions/{v}]]/stats` | Triton's statistics |
//! | POST | `/v2/models/{m}[/versions/{v}]/infer` | inference |
//! | POST | `/v2/repository/index` | every model with its state |
//! | POST | `/v2/repository/models/{m}/load`, `.../unload` | load (or reload) / unload |
//! | GET | `/metrics` | Prometheus metrics (OpenMetrics text) |
//!
//! Errors are `{"error": "..."}` with the status of [`ServeError::status`]. Bodies above the
//! configured limit get 413 before they are read whole. The repository endpoints answer 403 when
//! [`App::control`] refuses the request (see [`crate::control`]).

use crate::control::{CONTROL_KEY_HEADER, ControlAccess};
use crate::decode::{self, OutputChoice, Param, Params, RequestedOutput};
use crate::error::{Outcome, ServeError};
use crate::metrics::Protocol;
use crate::state::{CancelOnDrop, InferDone, ModelEntry, State, SubmitOptions};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State as AxState};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use kairos_ir::{DType, Tensor};
use kairos_sched::Class;
use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::time::Instant;

pub const HEADER_LENGTH: &str = "inference-header-content-length";

#[derive(Clone)]
pub struct App {
    pub state: Arc<State>,
    pub body_bytes_max: usize,
    /// Who may use the repository (model-control) endpoints.
    pub control: Arc<ControlAccess>,
}

/// The largest body of a repository index request (a JSON object with one flag).
pub const INDEX_BODY_BYTES_MAX: usize = 64 * 1024;
/// The largest body of a load or unload request.
pub const ADMIN_BODY_BYTES_MAX: usize = 1 << 20;

/// 403 with the reason when the control API refuses a request with these headers; `None` when it
/// accepts it.
fn control_refusal(app: &App, headers: &HeaderMap) -> Option<Response> {
    let reason = app.control.check(headers.get(CONTROL_KEY_HEADER).map(HeaderValue::as_bytes)).err()?;
    let body = serde_json::to_vec(&json!({ "error": reason })).unwrap_or_default();
    Some((StatusCode::FORBIDDEN, [(header::CONTENT_TYPE, "application/json")], body).into_response())
}

pub fn router(app: App) -> Router {
    Router::new()
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata_v))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready_v))
        .route("/v2/models/{model}/config", get(model_config))
        .route("/v2/models/{model}/versions/{version}/config", get(model_config_v))
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/versions/{version}/stats", get(model_stats_v))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_v))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/models/{model}/load", post(load))
        .route("/v2/repository/models/{model}/unload", post(unload))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app)
}

fn error_response(e: &ServeError) -> Response {
    let status = StatusCode::from_u16(e.status().http).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = serde_json::to_vec(&json!({ "error": e.to_string() })).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn json_response(v: &Value) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], serde_json::to_vec(v).unwrap_or_default()).into_response()
}

fn result_response(r: Result<Value, ServeError>) -> Response {
    match r {
        Ok(v) => json_response(&v),
        Err(e) => error_response(&e),
    }
}

async fn not_found() -> Response {
    error_response(&ServeError::NotFound("no such endpoint".into()))
}

/// 200 while the server can serve; 503 with the reason once an engine stopped for good (its GPU
/// failed and could not be reset: on CUDA a sticky error lasts for the life of the process), so
/// that a supervisor restarts the process.
async fn live(AxState(app): AxState<App>) -> Response {
    match app.state.not_live_reason() {
        None => StatusCode::OK.into_response(),
        Some(reason) => error_response(&ServeError::Unavailable(reason)),
    }
}

/// 200 once the start-up loading has finished; until then (and during a drain or the shutdown) 503
/// with the reason ("loading models: 2 of 5 done (now: resnet50, 12.3 s)").
async fn ready(AxState(app): AxState<App>) -> Response {
    match app.state.not_ready_reason() {
        None => StatusCode::OK.into_response(),
        Some(reason) => error_response(&ServeError::Unavailable(reason)),
    }
}

pub const EXTENSIONS: &[&str] = &["binary_tensor_data", "model_repository", "model_configuration", "statistics", "parameters"];

async fn server_metadata() -> Response {
    json_response(&json!({ "name": "kairos", "version": env!("CARGO_PKG_VERSION"), "extensions": EXTENSIONS }))
}

pub fn tensor_json(t: &kairos_ir::plan::IoTensor) -> Value {
    json!({ "name": t.name, "datatype": t.dtype.kserve_name(), "shape": t.shape })
}

pub fn metadata_json(m: &ModelEntry) -> Value {
    json!({
        "name": m.name(),
        "versions": [m.config.version],
        "platform": "kairos",
        // A dynamic axis (within shape bounds) is -1, as KServe v2 numbers it.
        "inputs": m.inputs.iter().enumerate().map(|(i, t)| json!({ "name": t.name, "datatype": t.dtype.kserve_name(), "shape": m.input_dims(i) })).collect::<Vec<_>>(),
        "outputs": m.outputs.iter().enumerate().map(|(i, t)| json!({ "name": t.name, "datatype": t.dtype.kserve_name(), "shape": m.output_dims(i) })).collect::<Vec<_>>(),
    })
}

async fn model_metadata(AxState(app): AxState<App>, Path(model): Path<String>) -> Response {
    result_response(app.state.resolve(&model, "").map(|m| metadata_json(&m)))
}

async fn model_metadata_v(AxState(app): AxState<App>, Path((model, version)): Path<(String, String)>) -> Response {
    result_response(app.state.resolve(&model, &version).map(|m| metadata_json(&m)))
}

fn ready_response(app: &App, model: &str, version: &str) -> Response {
    match app.state.resolve(model, version) {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => error_response(&e),
    }
}

async fn model_ready(AxState(app): AxState<App>, Path(model): Path<String>) -> Response {
    ready_response(&app, &model, "")
}

async fn model_ready_v(AxState(app): AxState<App>, Path((model, version)): Path<(String, String)>) -> Response {
    ready_response(&app, &model, &version)
}

fn triton_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "TYPE_FP32",
        DType::F16 => "TYPE_FP16",
        DType::I64 => "TYPE_INT64",
    }
}

/// Triton's model configuration, as JSON.
pub fn config_json(m: &ModelEntry) -> Value {
    let c = &m.config;
    let mut params = Map::new();
    for (k, v) in config_parameters(m) {
        params.insert(k, json!({ "string_value": v }));
    }
    json!({
        "name": m.name(),
        "platform": "kairos",
        "backend": "kairos",
        "max_batch_size": 0,
        "input": m.inputs.iter().enumerate().map(|(i, t)| json!({ "name": t.name, "data_type": triton_type(t.dtype), "dims": m.input_dims(i) })).collect::<Vec<_>>(),
        "output": m.outputs.iter().enumerate().map(|(i, t)| json!({ "name": t.name, "data_type": triton_type(t.dtype), "dims": m.output_dims(i) })).collect::<Vec<_>>(),
        "instance_group": [{ "name": format!("{}_0", m.name()), "kind": "KIND_GPU", "count": c.instances, "gpus": m.instance_gpus() }],
        "parameters": params,
    })
}

/// kairos' own settings of a model, as Triton-style string parameters.
pub fn config_parameters(m: &ModelEntry) -> Vec<(String, String)> {
    let c = &m.config;
    let mut v = vec![
        ("source".to_string(), c.source.describe()),
        ("dtype".to_string(), c.dtype.to_string()),
        ("batch".to_string(), c.batch.to_string()),
        ("class".to_string(), c.class_name().to_string()),
        ("priority_level".to_string(), c.priority_level.to_string()),
        ("tenant".to_string(), c.tenant.to_string()),
        ("kernels".to_string(), m.info.launches.to_string()),
        ("weight_bytes".to_string(), m.info.weight_bytes.to_string()),
        ("estimated_ns".to_string(), m.info.estimated_ns.to_string()),
    ];
    if let Some(d) = c.deadline_ns {
        v.push(("deadline_ms".to_string(), format!("{}", d as f64 / 1e6)));
    }
    if c.shapes.is_dynamic() {
        v.push(("seq_len".to_string(), c.seq_len.to_string()));
        if let Some(b) = c.shapes.batch_max {
            v.push(("batch_max".to_string(), b.to_string()));
        }
        if let Some((lo, hi)) = c.shapes.seq_len {
            v.push(("seq_len_min".to_string(), lo.to_string()));
            v.push(("seq_len_max".to_string(), hi.to_string()));
        }
        v.push(("shape_plans_max".to_string(), c.shapes.plans_max.to_string()));
        if let Some(d) = &m.dynamic {
            let loaded: Vec<String> = d.loaded_shapes().iter().map(|k| format!("b{}s{}", k.batch, k.seq_len)).collect();
            v.push(("shape_variants_loaded".to_string(), loaded.join(",")));
        }
    }
    v
}

async fn model_config(AxState(app): AxState<App>, Path(model): Path<String>) -> Response {
    result_response(app.state.resolve(&model, "").map(|m| config_json(&m)))
}

async fn model_config_v(AxState(app): AxState<App>, Path((model, version)): Path<(String, String)>) -> Response {
    result_response(app.state.resolve(&model, &version).map(|m| config_json(&m)))
}

pub fn stats_json(m: &ModelEntry) -> Value {
    let s = &m.metrics;
    let d = |x: &crate::metrics::Duration| {
        let (count, ns) = x.get();
        json!({ "count": count, "ns": ns })
    };
    let (count, _) = s.success.get();
    json!({
        "name": m.name(),
        "version": m.config.version,
        "last_inference": s.last_inference_ms.load(std::sync::atomic::Ordering::Relaxed),
        "inference_count": count,
        "execution_count": count,
        "inference_stats": {
            "success": d(&s.success), "fail": d(&s.fail), "queue": d(&s.queue_stat),
            "compute_input": d(&s.compute_input), "compute_infer": d(&s.compute_infer), "compute_output": d(&s.compute_output),
            "cache_hit": { "count": 0, "ns": 0 }, "cache_miss": { "count": 0, "ns": 0 },
        },
        "batch_stats": [],
    })
}

async fn all_stats(AxState(app): AxState<App>) -> Response {
    let rows: Vec<Value> = app.state.ready_models().iter().map(|m| stats_json(m)).collect();
    json_response(&json!({ "model_stats": rows }))
}

async fn model_stats(AxState(app): AxState<App>, Path(model): Path<String>) -> Response {
    result_response(app.state.resolve(&model, "").map(|m| json!({ "model_stats": [stats_json(&m)] })))
}

async fn model_stats_v(AxState(app): AxState<App>, Path((model, version)): Path<(String, String)>) -> Response {
    result_response(app.state.resolve(&model, &version).map(|m| json!({ "model_stats": [stats_json(&m)] })))
}

async fn repository_index(AxState(app): AxState<App>, headers: HeaderMap, body: Body) -> Response {
    if let Some(refused) = control_refusal(&app, &headers) {
        return refused;
    }
    let r = async {
        let bytes = read_body(&headers, body, INDEX_BODY_BYTES_MAX).await?;
        let ready_only = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            false
        } else {
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| ServeError::invalid(format!("malformed JSON: {e}")))?;
            v.get("ready").and_then(Value::as_bool).unwrap_or(false)
        };
        let rows: Vec<Value> = app
            .state
            .index(ready_only)
            .into_iter()
            .map(|r| json!({ "name": r.name, "version": r.version, "state": r.state, "reason": r.reason }))
            .collect();
        Ok(Value::Array(rows))
    }
    .await;
    result_response(r)
}

async fn admin(app: App, headers: HeaderMap, body: Body, model: String, load: bool) -> Response {
    if let Some(refused) = control_refusal(&app, &headers) {
        return refused;
    }
    let r = async {
        let bytes = read_body(&headers, body, ADMIN_BODY_BYTES_MAX).await?;
        if !bytes.iter().all(|b| b.is_ascii_whitespace()) {
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| ServeError::invalid(format!("malformed JSON: {e}")))?;
            // Unload's `unload_dependents` means nothing here (no ensembles); load overrides are refused.
            if load && v.get("parameters").and_then(Value::as_object).is_some_and(|p| !p.is_empty()) {
                return Err(ServeError::Unsupported(
                    "load parameters (configuration or file overrides) are not supported: edit the repository folder".into(),
                ));
            }
        }
        let state = app.state.clone();
        let m = model.clone();
        tokio::task::spawn_blocking(move || if load { state.load(&m) } else { state.unload(&m) })
            .await
            .map_err(|e| ServeError::Internal(format!("the load task failed: {e}")))??;
        Ok(())
    }
    .await;
    match r {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => error_response(&e),
    }
}

async fn load(AxState(app): AxState<App>, Path(model): Path<String>, headers: HeaderMap, body: Body) -> Response {
    admin(app, headers, body, model, true).await
}

async fn unload(AxState(app): AxState<App>, Path(model): Path<String>, headers: HeaderMap, body: Body) -> Response {
    admin(app, headers, body, model, false).await
}

async fn metrics(AxState(app): AxState<App>) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], app.state.render_metrics()).into_response()
}

/// Reads a body of at most `limit` bytes (413 beyond, checked on Content-Length first).
pub async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ServeError> {
    let too_large = |n: Option<u64>| {
        ServeError::TooLarge(match n {
            Some(n) => format!("the body of {n} bytes exceeds the limit of {limit} bytes"),
            None => format!("the body exceeds the limit of {limit} bytes"),
        })
    };
    if let Some(enc) = headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok())
        && !enc.eq_ignore_ascii_case("identity")
    {
        return Err(ServeError::Unsupported(format!("Content-Encoding '{enc}' is not supported: send the body uncompressed")));
    }
    if let Some(n) = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
        && n > limit as u64
    {
        return Err(too_large(Some(n)));
    }
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let inner = e.into_inner();
            let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&*inner);
            while let Some(s) = src {
                if s.is::<http_body_util::LengthLimitError>() {
                    return Err(too_large(None));
                }
                src = s.source();
            }
            Err(ServeError::invalid(format!("reading the body: {inner}")))
        }
    }
}

// ---------------------------------------------------------------- inference

/// One number of a JSON tensor.
#[derive(Clone, Copy, Debug)]
enum Num {
    I(i64),
    F(f64),
}

/// A JSON tensor's data, nested arrays flattened in row-major order while parsing.
#[derive(Debug, Default)]
struct FlatData(Vec<Num>);

struct Flatten<'a>(&'a mut Vec<Num>);

thread_local! {
    /// The most values one input's `data` may hold while a request is parsed on this thread: the
    /// model's largest input (set by [`decode_infer_request`]), so a body of a million numbers
    /// for a 64-value input is refused as it is read, not after 16 bytes per number were allocated.
    static DATA_VALUES_MAX: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

impl Flatten<'_> {
    fn push<E: serde::de::Error>(&mut self, n: Num) -> Result<(), E> {
        let max = DATA_VALUES_MAX.with(|m| m.get());
        if self.0.len() >= max {
            return Err(E::custom(format!(
                "an input's data holds more than {max} values, the most any input of the model takes"
            )));
        }
        self.0.push(n);
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Flatten<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Flatten<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("numbers or (nested) arrays of numbers")
    }
    fn visit_i64<E: serde::de::Error>(mut self, v: i64) -> Result<(), E> {
        self.push(Num::I(v))
    }
    fn visit_u64<E: serde::de::Error>(mut self, v: u64) -> Result<(), E> {
        let v = i64::try_from(v).map_err(|_| E::custom(format!("{v} does not fit INT64")))?;
        self.push(Num::I(v))
    }
    fn visit_f64<E: serde::de::Error>(mut self, v: f64) -> Result<(), E> {
        self.push(Num::F(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Flatten(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

impl<'de> Deserialize<'de> for FlatData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FlatData, D::Error> {
        let mut v = Vec::new();
        d.deserialize_any(Flatten(&mut v))?;
        Ok(FlatData(v))
    }
}

#[derive(Deserialize)]
struct InputJson {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(default)]
    data: Option<FlatData>,
}

#[derive(Deserialize)]
struct OutputJson {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

#[derive(Deserialize)]
struct InferRequestJson {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    inputs: Vec<InputJson>,
    #[serde(default)]
    outputs: Option<Vec<OutputJson>>,
}

/// A JSON `parameters` object in the decoder's neutral form.
fn params_of(p: Option<&Map<String, Value>>) -> Params {
    let param = |v: &Value| match v {
        Value::Null => Param::Null,
        Value::Bool(b) => Param::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Param::Uint(u),
            (None, Some(i)) => Param::Int(i),
            (None, None) => Param::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Param::Str(s.clone()),
        Value::Array(_) | Value::Object(_) => Param::Other,
    };
    p.map(|p| p.iter().map(|(k, v)| (k.clone(), param(v))).collect()).unwrap_or_default()
}

fn tensor_from_nums(name: &str, dtype: DType, shape: Vec<usize>, count: usize, nums: Vec<Num>) -> Result<Tensor, ServeError> {
    if nums.len() != count {
        return Err(ServeError::invalid(format!("input '{name}' has {} values, its shape {shape:?} holds {count}", nums.len())));
    }
    Ok(match dtype {
        DType::I64 => {
            let mut v = Vec::with_capacity(count);
            for n in nums {
                v.push(match n {
                    Num::I(i) => i,
                    Num::F(f) if f.fract() == 0.0 && f.abs() < 9.2e18 => f as i64,
                    Num::F(f) => return Err(ServeError::invalid(format!("input '{name}' is INT64 but holds {f}"))),
                });
            }
            Tensor::i64(shape, v)
        }
        d => {
            let v: Vec<f32> = nums
                .into_iter()
                .map(|n| match n {
                    Num::I(i) => i as f32,
                    Num::F(f) => f as f32,
                })
                .collect();
            Tensor::f32(shape, v).cast(d)
        }
    })
}

/// A decoded inference request.
pub struct Decoded {
    pub id: Option<String>,
    pub model: Arc<ModelEntry>,
    pub options: SubmitOptions,
    /// In the model's input order.
    pub inputs: Vec<Tensor>,
    pub outputs: Vec<OutputChoice>,
}

/// Decodes an inference request's body (JSON, or JSON followed by binary tensors when the
/// `Inference-Header-Content-Length` header is set) against `model`: every input's name, datatype
/// and shape is checked against the model before its data is decoded, so no claimed size leads to
/// an allocation larger than the body. Never panics; errors name what is wrong.
pub fn decode_infer_request(model: &Arc<ModelEntry>, headers: &HeaderMap, body: &[u8]) -> Result<Decoded, ServeError> {
    let header_len = match headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or_else(|| ServeError::invalid("Inference-Header-Content-Length is not a number"))?,
        ),
    };
    let (head, mut binary): (&[u8], &[u8]) = match header_len {
        Some(n) if n <= body.len() => (&body[..n], &body[n..]),
        Some(n) => {
            return Err(ServeError::invalid(format!(
                "Inference-Header-Content-Length {n} exceeds the body's {} bytes",
                body.len()
            )));
        }
        None => (body, &[]),
    };
    let values_max = model.input_values_max();
    let previous = DATA_VALUES_MAX.with(|m| m.replace(values_max));
    let req = serde_json::from_slice::<InferRequestJson>(head);
    DATA_VALUES_MAX.with(|m| m.set(previous));
    let req = req.map_err(|e| ServeError::invalid(format!("malformed inference request JSON: {e}")))?;
    let params = params_of(req.parameters.as_ref());
    let requested: Vec<RequestedOutput> = req
        .outputs
        .unwrap_or_default()
        .into_iter()
        .map(|o| RequestedOutput { params: params_of(o.parameters.as_ref()), name: o.name })
        .collect();
    let decode::Decoded { options, outputs } = decode::decode(model, &params, &requested)?;
    let mut slots: Vec<Option<Tensor>> = vec![None; model.inputs.len()];
    for input in req.inputs {
        let (count, dtype) = model.check_declared(&input.name, &input.datatype, &input.shape)?;
        let shape: Vec<usize> = input.shape.iter().map(|&d| d as usize).collect();
        let binary_size = decode::uint(&params_of(input.parameters.as_ref()), "binary_data_size")?;
        let t = match (binary_size, input.data) {
            (Some(_), Some(_)) => {
                return Err(ServeError::invalid(format!("input '{}' has both data and binary_data_size", input.name)));
            }
            (Some(size), None) => {
                let want = (count * dtype.size_bytes()) as u64;
                if size != want {
                    return Err(ServeError::invalid(format!(
                        "input '{}' declares {size} binary bytes, its {} shape {shape:?} takes {want}",
                        input.name, input.datatype
                    )));
                }
                if size as usize > binary.len() {
                    return Err(ServeError::invalid(format!(
                        "input '{}' wants {size} binary bytes, {} are left in the body",
                        input.name,
                        binary.len()
                    )));
                }
                let (this, rest) = binary.split_at(size as usize);
                binary = rest;
                Tensor::from_bytes(dtype, shape, this).map_err(ServeError::Invalid)?
            }
            (None, Some(data)) => tensor_from_nums(&input.name, dtype, shape, count, data.0)?,
            (None, None) => {
                return Err(ServeError::invalid(format!("input '{}' has no data and no binary_data_size", input.name)));
            }
        };
        model.bind_input(&mut slots, &input.name, t)?;
    }
    if !binary.is_empty() {
        return Err(ServeError::invalid(format!("{} binary bytes after the last input", binary.len())));
    }
    let inputs = model.finish_inputs(slots)?;
    Ok(Decoded { id: req.id, model: model.clone(), options, inputs, outputs })
}

#[derive(Serialize)]
#[serde(untagged)]
enum DataOut<'a> {
    F32(&'a [f32]),
    F32Owned(Vec<f32>),
    I64(&'a [i64]),
}

#[derive(Serialize)]
struct OutputOut<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [usize],
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<DataOut<'a>>,
}

#[derive(Serialize)]
struct ResponseOut<'a> {
    model_name: &'a str,
    model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    parameters: Value,
    outputs: Vec<OutputOut<'a>>,
}

/// The response parameters every front end returns.
pub fn timing_parameters(done: &InferDone) -> Value {
    json!({
        "kairos_engine_ns": done.engine_ns,
        "kairos_gpu_ns": done.gpu_ns(),
        "kairos_queue_ns": done.timing.queue_ns(),
        "kairos_deadline_missed": done.timing.deadline_missed,
    })
}

fn encode(d: &Decoded, done: &InferDone) -> Response {
    let model = &d.model;
    let mut outs = Vec::with_capacity(d.outputs.len());
    let mut binary_parts: Vec<Vec<u8>> = Vec::new();
    for choice in &d.outputs {
        let decl = &model.outputs[choice.index];
        let t = &done.outputs[choice.index];
        let (parameters, data) = if choice.binary {
            let bytes = t.to_bytes();
            let p = json!({ "binary_data_size": bytes.len() });
            binary_parts.push(bytes);
            (Some(p), None)
        } else {
            let data = match &t.data {
                kairos_ir::tensor::TensorData::F32(v) => DataOut::F32(v),
                kairos_ir::tensor::TensorData::I64(v) => DataOut::I64(v),
                kairos_ir::tensor::TensorData::F16(_) => DataOut::F32Owned(t.to_f32_vec()),
            };
            (None, Some(data))
        };
        outs.push(OutputOut { name: &decl.name, datatype: t.dtype().kserve_name(), shape: &t.shape, parameters, data });
    }
    let resp = ResponseOut {
        model_name: model.name(),
        model_version: &model.config.version,
        id: d.id.as_deref(),
        parameters: timing_parameters(done),
        outputs: outs,
    };
    let mut body = serde_json::to_vec(&resp).unwrap_or_default();
    if binary_parts.is_empty() {
        return (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    }
    let n = body.len();
    for p in binary_parts {
        body.extend_from_slice(&p);
    }
    let mut r = (StatusCode::OK, [(header::CONTENT_TYPE, "application/octet-stream")], body).into_response();
    r.headers_mut().insert(HEADER_LENGTH, HeaderValue::from(n));
    r
}

async fn infer_impl(app: App, model: String, version: String, headers: HeaderMap, body: Body) -> Response {
    let state = app.state.clone();
    let mut entry: Option<Arc<ModelEntry>> = None;
    let mut class = Class::BestEffort;
    let r: Result<Response, ServeError> = async {
        let m = state.resolve(&model, &version)?;
        class = m.config.class;
        entry = Some(m.clone());
        let bytes = read_body(&headers, body, app.body_bytes_max).await?;
        let t_in = Instant::now();
        let mut decoded = decode_infer_request(&m, &headers, &bytes)?;
        drop(bytes);
        let options = std::mem::take(&mut decoded.options);
        class = options.engine.class;
        m.metrics.compute_input.add(t_in.elapsed().as_nanos() as u64);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let inputs = std::mem::take(&mut decoded.inputs);
        let ticket = state.submit(&m, inputs, options, move |r| {
            let _ = tx.send(r);
        })?;
        // Dropped with this future when the client's connection goes away: the request is
        // cancelled, its GPU work stopped.
        let guard = CancelOnDrop::new(state.clone(), ticket);
        let done = rx.await.map_err(|_| ServeError::Internal("the engine dropped the request".into()));
        guard.disarm();
        let done = done??;
        let t_out = Instant::now();
        let resp = encode(&decoded, &done);
        m.metrics.compute_output.add(t_out.elapsed().as_nanos() as u64);
        Ok(resp)
    }
    .await;
    match r {
        Ok(resp) => {
            state.count(entry.as_deref(), class, Protocol::Http, Outcome::Ok);
            resp
        }
        Err(e) => {
            state.count(entry.as_deref(), class, Protocol::Http, e.status().outcome);
            error_response(&e)
        }
    }
}

async fn infer(AxState(app): AxState<App>, Path(model): Path<String>, headers: HeaderMap, body: Body) -> Response {
    infer_impl(app, model, String::new(), headers, body).await
}

async fn infer_v(
    AxState(app): AxState<App>,
    Path((model, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    infer_impl(app, model, version, headers, body).await
}
