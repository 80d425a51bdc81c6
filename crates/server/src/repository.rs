//! The model repository: a folder with one subfolder per model, each with an optional
//! `config.toml`: TOML with top-level keys and no tables, read with serde and the `toml` crate;
//! unknown keys are refused. [`CONFIG_KEYS`] is the one description of the keys: `kairos serve
//! --help` prints it ([`config_keys_help`]), and tests check that it names every key the reader
//! takes and that each example parses. For instance:
//!
//! ```toml
//! # models/resnet18/config.toml
//! model = "resnet18"
//! dtype = "f16"
//! class = "real-time"
//! deadline_ms = 5.0
//! ```
//!
//! Without `config.toml`, a folder holding exactly one `.onnx` file serves that file, and any other
//! folder is read as a zoo model of the folder's name, with every default.
//!
//! Nothing is read from outside the repository's root: model names are plain folder names, `model`
//! and `profile` are relative paths without `..`, and a model folder, `config.toml`, `.onnx` or
//! profile file that resolves (through symbolic links) outside the root is refused with an error.

use crate::error::ServeError;
use crate::state::PRIORITY_LEVELS_MAX;
use kairos_ir::DType;
use kairos_sched::Class;
use serde::Deserialize;
use std::path::{Component, Path, PathBuf};
use toml::Spanned;

pub const CONFIG_FILE: &str = "config.toml";
/// Bytes of a config file (it is a handful of lines).
pub const CONFIG_BYTES_MAX: u64 = 64 * 1024;
/// Model names: folder names of `[A-Za-z0-9_.-]`, this long at most.
pub const MODEL_NAME_BYTES_MAX: usize = 128;
pub const INSTANCES_MAX: u32 = 64;
pub const BATCH_MAX: usize = 4096;
pub const SEQ_LEN_MAX: usize = 65_536;
/// Shape variants of one model kept loaded at once (`shape_plans_max`), and its default.
pub const SHAPE_PLANS_MAX: usize = 64;
pub const SHAPE_PLANS_DEFAULT: usize = 4;
/// A deadline beyond an hour is a mistake, not a target.
pub const DEADLINE_MS_MAX: f64 = 3_600_000.0;
/// The shortest deadline, 1 µs (a shorter one would round to no time at all).
pub const DEADLINE_MS_MIN: f64 = 0.001;

/// One `config.toml` key as `kairos serve --help` shows it.
#[derive(Clone, Copy, Debug)]
pub struct ConfigKey {
    pub key: &'static str,
    /// A value as written in the file (TOML).
    pub example: &'static str,
    /// What it means and its default (one paragraph; [`config_keys_help`] wraps it).
    pub help: &'static str,
}

/// Every `config.toml` key, in the order `--help` lists them.
pub const CONFIG_KEYS: &[ConfigKey] = &[
    ConfigKey {
        key: "model",
        example: "\"resnet18\"",
        help: "a zoo name (`kairos zoo list`), or an .onnx file in this folder (default: the \
               folder's only .onnx file, else the zoo model of the folder's name)",
    },
    ConfigKey { key: "dtype", example: "\"f16\"", help: "f32 (default) or f16" },
    ConfigKey {
        key: "batch",
        example: "1",
        help: "batch size (zoo models; the dynamic batch dimension of .onnx files), 1..=4096; default 1",
    },
    ConfigKey {
        key: "seq_len",
        example: "128",
        help: "transformers' sequence length / other dynamic dimensions, 1..=65536; default the zoo's",
    },
    ConfigKey {
        key: "batch_max",
        example: "8",
        help: "serve any batch 1..=batch_max (at most 4096) of a model whose inputs have a dynamic batch axis (an \
               .onnx file's symbolic axis 0, any zoo model): a plan per batch, made when a request needs it; \
               `batch` is the one loaded at start; default none (one batch)",
    },
    ConfigKey {
        key: "seq_len_min",
        example: "16",
        help: "with seq_len_max: the shortest sequence served, 1..=seq_len_max; default 1",
    },
    ConfigKey {
        key: "seq_len_max",
        example: "256",
        help: "serve any sequence length seq_len_min..=seq_len_max (at most 65536) of a model with dynamic \
               sequence axes (an .onnx file's symbolic axes after the first, zoo transformers): a plan per \
               length; `seq_len` (default: the zoo's, within the bounds) is the one loaded at start; default none",
    },
    ConfigKey {
        key: "shape_plans_max",
        example: "4",
        help: "with batch_max or seq_len_max: shapes besides the start-up one kept loaded at once, 1..=64 \
               (each holds its own copy of the weights; the least recently used idle one is unloaded first); \
               default 4",
    },
    ConfigKey {
        key: "class",
        example: "\"real-time\"",
        help: "real-time or best-effort (default; also rt, be, realtime, best_effort)",
    },
    ConfigKey {
        key: "priority_level",
        example: "10",
        help: "numbered as requests number theirs: 1 is the most urgent, 1000 the least, 0 none \
               (default); a request's own level overrides it",
    },
    ConfigKey {
        key: "deadline_ms",
        example: "5.0",
        help: "latency target per request, 0.001..=3600000 ms (alias latency_target_ms); default none",
    },
    ConfigKey { key: "tenant", example: "1", help: "fairness account, any u32; default 0" },
    ConfigKey { key: "instances", example: "2", help: "copies of the model, 1..=64, spread round robin over `gpus`; default 1" },
    ConfigKey {
        key: "gpus",
        example: "[0, 1]",
        help: "devices of the instances (default [0]; each < --gpus); one number, or \"auto\": \
               each instance on the GPU with the fewest weight bytes placed so far",
    },
    ConfigKey { key: "version", example: "\"1\"", help: "the version clients name: letters, digits, _ . -; default \"1\"" },
    ConfigKey { key: "seed", example: "7", help: "seed of a zoo model's weights, non-negative; default the zoo's" },
    ConfigKey {
        key: "profile",
        example: "\"p.json\"",
        help: "a `kairos profile` JSON in this folder (default: found in the server's profile \
               folder by model name)",
    },
];

