//! The CUDA backend's process-wide settings.
//!
//! Library code never consults the environment on its own: a program (the `kairos` binary, a GPU
//! test, an example) builds a [`Settings`] — usually with [`Settings::from_env`], which reads the
//! variables listed in [`ENV_VARS`] (the README's table lists the same names, checked by a test
//! in the binary) — and installs it once with [`configure`] before it opens a GPU. Until then,
//! and in a program that never calls [`configure`], the settings are [`Settings::default`]: no
//! CUBIN cache folder, compilation on every core, progress on stderr, light launches on, two
//! launcher threads shared by streams and one for real-time streams alone, eight hardware queues.

pub use crate::protocol::StopFlag;
use std::path::PathBuf;
use std::sync::OnceLock;

/// How compilation progress reaches stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A bar drawn in place on a terminal, log lines otherwise.
    Auto,
    /// Log lines even on a terminal.
    Lines,
    /// Nothing.
    Off,
}

pub use crate::launcher::LAUNCH_THREADS_MAX;

/// Where real-time (high-priority) streams make their driver calls while there are launcher
/// threads ([`Settings::urgent_launches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UrgentLaunches {
    /// Through the launcher threads like every stream (lanes shared by stream id).
    Posted,
    /// On the caller's (the dispatcher's) thread.
    Inline,
    /// On a launcher thread that only urgent streams use.
    Lane,
}

/// Every setting of the CUDA backend that a program may choose.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Where compiled kernel images (CUBIN) and autotuning choices are cached; `None`: nowhere
    /// (every process compiles what it needs). `KAIROS_CACHE_DIR`, else `~/.cache/kairos/cubin`.
    pub cache_dir: Option<PathBuf>,
    /// Threads compiling kernel units in the foreground; `None`: one per core.
    /// `KAIROS_COMPILE_JOBS`.
    pub compile_jobs: Option<usize>,
    /// Extra NVRTC options for every build (e.g. `--Ofast-compile=min`); they enter the cache
    /// keys, so images built with and without them never mix. `KAIROS_NVRTC_OPTIONS`.
    pub nvrtc_options: Vec<String>,
    /// Compilation progress on stderr. `KAIROS_PROGRESS=lines|off`.
    pub progress: ProgressMode,
    /// Recorded runs replay the kernels' plain builds (true) or light protocol launches (false).
    /// `KAIROS_RUN_KERNELS=light` sets false.
    pub run_kernels_plain: bool,
    /// Each protocol launch is a programmatic dependent of the one before on its stream (sm_90+;
    /// off by default: on the H200 it did not lower latency, docs/benchmarks.md "Overlapped
    /// launches"). `KAIROS_OVERLAP_LAUNCHES=1`.
    pub overlap_launches: bool,
    /// Launches the caller will not preempt run light (no per-block protocol work; protocol.cuh,
    /// point 7). `KAIROS_LIGHT_LAUNCHES=0` sets false: every launch under the full protocol.
    pub light_launches: bool,
    /// Threads making the driver call of each protocol launch ([`crate::launcher`]); 0: every
    /// launch on the caller's thread. `KAIROS_LAUNCH_THREADS` (0 to [`LAUNCH_THREADS_MAX`]).
    pub launch_threads: usize,
    /// Where streams above the default priority (real-time work) make their driver calls while
    /// there are launcher threads: through them like every stream (`posted`), on the caller's
    /// thread (`inline`), or on a launcher thread of their own (`lane`, the default), so a
    /// real-time launch never waits behind best-effort calls queued on a shared launcher. The lane
    /// needs a core of its own: on a host with fewer cores than the launcher threads and two,
    /// urgent streams post to the shared lanes.
    /// Measured on an H200: docs/benchmarks.md "Where DISB A's first-block tail came from".
    /// `KAIROS_URGENT_LAUNCHES=posted|inline|lane`.
    pub urgent_launches: UrgentLaunches,
    /// Hardware queues the driver gives the context's streams: what it reads from
    /// `CUDA_DEVICE_MAX_CONNECTIONS` (the driver's default is 8; kairos' scripts set 32).
    pub hardware_queues: u32,
    /// Where launches' preempt flags live (protocol.cuh, point 3): device memory, read at every
    /// block take and raised by a stream write (default), or mapped host memory, polled every
    /// 4 µs. `KAIROS_PREEMPT_FLAG=device|host`. A driver without stream writes falls back to host.
    pub stop_flag: StopFlag,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            cache_dir: None,
            compile_jobs: None,
            nvrtc_options: Vec::new(),
            progress: ProgressMode::Auto,
            run_kernels_plain: true,
            overlap_launches: false,
            light_launches: true,
            launch_threads: crate::gpu::LAUNCH_THREADS_DEFAULT,
            urgent_launches: UrgentLaunches::Lane,
            hardware_queues: 8,
            stop_flag: StopFlag::Device,
        }
    }
}

