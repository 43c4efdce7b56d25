//! `turbine bench replay`: a Mooncake-format request trace replayed through
//! the real gateway and router onto mocker workers, once per routing
//! policy, side by side in one run.
//!
//! Each trace line has an arrival time (ms), an input and an output length,
//! and `hash_ids`: one id per 512-token block of the prompt, where equal
//! leading ids mean an equal prompt prefix. Every id becomes 512 fixed
//! synthetic token ids (a function of the id and the position), so prefix
//! sharing survives whatever block size the engine uses; the last id is cut
//! to the input length. Requests go to `/v1/completions` as token-id
//! prompts, streamed, at the trace's arrival times divided by `--speedup`
//! (the mocker runs `--speedup` times faster than its model of a GPU too,
//! so the replay is the trace with time compressed).
//!
//! Reported per policy: TTFT, inter-token latency and end-to-end latency
//! (p50/p90/p99/mean), output tokens/s, the prefix hit rate the engines
//! reported (`usage.prompt_tokens_details.cached_tokens` over prompt
//! tokens), and the oracle hit rate: every prefix block seen before in the
//! trace counts as a hit (an infinite cache on one worker).

//!
//! - [`trace`]: reading a trace, its prompts, the oracle's hits.
//! - [`drive`]: sending the trace at its arrival times, measuring.
//! - [`report`]: summaries, the table, the sweep's plot.

pub(crate) mod drive;
pub mod report;
pub mod trace;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use turbine_cluster::{Cluster, ClusterOptions, RunConfig};
use turbine_router::{KvTuning, Policy};
use turbine_runtime::CancellationToken;
use turbine_worker::{EngineKind, KvFetch};

use drive::drive;
use report::print_timeline;
pub use report::{PolicyReport, ReplayReport, print, write_plot};
pub use trace::{TraceRequest, conversations, oracle_hits, prompt_tokens, read_trace, shrink};