/// [`CONFIG_KEYS`] as aligned `key = example   help` lines, indented by `indent` spaces, the help
/// wrapped at `width` columns.
pub fn config_keys_help(indent: usize, width: usize) -> String {
    let column = CONFIG_KEYS.iter().map(|k| k.key.len() + 3 + k.example.len()).max().unwrap_or(0) + 2;
    let mut out = String::new();
    for k in CONFIG_KEYS {
        let mut line = format!("{:indent$}{:<column$}", "", format!("{} = {}", k.key, k.example));
        let mut words_on_line = 0;
        for word in k.help.split_whitespace() {
            if words_on_line > 0 && line.len() + 1 + word.len() > width {
                out.push_str(&line);
                out.push('\n');
                line = " ".repeat(indent + column);
                words_on_line = 0;
            }
            if words_on_line > 0 {
                line.push(' ');
            }
            line.push_str(word);
            words_on_line += 1;
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// What a model folder serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Zoo(String),
    Onnx(PathBuf),
}

impl ModelSource {
    pub fn describe(&self) -> String {
        match self {
            ModelSource::Zoo(n) => format!("zoo:{n}"),
            ModelSource::Onnx(p) => p.display().to_string(),
        }
    }
}

/// One model's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    pub source: ModelSource,
    pub dtype: DType,
    pub batch: usize,
    pub seq_len: usize,
    pub seed: u64,
    pub class: Class,
    /// Priority level as requests number it (1 most urgent, 0 none); see `state::priority_of_level`.
    pub priority_level: u64,
    pub deadline_ns: Option<u64>,
    pub tenant: u32,
    pub instances: u32,
    /// The GPUs the instances go to, round robin; empty: placed by the server (`gpus = "auto"`:
    /// each instance on the GPU with the fewest weight bytes placed so far).
    pub gpus: Vec<u32>,
    pub version: String,
    pub profile: Option<PathBuf>,
    /// Dynamic shapes: the bounds of the batch and sequence length requests may use, and how many
    /// shape variants besides the start-up one stay loaded.
    pub shapes: ShapeBounds,
}

/// What shapes a model serves besides its start-up one (`batch`, `seq_len`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShapeBounds {
    /// Any batch in 1..=batch_max.
    pub batch_max: Option<usize>,
    /// Any sequence length in min..=max.
    pub seq_len: Option<(usize, usize)>,
    /// Shape variants besides the start-up one loaded at once (0 when no bound is set).
    pub plans_max: usize,
}

impl ShapeBounds {
    pub fn is_dynamic(&self) -> bool {
        self.batch_max.is_some() || self.seq_len.is_some()
    }

    /// "batch 1..=8, seq_len 16..=256, 4 shape plans" for the log and the model configuration.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(b) = self.batch_max {
            parts.push(format!("batch 1..={b}"));
        }
        if let Some((lo, hi)) = self.seq_len {
            parts.push(format!("seq_len {lo}..={hi}"));
        }
        if parts.is_empty() {
            return "fixed".into();
        }
        parts.push(format!("{} shape plans", self.plans_max));
        parts.join(", ")
    }
}

