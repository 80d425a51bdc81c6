//! A sampling CPU profile of the whole process, for finding where host time goes on a device
//! machine that has no `perf` (`KAIROS_CPU_PROFILE=PATH`, binary built with `--features
//! cpu-profile`).
//!
//! Samples every thread at [`SAMPLE_HZ`] of CPU time (SIGPROF), and at exit writes `PATH.folded`
//! (one line per distinct stack: `thread;outermost;...;innermost count`, the input of flame-graph
//! tools), `PATH.svg` (a flame graph) and `PATH.top.txt` (per thread: its samples, and the
//! functions with the most samples inclusive and exclusive). Built without the feature, setting
//! the variable only prints that the binary cannot profile.

/// The environment variable that turns profiling on and names the output files' common prefix.
pub const ENV: &str = "KAIROS_CPU_PROFILE";

/// Samples per second of CPU time.
#[cfg(feature = "cpu-profile")]
pub const SAMPLE_HZ: i32 = 1999;

/// Functions listed per thread in `PATH.top.txt`.
#[cfg(feature = "cpu-profile")]
const TOP_FUNCTIONS: usize = 40;

/// A running profile; [`Guard::finish`] writes it.
pub struct Guard {
    #[cfg(feature = "cpu-profile")]
    inner: Option<(pprof::ProfilerGuard<'static>, String)>,
}

/// Starts profiling when [`ENV`] is set.
pub fn start() -> Guard {
    let path = std::env::var(ENV).ok().filter(|p| !p.is_empty());
    #[cfg(feature = "cpu-profile")]
    {
        let inner = path.and_then(|p| {
            match pprof::ProfilerGuardBuilder::default()
                .frequency(SAMPLE_HZ)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
            {
                Ok(g) => {
                    eprintln!("kairos: CPU profile at {SAMPLE_HZ} Hz, written to {p}.folded/.svg/.top.txt at exit");
                    Some((g, p))
                }
                Err(e) => {
                    eprintln!("kairos: cannot start the CPU profile ({e}); running without it");
                    None
                }
            }
        });
        Guard { inner }
    }
    #[cfg(not(feature = "cpu-profile"))]
    {
        if path.is_some() {
            eprintln!("kairos: {ENV} is set, but this binary was built without `--features cpu-profile`; no profile");
        }
        Guard {}
    }
}

impl Guard {
    /// Writes the profile (if one runs) and reports where.
    pub fn finish(self) {
        #[cfg(feature = "cpu-profile")]
        if let Some((g, path)) = self.inner {
            if let Err(e) = write(&g, &path) {
                eprintln!("kairos: the CPU profile could not be written: {e:#}");
            }
        }
    }
}

#[cfg(feature = "cpu-profile")]
fn write(g: &pprof::ProfilerGuard<'static>, path: &str) -> anyhow::Result<()> {
    use std::collections::HashMap;
    use std::io::Write;
    let report = g.report().build()?;
    let mut folded = std::io::BufWriter::new(std::fs::File::create(format!("{path}.folded"))?);
    // Per thread: total samples, samples per function inclusive (once per stack) and exclusive.
    type Counts = HashMap<String, i64>;
    let mut threads: HashMap<String, (i64, Counts, Counts)> = HashMap::new();
    for (frames, &count) in &report.data {
        let count = count as i64;
        let thread = frames.thread_name_or_id();
        // Outermost first; within a frame, the inlined functions outermost first.
        let names: Vec<String> = frames.frames.iter().rev().flat_map(|f| f.iter().rev().map(|s| s.name())).collect();
        writeln!(folded, "{};{} {count}", thread.replace(';', ":"), names.join(";").replace(' ', "_"))?;
        let t = threads.entry(thread).or_default();
        t.0 += count;
        let mut seen = std::collections::HashSet::new();
        for n in &names {
            if seen.insert(n.as_str()) {
                *t.1.entry(n.clone()).or_default() += count;
            }
        }
        if let Some(leaf) = names.last() {
            *t.2.entry(leaf.clone()).or_default() += count;
        }
    }
    folded.flush()?;
    let mut top = std::io::BufWriter::new(std::fs::File::create(format!("{path}.top.txt"))?);
    let mut by_samples: Vec<_> = threads.into_iter().collect();
    by_samples.sort_by_key(|(_, t)| -t.0);
    for (thread, (total, inclusive, exclusive)) in by_samples {
        writeln!(top, "== thread {thread}: {total} samples ({:.1} ms of CPU)", total as f64 * 1e3 / SAMPLE_HZ as f64)?;
        for (what, counts) in [("inclusive", inclusive), ("exclusive", exclusive)] {
            let mut v: Vec<_> = counts.into_iter().collect();
            v.sort_by_key(|(_, c)| -c);
            writeln!(top, "-- {what}")?;
            for (name, c) in v.into_iter().take(TOP_FUNCTIONS) {
                writeln!(top, "{:6.2}% {c:7} {name}", c as f64 * 100.0 / total.max(1) as f64)?;
            }
        }
    }
    top.flush()?;
    report.flamegraph(std::fs::File::create(format!("{path}.svg"))?)?;
    eprintln!("kairos: CPU profile written to {path}.folded, {path}.svg and {path}.top.txt");
    Ok(())
}
