//! A decision: one interval's pass of the planner (what each pool did, the
//! forecast, what each pool is asked for and why, and the connector's
//! action), as the ledger keeps it and `History`/`WatchPlan` show it.

use serde::{Deserialize, Serialize};
use turbine_proto::planner::v1 as pb;

use crate::predict::Load;
use crate::targets::{PoolKind, Predictor, Targets};

/// What one pool did during an interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// The pool's name.
    pub pool: String,
    /// The demand: requests per second as they arrived at the gateways
    /// (those refused for capacity included; before gateways counted
    /// arrivals, those that got their first token), the interval's input
    /// and output lengths.
    pub load: Load,
    /// TTFT at the targets' percentile, milliseconds; `None` when fewer
    /// than ten requests got their first token in the interval.
    pub ttft_ms: Option<f64>,
    /// ITL at the targets' percentile, milliseconds; `None` when fewer
    /// than ten requests of two or more tokens finished in the interval.
    pub itl_ms: Option<f64>,
    /// Requests waiting when the interval ended.
    pub queue_depth: f64,
    /// KV cache in use, a fraction of the pool's total.
    pub kv_usage: f64,
    /// Replicas serving during the interval.
    pub replicas: u32,
    /// Sequences the pool's workers were running when the interval ended
    /// (0 in decisions recorded before it was kept).
    #[serde(default)]
    pub running: u32,
    /// Mean KV cache per running sequence when the interval ended, tokens
    /// (a block several sequences share counts once); 0 when none ran.
    #[serde(default)]
    pub context_tokens: f64,
    /// Requests per second that finished during the interval (the
    /// deployment's, like the request rate).
    #[serde(default)]
    pub finish_rate: f64,
    /// The mean of the requests' ITL, milliseconds; `None` where `itl_ms`
    /// is.
    #[serde(default)]
    pub itl_mean_ms: Option<f64>,
    /// The mean time between the tokens streamed during the interval (of
    /// every request, running or finished), milliseconds; `None` when
    /// fewer than ten were. It is read before any request finishes.
    #[serde(default)]
    pub token_gap_ms: Option<f64>,
    /// The mean prompt of the requests that got their first token during
    /// the interval, tokens; 0 when fewer than ten did.
    #[serde(default)]
    pub started_isl_mean: f64,
    /// Requests per second that got their first token during the interval
    /// (the deployment's): what was served, below the demand while
    /// requests queue (0 in decisions recorded before it was kept).
    #[serde(default)]
    pub served_rate: f64,
    /// Requests arrived at the gateways without a first token when the
    /// interval ended (the deployment's): routing, queued at a worker, or
    /// in prefill.
    #[serde(default)]
    pub awaiting_first_token: f64,
}

/// The load a decision sized for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The predictor that made it.
    pub predictor: Predictor,
    /// The forecast.
    pub load: Load,
}

/// Where a connector's action stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ActionState {
    /// Handed to the connector, not yet confirmed.
    Pending,
    /// The connector confirmed it.
    Done,
    /// The connector failed it; the next interval decides afresh.
    Failed,
}

impl ActionState {
    /// Its name in the ledger.
    pub fn name(self) -> &'static str {
        match self {
            ActionState::Pending => "pending",
            ActionState::Done => "done",
            ActionState::Failed => "failed",
        }
    }

    /// The state named `name` in the ledger.
    pub fn from_name(name: &str) -> Option<Self> {
        [ActionState::Pending, ActionState::Done, ActionState::Failed].into_iter().find(|state| state.name() == name)
    }
}

/// A connector's action: set a pool's replicas. Its id is derived from
/// the decision and the pool, so a planner that re-runs a decision after
/// a restart hands the connector the same id, and the connector does it
/// once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    /// `<namespace>/<decision id>/<pool>`.
    pub id: String,
    /// The pool.
    pub pool: String,
    /// Replicas asked for.
    pub replicas: u32,
    /// Where it stands.
    pub state: ActionState,
    /// The connector's message (an error's text when it failed).
    pub message: String,
}

