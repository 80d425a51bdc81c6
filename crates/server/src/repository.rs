//! The model repository: a folder with one subfolder per model, each with an optional
//! `config.toml` in a flat TOML subset (`key = value` lines, `#` comments, strings in double
//! quotes, integers, decimals, booleans, arrays of integers; no tables).
//!
//! ```toml
//! # models/resnet18/config.toml
//! model = "resnet18"        # a zoo name, or an .onnx file in this folder
//! dtype = "f16"             # f32 (default) or f16
//! batch = 1                 # batch size (zoo models; the dynamic batch dimension of .onnx files)
//! seq_len = 128             # sequence length of transformers / other dynamic dimensions
//! class = "real-time"       # real-time or best-effort (default)
//! priority = 10             # higher is more urgent (default 0)
//! deadline_ms = 5.0         # latency target per request (alias latency_target_ms); none by default
//! tenant = 1                # fairness account (default 0)
//! instances = 2             # copies of the model (default 1), spread over `gpus`
//! gpus = [0, 1]             # devices the instances go to, round robin (default [0]); "auto": each
//!                           # instance on the GPU with the fewest weight bytes placed so far
//! version = "1"             # the version clients name (default "1")
//! seed = 7                  # zoo weights seed (default: the zoo's)
//! profile = "profile.json"  # a `kairos profile` JSON (default: the server's profile folder)
//! ```
//!
//! Without `config.toml`, a folder holding exactly one `.onnx` file serves that file, and any other
//! folder is read as a zoo model of the folder's name, with every default above.
//!
//! Nothing is read from outside the repository's root: model names are plain folder names, `model`
//! and `profile` are relative paths without `..`, and a model folder, `config.toml`, `.onnx` or
//! profile file that resolves (through symbolic links) outside the root is refused with an error.

use crate::error::ServeError;
use kairos_ir::DType;
use kairos_sched::Class;
use std::path::{Component, Path, PathBuf};

pub const CONFIG_FILE: &str = "config.toml";
/// Bytes of a config file (it is a handful of lines).
pub const CONFIG_BYTES_MAX: u64 = 64 * 1024;
/// Model names: folder names of `[A-Za-z0-9_.-]`, this long at most.
pub const MODEL_NAME_BYTES_MAX: usize = 128;
pub const INSTANCES_MAX: u32 = 64;
pub const BATCH_MAX: usize = 4096;
pub const SEQ_LEN_MAX: usize = 65_536;
/// A deadline beyond an hour is a mistake, not a target.
pub const DEADLINE_MS_MAX: f64 = 3_600_000.0;
/// The shortest deadline, 1 µs (a shorter one would round to no time at all).
pub const DEADLINE_MS_MIN: f64 = 0.001;

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
    pub priority: i32,
    pub deadline_ns: Option<u64>,
    pub tenant: u32,
    pub instances: u32,
    /// The GPUs the instances go to, round robin; empty: placed by the server (`gpus = "auto"`:
    /// each instance on the GPU with the fewest weight bytes placed so far).
    pub gpus: Vec<u32>,
    pub version: String,
    pub profile: Option<PathBuf>,
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
            priority: 0,
            deadline_ns: None,
            tenant: 0,
            instances: 1,
            gpus: vec![0],
            version: "1".into(),
            profile: None,
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

#[derive(Clone, Debug, PartialEq)]
enum Value {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
}

fn parse_value(s: &str) -> Result<Value, String> {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = rest.chars();
        loop {
            match chars.next() {
                None => return Err("unterminated string".into()),
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some('"') => out.push('"'),
                    Some('\\') => out.push('\\'),
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    other => return Err(format!("unknown escape \\{}", other.map(String::from).unwrap_or_default())),
                },
                Some(c) => out.push(c),
            }
        }
        if !chars.as_str().trim().is_empty() {
            return Err(format!("unexpected '{}' after the string", chars.as_str().trim()));
        }
        return Ok(Value::Str(out));
    }
    if let Some(inner) = s.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or("an array must end with ']'")?;
        let mut v = Vec::new();
        for item in inner.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            match parse_value(item)? {
                Value::Int(i) => v.push(i),
                _ => return Err(format!("array items must be integers, got '{item}'")),
            }
        }
        return Ok(Value::Ints(v));
    }
    match s {
        "true" => return Ok(Value::Bool(true)),
        "false" => return Ok(Value::Bool(false)),
        _ => {}
    }
    let plain = s.replace('_', "");
    if let Ok(i) = plain.parse::<i64>() {
        return Ok(Value::Int(i));
    }
    if let Ok(f) = plain.parse::<f64>()
        && f.is_finite()
    {
        return Ok(Value::Float(f));
    }
    Err(format!("'{s}' is not a string, number, boolean or integer array (strings need double quotes)"))
}

