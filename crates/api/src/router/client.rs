//! The router's client: [`RouterApi`] (what a router does for its
//! callers), [`GrpcRouter`] (that over `turbine.router.v1`) and
//! [`RouterClient`], the handle callers hold; the conversions between the
//! router's words and its messages, which the router's gRPC shell uses
//! too. Every failure is a [`RouterCallError`].

use std::sync::Arc;

use turbine_kv::WorkerId;
use turbine_proto::router::v1 as pb;
use turbine_proto::router::v1::router_client::RouterClient as PbRouterClient;
use turbine_proto::{ConversionError, ConversionResult, MessageLimits};
use turbine_runtime::grpc::TracedChannel;
use turbine_runtime::host::Role;

use super::{KvOverrides, Policy, RouteRequest, Routed, RoutedWorker};
use crate::error::{ApiError, ErrorCode, from_status};
use crate::{FormatKind, Load, OutputFormats, WorkerRole};

/// The role a router's certificate names: who this client calls.
pub const ROLE: Role = Role::Router;

/// The reason an UNAVAILABLE from the router carries when no live worker
/// serves the model (the router itself is up).
pub const NO_WORKERS: &str = "no-workers";

/// Why a router call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterCallError {
    /// No live worker serves the model.
    #[error("{0}")]
    NoWorkers(String),
    /// The request was malformed.
    #[error("{0}")]
    InvalidRequest(String),
    /// Workers serve the model, but none can serve the request as asked
    /// (none keeps to its output format): FAILED_PRECONDITION.
    #[error("{0}")]
    Unserved(String),
    /// The router could not be reached, or failed.
    #[error("router unavailable: {0}")]
    Unavailable(String),
    /// The caller may not make this call.
    #[error("the router denied the call ({code:?}): {message}")]
    Denied {
        /// Unauthenticated or PermissionDenied.
        code: ErrorCode,
        /// The router's words.
        message: String,
    },
}

impl ApiError for RouterCallError {
    fn code(&self) -> ErrorCode {
        match self {
            RouterCallError::NoWorkers(_) | RouterCallError::Unavailable(_) => ErrorCode::Unavailable,
            RouterCallError::InvalidRequest(_) => ErrorCode::InvalidArgument,
            RouterCallError::Unserved(_) => ErrorCode::FailedPrecondition,
            RouterCallError::Denied { code, .. } => *code,
        }
    }

    fn reason(&self) -> Option<&'static str> {
        matches!(self, RouterCallError::NoWorkers(_)).then_some(NO_WORKERS)
    }

    fn message(&self) -> String {
        match self {
            RouterCallError::NoWorkers(message)
            | RouterCallError::InvalidRequest(message)
            | RouterCallError::Unserved(message)
            | RouterCallError::Unavailable(message) => message.clone(),
            RouterCallError::Denied { message, .. } => message.clone(),
        }
    }

    fn from_parts(code: ErrorCode, reason: Option<&str>, message: String) -> Self {
        match code {
            // A bare UNAVAILABLE is the router itself being unreachable.
            ErrorCode::Unavailable if reason == Some(NO_WORKERS) => RouterCallError::NoWorkers(message),
            ErrorCode::InvalidArgument => RouterCallError::InvalidRequest(message),
            ErrorCode::FailedPrecondition => RouterCallError::Unserved(message),
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => RouterCallError::Denied { code, message },
            ErrorCode::Unavailable
            | ErrorCode::NotFound
            | ErrorCode::ResourceExhausted
            | ErrorCode::DeadlineExceeded
            | ErrorCode::Cancelled
            | ErrorCode::DataLoss
            | ErrorCode::Unimplemented
            | ErrorCode::Internal => RouterCallError::Unavailable(if code == ErrorCode::Unavailable { message } else { format!("{code:?}: {message}") }),
        }
    }
}

impl From<tonic::Status> for RouterCallError {
    fn from(status: tonic::Status) -> Self {
        from_status(&status)
    }
}

impl From<RouterCallError> for tonic::Status {
    fn from(error: RouterCallError) -> Self {
        crate::error::to_status(&error)
    }
}

impl From<ConversionError> for RouterCallError {
    fn from(error: ConversionError) -> Self {
        RouterCallError::Unavailable(format!("the router's answer: {error}"))
    }
}

