//! One set of words for what went wrong, shared by every client: each
//! client's error says its [`ErrorCode`], and a code maps to exactly one
//! gRPC code and one HTTP status. A client's error converts to a gRPC
//! status and back through its code alone ([`ApiError`]), so a server and
//! its client cannot disagree on what a failure means.

/// The kind of a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The caller asked for something malformed or out of range.
    InvalidArgument,
    /// What the call names does not exist.
    NotFound,
    /// The service cannot do this in its present state or configuration
    /// (asking again will not help).
    FailedPrecondition,
    /// A limit was reached (room, a quota, a queue).
    ResourceExhausted,
    /// The service could not be reached or is not ready; asking again may
    /// help.
    Unavailable,
    /// No answer within the time allowed.
    DeadlineExceeded,
    /// The call was cancelled.
    Cancelled,
    /// Bytes were lost or damaged.
    DataLoss,
    /// The caller did not say who it is.
    Unauthenticated,
    /// The caller may not do this.
    PermissionDenied,
    /// The service does not offer this call.
    Unimplemented,
    /// The service failed.
    Internal,
}

impl ErrorCode {
    /// Every code.
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::InvalidArgument,
        ErrorCode::NotFound,
        ErrorCode::FailedPrecondition,
        ErrorCode::ResourceExhausted,
        ErrorCode::Unavailable,
        ErrorCode::DeadlineExceeded,
        ErrorCode::Cancelled,
        ErrorCode::DataLoss,
        ErrorCode::Unauthenticated,
        ErrorCode::PermissionDenied,
        ErrorCode::Unimplemented,
        ErrorCode::Internal,
    ];

    /// The HTTP status a REST edge answers with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument | ErrorCode::FailedPrecondition => 400,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Cancelled => 499,
            ErrorCode::ResourceExhausted => 429,
            ErrorCode::Unimplemented => 501,
            ErrorCode::Unavailable => 503,
            ErrorCode::DeadlineExceeded => 504,
            ErrorCode::DataLoss | ErrorCode::Internal => 500,
        }
    }
}

/// Where a status carries an error's [`reason`](ApiError::reason).
pub const REASON_KEY: &str = "turbine-error";

/// A client's error: it has a code, perhaps a reason, and a message, and
/// comes back from them. `from_parts(e.code(), e.reason(), e.message())`
/// is `e` again for every error a server sends (errors made on the
/// caller's side, such as a malformed endpoint, may come back as another
/// variant of the same code).
pub trait ApiError: std::error::Error + Sized {
    /// Its kind.
    fn code(&self) -> ErrorCode;

    /// A finer kind, where a caller must tell two errors of one code apart
    /// (a router with no worker for the model from a router that cannot be
    /// reached); sent beside the code ([`REASON_KEY`]).
    fn reason(&self) -> Option<&'static str> {
        None
    }

    /// What happened, without the client's own prefix.
    fn message(&self) -> String;

    /// The error of kind `code` (and `reason`, when the error has one).
    fn from_parts(code: ErrorCode, reason: Option<&str>, message: String) -> Self;
}

#[cfg(feature = "grpc")]
mod grpc {
    use super::{ApiError, ErrorCode, REASON_KEY};

    impl From<ErrorCode> for tonic::Code {
        fn from(code: ErrorCode) -> Self {
            match code {
                ErrorCode::InvalidArgument => tonic::Code::InvalidArgument,
                ErrorCode::NotFound => tonic::Code::NotFound,
                ErrorCode::FailedPrecondition => tonic::Code::FailedPrecondition,
                ErrorCode::ResourceExhausted => tonic::Code::ResourceExhausted,
                ErrorCode::Unavailable => tonic::Code::Unavailable,
                ErrorCode::DeadlineExceeded => tonic::Code::DeadlineExceeded,
                ErrorCode::Cancelled => tonic::Code::Cancelled,
                ErrorCode::DataLoss => tonic::Code::DataLoss,
                ErrorCode::Unauthenticated => tonic::Code::Unauthenticated,
                ErrorCode::PermissionDenied => tonic::Code::PermissionDenied,
                ErrorCode::Unimplemented => tonic::Code::Unimplemented,
                ErrorCode::Internal => tonic::Code::Internal,
            }
        }
    }

    impl From<tonic::Code> for ErrorCode {
        /// The codes Turbine never sends read as their nearest kind.
        fn from(code: tonic::Code) -> Self {
            match code {
                tonic::Code::InvalidArgument | tonic::Code::OutOfRange => ErrorCode::InvalidArgument,
                tonic::Code::NotFound => ErrorCode::NotFound,
                tonic::Code::FailedPrecondition | tonic::Code::AlreadyExists => ErrorCode::FailedPrecondition,
                tonic::Code::ResourceExhausted => ErrorCode::ResourceExhausted,
                tonic::Code::Unavailable | tonic::Code::Aborted => ErrorCode::Unavailable,
                tonic::Code::DeadlineExceeded => ErrorCode::DeadlineExceeded,
                tonic::Code::Cancelled => ErrorCode::Cancelled,
                tonic::Code::DataLoss => ErrorCode::DataLoss,
                tonic::Code::Unauthenticated => ErrorCode::Unauthenticated,
                tonic::Code::PermissionDenied => ErrorCode::PermissionDenied,
                tonic::Code::Unimplemented => ErrorCode::Unimplemented,
                tonic::Code::Ok | tonic::Code::Unknown | tonic::Code::Internal => ErrorCode::Internal,
            }
        }
    }

    /// The status a server answers `error` with.
    pub fn to_status<E: ApiError>(error: &E) -> tonic::Status {
        let mut status = tonic::Status::new(error.code().into(), error.message());
        if let Some(reason) = error.reason() {
            status.metadata_mut().insert(REASON_KEY, tonic::metadata::MetadataValue::from_static(reason));
        }
        status
    }

    /// The client's error for a status a call ended with.
    pub fn from_status<E: ApiError>(status: &tonic::Status) -> E {
        let reason = status.metadata().get(REASON_KEY).and_then(|value| value.to_str().ok());
        E::from_parts(status.code().into(), reason, status.message().to_owned())
    }
}

#[cfg(feature = "grpc")]
pub use grpc::{from_status, to_status};

#[cfg(all(test, feature = "grpc"))]
mod tests {
    use super::*;

    #[test]
    fn every_code_maps_to_one_grpc_code_and_back() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let grpc = tonic::Code::from(code);
            assert!(seen.insert(grpc), "{code:?} shares {grpc:?}");
            assert_eq!(ErrorCode::from(grpc), code);
            assert!((400..600).contains(&code.http_status()));
        }
        assert_eq!(ErrorCode::from(tonic::Code::Unknown), ErrorCode::Internal);
    }
}
