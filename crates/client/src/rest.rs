//! The Open Inference Protocol over HTTP/1.1 (hyper): JSON tensors, and the binary tensor data
//! extension (a JSON header of `Inference-Header-Content-Length` bytes followed by raw tensor
//! bytes), as Triton and tritonclient use it.

use crate::{ClientError, Code, InferOptions, InferResult, ModelMetadata, Result, ServerTiming, TensorMetadata};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kairos_core::{DType, Tensor};
use serde_json::{Map, Value, json};

/// The header that gives the JSON part's length in binary requests and responses.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// A REST client with a pool of keep-alive connections; cheap to clone. [`RestClient::new`] for
/// plain HTTP; [`RestClient::builder`] for HTTPS (a CA certificate to trust) or a model-control key.
#[derive(Clone)]
pub struct RestClient {
    base: String,
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    control_key: Option<hyper::header::HeaderValue>,
}

impl std::fmt::Debug for RestClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("RestClient").field("base", &self.base).field("control_key", &self.control_key.is_some()).finish()
    }
}

/// Options of a [`RestClient`]: see [`RestClient::builder`].
#[derive(Clone, Default)]
pub struct RestClientBuilder {
    base: String,
    remote: crate::tls::RemoteOptions,
}

impl RestClientBuilder {
    /// Sends `key` in the `x-kairos-control-key` header of the model-control calls (repository
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

    /// [`RestClientBuilder::tls_ca_pem`] with the contents of a file.
    pub fn tls_ca_file(self, path: impl AsRef<std::path::Path>) -> Result<Self> {
        Ok(self.tls_ca_pem(crate::tls::RemoteOptions::read_ca_file(path.as_ref())?))
    }

    pub fn build(mut self) -> Result<RestClient> {
        let base = self.base;
        let https = base.starts_with("https://");
        if !https && !base.starts_with("http://") {
            return Err(ClientError::Usage(format!("'{base}' is not an http:// or https:// url")));
        }
        // hyper-rustls sets ALPN (http/1.1) itself. Plain http:// never uses the configuration (no
        // CA then), but the connector wants one.
        let ca_pem = self.remote.take_ca_for(&base, "RestClient")?;
        let tls = crate::tls::client_config(ca_pem.as_deref().unwrap_or(b""), &[])?;
        let control_key = self.remote.take_control_key::<hyper::header::HeaderValue>("a header")?;
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
        let connector = if https { builder.https_only() } else { builder.https_or_http() };
        let connector = connector.enable_http1().wrap_connector(http);
        let http = Client::builder(TokioExecutor::new()).build(connector);
        Ok(RestClient { base: base.trim_end_matches('/').to_string(), http, control_key })
    }
}

/// A raw HTTP answer.
#[derive(Clone, Debug)]
pub struct HttpReply {
    pub status: u16,
    pub header_length: Option<usize>,
    pub content_type: Option<String>,
    pub body: Bytes,
}

impl HttpReply {
    /// The error a non-2xx reply stands for (its JSON `error` field, or the body as text).
    pub fn error(&self) -> Option<ClientError> {
        if (200..300).contains(&self.status) {
            return None;
        }
        let message = serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).into_owned());
        Some(ClientError::Server { code: Code::from_http(self.status), message: format!("HTTP {}: {message}", self.status) })
    }

    pub fn json(&self) -> Result<Value> {
        if let Some(e) = self.error() {
            return Err(e);
        }
        serde_json::from_slice(&self.body).map_err(|e| ClientError::Protocol(format!("response is not JSON: {e}")))
    }
}

fn tensor_metadata(v: &Value) -> Result<Vec<TensorMetadata>> {
    let arr = v.as_array().ok_or_else(|| ClientError::Protocol("tensor metadata is not an array".into()))?;
    arr.iter()
        .map(|t| {
            Ok(TensorMetadata {
                name: t["name"].as_str().unwrap_or_default().to_string(),
                datatype: t["datatype"].as_str().unwrap_or_default().to_string(),
                shape: t["shape"].as_array().map(|s| s.iter().filter_map(|d| d.as_i64()).collect()).unwrap_or_default(),
            })
        })
        .collect()
}

