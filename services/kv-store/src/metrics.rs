//! The store's sizes and counters as Prometheus metrics, read from
//! [`Store::stats`] when scraped (`/metrics` on the admin port): per tier
//! (`tier="memory"` or `"disk"`) blocks, bytes, capacity, evictions,
//! corrupt blocks dropped and failed disk writes; puts, gets and misses.

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts};
use turbine_runtime::metrics::{CollectorGuard, register_collector};

use crate::store::{Store, TierUsage};

/// Reads a [`Store`]'s statistics at scrape time.
pub struct StoreCollector {
    store: Store,
    blocks: IntGaugeVec,
    bytes: IntGaugeVec,
    capacity_bytes: IntGaugeVec,
    evicted_blocks: IntCounterVec,
    corrupt_blocks: IntCounterVec,
    write_failures: IntCounterVec,
    put_blocks: IntCounterVec,
    get_blocks: IntCounterVec,
    misses: IntCounterVec,
    fingerprints: IntGauge,
    descs: Vec<Desc>,
}

impl StoreCollector {
    /// A collector over `store`.
    pub fn new(store: Store) -> Self {
        let tier_gauge = |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["tier"]).expect("valid gauge");
        let tier_count = |name: &str, help: &str| IntCounterVec::new(Opts::new(name, help), &["tier"]).expect("valid counter");
        let count = |name: &str, help: &str| IntCounterVec::new(Opts::new(name, help), &[]).expect("valid counter");
        let mut collector = Self {
            store,
            blocks: tier_gauge("turbine_kv_store_blocks", "KV blocks held in a tier of the store"),
            bytes: tier_gauge("turbine_kv_store_bytes", "Bytes held in a tier of the store (memory: blocks and their bookkeeping; disk: files)"),
            capacity_bytes: tier_gauge("turbine_kv_store_capacity_bytes", "Bytes a tier of the store may hold"),
            evicted_blocks: tier_count("turbine_kv_store_evicted_blocks_total", "KV blocks evicted from a tier of the store for room"),
            corrupt_blocks: tier_count("turbine_kv_store_corrupt_blocks_total", "KV blocks found corrupt in a tier of the store (dropped, never served)"),
            write_failures: tier_count("turbine_kv_store_write_failures_total", "Blocks a tier of the store could not write (disk: full or failing)"),
            put_blocks: count("turbine_kv_store_put_blocks_total", "KV blocks stored by puts"),
            get_blocks: count("turbine_kv_store_get_blocks_total", "KV blocks served by gets"),
            misses: count("turbine_kv_store_misses_total", "Sequence hashes asked for that the store did not hold"),
            fingerprints: IntGauge::new("turbine_kv_store_fingerprints", "Model and KV layout fingerprints with blocks in memory").expect("valid gauge"),
            descs: Vec::new(),
        };
        collector.descs = collector.metrics().iter().flat_map(|metric| metric.desc().into_iter().cloned()).collect();
        collector
    }

    fn metrics(&self) -> [&dyn Collector; 10] {
        [
            &self.blocks,
            &self.bytes,
            &self.capacity_bytes,
            &self.evicted_blocks,
            &self.corrupt_blocks,
            &self.write_failures,
            &self.put_blocks,
            &self.get_blocks,
            &self.misses,
            &self.fingerprints,
        ]
    }

    fn update(&self) {
        let stats = self.store.stats();
        let mut tiers = vec![("memory", stats.memory, 0)];
        if let Some(disk) = self.store.disk() {
            tiers.push(("disk", stats.disk, disk.write_failures()));
        }
        for (tier, TierUsage { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks }, write_failures) in tiers {
            self.blocks.with_label_values(&[tier]).set(blocks as i64);
            self.bytes.with_label_values(&[tier]).set(bytes as i64);
            self.capacity_bytes.with_label_values(&[tier]).set(capacity_bytes as i64);
            set_counter(&self.evicted_blocks, &[tier], evicted_blocks);
            set_counter(&self.corrupt_blocks, &[tier], corrupt_blocks);
            set_counter(&self.write_failures, &[tier], write_failures);
        }
        set_counter(&self.put_blocks, &[], stats.put_blocks);
        set_counter(&self.get_blocks, &[], stats.get_blocks);
        set_counter(&self.misses, &[], stats.misses);
        self.fingerprints.set(i64::from(stats.fingerprints));
    }
}

/// Raises a counter to `total` (the store's counters only grow).
fn set_counter(counter: &IntCounterVec, labels: &[&str], total: u64) {
    let counter = counter.with_label_values(labels);
    let current = counter.get();
    if total > current {
        counter.inc_by(total - current);
    }
}

impl Collector for StoreCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.update();
        self.metrics().iter().flat_map(|metric| metric.collect()).collect()
    }
}

/// Registers a collector for `store` until the guard drops. A process
/// holds one store; a second one (tests that start several) is served
/// without metrics, with a warning.
pub fn register(store: Store) -> CollectorGuard {
    register_collector(StoreCollector::new(store), "kv-store")
}
