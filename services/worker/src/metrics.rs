//! Worker metrics: request counters and latencies, plus the engine's own
//! counters and gauges read at scrape time (one set per worker, labelled by
//! worker id, so several workers can share a process).

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, GaugeVec, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts};
use turbine_engine::{EngineError, EngineHandle};
use turbine_runtime::metrics::{CollectorGuard, counter, histogram, latency_buckets, register_collector};

static REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| counter("turbine_worker_requests_total", "Generate calls by outcome", &["worker", "outcome"]));
static TIME_TO_FIRST_TOKEN: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram("turbine_worker_time_to_first_token_seconds", "Time from accepting a request to its first tokens", &["worker"], latency_buckets())
});
static REQUEST_DURATION: LazyLock<HistogramVec> =
    LazyLock::new(|| histogram("turbine_worker_request_duration_seconds", "Time from accepting a request to its last token", &["worker"], latency_buckets()));

pub(crate) fn request_refused(worker: &str, error: &EngineError) {
    let outcome = match error {
        EngineError::InvalidRequest(_) => "invalid",
        EngineError::Overloaded(_) => "overloaded",
        EngineError::ShuttingDown => "shutting_down",
        EngineError::Executor(_) => "failed",
    };
    REQUESTS.with_label_values(&[worker, outcome]).inc();
}

pub(crate) fn first_token(worker: &str, elapsed: Duration) {
    TIME_TO_FIRST_TOKEN.with_label_values(&[worker]).observe(elapsed.as_secs_f64());
}

pub(crate) fn request_finished(worker: &str, elapsed: Duration) {
    REQUESTS.with_label_values(&[worker, "finished"]).inc();
    REQUEST_DURATION.with_label_values(&[worker]).observe(elapsed.as_secs_f64());
}

/// Counts a stream's first token and its end, as they pass.
pub(crate) fn observe_stream(worker_id: turbine_kv::WorkerId, chunks: turbine_api::worker::TokenStream) -> turbine_api::worker::TokenStream {
    use futures::StreamExt;
    let (started, mut first) = (std::time::Instant::now(), true);
    Box::pin(chunks.inspect(move |chunk| {
        if std::mem::take(&mut first) {
            first_token(&worker_id, started.elapsed());
        }
        if let Ok(turbine_api::worker::TokenChunk { finished: Some(_), .. }) = chunk {
            request_finished(&worker_id, started.elapsed());
        }
    }))
}

static UPSTREAM_HEALTHY: LazyLock<prometheus::IntGaugeVec> = LazyLock::new(|| {
    turbine_runtime::metrics::gauge(
        "turbine_worker_upstream_healthy",
        "1 while the external engine a worker fronts answers its health checks, else 0",
        &["worker"],
    )
});

pub(crate) fn upstream_healthy(worker: &str, healthy: bool) {
    UPSTREAM_HEALTHY.with_label_values(&[worker]).set(i64::from(healthy));
}

static UPSTREAM_KV_UNMAPPED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_worker_upstream_kv_blocks_unmapped_total",
        "Blocks an external engine reported stored that Turbine could not hash (a parent stored before the worker listened, a salt or LoRA it did not send, another block size): not credited to the worker",
        &["worker"],
    )
});
static UPSTREAM_KV_GAPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_worker_upstream_kv_event_gaps_total",
        "Gaps in an external engine's KV event numbering (events lost): the worker's mirror of its cache was cleared",
        &["worker"],
    )
});

pub(crate) fn upstream_kv_blocks_unmapped(worker: &str, blocks: usize) {
    UPSTREAM_KV_UNMAPPED.with_label_values(&[worker]).inc_by(blocks as u64);
}

pub(crate) fn upstream_kv_event_gap(worker: &str) {
    UPSTREAM_KV_GAPS.with_label_values(&[worker]).inc();
}

static UPSTREAM_KV_REPLAYS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_worker_upstream_kv_event_replays_total",
        "Times the worker asked an external engine's replay socket for the KV events it missed (a reconnect, a gap), by outcome: filled (the mirror continues) or failed (it is cleared)",
        &["worker", "outcome"],
    )
});

pub(crate) fn upstream_kv_event_replay(worker: &str, outcome: &str) {
    UPSTREAM_KV_REPLAYS.with_label_values(&[worker, outcome]).inc();
}

