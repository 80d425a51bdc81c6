//! Issue 25, item 5 (server side): the model-control API can be switched off or put behind a key
//! (`ServerConfig::control`, `kairos serve --control-api`), on REST and gRPC; and no model name,
//! configuration or symbolic link reaches outside the repository's root.

mod common;

use common::*;
use kairos_client::grpc::GrpcClient;
use kairos_client::pb;
use kairos_server::ControlAccess;
use kairos_server::control::CONTROL_KEY_HEADER;
use std::io::{Read, Write};
use std::net::TcpStream;

const KEY: &str = "fuzz-key-0123456789abcdef";

/// One HTTP/1.1 request over a plain socket (so any header can be sent): (status, body).
fn http(base: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let addr = base.strip_prefix("http://").unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn grpc_request<T>(msg: T, key: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(k) = key {
        r.metadata_mut().insert(CONTROL_KEY_HEADER, k.parse().unwrap());
    }
    r
}

fn load_req(name: &str) -> pb::RepositoryModelLoadRequest {
    pb::RepositoryModelLoadRequest { repository_name: String::new(), model_name: name.into(), parameters: Default::default() }
}

fn unload_req(name: &str) -> pb::RepositoryModelUnloadRequest {
    pb::RepositoryModelUnloadRequest { repository_name: String::new(), model_name: name.into(), parameters: Default::default() }
}

fn index_req() -> pb::RepositoryIndexRequest {
    pb::RepositoryIndexRequest { repository_name: String::new(), ready: false }
}

/// The three control calls over both front ends with `key` (or none): the REST statuses and the
/// gRPC codes, in the order index, load, unload.
type ControlAnswers = (Vec<(u16, String)>, Vec<Result<(), tonic::Status>>);

fn control_calls(s: &TestServer, key: Option<&str>) -> ControlAnswers {
    let headers: Vec<(&str, &str)> = key.map(|k| vec![(CONTROL_KEY_HEADER, k)]).unwrap_or_default();
    let rest = vec![
        http(&s.http, "POST", "/v2/repository/index", &headers, b""),
        http(&s.http, "POST", "/v2/repository/models/pair/load", &headers, b""),
        http(&s.http, "POST", "/v2/repository/models/pair/unload", &headers, b""),
    ];
    let rt = runtime();
    let grpc = rt.block_on(async {
        let c = GrpcClient::connect(&s.grpc).await.unwrap().raw();
        vec![
            c.clone().repository_index(grpc_request(index_req(), key)).await.map(|_| ()),
            c.clone().repository_model_load(grpc_request(load_req("pair"), key)).await.map(|_| ()),
            c.clone().repository_model_unload(grpc_request(unload_req("pair"), key)).await.map(|_| ()),
        ]
    });
    (rest, grpc)
}

fn assert_refused(rest: &[(u16, String)], grpc: &[Result<(), tonic::Status>], why: &str) {
    for (status, body) in rest {
        assert_eq!(*status, 403, "{body}");
        assert!(body.contains(why), "'{why}' not in {body}");
    }
    for r in grpc {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains(why), "'{why}' not in {}", e.message());
    }
}

fn assert_allowed(rest: &[(u16, String)], grpc: &[Result<(), tonic::Status>]) {
    for (status, body) in rest {
        assert_eq!(*status, 200, "{body}");
    }
    for r in grpc {
        r.as_ref().unwrap();
    }
}

#[test]
fn control_api_on_by_default() {
    let s = start("control-on");
    let (rest, grpc) = control_calls(&s, None);
    assert_allowed(&rest, &grpc);
    // A key sent to a server without one is ignored.
    let (rest, grpc) = control_calls(&s, Some(KEY));
    assert_allowed(&rest, &grpc);
}

#[test]
fn control_api_off_refuses_everyone() {
    let s = start_with("control-off", |cfg, _| cfg.control = ControlAccess::Off);
    let (rest, grpc) = control_calls(&s, None);
    assert_refused(&rest, &grpc, "disabled");
    let (rest, grpc) = control_calls(&s, Some(KEY));
    assert_refused(&rest, &grpc, "disabled");
    // Inference and metadata are not control calls.
    let (status, body) = http(&s.http, "GET", "/v2/models/pair", &[], b"");
    assert_eq!(status, 200, "{body}");
    let (status, _) = http(&s.http, "GET", "/v2/models/pair/ready", &[], b"");
    assert_eq!(status, 200, "pair is still loaded: the refused unload did nothing");
}

