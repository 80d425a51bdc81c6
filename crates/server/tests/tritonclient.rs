//! Real clients: NVIDIA's `tritonclient` Python package (HTTP and gRPC) against kairos on the
//! simulated GPU — metadata, configuration, inference (binary and JSON), output selection,
//! priority and timeout, errors, repository load/unload, statistics, malformed protobuf.
//!
//! Needs `python3 -m pip install 'tritonclient[http,grpc]' numpy prometheus_client`. Without it the test prints a
//! skip note; with `KAIROS_REQUIRE_TRITONCLIENT=1` (set by `.ci/run`) a missing package fails it.

mod common;

use common::*;
use std::process::Command;

fn python() -> String {
    std::env::var("KAIROS_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn tritonclient_available() -> Result<(), String> {
    let out = Command::new(python())
        .args(["-c", "import tritonclient.http, tritonclient.grpc, numpy, grpc, prometheus_client"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).trim().to_string()) }
}

#[test]
fn tritonclient_http_and_grpc() {
    if let Err(why) = tritonclient_available() {
        let required = std::env::var("KAIROS_REQUIRE_TRITONCLIENT").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "KAIROS_REQUIRE_TRITONCLIENT=1 but tritonclient is not importable: {why}\n\
             install it with: python3 -m pip install 'tritonclient[http,grpc]' numpy prometheus_client"
        );
        eprintln!(
            "SKIPPED tritonclient_http_and_grpc: the Python package tritonclient is not installed ({why}).\n\
             Install it with `python3 -m pip install 'tritonclient[http,grpc]' numpy prometheus_client` to run this test."
        );
        return;
    }
    let s = start("tritonclient");
    let data = s.dir.join("cases");
    std::fs::create_dir_all(&data).unwrap();
    for model in MODELS {
        let inputs = s.inputs(model, 11);
        let outputs = s.reference(model, &inputs);
        for (i, t) in inputs.iter().enumerate() {
            kairos_ir::npy::write(&data.join(format!("{model}.in.{i}.npy")), t).unwrap();
        }
        for (i, t) in outputs.iter().enumerate() {
            kairos_ir::npy::write(&data.join(format!("{model}.out.{i}.npy")), t).unwrap();
        }
        let names = serde_json::json!({ "inputs": s.input_names(model), "outputs": s.output_names(model) });
        std::fs::write(data.join(format!("{model}.json")), names.to_string()).unwrap();
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tritonclient_check.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(s.http.trim_start_matches("http://"))
        .arg(s.grpc.trim_start_matches("http://"))
        .arg(&data)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(out.status.success(), "tritonclient checks failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all ") && stdout.contains("checks passed"), "{stdout}");
}
