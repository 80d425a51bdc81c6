//! The ONNX exporter corpus against onnxruntime, on the CPU reference (f32, relative L2 <= 1e-4).
//!
//! The corpus is made by `scripts/onnx-corpus.sh` (CPU PyTorch, torchvision, timm, transformers;
//! both exporters, opsets 17, 18 and the newest, dynamic batch and sequence axes; onnxruntime's
//! outputs at two shapes per model). With `KAIROS_ONNX_CORPUS=DIR` this test runs
//! `kairos check-onnx DIR` and requires every export the exporters wrote to load at both shapes
//! and match; without it the test says it skipped, unless `KAIROS_REQUIRE_ONNX_CORPUS=1` (set by
//! `.ci/run`), which makes a missing corpus a failure.

use std::path::PathBuf;
use std::process::Command;

/// The tiny tier has 34 architectures x 6 exports; a corpus with fewer passing exports than this
/// is not the corpus (a generator that broke half-way).
const PASSING_EXPORTS_MIN: u64 = 150;

#[test]
fn every_export_in_the_corpus_matches_onnxruntime() {
    let dir = match std::env::var("KAIROS_ONNX_CORPUS") {
        Ok(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            let required = std::env::var("KAIROS_REQUIRE_ONNX_CORPUS").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "KAIROS_REQUIRE_ONNX_CORPUS=1 but KAIROS_ONNX_CORPUS names no corpus (scripts/onnx-corpus.sh makes one)"
            );
            eprintln!("skipped: KAIROS_ONNX_CORPUS is not set (scripts/onnx-corpus.sh makes the corpus)");
            return;
        }
    };
    let report = std::env::temp_dir().join(format!("kairos-onnx-corpus-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["check-onnx", dir.to_str().expect("utf-8 path"), "--backend", "cpu", "--dtype", "f32", "--json"])
        .arg(&report)
        .output()
        .expect("runs kairos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "kairos check-onnx failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).expect("report written")).unwrap();
    let _ = std::fs::remove_file(&report);
    let summary = &json["summary"];
    let count = |k: &str| summary[k].as_u64().unwrap_or(u64::MAX);
    let failing: Vec<String> = json["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["outcome"] != "pass" && r["outcome"] != "export-failed")
        .map(|r| format!("{}: {} {}", r["file"], r["outcome"], r["note"]))
        .collect();
    assert!(failing.is_empty(), "{} exports do not load or do not match onnxruntime:\n{}", failing.len(), failing.join("\n"));
    assert_eq!(count("fail"), 0);
    assert_eq!(count("unsupported"), 0);
    assert!(
        count("pass") >= PASSING_EXPORTS_MIN,
        "only {} exports passed (expected at least {PASSING_EXPORTS_MIN})",
        count("pass")
    );
}
