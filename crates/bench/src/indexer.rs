//! `turbine bench indexer`: the KV index under a trace's event stream with
//! concurrent lookups.
//!
//! The trace's requests are dealt round-robin to `--workers` synthetic
//! workers. Each worker runs the engine's real block manager (prefix reuse,
//! LRU eviction) over its requests, one trace block per KV block, and the
//! `Stored`/`Removed` events it emits are recorded in trace order. The
//! timed phase applies every event from one thread while another thread
//! calls `find_matches` for the trace's prompts as fast as it can; the
//! report gives operations per second (events applied plus lookups) and the
//! lookup latency distribution.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use turbine_engine::block_manager::BlockManager;
use turbine_kv::{BlockHashes, KvEvent, KvIndex, NumberedEvent, SequenceHash};

use crate::replay::read_trace;

/// Flags of `turbine bench indexer`.
#[derive(Debug, Clone, clap::Args)]
pub struct IndexerBenchArgs {
    /// Mooncake-format JSONL trace.
    #[arg(long)]
    pub trace: PathBuf,
    /// Synthetic workers the trace is dealt to.
    #[arg(long, default_value_t = 7000)]
    pub workers: usize,
    /// KV blocks per synthetic worker (one trace block each).
    #[arg(long, default_value_t = 2048)]
    pub blocks_per_worker: usize,
    /// Replay only the first N requests [default: all].
    #[arg(long)]
    pub limit: Option<usize>,
    /// Times the trace is played; each pass uses fresh block ids, so the
    /// caches churn (evictions) as they fill.
    #[arg(long, default_value_t = 4)]
    pub passes: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What `turbine bench indexer` measures.
#[derive(Debug, Clone, Serialize)]
pub struct IndexerReport {
    /// Synthetic workers.
    pub workers: usize,
    /// Trace requests simulated.
    pub requests: usize,
    /// Events applied.
    pub events: usize,
    /// Blocks carried by those events.
    pub event_blocks: usize,
    /// Lookups done while the events were applied.
    pub find_matches: usize,
    /// Wall time of the timed phase.
    pub wall_secs: f64,
    /// (events + lookups) / wall time.
    pub ops_per_sec: f64,
    /// Events applied per second.
    pub events_per_sec: f64,
    /// Lookups per second.
    pub find_matches_per_sec: f64,
    /// Lookup latency, µs.
    pub find_matches_p50_us: f64,
    /// Lookup latency, µs.
    pub find_matches_p99_us: f64,
    /// Lookup latency, µs.
    pub find_matches_max_us: f64,
    /// Lookup latency on the final index with no writer, µs: the lookup's
    /// own cost, without waiting for the lock.
    pub quiet_find_matches_p50_us: f64,
    /// Same, p99.
    pub quiet_find_matches_p99_us: f64,
    /// Index size at the end.
    pub nodes: usize,
}

/// Chained hashes of a request's trace blocks (ids as block contents).
fn chain(hash_ids: &[u64]) -> Vec<BlockHashes> {
    let hasher = turbine_kv::BlockHasher::default();
    let mut parent = None;
    hash_ids
        .iter()
        .map(|&id| {
            let local = hasher.local(&[id as u32, (id >> 32) as u32]);
            let sequence = hasher.chain(parent, local);
            parent = Some(sequence);
            BlockHashes { local, sequence }
        })
        .collect()
}

/// Runs the benchmark.
pub fn run(args: &IndexerBenchArgs) -> anyhow::Result<IndexerReport> {
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    anyhow::ensure!(args.blocks_per_worker >= 1, "--blocks-per-worker must be at least 1");
    let requests = read_trace(&args.trace, args.limit)?;
    eprintln!("simulating {} requests x {} passes on {} workers...", requests.len(), args.passes, args.workers);
    anyhow::ensure!(args.passes >= 1, "--passes must be at least 1");
    let chains: Vec<Vec<BlockHashes>> = (0..args.passes as u64)
        .flat_map(|pass| requests.iter().map(move |r| chain(&r.hash_ids.iter().map(|&id| id + (pass << 40)).collect::<Vec<u64>>())))
        .collect();
    let longest = chains.iter().map(Vec::len).max().unwrap_or(1);
    let mut managers: Vec<Option<BlockManager>> = (0..args.workers).map(|_| None).collect();
    let mut next_ids = vec![0u64; args.workers];
    let mut events: Vec<(u32, NumberedEvent)> = Vec::new();
    let mut drained = Vec::new();
    for (index, chain) in chains.iter().enumerate() {
        let worker = index % args.workers;
        // Big enough for the longest prompt, so every request fits.
        let manager = managers[worker].get_or_insert_with(|| BlockManager::new(args.blocks_per_worker.max(longest), 1, true));
        let hashes: Vec<SequenceHash> = chain.iter().map(|b| b.sequence).collect();
        let cached = manager.match_prefix(&hashes);
        let mut table = manager.acquire_cached(&hashes[..cached]);
        table.extend(manager.allocate(chain.len() - cached, turbine_kv::KvTenant::SHARED).expect("the pool fits the longest prompt"));
        let parent = cached.checked_sub(1).map(|i| hashes[i]);
        let fresh: Vec<(u32, BlockHashes)> = table[cached..].iter().copied().zip(chain[cached..].iter().copied()).collect();
        manager.register(parent, turbine_kv::KvTenant::SHARED, &fresh);
        manager.release(table.into_iter().rev());
        manager.drain_events(&mut drained);
        for event in drained.drain(..) {
            events.push((worker as u32, NumberedEvent { event_id: next_ids[worker], event }));
            next_ids[worker] += 1;
        }
    }
    let event_blocks: usize = events
        .iter()
        .map(|(_, e)| match &e.event {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            KvEvent::Removed { sequence_hashes, .. } => sequence_hashes.len(),
            KvEvent::Cleared => 0,
        })
        .sum();
    let queries: Arc<Vec<Vec<SequenceHash>>> = Arc::new(chains.iter().map(|c| c.iter().map(|b| b.sequence).collect()).collect());
    let names: Vec<String> = (0..args.workers).map(|w| format!("worker-{w}")).collect();
    eprintln!("applying {} events ({} blocks) with concurrent lookups...", events.len(), event_blocks);

    let index = Arc::new(KvIndex::new());
    let done = Arc::new(AtomicBool::new(false));
    let reader = std::thread::spawn({
        let (index, done, queries) = (index.clone(), done.clone(), queries.clone());
        move || {
            let mut latencies = Vec::new();
            let mut turn = 0usize;
            while !done.load(Ordering::Relaxed) {
                let query = &queries[turn % queries.len()];
                turn += 1;
                let started = Instant::now();
                std::hint::black_box(index.find_matches(query));
                latencies.push(started.elapsed());
            }
            latencies
        }
    });
    let started = Instant::now();
    for (worker, event) in &events {
        index.apply(&names[*worker as usize], 1, event);
    }
    let wall = started.elapsed();
    done.store(true, Ordering::Relaxed);
    let mut latencies = reader.join().map_err(|_| anyhow::anyhow!("the lookup thread panicked"))?;
    latencies.sort();
    let mut quiet: Vec<Duration> = queries
        .iter()
        .take(latencies.len().clamp(1_000, 20_000))
        .map(|query| {
            let started = Instant::now();
            std::hint::black_box(index.find_matches(query));
            started.elapsed()
        })
        .collect();
    quiet.sort();
    let percentile = |sorted: &[Duration], q: f64| sorted.get(((sorted.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or_default();
    let pick = |q: f64| percentile(&latencies, q);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let secs = wall.as_secs_f64();
    Ok(IndexerReport {
        workers: args.workers,
        requests: chains.len(),
        events: events.len(),
        event_blocks,
        find_matches: latencies.len(),
        wall_secs: secs,
        ops_per_sec: (events.len() + latencies.len()) as f64 / secs,
        events_per_sec: events.len() as f64 / secs,
        find_matches_per_sec: latencies.len() as f64 / secs,
        find_matches_p50_us: us(pick(0.5)),
        find_matches_p99_us: us(pick(0.99)),
        find_matches_max_us: us(latencies.last().copied().unwrap_or_default()),
        quiet_find_matches_p50_us: us(percentile(&quiet, 0.5)),
        quiet_find_matches_p99_us: us(percentile(&quiet, 0.99)),
        nodes: index.stats().nodes,
    })
}

/// Prints the report.
pub fn print(report: &IndexerReport) {
    println!(
        "indexer: {} workers, {} requests, {} events ({} blocks) in {:.2} s with {} concurrent lookups",
        report.workers, report.requests, report.events, report.event_blocks, report.wall_secs, report.find_matches
    );
    println!(
        "  {:.0} ops/s ({:.0} events/s + {:.0} lookups/s); find_matches p50 {:.1} µs, p99 {:.1} µs, max {:.0} µs; {} nodes at the end",
        report.ops_per_sec,
        report.events_per_sec,
        report.find_matches_per_sec,
        report.find_matches_p50_us,
        report.find_matches_p99_us,
        report.find_matches_max_us,
        report.nodes
    );
    println!("  find_matches alone on the final index: p50 {:.1} µs, p99 {:.1} µs", report.quiet_find_matches_p50_us, report.quiet_find_matches_p99_us);
}
