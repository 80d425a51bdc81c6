//! Issue 25, item 5 (transport): `kairos serve --tls-cert --tls-key` puts the REST and gRPC
//! listeners behind TLS (rustls, ring); the kairos clients connect given the CA certificate to
//! trust, and send the model-control key. Certificates are made at test time (rcgen): a CA, and a
//! server certificate it signs for `localhost` and 127.0.0.1.

mod common;

use common::*;
use kairos_backends::SimBackend;
use kairos_client::grpc::GrpcClient;
use kairos_client::rest::RestClient;
use kairos_client::{ClientError, Code, InferOptions};
use kairos_server::{ControlAccess, RunningServer, ServerConfig, TlsConfig};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const KEY: &str = "tls-test-key-0123456789abcdef";

/// A CA and a server certificate it signed, as PEM files in `dir`.
struct Pki {
    ca_pem: String,
    cert: PathBuf,
    key: PathBuf,
    dir: PathBuf,
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ca(name: &str) -> rcgen::CertifiedIssuer<'static, rcgen::KeyPair> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap()
}

fn make_pki(dir: &Path, ca_name: &str) -> Pki {
    let ca = ca(ca_name);
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, "kairos test server");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    let (cert_path, key_path) = (dir.join("server.pem"), dir.join("server.key"));
    // The chain: the server's certificate, then the CA's.
    std::fs::write(&cert_path, format!("{}{}", cert.pem(), ca.pem())).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    Pki { ca_pem: ca.pem(), cert: cert_path, key: key_path, dir: dir.to_path_buf() }
}

/// A server on the tiny repository with TLS on both listeners; its urls are https://.
fn start_tls(tag: &str, control: ControlAccess) -> (TestServer, Pki) {
    let dir = temp_dir(&format!("{tag}-pki"));
    let pki = make_pki(&dir, "kairos test CA");
    let tls = TlsConfig { cert: pki.cert.clone(), key: pki.key.clone() };
    let mut s = start_with(tag, |cfg, _| {
        cfg.tls = Some(tls);
        cfg.control = control;
    });
    s.http = s.http.replacen("http://", "https://", 1);
    s.grpc = s.grpc.replacen("http://", "https://", 1);
    (s, pki)
}

fn tls_rest(s: &TestServer, ca_pem: &str) -> RestClient {
    RestClient::builder(&s.http).tls_ca_pem(ca_pem).build().unwrap()
}

async fn tls_grpc(s: &TestServer, ca_pem: &str) -> kairos_client::Result<GrpcClient> {
    GrpcClient::builder(&s.grpc).tls_ca_pem(ca_pem).connect().await
}

fn addr(url: &str) -> &str {
    url.split_once("://").unwrap().1
}

/// Infers `model` over both clients and checks the answers against the CPU reference. `rt` must be
/// the runtime the gRPC client was made on (its channel's worker runs there).
fn infer_both(rt: &tokio::runtime::Runtime, s: &TestServer, rest: &RestClient, grpc: &GrpcClient, model: &str, seed: u64) {
    let inputs = s.inputs(model, seed);
    let want = s.reference(model, &inputs);
    let names = s.input_names(model);
    let named: Vec<(&str, &kairos_ir::Tensor)> = names.iter().map(|n| n.as_str()).zip(inputs.iter()).collect();
    for binary in [false, true] {
        let r = rt.block_on(rest.infer(model, "", &named, &InferOptions::default(), binary)).unwrap();
        for (name, w) in s.output_names(model).iter().zip(&want) {
            assert_same(r.output(name).unwrap(), w, &format!("REST over TLS {model} {name} binary={binary}"));
        }
    }
    let r = rt.block_on(grpc.infer(model, "", &named, &InferOptions::default())).unwrap();
    for (name, w) in s.output_names(model).iter().zip(&want) {
        assert_same(r.output(name).unwrap(), w, &format!("gRPC over TLS {model} {name}"));
    }
}

