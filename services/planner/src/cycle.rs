//! The planner's cycle: once per interval of the targets in force, observe
//! the deployment and keep what was seen; then forecast the next interval
//! from the kept history, propose replicas per pool from the profile,
//! constrain them, and record the decision (published to watchers). While
//! paused it decides the same way but asks for nothing. Each action is
//! handed to the planner's connector once recorded; actions left pending by
//! a stopped planner are handed over again first. A pool is compared with
//! what its connector counts serving, so a worker that exited by itself
//! (a crash) is replaced at the next interval, cool-down or not.

use std::collections::HashMap;
use std::time::Duration;

use turbine_runtime::CancellationToken;

use crate::constrain::{PoolSize, constrain};
use crate::decision::{Action, ActionState, Decision, Observation, PoolDecision, Prediction};
use crate::ledger::LedgerError;
use crate::observe::Observer;
use crate::predict::{Forecaster, Load};
use crate::profile::Profile;
use crate::propose::{Corrections, Proposal, corrections_over, decode_in_flight, propose};
use crate::service::PlannerState;
use crate::targets::{PoolKind, Predictor, Targets};

/// How often a planner without targets looks for them.
const NO_TARGETS_POLL: Duration = Duration::from_secs(1);

/// How long the planner waits after its database failed before trying
/// again.
const LEDGER_RETRY: Duration = Duration::from_secs(1);

/// Most intervals of history a forecast reads.
const MAX_HISTORY: usize = 20_000;

/// How the planner sizes: the profile and the seasonal model's season.
#[derive(Debug, Clone)]
pub struct Sizing {
    /// The workers' profile.
    pub profile: Profile,
    /// Intervals per season of the seasonal predictor.
    pub season_intervals: usize,
}

/// Runs the cycle until `shutdown` fires. A failed observation or ledger
/// write is logged and the interval skipped: nothing is decided on missing
/// data.
pub async fn run(state: PlannerState, mut observer: Observer, sizing: Sizing, shutdown: CancellationToken) {
    // Actions pending when the planner last stopped are carried out first.
    while let Err(error) = crate::connector::resume(state.ledger(), state.connector()).await {
        tracing::warn!(%error, "cannot resume the pending actions; retrying");
        if sleep_or_shutdown(LEDGER_RETRY, &shutdown).await {
            return;
        }
    }
    loop {
        let control = match state.ledger().control().await {
            Ok(control) => control,
            Err(error) => {
                tracing::warn!(%error, "cannot read the targets; retrying");
                if sleep_or_shutdown(LEDGER_RETRY, &shutdown).await {
                    return;
                }
                continue;
            }
        };
        let Some(targets) = control.targets else {
            if sleep_or_shutdown(NO_TARGETS_POLL, &shutdown).await {
                return;
            }
            continue;
        };
        match observer.observe(&targets).await {
            Ok(Some(observed)) => {
                let now = crate::service::now_unix_ms();
                let decided = async {
                    state.ledger().record_observations(now, &observed).await?;
                    let decision = decide(&state, &targets, control.paused, &sizing, observed, now).await?;
                    tracing::info!(id = decision.id, reason = decision.reason, paused = decision.paused, "decision");
                    crate::metrics::record_decision(&targets, &decision);
                    let actions: Vec<Action> = decision.pools.iter().filter_map(|pool| pool.action.clone()).collect();
                    state.record(decision).await?;
                    crate::connector::execute(state.ledger(), state.connector(), &actions).await
                };
                if let Err(error) = decided.await {
                    tracing::warn!(%error, "cannot record this interval's decision");
                }
            }
            Ok(None) => tracing::debug!("observation baseline taken"),
            Err(error) => tracing::warn!(%error, "cannot observe this interval"),
        }
        if sleep_or_shutdown(targets.interval(), &shutdown).await {
            return;
        }
    }
}