impl Action {
    /// The id of the action of decision `decision` on `pool`.
    pub fn id_for(namespace: &str, decision: u64, pool: &str) -> String {
        format!("{namespace}/{decision}/{pool}")
    }
}

/// One pool's part of a decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDecision {
    /// The pool's name.
    pub pool: String,
    /// Replicas before.
    pub current_replicas: u32,
    /// Replicas the profile asks for, before the constraints.
    pub proposed_replicas: u32,
    /// Replicas after the constraints.
    pub desired_replicas: u32,
    /// Why, in words.
    pub reason: String,
    /// The connector's action; `None` when nothing changes.
    pub action: Option<Action>,
}

/// One interval's pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Increasing with each decision of a namespace, kept across restarts.
    pub id: u64,
    /// When it was made, milliseconds since the Unix epoch.
    pub at_unix_ms: i64,
    /// What each pool did during the interval.
    pub observed: Vec<Observation>,
    /// The forecast it sized for; `None` when nothing was observed yet.
    pub predicted: Option<Prediction>,
    /// Each pool's outcome.
    pub pools: Vec<PoolDecision>,
    /// The decision as a whole, in words.
    pub reason: String,
    /// Whether acting was paused (nothing was executed).
    pub paused: bool,
}

impl From<&Action> for pb::Action {
    fn from(action: &Action) -> Self {
        pb::Action {
            id: action.id.clone(),
            pool: action.pool.clone(),
            replicas: action.replicas,
            state: match action.state {
                ActionState::Pending => pb::ActionState::Pending,
                ActionState::Done => pb::ActionState::Done,
                ActionState::Failed => pb::ActionState::Failed,
            } as i32,
            message: action.message.clone(),
        }
    }
}

impl Action {
    /// `action` as received, `at` naming where it was in the message.
    fn from_pb(action: pb::Action, at: &str) -> Result<Self, Malformed> {
        let pb::Action { id, pool, replicas, state, message } = action;
        let state = match pb::ActionState::try_from(state) {
            Ok(pb::ActionState::Pending) => ActionState::Pending,
            Ok(pb::ActionState::Done) => ActionState::Done,
            Ok(pb::ActionState::Failed) => ActionState::Failed,
            Ok(pb::ActionState::Unspecified) | Err(_) => return Err(malformed(format!("{at}.state"), state)),
        };
        Ok(Action { id, pool, replicas, state, message })
    }
}

impl TryFrom<pb::Action> for Action {
    type Error = Malformed;

    fn try_from(action: pb::Action) -> Result<Self, Malformed> {
        Action::from_pb(action, "action")
    }
}

impl From<&Decision> for pb::Decision {
    fn from(decision: &Decision) -> Self {
        pb::Decision {
            id: decision.id,
            at_unix_ms: decision.at_unix_ms,
            observed: decision
                .observed
                .iter()
                .map(|seen| pb::PoolObservation {
                    pool: seen.pool.clone(),
                    request_rate: seen.load.request_rate,
                    isl_mean: seen.load.isl_mean,
                    osl_mean: seen.load.osl_mean,
                    ttft_ms: seen.ttft_ms.unwrap_or(0.0),
                    itl_ms: seen.itl_ms.unwrap_or(0.0),
                    queue_depth: seen.queue_depth,
                    kv_usage: seen.kv_usage,
                    replicas: seen.replicas,
                    running: seen.running,
                    context_tokens: seen.context_tokens,
                    finish_rate: seen.finish_rate,
                    itl_mean_ms: seen.itl_mean_ms.unwrap_or(0.0),
                    token_gap_ms: seen.token_gap_ms.unwrap_or(0.0),
                    started_isl_mean: seen.started_isl_mean,
                    served_rate: seen.served_rate,
                    awaiting_first_token: seen.awaiting_first_token,
                })
                .collect(),
            predicted: decision.predicted.as_ref().map(|predicted| pb::Prediction {
                predictor: predicted.predictor.name().to_owned(),
                request_rate: predicted.load.request_rate,
                isl_mean: predicted.load.isl_mean,
                osl_mean: predicted.load.osl_mean,
            }),
            pools: decision
                .pools
                .iter()
                .map(|pool| pb::PoolDecision {
                    pool: pool.pool.clone(),
                    current_replicas: pool.current_replicas,
                    proposed_replicas: pool.proposed_replicas,
                    desired_replicas: pool.desired_replicas,
                    reason: pool.reason.clone(),
                    action: pool.action.as_ref().map(pb::Action::from),
                })
                .collect(),
            reason: decision.reason.clone(),
            paused: decision.paused,
        }
    }
}

