//! Proposing replicas per pool for a forecast load, from the profile,
//! corrected by how the deployment's latencies compare with what the
//! profile expected of it.
//!
//! - **Prefill**: a request's prompt keeps a worker busy for the profile's
//!   time to first token at that input length, so the load is
//!   `rate × ttft` workers' worth of prefill. Queueing stretches the time to
//!   first token roughly as `ttft / (1 − utilization)`, so meeting the
//!   target allows a utilization of at most `1 − ttft / target` (kept
//!   within 5% and 90%), where `ttft` is the latency the deployment shows
//!   (corrected); the work itself is the profile's.
//! - **Decode**: the profile says how many sequences a worker decodes
//!   together within the ITL target at the load's context (input plus half
//!   the output). By Little's law `rate × osl × itl` sequences decode at
//!   once; divided by that concurrency, the decode workers.
//! - **Aggregated**: prefill and decode share each worker's steps. The
//!   ITL the targets read is each request's mean time between tokens (the
//!   gateway's and the bench's), and a step that computes a prompt delays
//!   every sequence decoding in it by the prompt's time: with prefill at
//!   utilization `u`, a sequence gets a token every `step / (1 − u)`. The
//!   pool is the fewest workers where that is within the ITL target (the
//!   step at their concurrency) and prefill within the utilization the
//!   TTFT target allows (not the prefill and decode shares added, which
//!   counts the prefill time twice).
//!
//! Pools are sized for 95% of each target (`AIM`): an interval's
//! percentile varies around what the model expects of it, and a fleet
//! sized to the target itself misses it about every other interval. The
//! margin is small because a miss is answered at the next interval (the
//! cool-down holds scale-downs only). On the aggregated bench command
//! 90% took about 7% more worker-seconds (one run, 100% of intervals met;
//! 98-100% at 95%). It also carried the fleet through the database
//! outages of the restart run while the planner held its plan through them
//! (98%; 92% at 95%); scaling up from memory through the outages, the
//! planner meets that run at 95% too (98%: docs/benchmarks.md).
//!
//! Requests queued at a pool's workers are work on top of the forecast
//! (`propose_queued`): their prompts computed within the TTFT target by
//! fully busy workers, seats for their sequences. A worker never counts
//! more seats than a worker of its pool was seen to run while at least as
//! many again queued at it and a latency target was missed
//! (`Corrections::seats`, the most over the intervals kept):
//! the profile may not know the workers' `--max-num-seqs` or KV cache,
//! and a queue shows the limit.
//!
//! The corrections are the observed latency (at the targets' percentile)
//! over what the same model expects at the observed load and replicas,
//! the median of the last five intervals that observed it (×1 without an
//! observation): a deployment slower than its profile gets more workers,
//! as many more as it is slower (no cap above; at least ×0.25, so that a
//! fast interval never shrinks a pool below a quarter of the profile's
//! sizing). Only intervals the model describes are read: prefill below
//! 90% utilization, no more sequences per worker than profiled, and no
//! backlog (requests waiting for a seat wait on what the profile does not
//! know; the queue rules above answer them). Before any request finishes, the ITL's is
//! the mean time between streamed tokens over what the profile expects of
//! the sequences running (`start_itl_correction`).

use crate::plan::Observation;
use crate::plan::predict::Load;
use crate::plan::profile::Profile;
use crate::plan::{PoolKind, Targets};

/// Bounds of the prefill utilization the planner sizes for.
const UTILIZATION: (f64, f64) = (0.05, 0.9);

/// The least a correction is (a deployment is credited with at most four
/// times its profile's speed; one slower than its profile gets the
/// correction observed, however large: sizing short of a deployment's real
/// speed misses every interval).
const FASTEST: f64 = 0.25;

/// Intervals whose corrections are read (their median).
const CORRECTION_WINDOW: usize = 5;

/// The share of each target the pools are sized for.
const AIM: f64 = 0.95;

/// Most workers an aggregated pool is searched up to.
const MOST_WORKERS: u32 = 100_000;

/// The whole workers that carry `workers` of work: rounded up, past what
/// floating point leaves over a whole number (4 / (1 − 150/180) is
/// 24.000000000000004).
fn round_up(workers: f64) -> f64 {
    (workers - 1e-9).ceil()
}

/// A sequence's mean time between tokens on a worker whose decode step is
/// `step_ms` and whose time is `utilization` prefill: prompts' steps
/// stretch every sequence's tokens.
fn token_ms(step_ms: f64, utilization: f64) -> f64 {
    step_ms / (1.0 - utilization).max(1.0 - UTILIZATION.1)
}

/// Observed latency over the profile's expectation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Corrections {
    /// Time to first token.
    pub ttft: f64,
    /// Inter-token latency.
    pub itl: f64,
    /// A request's mean time between tokens over the percentile's, as
    /// observed (at most 1): Little's law counts the sequences decoding
    /// at the mean, and the corrected ITL is the percentile's.
    pub token_mean: f64,
    /// The sequences a worker of the pools that decode ran while at least
    /// as many again queued at it (the most seen in the intervals kept): a limit the
    /// profile may not know (the workers' `--max-num-seqs`, or their KV
    /// cache), learned from the deployment; `None` before any queued.
    pub seats: Option<f64>,
}

impl Default for Corrections {
    fn default() -> Self {
        Self { ttft: 1.0, itl: 1.0, token_mean: 1.0, seats: None }
    }
}

impl Corrections {
    /// Sequences a worker decodes together: `per_worker`, within the seats
    /// seen.
    fn seated(&self, per_worker: f64) -> f64 {
        self.seats.map_or(per_worker, |seats| per_worker.min(seats)).max(1.0)
    }
}

