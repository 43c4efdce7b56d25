//! `turbine bench tiers`: time to first token of a long prompt whose KV
//! comes back from a lower tier, against computing it, on the native
//! engine, in one run.
//!
//! Two engines on the same model and thread count, each with a pool that
//! holds one prompt at a time: one with a host-memory tier (G2), one with a
//! host tier of two blocks over a disk tier (G3, so nearly every block is
//! read back from disk). Each runs `prompts` distinct prompts of
//! `prefix_tokens` tokens in turn (each pushes the previous one out of the
//! pool), measuring the time to first token of computing them; once the
//! copies to the tiers have settled it runs them again in the same order,
//! and now each prompt's blocks come back from the lower tier. The report
//! gives each engine's median time to first token computed and onboarded,
//! and their ratio (the median of per-prompt ratios). Each request decodes
//! `check_tokens` greedy tokens after its first, and the report counts the
//! prompts whose onboarded pass decoded exactly the computed pass's tokens:
//! blocks from a tier must give the text computing them gives.
//!
//! A third pair of engines measures the kv-store (G4) over loopback gRPC:
//! the first computes the prompts, its blocks written through to a
//! kv-store served in this process; then a second engine, its pool and
//! host tier empty, asks for them again and fetches their blocks from the
//! store (the time to first token computed is the first engine's).
//!
//! Disk reads go through the page cache: blocks written a moment ago are
//! usually still cached. `--drop-caches` asks the kernel to drop clean
//! page-cache pages before the second pass (root only), so that G3 reads
//! come from the device.

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use turbine_engine::{DiskTier, EngineHandle, EngineOutput, GenerateRequest, HostTier, KvTiers, RemoteTier, SchedulerConfig, StopConditions};
use turbine_native::{NativeExecutor, NativeOptions};
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Preprocessor};
use turbine_worker::store_tier::KvStoreTier;

/// Flags of `turbine bench tiers`.
#[derive(Debug, Clone, clap::Args)]
pub struct TiersBenchArgs {
    /// Model: catalog name or GGUF path.
    #[arg(long, default_value = turbine_tokens::pull::DEFAULT_MODEL)]
    pub model: String,
    /// Kernel threads of each engine.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Tokens of each prompt.
    #[arg(long, default_value_t = 2000)]
    pub prefix_tokens: usize,
    /// Distinct prompts per engine.
    #[arg(long, default_value_t = 4)]
    pub prompts: usize,
    /// Greedy tokens each request decodes, compared between the computed
    /// and the onboarded pass (the time to first token is measured on the
    /// first).
    #[arg(long, default_value_t = 16)]
    pub check_tokens: u32,
    /// Directory for the disk tier [default: a temporary directory].
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Drop clean page-cache pages before the onboarded pass (needs root).
    #[arg(long)]
    pub drop_caches: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One engine's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct TierNumbers {
    /// The tier the second pass onboarded from.
    pub tier: String,
    /// Time to first token of each prompt computed (ms).
    pub computed_ttft_ms: Vec<f64>,
    /// The same prompts with their blocks from the tier (ms).
    pub onboarded_ttft_ms: Vec<f64>,
    /// Median computed TTFT (ms).
    pub median_computed_ms: f64,
    /// Median onboarded TTFT (ms).
    pub median_onboarded_ms: f64,
    /// Median of the per-prompt ratios onboarded / computed.
    pub median_ratio: f64,
    /// Blocks onboarded from the tier over the pass.
    pub onboarded_blocks: u64,
    /// Prompts whose onboarded pass decoded the computed pass's tokens.
    pub identical_outputs: usize,
    /// Prompts compared.
    pub prompts: usize,
}

/// Everything `turbine bench tiers` measures.
#[derive(Debug, Clone, Serialize)]
pub struct TiersBenchReport {
    /// Tokens per prompt.
    pub prefix_tokens: usize,
    /// Kernel threads per engine.
    pub threads: usize,
    /// Whether the page cache was dropped before the onboarded pass.
    pub dropped_caches: bool,
    /// Greedy tokens compared per prompt.
    pub check_tokens: u32,
    /// Host memory (G2), disk (G3), then the kv-store (G4) over gRPC and,
    /// where the build has it, over UCX.
    pub tiers: Vec<TierNumbers>,
}