fn transport_error<T: std::fmt::Debug>(r: kairos_client::Result<T>, what: &str) -> String {
    match r {
        Err(ClientError::Transport(m)) => m,
        other => panic!("{what}: expected a transport error, got {other:?}"),
    }
}

#[test]
fn rest_and_grpc_infer_over_tls() {
    let (s, pki) = start_tls("tls-infer", ControlAccess::On);
    let rest = tls_rest(&s, &pki.ca_pem);
    let rt = runtime();
    let grpc = rt.block_on(tls_grpc(&s, &pki.ca_pem)).unwrap();
    assert!(rt.block_on(rest.server_ready()).unwrap());
    assert!(rt.block_on(grpc.server_ready()).unwrap());
    for (i, model) in ["mlp", "pair", "embed"].into_iter().enumerate() {
        infer_both(&rt, &s, &rest, &grpc, model, 11 + i as u64);
    }
    // Verification by name rather than address: the certificate is also for `localhost`.
    let port = addr(&s.grpc).rsplit_once(':').unwrap().1;
    let by_name =
        rt.block_on(GrpcClient::builder(&format!("https://localhost:{port}")).tls_ca_pem(pki.ca_pem.clone()).connect()).unwrap();
    assert!(rt.block_on(by_name.server_live()).unwrap());
    // A name the certificate is not for is refused.
    let e = rt.block_on(async {
        let c = GrpcClient::builder(&s.grpc).tls_ca_pem(pki.ca_pem.clone()).tls_domain("not-kairos.example").connect().await?;
        c.server_live().await
    });
    assert!(format!("{e:?}").contains("certificate not valid for name"), "{e:?}");
}