/// The request parameters that carry `opts`.
pub fn request_parameters(opts: &InferOptions) -> Map<String, Value> {
    let mut p = Map::new();
    if opts.priority != 0 {
        p.insert("priority".into(), json!(opts.priority));
    }
    if opts.deadline_us != 0 {
        p.insert("kairos_deadline_us".into(), json!(opts.deadline_us));
    }
    if opts.timeout_us != 0 {
        p.insert("timeout".into(), json!(opts.timeout_us));
    }
    if let Some(rt) = opts.real_time {
        p.insert("kairos_class".into(), json!(if rt { "real-time" } else { "best-effort" }));
    }
    if let Some(t) = opts.tenant {
        p.insert("kairos_tenant".into(), json!(t));
    }
    p
}

fn json_data(t: &Tensor) -> Value {
    match t.dtype() {
        DType::I64 => json!(t.as_i64().unwrap()),
        _ => json!(t.to_f32_vec()),
    }
}

/// Builds an inference request body: `binary` puts the tensors after a JSON header and asks for
/// binary outputs; otherwise everything is JSON. Returns the body and the header length to send.
pub fn infer_body(inputs: &[(&str, &Tensor)], opts: &InferOptions, binary: bool) -> (Vec<u8>, Option<usize>) {
    let mut params = request_parameters(opts);
    let mut tensors = Vec::new();
    for (name, t) in inputs {
        let mut o = json!({ "name": name, "datatype": t.dtype().kserve_name(), "shape": crate::shape_i64(&t.shape) });
        if binary {
            o["parameters"] = json!({ "binary_data_size": t.size_bytes() });
        } else {
            o["data"] = json_data(t);
        }
        tensors.push(o);
    }
    if binary {
        params.insert("binary_data_output".into(), json!(true));
    }
    let mut req = json!({ "inputs": tensors });
    if !params.is_empty() {
        req["parameters"] = Value::Object(params);
    }
    let mut body = serde_json::to_vec(&req).expect("JSON of plain values");
    if !binary {
        return (body, None);
    }
    let n = body.len();
    for (_, t) in inputs {
        body.extend_from_slice(&t.to_bytes());
    }
    (body, Some(n))
}

fn timing_of(params: Option<&Value>) -> ServerTiming {
    let int = |k: &str| params.and_then(|p| p.get(k)).and_then(|v| v.as_u64()).unwrap_or(0);
    ServerTiming {
        engine_ns: int("kairos_engine_ns"),
        gpu_ns: int("kairos_gpu_ns"),
        queue_ns: int("kairos_queue_ns"),
        deadline_missed: params.and_then(|p| p.get("kairos_deadline_missed")).and_then(|v| v.as_bool()).unwrap_or(false),
    }
}