/// Flags of `turbine bench replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: PathBuf,
    /// Divide every length of the trace by this (prompts, outputs, the
    /// tokens of each shared trace block): a replay on real engines that
    /// compute a Mooncake prompt of thousands of tokens too slowly.
    #[arg(long, default_value_t = 1)]
    pub shrink: usize,
    /// Mocker workers behind the router.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Routing policies to compare, each replayed on a fresh stack (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "kv,round-robin")]
    pub router: Vec<Policy>,
    /// Router replicas to compare, each behind its own gateway, requests
    /// spread over the gateways in turn (comma-separated, e.g. 1,2). Every
    /// policy is replayed with each count. Above 1 needs --redis.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub routers: Vec<usize>,
    /// Redis URL: workers publish their KV events to it and every router
    /// follows them into its own index replica (as separate processes do);
    /// without it, events go straight into one shared index.
    #[arg(long)]
    pub redis: Option<String>,
    /// Time compression: arrivals come this many times faster than in the trace.
    #[arg(long, default_value_t = 10.0)]
    pub speedup: f64,
    /// The mocker's speedup over its model of a GPU [default: --speedup, so
    /// the replay is the trace with time compressed]. Lower it to load the
    /// workers more (slower engines for the same traffic).
    #[arg(long)]
    pub engine_speedup: Option<f64>,
    /// Replay only the first N requests [default: all].
    #[arg(long)]
    pub limit: Option<usize>,
    /// Replay one conversation in K of those requests, each whole (the
    /// reuse within conversations and the trace's time span stay, at about
    /// 1/K of its load): real engines too slow for the whole trace still
    /// see the reuse that comes minutes apart.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub conversations_every: u64,
    /// Cap on each request's output tokens [default: the trace's].
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// Host-memory KV tier (G2) per mocker worker in MiB of modelled bytes,
    /// to compare (comma-separated, e.g. 0,8192: without the tier and with
    /// it). Every policy is replayed with each size. Blocks onboard at the
    /// worker's modelled host bandwidth.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub host_cache_mib: Vec<u64>,
    /// Host-tier onboard bandwidth the mockers model, GB/s [default: what
    /// this machine measured, see --mock-host-gbps of turbine worker].
    #[arg(long, default_value_t = turbine_worker::config::MOCK_HOST_GBPS)]
    pub host_gbps: f64,
    /// Local-disk KV tier (G3) per mocker worker below the host tier, GiB
    /// of modelled bytes (0: none; runs without a host tier have none).
    /// Its files go to a temporary directory per run.
    #[arg(long, default_value_t = 0.0)]
    pub disk_cache_gib: f64,
    /// Disk-tier onboard bandwidth the mockers model, GB/s [default: what
    /// this machine measured, see --mock-disk-gbps of turbine worker];
    /// lower it to slow the tier.
    #[arg(long, default_value_t = turbine_worker::config::MOCK_DISK_GBPS)]
    pub disk_gbps: f64,
    /// Fetch-or-recompute policies to compare on runs with a host tier
    /// (comma-separated: auto, always, never; see --kv-fetch of turbine
    /// worker). Each is replayed on a fresh stack.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    pub kv_fetch: Vec<KvFetch>,
    /// Also replay every configuration with a host tier on workers that
    /// share an embedded kv-store (G4), to compare (each once without the
    /// store, once with it).
    #[arg(long)]
    pub kv_store: bool,
    /// Shared-tier onboard bandwidth the mockers model, GB/s [default:
    /// what this machine measured, see --mock-remote-gbps of turbine worker].
    #[arg(long, default_value_t = turbine_worker::config::MOCK_REMOTE_GBPS)]
    pub remote_gbps: f64,
    /// Tokens per KV block of the mocker.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// KV blocks per mocker worker (sets the cache pressure).
    #[arg(long, default_value_t = 16_384)]
    pub num_blocks: usize,
    #[command(flatten)]
    pub kv: KvTuning,
    /// Model whose card and vocabulary the mocker uses.
    #[arg(long, default_value = turbine_tokens::pull::DEFAULT_MODEL)]
    pub model: String,
    /// Replay against a running deployment at this gateway URL (e.g.
    /// http://127.0.0.1:8000) instead of starting a stack: --router,
    /// --routers and the worker flags are then ignored, but --block-size
    /// should match the workers' (it sets the oracle's block rounding).
    #[arg(long)]
    pub gateway: Option<String>,
    /// Also report the hit rate in windows of this many seconds of arrival
    /// time (0: no timeline), e.g. to watch recovery after a failure.
    #[arg(long, default_value_t = 0.0)]
    pub window_secs: f64,
    /// Disaggregated sweep: prefill:decode worker splits (comma-separated,
    /// e.g. 1:1,1:2,2:2), each replayed with kv routing and compared with
    /// aggregated workers of the same count (replaces --workers, --router
    /// and --routers). The mockers model each hand-off's transfer from its
    /// bytes (--kv-bytes-per-token) and --transfer-gbps.
    #[arg(long, value_delimiter = ',')]
    pub disagg: Vec<String>,
    /// Sweep: KV bytes per token of the modelled model [default: Llama-3-8B in f16].
    #[arg(long, default_value_t = turbine_worker::config::MOCK_KV_BYTES_PER_TOKEN)]
    pub kv_bytes_per_token: usize,
    /// Sweep: KV transfer bandwidth in GB/s (`turbine bench transfer` measures it).
    #[arg(long, default_value_t = turbine_worker::config::MOCK_TRANSFER_GBPS)]
    pub transfer_gbps: f64,
    /// Sweep: prompts with more uncached tokens than this go to a prefill worker.
    #[arg(long, default_value_t = turbine_router::DisaggPolicy::default().threshold_tokens)]
    pub disagg_threshold_tokens: u32,
    /// Sweep: write a plot of TTFT and ITL per configuration (SVG) here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A prefill:decode split of the sweep.
