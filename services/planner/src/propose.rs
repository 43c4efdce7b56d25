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
//! - **Aggregated**: prefill and decode share each worker's steps. A
//!   step that computes a prompt is as long as the prompt's time to first
//!   token for every sequence decoding in it, far over any ITL target, so
//!   the ITL at the targets' percentile is a plain decode step only while
//!   fewer than the percentile's tail of the steps (the 10% above p90)
//!   carry a prompt, with headroom for arrivals bunching within an
//!   interval. The pool is the fewest workers where that holds, the decode
//!   step at their concurrency is within the ITL target and prefill within
//!   the utilization the TTFT target allows (not the prefill and decode
//!   shares added, which counts the prefill time twice).
//!
//! The corrections are the observed latency (at the targets' percentile)
//! over what the same model expects at the observed load and replicas
//! (each within ×0.25 to ×4; ×1 without an observation): a deployment
//! slower than its profile gets more workers.

use crate::decision::Observation;
use crate::predict::Load;
use crate::profile::Profile;
use crate::targets::{PoolKind, Targets};

/// Bounds of the prefill utilization the planner sizes for.
const UTILIZATION: (f64, f64) = (0.05, 0.9);

/// Bounds of a correction.
const CORRECTION: (f64, f64) = (0.25, 4.0);

/// Most workers an aggregated pool is searched up to.
const MOST_WORKERS: u32 = 100_000;

/// The share of the percentile's tail that steps carrying a prompt may
/// take on an aggregated worker (arrivals bunch within an interval).
const TAIL_HEADROOM: f64 = 0.7;

/// On an aggregated worker, the share of steps that carry a prompt:
/// prompts per second over steps per second, with `decode_ms` steps in
/// the time prefill leaves.
fn prompt_steps(prompts_per_second: f64, decode_ms: f64, utilization: f64) -> f64 {
    prompts_per_second * decode_ms / 1e3 / (1.0 - utilization).max(0.05)
}

/// Observed latency over the profile's expectation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Corrections {
    /// Time to first token.
    pub ttft: f64,
    /// Inter-token latency.
    pub itl: f64,
}

impl Default for Corrections {
    fn default() -> Self {
        Self { ttft: 1.0, itl: 1.0 }
    }
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
    let kind = |pool: &Observation| targets.pools().iter().find(|limits| limits.pool == pool.pool).map(|limits| limits.kind);
    let mut corrections = Corrections::default();
    if let Some((seen, ttft)) = observed.iter().filter(|seen| kind(seen) != Some(PoolKind::Decode)).find_map(|seen| Some((seen, seen.ttft_ms?)))
        && seen.replicas > 0
        && seen.load.request_rate > 0.0
    {
        let alone = profile.ttft_ms(seen.load.isl_mean);
        let utilization = (seen.load.request_rate * alone / 1e3 / f64::from(seen.replicas)).min(0.95);
        let expected = alone / (1.0 - utilization);
        corrections.ttft = (ttft / expected).clamp(CORRECTION.0, CORRECTION.1);
    }
    if let Some((seen, itl)) = observed.iter().filter(|seen| kind(seen) != Some(PoolKind::Prefill)).find_map(|seen| Some((seen, seen.itl_ms?)))
        && seen.replicas > 0
        && seen.load.request_rate > 0.0
    {
        let replicas = f64::from(seen.replicas);
        let concurrency = (seen.load.request_rate * seen.load.osl_mean * itl / 1e3 / replicas).max(1.0);
        let expected = profile.itl_ms(decode_context(&seen.load), concurrency);
        // On an aggregated pool whose tail is steps carrying prompts, the
        // observed ITL says nothing about the decode steps: no correction.
        let tail = 1.0 - targets.percentile() / 100.0;
        let utilization = (seen.load.request_rate * profile.ttft_ms(seen.load.isl_mean) / 1e3 / replicas).min(0.95);
        let prompt_tail = kind(seen) == Some(PoolKind::Aggregated) && prompt_steps(seen.load.request_rate / replicas, expected, utilization) > tail;
        if !prompt_tail {
            corrections.itl = (itl / expected).clamp(CORRECTION.0, CORRECTION.1);
        }
    }
    corrections
}

