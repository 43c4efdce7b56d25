//! The kv-store's fair shares among tenants ([`FairShare`], in
//! `turbine-kv`, which a worker's tiers keep too): the memory and disk
//! tiers each keep such books, and count here what they evicted for
//! fairness.

pub use turbine_kv::fair::{EVICTIONS_PER_PUT, FairShare};

static EVICTIONS: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_kv_store_fair_share_evictions_total",
        "Blocks a tier evicted because their tenant held more than its fair share (the tier's capacity over the tenants holding blocks) when a put needed room; counted in the tier's evicted blocks too",
        &["tier"],
    )
});

/// Counts a block `tier` evicted for fairness.
pub fn evicted(tier: &str) {
    EVICTIONS.with_label_values(&[tier]).inc();
}

/// Blocks `tier` evicted for fairness since start.
pub fn evictions(tier: &str) -> u64 {
    EVICTIONS.with_label_values(&[tier]).get()
}
