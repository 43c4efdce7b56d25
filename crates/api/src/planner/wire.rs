//! The planner's words to and from `turbine.planner.v1`, both ways: the
//! client reads the planner's answers with them and the planner's gRPC
//! shell writes them. What the wire may carry but the words refuse (an
//! unset pool kind, an unknown predictor) is a [`TargetsError`] or a
//! [`Malformed`] naming the field.

use std::time::Duration;

use turbine_proto::planner::v1 as pb;

use super::targets::refuse;
use super::{
    Action, ActionState, Decision, Load, Malformed, Observation, Plan, PoolDecision, PoolKind, PoolLimits, PoolState, Prediction, Predictor, Targets,
    TargetsError, UnknownPredictor,
};

fn malformed(field: impl Into<String>, problem: impl std::fmt::Display) -> Malformed {
    Malformed { field: field.into(), problem: problem.to_string() }
}

impl TryFrom<pb::Targets> for Targets {
    type Error = TargetsError;

    fn try_from(targets: pb::Targets) -> Result<Self, TargetsError> {
        let pb::Targets { ttft_ms, itl_ms, percentile, pools, budget_workers, interval_secs, cooldown_secs, predictor } = targets;
        let pools = pools
            .into_iter()
            .enumerate()
            .map(|(index, limits)| {
                let pb::PoolLimits { pool, kind, min_replicas, max_replicas } = limits;
                let kind = match pb::PoolKind::try_from(kind) {
                    Ok(pb::PoolKind::Aggregated) => PoolKind::Aggregated,
                    Ok(pb::PoolKind::Prefill) => PoolKind::Prefill,
                    Ok(pb::PoolKind::Decode) => PoolKind::Decode,
                    Ok(pb::PoolKind::Unspecified) => return Err(refuse(format!("targets.pools[{index}].kind"), "must be set (AGGREGATED, PREFILL or DECODE)")),
                    Err(_) => return Err(refuse(format!("targets.pools[{index}].kind"), format!("unknown value {kind}"))),
                };
                Ok(PoolLimits { pool, kind, min_replicas, max_replicas })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let predictor = if predictor.is_empty() {
            Predictor::default()
        } else {
            predictor.parse().map_err(|unknown: UnknownPredictor| refuse("targets.predictor", unknown.to_string()))?
        };
        Targets::new(
            ttft_ms,
            itl_ms,
            percentile,
            pools,
            budget_workers,
            Duration::from_secs(u64::from(interval_secs)),
            Duration::from_secs(u64::from(cooldown_secs)),
            predictor,
        )
    }
}

impl From<&Targets> for pb::Targets {
    fn from(targets: &Targets) -> Self {
        pb::Targets {
            ttft_ms: targets.ttft_ms(),
            itl_ms: targets.itl_ms(),
            percentile: targets.percentile(),
            pools: targets
                .pools()
                .iter()
                .map(|PoolLimits { pool, kind, min_replicas, max_replicas }| pb::PoolLimits {
                    pool: pool.clone(),
                    kind: match kind {
                        PoolKind::Aggregated => pb::PoolKind::Aggregated,
                        PoolKind::Prefill => pb::PoolKind::Prefill,
                        PoolKind::Decode => pb::PoolKind::Decode,
                    } as i32,
                    min_replicas: *min_replicas,
                    max_replicas: *max_replicas,
                })
                .collect(),
            budget_workers: targets.budget_workers(),
            // Whole seconds: both were built from seconds.
            interval_secs: targets.interval().as_secs() as u32,
            cooldown_secs: targets.cooldown().as_secs() as u32,
            predictor: targets.predictor().name().to_owned(),
        }
    }
}

impl From<ActionState> for pb::ActionState {
    fn from(state: ActionState) -> Self {
        match state {
            ActionState::Pending => pb::ActionState::Pending,
            ActionState::Done => pb::ActionState::Done,
            ActionState::Failed => pb::ActionState::Failed,
        }
    }
}

impl From<&Action> for pb::Action {
    fn from(action: &Action) -> Self {
        pb::Action {
            id: action.id.clone(),
            pool: action.pool.clone(),
            replicas: action.replicas,
            state: pb::ActionState::from(action.state) as i32,
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
                        predictor: predicted.predictor.parse().map_err(|unknown: UnknownPredictor| malformed("decision.predicted.predictor", unknown))?,
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

    fn pool(name: &str, kind: pb::PoolKind, min: u32, max: u32) -> pb::PoolLimits {
        pb::PoolLimits { pool: name.into(), kind: kind as i32, min_replicas: min, max_replicas: max }
    }

    fn valid() -> pb::Targets {
        pb::Targets {
            ttft_ms: 500.0,
            itl_ms: 30.0,
            percentile: 90.0,
            pools: vec![pool("prefill", pb::PoolKind::Prefill, 1, 4), pool("decode", pb::PoolKind::Decode, 1, 8)],
            budget_workers: 10,
            interval_secs: 60,
            cooldown_secs: 120,
            predictor: String::new(),
        }
    }

    fn field_refused(change: impl FnOnce(&mut pb::Targets)) -> String {
        let mut targets = valid();
        change(&mut targets);
        Targets::try_from(targets).expect_err("refused").field
    }

    #[test]
    fn valid_targets_round_trip_with_the_default_predictor_filled_in() {
        let targets = Targets::try_from(valid()).unwrap();
        assert_eq!(targets.predictor(), Predictor::MovingAverage);
        assert_eq!(targets.interval(), Duration::from_secs(60));
        let wire = pb::Targets::from(&targets);
        assert_eq!(wire, pb::Targets { predictor: "moving-average".into(), ..valid() });
        assert_eq!(Targets::try_from(wire).unwrap(), targets);
    }

    #[test]
    fn every_bad_field_is_named() {
        assert_eq!(field_refused(|t| t.ttft_ms = -1.0), "targets.ttft_ms");
        assert_eq!(field_refused(|t| t.ttft_ms = 0.0), "targets.ttft_ms");
        assert_eq!(field_refused(|t| t.itl_ms = f64::NAN), "targets.itl_ms");
        assert_eq!(field_refused(|t| t.percentile = 0.0), "targets.percentile");
        assert_eq!(field_refused(|t| t.percentile = 100.0), "targets.percentile");
        assert_eq!(field_refused(|t| t.percentile = 150.0), "targets.percentile");
        assert_eq!(field_refused(|t| t.pools.clear()), "targets.pools");
        assert_eq!(field_refused(|t| t.pools[1].min_replicas = 9), "targets.pools[1].min_replicas");
        assert_eq!(field_refused(|t| t.pools[0].max_replicas = 0), "targets.pools[0].min_replicas");
        assert_eq!(
            field_refused(|t| {
                t.pools[0].min_replicas = 0;
                t.pools[0].max_replicas = 0;
            }),
            "targets.pools[0].max_replicas"
        );
        assert_eq!(field_refused(|t| t.pools[1].pool = String::new()), "targets.pools[1].pool");
        assert_eq!(field_refused(|t| t.pools[1].pool = "pre fill".into()), "targets.pools[1].pool");
        assert_eq!(field_refused(|t| t.pools[1].pool = "prefill".into()), "targets.pools[1].pool");
        assert_eq!(field_refused(|t| t.pools[0].kind = 0), "targets.pools[0].kind");
        assert_eq!(field_refused(|t| t.pools[0].kind = 42), "targets.pools[0].kind");
        assert_eq!(field_refused(|t| t.pools[1].kind = pb::PoolKind::Aggregated as i32), "targets.pools");
        assert_eq!(field_refused(|t| t.pools.truncate(1)), "targets.pools");
        assert_eq!(field_refused(|t| t.budget_workers = 1), "targets.budget_workers");
        assert_eq!(field_refused(|t| t.interval_secs = 0), "targets.interval_secs");
        assert_eq!(field_refused(|t| t.cooldown_secs = 100_000), "targets.cooldown_secs");
        assert_eq!(field_refused(|t| t.predictor = "crystal-ball".into()), "targets.predictor");
    }

    #[test]
    fn an_aggregated_deployment_has_one_kind_of_pool() {
        let mut targets = valid();
        targets.pools = vec![pool("workers", pb::PoolKind::Aggregated, 0, 6)];
        targets.budget_workers = 6;
        assert_eq!(Targets::try_from(targets).unwrap().pools().len(), 1);
    }

    #[test]
    fn errors_read_as_field_and_problem() {
        let mut targets = valid();
        targets.percentile = 100.0;
        assert_eq!(Targets::try_from(targets).unwrap_err().to_string(), "targets.percentile: must lie in (0, 100), got 100");
    }
}