/// Runs the benchmark.
pub fn run(args: &TiersBenchArgs) -> anyhow::Result<TiersBenchReport> {
    anyhow::ensure!(
        args.prefix_tokens >= 32 && args.prompts >= 1 && args.threads >= 1 && args.check_tokens >= 1,
        "--prefix-tokens ≥ 32, --prompts ≥ 1, --threads ≥ 1 and --check-tokens ≥ 1"
    );
    let model = resolve_model(&args.model, None, &default_cache_dir(), Progress::Bars)?;
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(&model.name, &model.path, 16)?)?;
    let prompts: Vec<Vec<u32>> = (0..args.prompts)
        .map(|i| {
            let text = format!("Report {i}: the survey team measured the valley, counted the trees and mapped every stream they crossed. ");
            let ids = tokens.encode_text(&text.repeat(args.prefix_tokens / 10 + 10))?;
            ids.get(..args.prefix_tokens).map(<[u32]>::to_vec).context("the prompt text is too short")
        })
        .collect::<anyhow::Result<_>>()?;
    let temporary = tempfile::tempdir()?;
    let disk_dir = args.disk_dir.clone().unwrap_or_else(|| temporary.path().to_path_buf());
    let blocks = args.prefix_tokens.div_ceil(16) + 15;
    let mut tiers = Vec::new();
    let engine = |host: HostTier, remote: Option<RemoteTier>| -> anyhow::Result<EngineHandle> {
        let scheduler = SchedulerConfig {
            block_size: 16,
            num_blocks: blocks,
            max_batched_tokens: 512,
            max_model_len: args.prefix_tokens + args.check_tokens as usize + 64,
            ..SchedulerConfig::default()
        };
        let options = NativeOptions { block_size: 16, kv_blocks: Some(blocks), threads: args.threads, ..NativeOptions::default() };
        let executor = NativeExecutor::load(&model.path, &options)?;
        let memory = executor.kv_memory().context("the native engine exposes its KV pool")?;
        Ok(EngineHandle::spawn_with_tiers(
            scheduler,
            vec![],
            Box::new(executor),
            KvTiers { host: Some(host), memory: Some(memory), modelled: None, remote, fetch: turbine_engine::FetchPolicy::Always },
        ))
    };
    let block_bytes = {
        let options = NativeOptions { block_size: 16, kv_blocks: Some(1), threads: 1, ..NativeOptions::default() };
        NativeExecutor::load(&model.path, &options)?.kv_memory().context("the native engine exposes its KV pool")?.layout().block_bytes as u64
    };
    // Every full block but each prompt's last (a prompt that ends at a
    // block boundary leaves its last block to be computed).
    let pass_blocks = (args.prompts * (args.prefix_tokens / 16 - 1)) as u64;
    for tier in ["host", "disk"] {
        let host = match tier {
            "host" => HostTier::new((args.prompts * blocks) as u64 * block_bytes * 2),
            _ => HostTier::with_disk(2 * block_bytes, DiskTier::open(&disk_dir.join("bench-tiers"), (args.prompts * blocks) as u64 * block_bytes * 2, 1)?),
        };
        let engine = engine(host.clone(), None)?;
        let computed = prompts.iter().map(|prompt| decode(&engine, prompt, args.check_tokens)).collect::<anyhow::Result<Vec<_>>>()?;
        settle(&engine, &host, pass_blocks)?;
        if args.drop_caches {
            std::fs::write("/proc/sys/vm/drop_caches", "1").context("--drop-caches needs root (writing /proc/sys/vm/drop_caches)")?;
        }
        let before = onboarded(&host);
        let again = prompts.iter().map(|prompt| decode(&engine, prompt, args.check_tokens)).collect::<anyhow::Result<Vec<_>>>()?;
        let onboarded_blocks = onboarded(&host) - before;
        engine.shutdown();
        tiers.push(numbers(tier, computed, again, onboarded_blocks));
    }

    // The kv-store, served in this process on a loopback port.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let _entered = runtime.enter();
    // Served over UCX too where this build has it: the fetching pass runs
    // once over the gRPC stream and once over UCX.
    let store = turbine_kv_store::Store::open(
        (args.prompts * blocks) as u64 * (block_bytes + 4096) * 2,
        None,
        Some((turbine_kv::UcxNetwork::Any, turbine_kv::UcxKeys::WholePool)),
    );
    let listeners = runtime.block_on(turbine_runtime::host::Listeners::loopback())?;
    let endpoint = format!("http://{}", listeners.grpc.local_addr()?);
    let shutdown = turbine_runtime::CancellationToken::new();
    runtime.spawn(turbine_kv_store::serve(
        turbine_kv_store::KvStoreConfig::default(),
        store.clone(),
        turbine_kv_store::StoreEventSink::None,
        listeners,
        shutdown.clone(),
    ));
    let fingerprint = turbine_kv_store::Fingerprint::declaring(1, u32::try_from(block_bytes)?);
    let remote_over = |ucx: bool| -> anyhow::Result<RemoteTier> {
        let tier =
            KvStoreTier::new(turbine_api::kv_store::KvStoreClient::connect(&endpoint)?, fingerprint, Duration::from_secs(30), turbine_kv::UcxNetwork::Any);
        let tier = if ucx { tier } else { tier.without_ucx() };
        Ok(RemoteTier::new(std::sync::Arc::new(tier), 2))
    };
    let remote = || remote_over(false);
    let (computing_host, computing_remote) = (HostTier::new(2 * block_bytes), remote()?);
    let computing = engine(computing_host.clone(), Some(computing_remote.clone()))?;
    let computed = prompts.iter().map(|prompt| decode(&computing, prompt, args.check_tokens)).collect::<anyhow::Result<Vec<_>>>()?;
    // Every block reaches the host tier (or is skipped), then every block
    // queued for the store is in it.
    settle(&computing, &computing_host, pass_blocks)?;
    let started = Instant::now();
    while store.stats().put_blocks < computing_remote.stats().offloaded_blocks.load(Relaxed) {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "puts to the kv-store did not settle within 120 s: {} of {} blocks queued",
            store.stats().put_blocks,
            computing_remote.stats().offloaded_blocks.load(Relaxed)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    computing.shutdown();
    let mut paths = vec![("store", false)];
    if store.data_path().is_some() {
        paths.push(("store-ucx", true));
    }
    for (name, ucx) in paths {
        let remote = remote_over(ucx)?;
        let fetching = engine(HostTier::new(2 * block_bytes), Some(remote.clone()))?;
        let again = prompts.iter().map(|prompt| decode(&fetching, prompt, args.check_tokens)).collect::<anyhow::Result<Vec<_>>>()?;
        fetching.shutdown();
        tiers.push(numbers(name, computed.clone(), again, remote.stats().onboarded_blocks.load(Relaxed)));
    }
    shutdown.cancel();
    Ok(TiersBenchReport { prefix_tokens: args.prefix_tokens, threads: args.threads, dropped_caches: args.drop_caches, check_tokens: args.check_tokens, tiers })
}