/// A worker's seats as one interval shows them: the sequences its pool's
/// workers ran, each, while at least as many more queued and a latency
/// target was missed (a worker with that queue, too slow, seats no more; a
/// few requests waiting a step for the step's token budget, the targets
/// met, say nothing of its seats).
fn seats_seen(targets: &Targets, seen: &Observation) -> Option<f64> {
    let decodes = targets.pools().iter().any(|limits| limits.pool == seen.pool && limits.kind != PoolKind::Prefill);
    if !decodes || seen.replicas == 0 || seen.running == 0 || !missed(targets, seen) {
        return None;
    }
    let each = f64::from(seen.running) / f64::from(seen.replicas);
    (seen.queue_depth >= each.max(1.0)).then_some(each)
}

/// Whether the interval's TTFT or ITL percentile missed its target.
pub fn missed(targets: &Targets, seen: &Observation) -> bool {
    seen.ttft_ms.is_some_and(|ttft| ttft > targets.ttft_ms()) || seen.itl_ms.is_some_and(|itl| itl > targets.itl_ms())
}

/// Whether requests queue at a pool's workers beyond a step's wait: at
/// least one waiting per worker (a request or two waiting for the next
/// step's token budget is not a backlog).
pub fn backlogged(seen: &Observation) -> bool {
    seen.queue_depth >= f64::from(seen.replicas.max(1))
}

/// What the profile proposes for one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// The pool.
    pub pool: String,
    /// Replicas proposed (before the constraints).
    pub replicas: u32,
    /// The numbers behind it, in words.
    pub reason: String,
}

fn utilization_cap(ttft_ms: f64, target_ms: f64) -> f64 {
    (1.0 - ttft_ms / target_ms).clamp(UTILIZATION.0, UTILIZATION.1)
}

/// The context decoding runs at: the prompt and half the output.
fn decode_context(load: &Load) -> f64 {
    load.isl_mean + load.osl_mean / 2.0
}

/// The corrections an interval's observations give: the first pool with a
/// TTFT (prefill or aggregated) and with an ITL (decode or aggregated).
pub fn corrections(profile: &Profile, targets: &Targets, observed: &[Observation]) -> Corrections {
    corrections_over(profile, targets, std::slice::from_ref(&observed.to_vec()))
}

/// The corrections of the latest intervals (oldest first; the last
/// `CORRECTION_WINDOW` read): for each latency, the median of the
/// intervals that observed it (×1 where none did). One interval's
/// percentile is noisy; the deployment's speed against its profile
/// changes slowly. The mean ITL's share of the percentile's likewise,
/// from the first pool that decodes.
pub fn corrections_over(profile: &Profile, targets: &Targets, intervals: &[Vec<Observation>]) -> Corrections {
    let recent = &intervals[intervals.len().saturating_sub(CORRECTION_WINDOW)..];
    let (mut ttft, mut itl, mut token_mean): (Vec<f64>, Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new(), Vec::new());
    for observed in recent {
        let (seen_ttft, seen_itl) = interval_corrections(profile, targets, observed);
        ttft.extend(seen_ttft);
        itl.extend(seen_itl);
        let decodes = |seen: &&Observation| targets.pools().iter().any(|limits| limits.pool == seen.pool && limits.kind != PoolKind::Prefill);
        token_mean.extend(observed.iter().filter(decodes).find_map(|seen| Some((seen.itl_mean_ms? / seen.itl_ms?).clamp(FASTEST, 1.0))));
    }
    // Seats are a property of the workers, not of one interval's noise:
    // the most seen over every interval kept.
    let seats = intervals.iter().flatten().filter_map(|seen| seats_seen(targets, seen)).max_by(f64::total_cmp);
    Corrections { ttft: median(&mut ttft).unwrap_or(1.0), itl: median(&mut itl).unwrap_or(1.0), token_mean: median(&mut token_mean).unwrap_or(1.0), seats }
}

fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    match values.len() {
        0 => None,
        odd if odd % 2 == 1 => Some(values[middle]),
        _ => Some((values[middle - 1] + values[middle]) / 2.0),
    }
}

/// One interval's TTFT and ITL corrections, where it observed them (with
/// requests finished: the lengths the expectation needs).
fn interval_corrections(profile: &Profile, targets: &Targets, observed: &[Observation]) -> (Option<f64>, Option<f64>) {
    let kind = |pool: &Observation| targets.pools().iter().find(|limits| limits.pool == pool.pool).map(|limits| limits.kind);
    // Requests waiting for a seat at the workers (a backlog) wait on
    // what the profile does not model: the queue rules size those.
    let measured =
        |seen: &Observation| seen.replicas > 0 && seen.load.request_rate > 0.0 && seen.load.isl_mean > 0.0 && seen.load.osl_mean > 0.0 && !backlogged(seen);
    // Prefill at the profile's speed, per replica.
    let prefill = |seen: &Observation| seen.load.request_rate * profile.ttft_ms(seen.load.isl_mean) / 1e3 / f64::from(seen.replicas);
    // An interval the profile cannot model says nothing of its accuracy:
    // prefill saturated (the queue, not the work, sets the latencies),
    // more sequences per worker than the profile measured, or a backlog.
    let ttft = observed
        .iter()
        .filter(|seen| kind(seen) != Some(PoolKind::Decode))
        .find_map(|seen| Some((seen, seen.ttft_ms?)))
        .filter(|(seen, _)| measured(seen))
        .and_then(|(seen, ttft)| {
            let utilization = prefill(seen);
            let expected = profile.ttft_ms(seen.load.isl_mean) / (1.0 - utilization);
            (utilization < UTILIZATION.1).then(|| (ttft / expected).max(FASTEST))
        });
    let itl = observed
        .iter()
        .filter(|seen| kind(seen) != Some(PoolKind::Prefill))
        .find_map(|seen| Some((seen, seen.itl_ms?)))
        .filter(|(seen, _)| measured(seen))
        .and_then(|(seen, itl)| {
            let concurrency = (seen.load.request_rate * seen.load.osl_mean * itl / 1e3 / f64::from(seen.replicas)).max(1.0);
            // On an aggregated pool the prompts' steps stretch each token by
            // the prefill utilization; on a decode pool nothing does.
            let utilization = if kind(seen) == Some(PoolKind::Aggregated) { prefill(seen) } else { 0.0 };
            let expected = token_ms(profile.itl_ms(decode_context(&seen.load), concurrency), utilization);
            (utilization < UTILIZATION.1 && concurrency <= profile.max_concurrency()).then(|| (itl / expected).max(FASTEST))
        });
    (ttft, itl.or_else(|| start_itl_correction(profile, targets, observed)))
}