/// One pool now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolState {
    /// The pool's name.
    pub pool: String,
    /// What its workers do.
    pub kind: PoolKind,
    /// Replicas the latest decision asked for.
    pub desired_replicas: u32,
    /// Replicas serving (as last observed).
    pub actual_replicas: u32,
    /// Replicas draining.
    pub draining_replicas: u32,
}

/// The plan in force.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The targets in force; `None` before the first `SetTargets`.
    pub targets: Option<Targets>,
    /// Whether acting is paused.
    pub paused: bool,
    /// Each pool the targets list.
    pub pools: Vec<PoolState>,
    /// The latest decision.
    pub latest: Option<Decision>,
}

impl Plan {
    /// The plan `targets`, the pause switch and the latest decision make:
    /// each listed pool as that decision left it.
    pub fn new(targets: Option<Targets>, paused: bool, latest: Option<Decision>) -> Self {
        let pools = targets
            .as_ref()
            .map(Targets::pools)
            .unwrap_or_default()
            .iter()
            .map(|limits| {
                let decided = latest.as_ref().and_then(|decision| decision.pools.iter().find(|pool| pool.pool == limits.pool));
                let observed = latest.as_ref().and_then(|decision| decision.observed.iter().find(|pool| pool.pool == limits.pool));
                PoolState {
                    pool: limits.pool.clone(),
                    kind: limits.kind,
                    desired_replicas: decided.map_or(0, |pool| pool.desired_replicas),
                    actual_replicas: observed.map_or(0, |pool| pool.replicas),
                    draining_replicas: 0,
                }
            })
            .collect();
        Self { targets, paused, pools, latest }
    }
}

/// A message from a planner that does not read as the contract says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {field}: {problem}")]
pub struct Malformed {
    /// The field.
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

fn malformed(field: impl Into<String>, problem: impl std::fmt::Display) -> Malformed {
    Malformed { field: field.into(), problem: problem.to_string() }
}

fn pool_kind_from_pb(kind: i32, field: &str) -> Result<PoolKind, Malformed> {
    match pb::PoolKind::try_from(kind) {
        Ok(pb::PoolKind::Aggregated) => Ok(PoolKind::Aggregated),
        Ok(pb::PoolKind::Prefill) => Ok(PoolKind::Prefill),
        Ok(pb::PoolKind::Decode) => Ok(PoolKind::Decode),
        _ => Err(malformed(field, format!("pool kind {kind}"))),
    }
}

impl From<&Plan> for pb::Plan {
    fn from(plan: &Plan) -> Self {
        pb::Plan {
            targets: plan.targets.as_ref().map(pb::Targets::from),
            paused: plan.paused,
            pools: plan
                .pools
                .iter()
                .map(|pool| pb::PoolState {
                    pool: pool.pool.clone(),
                    kind: pool_kind_to_pb(pool.kind) as i32,
                    desired_replicas: pool.desired_replicas,
                    actual_replicas: pool.actual_replicas,
                    draining_replicas: pool.draining_replicas,
                })
                .collect(),
            latest: plan.latest.as_ref().map(pb::Decision::from),
        }
    }
}

fn pool_kind_to_pb(kind: PoolKind) -> pb::PoolKind {
    match kind {
        PoolKind::Aggregated => pb::PoolKind::Aggregated,
        PoolKind::Prefill => pb::PoolKind::Prefill,
        PoolKind::Decode => pb::PoolKind::Decode,
    }
}

impl TryFrom<pb::Plan> for Plan {
    type Error = Malformed;