/// The forecast of the next interval from the kept history: the rate from
/// every interval, the lengths from the intervals where requests finished. A
/// seasonal model that fails falls back to the moving average (said in the
/// reason). The rate is never below the last interval's: a pool scales up
/// on the load it sees (a forecast that averages lags a ramp) and down on
/// the forecast.
fn forecast(targets: &Targets, season_intervals: usize, history: &[Load]) -> (Prediction, String) {
    let busy: Vec<&Load> = history.iter().filter(|load| load.isl_mean > 0.0 || load.osl_mean > 0.0).collect();
    let attempt = |predictor: Predictor| {
        let forecaster = Forecaster::new(predictor, season_intervals);
        let rate = forecaster.forecast(&history.iter().map(|load| load.request_rate).collect::<Vec<_>>())?;
        let length = |value: fn(&Load) -> f64| if busy.is_empty() { Ok(0.0) } else { forecaster.forecast(&busy.iter().map(|load| value(load)).collect::<Vec<_>>()) };
        Ok::<_, crate::predict::ForecastError>(Load { request_rate: rate, isl_mean: length(|load| load.isl_mean)?, osl_mean: length(|load| load.osl_mean)? })
    };
    let (mut prediction, mut words) = match attempt(targets.predictor()) {
        Ok(load) => (Prediction { predictor: targets.predictor(), load }, String::new()),
        Err(error) => {
            let load = attempt(Predictor::MovingAverage).unwrap_or(Load { request_rate: 0.0, isl_mean: 0.0, osl_mean: 0.0 });
            (Prediction { predictor: Predictor::MovingAverage, load }, format!(" ({} failed: {error}; the moving average instead)", targets.predictor().name()))
        }
    };
    if let Some(last) = history.last()
        && last.request_rate > prediction.load.request_rate
    {
        words += &format!(" (forecast {:.2} req/s, below the last interval's: that instead)", prediction.load.request_rate);
        prediction.load.request_rate = last.request_rate;
    }
    (prediction, words)
}

/// The profile's proposals for `load`. While requests come but too few
/// have finished to know their lengths (a start), each pool holds its
/// decided size rather than be sized on the first, short ones. A pool
/// that decodes (decode or aggregated) is never proposed fewer workers
/// than the sequences it will hold by the next interval need
/// (`decode_in_flight`): the forecast trails a ramp, and at a start the
/// sequences in flight are all there is to size decode on.
fn proposals(profile: &Profile, targets: &Targets, load: &Load, corrections: Corrections, current: &HashMap<String, PoolSize>, observed: &[Observation]) -> Vec<Proposal> {
    let mut proposals = if load.request_rate > 0.0 && load.isl_mean == 0.0 && load.osl_mean == 0.0 {
        targets
            .pools()
            .iter()
            .map(|limits| {
                let held = current.get(&limits.pool).map_or(limits.min_replicas, |size| size.decided);
                Proposal { pool: limits.pool.clone(), replicas: held, reason: format!("too few requests finished to know their lengths: holding {held}") }
            })
            .collect()
    } else {
        propose(profile, targets, load, corrections)
    };
    for proposal in &mut proposals {
        let decode = targets.pools().iter().any(|limits| limits.pool == proposal.pool && limits.kind != PoolKind::Prefill);
        let Some(in_flight) = observed.iter().find(|seen| decode && seen.pool == proposal.pool).and_then(|seen| decode_in_flight(profile, targets, seen, corrections)) else { continue };
        if in_flight.replicas > proposal.replicas {
            proposal.reason = format!("{}; {}: {}", proposal.reason, in_flight.reason, in_flight.replicas);
            proposal.replicas = in_flight.replicas;
        }
    }
    proposals
}

