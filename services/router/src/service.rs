//! The `turbine.router.v1.Router` gRPC shell over [`Router`] (the
//! conversions between its messages and the router's words live with the
//! client, in `turbine_api::router`).

use std::sync::Arc;

use tonic::{Request, Response, Status};
use turbine_api::router::{RouteRequest, RouterApi};
use turbine_proto::router::v1 as pb;

use crate::router::Router;

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