/// Exposes one engine's statistics, read when scraped.
pub struct EngineCollector {
    engine: EngineHandle,
    running: IntGauge,
    waiting: IntGauge,
    blocks_used: IntGauge,
    blocks_total: IntGauge,
    steps: IntCounter,
    generated: IntCounter,
    prefill: IntCounter,
    cached: IntCounter,
    preemptions: IntCounter,
    pool_fair_share_evictions: IntCounter,
    onboarded: IntCounter,
    host: Option<TierMetrics>,
    disk: Option<TierMetrics>,
    /// The shared tier: its counters (what the store holds is in the
    /// kv-store's own Stats; the gauges stay 0 here).
    remote: Option<TierMetrics>,
    fetch: Option<FetchMetrics>,
    descs: Vec<Desc>,
}

/// The fetch-or-recompute decision's inputs and counts.
struct FetchMetrics {
    decisions: IntCounterVec,
    fixed_seconds: GaugeVec,
    block_seconds: GaugeVec,
    held_ratio: GaugeVec,
    step_seconds: Gauge,
    token_seconds: Gauge,
}

impl FetchMetrics {
    fn new(worker_id: &str) -> Self {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("worker", worker_id);
        let tier_gauge = |name: &str, help: &str| GaugeVec::new(opts(name, help), &["tier"]).expect("valid gauge");
        let gauge = |name: &str, help: &str| Gauge::with_opts(opts(name, help)).expect("valid gauge");
        Self {
            decisions: IntCounterVec::new(
                opts(
                    "turbine_worker_kv_fetch_decisions_total",
                    "Requests whose prefix blocks in a tier were read (fetch), read only to measure the tier again (probe), or not read (skip: computed, or read from a faster tier)",
                ),
                &["tier", "decision"],
            )
            .expect("valid counter"),
            fixed_seconds: tier_gauge("turbine_worker_kv_fetch_fixed_seconds", "Predicted seconds a read from a tier costs whatever its size (its round trip)"),
            block_seconds: tier_gauge("turbine_worker_kv_fetch_block_seconds", "Predicted seconds per KV block read from a tier (block bytes over its bandwidth)"),
            held_ratio: tier_gauge("turbine_worker_kv_fetch_held_ratio", "Share of the blocks asked of a tier that it held (recent reads)"),
            step_seconds: gauge("turbine_worker_prefill_step_fixed_seconds", "Predicted fixed seconds of an engine step (what a step costs whatever it computes)"),
            token_seconds: gauge("turbine_worker_prefill_token_seconds", "Predicted seconds to compute one more prompt token"),
        }
    }

    fn metrics(&self) -> [&dyn Collector; 6] {
        [&self.decisions, &self.fixed_seconds, &self.block_seconds, &self.held_ratio, &self.step_seconds, &self.token_seconds]
    }

    fn update(&self, estimates: &turbine_engine::FetchEstimates) {
        // The host tier is always read: it has costs, no decisions.
        if let (Some(fixed), Some(per_block)) = (estimates.host.fixed_seconds, estimates.host.block_seconds) {
            self.fixed_seconds.with_label_values(&["host"]).set(fixed);
            self.block_seconds.with_label_values(&["host"]).set(per_block);
        }
        for (tier, estimate) in [("disk", &estimates.disk), ("remote", &estimates.remote)] {
            let decisions = estimate.decisions;
            for (decision, count) in [("fetch", decisions.fetch), ("probe", decisions.probe), ("skip", decisions.skip)] {
                set_counter(&self.decisions.with_label_values(&[tier, decision]), count);
            }
            if let (Some(fixed), Some(per_block)) = (estimate.fixed_seconds, estimate.block_seconds) {
                self.fixed_seconds.with_label_values(&[tier]).set(fixed);
                self.block_seconds.with_label_values(&[tier]).set(per_block);
            }
            self.held_ratio.with_label_values(&[tier]).set(estimate.held_share);
        }
        if let (Some(step), Some(token)) = (estimates.step_seconds, estimates.token_seconds) {
            self.step_seconds.set(step);
            self.token_seconds.set(token);
        }
    }
}

/// One KV tier's gauges and counters, labelled `tier`.
struct TierMetrics {
    blocks: IntGauge,
    bytes: IntGauge,
    capacity_bytes: IntGauge,
    offloaded_blocks: IntCounter,
    offloaded_bytes: IntCounter,
    offloads_skipped: IntCounter,
    onboarded_blocks: IntCounter,
    evicted_blocks: IntCounter,
    fair_share_evictions: IntCounter,
    corrupt_blocks: IntCounter,
    read_bytes: IntCounter,
    read_seconds: Counter,
    failures: IntCounter,
}

