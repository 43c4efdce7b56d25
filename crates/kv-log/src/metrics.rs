//! Metrics of an index replica that follows the event log.

use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus::{IntCounterVec, IntGaugeVec};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turbine_kv::KvIndex;
use turbine_runtime::metrics::{counter, gauge};

use crate::FollowerStatus;

static EVENTS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_kv_events_applied_total", "KV events applied to this process's index replica", &["component"]));
static BATCHES: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_kv_event_batches_total", "Event-log entries read by this process's index replica", &["component"]));
static RESYNCS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_kv_resyncs_total", "Worker dumps loaded after a gap or a worker restart", &["component"]));
static REACHABLE: LazyLock<IntGaugeVec> =
    LazyLock::new(|| gauge("turbine_kv_event_log_reachable", "1 while the last read of the KV event log succeeded", &["component"]));
static WORKERS: LazyLock<IntGaugeVec> = LazyLock::new(|| gauge("turbine_kv_index_workers", "Workers with a view in the index replica", &["component"]));
static BLOCKS: LazyLock<IntGaugeVec> = LazyLock::new(|| gauge("turbine_kv_index_blocks", "Distinct blocks in the index replica", &["component"]));

/// Publishes `status` and the size of `index` every second, labelled
/// `component` (e.g. "router", "kv-index"), until `shutdown`.
pub fn export_metrics(component: &'static str, index: Arc<KvIndex>, status: Arc<FollowerStatus>, shutdown: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let labels = [component];
        let (mut events, mut batches, mut resyncs) = (0, 0, 0);
        loop {
            let counters = [
                (&*EVENTS, &mut events, status.events.load(Ordering::Relaxed)),
                (&*BATCHES, &mut batches, status.batches.load(Ordering::Relaxed)),
                (&*RESYNCS, &mut resyncs, status.resyncs.load(Ordering::Relaxed)),
            ];
            for (family, seen, now) in counters {
                family.with_label_values(&labels).inc_by(now.saturating_sub(*seen));
                *seen = now;
            }
            REACHABLE.with_label_values(&labels).set(i64::from(status.reachable()));
            let stats = index.stats();
            WORKERS.with_label_values(&labels).set(stats.workers as i64);
            BLOCKS.with_label_values(&labels).set(stats.nodes as i64);
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = shutdown.cancelled() => return,
            }
        }
    })
}
