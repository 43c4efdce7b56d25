//! The `turbine.router.v1.Router` gRPC shell over [`Router`], and the
//! conversions between its messages and the router's types.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use turbine_kv::WorkerId;
use turbine_proto::router::v1 as pb;
use turbine_proto::{ConversionError, ConversionResult};
use turbine_registry::{WorkerLoad, WorkerRole};

use crate::client::{RouterApi, RouterCallError};
use crate::kv::KvOverrides;
use crate::policy::Policy;
use crate::router::{RouteRequest, Routed, RoutedWorker, Router};

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

impl From<RouterCallError> for Status {
    fn from(error: RouterCallError) -> Self {
        match error {
            // UNAVAILABLE, marked: clients tell it from the router itself
            // being unreachable.
            RouterCallError::NoWorkers(message) => {
                let mut status = Status::unavailable(message);
                status.metadata_mut().insert(ERROR_KIND_KEY, tonic::metadata::MetadataValue::from_static(NO_WORKERS));
                status
            }
            RouterCallError::InvalidRequest(message) => Status::invalid_argument(message),
            RouterCallError::Unavailable(message) => Status::unavailable(message),
        }
    }
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    #[tracing::instrument(skip_all, name = "router.route", fields(request_id, worker))]
    async fn route(&self, request: Request<pb::RouteRequest>) -> Result<Response<pb::RouteResponse>, Status> {
        let request = RouteRequest::try_from(request.into_inner())?;
        tracing::Span::current().record("request_id", request.request_id.as_str());
        let routed = RouterApi::route(&*self.router, request).await?;
        tracing::Span::current().record("worker", routed.worker.worker_id.as_str());
        Ok(Response::new(pb::RouteResponse::from(routed)))
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
        Ok(Response::new(pb::ListWorkersResponse { workers: workers.into_iter().map(pb::WorkerInfo::from).collect() }))
    }
}

/// A policy from the wire (`None`: the router's configured one).
fn policy_from_wire(value: i32) -> ConversionResult<Option<Policy>> {
    match pb::Policy::try_from(value) {
        Ok(pb::Policy::Unspecified) => Ok(None),
        Ok(pb::Policy::RoundRobin) => Ok(Some(Policy::RoundRobin)),
        Ok(pb::Policy::Random) => Ok(Some(Policy::Random)),
        Ok(pb::Policy::LeastLoaded) => Ok(Some(Policy::LeastLoaded)),
        Ok(pb::Policy::Kv) => Ok(Some(Policy::Kv)),
        Err(_) => Err(ConversionError::UnknownEnum { field: "policy", value }),
    }
}

fn policy_to_wire(policy: Option<Policy>) -> pb::Policy {
    match policy {
        None => pb::Policy::Unspecified,
        Some(Policy::RoundRobin) => pb::Policy::RoundRobin,
        Some(Policy::Random) => pb::Policy::Random,
        Some(Policy::LeastLoaded) => pb::Policy::LeastLoaded,
        Some(Policy::Kv) => pb::Policy::Kv,
    }
}

/// A role from the wire (unspecified: aggregated).
fn role_from_wire(value: i32) -> ConversionResult<WorkerRole> {
    match pb::WorkerRole::try_from(value) {
        Ok(pb::WorkerRole::Unspecified | pb::WorkerRole::Aggregated) => Ok(WorkerRole::Aggregated),
        Ok(pb::WorkerRole::Prefill) => Ok(WorkerRole::Prefill),
        Ok(pb::WorkerRole::Decode) => Ok(WorkerRole::Decode),
        Err(_) => Err(ConversionError::UnknownEnum { field: "role", value }),
    }
}

fn role_to_wire(role: WorkerRole) -> pb::WorkerRole {
    match role {
        WorkerRole::Aggregated => pb::WorkerRole::Aggregated,
        WorkerRole::Prefill => pb::WorkerRole::Prefill,
        WorkerRole::Decode => pb::WorkerRole::Decode,
    }
}

impl From<pb::KvWeights> for KvOverrides {
    fn from(weights: pb::KvWeights) -> Self {
        let pb::KvWeights { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature } = weights;
        KvOverrides { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature }
    }
}

impl From<KvOverrides> for pb::KvWeights {
    fn from(overrides: KvOverrides) -> Self {
        let KvOverrides { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature } = overrides;
        pb::KvWeights { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature }
    }
}

impl TryFrom<pb::RouteRequest> for RouteRequest {
    type Error = ConversionError;

