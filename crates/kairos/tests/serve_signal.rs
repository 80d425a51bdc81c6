//! `kairos serve` on the simulator drains on SIGTERM and exits with status 0.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

#[test]
fn sigterm_drains_and_exits_with_status_0() {
    let dir = std::env::temp_dir().join(format!("kairos-serve-signal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    kairos_server::fixtures::write_tiny_repository(&dir).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["serve", "--backend", "sim", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--shm-socket", "off"])
        .args(["--load", "mlp", "--drain-timeout-s", "5", "--log", "info", "-r"])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut log = Vec::new();
    let t = Instant::now();
    // The readiness line comes after the signals are caught.
    while !log.iter().any(|l: &String| l.contains("model(s) ready after")) {
        match rx.recv_timeout(WAIT.saturating_sub(t.elapsed())) {
            Ok(l) => log.push(l),
            Err(_) => {
                let _ = child.kill();
                panic!("not ready within {WAIT:?}:\n{}", log.join("\n"));
            }
        }
    }
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > WAIT {
            let _ = child.kill();
            panic!("still running {WAIT:?} after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The reader ends at the end of the pipe.
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(10)) {
        log.push(l);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "exit status {status:?}:\n{}", log.join("\n"));
    let text = log.join("\n");
    assert!(text.contains("kairos serve: draining (0 request(s) in flight"), "{text}");
    assert!(text.contains("kairos serve: drained in"), "{text}");
    assert!(text.contains("kairos serve stopped"), "{text}");
}