    fn try_from(plan: pb::Plan) -> Result<Self, Malformed> {
        let pb::Plan { targets, paused, pools, latest } = plan;
        Ok(Plan {
            targets: targets.map(Targets::try_from).transpose().map_err(|error| malformed("plan.targets", error))?,
            paused,
            pools: pools
                .into_iter()
                .enumerate()
                .map(|(index, pool)| {
                    Ok(PoolState {
                        kind: pool_kind_from_pb(pool.kind, &format!("plan.pools[{index}].kind"))?,
                        pool: pool.pool,
                        desired_replicas: pool.desired_replicas,
                        actual_replicas: pool.actual_replicas,
                        draining_replicas: pool.draining_replicas,
                    })
                })
                .collect::<Result<_, Malformed>>()?,
            latest: latest.map(Decision::try_from).transpose()?,
        })
    }
}

impl TryFrom<pb::Decision> for Decision {
    type Error = Malformed;

    fn try_from(decision: pb::Decision) -> Result<Self, Malformed> {
        let pb::Decision { id, at_unix_ms, observed, predicted, pools, reason, paused } = decision;
        let load = |request_rate, isl_mean, osl_mean| Load { request_rate, isl_mean, osl_mean };
        Ok(Decision {
            id,
            at_unix_ms,
            observed: observed
                .into_iter()
                .map(|seen| Observation {
                    load: load(seen.request_rate, seen.isl_mean, seen.osl_mean),
                    pool: seen.pool,
                    ttft_ms: (seen.ttft_ms > 0.0).then_some(seen.ttft_ms),
                    itl_ms: (seen.itl_ms > 0.0).then_some(seen.itl_ms),
                    queue_depth: seen.queue_depth,
                    kv_usage: seen.kv_usage,
                    replicas: seen.replicas,
                    running: seen.running,
                    context_tokens: seen.context_tokens,
                    finish_rate: seen.finish_rate,
                    itl_mean_ms: (seen.itl_mean_ms > 0.0).then_some(seen.itl_mean_ms),
                    token_gap_ms: (seen.token_gap_ms > 0.0).then_some(seen.token_gap_ms),
                    started_isl_mean: seen.started_isl_mean,
                    served_rate: seen.served_rate,
                    awaiting_first_token: seen.awaiting_first_token,
                })
                .collect(),
            predicted: predicted
                .map(|predicted| {
                    Ok::<_, Malformed>(Prediction {
                        predictor: predicted.predictor.parse().map_err(|problem: String| malformed("decision.predicted.predictor", problem))?,
                        load: load(predicted.request_rate, predicted.isl_mean, predicted.osl_mean),
                    })
                })
                .transpose()?,
            pools: pools
                .into_iter()
                .enumerate()
                .map(|(index, pool)| {
                    let action = pool.action.map(|action| Action::from_pb(action, &format!("decision.pools[{index}].action"))).transpose()?;
                    Ok(PoolDecision {
                        pool: pool.pool,
                        current_replicas: pool.current_replicas,
                        proposed_replicas: pool.proposed_replicas,
                        desired_replicas: pool.desired_replicas,
                        reason: pool.reason,
                        action,
                    })
                })
                .collect::<Result<_, Malformed>>()?,
            reason,
            paused,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_recorded_before_the_sequences_in_flight_were_kept_still_reads() {
        let older = r#"{"pool":"decode","load":{"request_rate":6.5,"isl_mean":1200.0,"osl_mean":90.0},"ttft_ms":310.0,"itl_ms":null,"queue_depth":1.0,"kv_usage":0.4,"replicas":2}"#;
        let seen: Observation = serde_json::from_str(older).unwrap();
        assert_eq!(
            (seen.pool.as_str(), seen.replicas, seen.running, seen.context_tokens, seen.finish_rate, seen.itl_mean_ms),
            ("decode", 2, 0, 0.0, 0.0, None)
        );
    }
}