impl TierMetrics {
    fn new(worker_id: &str, tier: &str) -> Self {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("worker", worker_id).const_label("tier", tier);
        let gauge = |name: &str, help: &str| IntGauge::with_opts(opts(name, help)).expect("valid gauge");
        let count = |name: &str, help: &str| IntCounter::with_opts(opts(name, help)).expect("valid counter");
        Self {
            blocks: gauge("turbine_worker_kv_tier_blocks", "KV blocks held in a tier below the pool"),
            bytes: gauge("turbine_worker_kv_tier_bytes", "Bytes of KV blocks held in a tier below the pool"),
            capacity_bytes: gauge("turbine_worker_kv_tier_capacity_bytes", "Bytes a tier below the pool may hold"),
            offloaded_blocks: count("turbine_worker_kv_tier_offloaded_blocks_total", "KV blocks copied into a tier"),
            offloaded_bytes: count("turbine_worker_kv_tier_offloaded_bytes_total", "Bytes of KV blocks copied into a tier"),
            offloads_skipped: count("turbine_worker_kv_tier_offloads_skipped_total", "KV blocks not copied into a tier because copies fell behind"),
            onboarded_blocks: count("turbine_worker_kv_tier_onboarded_blocks_total", "KV blocks onboarded from a tier into the pool"),
            evicted_blocks: count("turbine_worker_kv_tier_evicted_blocks_total", "KV blocks evicted from a tier for room"),
            fair_share_evictions: count(
                "turbine_worker_kv_tier_fair_share_evictions_total",
                "KV blocks evicted from a tier because their tenant held more than its fair share (the tier's capacity over the tenants holding blocks) when another needed room; counted in evicted_blocks too",
            ),
            corrupt_blocks: count("turbine_worker_kv_tier_corrupt_blocks_total", "KV blocks dropped from a tier because they failed their checksum"),
            read_bytes: count(
                "turbine_worker_kv_tier_read_bytes_total",
                "Bytes read from a tier for onboards (disk, remote); over read_seconds: its bandwidth",
            ),
            read_seconds: Counter::with_opts(opts(
                "turbine_worker_kv_tier_read_seconds_total",
                "Seconds spent reading from a tier for onboards (disk, remote)",
            ))
            .expect("valid counter"),
            failures: count("turbine_worker_kv_tier_failures_total", "Reads or writes of a tier that failed (remote: the store down, slow or refusing)"),
        }
    }

    fn metrics(&self) -> [&dyn Collector; 13] {
        [
            &self.read_bytes,
            &self.read_seconds,
            &self.failures,
            &self.blocks,
            &self.bytes,
            &self.capacity_bytes,
            &self.offloaded_blocks,
            &self.offloaded_bytes,
            &self.offloads_skipped,
            &self.onboarded_blocks,
            &self.evicted_blocks,
            &self.fair_share_evictions,
            &self.corrupt_blocks,
        ]
    }

    fn update(&self, blocks: u64, bytes: u64, capacity_bytes: u64, stats: &turbine_engine::TierStats, failures: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.blocks.set(blocks as i64);
        self.bytes.set(bytes as i64);
        self.capacity_bytes.set(capacity_bytes as i64);
        set_counter(&self.offloaded_blocks, stats.offloaded_blocks.load(Relaxed));
        set_counter(&self.offloaded_bytes, stats.offloaded_bytes.load(Relaxed));
        set_counter(&self.offloads_skipped, stats.offloads_skipped.load(Relaxed));
        set_counter(&self.onboarded_blocks, stats.onboarded_blocks.load(Relaxed));
        set_counter(&self.evicted_blocks, stats.evicted_blocks.load(Relaxed));
        set_counter(&self.fair_share_evictions, stats.fair_share_evictions.load(Relaxed));
        set_counter(&self.corrupt_blocks, stats.corrupt_blocks.load(Relaxed));
        set_counter(&self.read_bytes, stats.read_bytes.load(Relaxed));
        set_counter(&self.failures, failures);
        let seconds = stats.read_micros.load(Relaxed) as f64 / 1e6;
        if seconds > self.read_seconds.get() {
            self.read_seconds.inc_by(seconds - self.read_seconds.get());
        }
    }
}