/// Decodes an inference response (JSON, or JSON header plus binary outputs).
pub fn decode_infer_reply(reply: &HttpReply) -> Result<InferResult> {
    if let Some(e) = reply.error() {
        return Err(e);
    }
    let proto = |m: String| ClientError::Protocol(m);
    let (head, mut rest): (&[u8], &[u8]) = match reply.header_length {
        Some(n) if n <= reply.body.len() => (&reply.body[..n], &reply.body[n..]),
        Some(n) => return Err(proto(format!("header length {n} exceeds the body's {} bytes", reply.body.len()))),
        None => (&reply.body[..], &[]),
    };
    let v: Value = serde_json::from_slice(head).map_err(|e| proto(format!("response header is not JSON: {e}")))?;
    let mut outputs = Vec::new();
    for o in v["outputs"].as_array().ok_or_else(|| proto("no outputs in the response".into()))? {
        let name = o["name"].as_str().unwrap_or_default().to_string();
        let datatype = o["datatype"].as_str().unwrap_or_default();
        let dtype = crate::dtype_of(datatype).ok_or_else(|| proto(format!("output '{name}' has datatype {datatype}")))?;
        let shape: Vec<i64> = o["shape"].as_array().map(|s| s.iter().filter_map(|d| d.as_i64()).collect()).unwrap_or_default();
        let shape = crate::shape_usize(&shape).map_err(proto)?;
        let t = if let Some(size) = o["parameters"]["binary_data_size"].as_u64() {
            let size = size as usize;
            if size > rest.len() {
                return Err(proto(format!("output '{name}' claims {size} bytes, {} left", rest.len())));
            }
            let t = Tensor::from_bytes(dtype, shape, &rest[..size]).map_err(proto)?;
            rest = &rest[size..];
            t
        } else {
            let data = o["data"].as_array().ok_or_else(|| proto(format!("output '{name}' has no data")))?;
            match dtype {
                DType::I64 => Tensor::i64(shape, data.iter().map(|x| x.as_i64().unwrap_or(0)).collect()),
                _ => Tensor::f32(shape, data.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()).cast(dtype),
            }
        };
        outputs.push((name, t));
    }
    Ok(InferResult {
        model_name: v["model_name"].as_str().unwrap_or_default().to_string(),
        model_version: v["model_version"].as_str().unwrap_or_default().to_string(),
        id: v["id"].as_str().unwrap_or_default().to_string(),
        timing: timing_of(v.get("parameters")),
        outputs,
    })
}

fn model_path(model: &str, version: &str, what: &str) -> String {
    let mut p = format!("/v2/models/{model}");
    if !version.is_empty() {
        p.push_str(&format!("/versions/{version}"));
    }
    if !what.is_empty() {
        p.push('/');
        p.push_str(what);
    }
    p
}

impl RestClient {
    /// A client of the server at `base_url` (for example `http://127.0.0.1:8000`), plain HTTP, no
    /// control key. Connects lazily.
    pub fn new(base_url: &str) -> Result<RestClient> {
        RestClient::builder(base_url).build()
    }

    /// Options for a client of `base_url`: `https://` with [`RestClientBuilder::tls_ca_pem`], and
    /// [`RestClientBuilder::control_key`]. Finish with [`RestClientBuilder::build`].
    ///
    /// ```no_run
    /// # fn f(ca_pem: &[u8]) -> kairos_client::Result<()> {
    /// let client = kairos_client::rest::RestClient::builder("https://kairos.local:8000")
    ///     .tls_ca_pem(ca_pem)
    ///     .control_key("a-key-of-16-characters-or-more")
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn builder(base_url: &str) -> RestClientBuilder {
        RestClientBuilder { base: base_url.to_string(), ..RestClientBuilder::default() }
    }

    /// A request with the control key's header (if this client has a key).
    async fn control_request(&self, path: &str, body: &Value) -> Result<Value> {
        let mut headers = Vec::new();
        if let Some(k) = &self.control_key {
            headers.push((crate::CONTROL_KEY_HEADER, k.clone()));
        }
        let reply = self.request_with("POST", path, serde_json::to_vec(body).unwrap(), None, &headers).await?;
        if let Some(e) = reply.error() {
            return Err(e);
        }
        if reply.body.is_empty() { Ok(Value::Null) } else { reply.json() }
    }

    /// Sends one request; `header_length` adds the binary extension's header.
    pub async fn request(&self, method: &str, path: &str, body: Vec<u8>, header_length: Option<usize>) -> Result<HttpReply> {
        self.request_with(method, path, body, header_length, &[]).await
    }