/// Before any request finishes (a start) there is no ITL percentile; the
/// mean time between the tokens streamed in the interval, over what the
/// profile expects of the sequences the pool ran when it ended (their
/// count per worker and context), stretched on an aggregated pool by the
/// prefill of the prompts that got their first token. A mean over a
/// mean, where the intervals after read a percentile over a mean: a
/// correction a little below theirs, which answers a deployment that
/// starts slower than its profile at the next interval rather than once
/// requests finish.
fn start_itl_correction(profile: &Profile, targets: &Targets, observed: &[Observation]) -> Option<f64> {
    let aggregated = |seen: &Observation| targets.pools().iter().any(|limits| limits.pool == seen.pool && limits.kind == PoolKind::Aggregated);
    let decodes = |seen: &&Observation| targets.pools().iter().any(|limits| limits.pool == seen.pool && limits.kind != PoolKind::Prefill);
    let seen = observed.iter().filter(decodes).find(|seen| seen.itl_ms.is_none() && seen.token_gap_ms.is_some())?;
    let gap = seen.token_gap_ms?;
    if seen.replicas == 0 || seen.running == 0 || seen.context_tokens <= 0.0 || backlogged(seen) {
        return None;
    }
    let concurrency = (f64::from(seen.running) / f64::from(seen.replicas)).max(1.0);
    let isl = started_isl(seen);
    let utilization = if aggregated(seen) && isl > 0.0 { seen.load.request_rate * profile.ttft_ms(isl) / 1e3 / f64::from(seen.replicas) } else { 0.0 };
    let expected = token_ms(profile.itl_ms(seen.context_tokens, concurrency), utilization);
    (utilization < UTILIZATION.1 && concurrency <= profile.max_concurrency()).then(|| (gap / expected).max(FASTEST))
}

/// The interval's mean prompt: of the requests finished, or before any
/// finished, of those that got their first token.
fn started_isl(seen: &Observation) -> f64 {
    if seen.load.isl_mean > 0.0 { seen.load.isl_mean } else { seen.started_isl_mean }
}

/// Replicas per pool of `targets` for `load`.
pub fn propose(profile: &Profile, targets: &Targets, load: &Load, corrections: Corrections) -> Vec<Proposal> {
    propose_queued(profile, targets, load, corrections, &|_| 0.0)
}

/// [`propose`], with the requests `queued` at each pool's workers (by
/// pool) as work on top of the forecast: a pool that computes prompts gets
/// the workers that compute the queued prompts within the TTFT target
/// (fully busy), a pool that decodes the seats for them.
pub fn propose_queued(profile: &Profile, targets: &Targets, load: &Load, corrections: Corrections, queued: &dyn Fn(&str) -> f64) -> Vec<Proposal> {
    let (ttft_aim, itl_aim) = (targets.ttft_ms() * AIM, targets.itl_ms() * AIM);
    // Prefill: the profile's work, at the utilization the corrected TTFT allows.
    let alone = profile.ttft_ms(load.isl_mean);
    let ttft = alone * corrections.ttft;
    let prefill_work = load.request_rate * alone / 1e3;
    let cap = utilization_cap(ttft, ttft_aim);
    let prefill = prefill_work / cap;
    // Decode: sequences decoding at once, and how many a worker takes within the ITL target.
    let context = decode_context(load);
    let per_worker = corrections.seated(profile.concurrency_within(context, itl_aim / corrections.itl));
    let itl = profile.itl_ms(context, per_worker) * corrections.itl;
    let sequences = load.request_rate * load.osl_mean * itl * corrections.token_mean / 1e3;
    let decode = sequences / per_worker;
    let unreachable = if ttft >= ttft_aim { " (the TTFT alone is over the share of the target sized for: sized at the lowest utilization)" } else { "" };
    let whole = |workers: f64, queued: f64| if load.request_rate > 0.0 || queued >= 1.0 { round_up(workers).max(1.0) as u32 } else { 0 };
    // The queued prompts computed within the TTFT target, workers fully busy.
    let draining = |queued: f64| queued * alone / ttft_aim;
    let queue_words = |queued: f64, workers: f64| {
        if queued >= 1.0 { format!("; {queued:.0} queued: {workers:.2} workers more to start them within the target") } else { String::new() }
    };
    let prefill_words = format!("prefill {prefill_work:.2} workers of work at up to {:.0}% utilization (TTFT {ttft:.1} ms alone){unreachable}", cap * 100.0);
    targets
        .pools()
        .iter()
        .map(|limits| {
            let queued = queued(&limits.pool).max(0.0);
            let (replicas, reason) = match limits.kind {
                PoolKind::Prefill => (whole(prefill + draining(queued), queued), format!("{prefill_words}{}", queue_words(queued, draining(queued)))),
                PoolKind::Decode => (
                    whole(decode + queued / per_worker, queued),
                    format!(
                        "decode {sequences:.1} sequences at {per_worker:.1} per worker (ITL {itl:.2} ms at context {context:.0}, {:.2} ms on average){}",
                        itl * corrections.token_mean,
                        queue_words(queued, queued / per_worker)
                    ),
                ),
                PoolKind::Aggregated => {
                    let shared = aggregated(profile, itl_aim, load, corrections, prefill_work, cap, queued, draining(queued));
                    let replicas = if load.request_rate > 0.0 || queued >= 1.0 { shared.workers } else { 0 };
                    let words = if shared.reached {
                        format!(
                            "{prefill_words}; decode {:.1} sequences, {:.1} per worker in {:.2} ms steps at context {context:.0}, {:.2} ms a token with {:.0}% of the time prefill",
                            shared.sequences,
                            shared.sequences / f64::from(shared.workers.max(1)),
                            shared.step_ms,
                            shared.itl_ms,
                            shared.utilization * 100.0
                        )
                    } else {
                        format!("{prefill_words}; decode {:.1} sequences: ITL {:.2} ms even alone, over the share of the target sized for: a worker per sequence", shared.sequences, shared.step_ms)
                    };
                    (replicas, words + &queue_words(queued, draining(queued)))
                }
            };
            Proposal { pool: limits.pool.clone(), replicas, reason }
        })
        .collect()
}