/// A variable whose value does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value}: {expected}")]
pub struct SettingsError {
    pub variable: &'static str,
    pub value: String,
    /// What it takes ("0 or 1", ...).
    pub expected: String,
}

fn bad(variable: &'static str, value: &str, expected: impl Into<String>) -> SettingsError {
    SettingsError { variable, value: value.to_string(), expected: expected.into() }
}

/// One environment variable [`Settings::from_env`] reads.
#[derive(Clone, Copy, Debug)]
pub struct EnvVar {
    pub name: &'static str,
    /// What it sets, in one line (the README's table says the same).
    pub meaning: &'static str,
}

/// The variables [`Settings::from_env`] reads.
pub const ENV_VARS: &[EnvVar] = &[
    EnvVar { name: "KAIROS_CACHE_DIR", meaning: "CUBIN and autotuning cache folder (default ~/.cache/kairos/cubin)" },
    EnvVar { name: "KAIROS_COMPILE_JOBS", meaning: "threads compiling kernel units (default: every core)" },
    EnvVar { name: "KAIROS_NVRTC_OPTIONS", meaning: "extra NVRTC options for every build, space-separated" },
    EnvVar { name: "KAIROS_PROGRESS", meaning: "compilation progress: lines or off (default: a bar on a terminal)" },
    EnvVar { name: "KAIROS_RUN_KERNELS", meaning: "light: recorded runs replay light protocol launches, not plain grids" },
    EnvVar { name: "KAIROS_OVERLAP_LAUNCHES", meaning: "1: overlap each launch's start with the previous one's end (sm_90+)" },
    EnvVar { name: "KAIROS_LIGHT_LAUNCHES", meaning: "0: every launch under the full protocol" },
    EnvVar { name: "KAIROS_PREEMPT_FLAG", meaning: "host: preempt flags in host memory, polled (default: device)" },
    EnvVar { name: "KAIROS_LAUNCH_THREADS", meaning: "launcher threads, 0 to 16 (default 2; 0: the dispatcher's thread)" },
    EnvVar { name: "KAIROS_URGENT_LAUNCHES", meaning: "posted|inline|lane: real-time streams' launches (default lane)" },
    EnvVar {
        name: "CUDA_DEVICE_MAX_CONNECTIONS",
        meaning: "the driver's hardware queues (default 8; set 32 for the stream pool)",
    },
];

impl Settings {
    /// The settings the variables of [`ENV_VARS`] give, each missing one at its default (the cache
    /// folder defaults to `~/.cache/kairos/cubin` when `HOME` is set). A value that does not parse
    /// is an error naming the variable.
    pub fn from_env() -> Result<Settings, SettingsError> {
        Settings::from_vars(|name| std::env::var(name).ok(), std::env::var_os("HOME").map(PathBuf::from))
    }