/// What the router does for its callers: the router itself in its
/// process (`turbine_router::Router`), [`GrpcRouter`] over the wire, or a
/// test's double.
#[cfg_attr(feature = "mock", mockall::automock)]
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
        let channel = turbine_runtime::grpc::channel(endpoint, ROLE)
            .map_err(|error| RouterCallError::Unavailable(format!("bad router endpoint {endpoint:?}: {error}")))?;
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

fn format_from_wire(value: i32) -> ConversionResult<FormatKind> {
    match pb::OutputFormat::try_from(value) {
        Ok(pb::OutputFormat::Unspecified) => Ok(FormatKind::Text),
        Ok(pb::OutputFormat::JsonObject) => Ok(FormatKind::JsonObject),
        Ok(pb::OutputFormat::JsonSchema) => Ok(FormatKind::JsonSchema),
        Err(_) => Err(ConversionError::UnknownEnum { field: "output_format", value }),
    }
}

fn format_to_wire(kind: FormatKind) -> pb::OutputFormat {
    match kind {
        FormatKind::Text => pb::OutputFormat::Unspecified,
        FormatKind::JsonObject => pb::OutputFormat::JsonObject,
        FormatKind::JsonSchema => pb::OutputFormat::JsonSchema,
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
        let pb::RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy,
            exclude_worker_ids,
            token_ids,
            kv_weights,
            cache_salt,
            kv_tenant,
            prefix_worker_id,
            output_format,
            output_continued,
        } = request;
        Ok(RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy: policy_from_wire(policy)?,
            exclude_worker_ids: exclude_worker_ids.into_iter().map(WorkerId::from).collect(),
            token_ids: token_ids.into(),
            kv: kv_weights.map(KvOverrides::from),
            cache_salt: turbine_kv::CacheSalt::new(cache_salt),
            kv_tenant: turbine_kv::KvTenant::new(kv_tenant),
            prefix_worker: (!prefix_worker_id.is_empty()).then(|| WorkerId::from(prefix_worker_id)),
            output: format_from_wire(output_format)?,
            output_continued,
        })
    }
}

impl From<RouteRequest> for pb::RouteRequest {
    fn from(request: RouteRequest) -> Self {
        let RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy,
            exclude_worker_ids,
            token_ids,
            kv,
            cache_salt,
            kv_tenant,
            prefix_worker,
            output,
            output_continued,
        } = request;
        pb::RouteRequest {
            request_id,
            model,
            prompt_tokens,
            policy: policy_to_wire(policy) as i32,
            exclude_worker_ids: exclude_worker_ids.into_iter().map(String::from).collect(),
            token_ids: token_ids.to_vec(),
            kv_weights: kv.map(pb::KvWeights::from),
            cache_salt: cache_salt.get(),
            kv_tenant: kv_tenant.get(),
            prefix_worker_id: prefix_worker.map(String::from).unwrap_or_default(),
            output_format: format_to_wire(output) as i32,
            output_continued,
        }
    }
}

impl From<RoutedWorker> for pb::WorkerInfo {
    fn from(worker: RoutedWorker) -> Self {
        let RoutedWorker {
            worker_id,
            endpoint,
            model,
            load: Load { running, waiting, blocks_used, blocks_total },
            in_flight,
            role,
            kv_tenants,
            output_formats,
        } = worker;
        let OutputFormats { json_object, json_schema, json_schema_core, resumes } = output_formats;
        pb::WorkerInfo {
            worker_id: worker_id.to_string(),
            endpoint,
            model,
            load: Some(pb::WorkerLoad { running, waiting, blocks_used, blocks_total }),
            in_flight,
            role: role_to_wire(role) as i32,
            kv_tenants: kv_tenants.into_iter().map(turbine_kv::KvTenant::get).collect(),
            output_formats: (!output_formats.is_text_only()).then_some(pb::WorkerOutputFormats { json_object, json_schema, json_schema_core, resumes }),
        }
    }
}

impl TryFrom<pb::WorkerInfo> for RoutedWorker {
    type Error = ConversionError;