/// A decode or aggregated pool's replicas for the sequences it will hold by the next
/// interval, over what a worker decodes within the ITL target at the
/// context their KV cache gives. It starts from those running and queued
/// when this one ended. Where the interval's requests give a sequence's
/// decode time `D` (their mean output length at their mean time between
/// tokens), those in flight finish at their own pace while requests start
/// at this one's rate `λ`: the count relaxes toward Little's `λD` as
/// `λD + (now − λD)·e^(−t/D)` — a backlog drains at the pace its sequences
/// end, not at the rate the last interval saw them end. Before any
/// request's length is known it is the interval's start rate less its
/// finish rate, over the interval. It needs no forecast: at a start it is
/// the only reading of the decode load, and on a ramp it leads the
/// forecast (which averages what finished). An aggregated pool's workers
/// also compute the prompts, which stretch each token by their share of
/// the time: it is the fewest workers whose tokens, so stretched, are
/// within the ITL target. `None` when nothing ran (no context to size
/// at).
pub fn decode_in_flight(profile: &Profile, targets: &Targets, seen: &Observation, corrections: Corrections) -> Option<Proposal> {
    if seen.running == 0 || seen.context_tokens <= 0.0 {
        return None;
    }
    let per_worker = corrections.seated(profile.concurrency_within(seen.context_tokens, targets.itl_ms() * AIM / corrections.itl));
    let now = f64::from(seen.running) + seen.queue_depth;
    let interval = targets.interval().as_secs_f64();
    let decoding_secs = seen.itl_mean_ms.filter(|_| seen.load.osl_mean > 0.0).map(|itl_mean| seen.load.osl_mean * itl_mean / 1e3).filter(|secs| *secs > 0.0);
    let (sequences, how) = match decoding_secs {
        Some(secs) => {
            let steady = seen.load.request_rate * secs;
            (
                steady + (now - steady) * (-interval / secs).exp(),
                format!("{now:.0} in flight, {:.2} starting a second, each decoding {secs:.1} s: {steady:.0} at the steady state", seen.load.request_rate),
            )
        }
        None => (
            (now + (seen.load.request_rate - seen.finish_rate) * interval).max(0.0),
            format!("{now:.0} in flight, {:.2} starting and {:.2} finishing a second", seen.load.request_rate, seen.finish_rate),
        ),
    };
    let aggregated = targets.pools().iter().any(|limits| limits.pool == seen.pool && limits.kind == PoolKind::Aggregated);
    let (replicas, per_worker) = if aggregated {
        // The prompts' steps stretch each token by the prefill share, as
        // the interval's requests make it (the profile's work; before any
        // finished, the prompts that got their first token).
        let isl = started_isl(seen);
        let prefill_work = if isl > 0.0 { seen.load.request_rate * profile.ttft_ms(isl) / 1e3 } else { 0.0 };
        let within = |workers: u32| {
            let n = f64::from(workers);
            let utilization = prefill_work / n;
            let step_ms = profile.itl_ms(seen.context_tokens, (sequences / n).max(1.0)) * corrections.itl;
            utilization < UTILIZATION.1 && token_ms(step_ms, utilization) <= targets.itl_ms() * AIM && sequences / n <= corrections.seated(f64::INFINITY)
        };
        // At most a worker per sequence (where not even that meets the
        // target, the aggregated proposal says so).
        let most = round_up(sequences).clamp(1.0, f64::from(MOST_WORKERS)) as u32;
        let workers = (1..=most).find(|workers| within(*workers)).unwrap_or(most);
        (workers, sequences / f64::from(workers))
    } else {
        (round_up(sequences / per_worker).max(1.0) as u32, per_worker)
    };
    let shared = if aggregated { ", their tokens stretched by the interval's prompts" } else { "" };
    Some(Proposal {
        pool: seen.pool.clone(),
        replicas,
        reason: format!(
            "decode {sequences:.0} sequences by the next interval ({how}) at {per_worker:.1} per worker (context {:.0} from their KV cache{shared})",
            seen.context_tokens
        ),
    })
}

