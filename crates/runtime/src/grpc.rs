//! gRPC plumbing shared by every service: one way to serve (tracing layer,
//! health, reflection, keep-alives, graceful drain under a grace period) and
//! one way to connect (lazy channels with trace propagation).

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tower_http::trace::TraceLayer;

use crate::propagation::{TraceContextInterceptor, server_span};

/// Largest gRPC message accepted or sent (model cards carry a vocabulary of
/// a few MiB; prompts are far smaller).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

/// A channel whose calls carry the caller's trace context.
pub type TracedChannel = InterceptedService<Channel, TraceContextInterceptor>;

/// Health and reflection (v1 and v1alpha, for older grpcurl) for a server
/// whose public packages are described by `descriptor_sets` (encoded
/// `FileDescriptorSet`s with source info, so `describe` shows comments).
pub fn base_routes<H>(health: H, descriptor_sets: &[&'static [u8]]) -> Routes
where
    H: tower::Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>, Error = std::convert::Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    H::Future: Send + 'static,
{
    let mut v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    let mut v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    for set in descriptor_sets {
        v1 = v1.register_encoded_file_descriptor_set(set);
        v1alpha = v1alpha.register_encoded_file_descriptor_set(set);
    }
    let v1 = v1.build_v1().expect("descriptor sets compiled from proto/ are valid");
    let v1alpha = v1alpha.build_v1alpha().expect("descriptor sets compiled from proto/ are valid");
    Routes::new(health).add_service(v1).add_service(v1alpha)
}

/// Serves `routes` on `listener` until `shutdown` fires, then stops
/// accepting and lets in-flight calls (streams included) finish for up to
/// `grace`; calls still open after that are dropped.
pub async fn serve(listener: TcpListener, routes: Routes, shutdown: CancellationToken, grace: Duration) -> Result<(), tonic::transport::Error> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = Server::builder()
        .layer(TraceLayer::new_for_grpc().make_span_with(server_span))
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    crate::shutdown::drain_within(server, &shutdown, grace, "gRPC calls").await
}

/// A lazily connecting channel to `endpoint` (e.g. `http://10.0.0.7:50061`)
/// that propagates trace context. Fails only on a malformed endpoint.
pub fn traced_channel(endpoint: &str) -> Result<TracedChannel, tonic::transport::Error> {
    let channel = Endpoint::from_shared(endpoint.to_owned())?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .connect_lazy();
    Ok(InterceptedService::new(channel, TraceContextInterceptor))
}

/// Normalizes an address to a gRPC endpoint URI (`host:port` gets `http://`).
pub fn endpoint_uri(address: &str) -> String {
    if address.contains("://") { address.to_owned() } else { format!("http://{address}") }
}
