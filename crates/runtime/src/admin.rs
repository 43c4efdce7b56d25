//! The admin HTTP surface every service exposes: `/metrics` (Prometheus
//! text), `/livez` (the process runs) and `/readyz` (it takes traffic).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::serve::ListenerExt;
use std::time::Duration;
use tokio::net::TcpListener;

use tokio_util::sync::CancellationToken;

use crate::health::Readiness;
use crate::http_server::HttpLimits;

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

/// How long admin requests in flight get once the admin port stops.
const ADMIN_GRACE: Duration = Duration::from_secs(5);

/// Serves the admin routes under `limits` until `shutdown` fires.
pub async fn serve(listener: TcpListener, readiness: Readiness, limits: HttpLimits, shutdown: CancellationToken) -> std::io::Result<()> {
    crate::http_server::serve(listener.tap_io(set_nodelay), router(readiness), limits, shutdown, ADMIN_GRACE, "admin").await
}

/// Small writes (SSE chunks) must leave at once: Nagle's algorithm plus the
/// client's delayed ACK would hold each for ~40 ms.
fn set_nodelay(stream: &mut tokio::net::TcpStream) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
}

/// Serves an API's router under `limits` until `shutdown` fires, then
/// stops accepting and lets in-flight requests (streams included) finish
/// for up to `grace`.
pub async fn serve_with_grace(listener: TcpListener, router: Router, limits: HttpLimits, shutdown: CancellationToken, grace: Duration) -> std::io::Result<()> {
    crate::http_server::serve(listener.tap_io(set_nodelay), router, limits, shutdown, grace, "api").await
}

/// As [`serve_with_grace`], over HTTPS: the connections `listener` hands
/// out have finished their TLS handshakes.
pub async fn serve_tls_with_grace(
    listener: crate::public_tls::TlsListener,
    router: Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
    grace: Duration,
) -> std::io::Result<()> {
    crate::http_server::serve(listener, router, limits, shutdown, grace, "api").await
}
