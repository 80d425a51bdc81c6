//! A short soak on the simulator through the real binary: `kairos bench soak` starts `kairos serve`
//! as a child process and drives it with REST and gRPC load and a flood of bad input. Every good
//! answer must come back right, every bad one with its client error, and the server must be alive
//! at the end and exit cleanly on SIGTERM. The memory bound is looser than the command's default
//! (the run is short: the allocator's pools are still settling); the measured growth is printed.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn a_short_soak_on_the_simulator_loses_nothing_and_refuses_bad_input_cleanly() {
    let out = std::env::temp_dir().join(format!("kairos-soak-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let status = Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["bench", "soak", "--backend", "sim", "--duration-s", "25", "--warmup-s", "5", "--rate", "12"])
        .args(["--clients", "2", "--rss-growth-max-pct", "25", "--timeout-s", "60", "--seed", "3"])
        .arg("--out")
        .arg(&out)
        .status()
        .expect("kairos runs");
    let results: PathBuf = out.join("results.json");
    let text = std::fs::read_to_string(&results).unwrap_or_else(|e| panic!("{}: {e}", results.display()));
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    let g = &r["good"];
    let server = &r["server"];
    println!(
        "soak: {} good sent, {} correct, {} bad sent; server RSS {} -> {} bytes after the warm-up: {:.2}% growth; exit: {}",
        g["sent"],
        g["correct"],
        r["bad_sent"],
        server["rss_warmup_end_bytes"],
        server["rss_end_bytes"],
        server["rss_growth_pct"].as_f64().unwrap_or(f64::NAN),
        server["exit"]
    );
    assert!(status.success(), "kairos bench soak failed: {}", r["failures"]);
    assert!(g["sent"].as_u64().unwrap() > 100, "{g}");
    assert_eq!(g["lost"], 0, "{g}");
    assert_eq!(g["wrong"], 0, "{g}");
    assert_eq!(g["correct"], g["sent"].as_u64().unwrap() - g["overloaded"].as_u64().unwrap(), "{g}");
    assert!(r["bad_sent"].as_u64().unwrap() > 30, "{}", r["bad"]);
    assert_eq!(r["bad_failed"], 0, "{}", r["bad"]);
    // No bad input got a server error.
    for (kind, b) in r["bad"].as_object().unwrap() {
        for (answer, _) in b["answers"].as_object().unwrap() {
            assert!(!answer.starts_with("HTTP 5"), "{kind}: {answer}");
            assert!(!["Internal", "Unknown", "Unavailable", "DataLoss"].contains(&answer.as_str()), "{kind}: {answer}");
        }
    }
    assert_eq!(server["live_at_end"], true);
    assert_eq!(server["exit"], "exit code 0");
    assert!(server["rss_growth_pct"].as_f64().unwrap() <= 25.0);
    // Every good request has its record.
    let records: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("requests.json")).unwrap()).unwrap();
    assert_eq!(records.as_array().unwrap().len() as u64, g["sent"].as_u64().unwrap() + g["not_sent"].as_u64().unwrap());
    let _ = std::fs::remove_dir_all(&out);
}
