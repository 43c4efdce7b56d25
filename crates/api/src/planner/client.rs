//! The planner's client: [`PlannerApi`] (what a planner does for its
//! callers), [`GrpcPlanner`] (that over `turbine.planner.v1`) and
//! [`PlannerClient`], the handle callers hold. Every failure is a
//! [`PlannerClientError`].

use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::{Stream, StreamExt};
use turbine_proto::MessageLimits;
use turbine_proto::planner::v1::{self as pb, planner_client::PlannerClient as PbClient};
use turbine_runtime::grpc::TracedChannel;
use turbine_runtime::host::Role;

use super::{Action, ActionState, Decision, Malformed, Plan, Targets};
use crate::error::{ApiError, ErrorCode, from_status};

/// The role a planner's certificate names: who this client calls.
pub const ROLE: Role = Role::Planner;

/// Why a call to the planner failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlannerClientError {
    /// The endpoint is malformed.
    #[error("bad planner endpoint {0:?}: {1}")]
    Endpoint(String, String),
    /// The planner refused the call or could not be reached.
    #[error("planner ({code:?}): {message}")]
    Call {
        /// The kind of failure.
        code: ErrorCode,
        /// The planner's words.
        message: String,
    },
    /// The planner's answer does not read as the contract says.
    #[error("planner: {0}")]
    Malformed(#[from] Malformed),
}

impl ApiError for PlannerClientError {
    fn code(&self) -> ErrorCode {
        match self {
            PlannerClientError::Endpoint(..) => ErrorCode::Unavailable,
            PlannerClientError::Call { code, .. } => *code,
            PlannerClientError::Malformed(_) => ErrorCode::Internal,
        }
    }

    fn message(&self) -> String {
        match self {
            PlannerClientError::Call { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }

    fn from_parts(code: ErrorCode, _reason: Option<&str>, message: String) -> Self {
        PlannerClientError::Call { code, message }
    }
}

impl From<tonic::Status> for PlannerClientError {
    fn from(status: tonic::Status) -> Self {
        from_status(&status)
    }
}

impl From<PlannerClientError> for tonic::Status {
    fn from(error: PlannerClientError) -> Self {
        crate::error::to_status(&error)
    }
}

/// A page of past decisions: newest first, and where the next page starts.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryPage {
    /// Newest first.
    pub decisions: Vec<Decision>,
    /// Pass it to continue; `None` on the last page.
    pub next_page_token: Option<String>,
}

/// Decisions as they are made.
pub type DecisionStream = Pin<Box<dyn Stream<Item = Result<Decision, PlannerClientError>> + Send>>;

/// What a planner does for its callers: [`GrpcPlanner`] over the wire, or
/// a test's double.
#[cfg_attr(feature = "mock", mockall::automock)]
#[tonic::async_trait]
pub trait PlannerApi: Send + Sync + 'static {
    /// The plan in force.
    async fn plan(&self) -> Result<Plan, PlannerClientError>;

    /// Replaces the targets; answers them as stored.
    async fn set_targets(&self, targets: Targets) -> Result<Targets, PlannerClientError>;

    /// A page of `page_size` decisions (0: the planner's default), from
    /// the newest or from `page_token`.
    async fn history(&self, page_size: u32, page_token: Option<String>) -> Result<HistoryPage, PlannerClientError>;

    /// Stops acting, with the operator's reason; answers the plan after.
    async fn pause(&self, reason: String) -> Result<Plan, PlannerClientError>;

    /// Acts again; answers the plan after.
    async fn resume(&self) -> Result<Plan, PlannerClientError>;

    /// Reports how action `id` ended; answers the action as recorded.
    async fn complete_action(&self, id: String, state: ActionState, message: String) -> Result<Action, PlannerClientError>;

    /// Every decision from now on (the latest first, if any).
    async fn watch(&self) -> Result<DecisionStream, PlannerClientError>;
}

/// A planner, behind gRPC or a test's double; cheap to clone.
#[derive(Clone)]
pub struct PlannerClient {
    inner: Arc<dyn PlannerApi>,
}

impl std::fmt::Debug for PlannerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlannerClient").finish_non_exhaustive()
    }
}

impl PlannerClient {
    /// A client for `planner`, called directly.
    pub fn new(planner: Arc<dyn PlannerApi>) -> Self {
        Self { inner: planner }
    }