fn parse_split(text: &str) -> anyhow::Result<(usize, usize)> {
    let (prefill, decode) = text.split_once(':').with_context(|| format!("--disagg {text:?}: expected PREFILL:DECODE, e.g. 1:2"))?;
    let (prefill, decode): (usize, usize) = (prefill.trim().parse()?, decode.trim().parse()?);
    anyhow::ensure!(prefill >= 1 && decode >= 1, "--disagg {text:?}: at least one prefill and one decode worker");
    Ok((prefill, decode))
}
/// Runs the replay for every policy.
pub async fn run(args: ReplayArgs) -> anyhow::Result<ReplayReport> {
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    anyhow::ensure!(args.speedup.is_finite() && args.speedup > 0.0, "--speedup must be positive");
    anyhow::ensure!(!args.router.is_empty(), "--router needs at least one policy");
    anyhow::ensure!(
        args.window_secs == 0.0 || (args.window_secs.is_finite() && args.window_secs >= 0.1),
        "--window-secs must be 0 (no timeline) or at least 0.1"
    );
    let requests = shrink(conversations(read_trace(&args.trace, args.limit)?, args.conversations_every)?, args.shrink)?;
    let longest = requests.iter().map(|r| r.input_length as u64 + u64::from(r.output_length)).max().unwrap_or(0);
    let context_length = u32::try_from(longest + 1).context("a trace request exceeds 2^32 tokens")?;
    let oracle = oracle_hits(&requests, args.block_size);
    let prompt_total: usize = requests.iter().map(|r| r.input_length).sum();
    let oracle_rate = oracle.iter().sum::<usize>() as f64 / prompt_total as f64;
    // Ids well inside the vocabulary of the default model, clear of its special tokens.
    let prompts: Arc<Vec<Arc<Vec<u32>>>> = Arc::new(requests.iter().map(|r| Arc::new(prompt_tokens(r, 1000..40_000))).collect());
    anyhow::ensure!(args.routers.iter().all(|&n| n >= 1), "--routers counts must be at least 1");
    anyhow::ensure!(args.redis.is_some() || args.routers.iter().all(|&n| n == 1), "several routers share their index through Redis: pass --redis URL");
    let mut policies = Vec::new();
    if let Some(gateway) = &args.gateway {
        let base = gateway.trim_end_matches('/').trim_end_matches("/v1");
        let models: serde_json::Value = reqwest::get(format!("{base}/v1/models")).await?.error_for_status()?.json().await?;
        let model = models["data"][0]["id"].as_str().with_context(|| format!("{base}/v1/models lists no model"))?.to_owned();
        eprintln!("replaying {} requests against {base} (model {model})...", requests.len());
        let urls = [format!("{base}/v1/completions")];
        let mut report = drive(&args, &urls, &model, &requests, &prompts, &oracle, oracle_rate).await?;
        report.router = "deployment".into();
        print_timeline(&report);
        policies.push(report);
    }
    let splits = args.disagg.iter().map(|text| parse_split(text)).collect::<anyhow::Result<Vec<_>>>()?;
    if !splits.is_empty() && args.gateway.is_none() {
        let mut aggregated_done = Vec::new();
        for &(prefill, decode) in &splits {
            let workers = prefill + decode;
            if !aggregated_done.contains(&workers) {
                eprintln!("replaying {} requests on {workers} aggregated workers...", requests.len());
                let report = replay_one(&args, Policy::Kv, 1, None, Tiers::NONE, workers, &requests, &prompts, context_length, &oracle, oracle_rate).await?;
                policies.push(PolicyReport { router: format!("aggregated x{workers}"), ..report });
                aggregated_done.push(workers);
            }
            eprintln!("replaying {} requests on {prefill} prefill + {decode} decode workers...", requests.len());
            let report =
                replay_one(&args, Policy::Kv, 1, Some((prefill, decode)), Tiers::NONE, workers, &requests, &prompts, context_length, &oracle, oracle_rate)
                    .await?;
            policies.push(PolicyReport { router: format!("{prefill}P:{decode}D"), ..report });
        }
    }
    anyhow::ensure!(!args.host_cache_mib.is_empty(), "--host-cache-mib needs at least one size (0: no host tier)");
    anyhow::ensure!(!args.kv_fetch.is_empty(), "--kv-fetch needs at least one policy");
    anyhow::ensure!(args.disk_cache_gib.is_finite() && args.disk_cache_gib >= 0.0, "--disk-cache-gib must be 0 or positive");
    anyhow::ensure!(args.disk_gbps.is_finite() && args.disk_gbps > 0.0, "--disk-gbps must be positive");
    anyhow::ensure!(args.remote_gbps.is_finite() && args.remote_gbps > 0.0, "--remote-gbps must be positive");
    let mut runs = Vec::new();
    for &policy in args.router.iter().filter(|_| args.gateway.is_none() && splits.is_empty()) {
        for &routers in &args.routers {
            for &host in &args.host_cache_mib {
                // The fetch policy and the store matter only below a host tier.
                let tiers = |fetch, kv_store| Tiers { host_cache_mib: host, disk_cache_gib: if host > 0 { args.disk_cache_gib } else { 0.0 }, fetch, kv_store };
                let stores: &[bool] = if args.kv_store { &[false, true] } else { &[false] };
                match host {
                    0 => runs.push((policy, routers, tiers(None, false))),
                    _ => {
                        for &kv_store in stores {
                            runs.extend(args.kv_fetch.iter().map(|&fetch| (policy, routers, tiers(Some(fetch), kv_store))));
                        }
                    }
                }
            }
        }
    }
    for (policy, routers, tiers) in runs {
        {
            let mut tier = if tiers.host_cache_mib > 0 { format!(", host tier {} MiB", tiers.host_cache_mib) } else { String::new() };
            if tiers.disk_cache_gib > 0.0 {
                tier += &format!(", disk tier {} GiB at {} GB/s", tiers.disk_cache_gib, args.disk_gbps);
            }
            if tiers.kv_store {
                tier += &format!(", kv-store at {} GB/s", args.remote_gbps);
            }
            if let Some(fetch) = tiers.fetch {
                tier += &format!(", --kv-fetch {}", fetch_name(fetch));
            }
            eprintln!("replaying {} requests with the {} router (x{routers}{tier})...", requests.len(), policy.name());
            let report = replay_one(&args, policy, routers, None, tiers, args.workers, &requests, &prompts, context_length, &oracle, oracle_rate).await?;
            print_timeline(&report);
            eprintln!(
                "  {} x{}: ttft mean {:.0} ms p90 {:.0} ms, hit rate {:.3} (oracle {:.3}), {} failed",
                report.router, report.routers, report.ttft.mean_ms, report.ttft.p90_ms, report.prefix_hit_rate, report.oracle_hit_rate, report.failed
            );
            policies.push(report);
        }
    }
    Ok(ReplayReport {
        trace: args.trace.display().to_string(),
        gateway: args.gateway.clone(),
        workers: args.workers,
        speedup: args.speedup,
        engine_speedup: args.engine_speedup.unwrap_or(args.speedup),
        block_size: args.block_size,
        num_blocks: args.num_blocks,
        policies,
    })
}

