//! Progress of a sweep on the terminal: one indicatif bar for the running point (hidden when stderr
//! is not a terminal) and one line per finished point, so logs of device runs show progress too.

use crate::experiment::Progress;
use crate::report::Point;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;

pub struct Bar {
    bar: ProgressBar,
    started: Instant,
}

impl Default for Bar {
    fn default() -> Self {
        let bar = ProgressBar::new(1000);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>9} [{bar:30}] {percent:>3}% {msg}")
                .expect("valid progress template")
                .progress_chars("=> "),
        );
        Bar { bar, started: Instant::now() }
    }
}

impl Bar {
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    fn line(&self, text: &str) {
        self.bar.suspend(|| eprintln!("{text}"));
    }
}

/// One line summarizing a finished point.
pub fn point_line(p: &Point) -> String {
    let o = &p.metrics.overall;
    let mut s = format!(
        "{:<18} {:<16} load {:<5} offered {:>8.1}/s served {:>8.1}/s p50 {:>9.3} ms p99 {:>9.3} ms",
        p.preset,
        p.policy,
        p.load,
        p.metrics.offered_per_s,
        o.throughput_per_s,
        o.latency.p50_ns as f64 / 1e6,
        o.latency.p99_ns as f64 / 1e6
    );
    for g in p.metrics.groups.iter().filter(|g| p.metrics.groups.len() > 1 && g.completed > 0) {
        s.push_str(&format!(" | {} p99 {:.3} ms", g.name, g.latency.p99_ns as f64 / 1e6));
        if let Some(r) = g.miss_rate() {
            s.push_str(&format!(" miss {:.1}%", r * 100.0));
        }
    }
    if p.saturated {
        s.push_str(" [saturated]");
    }
    s
}

impl Progress for Bar {
    fn message(&mut self, text: &str) {
        self.line(&format!("  {text}"));
    }

    fn point_start(&mut self, label: &str, index: usize, total: usize) {
        self.bar.reset();
        self.bar.set_length(1000);
        self.bar.set_prefix(format!("[{index}/{total}]"));
        self.bar.set_message(label.to_string());
    }

    fn fraction(&mut self, f: f64) {
        self.bar.set_position((f.clamp(0.0, 1.0) * 1000.0) as u64);
    }

    fn point_done(&mut self, p: &Point) {
        let t = self.started.elapsed().as_secs_f64();
        self.line(&format!("  {} ({:.1} s wall, {t:.0} s in all)", point_line(p), p.wall_s));
    }
}
