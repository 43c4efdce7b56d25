//! A decision: one interval's pass of the planner (what each pool did, the
//! forecast, what each pool is asked for and why, and the connector's
//! action), as the ledger keeps it and `History`/`WatchPlan` show it.

use serde::{Deserialize, Serialize};

use super::{PoolKind, Predictor, Targets};

/// One interval's load, as the planner sizes for it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Requests per second.
    pub request_rate: f64,
    /// Mean input length, tokens.
    pub isl_mean: f64,
    /// Mean output length, tokens.
    pub osl_mean: f64,
}

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