    async fn request_with(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        header_length: Option<usize>,
        headers: &[(&str, hyper::header::HeaderValue)],
    ) -> Result<HttpReply> {
        let method = hyper::Method::from_bytes(method.as_bytes()).map_err(|e| ClientError::Usage(e.to_string()))?;
        let mut b = hyper::Request::builder().method(method).uri(format!("{}{path}", self.base));
        for (k, v) in headers {
            b = b.header(*k, v.clone());
        }
        if let Some(n) = header_length {
            b = b.header(HEADER_LENGTH, n.to_string()).header("content-type", "application/octet-stream");
        } else if !body.is_empty() {
            b = b.header("content-type", "application/json");
        }
        let req = b.body(Full::new(Bytes::from(body))).map_err(|e| ClientError::Usage(e.to_string()))?;
        let resp =
            self.http.request(req).await.map_err(|e| ClientError::Transport(format!("{path}: {}", crate::error_chain(&e))))?;
        let status = resp.status().as_u16();
        let header = |k: &str| resp.headers().get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
        let header_length = header(HEADER_LENGTH).and_then(|v| v.parse().ok());
        let content_type = header("content-type");
        let body = resp.into_body().collect().await.map_err(|e| ClientError::Transport(format!("{path}: {e}")))?.to_bytes();
        Ok(HttpReply { status, header_length, content_type, body })
    }

    pub async fn get_json(&self, path: &str) -> Result<Value> {
        self.request("GET", path, Vec::new(), None).await?.json()
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Result<Value> {
        let reply = self.request("POST", path, serde_json::to_vec(body).unwrap(), None).await?;
        if let Some(e) = reply.error() {
            return Err(e);
        }
        if reply.body.is_empty() { Ok(Value::Null) } else { reply.json() }
    }

    async fn status_ok(&self, path: &str) -> Result<bool> {
        let r = self.request("GET", path, Vec::new(), None).await?;
        Ok(r.status == 200)
    }

    pub async fn server_live(&self) -> Result<bool> {
        self.status_ok("/v2/health/live").await
    }

    pub async fn server_ready(&self) -> Result<bool> {
        self.status_ok("/v2/health/ready").await
    }

    pub async fn model_ready(&self, model: &str, version: &str) -> Result<bool> {
        self.status_ok(&model_path(model, version, "ready")).await
    }

    pub async fn server_metadata(&self) -> Result<Value> {
        self.get_json("/v2").await
    }

    pub async fn model_metadata(&self, model: &str, version: &str) -> Result<ModelMetadata> {
        let v = self.get_json(&model_path(model, version, "")).await?;
        Ok(ModelMetadata {
            name: v["name"].as_str().unwrap_or_default().to_string(),
            versions: v["versions"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
                .unwrap_or_default(),
            platform: v["platform"].as_str().unwrap_or_default().to_string(),
            inputs: tensor_metadata(&v["inputs"])?,
            outputs: tensor_metadata(&v["outputs"])?,
        })
    }

    pub async fn model_config(&self, model: &str, version: &str) -> Result<Value> {
        self.get_json(&model_path(model, version, "config")).await
    }

    pub async fn model_statistics(&self, model: &str, version: &str) -> Result<Value> {
        if model.is_empty() {
            self.get_json("/v2/models/stats").await
        } else {
            self.get_json(&model_path(model, version, "stats")).await
        }
    }

    pub async fn repository_index(&self, ready_only: bool) -> Result<Value> {
        self.control_request("/v2/repository/index", &json!({ "ready": ready_only })).await
    }

    pub async fn load_model(&self, model: &str) -> Result<()> {
        self.control_request(&format!("/v2/repository/models/{model}/load"), &json!({})).await.map(|_| ())
    }

    pub async fn unload_model(&self, model: &str) -> Result<()> {
        self.control_request(&format!("/v2/repository/models/{model}/unload"), &json!({})).await.map(|_| ())
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> Result<String> {
        let r = self.request("GET", "/metrics", Vec::new(), None).await?;
        if let Some(e) = r.error() {
            return Err(e);
        }
        Ok(String::from_utf8_lossy(&r.body).into_owned())
    }

    /// One request; `binary` uses the binary tensor extension both ways, otherwise JSON tensors.
    pub async fn infer(
        &self,
        model: &str,
        version: &str,
        inputs: &[(&str, &Tensor)],
        opts: &InferOptions,
        binary: bool,
    ) -> Result<InferResult> {
        let (body, header_length) = infer_body(inputs, opts, binary);
        let reply = self.request("POST", &model_path(model, version, "infer"), body, header_length).await?;
        decode_infer_reply(&reply)
    }
}