/// One interval's decision.
async fn decide(state: &PlannerState, targets: &Targets, paused: bool, sizing: &Sizing, observed: Vec<Observation>, now: i64) -> Result<Decision, LedgerError> {
    let ledger = state.ledger();
    let wanted = (4 * sizing.season_intervals).clamp(64, MAX_HISTORY);
    let intervals: Vec<Vec<Observation>> = ledger.observations(wanted).await?.into_iter().map(|(_, pools)| pools).collect();
    let history: Vec<Load> = intervals.iter().filter_map(|pools| pools.first().map(|pool| pool.load)).collect();
    let (prediction, fallback) = forecast(targets, sizing.season_intervals, &history);
    let corrections = corrections_over(&sizing.profile, targets, &intervals);
    // A pool was decided at what the latest decision asked for, unless
    // that action failed; before any decision, at what is observed. It runs
    // what the connector counts (a worker may have exited since), unless
    // an action on it is still pending or the connector cannot tell.
    let latest = ledger.latest().await?;
    let pending = ledger.pending_actions().await?;
    let mut current = HashMap::new();
    let mut last_scaled = HashMap::new();
    for limits in targets.pools() {
        let observed_replicas = observed.iter().find(|seen| seen.pool == limits.pool).map_or(0, |seen| seen.replicas);
        let decided = latest
            .as_ref()
            .and_then(|decision| decision.pools.iter().find(|pool| pool.pool == limits.pool))
            .filter(|pool| pool.action.as_ref().is_none_or(|action| action.state != ActionState::Failed))
            .map(|pool| pool.desired_replicas);
        let decided = decided.unwrap_or(observed_replicas);
        let counted = if pending.iter().any(|action| action.pool == limits.pool) { None } else { state.connector().serving(&limits.pool, limits.kind).await };
        current.insert(limits.pool.clone(), PoolSize { running: counted.unwrap_or(decided), decided });
        if let Some(at) = ledger.last_scaled(&limits.pool).await? {
            last_scaled.insert(limits.pool.clone(), at);
        }
    }
    let proposals = proposals(&sizing.profile, targets, &prediction.load, corrections, &current, &observed);
    let id = ledger.next_decision_id().await?;
    let pools = constrain(targets, &proposals, &current, &last_scaled, now)
        .into_iter()
        .map(|pool| {
            let changes = pool.desired != pool.current;
            let action = (changes && !paused).then(|| Action {
                id: Action::id_for(ledger.namespace(), id, &pool.pool),
                pool: pool.pool.clone(),
                replicas: pool.desired,
                state: ActionState::Pending,
                message: String::new(),
            });
            let reason = if changes && paused { format!("{}; paused: not acting", pool.reason) } else { pool.reason };
            PoolDecision { pool: pool.pool, current_replicas: pool.current, proposed_replicas: pool.proposed, desired_replicas: pool.desired, reason, action }
        })
        .collect();
    let load = prediction.load;
    let reason = format!(
        "forecast {:.2} req/s, ISL {:.0}, OSL {:.0} by {}{fallback}; latencies ×{:.2} (TTFT) and ×{:.2} (ITL) of the profile's; the mean ITL ×{:.2} of its percentile",
        load.request_rate,
        load.isl_mean,
        load.osl_mean,
        prediction.predictor.name(),
        corrections.ttft,
        corrections.itl,
        corrections.token_mean
    );
    Ok(Decision { id, at_unix_ms: now, observed, predicted: Some(prediction), pools, reason, paused })
}