/// Strips a `#` comment that is not inside a string.
fn strip_comment(line: &str) -> &str {
    let mut in_str = false;
    let mut escaped = false;
    for (i, c) in line.char_indices() {
        match c {
            '\\' if in_str => escaped = !escaped,
            '"' if !escaped => in_str = !in_str,
            '#' if !in_str => return &line[..i],
            _ => escaped = false,
        }
        if c != '\\' {
            escaped = false;
        }
    }
    line
}

const KEYS: &[&str] = &[
    "model",
    "dtype",
    "batch",
    "seq_len",
    "seed",
    "class",
    "priority",
    "deadline_ms",
    "latency_target_ms",
    "tenant",
    "instances",
    "gpus",
    "version",
    "profile",
];

/// Parses a config file's text for the model in `dir` named `name`.
pub fn parse_config(name: &str, dir: &Path, text: &str) -> Result<ModelConfig, String> {
    let mut cfg = ModelConfig::defaults(name, default_source(name, dir)?);
    let mut seen: Vec<&str> = Vec::new();
    for (lineno, raw) in text.lines().enumerate() {
        let at = |m: String| format!("{CONFIG_FILE}:{}: {m}", lineno + 1);
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            return Err(at("tables are not supported: use plain `key = value` lines".into()));
        }
        let (key, value) = line.split_once('=').ok_or_else(|| at(format!("expected `key = value`, got '{line}'")))?;
        let key = key.trim();
        let Some(&known) = KEYS.iter().find(|k| **k == key) else {
            return Err(at(format!("unknown key '{key}' (known: {})", KEYS.join(", "))));
        };
        let canonical = if known == "latency_target_ms" { "deadline_ms" } else { known };
        if seen.contains(&canonical) {
            return Err(at(format!("'{key}' is set twice")));
        }
        seen.push(canonical);
        let value = parse_value(value).map_err(&at)?;
        let int = |lo: i64, hi: i64| match &value {
            Value::Int(i) if (lo..=hi).contains(i) => Ok(*i),
            Value::Int(i) => Err(at(format!("{key} = {i} must be in {lo}..={hi}"))),
            _ => Err(at(format!("{key} must be an integer"))),
        };
        let string = || match &value {
            Value::Str(s) => Ok(s.clone()),
            _ => Err(at(format!("{key} must be a string in double quotes"))),
        };
        match canonical {
            "model" => {
                let m = string()?;
                cfg.source = if m.ends_with(".onnx") {
                    let p = dir.join(relative_path(key, &m).map_err(&at)?);
                    if !p.is_file() {
                        return Err(at(format!("model file {} does not exist", p.display())));
                    }
                    ModelSource::Onnx(p)
                } else {
                    ModelSource::Zoo(m)
                };
            }
            "dtype" => {
                let s = string()?;
                cfg.dtype = match DType::parse(&s) {
                    Some(d @ (DType::F32 | DType::F16)) => d,
                    _ => return Err(at(format!("dtype '{s}': use f32 or f16"))),
                };
            }
            "batch" => cfg.batch = int(1, BATCH_MAX as i64)? as usize,
            "seq_len" => cfg.seq_len = int(1, SEQ_LEN_MAX as i64)? as usize,
            "seed" => cfg.seed = int(0, i64::MAX)? as u64,
            "class" => {
                let s = string()?;
                cfg.class = parse_class(&s).ok_or_else(|| at(format!("class '{s}': use real-time or best-effort")))?;
            }
            "priority" => cfg.priority = int(i32::MIN as i64, i32::MAX as i64)? as i32,
            "deadline_ms" => {
                let ms = match value {
                    Value::Int(i) => i as f64,
                    Value::Float(f) => f,
                    _ => return Err(at(format!("{key} must be a number of milliseconds"))),
                };
                if !(DEADLINE_MS_MIN..=DEADLINE_MS_MAX).contains(&ms) {
                    return Err(at(format!("{key} = {ms} must be in [{DEADLINE_MS_MIN}, {DEADLINE_MS_MAX}]")));
                }
                cfg.deadline_ns = Some((ms * 1e6).round() as u64);
            }
            "tenant" => cfg.tenant = int(0, u32::MAX as i64)? as u32,
            "instances" => cfg.instances = int(1, INSTANCES_MAX as i64)? as u32,
            "gpus" => match &value {
                Value::Ints(v) if !v.is_empty() && v.iter().all(|&g| (0..=u16::MAX as i64).contains(&g)) => {
                    cfg.gpus = v.iter().map(|&g| g as u32).collect();
                }
                Value::Int(g) if (0..=u16::MAX as i64).contains(g) => cfg.gpus = vec![*g as u32],
                Value::Str(s) if s == "auto" => cfg.gpus = Vec::new(),
                _ => return Err(at("gpus must be a non-empty array of device numbers, like [0, 1], or \"auto\"".into())),
            },
            "version" => {
                let v = string()?;
                if !valid_model_name(&v) {
                    return Err(at(format!("version '{v}' must be letters, digits, '_', '.' or '-'")));
                }
                cfg.version = v;
            }
            "profile" => cfg.profile = Some(dir.join(relative_path(key, &string()?).map_err(&at)?)),
            _ => unreachable!("every known key is handled"),
        }
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

    fn dir() -> PathBuf {
        std::env::temp_dir()
    }

    #[test]
    fn full_config() {
        let text = r#"
            # a comment
            model = "resnet18"   # trailing comment
            dtype = "f16"
            batch = 2
            class = "real-time"
            priority = -3
            latency_target_ms = 2.5
            tenant = 7
            instances = 3
            gpus = [0, 1]
            version = "2"
            seed = 1_000
        "#;
        let c = parse_config("r18", &dir(), text).unwrap();
        assert_eq!(c.source, ModelSource::Zoo("resnet18".into()));
        assert_eq!((c.dtype, c.batch, c.class, c.priority, c.tenant), (DType::F16, 2, Class::RealTime, -3, 7));
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
            ("colour = \"red\"", "1: unknown key 'colour'"),
            ("\n\nbatch = 0", "3: batch = 0 must be in"),
            ("batch = \"2\"", "batch must be an integer"),
            ("dtype = \"i64\"", "use f32 or f16"),
            ("class = \"urgent\"", "use real-time or best-effort"),
            ("deadline_ms = -1", "must be in [0.001"),
            // Regression (fuzzing): a positive deadline below 1 ns rounded to a deadline of 0 ns.
            ("deadline_ms = 0.0000000000001", "must be in [0.001"),
            ("deadline_ms = 0", "must be in [0.001"),
            ("deadline_ms = 1\nlatency_target_ms = 2", "set twice"),
            ("[model]", "tables are not supported"),
            ("model = \"x.onnx\"", "does not exist"),
            ("gpus = []", "non-empty array"),
            ("name = unquoted", "unknown key 'name'"),
            ("model = resnet18", "not a string"),
            ("model = \"resnet18", "unterminated string"),
            ("version = \"../x\"", "letters, digits"),
            ("just words", "expected `key = value`"),
        ] {
            let e = parse_config("m", &dir(), text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(e.starts_with("config.toml:"), "{e}");
        }
    }

    #[test]
    fn comments_inside_strings_stay() {
        assert_eq!(strip_comment(r#"version = "a#b" # c"#).trim(), r#"version = "a#b""#);
        assert_eq!(parse_value(r#""a\"b""#).unwrap(), Value::Str("a\"b".into()));
    }

    #[test]
    fn model_names() {
        assert!(valid_model_name("resnet18_fp16-v1.2"));
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(MODEL_NAME_BYTES_MAX + 1)] {
            assert!(!valid_model_name(bad), "{bad}");
        }
    }
}
