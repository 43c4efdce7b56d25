//! The planner's metrics (`/metrics` on the admin port): per pool, the
//! replicas asked for, observed and draining; each interval's SLA outcome
//! (`sla="met"`, `"missed"`, or `"idle"` when too few requests gave a latency),
//! so attainment is `rate(..{sla="met"}) / rate(..{sla!="idle"})`; the
//! decisions made and how the connector ended their actions.

use std::sync::LazyLock;

use prometheus::{IntCounterVec, IntGaugeVec};
use turbine_runtime::metrics::{counter, gauge};

use crate::act::connector::Outcome;
use crate::plan::Decision;
use crate::plan::Targets;

static DESIRED: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge("turbine_planner_desired_replicas", "Replicas the latest decision asked for, per pool", &["pool"]));
static OBSERVED: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge("turbine_planner_observed_replicas", "Replicas serving in the latest interval, per pool (from the registry)", &["pool"]));
static DRAINING: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge("turbine_planner_draining_replicas", "Replicas the local connector is draining, per pool", &["pool"]));
static INTERVALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_planner_intervals_total",
        "Intervals observed per pool, by SLA outcome: met (TTFT and ITL at the targets' percentile within target), missed, or idle (fewer than ten requests: no percentile)",
        &["pool", "sla"],
    )
});
static DECISIONS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_planner_decisions_total", "Decisions made, by whether acting was paused", &["paused"]));
static ACTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter("turbine_planner_actions_total", "Actions handed to the connector, by outcome: done, failed or awaiting (a report)", &["outcome"])
});

/// How an interval's latencies compare with `targets`.
pub fn sla_outcome(targets: &Targets, ttft_ms: Option<f64>, itl_ms: Option<f64>) -> &'static str {
    let within = |observed: Option<f64>, target: f64| observed.map(|observed| observed <= target);
    match (within(ttft_ms, targets.ttft_ms()), within(itl_ms, targets.itl_ms())) {
        (None, None) => "idle",
        (Some(false), _) | (_, Some(false)) => "missed",
        _ => "met",
    }
}

/// Counts `decision` (made under `targets`) and sets the replica gauges.
pub fn record_decision(targets: &Targets, decision: &Decision) {
    DECISIONS.with_label_values(&[if decision.paused { "true" } else { "false" }]).inc();
    for pool in &decision.pools {
        DESIRED.with_label_values(&[pool.pool.as_str()]).set(i64::from(pool.desired_replicas));
    }
    for seen in &decision.observed {
        OBSERVED.with_label_values(&[seen.pool.as_str()]).set(i64::from(seen.replicas));
        INTERVALS.with_label_values(&[seen.pool.as_str(), sla_outcome(targets, seen.ttft_ms, seen.itl_ms)]).inc();
    }
}

/// Counts how the connector ended an action.
pub fn record_outcome(outcome: &Outcome) {
    let label = match outcome {
        Outcome::Done(_) => "done",
        Outcome::Awaiting(_) => "awaiting",
        Outcome::Failed(_) => "failed",
    };
    ACTIONS.with_label_values(&[label]).inc();
}

/// Sets the replicas `pool` has draining.
pub fn set_draining(pool: &str, replicas: u32) {
    DRAINING.with_label_values(&[pool]).set(i64::from(replicas));
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::plan::{PoolKind, PoolLimits, Predictor};

    #[test]
    fn an_interval_meets_the_sla_when_every_latency_seen_is_within_target() {
        let pool = PoolLimits { pool: "a".into(), kind: PoolKind::Aggregated, min_replicas: 0, max_replicas: 4 };
        let targets = Targets::new(200.0, 20.0, 90.0, vec![pool], 4, Duration::from_secs(30), Duration::from_secs(60), Predictor::Constant).unwrap();
        assert_eq!(sla_outcome(&targets, None, None), "idle");
        assert_eq!(sla_outcome(&targets, Some(200.0), Some(20.0)), "met");
        assert_eq!(sla_outcome(&targets, Some(150.0), None), "met");
        assert_eq!(sla_outcome(&targets, Some(201.0), Some(10.0)), "missed");
        assert_eq!(sla_outcome(&targets, None, Some(25.0)), "missed");
    }
}
