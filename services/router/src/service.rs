//! The `turbine.router.v1.Router` gRPC service over [`Router`].

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};
use turbine_proto::router::v1 as pb;
use turbine_registry::WorkerRole;

use crate::metrics;
use crate::policy::Policy;
use crate::kv::KvOverrides;
use crate::router::{RouteError, RouteRequest, Routed, RoutedWorker, Router};

/// Metadata key naming the kind of a router error, so clients need not
/// parse messages.
pub const ERROR_KIND_KEY: &str = "turbine-error";
/// [`ERROR_KIND_KEY`] value: no live worker serves the model.
pub const NO_WORKERS: &str = "no-workers";

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct RouterService {
    router: Arc<Router>,
}

impl RouterService {
    /// Serves `router`.
    pub fn new(router: Arc<Router>) -> Self {
        Self { router }
    }
}

/// Policy from the wire (`None`: use the configured one).
pub fn policy_from_proto(policy: pb::Policy) -> Option<Policy> {
    match policy {
        pb::Policy::Unspecified => None,
        pb::Policy::RoundRobin => Some(Policy::RoundRobin),
        pb::Policy::Random => Some(Policy::Random),
        pb::Policy::LeastLoaded => Some(Policy::LeastLoaded),
        pb::Policy::Kv => Some(Policy::Kv),
    }
}

/// Policy to the wire.
pub fn policy_to_proto(policy: Option<Policy>) -> pb::Policy {
    match policy {
        None => pb::Policy::Unspecified,
        Some(Policy::RoundRobin) => pb::Policy::RoundRobin,
        Some(Policy::Random) => pb::Policy::Random,
        Some(Policy::LeastLoaded) => pb::Policy::LeastLoaded,
        Some(Policy::Kv) => pb::Policy::Kv,
    }
}

/// KV weight overrides from the wire.
pub fn kv_overrides_from_proto(weights: pb::KvWeights) -> KvOverrides {
    let pb::KvWeights { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature } = weights;
    KvOverrides { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature }
}

/// KV weight overrides to the wire.
pub fn kv_overrides_to_proto(overrides: KvOverrides) -> pb::KvWeights {
    let KvOverrides { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature } = overrides;
    pb::KvWeights { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature }
}

/// A routed worker to the wire.
pub fn worker_to_proto(worker: RoutedWorker) -> pb::WorkerInfo {
    let RoutedWorker { worker_id, endpoint, model, load, in_flight, role } = worker;
    pb::WorkerInfo {
        worker_id,
        endpoint,
        model,
        load: Some(pb::WorkerLoad { running: load.running, waiting: load.waiting, blocks_used: load.blocks_used, blocks_total: load.blocks_total }),
        in_flight,
        role: role_to_proto(role) as i32,
    }
}

/// A worker role to the wire.
pub fn role_to_proto(role: WorkerRole) -> pb::WorkerRole {
    match role {
        WorkerRole::Aggregated => pb::WorkerRole::Aggregated,
        WorkerRole::Prefill => pb::WorkerRole::Prefill,
        WorkerRole::Decode => pb::WorkerRole::Decode,
    }
}

/// A worker role from the wire (unspecified: aggregated).
pub fn role_from_proto(role: pb::WorkerRole) -> WorkerRole {
    match role {
        pb::WorkerRole::Unspecified | pb::WorkerRole::Aggregated => WorkerRole::Aggregated,
        pb::WorkerRole::Prefill => WorkerRole::Prefill,
        pb::WorkerRole::Decode => WorkerRole::Decode,
    }
}

impl From<RouteError> for Status {
    fn from(error: RouteError) -> Self {
        match error {
            RouteError::NoWorkers(_) => {
                let mut status = Status::unavailable(error.to_string());
                status.metadata_mut().insert(ERROR_KIND_KEY, tonic::metadata::MetadataValue::from_static(NO_WORKERS));
                status
            }
            RouteError::InvalidRequest(message) => Status::invalid_argument(message),
        }
    }
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    #[tracing::instrument(skip_all, name = "router.route", fields(request_id, worker))]
    async fn route(&self, request: Request<pb::RouteRequest>) -> Result<Response<pb::RouteResponse>, Status> {
        let started = Instant::now();
        let request = request.into_inner();
        let policy = policy_from_proto(request.policy());
        let pb::RouteRequest { request_id, model, prompt_tokens, policy: _, exclude_worker_ids, token_ids, kv_weights } = request;
        tracing::Span::current().record("request_id", request_id.as_str());
        let route = RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy,
            exclude_worker_ids,
            token_ids: token_ids.into(),
            kv: kv_weights.map(kv_overrides_from_proto),
        };
        let result = self.router.route_async(&route).await;
        metrics::decision(policy.unwrap_or(self.router.policy()), &result, started.elapsed());
        let Routed { worker, in_flight, prompt_blocks, overlap_blocks, prefill } = result?;
        tracing::Span::current().record("worker", worker.worker_id.as_str());
        Ok(Response::new(pb::RouteResponse {
            worker: Some(worker_to_proto(worker)),
            in_flight,
            prompt_blocks,
            overlap_blocks,
            prefill_worker: prefill.map(worker_to_proto),
        }))
    }

    async fn prefill_done(&self, request: Request<pb::PrefillDoneRequest>) -> Result<Response<pb::PrefillDoneResponse>, Status> {
        let found = self.router.prefill_done(&request.into_inner().request_id);
        Ok(Response::new(pb::PrefillDoneResponse { found }))
    }

    async fn request_finished(&self, request: Request<pb::RequestFinishedRequest>) -> Result<Response<pb::RequestFinishedResponse>, Status> {
        let released = self.router.finished(&request.into_inner().request_id);
        Ok(Response::new(pb::RequestFinishedResponse { released }))
    }

    async fn list_workers(&self, request: Request<pb::ListWorkersRequest>) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let model = request.into_inner().model;
        let workers = self.router.workers((!model.is_empty()).then_some(model.as_str()));
        Ok(Response::new(pb::ListWorkersResponse { workers: workers.into_iter().map(worker_to_proto).collect() }))
    }
}
