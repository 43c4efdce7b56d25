//! Errors as clients see them: one kind, one exhaustive mapping to an HTTP
//! status with OpenAI's error JSON, and to a gRPC code.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use turbine_api::router::RouterCallError;
use turbine_api::worker::WorkerError;

/// What went wrong, from the client's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Malformed or invalid request (400).
    InvalidRequest,
    /// Unknown model (404).
    ModelNotFound,
    /// Unknown path (404).
    NotFound,
    /// Wrong method for the path (405).
    MethodNotAllowed,
    /// No API key, or an unknown one (401).
    Unauthenticated,
    /// Body over the size limit (413).
    PayloadTooLarge,
    /// Body not received in time (408).
    RequestTimeout,
    /// Too many requests in flight (429).
    Overloaded,
    /// The caller's key is over one of its limits (429).
    RateLimited,
    /// No worker can serve the request now (503).
    Unavailable,
    /// A failure inside the service (500).
    Internal,
}

/// An error returned to a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct GatewayError {
    /// The kind, which decides status and codes.
    pub kind: ErrorKind,
    /// A message for the client (no internal detail).
    pub message: String,
    /// The request parameter at fault, if any.
    pub param: Option<String>,
    /// Seconds the client should wait before retrying (429, 503).
    pub retry_after: Option<u64>,
}

impl GatewayError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), param: None, retry_after: None }
    }

    /// A 429 for a key over its limits, retry after `seconds`.
    pub fn rate_limited(message: impl Into<String>, seconds: u64) -> Self {
        Self { kind: ErrorKind::RateLimited, message: message.into(), param: None, retry_after: Some(seconds) }
    }

    /// A 400 naming the parameter at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self { kind: ErrorKind::InvalidRequest, message: message.into(), param: Some(param.into()), retry_after: None }
    }

    /// A 404 for a model nobody serves.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            kind: ErrorKind::ModelNotFound,
            message: format!("The model `{model}` does not exist or no worker serves it."),
            param: Some("model".into()),
            retry_after: None,
        }
    }

    /// HTTP status.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::Overloaded | ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `error.type` and `error.code`.
    pub fn openai_type_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self.kind {
            ErrorKind::InvalidRequest => ("invalid_request_error", None),
            ErrorKind::ModelNotFound => ("invalid_request_error", Some("model_not_found")),
            ErrorKind::NotFound => ("invalid_request_error", Some("not_found")),
            ErrorKind::MethodNotAllowed => ("invalid_request_error", Some("method_not_allowed")),
            ErrorKind::Unauthenticated => ("invalid_request_error", Some("invalid_api_key")),
            ErrorKind::PayloadTooLarge => ("invalid_request_error", Some("request_too_large")),
            ErrorKind::RequestTimeout => ("invalid_request_error", Some("request_timeout")),
            ErrorKind::Overloaded | ErrorKind::RateLimited => ("rate_limit_error", Some("rate_limit_exceeded")),
            ErrorKind::Unavailable => ("server_error", Some("service_unavailable")),
            ErrorKind::Internal => ("server_error", None),
        }
    }

    /// gRPC status code.
    pub fn grpc_code(&self) -> tonic::Code {
        match self.kind {
            ErrorKind::InvalidRequest | ErrorKind::PayloadTooLarge => tonic::Code::InvalidArgument,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => tonic::Code::NotFound,
            ErrorKind::MethodNotAllowed => tonic::Code::Unimplemented,
            ErrorKind::RequestTimeout => tonic::Code::DeadlineExceeded,
            ErrorKind::Unauthenticated => tonic::Code::Unauthenticated,
            ErrorKind::Overloaded | ErrorKind::RateLimited => tonic::Code::ResourceExhausted,
            ErrorKind::Unavailable => tonic::Code::Unavailable,
            ErrorKind::Internal => tonic::Code::Internal,
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody<'_> {
        let (kind, code) = self.openai_type_and_code();
        ErrorBody { error: ErrorDetail { message: &self.message, kind, param: self.param.as_deref(), code } }
    }
}

/// `{"error": {...}}`
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// The error.
    pub error: ErrorDetail<'a>,
}

/// OpenAI's error object.
#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    /// Human-readable message.
    pub message: &'a str,
    /// Error type.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Parameter at fault.
    pub param: Option<&'a str>,
    /// Machine-readable code.
    pub code: Option<&'static str>,
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).expect("error bodies serialize");
        let mut response = (self.status(), [(header::CONTENT_TYPE, "application/json")], body).into_response();
        if matches!(self.kind, ErrorKind::Overloaded | ErrorKind::RateLimited | ErrorKind::Unavailable) {
            let seconds = self.retry_after.unwrap_or(1);
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<GatewayError> for tonic::Status {
    fn from(error: GatewayError) -> Self {
        let mut status = tonic::Status::new(error.grpc_code(), error.message);
        if let Some(seconds) = error.retry_after {
            status.metadata_mut().insert("retry-after", seconds.into());
        }
        status
    }
}

impl From<RouterCallError> for GatewayError {
    fn from(error: RouterCallError) -> Self {
        match error {
            RouterCallError::NoWorkers(message) => GatewayError::new(ErrorKind::Unavailable, message),
            // No worker of the model can serve it as asked: a 400 naming
            // why, not a 503 the client would retry.
            RouterCallError::InvalidRequest(message) | RouterCallError::Unserved(message) => GatewayError::new(ErrorKind::InvalidRequest, message),
            RouterCallError::Unavailable(message) => {
                tracing::warn!(error = %message, "router call failed");
                GatewayError::new(ErrorKind::Unavailable, "the router is unavailable; retry shortly")
            }
            // The gateway's own identity was refused: its operator's to fix,
            // nothing the client did.
            denied @ RouterCallError::Denied { .. } => {
                tracing::error!(error = %denied, "the router refused the gateway's call");
                GatewayError::new(ErrorKind::Internal, "the gateway cannot reach its router")
            }
        }
    }
}

impl From<WorkerError> for GatewayError {
    fn from(error: WorkerError) -> Self {
        match error {
            WorkerError::InvalidArgument(message) => GatewayError::new(ErrorKind::InvalidRequest, message),
            WorkerError::Overloaded(_) => GatewayError::new(ErrorKind::Overloaded, "all workers for this model are at capacity; retry shortly"),
            WorkerError::Unavailable(message) => {
                tracing::warn!(error = %message, "worker unavailable");
                GatewayError::new(ErrorKind::Unavailable, "no worker could serve the request; retry shortly")
            }
            WorkerError::NotFound(message) | WorkerError::Internal(message) => {
                tracing::error!(error = %message, "worker failed");
                GatewayError::new(ErrorKind::Internal, "the worker failed to generate")
            }
            // The gateway's own identity was refused: its operator's to fix.
            denied @ WorkerError::Denied { .. } => {
                tracing::error!(error = %denied, "a worker refused the gateway's call");
                GatewayError::new(ErrorKind::Internal, "the worker failed to generate")
            }
        }
    }
}
