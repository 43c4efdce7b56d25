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

use crate::ledger::{Control, LedgerError};
use crate::observe::Observer;
use crate::plan::constrain::{PoolSize, constrain};
use crate::plan::predict::{Forecaster, Load};
use crate::plan::profile::Profile;
use crate::plan::propose::{Corrections, Proposal, backlogged, corrections_over, decode_in_flight, propose, propose_queued};
use crate::plan::{Action, ActionState, Decision, Observation, PoolDecision, Prediction};
use crate::plan::{PoolKind, Predictor, Targets};
use crate::state::PlannerState;

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

impl Sizing {
    /// Intervals of history a forecast reads.
    fn wanted(&self) -> usize {
        (4 * self.season_intervals).clamp(64, MAX_HISTORY)
    }
}

/// Runs the cycle until `shutdown` fires. A failed observation is logged
/// and the interval skipped: nothing is decided on missing data. While the
/// database is unreachable the planner goes on from what it holds in
/// memory (the targets last read, the intervals and the decision last
/// seen): it scales up on what it observes but holds every pool at least at
/// its last plan, and records those decisions, in order, once the database
/// answers again (see [`Unrecorded`]).
pub async fn run(state: PlannerState, mut observer: Observer, sizing: Sizing, shutdown: CancellationToken) {
    // Actions pending when the planner last stopped are carried out first.
    while let Err(error) = crate::act::connector::resume(state.ledger(), state.connector()).await {
        tracing::warn!(%error, "cannot resume the pending actions; retrying");
        if sleep_or_shutdown(LEDGER_RETRY, &shutdown).await {
            return;
        }
    }
    let mut control = None;
    let mut memory: Option<Past> = None;
    let mut unrecorded = Unrecorded::default();
    loop {
        let reachable = tokio::time::timeout(PROBE, state.ledger().ping()).await.is_ok_and(|answered| answered.is_ok());
        // Decisions made from memory are recorded before anything else is.
        let read = match reachable {
            true => match unrecorded.record(&state).await {
                Ok(()) => state.ledger().control().await.map(Some),
                Err(error) => Err(error),
            },
            false => Ok(None),
        };
        let online = match read {
            Ok(Some(read)) => {
                control = Some(read);
                true
            }
            Ok(None) => false,
            Err(error) => {
                tracing::warn!(%error, "the database failed; going on from memory");
                false
            }
        };
        let Some(Control { targets: Some(targets), paused, .. }) = control.clone() else {
            let wait = if online { NO_TARGETS_POLL } else { LEDGER_RETRY };
            if control.is_none() {
                tracing::warn!("cannot read the targets; retrying");
            }
            if sleep_or_shutdown(wait, &shutdown).await {
                return;
            }
            continue;
        };
        match observer.observe(&targets).await {
            Ok(Some(observed)) => {
                let now = state.ledger().clock().now_unix_ms();
                let recorded = if online { decide_and_record(&state, &targets, paused, &sizing, &observed, now, &mut memory).await } else { Err(None) };
                match recorded {
                    Ok(()) => {}
                    Err(failure) => {
                        if let Some(error) = failure {
                            tracing::warn!(%error, "cannot record this interval's decision; deciding from memory");
                        }
                        match memory.as_mut() {
                            Some(past) if !unrecorded.full() => {
                                let decision = decide_unrecorded(&state, &targets, paused, &sizing, past, observed.clone(), now).await;
                                tracing::info!(id = decision.id, reason = decision.reason, paused = decision.paused, "decision (the database unreachable)");
                                crate::metrics::record_decision(&targets, &decision);
                                past.advance(observed.clone(), &decision, sizing.wanted());
                                unrecorded.push(now, observed, decision);
                            }
                            Some(_) => {
                                tracing::warn!(held = unrecorded.len(), "the database unreachable and as many decisions held as are kept: holding the plan")
                            }
                            None => tracing::warn!("the database unreachable before any decision: holding"),
                        }
                    }
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

/// One interval on a reachable database: records what was observed,
/// decides from the ledger, records the decision and hands its actions to
/// the connector, keeping what the decision read, with it, in `memory`.
/// The error while the decision is still unrecorded (the caller then
/// decides from memory).
#[allow(clippy::too_many_arguments)]
async fn decide_and_record(
    state: &PlannerState,
    targets: &Targets,
    paused: bool,
    sizing: &Sizing,
    observed: &[Observation],
    now: i64,
    memory: &mut Option<Past>,
) -> Result<(), Option<LedgerError>> {
    let ledger = state.ledger();
    ledger.record_observations(now, observed).await?;
    let mut past = Past::read(ledger, targets, sizing.wanted()).await?;
    let decision = decide(state, targets, paused, sizing, &past, observed.to_vec(), now, false).await;
    tracing::info!(id = decision.id, reason = decision.reason, paused = decision.paused, "decision");
    crate::metrics::record_decision(targets, &decision);
    let actions: Vec<Action> = decision.pools.iter().filter_map(|pool| pool.action.clone()).collect();
    if let Err(error) = state.record(decision.clone()).await {
        // The interval read back is this one (recorded above), which the
        // decision from memory adds itself; the write may have reached the
        // database after all, so that decision takes the next id.
        past.intervals.pop();
        past.next_id += 1;
        *memory = Some(past);
        return Err(Some(error));
    }
    // Recorded: the intervals the decision read already hold this one's.
    past.advance(Vec::new(), &decision, sizing.wanted());
    if let Err(error) = crate::act::connector::execute(ledger, state.connector(), &actions).await {
        tracing::warn!(%error, "cannot record how this interval's actions ended");
    }
    past.pending = Vec::new();
    *memory = Some(past);
    Ok(())
}

/// Most decisions made while the database is unreachable that are kept
/// for it (at a 30-second interval, eight hours); beyond them the planner
/// holds its plan.
const MAX_UNRECORDED: usize = 1000;

/// How long the planner waits for its database to answer before it
/// decides from memory.
const PROBE: Duration = Duration::from_secs(1);

/// Decisions made, and intervals observed, while the database was
/// unreachable, oldest first, until they are recorded.
#[derive(Debug, Default)]
struct Unrecorded(std::collections::VecDeque<(i64, Vec<Observation>, Decision)>);

impl Unrecorded {
    fn full(&self) -> bool {
        self.0.len() >= MAX_UNRECORDED
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn push(&mut self, at_unix_ms: i64, observed: Vec<Observation>, decision: Decision) {
        self.0.push_back((at_unix_ms, observed, decision));
    }

    /// Records each, oldest first (publishing the decisions to watchers);
    /// an action recorded supersedes the older ones still pending on its
    /// pool. Stops at the first failure, keeping what is left.
    async fn record(&mut self, state: &PlannerState) -> Result<(), LedgerError> {
        let ledger = state.ledger();
        while let Some((at, observed, decision)) = self.0.front() {
            ledger.record_observations(*at, observed).await?;
            let pending = ledger.pending_actions().await?;
            let actions: Vec<Action> = decision.pools.iter().filter_map(|pool| pool.action.clone()).collect();
            state.record_late(decision.clone()).await?;
            for action in &actions {
                crate::act::connector::supersede(ledger, &pending, action).await?;
            }
            tracing::info!(id = decision.id, "a decision made while the database was unreachable is recorded");
            self.0.pop_front();
        }
        Ok(())
    }
}

/// What a decision reads of the past: read from the ledger at each
/// interval, and carried on in memory while the database is unreachable.
#[derive(Debug, Clone, Default)]
struct Past {
    /// The newest intervals observed, oldest first.
    intervals: Vec<Vec<Observation>>,
    /// The newest decision.
    latest: Option<Decision>,
    /// Actions not yet carried out.
    pending: Vec<Action>,
    /// When each pool was last scaled (ms since the epoch).
    last_scaled: HashMap<String, i64>,
    /// The id the next decision takes.
    next_id: u64,
}

impl Past {
    async fn read(ledger: &crate::ledger::Ledger, targets: &Targets, wanted: usize) -> Result<Self, LedgerError> {
        let intervals = ledger.observations(wanted).await?.into_iter().map(|(_, pools)| pools).collect();
        let mut last_scaled = HashMap::new();
        for limits in targets.pools() {
            if let Some(at) = ledger.last_scaled(&limits.pool).await? {
                last_scaled.insert(limits.pool.clone(), at);
            }
        }
        Ok(Self { intervals, latest: ledger.latest().await?, pending: ledger.pending_actions().await?, last_scaled, next_id: ledger.next_decision_id().await? })
    }

    /// The past once `decision` was made on `observed` (empty when the
    /// intervals already hold them).
    fn advance(&mut self, observed: Vec<Observation>, decision: &Decision, wanted: usize) {
        if !observed.is_empty() {
            self.intervals.push(observed);
            let over = self.intervals.len().saturating_sub(wanted);
            self.intervals.drain(..over);
        }
        for action in decision.pools.iter().filter_map(|pool| pool.action.as_ref()).filter(|action| action.state != ActionState::Failed) {
            self.last_scaled.insert(action.pool.clone(), decision.at_unix_ms);
        }
        self.next_id = decision.id + 1;
        self.latest = Some(decision.clone());
    }
}

/// One interval's decision while the database is unreachable, from
/// `past`: a pool is never proposed below its last plan (a scale-down
/// waits until it can be recorded), and each action is carried out at once,
/// its outcome kept in the decision.
async fn decide_unrecorded(
    state: &PlannerState,
    targets: &Targets,
    paused: bool,
    sizing: &Sizing,
    past: &Past,
    observed: Vec<Observation>,
    now: i64,
) -> Decision {
    let mut past = past.clone();
    past.intervals.push(observed.clone());
    // Nothing is pending: actions from memory are carried out as decided.
    past.pending.clear();
    let mut decision = decide(state, targets, paused, sizing, &past, observed, now, true).await;
    for pool in &mut decision.pools {
        let kind = targets.pools().iter().find(|limits| limits.pool == pool.pool).map_or(PoolKind::Aggregated, |limits| limits.kind);
        if let Some(action) = pool.action.as_mut() {
            crate::act::connector::execute_unrecorded(state.connector(), action, kind).await;
        }
    }
    decision.reason += "; decided while the database was unreachable (scale-ups only), recorded once it answered";
    decision
}

/// The rate of the next interval where the last one rose from the one
/// before by more than chance: the rise carried one interval forward.
/// Each decision serves the interval after the one it saw, and a
/// request runs on into the interval after it arrived, so on a ramp a
/// fleet sized for the last interval is an interval behind. Chance is
/// the noise of two intervals' request counts (Poisson: the square root
/// of their sum): a flat load rises past it in about one interval of
/// six, a ramp's first steps do (6.0 to 9.0 requests a second over 3 s
/// intervals is 1.3 times it).
fn carried_rise(targets: &Targets, history: &[Load]) -> Option<f64> {
    let [.., before, last] = history else { return None };
    let secs = targets.interval().as_secs_f64();
    let rise = last.request_rate - before.request_rate;
    let noise = ((last.request_rate + before.request_rate) * secs).sqrt() / secs;
    (secs > 0.0 && rise > 0.0 && rise > noise).then_some(last.request_rate + rise)
}

/// The forecast of the next interval from the kept history: the rate from
/// every interval, the lengths from the intervals where requests finished. A
/// seasonal model that fails falls back to the moving average (said in the
/// reason). The rate is never below the last interval's: a pool scales up
/// on the load it sees (a forecast that averages lags a ramp) and down on
/// the forecast; a rise past chance is carried forward
/// ([`carried_rise`]).
fn forecast(targets: &Targets, season_intervals: usize, history: &[Load]) -> (Prediction, String) {
    let busy: Vec<&Load> = history.iter().filter(|load| load.isl_mean > 0.0 || load.osl_mean > 0.0).collect();
    let attempt = |predictor: Predictor| {
        let forecaster = Forecaster::new(predictor, season_intervals);
        let rate = forecaster.forecast(&history.iter().map(|load| load.request_rate).collect::<Vec<_>>())?;
        let length =
            |value: fn(&Load) -> f64| if busy.is_empty() { Ok(0.0) } else { forecaster.forecast(&busy.iter().map(|load| value(load)).collect::<Vec<_>>()) };
        Ok::<_, crate::plan::predict::ForecastError>(Load {
            request_rate: rate,
            isl_mean: length(|load| load.isl_mean)?,
            osl_mean: length(|load| load.osl_mean)?,
        })
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
    if let Some(rising) = carried_rise(targets, history)
        && rising > prediction.load.request_rate
    {
        words += &format!(" (forecast {:.2} req/s; the last rise, past chance, carried forward: {rising:.2})", prediction.load.request_rate);
        prediction.load.request_rate = rising;
    }
    (prediction, words)
}

/// The profile's proposals for `load`. While requests come but too few
/// have finished to know their lengths (a start), each pool holds its
/// decided size rather than be sized on the first, short ones. A pool
/// that decodes (decode or aggregated) is never proposed fewer workers
/// than the sequences it will hold by the next interval need
/// (`decode_in_flight`): the forecast trails a ramp, and at a start the
/// sequences in flight are all there is to size decode on. A scale-down
/// is sized for the longer of the mean prompt forecast and that of the
/// requests that got their first token in the last interval
/// ([`scale_down_at_prompts_started`]).
fn proposals(
    profile: &Profile,
    targets: &Targets,
    load: &Load,
    corrections: Corrections,
    current: &HashMap<String, PoolSize>,
    observed: &[Observation],
    rising: Option<f64>,
) -> Vec<Proposal> {
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
        let queued = |pool: &str| observed.iter().find(|seen| seen.pool == pool).map_or(0.0, |seen| seen.queue_depth);
        let mut proposed = propose_queued(profile, targets, load, corrections, &queued);
        scale_down_at_prompts_started(profile, targets, load, corrections, current, observed, &mut proposed);
        proposed
    };
    for proposal in &mut proposals {
        let decode = targets.pools().iter().any(|limits| limits.pool == proposal.pool && limits.kind != PoolKind::Prefill);
        // On a rise past chance, requests start at the rate carried forward.
        let starting = |seen: &Observation| {
            let mut seen = seen.clone();
            seen.load.request_rate = seen.load.request_rate.max(rising.unwrap_or(0.0));
            seen
        };
        let Some(in_flight) =
            observed.iter().find(|seen| decode && seen.pool == proposal.pool).and_then(|seen| decode_in_flight(profile, targets, &starting(seen), corrections))
        else {
            continue;
        };
        if in_flight.replicas > proposal.replicas {
            proposal.reason = format!("{}; {}: {}", proposal.reason, in_flight.reason, in_flight.replicas);
            proposal.replicas = in_flight.replicas;
        }
    }
    for proposal in &mut proposals {
        let Some(seen) = observed.iter().find(|seen| seen.pool == proposal.pool) else { continue };
        let decided = current.get(&proposal.pool).map_or(seen.replicas, |size| size.decided);
        queued_requests(targets, seen, decided, proposal);
    }
    proposals
}

/// Requests queued at a pool's workers (at least one a worker: a request
/// or two waiting for a step's token budget is not a backlog) are demand
/// served late. Where the pool also missed a latency target, the profile's sizing is wrong for
/// these workers, whatever it says: the pool grows by at least one worker,
/// and to as many as seat every sequence running and queued at what each
/// worker runs now (a worker with a queue seats no more: the backlog over
/// the sequences running, in proportion). While so backlogged the pool
/// does not shrink: it shrinks only when the forecast allows and no more
/// than a step's wait is queued.
fn queued_requests(targets: &Targets, seen: &Observation, decided: u32, proposal: &mut Proposal) {
    if !backlogged(seen) {
        return;
    }
    // The latency a pool's queue delays: a prompt's first token (prefill),
    // the tokens after it (decode), or both.
    let kind = targets.pools().iter().find(|limits| limits.pool == seen.pool).map_or(PoolKind::Aggregated, |limits| limits.kind);
    let missed: Vec<String> =
        [("TTFT", seen.ttft_ms, targets.ttft_ms(), kind != PoolKind::Decode), ("ITL", seen.itl_ms, targets.itl_ms(), kind != PoolKind::Prefill)]
            .into_iter()
            .filter(|(_, _, _, delays)| *delays)
            .map(|(name, observed, target, _)| (name, observed, target))
            .filter_map(|(name, observed, target)| {
                observed.filter(|observed| *observed > target).map(|observed| format!("{name} {observed:.0} ms over {target:.0} ms"))
            })
            .collect();
    if !missed.is_empty() {
        let step = decided + 1;
        let seated = if seen.running > 0 && seen.replicas > 0 {
            let each = f64::from(seen.running) / f64::from(seen.replicas);
            ((f64::from(seen.running) + seen.queue_depth) / each - 1e-9).ceil() as u32
        } else {
            step
        };
        let wanted = step.max(seated);
        if wanted > proposal.replicas {
            proposal.reason = format!(
                "{}; {} with {:.0} queued ({} running on {} workers): grown to seat them all, at least one more: {wanted}",
                proposal.reason,
                missed.join(", "),
                seen.queue_depth,
                seen.running,
                seen.replicas
            );
            proposal.replicas = wanted;
        }
    }
    if proposal.replicas < decided {
        proposal.reason = format!("{}; {:.0} queued: held at {decided} until the queue is empty", proposal.reason, seen.queue_depth);
        proposal.replicas = decided;
    }
}

/// A pool proposed fewer workers than it was decided at keeps as many as
/// the prompts started in the last interval need, where those are longer
/// than the forecast's mean (read from requests finished, which started an
/// interval or two before): the sequences the next interval decodes are
/// the ones starting now, and a pool shrunk under a run of longer prompts
/// misses the interval after. Scale-ups stay on the forecast: sizing every
/// interval for the longer of two noisy means costs workers (measured:
/// docs/benchmarks.md, "A scale-down sized at the prompts started").
fn scale_down_at_prompts_started(
    profile: &Profile,
    targets: &Targets,
    load: &Load,
    corrections: Corrections,
    current: &HashMap<String, PoolSize>,
    observed: &[Observation],
    proposed: &mut [Proposal],
) {
    let Some(started) = observed.iter().map(|seen| seen.started_isl_mean).find(|isl| *isl > load.isl_mean && load.isl_mean > 0.0) else { return };
    let longer = propose(profile, targets, &Load { isl_mean: started, ..*load }, corrections);
    for proposal in proposed {
        let Some(decided) = current.get(&proposal.pool).map(|size| size.decided) else { continue };
        let Some(needed) = longer.iter().find(|other| other.pool == proposal.pool).map(|other| other.replicas.min(decided)) else { continue };
        if proposal.replicas < decided && needed > proposal.replicas {
            proposal.reason = format!(
                "{}; a scale-down sized at the prompts started in the last interval (ISL {started:.0}, over {:.0}): {needed}",
                proposal.reason, load.isl_mean
            );
            proposal.replicas = needed;
        }
    }
}

/// One interval's decision from `past`. `unrecorded`: the database is
/// unreachable, and a pool is held at least at what was last decided.
#[allow(clippy::too_many_arguments)]
async fn decide(
    state: &PlannerState,
    targets: &Targets,
    paused: bool,
    sizing: &Sizing,
    past: &Past,
    observed: Vec<Observation>,
    now: i64,
    unrecorded: bool,
) -> Decision {
    let intervals = &past.intervals;
    let history: Vec<Load> = intervals.iter().filter_map(|pools| pools.first().map(|pool| pool.load)).collect();
    let (prediction, fallback) = forecast(targets, sizing.season_intervals, &history);
    let corrections = corrections_over(&sizing.profile, targets, intervals);
    // A pool was decided at what the latest decision asked for, unless
    // that action failed; before any decision, at what is observed. It runs
    // what the connector counts (a worker may have exited since), unless
    // an action on it is still pending or the connector cannot tell.
    let mut current = HashMap::new();
    for limits in targets.pools() {
        let observed_replicas = observed.iter().find(|seen| seen.pool == limits.pool).map_or(0, |seen| seen.replicas);
        let decided = past
            .latest
            .as_ref()
            .and_then(|decision| decision.pools.iter().find(|pool| pool.pool == limits.pool))
            .filter(|pool| pool.action.as_ref().is_none_or(|action| action.state != ActionState::Failed))
            .map(|pool| pool.desired_replicas);
        let decided = decided.unwrap_or(observed_replicas);
        let counted =
            if past.pending.iter().any(|action| action.pool == limits.pool) { None } else { state.connector().serving(&limits.pool, limits.kind).await };
        current.insert(limits.pool.clone(), PoolSize { running: counted.unwrap_or(decided), decided });
    }
    let proposals = proposals(&sizing.profile, targets, &prediction.load, corrections, &current, &observed, carried_rise(targets, &history));
    let id = past.next_id;
    let pools = constrain(targets, &proposals, &current, &past.last_scaled, now)
        .into_iter()
        .map(|mut pool| {
            let decided = current.get(&pool.pool).map_or(0, |size| size.decided);
            if unrecorded && pool.desired < decided {
                pool.reason += &format!("; holding {decided}, the last plan: a scale-down waits until the database can record it");
                pool.desired = decided;
            }
            let changes = pool.desired != pool.current;
            let action = (changes && !paused).then(|| Action {
                id: Action::id_for(state.ledger().namespace(), id, &pool.pool),
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
    let seats = corrections.seats.map_or_else(String::new, |seats| format!("; a worker seats {seats:.1} sequences (seen while requests queued)"));
    let reason = format!(
        "forecast {:.2} req/s, ISL {:.0}, OSL {:.0} by {}{fallback}; latencies ×{:.2} (TTFT) and ×{:.2} (ITL) of the profile's; the mean ITL ×{:.2} of its percentile{seats}",
        load.request_rate,
        load.isl_mean,
        load.osl_mean,
        prediction.predictor.name(),
        corrections.ttft,
        corrections.itl,
        corrections.token_mean
    );
    Decision { id, at_unix_ms: now, observed, predicted: Some(prediction), pools, reason, paused }
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
    use crate::plan::{PoolKind, PoolLimits};

    /// TTFT 10 ms at 100 tokens and 100 ms at 1,000; ITL 10 ms alone and
    /// 20 ms at 16 sequences.
    fn profile() -> Profile {
        use crate::plan::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint};
        let decode = vec![DecodePoint { context: 256, concurrency: 1, itl_ms: 10.0 }, DecodePoint { context: 256, concurrency: 16, itl_ms: 20.0 }];
        let prefill = vec![PrefillPoint { isl: 100, ttft_ms: 10.0 }, PrefillPoint { isl: 1000, ttft_ms: 100.0 }];
        Profile { version: PROFILE_VERSION, worker: "test".into(), prefill, decode }.check("test").unwrap()
    }

    fn targets(predictor: Predictor) -> Targets {
        let pool = PoolLimits { pool: "workers".into(), kind: PoolKind::Aggregated, min_replicas: 1, max_replicas: 8 };
        Targets::new(300.0, 20.0, 90.0, vec![pool], 8, Duration::from_secs(5), Duration::from_secs(10), predictor).unwrap()
    }

    fn rates(rates: &[f64]) -> Vec<Load> {
        rates.iter().map(|rate| Load { request_rate: *rate, isl_mean: 1000.0, osl_mean: 100.0 }).collect()
    }

    #[tokio::test]
    async fn from_memory_a_pool_scales_up_but_is_never_proposed_below_its_last_plan() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = crate::ledger::Ledger::open(&format!("sqlite:{}", dir.path().join("planner.sqlite").display()), "test").await.unwrap();
        // The virtual connector counts nothing: a pool runs what was decided.
        let state = PlannerState::new(ledger);
        let profile = profile();
        let sizing = Sizing { profile, season_intervals: 4 };
        let targets = targets(Predictor::Constant);
        let pool = |desired| PoolDecision {
            pool: "workers".into(),
            current_replicas: desired,
            proposed_replicas: desired,
            desired_replicas: desired,
            reason: String::new(),
            action: None,
        };
        let last = Decision { id: 6, at_unix_ms: 1_000, observed: Vec::new(), predicted: None, pools: vec![pool(5)], reason: String::new(), paused: false };
        let past = Past { latest: Some(last), next_id: 7, ..Past::default() };
        let seen = |request_rate| Observation {
            pool: "workers".into(),
            load: Load { request_rate, isl_mean: 500.0, osl_mean: 50.0 },
            ttft_ms: None,
            itl_ms: None,
            queue_depth: 0.0,
            kv_usage: 0.1,
            replicas: 5,
            running: 0,
            context_tokens: 0.0,
            finish_rate: request_rate,
            itl_mean_ms: None,
            token_gap_ms: None,
            started_isl_mean: 0.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };

        // A quiet interval: from the ledger the pool would shrink; from
        // memory it holds its last plan and asks for nothing.
        let quiet = vec![seen(0.5)];
        let online = decide(&state, &targets, false, &sizing, &past, quiet.clone(), 2_000, false).await;
        assert!(online.pools[0].desired_replicas < 5, "{online:?}");
        let held = decide_unrecorded(&state, &targets, false, &sizing, &past, quiet, 2_000).await;
        assert_eq!((held.id, held.pools[0].desired_replicas, held.pools[0].action.is_none()), (7, 5, true), "{held:?}");
        assert!(held.pools[0].reason.ends_with("; holding 5, the last plan: a scale-down waits until the database can record it"), "{held:?}");
        assert!(held.reason.ends_with("decided while the database was unreachable (scale-ups only), recorded once it answered"), "{held:?}");

        // A busy one: it scales up at once, the action carried out (here
        // published, to be reported) under the next decision id.
        let busy = decide_unrecorded(&state, &targets, false, &sizing, &past, vec![seen(40.0)], 2_000).await;
        assert!(busy.pools[0].desired_replicas > 5, "{busy:?}");
        let action = busy.pools[0].action.clone().expect("a scale-up");
        assert_eq!((action.id.as_str(), action.state, action.replicas), ("test/7/workers", ActionState::Pending, busy.pools[0].desired_replicas));
        assert!(action.message.starts_with("published: set workers to"), "{action:?}");

        // Memory moves on: the next decision id, the interval kept, the
        // pool scaled now (for the cool-down), at most `wanted` intervals.
        let mut moved = past.clone();
        moved.advance(vec![seen(40.0)], &busy, 1);
        moved.advance(vec![seen(41.0)], &busy, 1);
        assert_eq!((moved.next_id, moved.intervals.len(), moved.last_scaled.get("workers")), (8, 1, Some(&2_000)));
        assert_eq!(moved.intervals[0][0].load.request_rate, 41.0);
        assert_eq!(moved.latest.as_ref().map(|decision| decision.id), Some(7));
        // Paused: decided the same way, nothing asked for.
        let paused = decide_unrecorded(&state, &targets, true, &sizing, &past, vec![seen(40.0)], 2_000).await;
        assert!(paused.pools[0].action.is_none() && paused.pools[0].reason.contains("paused: not acting"), "{paused:?}");
    }

    #[test]
    fn a_scale_down_is_sized_at_the_prompts_started_when_they_are_longer() {
        let profile = profile();
        let targets = targets(Predictor::Constant);
        let load = Load { request_rate: 10.0, isl_mean: 500.0, osl_mean: 50.0 };
        let at = |isl_mean| propose(&profile, &targets, &Load { isl_mean, ..load }, Corrections::default())[0].replicas;
        let (forecast, longer) = (at(500.0), at(3_000.0));
        assert!(longer >= forecast + 2, "{forecast} {longer}");
        let seen = |started_isl_mean| Observation {
            pool: "workers".into(),
            load,
            ttft_ms: None,
            itl_ms: None,
            queue_depth: 0.0,
            kv_usage: 0.1,
            replicas: 2,
            running: 0,
            context_tokens: 0.0,
            finish_rate: 10.0,
            itl_mean_ms: None,
            token_gap_ms: None,
            started_isl_mean,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        let decided = |decided| HashMap::from([("workers".to_owned(), PoolSize { running: decided, decided })]);
        let proposed =
            |current: u32, started: f64| proposals(&profile, &targets, &load, Corrections::default(), &decided(current), &[seen(started)], None).remove(0);
        // From above what the longer prompts need: down to what they need.
        let down = proposed(longer + 2, 3_000.0);
        assert_eq!(down.replicas, longer, "{down:?}");
        assert!(down.reason.ends_with(&format!("; a scale-down sized at the prompts started in the last interval (ISL 3000, over 500): {longer}")), "{down:?}");
        // From between: held where it is.
        assert_eq!(proposed(forecast + 1, 3_000.0).replicas, forecast + 1);
        // No scale-down (a scale-up or the same size): the forecast's.
        assert_eq!(proposed(forecast, 3_000.0).replicas, forecast);
        assert_eq!(proposed(1, 3_000.0).replicas, forecast);
        // Shorter prompts started, or too few to say: the forecast's.
        assert_eq!(proposed(longer + 2, 300.0).replicas, forecast);
        assert_eq!(proposed(longer + 2, 0.0).replicas, forecast);
    }

    /// The saturated fleet an operator met (issue #51): one worker of
    /// eight allowed, running the 4 sequences its `--max-num-seqs` seats,
    /// 20 queued behind them, the TTFT percentile at 2,845 ms against 300.
    /// The profile knows no seat limit and would keep a worker or two.
    #[test]
    fn a_queue_with_a_missed_target_grows_the_pool_to_seat_it() {
        let profile = profile();
        let targets = targets(Predictor::Constant);
        let load = Load { request_rate: 8.0, isl_mean: 100.0, osl_mean: 100.0 };
        let seen = |queue_depth: f64, ttft_ms, replicas, running| Observation {
            pool: "workers".into(),
            load,
            ttft_ms: Some(ttft_ms),
            itl_ms: Some(15.0),
            queue_depth,
            kv_usage: 0.1,
            replicas,
            running,
            context_tokens: 150.0,
            finish_rate: 8.0,
            itl_mean_ms: Some(12.0),
            token_gap_ms: None,
            started_isl_mean: 100.0,
            served_rate: 8.0,
            awaiting_first_token: queue_depth + f64::from(running),
        };
        let decided = |decided| HashMap::from([("workers".to_owned(), PoolSize { running: decided, decided })]);
        let proposed =
            |seen: Observation, current: u32| proposals(&profile, &targets, &load, Corrections::default(), &decided(current), &[seen], None).remove(0);
        let forecast = propose(&profile, &targets, &load, Corrections::default())[0].replicas;
        assert!(forecast <= 2, "the forecast alone: {forecast}");

        // Queued and missed: seat all 24 at the 4 a worker runs: 6.
        let saturated = seen(20.0, 2_845.0, 1, 4);
        let grown = proposed(saturated.clone(), 1);
        assert_eq!(grown.replicas, 6, "{grown:?}");
        assert!(
            grown.reason.contains("; TTFT 2845 ms over 300 ms with 20 queued (4 running on 1 workers): grown to seat them all, at least one more: 6"),
            "{grown:?}"
        );
        // Two workers already, two queued, a miss: at least one more.
        assert_eq!(proposed(seen(2.0, 400.0, 2, 8), 2).replicas, 3);
        // A request waiting a step on each of few workers is no backlog.
        assert!(!proposed(seen(1.0, 400.0, 2, 8), 2).reason.contains("grown to seat"));

        // The same queue within the targets: the queue is still work (its
        // prompts within the TTFT target, seats for its sequences).
        let within = proposed(seen(20.0, 250.0, 1, 4), 1);
        assert!(within.replicas > forecast && within.reason.contains("; 20 queued: "), "{within:?}");
        assert!(!within.reason.contains("over 300 ms"), "{within:?}");

        // A queue holds a pool that the forecast would shrink.
        let held = proposed(seen(8.0, 250.0, 6, 24), 6);
        assert_eq!(held.replicas, 6, "{held:?}");
        assert!(held.reason.ends_with("; 8 queued: held at 6 until the queue is empty"), "{held:?}");
        // Without a queue, or with a request waiting a step, it shrinks.
        assert!(proposed(seen(0.0, 250.0, 6, 24), 6).replicas < 6);
        assert!(proposed(seen(3.0, 250.0, 6, 24), 6).replicas < 6);

        // The seats seen while requests queued and the target was missed
        // are learned (4 a worker), and size the forecast once the queue
        // has drained; a queue within the targets teaches nothing.
        let learned = corrections_over(&profile, &targets, &[vec![saturated], vec![seen(0.0, 250.0, 6, 30)], vec![seen(12.0, 250.0, 6, 12)]]);
        assert_eq!(learned.seats, Some(4.0));
        let seated = propose(&profile, &targets, &load, Corrections { seats: learned.seats, ..Corrections::default() })[0].replicas;
        assert!(seated > forecast, "{seated} workers at 4 seats each, {forecast} without");
    }

    #[test]
    fn requests_without_known_lengths_hold_the_pools() {
        let profile = profile();
        let current = HashMap::from([("workers".to_owned(), PoolSize { running: 5, decided: 5 })]);
        let unknown = Load { request_rate: 20.0, isl_mean: 0.0, osl_mean: 0.0 };
        let held = proposals(&profile, &targets(Predictor::Constant), &unknown, Corrections::default(), &current, &[], None);
        assert_eq!((held[0].replicas, held[0].reason.as_str()), (5, "too few requests finished to know their lengths: holding 5"));
        // Known lengths: the profile's proposal.
        let known = proposals(
            &profile,
            &targets(Predictor::Constant),
            &Load { isl_mean: 1000.0, osl_mean: 100.0, ..unknown },
            Corrections::default(),
            &current,
            &[],
            None,
        );
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
            token_gap_ms: None,
            started_isl_mean: 0.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        let start = proposals(&profile, &split, &unknown, Corrections::default(), &current, &[seen("prefill", 12, 0.0), seen("decode", 40, 0.0)], None);
        assert_eq!(start.iter().map(|proposal| proposal.replicas).collect::<Vec<_>>(), [2, 10], "{start:?}");
        assert!(
            start[1].reason.starts_with("too few requests finished to know their lengths: holding 2; decode 140 sequences by the next interval"),
            "{start:?}"
        );
        assert!(start[1].reason.ends_with("(context 1200 from their KV cache): 10"), "{start:?}");
        // A rise past chance carried forward (30 a second): the requests
        // start at that rate, 190 sequences by the next interval.
        let ramp = proposals(&profile, &split, &unknown, Corrections::default(), &current, &[seen("prefill", 12, 0.0), seen("decode", 40, 0.0)], Some(30.0));
        assert!(ramp[1].reason.contains("decode 190 sequences by the next interval (40 in flight, 30.00 starting and 0.00 finishing a second)"), "{ramp:?}");
        assert!(ramp[1].replicas > start[1].replicas, "{ramp:?}");
        // Fewer than the pool holds (as many finishing as starting): it holds.
        let quiet = proposals(&profile, &split, &unknown, Corrections::default(), &current, &[seen("decode", 10, 20.0)], None);
        assert_eq!(quiet[1].replicas, 2, "{quiet:?}");
        // An aggregated pool at the same start (its prompts' lengths not
        // known yet): sized for its sequences as the decode pool is.
        let current = HashMap::from([("workers".to_owned(), PoolSize { running: 5, decided: 5 })]);
        let shared = proposals(&profile, &targets(Predictor::Constant), &unknown, Corrections::default(), &current, &[seen("workers", 40, 0.0)], None);
        assert_eq!(shared[0].replicas, 10, "{shared:?}");
        assert!(
            shared[0].reason.starts_with("too few requests finished to know their lengths: holding 5; decode 140 sequences by the next interval"),
            "{shared:?}"
        );
    }

    #[test]
    fn a_ramp_is_met_at_the_load_seen_and_a_fall_at_the_forecast() {
        // Rising: the average of the last five (5.8) lags the last interval
        // (9; its rise from 8 is within chance: see below).
        let (rising, words) = forecast(&targets(Predictor::MovingAverage), 4, &rates(&[2.0, 4.0, 6.0, 8.0, 9.0]));
        assert_eq!(rising.load.request_rate, 9.0);
        assert!(words.contains("forecast 5.80 req/s, below the last interval's"), "{words}");
        // Falling: the average (6) is kept, above the last interval (2).
        let (falling, words) = forecast(&targets(Predictor::MovingAverage), 4, &rates(&[10.0, 8.0, 6.0, 4.0, 2.0]));
        assert_eq!((falling.load.request_rate, words.as_str()), (6.0, ""));
        // The lengths are the predictor's either way.
        assert_eq!((rising.load.isl_mean, rising.load.osl_mean), (1000.0, 100.0));
    }

    #[test]
    fn a_rise_past_chance_is_carried_one_interval_forward() {
        // 5-second intervals. From 6 to 9 a second: 30 and 45 requests, a
        // rise of 15 against a noise of √75 ≈ 8.7: 12 a second next.
        let constant = targets(Predictor::Constant);
        assert_eq!(carried_rise(&constant, &rates(&[6.0, 9.0])), Some(12.0));
        let (ramp, words) = forecast(&constant, 4, &rates(&[6.0, 9.0]));
        assert_eq!(ramp.load.request_rate, 12.0);
        assert!(words.contains("forecast 9.00 req/s; the last rise, past chance, carried forward: 12.00"), "{words}");
        // From 10 to 11: 5 more requests against a noise of √105 ≈ 10.2:
        // chance, the last interval's rate.
        assert_eq!(carried_rise(&constant, &rates(&[10.0, 11.0])), None);
        assert_eq!(forecast(&constant, 4, &rates(&[10.0, 11.0])).0.load.request_rate, 11.0);
        // A fall, or a single interval, carries nothing.
        assert_eq!(carried_rise(&constant, &rates(&[9.0, 6.0])), None);
        assert_eq!(carried_rise(&constant, &rates(&[9.0])), None);
    }
}
