//! Constraining proposals into what the connector is asked for:
//!
//! 1. each pool within its min and max replicas;
//! 2. a pool scaled less than a cool-down ago does not scale down: it
//!    keeps at least the replicas last decided (a worker that exited since
//!    is still replaced). A scale-up is not held: a pool under its load
//!    misses its targets every interval it waits, while what the cool-down
//!    guards against is a fleet that shrinks right after it grew (or
//!    twice in a row) on one interval's noise;
//! 3. the pools together within the budget: scale-ups are cut first
//!    (largest first), then pools above their minimum, largest first.
//!
//! At most one action per pool per interval follows by construction (one
//! decision per interval, one action per pool in it). Scaling down is the
//! connector's drain: the worker leaves the registry first.

use std::collections::HashMap;

use crate::plan::Targets;
use crate::plan::propose::Proposal;

/// A pool's size going in: what runs and what was last decided. They
/// differ when a worker exited by itself (a crash), or when the connector
/// cannot tell what runs (then both are the decided size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolSize {
    /// Replicas the fleet is at (or being moved to by a pending action).
    pub running: u32,
    /// Replicas the latest decision asked for.
    pub decided: u32,
}

/// One pool after the constraints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Constrained {
    /// The pool.
    pub pool: String,
    /// Replicas the fleet is at or being moved to (what runs).
    pub current: u32,
    /// What the profile proposed.
    pub proposed: u32,
    /// What the connector is asked for.
    pub desired: u32,
    /// Why, in words: the proposal's numbers and each constraint that bound.
    pub reason: String,
}