/// Replicas per pool of `targets` for `load`.
pub fn propose(profile: &Profile, targets: &Targets, load: &Load, corrections: Corrections) -> Vec<Proposal> {
    // Prefill: the profile's work, at the utilization the corrected TTFT allows.
    let alone = profile.ttft_ms(load.isl_mean);
    let ttft = alone * corrections.ttft;
    let prefill_work = load.request_rate * alone / 1e3;
    let cap = utilization_cap(ttft, targets.ttft_ms());
    let prefill = prefill_work / cap;
    // Decode: sequences decoding at once, and how many a worker takes within the ITL target.
    let context = decode_context(load);
    let per_worker = profile.concurrency_within(context, targets.itl_ms() / corrections.itl);
    let itl = profile.itl_ms(context, per_worker) * corrections.itl;
    let sequences = load.request_rate * load.osl_mean * itl / 1e3;
    let decode = sequences / per_worker;
    let unreachable = if ttft >= targets.ttft_ms() { " (the TTFT alone is over the target: sized at the lowest utilization)" } else { "" };
    let whole = |workers: f64| if load.request_rate > 0.0 { workers.ceil().max(1.0) as u32 } else { 0 };
    let prefill_words = format!("prefill {prefill_work:.2} workers of work at up to {:.0}% utilization (TTFT {ttft:.1} ms alone){unreachable}", cap * 100.0);
    targets
        .pools()
        .iter()
        .map(|limits| {
            let (replicas, reason) = match limits.kind {
                PoolKind::Prefill => (whole(prefill), prefill_words.clone()),
                PoolKind::Decode => (whole(decode), format!("decode {sequences:.1} sequences at {per_worker:.1} per worker (ITL {itl:.2} ms at context {context:.0})")),
                PoolKind::Aggregated => {
                    let shared = aggregated(profile, targets, load, corrections, prefill_work, cap);
                    let replicas = if load.request_rate > 0.0 { shared.workers } else { 0 };
                    let words = if shared.reached {
                        format!(
                            "{prefill_words}; decode {:.1} sequences, {:.1} per worker at {:.0}% prefill, {:.1}% of steps with a prompt (decode step {:.2} ms at context {context:.0})",
                            shared.sequences,
                            shared.sequences / f64::from(shared.workers.max(1)),
                            shared.utilization * 100.0,
                            shared.prompt_steps * 100.0,
                            shared.itl_ms
                        )
                    } else {
                        format!("{prefill_words}; decode {:.1} sequences: ITL {:.2} ms even alone, over the target: a worker per sequence", shared.sequences, shared.itl_ms)
                    };
                    (replicas, words)
                }
            };
            Proposal { pool: limits.pool.clone(), replicas, reason }
        })
        .collect()
}

/// An aggregated pool's size and what it runs at.
struct Shared {
    workers: u32,
    sequences: f64,
    utilization: f64,
    /// Share of steps carrying a prompt.
    prompt_steps: f64,
    /// The decode step, ms (corrected).
    itl_ms: f64,
    reached: bool,
}

