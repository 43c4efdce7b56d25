//! Prometheus metrics: every service registers into the process-wide default
//! registry (services in one process use distinct metric names, and
//! per-instance labels where several instances share a process).

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, TextEncoder};

/// Renders every registered metric in the Prometheus text format.
pub fn render() -> String {
    let mut buffer = Vec::new();
    let families = prometheus::gather();
    if let Err(error) = TextEncoder::new().encode(&families, &mut buffer) {
        tracing::warn!(%error, "metrics encoding failed");
    }
    String::from_utf8(buffer).unwrap_or_default()
}

/// Registers a counter family. Call once per process (e.g. from a `LazyLock`).
pub fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let counter = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter definition");
    prometheus::register(Box::new(counter.clone())).expect("counter registered once");
    counter
}

/// Registers a gauge family. Call once per process.
pub fn gauge(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let gauge = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid gauge definition");
    prometheus::register(Box::new(gauge.clone())).expect("gauge registered once");
    gauge
}

/// Registers a histogram family with `buckets` (seconds). Call once per process.
pub fn histogram(name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
    let histogram = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).expect("valid histogram definition");
    prometheus::register(Box::new(histogram.clone())).expect("histogram registered once");
    histogram
}

/// Latency buckets from 100 µs to 60 s.
pub fn latency_buckets() -> Vec<f64> {
    vec![0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
}

/// Latency buckets fine enough to read a percentile from (each 15% above
/// the one before, 1 ms to ~100 s: a percentile interpolated within a
/// bucket is off by at most ~7%), for the latencies targets are set on
/// (TTFT, ITL) and the planner reads.
pub fn slo_latency_buckets() -> Vec<f64> {
    std::iter::successors(Some(0.001_f64), |bound| Some(bound * 1.15)).take_while(|bound| *bound <= 100.0).collect()
}

/// Registers `collector` (one that reads an instance's statistics when
/// scraped) until the returned guard drops. A collector whose metrics are
/// already registered (a second instance with the same labels in this
/// process) is left out, with a warning naming `what`.
pub fn register_collector<C: Collector + 'static>(collector: C, what: &str) -> CollectorGuard {
    let descs: Vec<Desc> = collector.desc().into_iter().cloned().collect();
    match prometheus::register(Box::new(collector)) {
        Ok(()) => CollectorGuard { registered: Some(descs) },
        Err(error) => {
            tracing::warn!(%error, "{what} metrics not registered");
            CollectorGuard { registered: None }
        }
    }
}

/// Unregisters a collector when dropped.
pub struct CollectorGuard {
    registered: Option<Vec<Desc>>,
}

impl std::fmt::Debug for CollectorGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectorGuard").field("registered", &self.registered.is_some()).finish()
    }
}

impl Drop for CollectorGuard {
    fn drop(&mut self) {
        if let Some(descs) = self.registered.take() {
            // The registry finds a collector by its descriptors.
            let _ = prometheus::unregister(Box::new(DescriptorsOnly(descs)));
        }
    }
}

/// Stands in for a registered collector when unregistering it.
struct DescriptorsOnly(Vec<Desc>);

impl Collector for DescriptorsOnly {
    fn desc(&self) -> Vec<&Desc> {
        self.0.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        Vec::new()
    }
}
