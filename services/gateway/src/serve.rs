//! Running a gateway: REST and gRPC servers over one pipeline, readiness
//! following the router, graceful drain on shutdown. Used by the
//! `turbine-gateway` binary (remote router) and by `turbine run` (router
//! and workers in process).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use turbine_proto::gateway::v1::{FILE_DESCRIPTOR_SET, inference_server::InferenceServer};
use turbine_proto::service_names;
use turbine_router::RouterClient;
use turbine_runtime::grpc::{base_routes, serve as serve_grpc};
use turbine_runtime::health::Readiness;
use turbine_runtime::{CancellationToken, admin};

use crate::catalog::ModelCatalog;
use crate::config::GatewayConfig;
use crate::grpc::InferenceService;
use crate::openai::{AppState, router as rest_router};
use crate::pipeline::Pipeline;
use crate::pool::WorkerPool;

/// Listeners of a gateway, bound by the caller (port 0 in tests).
#[derive(Debug)]
pub struct GatewayListeners {
    /// OpenAI REST.
    pub http: TcpListener,
    /// gRPC.
    pub grpc: TcpListener,
}

impl GatewayListeners {
    /// Binds the configured addresses.
    pub async fn bind(config: &GatewayConfig) -> anyhow::Result<Self> {
        let http = TcpListener::bind(config.http_addr).await.with_context(|| format!("cannot bind HTTP on {}", config.http_addr))?;
        let grpc = TcpListener::bind(config.grpc_addr).await.with_context(|| format!("cannot bind gRPC on {}", config.grpc_addr))?;
        Ok(Self { http, grpc })
    }
}

/// Serves until `shutdown` fires; then stops accepting, lets in-flight
/// requests finish (up to the grace period) and returns.
pub async fn serve(config: &GatewayConfig, listeners: GatewayListeners, router: RouterClient, pool: WorkerPool, shutdown: CancellationToken) -> anyhow::Result<()> {
    let http_addr = listeners.http.local_addr()?;
    let grpc_addr = listeners.grpc.local_addr()?;
    let (readiness, health) = Readiness::new(&[service_names::GATEWAY_INFERENCE]).await;
    let catalog = Arc::new(ModelCatalog::new(router.clone(), pool.clone()));
    let state = AppState {
        pipeline: Pipeline::new(router, pool, catalog.clone()),
        admission: Arc::new(Semaphore::new(config.max_concurrent_requests)),
        max_body_bytes: config.max_body_bytes,
        readiness: readiness.clone(),
    };
    let refresh_readiness = readiness.clone();
    catalog.spawn_refresh(Duration::from_millis(config.model_refresh_ms), shutdown.clone(), move |router_answers| {
        let readiness = refresh_readiness.clone();
        tokio::spawn(async move { readiness.set_ready(router_answers).await });
    });

    let grace = Duration::from_secs_f64(config.shutdown_grace_secs);
    let routes = base_routes(health, &[FILE_DESCRIPTOR_SET]).add_service(InferenceServer::new(InferenceService::new(state.clone())));
    let grpc_task = tokio::spawn(serve_grpc(listeners.grpc, routes, shutdown.clone(), grace));
    let http_task = tokio::spawn(admin::serve_with_grace(listeners.http, rest_router(state), shutdown.clone(), grace));
    tracing::info!(http = %http_addr, grpc = %grpc_addr, "gateway listening");

    shutdown.cancelled().await;
    readiness.drain().await;
    let (http, grpc) = tokio::join!(http_task, grpc_task);
    http.context("HTTP server panicked")?.context("HTTP server failed")?;
    grpc.context("gRPC server panicked")?.context("gRPC server failed")?;
    tracing::info!("gateway stopped");
    Ok(())
}

/// Runs a standalone gateway process.
pub async fn run(config: GatewayConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let endpoint = config.router.as_deref().context(
        "turbine-gateway needs a router: pass --router http://HOST:PORT (or run everything in one process with `turbine run`)",
    )?;
    let router = RouterClient::connect(&turbine_runtime::grpc::endpoint_uri(endpoint))?;
    let listeners = GatewayListeners::bind(&config).await?;
    serve(&config, listeners, router, WorkerPool::default(), shutdown).await
}

/// Entry point shared by `turbine-gateway` and `turbine gateway`.
pub fn main(args: crate::GatewayArgs) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-gateway", move |shutdown| async move {
        let config = args.load()?;
        run(config, shutdown).await
    })
}
