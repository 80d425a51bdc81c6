//! Progress of long GPU preparation work (kernel compilation, autotuning) on stderr, and the
//! process-wide activity line a server reports while it is not ready.
//!
//! On a terminal the progress is one line redrawn in place (a bar, the counts, the units running
//! and the elapsed time); otherwise, for logs, one line when the work starts, one per unit done and
//! one at the end. Nothing is printed when nothing needs compiling.

use crate::settings::ProgressMode;
use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::Instant;

/// What the process is preparing right now, if anything ("compiling kernels for resnet50: 3/7 units,
/// 12.4 s"): [`activity`] reads it.
static ACTIVITY: Mutex<Vec<(u64, String)>> = Mutex::new(Vec::new());
static ACTIVITY_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The preparation work under way in this process (compilations, autotuning), joined by "; ".
pub fn activity() -> Option<String> {
    let a = ACTIVITY.lock().unwrap_or_else(|e| e.into_inner());
    (!a.is_empty()).then(|| a.iter().map(|(_, s)| s.as_str()).collect::<Vec<_>>().join("; "))
}

/// An entry of [`activity`], removed on drop.
pub struct Activity(u64);

impl Activity {
    pub fn begin(text: String) -> Activity {
        let id = ACTIVITY_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ACTIVITY.lock().unwrap_or_else(|e| e.into_inner()).push((id, text));
        Activity(id)
    }

    pub fn set(&self, text: String) {
        let mut a = ACTIVITY.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = a.iter_mut().find(|e| e.0 == self.0) {
            e.1 = text;
        }
    }
}

impl Drop for Activity {
    fn drop(&mut self) {
        ACTIVITY.lock().unwrap_or_else(|e| e.into_inner()).retain(|e| e.0 != self.0);
    }
}

/// Whether progress is drawn in place: stderr is a terminal and the settings ask for no lines.
fn in_place() -> bool {
    std::io::stderr().is_terminal() && crate::settings::settings().progress == ProgressMode::Auto
}

/// Whether progress is printed at all (the settings' [`ProgressMode::Off`] silences it).
fn enabled() -> bool {
    crate::settings::settings().progress != ProgressMode::Off
}

struct State {
    running: Vec<bool>,
    done: usize,
    failed: usize,
}

/// Progress of one parallel compilation of kernel units.
pub struct CompileProgress {
    what: String,
    arch: u32,
    names: Vec<String>,
    t0: Instant,
    state: Mutex<State>,
    in_place: bool,
    enabled: bool,
    activity: Activity,
}

impl CompileProgress {
    /// Starts reporting the compilation of `names` (units) for `what` ("resnet50", "the library").
    pub fn start(what: &str, arch: u32, names: &[String], workers: usize) -> CompileProgress {
        let p = CompileProgress {
            what: what.to_string(),
            arch,
            names: names.to_vec(),
            t0: Instant::now(),
            state: Mutex::new(State { running: vec![false; names.len()], done: 0, failed: 0 }),
            in_place: in_place(),
            enabled: enabled(),
            activity: Activity::begin(format!("compiling kernels for {what}: 0/{} units", names.len())),
        };
        if p.enabled {
            let line = format!(
                "kairos: compiling {} kernel unit(s) for {what} (sm_{arch}, {workers} at a time; cached for later runs): {}",
                names.len(),
                names.join(", ")
            );
            eprintln!("{line}");
        }
        p
    }

    pub fn begin(&self, i: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.running[i] = true;
        self.draw(&s, None);
    }

    /// Unit `i` ended: its compile time in ms (None: another thread compiled it meanwhile), or an
    /// error.
    pub fn end(&self, i: usize, r: Result<Option<f64>, ()>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.running[i] = false;
        s.done += 1;
        if r.is_err() {
            s.failed += 1;
        }
        self.activity.set(format!(
            "compiling kernels for {}: {}/{} units, {:.1} s",
            self.what,
            s.done,
            self.names.len(),
            self.t0.elapsed().as_secs_f64()
        ));
        self.draw(&s, Some((i, r)));
    }

    fn draw(&self, s: &State, ended: Option<(usize, Result<Option<f64>, ()>)>) {
        if !self.enabled {
            return;
        }
        let elapsed_s = self.t0.elapsed().as_secs_f64();
        let n = self.names.len();
        if self.in_place {
            const WIDTH: usize = 24;
            let filled = (s.done * WIDTH).checked_div(n).unwrap_or(WIDTH);
            let running: Vec<&str> = s.running.iter().zip(&self.names).filter(|(r, _)| **r).map(|(_, n)| n.as_str()).collect();
            let mut line = format!(
                "\r[{}{}] {}/{n} kernel units, {elapsed_s:.0} s; compiling {}",
                "#".repeat(filled),
                ".".repeat(WIDTH - filled),
                s.done,
                if running.is_empty() { "-".to_string() } else { running.join(" ") }
            );
            line.truncate(160);
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "{line}\x1b[K");
            let _ = err.flush();
        } else if let Some((i, r)) = ended {
            match r {
                Ok(Some(ms)) => eprintln!(
                    "kairos: [{}/{n}] kernel unit {} compiled in {:.1} s ({elapsed_s:.1} s elapsed)",
                    s.done,
                    self.names[i],
                    ms / 1e3
                ),
                Ok(None) => eprintln!(
                    "kairos: [{}/{n}] kernel unit {} ready (compiled by another thread; {elapsed_s:.1} s elapsed)",
                    s.done, self.names[i]
                ),
                Err(()) => eprintln!("kairos: [{}/{n}] kernel unit {} failed to compile", s.done, self.names[i]),
            }
        }
    }

    /// Ends the report with a summary line.
    pub fn finish(self) {
        if !self.enabled {
            return;
        }
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if self.in_place {
            eprint!("\r\x1b[K");
        }
        eprintln!(
            "kairos: {} kernel unit(s) for {} (sm_{}) ready in {:.1} s{}",
            s.done - s.failed,
            self.what,
            self.arch,
            self.t0.elapsed().as_secs_f64(),
            if s.failed > 0 { format!(", {} failed", s.failed) } else { String::new() }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_lists_work_under_way_and_forgets_it_when_done() {
        let a = Activity::begin("compiling kernels for x: 0/2 units".into());
        assert!(activity().unwrap().contains("compiling kernels for x: 0/2 units"));
        a.set("compiling kernels for x: 1/2 units".into());
        let b = Activity::begin("autotuning y".into());
        let now = activity().unwrap();
        assert!(now.contains("x: 1/2 units") && now.contains("autotuning y"), "{now}");
        drop(a);
        drop(b);
        let now = activity().unwrap_or_default();
        assert!(!now.contains("x: 1/2") && !now.contains("autotuning y"), "{now}");
    }
}