impl ModelConfig {
    pub fn defaults(name: &str, source: ModelSource) -> ModelConfig {
        ModelConfig {
            name: name.to_string(),
            source,
            dtype: DType::F32,
            batch: 1,
            seq_len: kairos_ir::zoo::DEFAULT_SEQ_LEN,
            seed: kairos_ir::zoo::DEFAULT_SEED,
            class: Class::BestEffort,
            priority_level: 0,
            deadline_ns: None,
            tenant: 0,
            instances: 1,
            gpus: vec![0],
            version: "1".into(),
            profile: None,
            shapes: ShapeBounds::default(),
        }
    }

    /// The `kairos_ir` model spec (an .onnx path or zoo name with load options).
    pub fn ir_spec(&self) -> kairos_ir::model::ModelSpec {
        let model = match &self.source {
            ModelSource::Zoo(n) => n.clone(),
            ModelSource::Onnx(p) => p.display().to_string(),
        };
        kairos_ir::model::ModelSpec { model, batch: self.batch, seq_len: self.seq_len, seed: self.seed, dtype: self.dtype }
    }

    /// The zoo or file name the profile set knows the model by.
    pub fn profile_key(&self) -> String {
        match &self.source {
            ModelSource::Zoo(n) => n.clone(),
            ModelSource::Onnx(p) => p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
        }
    }

    pub fn class_name(&self) -> &'static str {
        class_name(self.class)
    }
}

pub fn class_name(c: Class) -> &'static str {
    match c {
        Class::RealTime => "real-time",
        Class::BestEffort => "best-effort",
    }
}

pub fn parse_class(s: &str) -> Option<Class> {
    match s.to_ascii_lowercase().replace('_', "-").as_str() {
        "real-time" | "realtime" | "rt" => Some(Class::RealTime),
        "best-effort" | "besteffort" | "be" => Some(Class::BestEffort),
        _ => None,
    }
}

pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MODEL_NAME_BYTES_MAX
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// `config.toml` as written: every key is optional (the defaults are [`ModelConfig::defaults`]'s);
/// [`CONFIG_KEYS`] describes each. Integers are read as `i64` and range-checked here, so that an
/// error names the key and its range.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    model: Option<Spanned<String>>,
    dtype: Option<Spanned<String>>,
    batch: Option<Spanned<i64>>,
    seq_len: Option<Spanned<i64>>,
    seed: Option<Spanned<i64>>,
    class: Option<Spanned<String>>,
    priority_level: Option<Spanned<i64>>,
    /// Refused with a pointer to `priority_level` (it counted the other way round); not in
    /// [`CONFIG_KEYS`].
    priority: Option<Spanned<toml::Value>>,
    #[serde(alias = "latency_target_ms")]
    deadline_ms: Option<Spanned<f64>>,
    tenant: Option<Spanned<i64>>,
    instances: Option<Spanned<i64>>,
    gpus: Option<Spanned<toml::Value>>,
    version: Option<Spanned<String>>,
    profile: Option<Spanned<String>>,
    batch_max: Option<Spanned<i64>>,
    seq_len_min: Option<Spanned<i64>>,
    seq_len_max: Option<Spanned<i64>>,
    shape_plans_max: Option<Spanned<i64>>,
}

/// `config.toml:LINE:COLUMN: message` for a byte offset of `text`.
fn at(text: &str, offset: usize, m: impl std::fmt::Display) -> String {
    let before = &text[..text.floor_char_boundary(offset.min(text.len()))];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("{CONFIG_FILE}:{line}:{column}: {m}")
}

/// A toml error as `config.toml:LINE:COLUMN: key: message`, the key found in `doc` by the span.
fn toml_error(text: &str, doc: Option<&toml::de::DeTable<'_>>, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else { return format!("{CONFIG_FILE}: {}", e.message()) };
    let key = doc.and_then(|d| {
        d.iter()
            .find(|(k, v)| k.span().contains(&span.start) || v.span().contains(&span.start))
            .map(|(k, _)| k.get_ref().to_string())
    });
    match key {
        Some(k) if !e.message().contains(&format!("`{k}`")) => at(text, span.start, format!("{k}: {}", e.message())),
        _ => at(text, span.start, e.message()),
    }
}