/// The fewest workers that meet both targets with prefill and decode in
/// the same steps: prefill utilization within `cap`, the decode step at
/// their concurrency within the ITL target, and few enough steps carrying
/// a prompt that the percentile falls on a decode step.
fn aggregated(profile: &Profile, targets: &Targets, load: &Load, corrections: Corrections, prefill_work: f64, cap: f64) -> Shared {
    let context = decode_context(load);
    let first = (prefill_work / cap).ceil().max(1.0) as u32;
    let tail = (1.0 - targets.percentile() / 100.0) * TAIL_HEADROOM;
    let fastest = profile.itl_ms(context, 1.0) * corrections.itl;
    if fastest > targets.itl_ms() {
        // Not even a worker per sequence, without prefill, meets the
        // target: a worker per sequence.
        let sequences = load.request_rate * load.osl_mean * fastest / 1e3;
        let workers = first.max(sequences.ceil().min(f64::from(MOST_WORKERS)) as u32);
        let utilization = prefill_work / f64::from(workers);
        return Shared { workers, sequences, utilization, prompt_steps: prompt_steps(load.request_rate / f64::from(workers), fastest, utilization), itl_ms: fastest, reached: false };
    }
    for workers in first..=MOST_WORKERS.max(first) {
        let n = f64::from(workers);
        let utilization = prefill_work / n;
        // A few rounds of step time ↔ concurrency settle the fixed point
        // (a sequence's mean token time includes the prompts' steps).
        let mut itl_ms = fastest;
        let mut sequences = 0.0;
        for _ in 0..6 {
            sequences = load.request_rate * load.osl_mean * itl_ms / (1.0 - utilization) / 1e3;
            itl_ms = profile.itl_ms(context, (sequences / n).max(1.0)) * corrections.itl;
        }
        let share = prompt_steps(load.request_rate / n, itl_ms, utilization);
        if itl_ms <= targets.itl_ms() && share <= tail {
            return Shared { workers, sequences, utilization, prompt_steps: share, itl_ms, reached: true };
        }
    }
    Shared { workers: MOST_WORKERS, sequences: 0.0, utilization: 0.0, prompt_steps: 0.0, itl_ms: 0.0, reached: false }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint};
    use crate::targets::{PoolLimits, Predictor};

    fn profile() -> Profile {
        // TTFT alone 100 ms at 1,000 tokens; ITL 10 ms alone, 20 ms at 16 sequences, whatever the context.
        let decode = [(256, 1, 10.0), (256, 16, 20.0), (4096, 1, 10.0), (4096, 16, 20.0)]
            .into_iter()
            .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
            .collect();
        Profile { version: PROFILE_VERSION, worker: "test".into(), prefill: vec![PrefillPoint { isl: 100, ttft_ms: 10.0 }, PrefillPoint { isl: 1000, ttft_ms: 100.0 }], decode }.check("test").unwrap()
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
        // Prefill: 40 × 0.1 s = 4 workers of work; TTFT 100 of 200 ms allows 50%: 8 workers.
        assert_eq!(proposals[0].replicas, 8, "{}", proposals[0].reason);
        // Decode: 16 sequences per worker within 20 ms; 40 × 100 × 0.02 = 80 sequences: 5 workers.
        assert_eq!(proposals[1].replicas, 5, "{}", proposals[1].reason);
        // Aggregated: on 12 workers prefill takes a third of the time, 84
        // sequences decode 7 to a worker in 14 ms steps, and 7% of the steps
        // carry a prompt (p90's tail of 10% with headroom); on 11, 8.6%.
        let aggregated = propose(&profile(), &targets_aggregated(), &load, Corrections::default());
        assert_eq!(aggregated[0].replicas, 12, "{:?}", aggregated[0]);
        assert!(aggregated[0].reason.contains("at 33% prefill, 7.0% of steps with a prompt (decode step 13.99 ms"), "{:?}", aggregated[0]);
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
        let seen = |pool: &str, ttft_ms, itl_ms, replicas| Observation { pool: pool.into(), load, ttft_ms, itl_ms, queue_depth: 0.0, kv_usage: 0.0, replicas };
        let corrections = corrections(&profile(), &targets, &[seen("p", Some(300.0), None, 8), seen("d", None, Some(20.0), 5)]);
        assert!((corrections.ttft - 1.5).abs() < 1e-9, "{corrections:?}");
        // 40 × 100 × 0.02 / 5 = 16 sequences per decode worker: expected 20 ms, as observed.
        assert!((corrections.itl - 1.0).abs() < 1e-9, "{corrections:?}");
        let slower = propose(&profile(), &targets, &load, corrections);
        // The work is the profile's, 40 × 0.1 s = 4 workers; the TTFT as
        // observed (150 of 200 ms) allows 25%: 16.
        assert_eq!(slower[0].replicas, 16, "{}", slower[0].reason);
        assert_eq!(corrections_without_observations(&targets), Corrections::default());
    }

    #[test]
    fn an_aggregated_pool_keeps_its_percentile_on_decode_steps() {
        // ITL 10 ms at any concurrency: only the steps carrying prompts matter.
        let flat = [(256, 1, 10.0), (256, 16, 10.0), (4096, 1, 10.0), (4096, 16, 10.0)]
            .into_iter()
            .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
            .collect();
        let profile = Profile { decode: flat, ..profile() };
        let load = Load { request_rate: 40.0, isl_mean: 1000.0, osl_mean: 100.0 };
        let at = |percentile: f64, itl_ms: f64| {
            Targets::new(200.0, itl_ms, percentile, targets_aggregated().pools().to_vec(), 200, Duration::from_secs(30), Duration::from_secs(60), Predictor::Constant).unwrap()
        };
        // 4 workers of prefill; on n workers 40/n prompts a second in 10 ms
        // steps, in the 1 − 4/n of the time prefill leaves: at most 7% of
        // the steps (p90, with headroom) from n = 10.
        let p90 = &propose(&profile, &at(90.0, 20.0), &load, Corrections::default())[0];
        assert_eq!(p90.replicas, 10, "{}", p90.reason);
        assert!(p90.reason.contains("at 40% prefill, 6.7% of steps with a prompt"), "{}", p90.reason);
        // p99: at most 0.7% of the steps: 62.
        assert_eq!(propose(&profile, &at(99.0, 20.0), &load, Corrections::default())[0].replicas, 62);
        // A decode step alone over the target: a worker per sequence (40 × 100 × 0.025 = 100), said so.
        let hopeless = propose(&profile, &at(90.0, 12.5), &load, Corrections { ttft: 1.0, itl: 2.5 });
        assert_eq!(hopeless[0].replicas, 100, "{}", hopeless[0].reason);
        assert!(hopeless[0].reason.contains("over the target"), "{}", hopeless[0].reason);
        // Observed: on 10 workers (6.7% of the steps carry a prompt) the p90
        // is a decode step, 12 ms for the profile's 10: ×1.2. On 5 (40%)
        // it is a prompt's step, which says nothing of decoding: ×1.
        let seen = |itl_ms, replicas| Observation { pool: "a".into(), load, ttft_ms: None, itl_ms: Some(itl_ms), queue_depth: 0.0, kv_usage: 0.0, replicas };
        assert!((corrections(&profile, &targets_aggregated(), &[seen(12.0, 10)]).itl - 1.2).abs() < 1e-9);
        assert_eq!(corrections(&profile, &targets_aggregated(), &[seen(80.0, 5)]).itl, 1.0);
    }

    fn corrections_without_observations(targets: &Targets) -> Corrections {
        corrections(&profile(), targets, &[])
    }
}