    /// [`Settings::from_env`] over any source of variables (`get(name)`), for tests.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>, home: Option<PathBuf>) -> Result<Settings, SettingsError> {
        let cache_dir = match get("KAIROS_CACHE_DIR") {
            Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
            _ => home.map(|h| h.join(".cache").join("kairos").join("cubin")),
        };
        let mut s = Settings { cache_dir, ..Settings::default() };
        if let Some(v) = get("KAIROS_COMPILE_JOBS") {
            let n = v.trim().parse::<usize>().ok().filter(|&n| n > 0);
            s.compile_jobs = Some(n.ok_or_else(|| bad("KAIROS_COMPILE_JOBS", &v, "a number of threads, at least 1"))?);
        }
        if let Some(v) = get("KAIROS_NVRTC_OPTIONS") {
            s.nvrtc_options = v.split_whitespace().map(str::to_string).collect();
        }
        if let Some(v) = get("KAIROS_PROGRESS") {
            s.progress = match v.trim() {
                "lines" => ProgressMode::Lines,
                "off" => ProgressMode::Off,
                "" | "auto" => ProgressMode::Auto,
                _ => return Err(bad("KAIROS_PROGRESS", &v, "lines, off or auto")),
            };
        }
        if let Some(v) = get("KAIROS_RUN_KERNELS") {
            s.run_kernels_plain = match v.trim() {
                "light" => false,
                "plain" | "" => true,
                _ => return Err(bad("KAIROS_RUN_KERNELS", &v, "plain or light")),
            };
        }
        if let Some(v) = get("KAIROS_OVERLAP_LAUNCHES") {
            s.overlap_launches = flag("KAIROS_OVERLAP_LAUNCHES", &v)?;
        }
        if let Some(v) = get("KAIROS_LIGHT_LAUNCHES") {
            s.light_launches = flag("KAIROS_LIGHT_LAUNCHES", &v)?;
        }
        if let Some(v) = get("KAIROS_LAUNCH_THREADS") {
            s.launch_threads = v.trim().parse::<usize>().ok().filter(|&n| n <= LAUNCH_THREADS_MAX).ok_or_else(|| {
                bad("KAIROS_LAUNCH_THREADS", &v, format!("a number of launcher threads (0 to {LAUNCH_THREADS_MAX})"))
            })?;
        }
        if let Some(v) = get("KAIROS_URGENT_LAUNCHES") {
            s.urgent_launches = match v.trim() {
                "inline" => UrgentLaunches::Inline,
                "lane" | "" => UrgentLaunches::Lane,
                "posted" => UrgentLaunches::Posted,
                _ => return Err(bad("KAIROS_URGENT_LAUNCHES", &v, "posted, inline or lane")),
            };
        }
        if let Some(v) = get("KAIROS_PREEMPT_FLAG") {
            s.stop_flag = match v.trim() {
                "device" | "" => StopFlag::Device,
                "host" => StopFlag::Host,
                _ => return Err(bad("KAIROS_PREEMPT_FLAG", &v, "device or host")),
            };
        }
        if let Some(v) = get("CUDA_DEVICE_MAX_CONNECTIONS") {
            s.hardware_queues = v
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| (1..=32).contains(&n))
                .ok_or_else(|| bad("CUDA_DEVICE_MAX_CONNECTIONS", &v, "1 to 32"))?;
        }
        Ok(s)
    }
}

/// A 0/1 variable's value (`name` for the error).
pub fn flag(name: &'static str, v: &str) -> Result<bool, SettingsError> {
    match v.trim() {
        "1" => Ok(true),
        "0" => Ok(false),
        _ => Err(bad(name, v, "0 or 1")),
    }
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Installs the process's settings. Call it once, before the first GPU or compilation; a second
/// call, or one after [`settings`] has been read, is refused (the settings in force are kept).
pub fn configure(settings: Settings) -> Result<(), AlreadyConfigured> {
    let mut wanted = Some(settings);
    SETTINGS.get_or_init(|| wanted.take().expect("taken once"));
    match wanted {
        None => Ok(()),
        Some(w) if SETTINGS.get() == Some(&w) => Ok(()),
        Some(_) => Err(AlreadyConfigured),
    }
}

/// [`configure`] came too late: other settings were already in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the CUDA backend's settings were already in force; configure them before opening a GPU")]
pub struct AlreadyConfigured;

/// The settings in force ([`configure`]'s, else the defaults).
pub fn settings() -> &'static Settings {
    SETTINGS.get_or_init(Settings::default)
}

