//! The server's one error enum and the one table that maps it onto HTTP statuses, gRPC codes and
//! metric labels. Every front end (REST, gRPC, shared memory) answers through [`ServeError::status`].

use kairos_client::Code;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServeError {
    /// Malformed JSON or protobuf, wrong dtype, shape or tensor count, bad parameters, bad spans.
    #[error("{0}")]
    Invalid(String),
    /// Unknown model or version.
    #[error("{0}")]
    NotFound(String),
    /// A body above the configured limit.
    #[error("{0}")]
    TooLarge(String),
    /// A full queue or pool: retry later.
    #[error("{0}")]
    Overloaded(String),
    /// The model is loading or unloading, or the server is shutting down.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Cancelled(String),
    /// The request ran past its `timeout` and was cancelled.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A feature of the protocol kairos does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// A GPU or engine failure.
    #[error("{0}")]
    Internal(String),
}

/// Where an error goes: HTTP status, gRPC code, and the `outcome` label of the request counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    pub http: u16,
    pub grpc: Code,
    pub outcome: Outcome,
}

/// The `outcome` label of `kairos_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ok,
    Invalid,
    NotFound,
    TooLarge,
    Overloaded,
    Unavailable,
    Cancelled,
    DeadlineExceeded,
    Internal,
}

impl Outcome {
    pub const ALL: [Outcome; 9] = [
        Outcome::Ok,
        Outcome::Invalid,
        Outcome::NotFound,
        Outcome::TooLarge,
        Outcome::Overloaded,
        Outcome::Unavailable,
        Outcome::Cancelled,
        Outcome::DeadlineExceeded,
        Outcome::Internal,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Invalid => "invalid",
            Outcome::NotFound => "not_found",
            Outcome::TooLarge => "too_large",
            Outcome::Overloaded => "overloaded",
            Outcome::Unavailable => "unavailable",
            Outcome::Cancelled => "cancelled",
            Outcome::DeadlineExceeded => "deadline_exceeded",
            Outcome::Internal => "internal",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

impl ServeError {
    /// The mapping table.
    pub fn status(&self) -> Status {
        let (http, grpc, outcome) = match self {
            ServeError::Invalid(_) => (400, Code::InvalidArgument, Outcome::Invalid),
            ServeError::NotFound(_) => (404, Code::NotFound, Outcome::NotFound),
            ServeError::TooLarge(_) => (413, Code::InvalidArgument, Outcome::TooLarge),
            ServeError::Overloaded(_) => (429, Code::ResourceExhausted, Outcome::Overloaded),
            ServeError::Unavailable(_) => (503, Code::Unavailable, Outcome::Unavailable),
            ServeError::Cancelled(_) => (499, Code::Cancelled, Outcome::Cancelled),
            ServeError::DeadlineExceeded(_) => (504, Code::DeadlineExceeded, Outcome::DeadlineExceeded),
            ServeError::Unsupported(_) => (400, Code::Unimplemented, Outcome::Invalid),
            ServeError::Internal(_) => (500, Code::Internal, Outcome::Internal),
        };
        Status { http, grpc, outcome }
    }

    pub fn invalid(m: impl Into<String>) -> ServeError {
        ServeError::Invalid(m.into())
    }
}

impl From<kairos_sched::Error> for ServeError {
    fn from(e: kairos_sched::Error) -> Self {
        use kairos_sched::Error as E;
        let m = e.to_string();
        match e {
            E::UnknownModel(_) => ServeError::NotFound(m),
            E::ModelExists(_) | E::InvalidModel(_) | E::InvalidInput(_) => ServeError::Invalid(m),
            E::Overloaded { .. } => ServeError::Overloaded(m),
            E::ModelUnloading(_) | E::ShuttingDown | E::GpuFailed(_) => ServeError::Unavailable(m),
            E::Cancelled => ServeError::Cancelled(m),
            E::Gpu(_) => ServeError::Internal(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        use kairos_sched::Error as E;
        let cases: Vec<(ServeError, u16, Code)> = vec![
            (E::Overloaded { what: "submission queue", max: 4 }.into(), 429, Code::ResourceExhausted),
            (E::UnknownModel("m".into()).into(), 404, Code::NotFound),
            (E::InvalidInput("shape".into()).into(), 400, Code::InvalidArgument),
            (E::Cancelled.into(), 499, Code::Cancelled),
            (E::ShuttingDown.into(), 503, Code::Unavailable),
            (E::ModelUnloading("m".into()).into(), 503, Code::Unavailable),
            (E::Gpu("boom".into()).into(), 500, Code::Internal),
            (E::GpuFailed("launch 3 hung".into()).into(), 503, Code::Unavailable),
            (ServeError::TooLarge("big".into()), 413, Code::InvalidArgument),
            (ServeError::DeadlineExceeded("late".into()), 504, Code::DeadlineExceeded),
        ];
        for (e, http, grpc) in cases {
            let s = e.status();
            assert_eq!((s.http, s.grpc), (http, grpc), "{e:?}");
        }
        assert_eq!(Outcome::ALL.iter().map(|o| o.index()).collect::<Vec<_>>(), (0..9).collect::<Vec<_>>());
    }
}