/// The KV tiers of one run's workers.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tiers {
    host_cache_mib: u64,
    disk_cache_gib: f64,
    /// None: the workers' default (no tier it would apply to).
    fetch: Option<KvFetch>,
    /// Workers share an embedded kv-store.
    kv_store: bool,
}

impl Tiers {
    const NONE: Tiers = Tiers { host_cache_mib: 0, disk_cache_gib: 0.0, fetch: None, kv_store: false };
}

fn fetch_name(fetch: KvFetch) -> &'static str {
    turbine_engine::FetchPolicy::from(fetch).name()
}

#[allow(clippy::too_many_arguments)]
async fn replay_one(
    args: &ReplayArgs,
    policy: Policy,
    routers: usize,
    split: Option<(usize, usize)>,
    tiers: Tiers,
    workers: usize,
    requests: &[TraceRequest],
    prompts: &Arc<Vec<Arc<Vec<u32>>>>,
    context_length: u32,
    oracle: &[usize],
    oracle_rate: f64,
) -> anyhow::Result<PolicyReport> {
    let shutdown = CancellationToken::new();
    let mut config = RunConfig {
        host: [127, 0, 0, 1].into(),
        http_port: 0,
        grpc_port: 0,
        workers,
        prefill_workers: split.map_or(0, |(prefill, _)| prefill),
        decode_workers: split.map_or(0, |(_, decode)| decode),
        shutdown_grace_secs: 1.0,
        ..RunConfig::default()
    };
    config.gateway.max_concurrent_requests = 65_536;
    config.router.policy = policy;
    config.router.kv.tuning = args.kv;
    config.router.disagg_threshold_tokens = args.disagg_threshold_tokens;
    let engine = &mut config.worker.engine;
    engine.model = args.model.clone();
    engine.served_model_name = Some("replay".into());
    engine.engine = EngineKind::Mock;
    engine.speedup = args.engine_speedup.unwrap_or(args.speedup);
    engine.block_size = Some(args.block_size);
    engine.num_blocks = Some(args.num_blocks);
    engine.threads = Some(1);
    engine.context_length = Some(context_length);
    engine.host_cache_mib = tiers.host_cache_mib;
    engine.mock_host_gbps = args.host_gbps;
    // Each worker's disk tier goes to <dir>/<worker id>, removed after the run.
    let disk_dir = if tiers.disk_cache_gib > 0.0 { Some(tempfile::tempdir().context("a directory for the disk tiers")?) } else { None };
    engine.disk_cache_dir = disk_dir.as_ref().map(|dir| dir.path().to_path_buf());
    engine.disk_cache_gib = if tiers.disk_cache_gib > 0.0 { tiers.disk_cache_gib } else { engine.disk_cache_gib };
    engine.mock_disk_gbps = args.disk_gbps;
    engine.mock_remote_gbps = args.remote_gbps;
    if tiers.kv_store {
        config.kv_store_port = Some(0);
    }
    if let Some(fetch) = tiers.fetch {
        engine.kv_fetch = fetch;
    }
    config.worker.transfer.mock_kv_bytes_per_token = args.kv_bytes_per_token;
    config.worker.transfer.mock_transfer_gbps = args.transfer_gbps;
    let options = ClusterOptions {
        routers,
        // A namespace of its own per replay, so runs never share a stream.
        event_log: args.redis.clone().map(|url| (url, format!("replay-{}-{}-{}x{routers}", std::process::id(), unix_millis(), policy.name()))),
        ..ClusterOptions::default()
    };
    // Traffic starts once every gateway lists the model.
    let cluster = Cluster::start(config, options, shutdown.clone()).await?;
    let urls: Vec<String> = cluster.gateways().iter().map(|gateway| format!("http://{}/v1/completions", gateway.http.expect("gateways serve HTTP"))).collect();
    // The workers' tier counters and the routers' cached blocks, read
    // before they stop (they share this process's metrics registry; the
    // routers' count since the process started, hence the difference).
    let before = report::tier_counters(&turbine_runtime::metrics::render());
    let report = drive(args, &urls, "replay", requests, prompts, oracle, oracle_rate).await;
    let mut tier_counters = report::tier_counters(&turbine_runtime::metrics::render());
    for (key, value) in &mut tier_counters {
        if key.starts_with("router ") {
            *value -= before.get(key).copied().unwrap_or(0.0);
        }
    }
    shutdown.cancel();
    cluster.finished().await?;
    let (prefill_workers, decode_workers) = split.unwrap_or((0, 0));
    drop(disk_dir);
    Ok(PolicyReport {
        router: policy.name().to_owned(),
        routers,
        workers,
        prefill_workers,
        decode_workers,
        host_cache_mib: tiers.host_cache_mib,
        disk_cache_gib: tiers.disk_cache_gib,
        kv_fetch: tiers.fetch.map(|fetch| fetch_name(fetch).to_owned()),
        kv_store: tiers.kv_store,
        tier_counters,
        ..report?
    })
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}