/// Parses a config file's text for the model in `dir` named `name`.
pub fn parse_config(name: &str, dir: &Path, text: &str) -> Result<ModelConfig, String> {
    let mut cfg = ModelConfig::defaults(name, default_source(name, dir)?);
    let doc = toml::de::DeTable::parse(text).map_err(|e| toml_error(text, None, &e))?;
    if let Some((k, _)) = doc.get_ref().iter().find(|(_, v)| matches!(v.get_ref(), toml::de::DeValue::Table(_))) {
        return Err(at(text, k.span().start, "tables are not supported: use plain `key = value` lines"));
    }
    let file: ConfigFile = toml::from_str(text).map_err(|e| toml_error(text, Some(doc.get_ref()), &e))?;
    let int = |key: &str, v: &Spanned<i64>, lo: i64, hi: i64| {
        let i = *v.get_ref();
        if (lo..=hi).contains(&i) { Ok(i) } else { Err(at(text, v.span().start, format!("{key} = {i} must be in {lo}..={hi}"))) }
    };
    let path = |key: &str, v: &Spanned<String>| {
        relative_path(key, v.get_ref()).map(|p| dir.join(p)).map_err(|m| at(text, v.span().start, m))
    };
    if let Some(m) = &file.model {
        cfg.source = if m.get_ref().ends_with(".onnx") {
            let p = path("model", m)?;
            if !p.is_file() {
                return Err(at(text, m.span().start, format!("model file {} does not exist", p.display())));
            }
            ModelSource::Onnx(p)
        } else {
            ModelSource::Zoo(m.get_ref().clone())
        };
    }
    if let Some(s) = &file.dtype {
        cfg.dtype = match DType::parse(s.get_ref()) {
            Some(d @ (DType::F32 | DType::F16)) => d,
            _ => return Err(at(text, s.span().start, format!("dtype '{}': use f32 or f16", s.get_ref()))),
        };
    }
    if let Some(v) = &file.batch {
        cfg.batch = int("batch", v, 1, BATCH_MAX as i64)? as usize;
    }
    if let Some(v) = &file.seq_len {
        cfg.seq_len = int("seq_len", v, 1, SEQ_LEN_MAX as i64)? as usize;
    }
    if let Some(v) = &file.seed {
        cfg.seed = int("seed", v, 0, i64::MAX)? as u64;
    }
    if let Some(s) = &file.class {
        cfg.class = parse_class(s.get_ref())
            .ok_or_else(|| at(text, s.span().start, format!("class '{}': use real-time or best-effort", s.get_ref())))?;
    }
    if let Some(v) = &file.priority {
        return Err(at(
            text,
            v.span().start,
            "`priority` is now `priority_level`, numbered as requests number theirs: 1 is the most urgent, 1000 the least",
        ));
    }
    if let Some(v) = &file.priority_level {
        cfg.priority_level = int("priority_level", v, 0, PRIORITY_LEVELS_MAX as i64)? as u64;
    }
    if let Some(v) = &file.deadline_ms {
        let ms = *v.get_ref();
        if !(DEADLINE_MS_MIN..=DEADLINE_MS_MAX).contains(&ms) {
            return Err(at(
                text,
                v.span().start,
                format!("deadline_ms = {ms} must be in [{DEADLINE_MS_MIN}, {DEADLINE_MS_MAX}]"),
            ));
        }
        cfg.deadline_ns = Some((ms * 1e6).round() as u64);
    }
    if let Some(v) = &file.tenant {
        cfg.tenant = int("tenant", v, 0, u32::MAX as i64)? as u32;
    }
    if let Some(v) = &file.instances {
        cfg.instances = int("instances", v, 1, INSTANCES_MAX as i64)? as u32;
    }
    if let Some(v) = &file.gpus {
        let device = |g: &toml::Value| g.as_integer().filter(|g| (0..=u16::MAX as i64).contains(g)).map(|g| g as u32);
        cfg.gpus = match v.get_ref() {
            toml::Value::Array(a) if !a.is_empty() && a.iter().all(|g| device(g).is_some()) => {
                a.iter().filter_map(device).collect()
            }
            toml::Value::String(s) if s == "auto" => Vec::new(),
            g => match device(g) {
                Some(g) => vec![g],
                None => {
                    return Err(at(
                        text,
                        v.span().start,
                        "gpus must be a non-empty array of device numbers, like [0, 1], or \"auto\"",
                    ));
                }
            },
        };
    }
    if let Some(v) = &file.version {
        if !valid_model_name(v.get_ref()) {
            return Err(at(text, v.span().start, format!("version '{}' must be letters, digits, '_', '.' or '-'", v.get_ref())));
        }
        cfg.version = v.get_ref().clone();
    }
    if let Some(p) = &file.profile {
        cfg.profile = Some(path("profile", p)?);
    }
    if let Some(v) = &file.batch_max {
        let b = int("batch_max", v, 1, BATCH_MAX as i64)? as usize;
        if cfg.batch > b {
            return Err(at(text, v.span().start, format!("batch = {} is above batch_max = {b}", cfg.batch)));
        }
        cfg.shapes.batch_max = Some(b);
    }
    match (&file.seq_len_min, &file.seq_len_max) {
        (Some(v), None) => return Err(at(text, v.span().start, "seq_len_min needs seq_len_max (the longest sequence served)")),
        (min, Some(v)) => {
            let hi = int("seq_len_max", v, 1, SEQ_LEN_MAX as i64)?;
            let lo = match min {
                Some(m) => int("seq_len_min", m, 1, hi)?,
                None => 1,
            } as usize;
            let hi = hi as usize;
            if file.seq_len.is_none() {
                // The zoo's default length, kept within the bounds.
                cfg.seq_len = cfg.seq_len.clamp(lo, hi);
            } else if !(lo..=hi).contains(&cfg.seq_len) {
                return Err(at(
                    text,
                    v.span().start,
                    format!("seq_len = {} is outside seq_len_min..=seq_len_max ({lo}..={hi})", cfg.seq_len),
                ));
            }
            cfg.shapes.seq_len = Some((lo, hi));
        }
        (None, None) => {}
    }
    match &file.shape_plans_max {
        Some(v) if !cfg.shapes.is_dynamic() => {
            return Err(at(
                text,
                v.span().start,
                "shape_plans_max needs batch_max or seq_len_max (a model with one shape has no variants)",
            ));
        }
        Some(v) => cfg.shapes.plans_max = int("shape_plans_max", v, 1, SHAPE_PLANS_MAX as i64)? as usize,
        None if cfg.shapes.is_dynamic() => cfg.shapes.plans_max = SHAPE_PLANS_DEFAULT,
        None => {}
    }
    Ok(cfg)
}