/// An aggregated pool's size and what it runs at.
struct Shared {
    workers: u32,
    sequences: f64,
    utilization: f64,
    /// The decode step, ms (corrected).
    step_ms: f64,
    /// A sequence's mean time between tokens, prompts' steps included, ms
    /// (corrected).
    itl_ms: f64,
    reached: bool,
}

/// The fewest workers that meet both targets with prefill and decode in
/// the same steps: prefill utilization within `cap`, and a sequence's mean
/// time between tokens (the decode step at their concurrency, stretched by
/// the prompts' steps) within `itl_aim`, ms.
#[allow(clippy::too_many_arguments)]
fn aggregated(profile: &Profile, itl_aim: f64, load: &Load, corrections: Corrections, prefill_work: f64, cap: f64, queued: f64, draining: f64) -> Shared {
    let context = decode_context(load);
    // The forecast's prompts within the utilization allowed, and the
    // queued ones computed within the target besides; each worker seats
    // no more than it was seen to.
    let first = round_up(prefill_work / cap + draining).max(1.0) as u32;
    let fastest = profile.itl_ms(context, 1.0) * corrections.itl;
    if fastest > itl_aim {
        // Not even a worker per sequence, without prefill, meets the
        // target: a worker per sequence.
        let sequences = load.request_rate * load.osl_mean * fastest / 1e3 + queued;
        let workers = first.max(round_up(sequences).min(f64::from(MOST_WORKERS)) as u32);
        let utilization = prefill_work / f64::from(workers);
        return Shared { workers, sequences, utilization, step_ms: fastest, itl_ms: token_ms(fastest, utilization), reached: false };
    }
    for workers in first..=MOST_WORKERS.max(first) {
        let n = f64::from(workers);
        let utilization = prefill_work / n;
        // A few rounds of token time ↔ concurrency settle the fixed point
        // (Little's law: sequences decoding = rate × OSL × token time).
        let mut step_ms = fastest;
        let mut itl_ms = token_ms(step_ms, utilization);
        let mut sequences = 0.0;
        for _ in 0..20 {
            sequences = load.request_rate * load.osl_mean * itl_ms / 1e3 + queued;
            step_ms = profile.itl_ms(context, (sequences / n).max(1.0)) * corrections.itl;
            itl_ms = token_ms(step_ms, utilization);
        }
        if itl_ms <= itl_aim && sequences / n <= corrections.seated(f64::INFINITY) {
            return Shared { workers, sequences, utilization, step_ms, itl_ms, reached: true };
        }
    }
    Shared { workers: MOST_WORKERS, sequences: 0.0, utilization: 0.0, step_ms: 0.0, itl_ms: 0.0, reached: false }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::plan::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint};
    use crate::plan::{PoolLimits, Predictor};

    fn profile() -> Profile {
        // TTFT alone 100 ms at 1,000 tokens; ITL 10 ms alone, 20 ms at 16 sequences, whatever the context.
        let decode = [(256, 1, 10.0), (256, 16, 20.0), (4096, 1, 10.0), (4096, 16, 20.0)]
            .into_iter()
            .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
            .collect();
        Profile {
            version: PROFILE_VERSION,
            worker: "test".into(),
            prefill: vec![PrefillPoint { isl: 100, ttft_ms: 10.0 }, PrefillPoint { isl: 1000, ttft_ms: 100.0 }],
            decode,
        }
        .check("test")
        .unwrap()
    }

    fn targets(kinds: &[(&str, PoolKind)]) -> Targets {
        let pools = kinds.iter().map(|(name, kind)| PoolLimits { pool: (*name).into(), kind: *kind, min_replicas: 0, max_replicas: 100 }).collect();
        Targets::new(200.0, 20.0, 90.0, pools, 200, Duration::from_secs(30), Duration::from_secs(60), Predictor::Constant).unwrap()
    }

    #[test]
    fn prefill_and_decode_are_sized_from_the_profile() {
        let targets = targets(&[("p", PoolKind::Prefill), ("d", PoolKind::Decode)]);
        let load = Load { request_rate: 40.0, isl_mean: 1000.0, osl_mean: 100.0 };
        let proposals = propose(&profile(), &targets, &load, Corrections::default());
        // Sized for 95% of the targets, 190 and 19 ms.
        // Prefill: 40 × 0.1 s = 4 workers of work; TTFT 100 of 190 ms allows 47%: 9 workers.
        assert_eq!(proposals[0].replicas, 9, "{}", proposals[0].reason);
        // Decode: 14.5 sequences per worker within 19 ms (10 ms plus 2/3 ms
        // per sequence past the first); 40 × 100 × 0.019 = 76 sequences: 6 workers.
        assert_eq!(proposals[1].replicas, 6, "{}", proposals[1].reason);
        // Requests' mean ITL at half the percentile's: half the sequences
        // decode at once (38), 3 workers.
        let halved = propose(&profile(), &targets, &load, Corrections { token_mean: 0.5, ..Corrections::default() });
        assert_eq!(halved[1].replicas, 3, "{}", halved[1].reason);
        assert!(halved[1].reason.contains("(ITL 19.00 ms at context 1050, 9.50 ms on average)"), "{}", halved[1].reason);
        // Aggregated: prefill within 44% starts the search at 9. On n
        // workers a token takes step / (1 − 4/n), with 4 × token sequences
        // (Little's law) spread over n. On 13: token = 1.444 × (9.33 + 4t/13
        // × 2/3), t = 19.16 ms, over 18. On 14: t = 1.4 × (9.33 + 4t/14 ×
        // 2/3) = 17.82 ms, its step 12.73 ms.
        let aggregated = propose(&profile(), &targets_aggregated(), &load, Corrections::default());
        assert_eq!(aggregated[0].replicas, 14, "{:?}", aggregated[0]);
        assert!(
            aggregated[0].reason.contains("5.1 per worker in 12.73 ms steps at context 1050, 17.82 ms a token with 29% of the time prefill"),
            "{:?}",
            aggregated[0]
        );
        // No load: nothing proposed (the minimums apply later).
        assert_eq!(propose(&profile(), &targets, &Load { request_rate: 0.0, ..load }, Corrections::default())[0].replicas, 0);
    }

    fn targets_aggregated() -> Targets {
        targets(&[("a", PoolKind::Aggregated)])
    }

    #[test]
    fn a_deployment_slower_than_its_profile_gets_more_workers() {
        let targets = targets(&[("p", PoolKind::Prefill), ("d", PoolKind::Decode)]);
        let load = Load { request_rate: 40.0, isl_mean: 1000.0, osl_mean: 100.0 };
        // Observed on 8 prefill workers at 50%: expected 200 ms; observed 300 ms is ×1.5.
        let seen = |pool: &str, ttft_ms, itl_ms, replicas| Observation {
            pool: pool.into(),
            load,
            ttft_ms,
            itl_ms,
            queue_depth: 0.0,
            kv_usage: 0.0,
            replicas,
            running: 0,
            context_tokens: 0.0,
            finish_rate: 0.0,
            itl_mean_ms: None,
            token_gap_ms: None,
            started_isl_mean: 0.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        let corrections = corrections(&profile(), &targets, &[seen("p", Some(300.0), None, 8), seen("d", None, Some(20.0), 5)]);
        assert!((corrections.ttft - 1.5).abs() < 1e-9, "{corrections:?}");
        // 40 × 100 × 0.02 / 5 = 16 sequences per decode worker: expected 20 ms, as observed.
        assert!((corrections.itl - 1.0).abs() < 1e-9, "{corrections:?}");
        let slower = propose(&profile(), &targets, &load, corrections);
        // The work is the profile's, 40 × 0.1 s = 4 workers; the TTFT as
        // observed (150 of 190 ms) allows 21.1%: 19.
        assert_eq!(slower[0].replicas, 19, "{}", slower[0].reason);
        assert_eq!(corrections_without_observations(&targets), Corrections::default());
        // A deployment eight times slower at decode than its profile (on
        // 40 workers, 40 × 100 × 0.16 / 40 = 16 sequences each, expected
        // 20 ms): the correction is what was observed (it was capped at ×4).
        let eight = super::corrections(&profile(), &targets, &[seen("d", None, Some(160.0), 40)]);
        assert!((eight.itl - 8.0).abs() < 1e-9, "{eight:?}");
        // And 15× at prefill: 3 s where 200 ms was expected. A backlog (a
        // request waiting per worker or more) teaches nothing: its
        // latencies are the wait for a seat.
        let backlog = Observation { queue_depth: 8.0, ..seen("p", Some(3_000.0), None, 8) };
        assert_eq!(super::corrections(&profile(), &targets, std::slice::from_ref(&backlog)).ttft, 1.0);
        assert!((super::corrections(&profile(), &targets, &[Observation { queue_depth: 7.0, ..backlog }]).ttft - 15.0).abs() < 1e-9);
    }

    #[test]
    fn an_aggregated_pools_tokens_wait_for_the_prompts_steps() {
        // ITL 10 ms at any concurrency: only the prefill's share matters.
        let flat = [(256, 1, 10.0), (256, 16, 10.0), (4096, 1, 10.0), (4096, 16, 10.0)]
            .into_iter()
            .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
            .collect();
        let profile = Profile { decode: flat, ..profile() };
        let load = Load { request_rate: 40.0, isl_mean: 1000.0, osl_mean: 100.0 };
        let within = |itl_ms: f64| {
            Targets::new(200.0, itl_ms, 90.0, targets_aggregated().pools().to_vec(), 200, Duration::from_secs(30), Duration::from_secs(60), Predictor::Constant)
                .unwrap()
        };
        // 4 workers of prefill; on n a token takes 10 / (1 − 4/n) ms: within
        // 95% of 16 ms (15.2) from n = 12 (15.00 ms; on 11, 15.71).
        let sized = &propose(&profile, &within(16.0), &load, Corrections::default())[0];
        assert_eq!(sized.replicas, 12, "{}", sized.reason);
        assert!(sized.reason.contains("in 10.00 ms steps at context 1050, 15.00 ms a token with 33% of the time prefill"), "{}", sized.reason);
        // Within 95% of 25 ms from 7, but the TTFT's 47% utilization takes 9.
        assert_eq!(propose(&profile, &within(25.0), &load, Corrections::default())[0].replicas, 9);
        // A decode step alone over the target: a worker per sequence (40 × 100 × 0.025 = 100), said so.
        let hopeless = propose(&profile, &within(12.5), &load, Corrections { ttft: 1.0, itl: 2.5, token_mean: 1.0, seats: None });
        assert_eq!(hopeless[0].replicas, 100, "{}", hopeless[0].reason);
        assert!(hopeless[0].reason.contains("over the share of the target sized for"), "{}", hopeless[0].reason);
        // Observed: on 10 workers (40% prefill) the profile expects a token
        // every 10 / 0.6 = 16.67 ms; 20 ms is ×1.2. On 8 (50%), 20 ms; 30
        // ms is ×1.5. On 5 (80%) at 80 ms, 64 sequences a worker: more than
        // the profile measured (16), so no correction (×1).
        let seen = |itl_ms, replicas| Observation {
            pool: "a".into(),
            load,
            ttft_ms: None,
            itl_ms: Some(itl_ms),
            queue_depth: 0.0,
            kv_usage: 0.0,
            replicas,
            running: 0,
            context_tokens: 0.0,
            finish_rate: 0.0,
            itl_mean_ms: None,
            token_gap_ms: None,
            started_isl_mean: 0.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        assert!((corrections(&profile, &targets_aggregated(), &[seen(20.0, 10)]).itl - 1.2).abs() < 1e-9);
        assert!((corrections(&profile, &targets_aggregated(), &[seen(30.0, 8)]).itl - 1.5).abs() < 1e-9);
        assert_eq!(corrections(&profile, &targets_aggregated(), &[seen(80.0, 5)]).itl, 1.0);
        // Over intervals, the median of the last five that observed it: the
        // ×0.25 of the oldest is out of the window, and the interval
        // without an ITL and the one beyond the profile are skipped. Those
        // give 1.2, 1.5 and 2.4 (40 ms on 10): ×1.5.
        let without = Observation { itl_ms: None, ..seen(20.0, 10) };
        let intervals = [seen(4.0, 10), seen(20.0, 10), without, seen(30.0, 8), seen(40.0, 10), seen(80.0, 5)].map(|seen| vec![seen]);
        assert!((corrections_over(&profile, &targets_aggregated(), &intervals).itl - 1.5).abs() < 1e-9);
    }

    #[test]
    fn a_decode_pool_is_sized_for_the_sequences_it_holds() {
        let targets = targets(&[("p", PoolKind::Prefill), ("d", PoolKind::Decode)]);
        let seen = |running, queue_depth, context_tokens, started: f64, finished: f64| Observation {
            pool: "d".into(),
            load: Load { request_rate: started, isl_mean: 0.0, osl_mean: 0.0 },
            ttft_ms: None,
            itl_ms: None,
            queue_depth,
            kv_usage: 0.5,
            replicas: 2,
            running,
            context_tokens,
            finish_rate: finished,
            itl_mean_ms: None,
            token_gap_ms: None,
            started_isl_mean: 0.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        // 30 running and 9 queued, as many starting as finishing: 39
        // sequences, 14.5 per worker within 19 ms: 3 workers.
        let sized = decode_in_flight(&profile(), &targets, &seen(30, 9.0, 1_200.0, 2.0, 2.0), Corrections::default()).unwrap();
        assert_eq!((sized.pool.as_str(), sized.replicas), ("d", 3), "{sized:?}");
        assert!(
            sized
                .reason
                .contains("39 sequences by the next interval (39 in flight, 2.00 starting and 2.00 finishing a second) at 14.5 per worker (context 1200"),
            "{sized:?}"
        );
        // A ramp: 0.5 a second more start than finish over the 30-second
        // interval, 54 sequences: 4 workers. Falling as fast: 24, 2.
        assert_eq!(decode_in_flight(&profile(), &targets, &seen(30, 9.0, 1_200.0, 2.5, 2.0), Corrections::default()).unwrap().replicas, 4);
        assert_eq!(decode_in_flight(&profile(), &targets, &seen(30, 9.0, 1_200.0, 2.0, 2.5), Corrections::default()).unwrap().replicas, 2);
        // Twice as slow as the profile: 19 ms is the profile's 9.5 ms, under
        // its ITL alone: a worker per sequence.
        assert_eq!(
            decode_in_flight(&profile(), &targets, &seen(30, 9.0, 1_200.0, 2.0, 2.0), Corrections { ttft: 1.0, itl: 2.0, token_mean: 1.0, seats: None })
                .unwrap()
                .replicas,
            39
        );
        // Nothing running: nothing to size on.
        assert_eq!(decode_in_flight(&profile(), &targets, &seen(0, 4.0, 0.0, 2.0, 0.0), Corrections::default()), None);
        // With the requests' lengths: 100 tokens at 50 ms, 5 s a sequence;
        // 2 starting a second hold 10 at the steady state. A backlog of 39
        // drains toward it over the 30-second interval (e^-6 of the excess
        // left: 10.07, one worker), whatever the last interval saw finish;
        // a start from 1 in flight at 8 a second climbs to 40 (3 workers).
        let timed = |running, queue_depth, started| Observation {
            load: Load { request_rate: started, isl_mean: 1_000.0, osl_mean: 100.0 },
            itl_mean_ms: Some(50.0),
            ..seen(running, queue_depth, 1_200.0, started, 0.0)
        };
        let draining = decode_in_flight(&profile(), &targets, &timed(30, 9.0, 2.0), Corrections::default()).unwrap();
        assert_eq!(draining.replicas, 1, "{draining:?}");
        assert!(
            draining
                .reason
                .contains("decode 10 sequences by the next interval (39 in flight, 2.00 starting a second, each decoding 5.0 s: 10 at the steady state)"),
            "{draining:?}"
        );
        assert_eq!(decode_in_flight(&profile(), &targets, &timed(1, 0.0, 8.0), Corrections::default()).unwrap().replicas, 3);
        // On an aggregated pool the same 39.9 sequences share the workers
        // with 8 prompts a second of 100 ms (0.8 workers of prefill): on 4,
        // steps of 15.98 ms stretched by 20% prefill are 19.98 ms a token,
        // over 19; on 5, 14.65 ms by 16%, 17.44 ms.
        let aggregated = Observation { pool: "a".into(), ..timed(1, 0.0, 8.0) };
        let shared = decode_in_flight(&profile(), &targets_aggregated(), &aggregated, Corrections::default()).unwrap();
        assert_eq!(shared.replicas, 5, "{shared:?}");
        assert!(shared.reason.contains("at 8.0 per worker (context 1200 from their KV cache, their tokens stretched by the interval's prompts)"), "{shared:?}");
        // Without prompts (their lengths unknown), as a decode pool.
        assert_eq!(
            decode_in_flight(&profile(), &targets_aggregated(), &Observation { pool: "a".into(), ..seen(30, 9.0, 1_200.0, 2.0, 2.0) }, Corrections::default())
                .unwrap()
                .replicas,
            3
        );
    }

    #[test]
    fn before_any_request_finishes_the_itl_correction_is_read_from_the_streamed_tokens() {
        // 16 sequences on 4 workers, at context 1,200: the profile's step at
        // 4 a worker is 12 ms. 8 prompts a second of 1,000 tokens got their
        // first token (0.8 workers of prefill, 20% of each worker's time):
        // a token every 12 / 0.8 = 15 ms expected; 18 ms streamed is ×1.2.
        let start = |pool: &str, token_gap_ms: Option<f64>, started_isl_mean: f64| Observation {
            pool: pool.into(),
            load: Load { request_rate: 8.0, isl_mean: 0.0, osl_mean: 0.0 },
            ttft_ms: Some(150.0),
            itl_ms: None,
            queue_depth: 0.0,
            kv_usage: 0.5,
            replicas: 4,
            running: 16,
            context_tokens: 1_200.0,
            finish_rate: 8.0,
            itl_mean_ms: None,
            token_gap_ms,
            started_isl_mean,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        let aggregated = targets_aggregated();
        let seen = start("a", Some(18.0), 1_000.0);
        let corrected = corrections(&profile(), &aggregated, std::slice::from_ref(&seen));
        assert!((corrected.itl - 1.2).abs() < 1e-9, "{corrected:?}");
        // Its prompts unknown, nothing stretches the 12 ms step: ×1.5. On a
        // decode pool likewise; a prefill pool's tokens are not its own.
        assert!((corrections(&profile(), &aggregated, &[start("a", Some(18.0), 0.0)]).itl - 1.5).abs() < 1e-9);
        let split = targets(&[("p", PoolKind::Prefill), ("d", PoolKind::Decode)]);
        assert!((corrections(&profile(), &split, &[start("p", Some(36.0), 1_000.0), start("d", Some(18.0), 1_000.0)]).itl - 1.5).abs() < 1e-9);
        assert_eq!(corrections(&profile(), &split, &[start("p", Some(36.0), 1_000.0)]).itl, 1.0);
        // Too few tokens streamed, or none running: no correction.
        assert_eq!(corrections(&profile(), &aggregated, &[start("a", None, 1_000.0)]).itl, 1.0);
        assert_eq!(corrections(&profile(), &aggregated, &[Observation { running: 0, ..start("a", Some(18.0), 1_000.0) }]).itl, 1.0);
        // Once requests finish, their ITL percentile is read, not the gaps
        // (20 ms over the 1,050-context step at 40 × 100 × 20 ms / 4 = 20
        // sequences a worker: more than the profile measured, so ×1).
        let finished =
            Observation { load: Load { request_rate: 40.0, isl_mean: 1_000.0, osl_mean: 100.0 }, itl_ms: Some(20.0), ..start("a", Some(18.0), 1_000.0) };
        assert_eq!(corrections(&profile(), &aggregated, &[finished]).itl, 1.0);
        // The start's sequences, held within the ITL target corrected: 3
        // workers at the profile's speed, 4 at 1.2 times its step (on 3,
        // 5.3 sequences a worker take 12.89 × 1.2 ms steps, 21.1 ms a token
        // stretched by 27% prefill, over 95% of 20 ms; on 4, 18 ms).
        assert_eq!(decode_in_flight(&profile(), &aggregated, &seen, Corrections::default()).unwrap().replicas, 3);
        assert_eq!(decode_in_flight(&profile(), &aggregated, &seen, corrected).unwrap().replicas, 4);
    }

    #[test]
    fn the_mean_itls_share_of_the_percentile_is_read_from_the_pool_that_decodes() {
        let targets = targets(&[("p", PoolKind::Prefill), ("d", PoolKind::Decode)]);
        let load = Load { request_rate: 40.0, isl_mean: 1000.0, osl_mean: 100.0 };
        let seen = |pool: &str, itl_ms, itl_mean_ms| Observation {
            pool: pool.into(),
            load,
            ttft_ms: None,
            itl_ms,
            queue_depth: 0.0,
            kv_usage: 0.0,
            replicas: 5,
            running: 0,
            context_tokens: 0.0,
            finish_rate: 0.0,
            itl_mean_ms,
            token_gap_ms: None,
            started_isl_mean: 0.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        };
        // 0.75, 0.9 and 0.8 (the prefill pool's 0.1 and the interval
        // without an ITL skipped): the median, 0.8.
        let intervals = [
            vec![seen("p", Some(40.0), Some(4.0)), seen("d", Some(40.0), Some(30.0))],
            vec![seen("d", Some(20.0), Some(18.0))],
            vec![seen("d", None, None)],
            vec![seen("d", Some(25.0), Some(20.0))],
        ];
        assert!((corrections_over(&profile(), &targets, &intervals).token_mean - 0.8).abs() < 1e-9);
        // A mean above the percentile (buckets interpolate) counts as 1; none observed, 1.
        assert_eq!(corrections_over(&profile(), &targets, &[vec![seen("d", Some(20.0), Some(21.0))]]).token_mean, 1.0);
        assert_eq!(corrections_without_observations(&targets).token_mean, 1.0);
    }

    fn corrections_without_observations(targets: &Targets) -> Corrections {
        corrections(&profile(), targets, &[])
    }
}
