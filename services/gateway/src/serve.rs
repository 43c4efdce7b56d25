//! Serving a gateway: REST and gRPC over one pipeline, readiness following
//! the router, graceful drain on shutdown.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use turbine_api::router::RouterClient;
use turbine_api::worker::WorkerClients;
use turbine_proto::gateway::v1::{FILE_DESCRIPTOR_SET, inference_server::InferenceServer};
use turbine_proto::service_names;
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Host, HostSpec, Listeners, bind};

use crate::catalog::ModelCatalog;
use crate::config::GatewayConfig;
use crate::grpc::InferenceService;
use crate::keys::{Access, KeyRing, KeyTable, SharedBuckets};
use crate::openai::{AppState, router as rest_router};
use crate::pipeline::Pipeline;

/// What a gateway needs besides its configuration.
#[derive(Debug, Clone)]
pub struct GatewayDeps {
    /// The router.
    pub router: RouterClient,
    /// How to reach the workers the router chooses.
    pub workers: WorkerClients,
    /// A key the process running this gateway holds for itself (made at
    /// start, kept in memory only), accepted besides the keys file's: for
    /// `turbine run` to ask its own gateway whether it lists the model.
    pub own_key: Option<String>,
}

impl GatewayDeps {
    /// A standalone gateway's: the router at `--router`, workers over gRPC.
    pub fn from_config(config: &GatewayConfig) -> anyhow::Result<Self> {
        let endpoint = config
            .router
            .as_deref()
            .context("turbine-gateway needs a router: pass --router http://HOST:PORT (or run everything in one process with `turbine run`)")?;
        Ok(Self { router: RouterClient::connect(endpoint)?, workers: WorkerClients::default(), own_key: None })
    }
}

const SPEC: HostSpec = HostSpec {
    name: "gateway",
    health: &[service_names::GATEWAY_INFERENCE],
    descriptors: &[FILE_DESCRIPTOR_SET],
    // A disaggregated request's prefill happens before its stream starts.
    handler_timeout: Duration::from_secs(600),
    roles: &[],
};

/// Serves the gateway on `listeners` (gRPC, and the REST API on their HTTP
/// listener) until `shutdown` fires; then stops accepting, lets in-flight
/// requests finish (up to the grace period) and returns.
pub async fn serve(config: GatewayConfig, deps: GatewayDeps, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    anyhow::ensure!(listeners.http.is_some(), "the gateway needs an HTTP listener for its REST API");
    let mut host = Host::new(SPEC, &config.server, listeners).await?;
    if let Some(public) = config.admission.public_tls()? {
        host.set_public_tls(public)?;
    }
    let readiness = host.readiness().clone();
    let catalog = Arc::new(ModelCatalog::new(deps.router.clone(), deps.workers.clone()));
    // Per-minute limits shared with the namespace's other gateways.
    let shared = || config.cluster.redis.as_deref().map(|url| SharedBuckets::new(url, &config.cluster.namespace)).transpose();
    let keys = match (&config.admission.api_keys, &config.admission.api_keys_database) {
        (Some(path), _) => {
            tracing::info!(file = %path.display(), "API keys required, from a file");
            Some(KeyRing::load(path, deps.own_key.clone(), shared()?)?)
        }
        (None, Some(url)) => {
            let table = KeyTable::open_to_read(url, &config.cluster.namespace).await?;
            tracing::info!(database = table.url(), namespace = table.namespace(), "API keys required, from a database");
            Some(KeyRing::open(table, deps.own_key.clone(), shared()?).await?)
        }
        (None, None) => None,
    };
    let access = match keys {
        Some(keys) => {
            let keys = Arc::new(keys);
            tracing::info!(keys = keys.current().len(), reload_secs = config.admission.api_keys_reload_secs, "API keys in force");
            if config.admission.api_keys_reload_secs > 0 {
                keys.clone().spawn_watch(Duration::from_secs(config.admission.api_keys_reload_secs), shutdown.clone());
            }
            Access::Keys(keys)
        }
        None => Access::Open,
    };
    let state = AppState {
        access,
        pipeline: Pipeline::new(deps.router, deps.workers, catalog.clone(), config.admission.content_control_tokens.into()),
        admission: crate::admission::Admission::new(config.admission.max_concurrent_requests),
        max_body_bytes: config.admission.max_body_bytes,
        body_timeout: Duration::from_secs_f64(config.admission.body_timeout_secs),
        stream_stall_timeout: Duration::from_secs_f64(config.admission.stream_stall_secs),
        readiness: readiness.clone(),
        proxies: config.server.clients.trusted_proxies(),
    };
    host.add_service(InferenceServer::new(InferenceService::new(state.clone())));
    // With API keys the API's port serves no /metrics: its callers are
    // tenants, and the metrics tell of every tenant's traffic.
    match state.access {
        Access::Keys(_) => host.set_http_without_admin(rest_router(state))?,
        Access::Open => host.set_http(rest_router(state)),
    }
    let serving = host.start(shutdown.clone())?;
    // Ready while the router answers.
    catalog.spawn_refresh(Duration::from_millis(config.admission.model_refresh_ms), shutdown, move |router_answers| {
        let readiness = readiness.clone();
        tokio::spawn(async move { readiness.set_ready(router_answers).await });
    });
    serving.until_shutdown(async {}).await
}

/// Entry point shared by `turbine-gateway` and `turbine gateway`.
pub fn main(config: GatewayConfig) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-gateway", move |shutdown| async move {
        // The identity first: every client made below dials with it.
        config.server.tls.establish()?;
        let deps = GatewayDeps::from_config(&config)?;
        let listeners = Listeners::bind(&config.server).await?.with_http(bind(config.http_addr, "HTTP").await?);
        serve(config, deps, listeners, shutdown).await
    })
}
