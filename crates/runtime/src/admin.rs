//! The admin HTTP surface every service exposes: `/metrics` (Prometheus
//! text), `/livez` (the process runs) and `/readyz` (it takes traffic).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::health::Readiness;

/// Routes for `/metrics`, `/livez` and `/readyz`, to serve alone or merge
/// into a larger router.
pub fn router(readiness: Readiness) -> Router {
    Router::new().route("/metrics", get(metrics)).route("/livez", get(|| async { "ok\n" })).route("/readyz", get(ready)).with_state(readiness)
}

async fn metrics() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render())
}

async fn ready(State(readiness): State<Readiness>) -> impl IntoResponse {
    if readiness.is_ready() { (StatusCode::OK, "ready\n") } else { (StatusCode::SERVICE_UNAVAILABLE, "not ready\n") }
}

/// Serves the admin routes until `shutdown` fires.
pub async fn serve(listener: TcpListener, readiness: Readiness, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener.tap_io(set_nodelay), router(readiness)).with_graceful_shutdown(shutdown.cancelled_owned()).await
}

/// Small writes (SSE chunks) must leave at once: Nagle's algorithm plus the
/// client's delayed ACK would hold each for ~40 ms.
fn set_nodelay(stream: &mut tokio::net::TcpStream) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
}

/// Serves an HTTP router until `shutdown` fires, then stops accepting and
/// lets in-flight requests (streams included) finish for up to `grace`.
pub async fn serve_with_grace(listener: TcpListener, router: Router, shutdown: CancellationToken, grace: std::time::Duration) -> std::io::Result<()> {
    serve_listener_with_grace(listener.tap_io(set_nodelay), router, shutdown, grace).await
}

/// As [`serve_with_grace`], over HTTPS: the connections `listener` hands
/// out have finished their TLS handshakes.
pub async fn serve_tls_with_grace(
    listener: crate::public_tls::TlsListener,
    router: Router,
    shutdown: CancellationToken,
    grace: std::time::Duration,
) -> std::io::Result<()> {
    serve_listener_with_grace(listener, router, shutdown, grace).await
}

async fn serve_listener_with_grace<L>(listener: L, router: Router, shutdown: CancellationToken, grace: std::time::Duration) -> std::io::Result<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let server = axum::serve(listener, router).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    crate::shutdown::drain_within(std::future::IntoFuture::into_future(server), &shutdown, grace, "HTTP requests").await
}