/// A pass's numbers: each prompt's time to first token (ms) and tokens.
fn numbers(tier: &str, computed: Vec<(f64, Vec<u32>)>, again: Vec<(f64, Vec<u32>)>, onboarded_blocks: u64) -> TierNumbers {
    let identical_outputs = computed.iter().zip(&again).filter(|((_, first), (_, second))| first == second).count();
    let prompts = computed.len();
    let (computed, again): (Vec<f64>, Vec<f64>) = (computed.into_iter().map(|(ms, _)| ms).collect(), again.into_iter().map(|(ms, _)| ms).collect());
    let ratios: Vec<f64> = computed.iter().zip(&again).map(|(c, a)| a / c).collect();
    TierNumbers {
        tier: tier.into(),
        median_computed_ms: median(&computed),
        median_onboarded_ms: median(&again),
        median_ratio: median(&ratios),
        computed_ttft_ms: computed,
        onboarded_ttft_ms: again,
        onboarded_blocks,
        identical_outputs,
        prompts,
    }
}

/// Blocks onboarded from the host tier and the disk tier below it.
fn onboarded(host: &HostTier) -> u64 {
    host.stats().onboarded_blocks.load(Relaxed) + host.disk().map_or(0, |disk| disk.stats().onboarded_blocks.load(Relaxed))
}