/// A file named in `config.toml`: a relative path below the model's folder (no root, no `..`, no
/// NUL), so it cannot name a file outside the repository by itself (symbolic links are checked by
/// [`Repository::config`]).
fn relative_path<'a>(key: &str, value: &'a str) -> Result<&'a Path, String> {
    let p = Path::new(value);
    if value.contains('\0') {
        return Err(format!("{key} '{}' holds a NUL byte", value.escape_debug()));
    }
    if value.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)) {
        return Err(format!(
            "{key} '{}' must be a relative path inside the model's folder (no absolute path, no '..')",
            value.escape_debug()
        ));
    }
    Ok(p)
}

/// The model a folder serves without a `model` key: its only .onnx file, else the folder's name as
/// a zoo model.
fn default_source(name: &str, dir: &Path) -> Result<ModelSource, String> {
    let mut onnx = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "onnx") && p.is_file() {
                onnx.push(p);
            }
        }
    }
    match onnx.len() {
        0 => Ok(ModelSource::Zoo(name.to_string())),
        1 => Ok(ModelSource::Onnx(onnx.pop().unwrap())),
        n => Err(format!("{n} .onnx files in {}: name one with `model = \"file.onnx\"` in {CONFIG_FILE}", dir.display())),
    }
}

/// The repository folder.
#[derive(Clone, Debug)]
pub struct Repository {
    pub root: PathBuf,
}

impl Repository {
    pub fn new(root: impl Into<PathBuf>) -> Repository {
        Repository { root: root.into() }
    }

    /// The model folders' names, sorted.
    pub fn model_names(&self) -> Result<Vec<String>, ServeError> {
        let rd = std::fs::read_dir(&self.root)
            .map_err(|e| ServeError::Invalid(format!("model repository {}: {e}", self.root.display())))?;
        let mut names = Vec::new();
        for e in rd.flatten() {
            if e.path().is_dir() {
                let n = e.file_name().to_string_lossy().into_owned();
                if !n.starts_with('.') {
                    names.push(n);
                }
            }
        }
        names.sort();
        Ok(names)
    }