#[test]
fn control_api_key_needs_the_key() {
    let s = start_with("control-key", |cfg, _| cfg.control = KEY.parse().unwrap());
    let (rest, grpc) = control_calls(&s, None);
    assert_refused(&rest, &grpc, "needs a key");
    for wrong in ["fuzz-key-0123456789abcdeF", "fuzz-key-0123456789abcde", "fuzz-key-0123456789abcdef0", "x"] {
        let (rest, grpc) = control_calls(&s, Some(wrong));
        assert_refused(&rest, &grpc, "does not hold");
    }
    let (rest, grpc) = control_calls(&s, Some(KEY));
    assert_allowed(&rest, &grpc);
    let (status, body) = http(&s.http, "GET", "/v2/models/mlp", &[], b"");
    assert_eq!(status, 200, "inference needs no key: {body}");
}

/// Names that try to leave the root, over REST and gRPC, and links and configuration that point
/// outside it: each is refused with a clear error and loads nothing.
#[test]
fn repository_paths_stay_inside_the_root() {
    let s = start("repo-escape");
    let repo = s.repository();
    let outside = s.dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("mlp.onnx"), kairos_server::fixtures::mlp_onnx()).unwrap();
    std::fs::write(outside.join("config.toml"), "secret_line = 1\n").unwrap();
    // A model folder that is a link to a folder outside (with a model that would load).
    std::os::unix::fs::symlink(&outside, repo.join("linked")).unwrap();
    // A model folder whose config.toml links outside (its lines must not show in the error).
    std::fs::create_dir_all(repo.join("leaky")).unwrap();
    std::os::unix::fs::symlink(outside.join("config.toml"), repo.join("leaky/config.toml")).unwrap();
    // A model folder whose only .onnx file links outside.
    std::fs::create_dir_all(repo.join("onnxlink")).unwrap();
    std::os::unix::fs::symlink(outside.join("mlp.onnx"), repo.join("onnxlink/m.onnx")).unwrap();
    // Configurations naming files outside.
    for (name, config) in [
        ("dotdot", "model = \"../../outside/mlp.onnx\"\n"),
        ("absolute", &*format!("model = \"{}\"\n", outside.join("mlp.onnx").display())),
        ("zoo_path", &*format!("model = \"{}\"\n", outside.join("config.toml").display())),
        ("profile", "profile = \"../../outside/config.toml\"\n"),
    ] {
        std::fs::create_dir_all(repo.join(name)).unwrap();
        std::fs::write(repo.join(name).join("config.toml"), config).unwrap();
    }
    // A link to another model's folder inside the root is fine.
    std::os::unix::fs::symlink(repo.join("mlp"), repo.join("alias")).unwrap();

    let cases: &[(&str, u16, &str)] = &[
        ("..%2Foutside", 400, "is not a model name"),
        ("%2Fetc", 400, "is not a model name"),
        ("a%00b", 400, "is not a model name"),
        ("..", 400, "is not a model name"),
        ("nope", 404, "no model 'nope'"),
        ("linked", 400, "resolves outside the model repository"),
        ("leaky", 400, "resolves outside the model repository"),
        ("onnxlink", 400, "resolves outside the model repository"),
        ("dotdot", 400, "must be a relative path inside the model's folder"),
        ("absolute", 400, "must be a relative path inside the model's folder"),
        ("zoo_path", 400, "not a zoo name"),
        ("profile", 400, "must be a relative path inside the model's folder"),
    ];
    for (name, status, fragment) in cases {
        let (got, body) = http(&s.http, "POST", &format!("/v2/repository/models/{name}/load"), &[], b"");
        assert_eq!(got, *status, "{name}: {body}");
        assert!(body.contains(fragment), "{name}: '{fragment}' not in {body}");
        assert!(!body.contains("secret_line"), "{name}: {body}");
    }
    let rt = runtime();
    let grpc = rt.block_on(GrpcClient::connect(&s.grpc)).unwrap();
    for (name, code) in [
        ("../outside", kairos_client::Code::InvalidArgument),
        ("/etc", kairos_client::Code::InvalidArgument),
        ("a\0b", kairos_client::Code::InvalidArgument),
        ("linked", kairos_client::Code::InvalidArgument),
        ("leaky", kairos_client::Code::InvalidArgument),
    ] {
        let e = rt.block_on(grpc.load_model(name)).unwrap_err();
        assert_eq!(e.code(), Some(code), "{name}: {e}");
        assert!(!e.to_string().contains("secret_line"), "{name}: {e}");
    }
    for name in ["linked", "leaky", "onnxlink", "dotdot", "absolute"] {
        let (status, _) = http(&s.http, "GET", &format!("/v2/models/{name}/ready"), &[], b"");
        assert_ne!(status, 200, "{name} must not be loaded");
    }
    let (status, body) = http(&s.http, "POST", "/v2/repository/models/alias/load", &[], b"");
    assert_eq!(status, 200, "a link inside the root loads: {body}");
}
