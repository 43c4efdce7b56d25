//! Router metrics.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{HistogramVec, IntCounterVec, IntGaugeVec};
use turbine_runtime::metrics::{counter, gauge, histogram};

use crate::policy::Policy;

static DECISIONS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_router_decisions_total", "Routing decisions by policy and outcome", &["policy", "outcome"]));
static DECISION_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "turbine_router_decision_seconds",
        "Time to choose a worker",
        &["policy"],
        vec![0.000_001, 0.000_005, 0.00001, 0.000_025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.005, 0.01],
    )
});
static WORKERS: LazyLock<IntGaugeVec> = LazyLock::new(|| gauge("turbine_router_live_workers", "Live workers by model", &["model"]));
static IN_FLIGHT: LazyLock<IntGaugeVec> = LazyLock::new(|| gauge("turbine_router_in_flight_requests", "Requests booked against each worker", &["worker"]));

static KV_OVERLAP: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "turbine_router_kv_overlap_ratio",
        "Share of each kv-routed prompt's blocks the chosen worker caches",
        &[],
        vec![0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0],
    )
});
static KV_BLOCKS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_router_kv_prompt_blocks_total", "Prompt blocks of kv-routed requests, cached on the chosen worker or not", &["cached"]));

static KV_INDEX_ERRORS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_router_kv_index_errors_total", "kv decisions routed by load alone because the kv-index could not answer", &["reason"]));

/// Counts a kv decision the kv-index could not serve.
pub(crate) fn kv_index_error(reason: &'static str) {
    KV_INDEX_ERRORS.with_label_values(&[reason]).inc();
}

/// Records one kv decision's overlap.
pub(crate) fn kv_overlap(overlap_blocks: u32, prompt_blocks: u32) {
    if prompt_blocks > 0 {
        KV_OVERLAP.with_label_values(&[] as &[&str]).observe(f64::from(overlap_blocks) / f64::from(prompt_blocks));
    }
    KV_BLOCKS.with_label_values(&["true"]).inc_by(overlap_blocks.into());
    KV_BLOCKS.with_label_values(&["false"]).inc_by(prompt_blocks.saturating_sub(overlap_blocks).into());
}

/// Counts and times one decision; `outcome` is `routed` or the error's.
pub(crate) fn decision(policy: Policy, outcome: &str, elapsed: Duration) {
    DECISIONS.with_label_values(&[policy.name(), outcome]).inc();
    DECISION_SECONDS.with_label_values(&[policy.name()]).observe(elapsed.as_secs_f64());
}

/// Publishes the live worker set, `(model, worker, in flight)` each
/// (called after each registry poll).
pub(crate) fn workers<'a>(workers: impl IntoIterator<Item = (&'a str, &'a str, u32)>) {
    WORKERS.reset();
    IN_FLIGHT.reset();
    for (model, worker, in_flight) in workers {
        WORKERS.with_label_values(&[model]).inc();
        IN_FLIGHT.with_label_values(&[worker]).set(in_flight.into());
    }
}

/// Publishes one worker's booking count as it changes.
pub(crate) fn in_flight(worker_id: &str, count: u32) {
    IN_FLIGHT.with_label_values(&[worker_id]).set(count.into());
}

static DISAGG: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_router_prefill_decisions_total",
        "Where prompts were computed: remote (a prefill worker), local (the decode worker: short prompt or saturated prefill pool), aggregated (no prefill workers)",
        &["where"],
    )
});

pub(crate) fn disagg_decision(place: &str) {
    DISAGG.with_label_values(&[place]).inc();
}