/// Sleeps `period`; true when `shutdown` fired first.
async fn sleep_or_shutdown(period: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(period) => false,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::targets::{PoolKind, PoolLimits};

    fn targets(predictor: Predictor) -> Targets {
        let pool = PoolLimits { pool: "workers".into(), kind: PoolKind::Aggregated, min_replicas: 1, max_replicas: 8 };
        Targets::new(300.0, 20.0, 90.0, vec![pool], 8, Duration::from_secs(5), Duration::from_secs(10), predictor).unwrap()
    }

    fn rates(rates: &[f64]) -> Vec<Load> {
        rates.iter().map(|rate| Load { request_rate: *rate, isl_mean: 1000.0, osl_mean: 100.0 }).collect()
    }

    #[test]
    fn requests_without_known_lengths_hold_the_pools() {
        use crate::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint};
        let decode = vec![DecodePoint { context: 256, concurrency: 1, itl_ms: 10.0 }, DecodePoint { context: 256, concurrency: 16, itl_ms: 20.0 }];
        let prefill = vec![PrefillPoint { isl: 100, ttft_ms: 10.0 }, PrefillPoint { isl: 1000, ttft_ms: 100.0 }];
        let profile = Profile { version: PROFILE_VERSION, worker: "test".into(), prefill, decode }.check("test").unwrap();
        let current = HashMap::from([("workers".to_owned(), PoolSize { running: 5, decided: 5 })]);
        let unknown = Load { request_rate: 20.0, isl_mean: 0.0, osl_mean: 0.0 };
        let held = proposals(&profile, &targets(Predictor::Constant), &unknown, Corrections::default(), &current, &[]);
        assert_eq!((held[0].replicas, held[0].reason.as_str()), (5, "too few requests finished to know their lengths: holding 5"));
        // Known lengths: the profile's proposal.
        let known = proposals(&profile, &targets(Predictor::Constant), &Load { isl_mean: 1000.0, osl_mean: 100.0, ..unknown }, Corrections::default(), &current, &[]);
        assert!(known[0].reason.starts_with("prefill "), "{:?}", known[0]);

        // Prefill and decode pools at a start: prefill holds, decode is
        // sized for the 40 sequences it holds and the 20 a second that
        // start over the 5-second interval (none finishing): 140, at 14.5
        // per worker within 19 ms.
        let pools = [("prefill", PoolKind::Prefill), ("decode", PoolKind::Decode)]
            .map(|(pool, kind)| PoolLimits { pool: pool.into(), kind, min_replicas: 1, max_replicas: 8 })
            .to_vec();
        let split = Targets::new(300.0, 20.0, 90.0, pools, 16, Duration::from_secs(5), Duration::from_secs(10), Predictor::Constant).unwrap();
        let current = HashMap::from([("prefill".to_owned(), PoolSize { running: 2, decided: 2 }), ("decode".to_owned(), PoolSize { running: 2, decided: 2 })]);
        let seen = |pool: &str, running, finish_rate| Observation {
            pool: pool.into(),
            load: unknown,
            ttft_ms: None,
            itl_ms: None,
            queue_depth: 0.0,
            kv_usage: 0.5,
            replicas: 2,
            running,
            context_tokens: 1_200.0,
            finish_rate,
            itl_mean_ms: None,
        };
        let start = proposals(&profile, &split, &unknown, Corrections::default(), &current, &[seen("prefill", 12, 0.0), seen("decode", 40, 0.0)]);
        assert_eq!(start.iter().map(|proposal| proposal.replicas).collect::<Vec<_>>(), [2, 10], "{start:?}");
        assert!(start[1].reason.starts_with("too few requests finished to know their lengths: holding 2; decode 140 sequences by the next interval"), "{start:?}");
        assert!(start[1].reason.ends_with("(context 1200 from their KV cache): 10"), "{start:?}");
        // Fewer than the pool holds (as many finishing as starting): it holds.
        let quiet = proposals(&profile, &split, &unknown, Corrections::default(), &current, &[seen("decode", 10, 20.0)]);
        assert_eq!(quiet[1].replicas, 2, "{quiet:?}");
        // An aggregated pool at the same start (its prompts' lengths not
        // known yet): sized for its sequences as the decode pool is.
        let current = HashMap::from([("workers".to_owned(), PoolSize { running: 5, decided: 5 })]);
        let shared = proposals(&profile, &targets(Predictor::Constant), &unknown, Corrections::default(), &current, &[seen("workers", 40, 0.0)]);
        assert_eq!(shared[0].replicas, 10, "{shared:?}");
        assert!(shared[0].reason.starts_with("too few requests finished to know their lengths: holding 5; decode 140 sequences by the next interval"), "{shared:?}");
    }

    #[test]
    fn a_ramp_is_met_at_the_load_seen_and_a_fall_at_the_forecast() {
        // Rising: the average of the last five (6) lags the last interval (10).
        let (rising, words) = forecast(&targets(Predictor::MovingAverage), 4, &rates(&[2.0, 4.0, 6.0, 8.0, 10.0]));
        assert_eq!(rising.load.request_rate, 10.0);
        assert!(words.contains("forecast 6.00 req/s, below the last interval's"), "{words}");
        // Falling: the average (6) is kept, above the last interval (2).
        let (falling, words) = forecast(&targets(Predictor::MovingAverage), 4, &rates(&[10.0, 8.0, 6.0, 4.0, 2.0]));
        assert_eq!((falling.load.request_rate, words.as_str()), (6.0, ""));
        // The lengths are the predictor's either way.
        assert_eq!((rising.load.isl_mean, rising.load.osl_mean), (1000.0, 100.0));
    }
}
