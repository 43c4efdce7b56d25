//! The gRPC shell over the ledger: `turbine.planner.v1.Planner`.

use std::pin::Pin;

use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_proto::planner::v1::{self as pb, planner_server};
use turbine_runtime::CancellationToken;

use crate::ledger::{LedgerError, MAX_PAGE};
use crate::plan::Targets;
use crate::plan::{ActionState, Plan};
use crate::state::{PlannerState, WATCH_BUFFER};

/// Longest pause reason, bytes.
pub const MAX_REASON: usize = 1024;

/// Decisions per History page when the caller names none.
pub const DEFAULT_PAGE: u32 = 100;

/// The service.
#[derive(Debug, Clone)]
pub struct PlannerService {
    state: PlannerState,
    shutdown: CancellationToken,
}

impl PlannerService {
    /// Serves `state`; watch streams end when `shutdown` fires (so a
    /// watcher never holds up the drain).
    pub fn new(state: PlannerState, shutdown: CancellationToken) -> Self {
        Self { state, shutdown }
    }

    async fn plan(&self) -> Result<pb::Plan, Status> {
        let ledger = self.state.ledger();
        let control = ledger.control().await.map_err(unavailable)?;
        let latest = ledger.latest().await.map_err(unavailable)?;
        let mut plan = Plan::new(control.targets, control.paused, latest);
        for pool in &mut plan.pools {
            pool.draining_replicas = self.state.connector().draining(&pool.pool);
        }
        Ok(pb::Plan::from(&plan))
    }
}

/// A ledger failure as the caller sees it: the planner's database cannot
/// answer now; the call may be retried.
fn unavailable(error: LedgerError) -> Status {
    tracing::warn!(%error, "planner ledger");
    match error {
        LedgerError::Corrupt { .. } => Status::internal(format!("planner state: {error}")),
        _ => Status::unavailable(format!("planner state: {error}")),
    }
}

/// History's page token: the id the next page starts below.
fn token_before(before: u64) -> String {
    format!("before-{before}")
}

fn parse_page_token(token: &str) -> Result<Option<u64>, Status> {
    if token.is_empty() {
        return Ok(None);
    }
    token.strip_prefix("before-").and_then(|id| id.parse().ok()).map(Some).ok_or_else(|| {
        Status::invalid_argument(format!("page_token: {token:?} was not issued by this planner (pass a previous answer's next_page_token, or nothing)"))
    })
}

type DecisionStream = Pin<Box<dyn Stream<Item = Result<pb::Decision, Status>> + Send>>;

#[tonic::async_trait]
impl planner_server::Planner for PlannerService {
    async fn get_plan(&self, _request: Request<pb::GetPlanRequest>) -> Result<Response<pb::Plan>, Status> {
        Ok(Response::new(self.plan().await?))
    }

    type WatchPlanStream = DecisionStream;

    async fn watch_plan(&self, _request: Request<pb::WatchPlanRequest>) -> Result<Response<DecisionStream>, Status> {
        // Subscribe before reading the latest, so nothing falls between.
        let decisions = self.state.subscribe();
        let latest = self.state.ledger().latest().await.map_err(unavailable)?;
        let sent = latest.as_ref().map_or(0, |decision| decision.id);
        let first = tokio_stream::iter(latest.map(|decision| Ok(pb::Decision::from(&decision))));
        let rest = BroadcastStream::new(decisions).filter(move |next| !matches!(next, Ok(decision) if decision.id <= sent)).map(|next| match next {
            Ok(decision) => Ok(pb::Decision::from(&*decision)),
            // tonic ends the stream with this status.
            Err(BroadcastStreamRecvError::Lagged(missed)) => Err(Status::resource_exhausted(format!(
                "this watcher fell {missed} decisions behind (the planner buffers {WATCH_BUFFER}): call History for what was missed, then watch again"
            ))),
        });
        Ok(Response::new(Box::pin(futures::StreamExt::take_until(first.chain(rest), self.shutdown.clone().cancelled_owned()))))
    }

