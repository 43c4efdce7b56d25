//! [`PlannerClient`]: the typed client of `turbine.planner.v1` (domain
//! types in and out; the wire types stay here).

use std::pin::Pin;

use tokio_stream::{Stream, StreamExt};
use turbine_proto::MessageLimits;
use turbine_proto::planner::v1::{self as pb, planner_client::PlannerClient as PbClient};
use turbine_runtime::grpc::TracedChannel;

use turbine_api::{ApiError, ErrorCode};

use crate::decision::{Action, ActionState, Decision, Malformed, Plan};
use crate::targets::Targets;

/// Why a call to the planner failed.
#[derive(Debug, thiserror::Error)]
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
        turbine_api::from_status(&status)
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

/// A planner over gRPC. Cloning shares the connection.
#[derive(Debug, Clone)]
pub struct PlannerClient {
    client: PbClient<TracedChannel>,
}

impl PlannerClient {
    /// The planner at `endpoint` (`http://host:port`), over the process's
    /// shared channel to it (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, PlannerClientError> {
        let channel = turbine_runtime::grpc::channel(endpoint).map_err(|error| PlannerClientError::Endpoint(endpoint.to_owned(), error.to_string()))?;
        Ok(Self { client: PbClient::new(channel).with_message_limits() })
    }

    /// The plan in force.
    pub async fn plan(&self) -> Result<Plan, PlannerClientError> {
        Ok(Plan::try_from(self.client.clone().get_plan(pb::GetPlanRequest {}).await?.into_inner())?)
    }

    /// Replaces the targets; answers them as stored.
    pub async fn set_targets(&self, targets: &Targets) -> Result<Targets, PlannerClientError> {
        let stored = self.client.clone().set_targets(pb::SetTargetsRequest { targets: Some(targets.into()) }).await?.into_inner().targets;
        let stored = stored.ok_or_else(|| Malformed { field: "targets".into(), problem: "missing".into() })?;
        Ok(Targets::try_from(stored).map_err(|error| Malformed { field: "targets".into(), problem: error.to_string() })?)
    }

    /// A page of `page_size` decisions (0: the planner's default), from
    /// the newest or from `page_token`.
    pub async fn history(&self, page_size: u32, page_token: Option<&str>) -> Result<HistoryPage, PlannerClientError> {
        let request = pb::HistoryRequest { page_size, page_token: page_token.unwrap_or_default().to_owned() };
        let pb::HistoryResponse { decisions, next_page_token } = self.client.clone().history(request).await?.into_inner();
        Ok(HistoryPage {
            decisions: decisions.into_iter().map(Decision::try_from).collect::<Result<_, _>>()?,
            next_page_token: (!next_page_token.is_empty()).then_some(next_page_token),
        })
    }

    /// Stops acting, with the operator's reason; answers the plan after.
    pub async fn pause(&self, reason: &str) -> Result<Plan, PlannerClientError> {
        let plan = self.client.clone().pause(pb::PauseRequest { reason: reason.to_owned() }).await?.into_inner().plan;
        Ok(Plan::try_from(plan.ok_or_else(|| Malformed { field: "plan".into(), problem: "missing".into() })?)?)
    }

    /// Acts again; answers the plan after.
    pub async fn resume(&self) -> Result<Plan, PlannerClientError> {
        let plan = self.client.clone().resume(pb::ResumeRequest {}).await?.into_inner().plan;
        Ok(Plan::try_from(plan.ok_or_else(|| Malformed { field: "plan".into(), problem: "missing".into() })?)?)
    }

    /// Reports how action `id` ended (`Done` or `Failed`, with what
    /// happened), for a planner whose connector is `virtual`; answers the
    /// action as recorded.
    pub async fn complete_action(&self, id: &str, state: ActionState, message: &str) -> Result<Action, PlannerClientError> {
        let state = match state {
            ActionState::Pending => pb::ActionState::Pending,
            ActionState::Done => pb::ActionState::Done,
            ActionState::Failed => pb::ActionState::Failed,
        };
        let request = pb::CompleteActionRequest { id: id.to_owned(), state: state as i32, message: message.to_owned() };
        let action = self.client.clone().complete_action(request).await?.into_inner().action;
        Ok(Action::try_from(action.ok_or_else(|| Malformed { field: "action".into(), problem: "missing".into() })?)?)
    }

    /// Every decision from now on (the latest first, if any).
    pub async fn watch(&self) -> Result<DecisionStream, PlannerClientError> {
        let stream = self.client.clone().watch_plan(pb::WatchPlanRequest {}).await?.into_inner();
        Ok(Box::pin(stream.map(|next| Ok(Decision::try_from(next?)?))))
    }
}