#[test]
fn plain_text_clients_are_refused() {
    let (s, pki) = start_tls("tls-plain", ControlAccess::On);
    let rt = runtime();
    // The kairos clients without TLS.
    let plain_rest = RestClient::new(&format!("http://{}", addr(&s.http))).unwrap();
    transport_error(rt.block_on(plain_rest.server_live()), "plain REST");
    let plain_grpc = rt.block_on(async {
        let c = GrpcClient::connect(&format!("http://{}", addr(&s.grpc))).await?;
        c.server_live().await
    });
    assert!(plain_grpc.is_err(), "plain gRPC must fail: {plain_grpc:?}");
    // A raw HTTP/1.1 request gets no HTTP answer: the connection is closed (after a TLS alert at most).
    let mut tcp = TcpStream::connect(addr(&s.http)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    tcp.write_all(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = Vec::new();
    let _ = tcp.read_to_end(&mut out);
    assert!(!out.starts_with(b"HTTP/"), "a plain-text request got an HTTP answer: {:?}", String::from_utf8_lossy(&out));
    // The server is unaffected: TLS clients still work.
    assert!(rt.block_on(tls_rest(&s, &pki.ca_pem).server_live()).unwrap());
    assert!(rt.block_on(async { tls_grpc(&s, &pki.ca_pem).await?.server_live().await }).unwrap());
}

#[test]
fn clients_that_do_not_trust_the_ca_fail() {
    let (s, pki) = start_tls("tls-untrusted", ControlAccess::On);
    let other = make_pki(&temp_dir("tls-other-ca"), "another CA");
    let rt = runtime();
    let r = RestClient::builder(&s.http).tls_ca_pem(other.ca_pem.clone()).build().unwrap();
    let m = transport_error(rt.block_on(r.server_live()), "REST with another CA");
    assert!(m.contains("UnknownIssuer"), "{m}");
    let g =
        rt.block_on(async { GrpcClient::builder(&s.grpc).tls_ca_pem(other.ca_pem.clone()).connect().await?.server_live().await });
    assert!(format!("{g:?}").contains("UnknownIssuer"), "{g:?}");
    // An https:// url without a CA, and a CA that is not PEM, are the caller's mistakes.
    assert!(matches!(RestClient::new(&s.http), Err(ClientError::Usage(m)) if m.contains("CA certificate")));
    assert!(matches!(rt.block_on(GrpcClient::connect(&s.grpc)), Err(ClientError::Usage(m)) if m.contains("CA certificate")));
    let bad = RestClient::builder(&s.http).tls_ca_pem("not a certificate").build();
    assert!(matches!(bad, Err(ClientError::Usage(m)) if m.contains("no PEM certificate")));
    // The failed handshakes left the server serving.
    let rest = tls_rest(&s, &pki.ca_pem);
    let grpc = rt.block_on(tls_grpc(&s, &pki.ca_pem)).unwrap();
    infer_both(&rt, &s, &rest, &grpc, "mlp", 3);
}

/// Handshakes run off the accept path: connections that never finish theirs (silent, or sending
/// garbage) do not hold up other clients, and a silent one is closed after the handshake timeout.
#[test]
fn stalled_and_broken_handshakes_do_not_hold_up_others() {
    let (s, pki) = start_tls("tls-stall", ControlAccess::On);
    let mut silent = Vec::new();
    for url in [&s.http, &s.grpc] {
        for _ in 0..8 {
            silent.push(TcpStream::connect(addr(url)).unwrap());
        }
        // Half a TLS record header, then nothing.
        let mut half = TcpStream::connect(addr(url)).unwrap();
        half.write_all(&[0x16, 0x03, 0x01]).unwrap();
        silent.push(half);
        let mut garbage = TcpStream::connect(addr(url)).unwrap();
        garbage.write_all(&[0xab; 512]).unwrap();
        silent.push(garbage);
    }
    let started = Instant::now();
    let rest = tls_rest(&s, &pki.ca_pem);
    let rt = runtime();
    let grpc = rt.block_on(tls_grpc(&s, &pki.ca_pem)).unwrap();
    infer_both(&rt, &s, &rest, &grpc, "mlp", 5);
    assert!(started.elapsed() < Duration::from_secs(5), "served in {:?} beside stalled handshakes", started.elapsed());
    // The first silent connection is closed once the handshake timeout passes.
    let first = &mut silent[0];
    first.set_read_timeout(Some(kairos_server::tls::HANDSHAKE_TIMEOUT + Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    let r = first.read(&mut buf);
    assert!(matches!(r, Ok(0)) || r.is_err(), "{r:?}");
    if let Err(e) = &r {
        assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "not closed within the handshake timeout and 10 s");
    }
    let waited = started.elapsed();
    assert!(waited + Duration::from_secs(1) >= kairos_server::tls::HANDSHAKE_TIMEOUT, "closed after {waited:?}: too early");
    // Still serving.
    infer_both(&rt, &s, &rest, &grpc, "mlp", 6);
}

/// The clients send the control key (`ControlAccess::Key`): the right key may index, load and
/// unload; a wrong or missing one gets 403 / PERMISSION_DENIED. Over TLS, as a key should travel.
#[test]
fn clients_send_the_control_key() {
    let (s, pki) = start_tls("tls-control", KEY.parse().unwrap());
    let rt = runtime();
    let with_key = |key: Option<&str>| {
        let mut r = RestClient::builder(&s.http).tls_ca_pem(pki.ca_pem.clone());
        let mut g = GrpcClient::builder(&s.grpc).tls_ca_pem(pki.ca_pem.clone());
        if let Some(k) = key {
            r = r.control_key(k);
            g = g.control_key(k);
        }
        (r.build().unwrap(), rt.block_on(g.connect()).unwrap())
    };
    let (rest, grpc) = with_key(Some(KEY));
    rt.block_on(async {
        rest.unload_model("pair").await.unwrap();
        assert!(!rest.model_ready("pair", "").await.unwrap());
        rest.load_model("pair").await.unwrap();
        assert!(rest.model_ready("pair", "").await.unwrap());
        assert!(rest.repository_index(false).await.unwrap().as_array().unwrap().len() >= 4);
        grpc.unload_model("pair").await.unwrap();
        assert!(!grpc.model_ready("pair", "").await.unwrap());
        grpc.load_model("pair").await.unwrap();
        assert!(grpc.model_ready("pair", "").await.unwrap());
        assert!(grpc.repository_index(false).await.unwrap().models.len() >= 4);
    });
    for (key, why) in [(None, "needs a key"), (Some("tls-test-key-0123456789abcdeX"), "does not hold")] {
        let (rest, grpc) = with_key(key);
        rt.block_on(async {
            let results = [
                rest.unload_model("pair").await,
                rest.load_model("pair").await,
                rest.repository_index(false).await.map(|_| ()),
                grpc.unload_model("pair").await,
                grpc.load_model("pair").await,
                grpc.repository_index(false).await.map(|_| ()),
            ];
            for (i, r) in results.into_iter().enumerate() {
                let e = r.unwrap_err();
                assert_eq!(e.code(), Some(Code::PermissionDenied), "call {i} with {key:?}: {e}");
                assert!(e.to_string().contains(why), "call {i}: '{why}' not in {e}");
            }
            assert!(rest.model_ready("pair", "").await.unwrap(), "the refused unload did nothing");
            // Inference needs no key.
            assert!(rest.model_metadata("pair", "").await.is_ok());
        });
    }
    // A key that cannot travel in a header is the caller's mistake.
    let bad = RestClient::builder(&s.http).tls_ca_pem(pki.ca_pem.clone()).control_key("bad\nkey").build();
    assert!(matches!(bad, Err(ClientError::Usage(_))), "{bad:?}");
}

/// Files that cannot be read or parsed, or a key that does not fit the certificate: the server
/// does not start, and the error names the file and the problem.
#[test]
fn bad_tls_files_are_refused_with_the_file_named() {
    let dir = temp_dir("tls-files");
    let good = make_pki(&dir, "files CA");
    let other_dir = temp_dir("tls-files-other");
    let other = make_pki(&other_dir, "other CA");
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let cert_text = std::fs::read_to_string(&good.cert).unwrap();
    let truncated = write("truncated.pem", &cert_text[..cert_text.len() / 3]);
    let garbage = write("garbage.pem", "hello\n");
    let missing = dir.join("missing.pem");
    let cases: Vec<(TlsConfig, &Path, &str)> = vec![
        (TlsConfig { cert: missing.clone(), key: good.key.clone() }, &missing, "cannot read it"),
        (TlsConfig { cert: good.cert.clone(), key: missing.clone() }, &missing, "cannot read it"),
        (TlsConfig { cert: dir.clone(), key: good.key.clone() }, &dir, "not a regular file"),
        (TlsConfig { cert: garbage.clone(), key: good.key.clone() }, &garbage, "holds no PEM certificate"),
        (TlsConfig { cert: truncated.clone(), key: good.key.clone() }, &truncated, "no END line"),
        // A certificate where the key should be.
        (TlsConfig { cert: good.cert.clone(), key: good.cert.clone() }, &good.cert, "holds no PEM private key"),
        // Another certificate's key.
        (TlsConfig { cert: good.cert.clone(), key: other.key.clone() }, &other.key, "key"),
    ];
    for (cfg, file, fragment) in &cases {
        let e = cfg.load().unwrap_err().to_string();
        assert!(e.contains(&file.display().to_string()), "{e} does not name {}", file.display());
        assert!(e.contains(fragment), "'{fragment}' not in {e}");
    }
    let e = TlsConfig { cert: good.cert.clone(), key: other.key.clone() }.load().unwrap_err().to_string();
    assert!(e.contains("match") || e.contains("Mismatch"), "a key of another certificate: {e}");
    // The server refuses to start on them.
    let repo = dir.join("models");
    std::fs::create_dir_all(&repo).unwrap();
    let mut cfg = ServerConfig::new(&repo);
    cfg.http = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.grpc = None;
    cfg.tls = Some(TlsConfig { cert: garbage.clone(), key: good.key.clone() });
    let backend = SimBackend::new(kairos_sim::GpuDesc::h100_sxm(), 7);
    match RunningServer::start(cfg, Box::new(backend)) {
        Ok(_) => panic!("the server started with a certificate file that holds no certificate"),
        Err(e) => assert!(e.to_string().contains("garbage.pem"), "{e}"),
    }
}