    /// Reads one model's configuration. Refuses names that are not plain folder names and any
    /// folder or file that resolves outside the repository's root.
    pub fn config(&self, name: &str) -> Result<ModelConfig, ServeError> {
        if !valid_model_name(name) {
            return Err(ServeError::Invalid(format!(
                "'{}' is not a model name (letters, digits, '_', '.', '-'; at most {MODEL_NAME_BYTES_MAX} bytes)",
                name.escape_debug()
            )));
        }
        let dir = self.root.join(name);
        if !dir.is_dir() {
            return Err(ServeError::NotFound(format!("no model '{name}' in the repository {}", self.root.display())));
        }
        let root = self
            .root
            .canonicalize()
            .map_err(|e| ServeError::Invalid(format!("model repository {}: {e}", self.root.display())))?;
        self.inside(&root, name, "its folder", &dir)?;
        let file = dir.join(CONFIG_FILE);
        if file.symlink_metadata().is_ok() {
            // Checked before reading: a link to a file outside must not show its lines in errors.
            self.inside(&root, name, CONFIG_FILE, &file)?;
        }
        let text = if file.is_file() {
            let len = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
            if len > CONFIG_BYTES_MAX {
                return Err(ServeError::Invalid(format!("{} is {len} bytes (limit {CONFIG_BYTES_MAX})", file.display())));
            }
            std::fs::read_to_string(&file).map_err(|e| ServeError::Invalid(format!("{}: {e}", file.display())))?
        } else {
            String::new()
        };
        let cfg = parse_config(name, &dir, &text).map_err(|e| ServeError::Invalid(format!("model '{name}': {e}")))?;
        match &cfg.source {
            ModelSource::Onnx(p) => self.inside(&root, name, "its model file", p)?,
            // A zoo name is only ever a zoo name: `kairos_ir` would read an existing file of that
            // name relative to the working directory.
            ModelSource::Zoo(z) if kairos_ir::zoo::find(z).is_none() => {
                return Err(ServeError::Invalid(format!(
                    "model '{name}': unknown model '{}': not a zoo name (kairos zoo list) and not an .onnx file in its folder",
                    z.escape_debug()
                )));
            }
            ModelSource::Zoo(_) => {}
        }
        if let Some(p) = &cfg.profile
            && p.symlink_metadata().is_ok()
        {
            self.inside(&root, name, "its profile", p)?;
        }
        Ok(cfg)
    }