    /// The planner at `endpoint` (`http://host:port`), over the process's
    /// shared channel to it (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, PlannerClientError> {
        let channel = turbine_runtime::grpc::channel(endpoint, ROLE).map_err(|error| PlannerClientError::Endpoint(endpoint.to_owned(), error.to_string()))?;
        Ok(Self::new(Arc::new(GrpcPlanner { client: PbClient::new(channel).with_message_limits() })))
    }

    /// The plan in force.
    pub async fn plan(&self) -> Result<Plan, PlannerClientError> {
        self.inner.plan().await
    }

    /// Replaces the targets; answers them as stored.
    pub async fn set_targets(&self, targets: &Targets) -> Result<Targets, PlannerClientError> {
        self.inner.set_targets(targets.clone()).await
    }

    /// A page of `page_size` decisions (0: the planner's default), from
    /// the newest or from `page_token`.
    pub async fn history(&self, page_size: u32, page_token: Option<&str>) -> Result<HistoryPage, PlannerClientError> {
        self.inner.history(page_size, page_token.map(str::to_owned)).await
    }

    /// Stops acting, with the operator's reason; answers the plan after.
    pub async fn pause(&self, reason: &str) -> Result<Plan, PlannerClientError> {
        self.inner.pause(reason.to_owned()).await
    }

    /// Acts again; answers the plan after.
    pub async fn resume(&self) -> Result<Plan, PlannerClientError> {
        self.inner.resume().await
    }

    /// Reports how action `id` ended (`Done` or `Failed`, with what
    /// happened), for a planner whose connector is `virtual`; answers the
    /// action as recorded.
    pub async fn complete_action(&self, id: &str, state: ActionState, message: &str) -> Result<Action, PlannerClientError> {
        self.inner.complete_action(id.to_owned(), state, message.to_owned()).await
    }

    /// Every decision from now on (the latest first, if any).
    pub async fn watch(&self) -> Result<DecisionStream, PlannerClientError> {
        self.inner.watch().await
    }
}

/// [`PlannerApi`] over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcPlanner {
    client: PbClient<TracedChannel>,
}

fn missing(field: &str) -> Malformed {
    Malformed { field: field.into(), problem: "missing".into() }
}

#[tonic::async_trait]
impl PlannerApi for GrpcPlanner {
    async fn plan(&self) -> Result<Plan, PlannerClientError> {
        Ok(Plan::try_from(self.client.clone().get_plan(pb::GetPlanRequest {}).await?.into_inner())?)
    }

    async fn set_targets(&self, targets: Targets) -> Result<Targets, PlannerClientError> {
        let stored = self.client.clone().set_targets(pb::SetTargetsRequest { targets: Some((&targets).into()) }).await?.into_inner().targets;
        let stored = stored.ok_or_else(|| missing("targets"))?;
        Ok(Targets::try_from(stored).map_err(|error| Malformed { field: "targets".into(), problem: error.to_string() })?)
    }

    async fn history(&self, page_size: u32, page_token: Option<String>) -> Result<HistoryPage, PlannerClientError> {
        let request = pb::HistoryRequest { page_size, page_token: page_token.unwrap_or_default() };
        let pb::HistoryResponse { decisions, next_page_token } = self.client.clone().history(request).await?.into_inner();
        Ok(HistoryPage {
            decisions: decisions.into_iter().map(Decision::try_from).collect::<Result<_, _>>()?,
            next_page_token: (!next_page_token.is_empty()).then_some(next_page_token),
        })
    }

    async fn pause(&self, reason: String) -> Result<Plan, PlannerClientError> {
        let plan = self.client.clone().pause(pb::PauseRequest { reason }).await?.into_inner().plan;
        Ok(Plan::try_from(plan.ok_or_else(|| missing("plan"))?)?)
    }

    async fn resume(&self) -> Result<Plan, PlannerClientError> {
        let plan = self.client.clone().resume(pb::ResumeRequest {}).await?.into_inner().plan;
        Ok(Plan::try_from(plan.ok_or_else(|| missing("plan"))?)?)
    }

    async fn complete_action(&self, id: String, state: ActionState, message: String) -> Result<Action, PlannerClientError> {
        let request = pb::CompleteActionRequest { id, state: pb::ActionState::from(state) as i32, message };
        let action = self.client.clone().complete_action(request).await?.into_inner().action;
        Ok(Action::try_from(action.ok_or_else(|| missing("action"))?)?)
    }

    async fn watch(&self) -> Result<DecisionStream, PlannerClientError> {
        let stream = self.client.clone().watch_plan(pb::WatchPlanRequest {}).await?.into_inner();
        Ok(Box::pin(stream.map(|next| Ok(Decision::try_from(next?)?))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_a_planner_sends_comes_back_as_itself() {
        for code in ErrorCode::ALL {
            let error = PlannerClientError::Call { code, message: format!("{code:?} happened") };
            assert_eq!(PlannerClientError::from(tonic::Status::from(error.clone())), error);
        }
        // What only the client says reads back as the code it maps to.
        let endpoint = PlannerClientError::Endpoint("nowhere".into(), "no scheme".into());
        assert_eq!(tonic::Status::from(endpoint).code(), tonic::Code::Unavailable);
        let malformed = PlannerClientError::Malformed(missing("plan"));
        let status = tonic::Status::from(malformed);
        assert_eq!((status.code(), status.message()), (tonic::Code::Internal, "planner: malformed plan: missing"));
        assert!(matches!(
            PlannerClientError::from(tonic::Status::invalid_argument("targets.percentile: must lie in (0, 100)")),
            PlannerClientError::Call { code: ErrorCode::InvalidArgument, message } if message.starts_with("targets.percentile")
        ));
    }
}
