//! [`RouterClient`]: one client for the router, in this process or over
//! gRPC.

use std::sync::Arc;
use std::time::Instant;

use tonic::Code;
use turbine_proto::MessageLimits;
use turbine_proto::router::v1 as pb;
use turbine_proto::router::v1::router_client::RouterClient as PbRouterClient;
use turbine_runtime::grpc::TracedChannel;

use crate::router::{RouteError, RouteRequest, Routed, RoutedWorker, Router};
use crate::service::{ERROR_KIND_KEY, NO_WORKERS};

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
            Code::Unavailable if status.metadata().get(ERROR_KIND_KEY).is_some_and(|kind| kind == NO_WORKERS) => RouterCallError::NoWorkers(message),
            Code::InvalidArgument => RouterCallError::InvalidRequest(message),
            _ => RouterCallError::Unavailable(format!("{}: {message}", status.code())),
        }
    }
}

impl From<turbine_proto::ConversionError> for RouterCallError {
    fn from(error: turbine_proto::ConversionError) -> Self {
        RouterCallError::Unavailable(format!("the router's answer: {error}"))
    }
}

/// What the router does for its callers: [`Router`] itself in this
/// process, [`GrpcRouter`] over the wire, or a test double.
#[tonic::async_trait]
pub trait RouterApi: Send + Sync + 'static {
    /// Chooses a worker and books the request.
    async fn route(&self, request: RouteRequest) -> Result<Routed, RouterCallError>;

    /// The request's first token came: its prefill is done.
    async fn prefill_done(&self, request_id: String) -> Result<bool, RouterCallError>;

    /// Releases the request's booking.
    async fn finished(&self, request_id: String) -> Result<bool, RouterCallError>;

    /// Live workers, optionally of one model.
    async fn workers(&self, model: Option<String>) -> Result<Vec<RoutedWorker>, RouterCallError>;
}

#[tonic::async_trait]
impl RouterApi for Router {
    async fn route(&self, request: RouteRequest) -> Result<Routed, RouterCallError> {
        let started = Instant::now();
        let result = Router::route(self, &request).await;
        let outcome = result.as_ref().map_or_else(RouteError::outcome, |_| "routed");
        crate::metrics::decision(request.policy.unwrap_or(self.policy()), outcome, started.elapsed());
        Ok(result?)
    }

    async fn prefill_done(&self, request_id: String) -> Result<bool, RouterCallError> {
        Ok(Router::prefill_done(self, &request_id))
    }

    async fn finished(&self, request_id: String) -> Result<bool, RouterCallError> {
        Ok(Router::finished(self, &request_id))
    }

    async fn workers(&self, model: Option<String>) -> Result<Vec<RoutedWorker>, RouterCallError> {
        Ok(Router::workers(self, model.as_deref()))
    }
}

/// The router, in this process or behind gRPC; cheap to clone.
#[derive(Clone)]
pub struct RouterClient {
    inner: Arc<dyn RouterApi>,
}

impl std::fmt::Debug for RouterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterClient").finish_non_exhaustive()
    }
}

impl RouterClient {
    /// A client for `router`, called directly.
    pub fn new(router: Arc<dyn RouterApi>) -> Self {
        Self { inner: router }
    }

    /// The router at `endpoint`, over the process's shared channel to it
    /// (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, RouterCallError> {
        let channel =
            turbine_runtime::grpc::channel(endpoint).map_err(|error| RouterCallError::Unavailable(format!("bad router endpoint {endpoint:?}: {error}")))?;
        Ok(Self::new(Arc::new(GrpcRouter { client: PbRouterClient::new(channel).with_message_limits() })))
    }

    /// Chooses a worker and books the request.
    pub async fn route(&self, request: &RouteRequest) -> Result<Routed, RouterCallError> {
        self.inner.route(request.clone()).await
    }

    /// Tells the router a request's first token came.
    pub async fn prefill_done(&self, request_id: &str) -> Result<(), RouterCallError> {
        self.inner.prefill_done(request_id.to_owned()).await.map(drop)
    }

    /// Releases a booking.
    pub async fn finished(&self, request_id: &str) -> Result<(), RouterCallError> {
        self.inner.finished(request_id.to_owned()).await.map(drop)
    }

    /// Live workers, optionally of one model.
    pub async fn workers(&self, model: Option<&str>) -> Result<Vec<RoutedWorker>, RouterCallError> {
        self.inner.workers(model.map(str::to_owned)).await
    }

    /// [`prefill_done`](Self::prefill_done) without waiting for it; a lost
    /// notice leaves the booking's prefill part until the request ends.
    pub fn prefill_done_in_background(&self, request_id: &str) {
        let (client, request_id) = (self.clone(), request_id.to_owned());
        spawn(async move {
            if let Err(error) = client.prefill_done(&request_id).await {
                tracing::debug!(%error, request_id, "prefill-done notice failed; the booking keeps its prefill until it ends");
            }
        });
    }

    /// [`finished`](Self::finished) without waiting for it; a lost release
    /// is expired by the router after its booking TTL.
    pub fn finished_in_background(&self, request_id: &str) {
        let (client, request_id) = (self.clone(), request_id.to_owned());
        spawn(async move {
            if let Err(error) = client.finished(&request_id).await {
                tracing::debug!(%error, request_id, "booking release failed; the router will expire it");
            }
        });
    }
}

/// Runs `task` on the current runtime, if there is one.
fn spawn(task: impl Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

/// [`RouterApi`] over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcRouter {
    client: PbRouterClient<TracedChannel>,
}

#[tonic::async_trait]
impl RouterApi for GrpcRouter {
    async fn route(&self, request: RouteRequest) -> Result<Routed, RouterCallError> {
        Ok(Routed::try_from(self.client.clone().route(pb::RouteRequest::from(request)).await?.into_inner())?)
    }

    async fn prefill_done(&self, request_id: String) -> Result<bool, RouterCallError> {
        Ok(self.client.clone().prefill_done(pb::PrefillDoneRequest { request_id }).await?.into_inner().found)
    }

    async fn finished(&self, request_id: String) -> Result<bool, RouterCallError> {
        Ok(self.client.clone().request_finished(pb::RequestFinishedRequest { request_id }).await?.into_inner().released)
    }

    async fn workers(&self, model: Option<String>) -> Result<Vec<RoutedWorker>, RouterCallError> {
        let workers = self.client.clone().list_workers(pb::ListWorkersRequest { model: model.unwrap_or_default() }).await?.into_inner().workers;
        Ok(workers.into_iter().map(RoutedWorker::try_from).collect::<Result<_, _>>()?)
    }
}