    async fn set_targets(&self, request: Request<pb::SetTargetsRequest>) -> Result<Response<pb::SetTargetsResponse>, Status> {
        let targets = request.into_inner().targets.ok_or_else(|| Status::invalid_argument("targets: required"))?;
        let targets = Targets::try_from(targets).map_err(|error| Status::invalid_argument(error.to_string()))?;
        self.state.ledger().set_targets(&targets, self.state.ledger().clock().now_unix_ms()).await.map_err(unavailable)?;
        tracing::info!(?targets, "targets set");
        Ok(Response::new(pb::SetTargetsResponse { targets: Some(pb::Targets::from(&targets)) }))
    }

    async fn history(&self, request: Request<pb::HistoryRequest>) -> Result<Response<pb::HistoryResponse>, Status> {
        let pb::HistoryRequest { page_size, page_token } = request.into_inner();
        let before = parse_page_token(&page_token)?;
        let size = match page_size {
            0 => DEFAULT_PAGE,
            size if size > MAX_PAGE => return Err(Status::invalid_argument(format!("page_size: {size}, at most {MAX_PAGE}"))),
            size => size,
        };
        // One more than the page says whether another page follows.
        let mut decisions = self.state.ledger().history(before, size as usize + 1).await.map_err(unavailable)?;
        let more = decisions.len() > size as usize;
        decisions.truncate(size as usize);
        let next_page_token = match decisions.last() {
            Some(oldest) if more => token_before(oldest.id),
            _ => String::new(),
        };
        Ok(Response::new(pb::HistoryResponse { decisions: decisions.iter().map(pb::Decision::from).collect(), next_page_token }))
    }

    async fn pause(&self, request: Request<pb::PauseRequest>) -> Result<Response<pb::PauseResponse>, Status> {
        let reason = request.into_inner().reason;
        if reason.len() > MAX_REASON {
            return Err(Status::invalid_argument(format!("reason: {} bytes, at most {MAX_REASON}", reason.len())));
        }
        self.state.ledger().set_paused(true, &reason, self.state.ledger().clock().now_unix_ms()).await.map_err(unavailable)?;
        tracing::info!(reason, "planner paused");
        Ok(Response::new(pb::PauseResponse { plan: Some(self.plan().await?) }))
    }

    async fn resume(&self, _request: Request<pb::ResumeRequest>) -> Result<Response<pb::ResumeResponse>, Status> {
        self.state.ledger().set_paused(false, "", self.state.ledger().clock().now_unix_ms()).await.map_err(unavailable)?;
        tracing::info!("planner resumed");
        Ok(Response::new(pb::ResumeResponse { plan: Some(self.plan().await?) }))
    }

    async fn complete_action(&self, request: Request<pb::CompleteActionRequest>) -> Result<Response<pb::CompleteActionResponse>, Status> {
        let pb::CompleteActionRequest { id, state, message } = request.into_inner();
        let state = match pb::ActionState::try_from(state) {
            Ok(pb::ActionState::Done) => ActionState::Done,
            Ok(pb::ActionState::Failed) => ActionState::Failed,
            Ok(pb::ActionState::Pending | pb::ActionState::Unspecified) | Err(_) => {
                return Err(Status::invalid_argument(format!("state: {state}, must be ACTION_STATE_DONE or ACTION_STATE_FAILED")));
            }
        };
        if id.is_empty() {
            return Err(Status::invalid_argument("id: required (the action's id, as its decision carried it)"));
        }
        if message.len() > MAX_REASON {
            return Err(Status::invalid_argument(format!("message: {} bytes, at most {MAX_REASON}", message.len())));
        }
        if !self.state.connector().awaits_reports() {
            return Err(Status::failed_precondition(format!(
                "this planner's {:?} connector carries out actions itself; outcomes are not reported to it",
                self.state.connector().kind()
            )));
        }
        let ledger = self.state.ledger();
        let ended = ledger.end_action(&id, state, &message, self.state.ledger().clock().now_unix_ms()).await.map_err(unavailable)?;
        let action =
            ledger.action(&id).await.map_err(unavailable)?.ok_or_else(|| Status::not_found(format!("id: no action {id:?} was issued by this planner")))?;
        let reported_before = action.state == state && action.message == message;
        if !ended && !reported_before {
            return Err(Status::failed_precondition(format!("action {id:?} already ended {}: {}", action.state.name(), action.message)));
        }
        if ended {
            tracing::info!(action = id, state = state.name(), message, "action reported");
        }
        Ok(Response::new(pb::CompleteActionResponse { action: Some(pb::Action::from(&action)) }))
    }
}