    /// Refuses `path` (a file or folder of model `name`) if it resolves outside `root` (canonical).
    fn inside(&self, root: &Path, name: &str, what: &str, path: &Path) -> Result<(), ServeError> {
        let real = path.canonicalize().map_err(|e| ServeError::Invalid(format!("model '{name}': {}: {e}", path.display())))?;
        if real.starts_with(root) {
            Ok(())
        } else {
            Err(ServeError::Invalid(format!(
                "model '{name}': {what} ({}) resolves outside the model repository {} (a symbolic link?)",
                path.display(),
                self.root.display()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty model folder of this test process (the system's temporary folder may hold .onnx
    /// files, which a folder without `model =` would serve).
    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("kairos-repository-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn full_config() {
        let text = r#"
            # a comment
            model = "resnet18"   # trailing comment
            dtype = "f16"
            batch = 2
            class = "real-time"
            priority_level = 3
            latency_target_ms = 2.5
            tenant = 7
            instances = 3
            gpus = [0, 1]
            version = "2"
            seed = 1_000
        "#;
        let c = parse_config("r18", &dir(), text).unwrap();
        assert_eq!(c.source, ModelSource::Zoo("resnet18".into()));
        assert_eq!((c.dtype, c.batch, c.class, c.priority_level, c.tenant), (DType::F16, 2, Class::RealTime, 3, 7));
        assert_eq!(c.deadline_ns, Some(2_500_000));
        assert_eq!((c.instances, c.gpus.clone(), c.version.as_str(), c.seed), (3, vec![0, 1], "2", 1000));
    }

    #[test]
    fn gpus_auto_leaves_placement_to_the_server() {
        let c = parse_config("r18", &dir(), "gpus = \"auto\"\ninstances = 4").unwrap();
        assert!(c.gpus.is_empty());
        assert!(parse_config("r18", &dir(), "gpus = \"some\"").unwrap_err().to_string().contains("\"auto\""));
    }

    #[test]
    fn defaults_without_a_file() {
        let c = parse_config("mobilenet_v2", Path::new("/nonexistent"), "").unwrap();
        assert_eq!(c.source, ModelSource::Zoo("mobilenet_v2".into()));
        assert_eq!((c.dtype, c.batch, c.instances, c.class), (DType::F32, 1, 1, Class::BestEffort));
        assert_eq!(c.deadline_ns, None);
    }

    #[test]
    fn errors_name_the_line() {
        for (text, want) in [
            ("colour = \"red\"", "1:1: unknown field `colour`"),
            ("\n\nbatch = 0", "3:9: batch = 0 must be in"),
            ("batch = \"2\"", "1:9: batch: invalid type: string \"2\", expected i64"),
            ("dtype = \"i64\"", "use f32 or f16"),
            ("class = \"urgent\"", "use real-time or best-effort"),
            ("priority_level = 1001", "priority_level = 1001 must be in"),
            ("priority = 5", "`priority` is now `priority_level`"),
            ("deadline_ms = -1", "must be in [0.001"),
            ("deadline_ms = \"5\"", "deadline_ms: invalid type: string"),
            // Regression (fuzzing): a positive deadline below 1 ns rounded to a deadline of 0 ns.
            ("deadline_ms = 0.0000000000001", "must be in [0.001"),
            ("deadline_ms = 0", "must be in [0.001"),
            ("deadline_ms = nan", "must be in [0.001"),
            ("deadline_ms = 1\nlatency_target_ms = 2", "duplicate field `deadline_ms`"),
            ("batch = 1\nbatch = 2", "2:1: duplicate key"),
            ("[model]", "1:2: tables are not supported"),
            ("model = { a = 1 }", "tables are not supported"),
            ("model = \"x.onnx\"", "does not exist"),
            ("model = \"../x.onnx\"", "must be a relative path"),
            ("profile = \"/etc/passwd\"", "must be a relative path"),
            ("gpus = []", "non-empty array"),
            ("gpus = [0, -1]", "non-empty array"),
            ("gpus = 70000", "non-empty array"),
            ("tenant = 4294967296", "tenant = 4294967296 must be in 0..=4294967295"),
            ("name = unquoted", "1:8:"),
            ("model = resnet18", "1:9:"),
            ("model = \"resnet18", "1:18: invalid basic string"),
            ("version = \"../x\"", "letters, digits"),
            ("just words", "1:"),
            ("batch_max = 0", "batch_max = 0 must be in 1..=4096"),
            ("batch_max = 5000", "batch_max = 5000 must be in 1..=4096"),
            ("batch = 9\nbatch_max = 8", "batch = 9 is above batch_max = 8"),
            ("seq_len_min = 4", "seq_len_min needs seq_len_max"),
            ("seq_len_max = 70000", "seq_len_max = 70000 must be in 1..=65536"),
            ("seq_len_min = 40\nseq_len_max = 32", "seq_len_min = 40 must be in 1..=32"),
            ("seq_len = 300\nseq_len_max = 256", "seq_len = 300 is outside seq_len_min..=seq_len_max (1..=256)"),
            ("shape_plans_max = 2", "shape_plans_max needs batch_max or seq_len_max"),
            ("batch_max = 4\nshape_plans_max = 65", "shape_plans_max = 65 must be in 1..=64"),
        ] {
            let e = parse_config("m", &dir(), text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.starts_with("config.toml:"), "{e}");
        }
    }

    #[test]
    fn shape_bounds() {
        let c = parse_config("m", &dir(), "batch = 2\nbatch_max = 8\nseq_len_min = 16\nseq_len_max = 64").unwrap();
        assert_eq!(c.shapes, ShapeBounds { batch_max: Some(8), seq_len: Some((16, 64)), plans_max: SHAPE_PLANS_DEFAULT });
        // The zoo's default length (128) is kept within the bounds when seq_len is not given.
        assert_eq!((c.batch, c.seq_len), (2, 64));
        assert_eq!(c.shapes.describe(), "batch 1..=8, seq_len 16..=64, 4 shape plans");
        let c = parse_config("m", &dir(), "seq_len_max = 512\nshape_plans_max = 2").unwrap();
        assert_eq!((c.seq_len, c.shapes.seq_len, c.shapes.plans_max, c.shapes.batch_max), (128, Some((1, 512)), 2, None));
        let c = parse_config("m", &dir(), "").unwrap();
        assert!(!c.shapes.is_dynamic());
        assert_eq!(c.shapes.describe(), "fixed");
    }

    #[test]
    fn comments_inside_strings_stay() {
        let c = parse_config("m", &dir(), r#"version = "a#b" # c"#).unwrap_err();
        assert!(c.contains("version 'a#b'"), "{c}");
        let c = parse_config("m", &dir(), "version = \"v.2\" # c\nseed = 1_000 # d").unwrap();
        assert_eq!((c.version.as_str(), c.seed), ("v.2", 1000));
    }

    #[test]
    fn accepted_forms() {
        // One device number, a decimal or integer deadline, either alias, TOML's other string forms.
        let c = parse_config("m", &dir(), "gpus = 3\ndeadline_ms = 2\nmodel = 'resnet18'").unwrap();
        assert_eq!((c.gpus.clone(), c.deadline_ns), (vec![3], Some(2_000_000)));
        assert_eq!(c.source, ModelSource::Zoo("resnet18".into()));
        let c = parse_config("m", &dir(), "latency_target_ms = 0.5\ngpus = [0, 1,]\r\n").unwrap();
        assert_eq!((c.gpus.clone(), c.deadline_ns), (vec![0, 1], Some(500_000)));
    }

    /// The sample in this module's documentation parses, so the docs and the parser cannot drift.
    #[test]
    fn documented_samples_parse() {
        // Every key of the table with its example: `kairos serve --help`'s sample.
        let all: String = CONFIG_KEYS.iter().map(|k| format!("{} = {}\n", k.key, k.example)).collect();
        let c = parse_config("resnet18", &dir(), &all).unwrap_or_else(|e| panic!("{e}\n{all}"));
        assert_eq!((c.dtype, c.batch, c.seq_len, c.class, c.priority_level), (DType::F16, 1, 128, Class::RealTime, 10));
        assert_eq!((c.deadline_ns, c.tenant, c.instances, c.gpus.clone()), (Some(5_000_000), 1, 2, vec![0, 1]));
        assert_eq!((c.version.as_str(), c.seed, c.profile.clone()), ("1", 7, Some(dir().join("p.json"))));
        assert_eq!(c.source, ModelSource::Zoo("resnet18".into()));
        // The module docs' sample.
        let src = include_str!("repository.rs");
        let start = src.find("//! ```toml\n").unwrap() + "//! ```toml\n".len();
        let end = start + src[start..].find("//! ```\n").unwrap();
        let sample: String = src[start..end].lines().map(|l| format!("{}\n", l.strip_prefix("//!").unwrap())).collect();
        let c = parse_config("resnet18", &dir(), &sample).unwrap_or_else(|e| panic!("{e}\n{sample}"));
        assert_eq!((c.dtype, c.class, c.deadline_ns), (DType::F16, Class::RealTime, Some(5_000_000)));
        // README.md's: `printf '...' > models/resnet18/config.toml`.
        let readme = include_str!("../../../README.md");
        let line = readme.lines().find(|l| l.contains("> models/resnet18/config.toml")).unwrap();
        let quoted = line.split('\'').nth(1).unwrap().replace("\\n", "\n");
        let c = parse_config("resnet18", &dir(), &quoted).unwrap_or_else(|e| panic!("{e}\n{quoted}"));
        assert_eq!((c.dtype, c.class), (DType::F16, Class::RealTime));
    }

    #[test]
    fn the_key_table_names_every_key_the_reader_takes() {
        // serde's unknown-field error lists the fields the reader takes.
        let e = parse_config("m", &dir(), "no_such_key = 1").unwrap_err();
        let listed = e.split("expected one of ").nth(1).unwrap_or_else(|| panic!("{e}"));
        let mut read: Vec<&str> = listed.split(", ").map(|f| f.trim().trim_matches('`')).collect();
        // Refused or aliases: not keys of their own.
        read.retain(|f| !["priority", "latency_target_ms"].contains(f));
        let mut documented: Vec<&str> = CONFIG_KEYS.iter().map(|k| k.key).collect();
        read.sort_unstable();
        documented.sort_unstable();
        assert_eq!(read, documented, "{e}");
    }

    #[test]
    fn the_key_table_states_the_limits_the_reader_checks() {
        let help = |key: &str| CONFIG_KEYS.iter().find(|k| k.key == key).unwrap().help;
        assert!(help("batch").contains(&format!("1..={BATCH_MAX}")));
        assert!(help("seq_len").contains(&format!("1..={SEQ_LEN_MAX}")));
        assert!(help("instances").contains(&format!("1..={INSTANCES_MAX}")));
        assert!(help("batch_max").contains(&format!("(at most {BATCH_MAX})")));
        assert!(help("seq_len_max").contains(&format!("(at most {SEQ_LEN_MAX})")));
        assert!(help("shape_plans_max").contains(&format!("1..={SHAPE_PLANS_MAX}")));
        assert!(help("shape_plans_max").contains(&format!("default {SHAPE_PLANS_DEFAULT}")));
        assert!(help("priority_level").contains(&format!("{PRIORITY_LEVELS_MAX} the least")));
        assert!(help("deadline_ms").contains(&format!("{DEADLINE_MS_MIN}..={DEADLINE_MS_MAX} ms")));
        let text = config_keys_help(2, 100);
        assert_eq!(text.lines().filter(|l| l.contains(" = ")).count(), CONFIG_KEYS.len(), "{text}");
        assert!(text.lines().all(|l| l.starts_with("  ") && l.len() <= 100), "{text}");
        let words = |t: &str| t.split_whitespace().count();
        let table: usize = CONFIG_KEYS.iter().map(|k| 2 + words(k.example) + words(k.help)).sum();
        assert_eq!(words(&text), table, "no word lost in wrapping:\n{text}");
    }

    #[test]
    fn model_names() {
        assert!(valid_model_name("resnet18_fp16-v1.2"));
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(MODEL_NAME_BYTES_MAX + 1)] {
            assert!(!valid_model_name(bad), "{bad}");
        }
    }
}