impl EngineCollector {
    /// A collector for `engine`, labelled `worker=<worker_id>`.
    pub fn new(worker_id: &str, engine: EngineHandle) -> Self {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("worker", worker_id);
        let gauge = |name: &str, help: &str| IntGauge::with_opts(opts(name, help)).expect("valid gauge");
        let count = |name: &str, help: &str| IntCounter::with_opts(opts(name, help)).expect("valid counter");
        let host = engine.host_tier().map(|_| TierMetrics::new(worker_id, "host"));
        let disk = engine.host_tier().and_then(|host| host.disk()).map(|_| TierMetrics::new(worker_id, "disk"));
        let remote = engine.remote_tier().map(|_| TierMetrics::new(worker_id, "remote"));
        let fetch = engine.fetch_estimates().map(|_| FetchMetrics::new(worker_id));
        let mut collector = Self {
            engine,
            host,
            disk,
            remote,
            fetch,
            running: gauge("turbine_worker_running_sequences", "Sequences scheduled (prefilling or decoding)"),
            waiting: gauge("turbine_worker_waiting_sequences", "Sequences queued"),
            blocks_used: gauge("turbine_worker_kv_blocks_used", "KV blocks referenced by sequences"),
            blocks_total: gauge("turbine_worker_kv_blocks_total", "KV blocks in the pool"),
            steps: count("turbine_worker_engine_steps_total", "Engine steps run"),
            generated: count("turbine_worker_generated_tokens_total", "Tokens generated"),
            prefill: count("turbine_worker_prefill_tokens_total", "Prompt tokens computed"),
            cached: count("turbine_worker_cached_prompt_tokens_total", "Prompt tokens served from the prefix cache"),
            preemptions: count("turbine_worker_preemptions_total", "Sequences preempted for lack of KV blocks"),
            pool_fair_share_evictions: count(
                "turbine_worker_kv_pool_fair_share_evictions_total",
                "Cached KV blocks evicted from the pool because their tenant held more than its fair share (the pool over the tenants holding cached blocks) when another needed room",
            ),
            onboarded: count("turbine_worker_onboarded_prompt_tokens_total", "Prompt tokens onboarded from a tier below the pool (then hits)"),
            descs: Vec::new(),
        };
        collector.descs = collector.metrics().iter().flat_map(|metric| metric.desc().into_iter().cloned()).collect();
        collector
    }

    fn metrics(&self) -> Vec<&dyn Collector> {
        let mut metrics: Vec<&dyn Collector> = vec![
            &self.running,
            &self.waiting,
            &self.blocks_used,
            &self.blocks_total,
            &self.steps,
            &self.generated,
            &self.prefill,
            &self.cached,
            &self.preemptions,
            &self.pool_fair_share_evictions,
            &self.onboarded,
        ];
        for tier in [&self.host, &self.disk, &self.remote].into_iter().flatten() {
            metrics.extend(tier.metrics());
        }
        if let Some(fetch) = &self.fetch {
            metrics.extend(fetch.metrics());
        }
        metrics
    }
}

fn set_counter(counter: &IntCounter, total: u64) {
    let current = counter.get();
    if total > current {
        counter.inc_by(total - current);
    }
}

impl Collector for EngineCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        use std::sync::atomic::Ordering::Relaxed;
        let load = self.engine.load();
        self.running.set(load.running.into());
        self.waiting.set(load.waiting.into());
        self.blocks_used.set(load.blocks_used.into());
        self.blocks_total.set(load.blocks_total.into());
        let stats = self.engine.stats();
        set_counter(&self.steps, stats.steps.load(Relaxed));
        set_counter(&self.generated, stats.generated_tokens.load(Relaxed));
        set_counter(&self.prefill, stats.prefill_tokens.load(Relaxed));
        set_counter(&self.cached, stats.cached_prompt_tokens.load(Relaxed));
        set_counter(&self.preemptions, stats.preemptions.load(Relaxed));
        set_counter(&self.pool_fair_share_evictions, stats.fair_share_evictions.load(Relaxed));
        set_counter(&self.onboarded, stats.onboarded_prompt_tokens.load(Relaxed));
        if let (Some(metrics), Some(host)) = (&self.host, self.engine.host_tier()) {
            metrics.update(host.blocks(), host.used_bytes(), host.capacity_bytes(), host.stats(), host.stats().failures.load(Relaxed));
            if let (Some(metrics), Some(disk)) = (&self.disk, host.disk()) {
                metrics.update(disk.blocks(), disk.used_bytes(), disk.capacity_bytes(), disk.stats(), disk.stats().failures.load(Relaxed));
            }
        }
        if let (Some(metrics), Some(remote)) = (&self.remote, self.engine.remote_tier()) {
            metrics.update(0, 0, 0, remote.stats(), remote.failures());
        }
        if let (Some(metrics), Some(estimates)) = (&self.fetch, self.engine.fetch_estimates()) {
            metrics.update(&estimates);
        }
        self.metrics().iter().flat_map(|metric| metric.collect()).collect()
    }
}

/// Registers the engine collector of a worker until the guard drops.
pub fn register_engine(worker_id: &str, engine: EngineHandle) -> CollectorGuard {
    register_collector(EngineCollector::new(worker_id, engine), &format!("engine (worker {worker_id})"))
}