    fn try_from(worker: pb::WorkerInfo) -> ConversionResult<Self> {
        let pb::WorkerInfo { worker_id, endpoint, model, load, in_flight, role, kv_tenants, output_formats } = worker;
        if worker_id.is_empty() {
            return Err(ConversionError::Missing("worker.worker_id"));
        }
        let pb::WorkerLoad { running, waiting, blocks_used, blocks_total } = load.unwrap_or_default();
        Ok(RoutedWorker {
            worker_id: WorkerId::from(worker_id),
            endpoint,
            model,
            load: Load { running, waiting, blocks_used, blocks_total },
            in_flight,
            role: role_from_wire(role)?,
            kv_tenants: kv_tenants.into_iter().map(turbine_kv::KvTenant::new).collect(),
            output_formats: output_formats.map_or(OutputFormats::TEXT, |pb::WorkerOutputFormats { json_object, json_schema, json_schema_core, resumes }| {
                OutputFormats { json_object, json_schema, json_schema_core, resumes }
            }),
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
            cache_salt: turbine_kv::CacheSalt::of(&["tenant"]),
            kv_tenant: turbine_kv::KvTenant::of_tenant("acme"),
            prefix_worker: Some("w-1".into()),
            output: FormatKind::JsonSchema,
            output_continued: true,
        };
        assert_eq!(RouteRequest::try_from(pb::RouteRequest::from(request.clone())).unwrap(), request);
        for output in [FormatKind::Text, FormatKind::JsonObject] {
            let plain = RouteRequest { output, output_continued: false, ..request.clone() };
            assert_eq!(RouteRequest::try_from(pb::RouteRequest::from(plain.clone())).unwrap(), plain);
        }
        let unknown = pb::RouteRequest { output_format: 7, ..pb::RouteRequest::from(request.clone()) };
        assert!(RouteRequest::try_from(unknown).is_err(), "an unknown format is refused, not read as text");
        let alone = RouteRequest { prefix_worker: None, ..request };
        assert_eq!(RouteRequest::try_from(pb::RouteRequest::from(alone.clone())).unwrap(), alone);
        let worker = RoutedWorker {
            worker_id: "w-1".into(),
            endpoint: "http://w".into(),
            model: "m".into(),
            load: Load::default(),
            in_flight: 2,
            role: WorkerRole::Decode,
            kv_tenants: vec![turbine_kv::KvTenant::of_tenant("acme"), turbine_kv::KvTenant::SHARED],
            output_formats: OutputFormats { json_object: true, json_schema: false, json_schema_core: true, resumes: true },
        };
        let routed = Routed {
            worker: worker.clone(),
            in_flight: 2,
            prompt_blocks: 4,
            overlap_blocks: 1,
            prefill: Some(RoutedWorker { role: WorkerRole::Prefill, output_formats: OutputFormats::TEXT, ..worker.clone() }),
        };
        assert_eq!(Routed::try_from(pb::RouteResponse::from(routed.clone())).unwrap(), routed);
        for formats in [OutputFormats::TEXT, OutputFormats { json_schema: true, ..OutputFormats::TEXT }] {
            let info = pb::WorkerInfo::from(RoutedWorker { output_formats: formats, ..worker.clone() });
            assert_eq!(info.output_formats.is_none(), formats.is_text_only(), "text only is left unset");
            assert_eq!(RoutedWorker::try_from(info).unwrap().output_formats, formats);
        }
    }

    #[test]
    fn unknown_enums_and_missing_workers_are_refused() {
        let bad_policy = pb::RouteRequest { policy: 42, ..Default::default() };
        assert_eq!(RouteRequest::try_from(bad_policy).unwrap_err(), ConversionError::UnknownEnum { field: "policy", value: 42 });
        assert_eq!(Routed::try_from(pb::RouteResponse::default()).unwrap_err(), ConversionError::Missing("worker"));
    }

    #[test]
    fn every_error_a_router_sends_comes_back_as_itself() {
        let sent = [
            RouterCallError::NoWorkers("no live worker serves model \"m\"".into()),
            RouterCallError::InvalidRequest("model is required".into()),
            RouterCallError::Unavailable("shutting down".into()),
            RouterCallError::Denied { code: ErrorCode::Unauthenticated, message: "no certificate".into() },
        ];
        for error in sent {
            let status = tonic::Status::from(error.clone());
            assert_eq!(RouterCallError::from(status), error);
        }
        let no_workers = tonic::Status::from(RouterCallError::NoWorkers("none".into()));
        assert_eq!(no_workers.code(), tonic::Code::Unavailable, "the code is UNAVAILABLE; the reason tells it from an unreachable router");
        assert!(matches!(RouterCallError::from(tonic::Status::unavailable("connection refused")), RouterCallError::Unavailable(_)));
        assert!(matches!(RouterCallError::from(tonic::Status::internal("bug")), RouterCallError::Unavailable(message) if message.contains("Internal")));
    }
}
