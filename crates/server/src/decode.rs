//! The one decoder of what a request asks for beyond its tensors, shared by REST, gRPC and the
//! shared-memory channel. Each front end converts its wire form (a JSON object, protobuf's
//! `InferParameter` map, the shared-memory submission's fields) into [`Params`] and
//! [`RequestedOutput`]s; [`decode`] turns them into the engine's options and the output selection
//! with one set of rules and error messages.
//!
//! | parameter | where | value | meaning |
//! |---|---|---|---|
//! | `priority` | request | integer in 0..=1000 | Triton's level: 1 is the most urgent, 0 the model's own |
//! | `timeout` | request | integer, microseconds | the request's deadline; past it the request is cancelled (504 / DEADLINE_EXCEEDED); 0: none |
//! | `kairos_deadline_us` | request | integer, microseconds | the request's deadline only: the scheduler's target and `kairos_deadline_missed`, with no cancellation (a late result is still delivered); 0: none. With `timeout` too, the deadline is this one and `timeout` only cancels |
//! | `kairos_class` | request | `real-time` or `best-effort` | overrides the model's class |
//! | `kairos_tenant` | request | integer fitting u32 | overrides the model's tenant |
//! | `sequence_id` | request | 0 | anything else: unsupported (no sequence batching) |
//! | `binary_data_output` | request | boolean | every output as binary data (REST) |
//! | `binary_data` | output | boolean | this output as binary data (REST) |
//! | `classification` | output | (any) | unsupported |
//! | `binary_data_size` | input | non-negative integer | the input's bytes in the binary part (REST, [`uint`]) |
//!
//! A parameter present with no value (JSON `null`, an `InferParameter` with no choice) counts as
//! absent, except `classification`, which is refused whenever it is named. Parameters kairos does
//! not know are ignored.

use crate::error::ServeError;
use crate::state::{ModelEntry, RequestParams, SubmitOptions, TIMEOUT_US_MAX};
use kairos_sched::Class;
use std::collections::HashMap;

/// A parameter's value as the wire carried it.
#[derive(Clone, Debug, PartialEq)]
pub enum Param {
    /// Present with no value: JSON `null`, an `InferParameter` without a choice.
    Null,
    Bool(bool),
    /// A signed integer (negative ones come only this way; non-negative ones may too).
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
    /// Anything else (a JSON array or object).
    Other,
}

/// Parameters by name.
pub type Params = HashMap<String, Param>;

/// An output the request names, with its parameters.
#[derive(Clone, Debug, Default)]
pub struct RequestedOutput {
    pub name: String,
    pub params: Params,
}

/// Which output goes back, and whether as binary data (REST's binary tensor extension; gRPC and
/// the shared-memory channel always send raw bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputChoice {
    pub index: usize,
    pub binary: bool,
}

/// What [`decode`] makes of a request.
#[derive(Clone, Debug)]
pub struct Decoded {
    pub options: SubmitOptions,
    /// In the order asked for; every output in the model's order when none is named.
    pub outputs: Vec<OutputChoice>,
}

fn get<'a>(p: &'a Params, key: &str) -> Option<&'a Param> {
    p.get(key).filter(|v| **v != Param::Null)
}

/// A non-negative integer parameter (absent or null: `None`).
pub fn uint(p: &Params, key: &str) -> Result<Option<u64>, ServeError> {
    match get(p, key) {
        None => Ok(None),
        Some(Param::Uint(v)) => Ok(Some(*v)),
        Some(Param::Int(v)) if *v >= 0 => Ok(Some(*v as u64)),
        Some(_) => Err(ServeError::invalid(format!("parameter '{key}' must be a non-negative integer"))),
    }
}

/// A boolean parameter (absent or null: `None`).
pub fn flag(p: &Params, key: &str) -> Result<Option<bool>, ServeError> {
    match get(p, key) {
        None => Ok(None),
        Some(Param::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ServeError::invalid(format!("parameter '{key}' must be a boolean"))),
    }
}

/// The request-level parameters kairos reads (see the table above).
pub fn request_params(p: &Params) -> Result<RequestParams, ServeError> {
    let class = match get(p, "kairos_class") {
        None => None,
        Some(Param::Str(s)) => Some(
            crate::repository::parse_class(s)
                .ok_or_else(|| ServeError::invalid(format!("kairos_class '{s}': use real-time or best-effort")))?,
        ),
        Some(_) => return Err(ServeError::invalid("parameter 'kairos_class' must be a string")),
    };
    let tenant = match uint(p, "kairos_tenant")? {
        None => None,
        Some(t) => Some(u32::try_from(t).map_err(|_| ServeError::invalid(format!("kairos_tenant {t} does not fit u32")))?),
    };
    match get(p, "sequence_id") {
        None | Some(Param::Int(0) | Param::Uint(0)) => {}
        Some(_) => return Err(ServeError::Unsupported("sequence batching (sequence_id) is not supported".into())),
    }
    Ok(RequestParams { priority_level: uint(p, "priority")?, timeout_us: uint(p, "timeout")?, class, tenant })
}

