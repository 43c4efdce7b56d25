//! W3C trace context across process boundaries.
//!
//! Clients inject the current span's context into outgoing gRPC metadata
//! ([`TraceContextInterceptor`]); servers extract it from incoming headers
//! into the request span ([`server_span`]), so a request that crosses the
//! gateway, the router and a worker is one trace. With no propagator
//! installed (traces not exported) both are no-ops.

use opentelemetry::propagation::{Extractor, Injector};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Reads trace headers from an HTTP header map.
struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Writes trace headers into an HTTP header map.
struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}

/// Makes `span` a child of the trace context carried in `headers`, if any.
pub fn set_parent_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    let context = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&HeaderExtractor(headers)));
    let _ = span.set_parent(context);
}

/// Writes the current span's trace context into `headers`.
pub fn inject_current(headers: &mut http::HeaderMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.inject_context(&context, &mut HeaderInjector(headers)));
}

/// The span of one incoming gRPC call, parented to the caller's trace.
pub fn server_span<B>(request: &http::Request<B>) -> tracing::Span {
    let path = request.uri().path();
    let span = tracing::info_span!("grpc.server", otel.name = %path.trim_start_matches('/'), otel.kind = "server", rpc.system = "grpc");
    set_parent_from_headers(&span, request.headers());
    span
}

/// Injects the current span's trace context into every outgoing gRPC call.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextInterceptor;

impl tonic::service::Interceptor for TraceContextInterceptor {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let mut headers = http::HeaderMap::new();
        inject_current(&mut headers);
        for (name, value) in &headers {
            if let (Ok(key), Ok(value)) =
                (tonic::metadata::MetadataKey::from_bytes(name.as_str().as_bytes()), tonic::metadata::MetadataValue::try_from(value.as_bytes()))
            {
                request.metadata_mut().insert(key, value);
            }
        }
        Ok(request)
    }
}