/// Waits until the pass's blocks are copied down (at least `blocks` in the
/// host tier, and its evictions written to disk) and nothing is pinned.
fn settle(engine: &EngineHandle, host: &HostTier, blocks: u64) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        // A block the copies fell behind on is skipped, not late: it
        // counts as settled (and is computed again in the second pass).
        let host_done = host.stats().offloaded_blocks.load(Relaxed) + host.stats().offloads_skipped.load(Relaxed) >= blocks;
        let disk_done = host.disk().is_none_or(|disk| {
            disk.stats().offloaded_blocks.load(Relaxed) + disk.stats().offloads_skipped.load(Relaxed) >= host.stats().evicted_blocks.load(Relaxed)
        });
        if host_done && disk_done && engine.load().blocks_used == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "copies to the lower tiers did not settle within 120 s: {} of {blocks} blocks in the host tier ({} skipped), {} of its {} evictions written to disk, {} blocks pinned",
            host.stats().offloaded_blocks.load(Relaxed),
            host.stats().offloads_skipped.load(Relaxed),
            host.disk().map_or(0, |disk| disk.stats().offloaded_blocks.load(Relaxed) + disk.stats().offloads_skipped.load(Relaxed)),
            host.stats().evicted_blocks.load(Relaxed),
            engine.load().blocks_used
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Milliseconds from submitting `prompt` to its first token, and the
/// `tokens` greedy tokens it decodes.
fn decode(engine: &EngineHandle, prompt: &[u32], tokens: u32) -> anyhow::Result<(f64, Vec<u32>)> {
    let started = Instant::now();
    let mut outputs = engine.generate(GenerateRequest {
        request_id: String::new(),
        prompt: prompt.to_vec(),
        sampling: Default::default(),
        stop: StopConditions { max_tokens: tokens, stop_token_ids: vec![], ignore_eos: true },
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    })?;
    let mut first = None;
    let mut decoded = Vec::new();
    while let Some(output) = outputs.blocking_recv() {
        match output {
            EngineOutput::Token(token, _) => {
                first = first.or(Some(started.elapsed()));
                decoded.push(token);
            }
            EngineOutput::Finished { .. } => break,
            EngineOutput::Failed(error) => anyhow::bail!("the engine failed a request: {error}"),
            EngineOutput::Pinned(_) => {}
        }
    }
    Ok((first.context("no token came back")?.as_secs_f64() * 1e3, decoded))
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Prints the report as a table.
pub fn print(report: &TiersBenchReport) {
    println!(
        "time to first token, {}-token prompts, {} threads{}:",
        report.prefix_tokens,
        report.threads,
        if report.dropped_caches { ", page cache dropped before onboarding" } else { "" }
    );
    println!("{:<9} {:>14} {:>14} {:>8} {:>10} {:>18}", "tier", "computed ms", "onboarded ms", "ratio", "blocks", "same tokens");
    for tier in &report.tiers {
        println!(
            "{:<9} {:>14.1} {:>14.1} {:>8.3} {:>10} {:>18}",
            tier.tier,
            tier.median_computed_ms,
            tier.median_onboarded_ms,
            tier.median_ratio,
            tier.onboarded_blocks,
            format!("{}/{} prompts", tier.identical_outputs, tier.prompts)
        );
    }
    println!("same tokens: the onboarded pass decoded the computed pass's {} greedy tokens", report.check_tokens);
}
