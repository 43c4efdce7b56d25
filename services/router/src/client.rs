//! One client for the router, in-process or over gRPC.

use std::sync::Arc;

use tonic::Code;
use turbine_proto::router::v1 as pb;
use turbine_proto::router::v1::router_client::RouterClient as GrpcRouterClient;
use turbine_registry::WorkerLoad;
use turbine_runtime::grpc::{TracedChannel, traced_channel};

use crate::router::{RouteError, RouteRequest, Routed, RoutedWorker, Router};
use crate::service::{ERROR_KIND_KEY, NO_WORKERS, kv_overrides_to_proto, policy_to_proto};

/// Why a router call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterCallError {
    /// No live worker serves the model.
    #[error("{0}")]
    NoWorkers(String),
    /// The request was malformed.
    #[error("{0}")]
    InvalidRequest(String),
    /// The router could not be reached.
    #[error("router unavailable: {0}")]
    Unavailable(String),
}

impl From<RouteError> for RouterCallError {
    fn from(error: RouteError) -> Self {
        match error {
            RouteError::NoWorkers(_) => RouterCallError::NoWorkers(error.to_string()),
            RouteError::InvalidRequest(message) => RouterCallError::InvalidRequest(message),
        }
    }
}

impl From<tonic::Status> for RouterCallError {
    fn from(status: tonic::Status) -> Self {
        let message = status.message().to_owned();
        match status.code() {
            // The router marks "no worker serves the model"; a bare
            // UNAVAILABLE is the router itself being unreachable.
            Code::Unavailable if status.metadata().get(ERROR_KIND_KEY).is_some_and(|kind| kind == NO_WORKERS) => {
                RouterCallError::NoWorkers(message)
            }
            Code::InvalidArgument => RouterCallError::InvalidRequest(message),
            _ => RouterCallError::Unavailable(format!("{}: {message}", status.code())),
        }
    }
}

/// The router, in this process or behind gRPC.
#[derive(Debug, Clone)]
pub enum RouterClient {
    /// In this process.
    Local(Arc<Router>),
    /// Behind gRPC.
    Remote(GrpcRouterClient<TracedChannel>),
}

fn worker_from_proto(worker: pb::WorkerInfo) -> RoutedWorker {
    let role = crate::service::role_from_proto(worker.role());
    let pb::WorkerInfo { worker_id, endpoint, model, load, in_flight, role: _ } = worker;
    let load = load.unwrap_or_default();
    RoutedWorker {
        worker_id,
        endpoint,
        model,
        load: WorkerLoad { running: load.running, waiting: load.waiting, blocks_used: load.blocks_used, blocks_total: load.blocks_total },
        in_flight,
        role,
    }
}

impl RouterClient {
    /// A lazily connecting client for the router at `endpoint`.
    pub fn connect(endpoint: &str) -> Result<Self, RouterCallError> {
        let channel = traced_channel(endpoint).map_err(|error| RouterCallError::Unavailable(format!("bad router endpoint {endpoint:?}: {error}")))?;
        Ok(RouterClient::Remote(GrpcRouterClient::new(channel)))
    }

    /// Chooses a worker and books the request.
    pub async fn route(&self, request: &RouteRequest) -> Result<Routed, RouterCallError> {
        match self {
            RouterClient::Local(router) => Ok(router.route_async(request).await?),
            RouterClient::Remote(client) => {
                let message = pb::RouteRequest {
                    request_id: request.request_id.clone(),
                    model: request.model.clone(),
                    prompt_tokens: request.prompt_tokens,
                    policy: policy_to_proto(request.policy) as i32,
                    exclude_worker_ids: request.exclude_worker_ids.clone(),
                    token_ids: request.token_ids.to_vec(),
                    kv_weights: request.kv.map(kv_overrides_to_proto),
                };
                let response = client.clone().route(message).await?.into_inner();
                let pb::RouteResponse { worker, in_flight, prompt_blocks, overlap_blocks, prefill_worker } = response;
                let worker = worker.map(worker_from_proto).ok_or_else(|| RouterCallError::Unavailable("router returned no worker".into()))?;
                Ok(Routed { worker, in_flight, prompt_blocks, overlap_blocks, prefill: prefill_worker.map(worker_from_proto) })
            }
        }
    }

    /// Tells the router a request's first token came.
    pub async fn prefill_done(&self, request_id: &str) -> Result<(), RouterCallError> {
        match self {
            RouterClient::Local(router) => {
                router.prefill_done(request_id);
                Ok(())
            }
            RouterClient::Remote(client) => {
                client.clone().prefill_done(pb::PrefillDoneRequest { request_id: request_id.to_owned() }).await?;
                Ok(())
            }
        }
    }

    /// Releases a booking.
    pub async fn finished(&self, request_id: &str) -> Result<(), RouterCallError> {
        match self {
            RouterClient::Local(router) => {
                router.finished(request_id);
                Ok(())
            }
            RouterClient::Remote(client) => {
                client.clone().request_finished(pb::RequestFinishedRequest { request_id: request_id.to_owned() }).await?;
                Ok(())
            }
        }
    }

    /// Live workers, optionally of one model.
    pub async fn workers(&self, model: Option<&str>) -> Result<Vec<RoutedWorker>, RouterCallError> {
        match self {
            RouterClient::Local(router) => Ok(router.workers(model)),
            RouterClient::Remote(client) => {
                let request = pb::ListWorkersRequest { model: model.unwrap_or_default().to_owned() };
                let workers = client.clone().list_workers(request).await?.into_inner().workers;
                Ok(workers.into_iter().map(worker_from_proto).collect())
            }
        }
    }
}