/// `proposals` constrained by `targets`, given each pool's `current` size
/// and when it was last scaled (ms since the epoch), at `now`.
pub fn constrain(
    targets: &Targets,
    proposals: &[Proposal],
    current: &HashMap<String, PoolSize>,
    last_scaled: &HashMap<String, i64>,
    now_unix_ms: i64,
) -> Vec<Constrained> {
    let cooldown_ms = targets.cooldown().as_millis() as i64;
    let mut pools: Vec<Constrained> = targets
        .pools()
        .iter()
        .map(|limits| {
            let proposal = proposals.iter().find(|proposal| proposal.pool == limits.pool);
            let proposed = proposal.map_or(limits.min_replicas, |proposal| proposal.replicas);
            let size = current.get(&limits.pool).copied().unwrap_or_default();
            let now = size.running;
            let mut reason = proposal.map_or_else(|| "no proposal".to_owned(), |proposal| proposal.reason.clone());
            if size.running != size.decided {
                reason += &format!("; {} runs {}, not the {} decided (workers exited by themselves)", limits.pool, size.running, size.decided);
            }
            let mut desired = proposed.clamp(limits.min_replicas, limits.max_replicas);
            if desired != proposed {
                let bound = if desired > proposed { "raised to min_replicas" } else { "capped at max_replicas" };
                reason += &format!("; {bound} {desired}");
            }
            // The cool-down holds what was decided, not what runs: a worker
            // that exited is replaced at once.
            let held = size.decided.clamp(limits.min_replicas, limits.max_replicas);
            if desired < held
                && let Some(&at) = last_scaled.get(&limits.pool)
                && now_unix_ms - at < cooldown_ms
            {
                let left = (cooldown_ms - (now_unix_ms - at)).max(0) as f64 / 1e3;
                reason += &format!("; cool-down: scaled {:.0} s ago, {left:.0} s left, holding {held}", (now_unix_ms - at) as f64 / 1e3);
                desired = held;
            }
            Constrained { pool: limits.pool.clone(), current: now, proposed, desired, reason }
        })
        .collect();
    let budget = targets.budget_workers();
    let total = |pools: &[Constrained]| pools.iter().map(|pool| u64::from(pool.desired)).sum::<u64>();
    let over = total(&pools).saturating_sub(u64::from(budget));
    if over > 0 {
        let minimum = |pool: &Constrained| targets.pools().iter().find(|limits| limits.pool == pool.pool).map_or(0, |limits| limits.min_replicas);
        for _ in 0..over {
            // A scale-up first (the largest), else the largest pool above its minimum.
            let cut = pools
                .iter()
                .enumerate()
                .filter(|(_, pool)| pool.desired > pool.current.max(minimum(pool)))
                .max_by_key(|(_, pool)| pool.desired - pool.current)
                .or_else(|| pools.iter().enumerate().filter(|(_, pool)| pool.desired > minimum(pool)).max_by_key(|(_, pool)| pool.desired))
                .map(|(index, _)| index);
            let Some(index) = cut else { break };
            pools[index].desired -= 1;
        }
        for pool in pools.iter_mut().filter(|pool| pool.desired < pool.proposed.clamp(minimum(pool), u32::MAX)) {
            if !pool.reason.contains("budget") {
                pool.reason += &format!("; cut to {} by the budget of {budget} workers", pool.desired);
            }
        }
    }
    pools
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::plan::{PoolKind, PoolLimits, Predictor};

    fn targets(budget: u32) -> Targets {
        let pool = |name: &str, kind, min, max| PoolLimits { pool: name.into(), kind, min_replicas: min, max_replicas: max };
        Targets::new(
            200.0,
            20.0,
            90.0,
            vec![pool("p", PoolKind::Prefill, 1, 6), pool("d", PoolKind::Decode, 2, 10)],
            budget,
            Duration::from_secs(30),
            Duration::from_secs(60),
            Predictor::Constant,
        )
        .unwrap()
    }

    fn proposals(prefill: u32, decode: u32) -> Vec<Proposal> {
        vec![
            Proposal { pool: "p".into(), replicas: prefill, reason: "profile".into() },
            Proposal { pool: "d".into(), replicas: decode, reason: "profile".into() },
        ]
    }

    fn steady(replicas: u32) -> PoolSize {
        PoolSize { running: replicas, decided: replicas }
    }

    fn current(prefill: u32, decode: u32) -> HashMap<String, PoolSize> {
        HashMap::from([("p".to_owned(), steady(prefill)), ("d".to_owned(), steady(decode))])
    }

    fn desired(pools: &[Constrained]) -> Vec<u32> {
        pools.iter().map(|pool| pool.desired).collect()
    }

    #[test]
    fn bounds_cool_down_and_budget_bind_in_turn_and_say_so() {
        let none = HashMap::new();
        // Within bounds.
        assert_eq!(desired(&constrain(&targets(20), &proposals(3, 4), &current(2, 4), &none, 0)), [3, 4]);
        // Min and max.
        let bounded = constrain(&targets(20), &proposals(0, 50), &current(2, 4), &none, 0);
        assert_eq!(desired(&bounded), [1, 10]);
        assert!(bounded[0].reason.contains("raised to min_replicas 1") && bounded[1].reason.contains("capped at max_replicas 10"));
        // Cool-down: prefill scaled 20 s ago does not scale down; decode
        // scaled 90 s ago does.
        let scaled = HashMap::from([("p".to_owned(), 100_000), ("d".to_owned(), 30_000)]);
        let cooling = constrain(&targets(20), &proposals(1, 3), &current(2, 4), &scaled, 120_000);
        assert_eq!(desired(&cooling), [2, 3]);
        assert!(cooling[0].reason.contains("cool-down: scaled 20 s ago, 40 s left"), "{}", cooling[0].reason);
        // Within it, a scale-up is not held.
        assert_eq!(desired(&constrain(&targets(20), &proposals(5, 6), &current(2, 4), &scaled, 120_000)), [5, 6]);
        // Budget 8: the scale-ups are cut, the largest first.
        let cut = constrain(&targets(8), &proposals(5, 6), &current(2, 4), &none, 0);
        assert_eq!(desired(&cut), [3, 5]);
        assert!(cut[0].reason.contains("budget of 8"), "{}", cut[0].reason);
        // Budget below what runs: pools above their minimum shrink, largest first.
        assert_eq!(desired(&constrain(&targets(5), &proposals(3, 6), &current(3, 6), &none, 0)), [3, 2]);
    }

    #[test]
    fn workers_that_exited_are_replaced_even_in_a_cool_down() {
        // Decode decided 4 but runs 2 (two crashed); both pools scaled 20 s ago.
        let crashed = HashMap::from([("p".to_owned(), steady(2)), ("d".to_owned(), PoolSize { running: 2, decided: 4 })]);
        let scaled = HashMap::from([("p".to_owned(), 100_000), ("d".to_owned(), 100_000)]);
        let pools = constrain(&targets(20), &proposals(1, 3), &crashed, &scaled, 120_000);
        assert_eq!(desired(&pools), [2, 4], "the cool-down holds the decided sizes, and decode gets its workers back");
        assert_eq!(pools[1].current, 2);
        assert!(pools[1].reason.contains("d runs 2, not the 4 decided") && pools[1].reason.contains("holding 4"), "{}", pools[1].reason);
        // Out of the cool-down the proposal moves it as usual.
        assert_eq!(desired(&constrain(&targets(20), &proposals(2, 3), &crashed, &HashMap::new(), 120_000)), [2, 3]);
        // A budget of 5 cuts the replacement like any scale-up.
        assert_eq!(desired(&constrain(&targets(5), &proposals(2, 4), &crashed, &HashMap::new(), 0)), [2, 3]);
    }
}