static KV_PINS: LazyLock<prometheus::IntGaugeVec> = LazyLock::new(|| {
    turbine_runtime::metrics::gauge("turbine_worker_kv_pinned_handles", "Prefill handles whose KV blocks are pinned for a decode worker", &["worker"])
});
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
static KV_UCX_HANDLE_KEYS: LazyLock<prometheus::IntGaugeVec> = LazyLock::new(|| {
    turbine_runtime::metrics::gauge(
        "turbine_worker_kv_ucx_handle_keys",
        "Runs of prefill handles' blocks registered with UCX for those handles alone (a pool keyed per handle: serving certificates with a network named for UCX), each unregistered at its handle's release or expiry",
        &["worker"],
    )
});
static KV_LEASES_EXPIRED: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_worker_kv_leases_expired_total", "Prefill handles freed because no decode worker released them in time", &["worker"]));
static KV_PINS_REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_worker_kv_pins_refused_total",
        "Prefills that handed over no blocks because a handle would pass a pin budget: requester_share (the caller's share of the pool) or pool_share (all handles' share); their decode workers computed the prompts",
        &["worker", "reason"],
    )
});
static KV_IMPORTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_worker_kv_imports_total",
        "Decode requests after a remote prefill, by transport and outcome (ok, or why the prompt was computed locally)",
        &["worker", "transport", "outcome"],
    )
});
static KV_IMPORTS_IN_FLIGHT: LazyLock<prometheus::IntGaugeVec> = LazyLock::new(|| {
    turbine_runtime::metrics::gauge("turbine_worker_kv_imports_in_flight", "Remote prefills whose blocks this worker is reading now", &["worker"])
});
static KV_IMPORT_BYTES: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_worker_kv_import_bytes_total", "KV block bytes read from prefill workers", &["worker", "transport"]));
static KV_IMPORT_SECONDS: LazyLock<HistogramVec> =
    LazyLock::new(|| histogram("turbine_worker_kv_import_seconds", "Time to read a remote prefill's blocks (or give up)", &["worker"], latency_buckets()));
static KV_CHECKSUM_MISMATCHES: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_worker_kv_checksum_mismatches_total", "Transferred KV blocks that failed their checksum", &["worker"]));
static KV_UCX_READS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_worker_kv_ucx_reads_total",
        "Batches of UCX block reads, by path: mapped (copied out of a same-machine peer's shared pool) or get (one-sided gets)",
        &["worker", "path"],
    )
});
static KV_UCX_POST: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "turbine_worker_kv_ucx_post_seconds",
        "Time to post one batch of UCX block reads",
        &["worker"],
        vec![1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2],
    )
});

pub(crate) fn kv_pins(worker: &str, delta: i64) {
    KV_PINS.with_label_values(&[worker]).add(delta);
}

#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) fn kv_ucx_handle_keys(worker: &str, delta: i64) {
    KV_UCX_HANDLE_KEYS.with_label_values(&[worker]).add(delta);
}

pub(crate) fn kv_pins_refused(worker: &str, reason: &str) {
    KV_PINS_REFUSED.with_label_values(&[worker, reason]).inc();
}

pub(crate) fn kv_lease_expired(worker: &str) {
    KV_LEASES_EXPIRED.with_label_values(&[worker]).inc();
}

/// Counts an import in flight until dropped.
pub(crate) struct ImportInFlight(prometheus::IntGauge);

impl ImportInFlight {
    pub(crate) fn start(worker: &str) -> Self {
        let gauge = KV_IMPORTS_IN_FLIGHT.with_label_values(&[worker]);
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for ImportInFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

pub(crate) fn kv_import(worker: &str, transport: &str, outcome: &str, bytes: usize, elapsed: Duration) {
    KV_IMPORTS.with_label_values(&[worker, transport, outcome]).inc();
    if bytes > 0 {
        KV_IMPORT_BYTES.with_label_values(&[worker, transport]).inc_by(bytes as u64);
    }
    KV_IMPORT_SECONDS.with_label_values(&[worker]).observe(elapsed.as_secs_f64());
}

pub(crate) fn kv_checksum_mismatch(worker: &str) {
    KV_CHECKSUM_MISMATCHES.with_label_values(&[worker]).inc();
}

#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
/// One batch of UCX block reads: the time to post it, and whether the
/// blocks were copied out of the peer's pool mapped here (`mapped`) or read
/// with gets (`get`).
pub(crate) fn kv_ucx_read(worker: &str, post: Duration, mapped: bool) {
    KV_UCX_POST.with_label_values(&[worker]).observe(post.as_secs_f64());
    KV_UCX_READS.with_label_values(&[worker, if mapped { "mapped" } else { "get" }]).inc();
}