/// The shared-memory channel's class code as a `kairos_class` parameter (`None`: the model's).
pub fn class_code(code: u8) -> Result<Option<Param>, ServeError> {
    use kairos_client::shm::layout::{CLASS_BEST_EFFORT, CLASS_MODEL_DEFAULT, CLASS_REAL_TIME};
    match code {
        CLASS_MODEL_DEFAULT => Ok(None),
        CLASS_REAL_TIME => Ok(Some(Param::Str(class_name(Class::RealTime).into()))),
        CLASS_BEST_EFFORT => Ok(Some(Param::Str(class_name(Class::BestEffort).into()))),
        c => Err(ServeError::invalid(format!(
            "class code {c}: use {CLASS_MODEL_DEFAULT} (the model's), {CLASS_REAL_TIME} (real-time) or {CLASS_BEST_EFFORT} (best-effort)"
        ))),
    }
}

fn class_name(c: Class) -> &'static str {
    match c {
        Class::RealTime => "real-time",
        Class::BestEffort => "best-effort",
    }
}

/// The outputs to send back: those named (none named: every one), each binary when its
/// `binary_data` says so, else as the request's `binary_data_output` says (default: JSON).
pub fn outputs(m: &ModelEntry, p: &Params, requested: &[RequestedOutput]) -> Result<Vec<OutputChoice>, ServeError> {
    let default_binary = flag(p, "binary_data_output")?.unwrap_or(false);
    if requested.is_empty() {
        return Ok((0..m.outputs.len()).map(|index| OutputChoice { index, binary: default_binary }).collect());
    }
    let mut v = Vec::with_capacity(requested.len());
    for o in requested {
        let index = m.output_index(&o.name).ok_or_else(|| {
            ServeError::invalid(format!(
                "model '{}' has no output '{}' (outputs: {})",
                m.name(),
                o.name,
                m.outputs.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        if o.params.contains_key("classification") {
            return Err(ServeError::Unsupported("the classification extension is not supported".into()));
        }
        let binary = flag(&o.params, "binary_data")?.unwrap_or(default_binary);
        v.push(OutputChoice { index, binary });
    }
    Ok(v)
}

/// The `kairos_deadline_us` parameter: a deadline in microseconds with no cancellation, in the
/// range `timeout` has (absent, null or 0: `None`).
pub fn deadline_us(p: &Params) -> Result<Option<u64>, ServeError> {
    match uint(p, DEADLINE_US)? {
        None | Some(0) => Ok(None),
        Some(d) if d <= TIMEOUT_US_MAX => Ok(Some(d)),
        Some(d) => Err(ServeError::invalid(format!("{DEADLINE_US} {d} us exceeds {TIMEOUT_US_MAX} us"))),
    }
}

/// The name of the deadline-only parameter.
pub const DEADLINE_US: &str = "kairos_deadline_us";

/// Decodes a request's parameters and output selection against `m`: the engine's options (the
/// model's configuration overridden by the request, range-checked) and the outputs to send back.
/// `kairos_deadline_us`, when given, is the engine's deadline (over `timeout`'s); `timeout` alone
/// decides the cancellation.
pub fn decode(m: &ModelEntry, params: &Params, requested: &[RequestedOutput]) -> Result<Decoded, ServeError> {
    let mut options = m.submit_options(&request_params(params)?)?;
    if let Some(d) = deadline_us(params)? {
        options.engine.deadline_ns = Some(d * 1000);
    }
    let outputs = outputs(m, params, requested)?;
    Ok(Decoded { options, outputs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ModelEntry;
    use std::sync::Arc;

    fn params(v: &[(&str, Param)]) -> Params {
        v.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    fn err(r: Result<impl std::fmt::Debug, ServeError>) -> ServeError {
        r.expect_err("should fail")
    }

    fn invalid(r: Result<impl std::fmt::Debug, ServeError>, fragment: &str) {
        match err(r) {
            ServeError::Invalid(m) => assert!(m.contains(fragment), "'{fragment}' not in '{m}'"),
            e => panic!("not Invalid: {e:?}"),
        }
    }

    fn unsupported(r: Result<impl std::fmt::Debug, ServeError>, fragment: &str) {
        match err(r) {
            ServeError::Unsupported(m) => assert!(m.contains(fragment), "'{fragment}' not in '{m}'"),
            e => panic!("not Unsupported: {e:?}"),
        }
    }

    /// A model with input `x` and outputs `y`, `z` (no instances: nothing runs it).
    fn model() -> Arc<ModelEntry> {
        use crate::repository::{ModelConfig, ModelSource};
        use kairos_ir::DType;
        use kairos_ir::plan::IoTensor;
        let t = |name: &str| IoTensor { name: name.into(), shape: vec![1, 4], dtype: DType::F32 };
        Arc::new(ModelEntry {
            config: ModelConfig::defaults("m", ModelSource::Zoo("mlp".into())),
            inputs: vec![t("x")],
            outputs: vec![t("y"), t("z")],
            instances: Vec::new(),
            info: kairos_sched::ModelInfo {
                name: "m".into(),
                launches: 1,
                weight_bytes: 0,
                arena_bytes: 0,
                estimated_ns: 0,
                estimate_source: kairos_sched::EstimateSource::Roofline,
            },
            metrics: Default::default(),
            dynamic: None,
        })
    }

    #[test]
    fn empty_is_the_model_default() {
        assert_eq!(request_params(&Params::new()).unwrap(), RequestParams::default());
        let nulls = params(&[
            ("priority", Param::Null),
            ("timeout", Param::Null),
            ("kairos_class", Param::Null),
            ("kairos_tenant", Param::Null),
            ("sequence_id", Param::Null),
            ("binary_data_output", Param::Null),
        ]);
        assert_eq!(request_params(&nulls).unwrap(), RequestParams::default());
        let unknown = params(&[("something_else", Param::Str("x".into()))]);
        assert_eq!(request_params(&unknown).unwrap(), RequestParams::default());
    }

    #[test]
    fn priority_and_timeout() {
        for key in ["priority", "timeout"] {
            for (v, want) in [(Param::Uint(7), 7), (Param::Int(7), 7), (Param::Int(0), 0)] {
                let p = request_params(&params(&[(key, v)])).unwrap();
                let got = if key == "priority" { p.priority_level } else { p.timeout_us };
                assert_eq!(got, Some(want));
            }
            for bad in [Param::Int(-1), Param::Float(1.5), Param::Str("high".into()), Param::Bool(true), Param::Other] {
                invalid(request_params(&params(&[(key, bad)])), &format!("parameter '{key}' must be a non-negative integer"));
            }
        }
    }

    #[test]
    fn priority_and_timeout_ranges() {
        let m = model();
        let d = decode(&m, &params(&[("priority", Param::Uint(1)), ("timeout", Param::Uint(2500))]), &[]).unwrap();
        assert_eq!(d.options.engine.priority, (crate::state::PRIORITY_LEVELS_MAX - 1) as i32);
        assert_eq!(d.options.engine.deadline_ns, Some(2_500_000));
        assert_eq!(d.options.timeout, Some(std::time::Duration::from_micros(2500)));
        let d = decode(&m, &params(&[("timeout", Param::Uint(0))]), &[]).unwrap();
        assert_eq!(d.options.timeout, None);
        invalid(decode(&m, &params(&[("priority", Param::Uint(1001))]), &[]), "outside 1..=1000");
        invalid(decode(&m, &params(&[("timeout", Param::Uint(u64::MAX))]), &[]), "timeout");
    }

    #[test]
    fn class() {
        for (s, want) in [("real-time", Class::RealTime), ("best_effort", Class::BestEffort), ("RT", Class::RealTime)] {
            let p = request_params(&params(&[("kairos_class", Param::Str(s.into()))])).unwrap();
            assert_eq!(p.class, Some(want));
        }
        invalid(request_params(&params(&[("kairos_class", Param::Str("urgent".into()))])), "kairos_class 'urgent'");
        invalid(request_params(&params(&[("kairos_class", Param::Int(1))])), "parameter 'kairos_class' must be a string");
    }

    #[test]
    fn class_codes() {
        use kairos_client::shm::layout::{CLASS_BEST_EFFORT, CLASS_MODEL_DEFAULT, CLASS_REAL_TIME};
        assert_eq!(class_code(CLASS_MODEL_DEFAULT).unwrap(), None);
        for (code, want) in [(CLASS_REAL_TIME, Class::RealTime), (CLASS_BEST_EFFORT, Class::BestEffort)] {
            let p = params(&[("kairos_class", class_code(code).unwrap().unwrap())]);
            assert_eq!(request_params(&p).unwrap().class, Some(want));
        }
        invalid(class_code(9), "class code 9");
    }

    #[test]
    fn tenant() {
        let p = request_params(&params(&[("kairos_tenant", Param::Uint(u32::MAX as u64))])).unwrap();
        assert_eq!(p.tenant, Some(u32::MAX));
        invalid(request_params(&params(&[("kairos_tenant", Param::Uint(1 << 32))])), "kairos_tenant 4294967296 does not fit u32");
        invalid(request_params(&params(&[("kairos_tenant", Param::Int(-3))])), "parameter 'kairos_tenant' must be");
        invalid(request_params(&params(&[("kairos_tenant", Param::Str("a".into()))])), "parameter 'kairos_tenant' must be");
    }

    #[test]
    fn sequence_id() {
        for ok in [Param::Int(0), Param::Uint(0), Param::Null] {
            request_params(&params(&[("sequence_id", ok)])).unwrap();
        }
        for bad in
            [Param::Int(7), Param::Uint(7), Param::Int(-1), Param::Str("abc".into()), Param::Float(0.0), Param::Bool(false)]
        {
            unsupported(request_params(&params(&[("sequence_id", bad)])), "sequence_id");
        }
    }

    #[test]
    fn flags_and_uints() {
        let p = params(&[("a", Param::Bool(true)), ("b", Param::Int(1)), ("c", Param::Null)]);
        assert_eq!(flag(&p, "a").unwrap(), Some(true));
        assert_eq!(flag(&p, "c").unwrap(), None);
        assert_eq!(flag(&p, "zz").unwrap(), None);
        invalid(flag(&p, "b"), "parameter 'b' must be a boolean");
        assert_eq!(uint(&p, "b").unwrap(), Some(1));
        invalid(uint(&p, "a"), "parameter 'a' must be a non-negative integer");
    }

    #[test]
    fn output_selection() {
        let m = model();
        let out = |name: &str, p: &[(&str, Param)]| RequestedOutput { name: name.into(), params: params(p) };
        let all = outputs(&m, &Params::new(), &[]).unwrap();
        assert_eq!(all, (0..m.outputs.len()).map(|index| OutputChoice { index, binary: false }).collect::<Vec<_>>());
        let bin = params(&[("binary_data_output", Param::Bool(true))]);
        assert!(outputs(&m, &bin, &[]).unwrap().iter().all(|o| o.binary));
        let name = m.outputs[0].name.clone();
        assert_eq!(outputs(&m, &bin, &[out(&name, &[])]).unwrap(), vec![OutputChoice { index: 0, binary: true }]);
        let both = [out("z", &[]), out("y", &[("binary_data", Param::Bool(true))])];
        assert_eq!(
            outputs(&m, &Params::new(), &both).unwrap(),
            vec![OutputChoice { index: 1, binary: false }, OutputChoice { index: 0, binary: true }]
        );
        assert_eq!(
            outputs(&m, &bin, &[out(&name, &[("binary_data", Param::Bool(false))])]).unwrap(),
            vec![OutputChoice { index: 0, binary: false }]
        );
        assert_eq!(
            outputs(&m, &Params::new(), &[out(&name, &[("binary_data", Param::Bool(true))])]).unwrap(),
            vec![OutputChoice { index: 0, binary: true }]
        );
        invalid(outputs(&m, &Params::new(), &[out("nope", &[])]), "has no output 'nope' (outputs: ");
        invalid(
            outputs(&m, &Params::new(), &[out(&name, &[("binary_data", Param::Str("yes".into()))])]),
            "parameter 'binary_data' must be a boolean",
        );
        invalid(
            outputs(&m, &params(&[("binary_data_output", Param::Int(1))]), &[]),
            "parameter 'binary_data_output' must be a boolean",
        );
        for c in [Param::Int(3), Param::Null] {
            unsupported(outputs(&m, &Params::new(), &[out(&name, &[("classification", c)])]), "classification");
        }
    }

    #[test]
    fn the_deadline_only_parameter_is_range_checked() {
        assert_eq!(deadline_us(&params(&[])).unwrap(), None);
        assert_eq!(deadline_us(&params(&[(DEADLINE_US, Param::Uint(0))])).unwrap(), None);
        assert_eq!(deadline_us(&params(&[(DEADLINE_US, Param::Null)])).unwrap(), None);
        assert_eq!(deadline_us(&params(&[(DEADLINE_US, Param::Int(250))])).unwrap(), Some(250));
        assert_eq!(deadline_us(&params(&[(DEADLINE_US, Param::Uint(TIMEOUT_US_MAX))])).unwrap(), Some(TIMEOUT_US_MAX));
        invalid(deadline_us(&params(&[(DEADLINE_US, Param::Uint(TIMEOUT_US_MAX + 1))])), "exceeds");
        invalid(deadline_us(&params(&[(DEADLINE_US, Param::Int(-1))])), "non-negative integer");
        invalid(deadline_us(&params(&[(DEADLINE_US, Param::Str("soon".into()))])), "kairos_deadline_us");
        invalid(deadline_us(&params(&[(DEADLINE_US, Param::Float(1.5))])), "kairos_deadline_us");
    }
}