    fn try_from(request: pb::RouteRequest) -> ConversionResult<Self> {
        let pb::RouteRequest { request_id, model, prompt_tokens, policy, exclude_worker_ids, token_ids, kv_weights } = request;
        Ok(RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy: policy_from_wire(policy)?,
            exclude_worker_ids: exclude_worker_ids.into_iter().map(WorkerId::from).collect(),
            token_ids: token_ids.into(),
            kv: kv_weights.map(KvOverrides::from),
        })
    }
}

impl From<RouteRequest> for pb::RouteRequest {
    fn from(request: RouteRequest) -> Self {
        let RouteRequest { request_id, model, prompt_tokens, policy, exclude_worker_ids, token_ids, kv } = request;
        pb::RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy: policy_to_wire(policy) as i32,
            exclude_worker_ids: exclude_worker_ids.into_iter().map(String::from).collect(),
            token_ids: token_ids.to_vec(),
            kv_weights: kv.map(pb::KvWeights::from),
        }
    }
}

impl From<RoutedWorker> for pb::WorkerInfo {
    fn from(worker: RoutedWorker) -> Self {
        let RoutedWorker { worker_id, endpoint, model, load: WorkerLoad { running, waiting, blocks_used, blocks_total }, in_flight, role } = worker;
        pb::WorkerInfo {
            worker_id: worker_id.to_string(),
            endpoint,
            model,
            load: Some(pb::WorkerLoad { running, waiting, blocks_used, blocks_total }),
            in_flight,
            role: role_to_wire(role) as i32,
        }
    }
}

impl TryFrom<pb::WorkerInfo> for RoutedWorker {
    type Error = ConversionError;

    fn try_from(worker: pb::WorkerInfo) -> ConversionResult<Self> {
        let pb::WorkerInfo { worker_id, endpoint, model, load, in_flight, role } = worker;
        if worker_id.is_empty() {
            return Err(ConversionError::Missing("worker.worker_id"));
        }
        let pb::WorkerLoad { running, waiting, blocks_used, blocks_total } = load.unwrap_or_default();
        Ok(RoutedWorker {
            worker_id: WorkerId::from(worker_id),
            endpoint,
            model,
            load: WorkerLoad { running, waiting, blocks_used, blocks_total },
            in_flight,
            role: role_from_wire(role)?,
        })
    }
}

impl From<Routed> for pb::RouteResponse {
    fn from(routed: Routed) -> Self {
        let Routed { worker, in_flight, prompt_blocks, overlap_blocks, prefill } = routed;
        pb::RouteResponse {
            worker: Some(pb::WorkerInfo::from(worker)),
            in_flight,
            prompt_blocks,
            overlap_blocks,
            prefill_worker: prefill.map(pb::WorkerInfo::from),
        }
    }
}

impl TryFrom<pb::RouteResponse> for Routed {
    type Error = ConversionError;

    fn try_from(response: pb::RouteResponse) -> ConversionResult<Self> {
        let pb::RouteResponse { worker, in_flight, prompt_blocks, overlap_blocks, prefill_worker } = response;
        Ok(Routed {
            worker: RoutedWorker::try_from(worker.ok_or(ConversionError::Missing("worker"))?)?,
            in_flight,
            prompt_blocks,
            overlap_blocks,
            prefill: prefill_worker.map(RoutedWorker::try_from).transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_decisions_round_trip() {
        let request = RouteRequest {
            request_id: "r".into(),
            model: "m".into(),
            prompt_tokens: 3,
            policy: Some(Policy::Kv),
            exclude_worker_ids: vec!["w-2".into()],
            token_ids: vec![1, 2, 3].into(),
            kv: Some(KvOverrides { temperature: Some(0.5), ..KvOverrides::default() }),
        };
        assert_eq!(RouteRequest::try_from(pb::RouteRequest::from(request.clone())).unwrap(), request);
        let worker = RoutedWorker {
            worker_id: "w-1".into(),
            endpoint: "http://w".into(),
            model: "m".into(),
            load: WorkerLoad::default(),
            in_flight: 2,
            role: WorkerRole::Decode,
        };
        let routed = Routed {
            worker: worker.clone(),
            in_flight: 2,
            prompt_blocks: 4,
            overlap_blocks: 1,
            prefill: Some(RoutedWorker { role: WorkerRole::Prefill, ..worker }),
        };
        assert_eq!(Routed::try_from(pb::RouteResponse::from(routed.clone())).unwrap(), routed);
    }

    #[test]
    fn unknown_enums_and_missing_workers_are_refused() {
        let bad_policy = pb::RouteRequest { policy: 42, ..Default::default() };
        assert_eq!(RouteRequest::try_from(bad_policy).unwrap_err(), ConversionError::UnknownEnum { field: "policy", value: 42 });
        assert_eq!(Routed::try_from(pb::RouteResponse::default()).unwrap_err(), ConversionError::Missing("worker"));
    }
}
