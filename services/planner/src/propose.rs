//! Proposing replicas per pool for a forecast load, from the profile,
//! corrected by how the deployment's latencies compare with what the
//! profile expected of it.
//!
//! - **Prefill** (and an aggregated pool's prefill share): a request's
//!   prompt keeps a worker busy for the profile's time to first token at
//!   that input length, so the load is `rate × ttft` workers' worth of
//!   prefill. Queueing stretches the time to first token roughly as
//!   `ttft / (1 − utilization)`, so meeting the target allows a
//!   utilization of at most `1 − ttft / target` (kept within 5% and 90%).
//! - **Decode**: the profile says how many sequences a worker decodes
//!   together within the ITL target at the load's context (input plus half
//!   the output). By Little's law `rate × osl × itl` sequences decode at
//!   once; divided by that concurrency, the decode workers.
//! - **Aggregated**: both shares on the same workers, added.
//!
//! The corrections are the observed latency over the profile's expectation
//! at the observed load and replicas (each within ×0.25 to ×4; ×1 without
//! an observation): a deployment slower than its profile gets more
//! workers.

use crate::decision::Observation;
use crate::predict::Load;
use crate::profile::Profile;
use crate::targets::{PoolKind, Targets};

/// Bounds of the prefill utilization the planner sizes for.
const UTILIZATION: (f64, f64) = (0.05, 0.9);

/// Bounds of a correction.
const CORRECTION: (f64, f64) = (0.25, 4.0);

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
        let concurrency = (seen.load.request_rate * seen.load.osl_mean * itl / 1e3 / f64::from(seen.replicas)).max(1.0);
        let expected = profile.itl_ms(decode_context(&seen.load), concurrency);
        corrections.itl = (itl / expected).clamp(CORRECTION.0, CORRECTION.1);
    }
    corrections
}

/// Replicas per pool of `targets` for `load`.
pub fn propose(profile: &Profile, targets: &Targets, load: &Load, corrections: Corrections) -> Vec<Proposal> {
    // Prefill: workers' worth of work, and the utilization the TTFT target allows.
    let ttft = profile.ttft_ms(load.isl_mean) * corrections.ttft;
    let prefill_work = load.request_rate * ttft / 1e3;
    let cap = utilization_cap(ttft, targets.ttft_ms());
    let prefill = prefill_work / cap;
    // Decode: sequences decoding at once, and how many a worker takes within the ITL target.
    let context = decode_context(load);
    let per_worker = profile.concurrency_within(context, targets.itl_ms() / corrections.itl);
    let itl = profile.itl_ms(context, per_worker) * corrections.itl;
    let sequences = load.request_rate * load.osl_mean * itl / 1e3;
    let decode = sequences / per_worker;
    let unreachable = if ttft >= targets.ttft_ms() { " (the profile's TTFT alone is over the target: sized at the lowest utilization)" } else { "" };
    let whole = |workers: f64| if load.request_rate > 0.0 { workers.ceil().max(1.0) as u32 } else { 0 };
    targets
        .pools()
        .iter()
        .map(|limits| {
            let prefill_words = format!("prefill {prefill_work:.2} workers of work at {:.0}% utilization (TTFT {ttft:.1} ms alone){unreachable}", cap * 100.0);
            let decode_words = format!("decode {sequences:.1} sequences at {per_worker:.1} per worker (ITL {itl:.2} ms at context {context:.0})");
            let (replicas, reason) = match limits.kind {
                PoolKind::Prefill => (whole(prefill), prefill_words),
                PoolKind::Decode => (whole(decode), decode_words),
                PoolKind::Aggregated => (whole(prefill + decode), format!("{prefill_words}; {decode_words}")),
            };
            Proposal { pool: limits.pool.clone(), replicas, reason }
        })
        .collect()
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
        // Aggregated: both shares on one pool.
        let aggregated = propose(&profile(), &targets_aggregated(), &load, Corrections::default());
        assert_eq!(aggregated[0].replicas, 13);
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
        // 40 × 0.15 s = 6 workers of work at 25% (150 of 200 ms): 24.
        assert_eq!(slower[0].replicas, 24, "{}", slower[0].reason);
        assert_eq!(corrections_without_observations(&targets), Corrections::default());
    }

    fn corrections_without_observations(targets: &Targets) -> Corrections {
        corrections(&profile(), targets, &[])
    }
}