/// For tests and examples: [`Settings::from_env`] installed with [`configure`]; a bad variable
/// panics with its message.
pub fn configure_from_env() {
    let s = Settings::from_env().unwrap_or_else(|e| panic!("{e}"));
    configure(s).unwrap_or_else(|e| panic!("{e}"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Settings::from_vars(|k| m.get(k).cloned(), Some(PathBuf::from("/home/u")))
    }

    #[test]
    fn missing_variables_give_the_defaults() {
        let s = from(&[]).unwrap();
        assert_eq!(s.cache_dir, Some(PathBuf::from("/home/u/.cache/kairos/cubin")));
        assert_eq!(Settings { cache_dir: None, ..s }, Settings::default());
        assert_eq!(Settings::from_vars(|_| None, None).unwrap(), Settings::default());
    }

    #[test]
    fn every_variable_sets_its_field() {
        let s = from(&[
            ("KAIROS_CACHE_DIR", "/c"),
            ("KAIROS_COMPILE_JOBS", "3"),
            ("KAIROS_NVRTC_OPTIONS", " --a  --b "),
            ("KAIROS_PROGRESS", "off"),
            ("KAIROS_RUN_KERNELS", "light"),
            ("KAIROS_OVERLAP_LAUNCHES", "1"),
            ("KAIROS_LIGHT_LAUNCHES", "0"),
            ("KAIROS_LAUNCH_THREADS", "0"),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "32"),
            ("KAIROS_PREEMPT_FLAG", "host"),
            ("KAIROS_URGENT_LAUNCHES", "inline"),
        ])
        .unwrap();
        assert_eq!(s.cache_dir, Some(PathBuf::from("/c")));
        assert_eq!(s.compile_jobs, Some(3));
        assert_eq!(s.nvrtc_options, ["--a", "--b"]);
        assert_eq!(s.progress, ProgressMode::Off);
        assert!(!s.run_kernels_plain && s.overlap_launches && !s.light_launches);
        assert_eq!((s.launch_threads, s.hardware_queues), (0, 32));
        assert_eq!(s.stop_flag, StopFlag::Host);
        assert_eq!(s.urgent_launches, UrgentLaunches::Inline);
        assert_eq!(from(&[("KAIROS_URGENT_LAUNCHES", "posted")]).unwrap().urgent_launches, UrgentLaunches::Posted);
        assert_eq!(from(&[("KAIROS_URGENT_LAUNCHES", "lane")]).unwrap().urgent_launches, UrgentLaunches::Lane);
        // Every variable read is in the table.
        let read = ["KAIROS_CACHE_DIR", "KAIROS_COMPILE_JOBS", "KAIROS_NVRTC_OPTIONS", "KAIROS_PROGRESS", "KAIROS_RUN_KERNELS"];
        for name in read {
            assert!(ENV_VARS.iter().any(|v| v.name == name), "{name}");
        }
        assert_eq!(ENV_VARS.len(), 11);
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (k, v) in [
            ("KAIROS_COMPILE_JOBS", "0"),
            ("KAIROS_COMPILE_JOBS", "many"),
            ("KAIROS_PROGRESS", "bar"),
            ("KAIROS_RUN_KERNELS", "fast"),
            ("KAIROS_OVERLAP_LAUNCHES", "yes"),
            ("KAIROS_LIGHT_LAUNCHES", "2"),
            ("KAIROS_LAUNCH_THREADS", "17"),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "0"),
            ("KAIROS_PREEMPT_FLAG", "pcie"),
            ("KAIROS_URGENT_LAUNCHES", "later"),
        ] {
            let e = from(&[(k, v)]).unwrap_err();
            assert_eq!((e.variable, e.value.as_str()), (k, v));
            assert!(e.to_string().starts_with(&format!("{k}={v}: ")), "{e}");
        }
    }
}
