//! The admin HTTP surface every service exposes: `/metrics` (Prometheus
//! text), `/livez` (the process runs) and `/readyz` (it takes traffic).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::health::Readiness;

/// Routes for `/metrics`, `/livez` and `/readyz`, to serve alone or merge
/// into a larger router.
pub fn router(readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(readiness)
}

async fn metrics() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render())
}

async fn ready(State(readiness): State<Readiness>) -> impl IntoResponse {
    if readiness.is_ready() { (StatusCode::OK, "ready\n") } else { (StatusCode::SERVICE_UNAVAILABLE, "not ready\n") }
}

/// Serves the admin routes until `shutdown` fires.
pub async fn serve(listener: TcpListener, readiness: Readiness, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener, router(readiness)).with_graceful_shutdown(shutdown.cancelled_owned()).await
}
