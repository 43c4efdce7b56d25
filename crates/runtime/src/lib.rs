//! What every Turbine service shares, so each service crate holds only its
//! own logic.
//!
//! - [`config`]: typed, layered configuration (defaults < file <
//!   `TURBINE_*` env < flags), each setting declared once; the settings
//!   every service shares.
//! - [`host`]: the service host: listeners, health, reflection, message
//!   limits, the tower stack, bound addresses, the drain.
//! - [`telemetry`]: `tracing` logs and, when `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   is set, OpenTelemetry traces over OTLP/gRPC.
//! - [`propagation`]: W3C trace context through gRPC metadata and HTTP
//!   headers, so one request is one trace across services.
//! - [`health`]: gRPC health (NOT_SERVING until dependencies answer) and the
//!   readiness behind `/readyz`.
//! - [`admin`]: `/metrics`, `/livez`, `/readyz` over HTTP.
//! - [`http_server`]: HTTP serving under limits no client holds a port
//!   past (headers and idle time); [`connections`]: open connections in
//!   all and per client.
//! - [`grpc`]: server wiring and client channels (one per endpoint).
//! - [`shutdown`]: SIGTERM/SIGINT as a cancellation token.
//! - [`metrics`]: Prometheus registry helpers.
//! - [`trust`]: mutual TLS, the role a certificate names, and the
//!   authorization of each rpc against its service's role table.
//! - [`public_tls`]: server-only TLS for public ports (the gateway's API),
//!   whose clients authenticate with keys, not certificates.
//! - [`gate`] and [`strikes`]: new connections per address, refusals per
//!   connection.

pub mod admin;
pub mod config;
pub mod connections;
pub mod gate;
pub mod grpc;
pub mod health;
pub mod host;
pub mod http_server;
pub mod metrics;
pub mod propagation;
pub mod proxies;
pub mod public_tls;
pub mod redis;
pub mod shutdown;
pub mod signed;
pub mod strikes;
pub mod telemetry;
pub mod trust;

pub use tokio_util::sync::CancellationToken;

use std::future::Future;
use std::process::ExitCode;

/// Runs a service process: a multi-threaded Tokio runtime, telemetry for
/// `service_name`, SIGTERM/SIGINT wired to the shutdown token passed to
/// `body`. Exits 0 when `body` returns Ok (after a graceful drain), 1 with
/// the error chain logged otherwise.
pub fn run_service<F, Fut>(service_name: &'static str, body: F) -> ExitCode
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{service_name}: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let _telemetry = telemetry::init(service_name);
        if let Some((before, after)) = connections::raise_open_files_limit() {
            tracing::info!(before, after, "raised the soft open-files limit to the hard one");
        }
        let shutdown = CancellationToken::new();
        shutdown::cancel_on_signal(shutdown.clone());
        match body(shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                tracing::error!(error = format!("{error:#}"), "{service_name} failed");
                eprintln!("{service_name}: error: {error:#}");
                ExitCode::FAILURE
            }
        }
    })
}
