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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use turbine_router::Policy;
use turbine_runtime::CancellationToken;
use turbine_worker::EngineKind;

use crate::run::{KvFlags, RunArgs, start};

/// Tokens per `hash_ids` entry in Mooncake traces.
const TRACE_BLOCK_TOKENS: usize = 512;

/// Flags of `turbine bench replay`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: PathBuf,
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
    /// Cap on each request's output tokens [default: the trace's].
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// Tokens per KV block of the mocker.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// KV blocks per mocker worker (sets the cache pressure).
    #[arg(long, default_value_t = 16_384)]
    pub num_blocks: usize,
    #[command(flatten)]
    pub kv: KvFlags,
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

/// One trace line.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Generated tokens.
    pub output_length: u32,
    /// Prefix block ids (512 tokens each; the last may be partial).
    pub hash_ids: Vec<u64>,
}

/// Reads a Mooncake-format trace.
pub fn read_trace(path: &std::path::Path, limit: Option<usize>) -> anyhow::Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading trace {}", path.display()))?;
    let mut requests = Vec::new();
    for (number, line) in text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()) {
        if limit.is_some_and(|limit| requests.len() >= limit) {
            break;
        }
        let request: TraceRequest = serde_json::from_str(line).with_context(|| format!("{}:{}: not a Mooncake trace line", path.display(), number + 1))?;
        if request.input_length == 0 || request.hash_ids.is_empty() {
            bail!("{}:{}: a request needs input_length > 0 and hash_ids", path.display(), number + 1);
        }
        if request.hash_ids.len() < request.input_length.div_ceil(TRACE_BLOCK_TOKENS) {
            bail!("{}:{}: {} hash_ids cannot cover {} tokens", path.display(), number + 1, request.hash_ids.len(), request.input_length);
        }
        requests.push(request);
    }
    if requests.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok(requests)
}

/// A token id for position `position` of trace block `hash_id`: fixed per
/// (id, position), spread over `range` so blocks differ.
fn synthetic_token(hash_id: u64, position: usize, range: std::ops::Range<u32>) -> u32 {
    let mut x = hash_id.wrapping_mul(TRACE_BLOCK_TOKENS as u64).wrapping_add(position as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    // splitmix64
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    range.start + (x % u64::from(range.end - range.start)) as u32
}

/// The prompt of one trace request.
pub fn prompt_tokens(request: &TraceRequest, range: std::ops::Range<u32>) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(request.input_length);
    'ids: for &id in &request.hash_ids {
        for position in 0..TRACE_BLOCK_TOKENS {
            if tokens.len() == request.input_length {
                break 'ids;
            }
            tokens.push(synthetic_token(id, position, range.clone()));
        }
    }
    tokens
}

/// Prompt tokens an ideal cache could serve for each request: the leading
/// trace blocks seen before (as far as earlier requests had them), cut to
/// whole engine blocks and leaving at least one token to compute.
pub fn oracle_hits(requests: &[TraceRequest], block_size: usize) -> Vec<usize> {
    // Longest run of each id's tokens any earlier request carried.
    let mut seen: HashMap<u64, usize> = HashMap::new();
    requests
        .iter()
        .map(|request| {
            let mut hit = 0;
            for (index, &id) in request.hash_ids.iter().enumerate() {
                // Ids past the input length carry no tokens.
                let Some(here) = request.input_length.checked_sub(index * TRACE_BLOCK_TOKENS).filter(|&n| n > 0) else { break };
                let here = here.min(TRACE_BLOCK_TOKENS);
                let before = seen.get(&id).copied().unwrap_or(0);
                hit += before.min(here);
                if before < here {
                    break;
                }
            }
            for (index, &id) in request.hash_ids.iter().enumerate() {
                let Some(here) = request.input_length.checked_sub(index * TRACE_BLOCK_TOKENS).filter(|&n| n > 0) else { break };
                let entry = seen.entry(id).or_default();
                *entry = (*entry).max(here.min(TRACE_BLOCK_TOKENS));
            }
            let usable = hit.min(request.input_length - 1);
            usable / block_size * block_size
        })
        .collect()
}

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Summary {
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Mean.
    pub mean_ms: f64,
}

fn summarize(mut samples: Vec<f64>) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    samples.sort_by(f64::total_cmp);
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Summary { p50_ms: pick(0.5), p90_ms: pick(0.9), p99_ms: pick(0.99), mean_ms: samples.iter().sum::<f64>() / samples.len() as f64 }
}

/// One policy's replay.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// Routing policy.
    pub router: String,
    /// Router replicas (each behind its own gateway).
    pub routers: usize,
    /// Workers behind the routers, all roles; 0 for a deployment (--gateway).
    pub workers: usize,
    /// Of those, prefill workers (0 when aggregated).
    pub prefill_workers: usize,
    /// Of those, decode workers (0 when aggregated).
    pub decode_workers: usize,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (non-200 or a broken stream).
    pub failed: usize,
    /// Time to first token.
    pub ttft: Summary,
    /// Mean time between tokens, per request.
    pub itl: Summary,
    /// End-to-end latency.
    pub end_to_end: Summary,
    /// Output tokens per second of wall time.
    pub output_tokens_per_sec: f64,
    /// Cached prompt tokens / prompt tokens, as the engines reported.
    pub prefix_hit_rate: f64,
    /// The same for an ideal cache (see the module docs).
    pub oracle_hit_rate: f64,
    /// prefix_hit_rate / oracle_hit_rate.
    pub share_of_oracle: f64,
    /// Wall time of the replay in seconds.
    pub wall_secs: f64,
    /// Hit rates by arrival window (with --window-secs).
    pub timeline: Vec<Window>,
}

/// The requests that arrived in one window of the replay.
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    /// Window start, seconds after the first arrival.
    pub start_secs: f64,
    /// Requests that arrived in it.
    pub requests: usize,
    /// Of those, requests that failed.
    pub failed: usize,
    /// Cached prompt tokens over prompt tokens (successful requests).
    pub hit_rate: f64,
    /// Cached tokens the oracle could serve, over what it could serve:
    /// how much of the reuse available in this window was captured.
    pub oracle_share: Option<f64>,
}

/// Everything `turbine bench replay` measures.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace file.
    pub trace: String,
    /// The deployment replayed against (--gateway); the stack fields
    /// below then describe nothing.
    pub gateway: Option<String>,
    /// Mocker workers of the router policies (--workers); a disaggregated
    /// sweep's own counts are in each of `policies`.
    pub workers: usize,
    /// Time compression of arrivals.
    pub speedup: f64,
    /// The mocker's speedup.
    pub engine_speedup: f64,
    /// Mocker block size and pool.
    pub block_size: usize,
    /// KV blocks per worker.
    pub num_blocks: usize,
    /// One entry per policy, in the order run.
    pub policies: Vec<PolicyReport>,
}

struct Outcome {
    ttft: Duration,
    end_to_end: Duration,
    text_events: usize,
    completion_tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Runs the replay for every policy.
pub async fn run(args: ReplayArgs) -> anyhow::Result<ReplayReport> {
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    anyhow::ensure!(args.speedup.is_finite() && args.speedup > 0.0, "--speedup must be positive");
    anyhow::ensure!(!args.router.is_empty(), "--router needs at least one policy");
    anyhow::ensure!(args.window_secs == 0.0 || (args.window_secs.is_finite() && args.window_secs >= 0.1), "--window-secs must be 0 (no timeline) or at least 0.1");
    let requests = read_trace(&args.trace, args.limit)?;
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
                let report = replay_one(&args, Policy::Kv, 1, None, workers, &requests, &prompts, context_length, &oracle, oracle_rate).await?;
                policies.push(PolicyReport { router: format!("aggregated x{workers}"), ..report });
                aggregated_done.push(workers);
            }
            eprintln!("replaying {} requests on {prefill} prefill + {decode} decode workers...", requests.len());
            let report = replay_one(&args, Policy::Kv, 1, Some((prefill, decode)), workers, &requests, &prompts, context_length, &oracle, oracle_rate).await?;
            policies.push(PolicyReport { router: format!("{prefill}P:{decode}D"), ..report });
        }
    }
    for &policy in args.router.iter().filter(|_| args.gateway.is_none() && splits.is_empty()) {
        for &routers in &args.routers {
            eprintln!("replaying {} requests with the {} router (x{routers})...", requests.len(), policy.name());
            let report = replay_one(&args, policy, routers, None, args.workers, &requests, &prompts, context_length, &oracle, oracle_rate).await?;
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

#[allow(clippy::too_many_arguments)]
async fn replay_one(
    args: &ReplayArgs,
    policy: Policy,
    routers: usize,
    split: Option<(usize, usize)>,
    workers: usize,
    requests: &[TraceRequest],
    prompts: &Arc<Vec<Arc<Vec<u32>>>>,
    context_length: u32,
    oracle: &[usize],
    oracle_rate: f64,
) -> anyhow::Result<PolicyReport> {
    let shutdown = CancellationToken::new();
    let run_args = RunArgs {
        model: args.model.clone(),
        served_model_name: Some("replay".into()),
        workers,
        prefill_workers: split.map_or(0, |(prefill, _)| prefill),
        decode_workers: split.map_or(0, |(_, decode)| decode),
        disagg_threshold_tokens: args.disagg_threshold_tokens,
        kv_transport: turbine_worker::KvTransport::Auto,
        mock_kv_bytes_per_token: args.kv_bytes_per_token,
        mock_transfer_gbps: args.transfer_gbps,
        engine: EngineKind::Mock,
        host: [127, 0, 0, 1].into(),
        http_port: 0,
        grpc_port: 0,
        policy,
        kv: args.kv.clone(),
        speedup: args.engine_speedup.unwrap_or(args.speedup),
        block_size: Some(args.block_size),
        num_blocks: Some(args.num_blocks),
        kv_cache_mib: 512,
        threads: Some(1),
        device: "cpu".into(),
        context_length: Some(context_length),
        max_num_seqs: 256,
        max_batched_tokens: 8192,
        max_concurrent_requests: 65_536,
        shutdown_grace_secs: 1.0,
        routers,
        // A namespace of its own per replay, so runs never share a stream.
        event_log: args.redis.clone().map(|url| (url, format!("replay-{}-{}-{}x{routers}", std::process::id(), unix_millis(), policy.name()))),
    };
    let stack = start(run_args, shutdown.clone()).await?;
    // Traffic starts once every gateway lists the model and the routers
    // have polled the registry (100 ms) at least twice.
    for port in &stack.http_ports {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let listed = match reqwest::get(format!("http://127.0.0.1:{port}/v1/models")).await {
                Ok(response) => response.json::<serde_json::Value>().await.ok().is_some_and(|body| body["data"].as_array().is_some_and(|data| !data.is_empty())),
                Err(_) => false,
            };
            if listed {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "the stack never listed its model");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    let urls: Vec<String> = stack.http_ports.iter().map(|port| format!("http://127.0.0.1:{port}/v1/completions")).collect();
    let report = drive(args, &urls, "replay", requests, prompts, oracle, oracle_rate).await;
    shutdown.cancel();
    stack.finished.await.context("stack panicked")??;
    let (prefill_workers, decode_workers) = split.unwrap_or((0, 0));
    Ok(PolicyReport { router: policy.name().to_owned(), routers, workers, prefill_workers, decode_workers, ..report? })
}

/// Sends the trace to the gateways at `urls` (in turn) at its arrival times
/// and summarizes what came back.
async fn drive(
    args: &ReplayArgs,
    urls: &[String],
    model: &str,
    requests: &[TraceRequest],
    prompts: &Arc<Vec<Arc<Vec<u32>>>>,
    oracle: &[usize],
    oracle_rate: f64,
) -> anyhow::Result<PolicyReport> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build()?;
    let arrival = |request: &TraceRequest| request.timestamp.saturating_sub(requests[0].timestamp) as f64 / 1000.0 / args.speedup;
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (index, request) in requests.iter().enumerate() {
        tokio::time::sleep_until((started + Duration::from_secs_f64(arrival(request))).into()).await;
        let max_tokens = args.max_output_tokens.map_or(request.output_length, |cap| request.output_length.min(cap)).max(1);
        let body = serde_json::json!({
            "model": model,
            "prompt": &*prompts[index],
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        // Gateways in turn, as a load balancer in front of them would.
        let (http, url) = (http.clone(), urls[index % urls.len()].clone());
        tasks.push(tokio::spawn(async move { stream_completion(&http, &url, &body).await }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    let mut failed = 0;
    for task in tasks {
        let result = task.await?;
        if let Err(error) = &result {
            failed += 1;
            if failed <= 5 {
                eprintln!("  request failed: {error:#}");
            }
        }
        results.push(result);
    }
    let wall = started.elapsed();
    let timeline = if args.window_secs > 0.0 {
        timeline(args.window_secs, requests.iter().map(arrival).collect(), &results, oracle)
    } else {
        Vec::new()
    };
    let outcomes: Vec<&Outcome> = results.iter().filter_map(|r| r.as_ref().ok()).collect();

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft = summarize(outcomes.iter().map(|o| ms(o.ttft)).collect());
    let itl = summarize(
        outcomes.iter().filter(|o| o.text_events > 1).map(|o| ms(o.end_to_end - o.ttft) / (o.text_events - 1) as f64).collect(),
    );
    let end_to_end = summarize(outcomes.iter().map(|o| ms(o.end_to_end)).collect());
    let completion: u64 = outcomes.iter().map(|o| o.completion_tokens).sum();
    let prompt: u64 = outcomes.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
    let prefix_hit_rate = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 };
    Ok(PolicyReport {
        router: String::new(),
        routers: urls.len(),
        workers: 0,
        prefill_workers: 0,
        decode_workers: 0,
        requests: requests.len(),
        failed,
        ttft,
        itl,
        end_to_end,
        output_tokens_per_sec: completion as f64 / wall.as_secs_f64(),
        prefix_hit_rate,
        oracle_hit_rate: oracle_rate,
        share_of_oracle: if oracle_rate > 0.0 { prefix_hit_rate / oracle_rate } else { 0.0 },
        wall_secs: wall.as_secs_f64(),
        timeline,
    })
}

/// Hit rates per window of `window` seconds of arrival time.
fn timeline(window: f64, arrivals: Vec<f64>, results: &[anyhow::Result<Outcome>], oracle: &[usize]) -> Vec<Window> {
    let count = arrivals.iter().map(|&a| (a / window) as usize + 1).max().unwrap_or(0);
    let mut windows: Vec<(Window, u64, u64, u64, u64)> =
        (0..count).map(|i| (Window { start_secs: i as f64 * window, requests: 0, failed: 0, hit_rate: 0.0, oracle_share: None }, 0, 0, 0, 0)).collect();
    for ((arrival, result), &oracle) in arrivals.iter().zip(results).zip(oracle) {
        let (window, prompt, cached, captured, available) = &mut windows[(arrival / window) as usize];
        window.requests += 1;
        match result {
            Ok(outcome) => {
                *prompt += outcome.prompt_tokens;
                *cached += outcome.cached_tokens;
                *captured += outcome.cached_tokens.min(oracle as u64);
                *available += oracle as u64;
            }
            Err(_) => window.failed += 1,
        }
    }
    windows
        .into_iter()
        .map(|(mut window, prompt, cached, captured, available)| {
            window.hit_rate = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 };
            window.oracle_share = (available > 0).then(|| captured as f64 / available as f64);
            window
        })
        .collect()
}

/// Prints a report's timeline, if it has one.
fn print_timeline(report: &PolicyReport) {
    if report.timeline.is_empty() {
        return;
    }
    eprintln!("  {:>8} {:>8} {:>6} {:>8} {:>13}", "from", "requests", "failed", "hit", "oracle share");
    for window in &report.timeline {
        let share = window.oracle_share.map_or("-".to_owned(), |share| format!("{:.1}%", share * 100.0));
        eprintln!("  {:>7.0}s {:>8} {:>6} {:>8.3} {:>13}", window.start_secs, window.requests, window.failed, window.hit_rate, share);
    }
}

/// One streamed completion: first text, end, text events and usage.
async fn stream_completion(http: &reqwest::Client, url: &str, body: &serde_json::Value) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let response = http.post(url).json(body).send().await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!("gateway answered {status}: {text}");
    }
    let mut first = None;
    let mut text_events = 0;
    let mut usage = None;
    let done = super::for_each_sse_data(response, |data| {
        if data == b"[DONE]" {
            return Ok(false);
        }
        if super::carries_text(data) {
            text_events += 1;
            first.get_or_insert_with(|| started.elapsed());
        }
        if data.windows(8).any(|w| w == b"\"usage\":") {
            let chunk: serde_json::Value = serde_json::from_slice(data)?;
            let usage_json = &chunk["usage"];
            if usage_json.is_object() {
                usage = Some((
                    usage_json["prompt_tokens"].as_u64().unwrap_or(0),
                    usage_json["completion_tokens"].as_u64().unwrap_or(0),
                    usage_json["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
                ));
            }
        }
        Ok(true)
    })
    .await?;
    if !done {
        bail!("the stream ended without [DONE]");
    }
    let (prompt_tokens, completion_tokens, cached_tokens) = usage.context("the stream carried no usage")?;
    Ok(Outcome { ttft: first.unwrap_or_else(|| started.elapsed()), end_to_end: started.elapsed(), text_events, completion_tokens, prompt_tokens, cached_tokens })
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// Prints the side-by-side table.
pub fn print(report: &ReplayReport) {
    match &report.gateway {
        Some(gateway) => println!("replay of {} against {gateway}, arrivals {}x", report.trace, report.speedup),
        None => println!(
            "replay of {} on mocker workers ({} blocks of {} tokens each), arrivals {}x, engines {}x",
            report.trace, report.num_blocks, report.block_size, report.speedup, report.engine_speedup
        ),
    }
    println!(
        "{:<14} {:>7} {:>8} {:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>10} {:>9} {:>8} {:>8}",
        "router", "workers", "requests", "failed", "ttft mean", "ttft p50", "ttft p90", "itl mean", "itl p90", "e2e mean", "out tok/s", "hit", "oracle"
    );
    for p in &report.policies {
        let label = if p.routers > 1 { format!("{} x{}", p.router, p.routers) } else { p.router.clone() };
        println!(
            "{:<14} {:>7} {:>8} {:>6} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>7.1}ms {:>7.1}ms {:>8.0}ms {:>9.0} {:>8.3} {:>8.3}",
            label,
            if p.workers == 0 { "-".to_owned() } else { p.workers.to_string() },
            p.requests,
            p.failed,
            p.ttft.mean_ms,
            p.ttft.p50_ms,
            p.ttft.p90_ms,
            p.itl.mean_ms,
            p.itl.p90_ms,
            p.end_to_end.mean_ms,
            p.output_tokens_per_sec,
            p.prefix_hit_rate,
            p.oracle_hit_rate
        );
    }
    let one = |name: &str| report.policies.iter().find(|p| p.router == name && p.routers == 1);
    if let (Some(kv), Some(rr)) = (one("kv"), one("round-robin")) {
        println!(
            "kv vs round-robin: mean TTFT {:.2}x lower, p90 TTFT {:.2}x lower; kv captures {:.1}% of the oracle hit rate",
            rr.ttft.mean_ms / kv.ttft.mean_ms,
            rr.ttft.p90_ms / kv.ttft.p90_ms,
            kv.share_of_oracle * 100.0
        );
    }
    // The disaggregated sweep: each split against aggregated workers of the same count.
    for p in report.policies.iter().filter(|p| p.prefill_workers > 0) {
        let workers = p.workers;
        if let Some(aggregated) = report.policies.iter().find(|a| a.router == format!("aggregated x{workers}")) {
            println!(
                "{} vs aggregated x{workers}: TTFT mean {:.2}x, p90 {:.2}x; ITL mean {:.2}x, p90 {:.2}x (below 1: disaggregated is faster)",
                p.router,
                p.ttft.mean_ms / aggregated.ttft.mean_ms,
                p.ttft.p90_ms / aggregated.ttft.p90_ms,
                p.itl.mean_ms / aggregated.itl.mean_ms,
                p.itl.p90_ms / aggregated.itl.p90_ms
            );
        }
    }
    for p in report.policies.iter().filter(|p| p.routers > 1) {
        if let Some(single) = one(&p.router) {
            println!(
                "{} x{} vs one router: hit rate {:+.1} points, mean TTFT {:.2}x",
                p.router,
                p.routers,
                (p.prefix_hit_rate - single.prefix_hit_rate) * 100.0,
                p.ttft.mean_ms / single.ttft.mean_ms
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: usize, hash_ids: Vec<u64>) -> TraceRequest {
        TraceRequest { timestamp: 0, input_length, output_length: 1, hash_ids }
    }

    #[test]
    fn shared_ids_give_shared_prefixes() {
        let a = prompt_tokens(&request(1100, vec![7, 8, 9]), 1000..40_000);
        let b = prompt_tokens(&request(600, vec![7, 5]), 1000..40_000);
        assert_eq!((a.len(), b.len()), (1100, 600));
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..600], b[512..600]);
        assert!(a.iter().all(|t| (1000..40_000).contains(t)));
    }

    #[test]
    fn the_oracle_counts_prefix_blocks_seen_before() {
        let requests = vec![request(1100, vec![1, 2, 3]), request(1100, vec![1, 2, 4]), request(700, vec![1, 2]), request(600, vec![9, 2])];
        // 2nd: ids 1 and 2 seen in full (1024). 3rd: id 1 in full, id 2 only
        // its first 188 tokens here (all of them seen) = 700, minus the last
        // token, cut to blocks of 64 = 640. 4th: id 9 unseen.
        assert_eq!(oracle_hits(&requests, 64), vec![0, 1024, 640, 0]);
    }

    #[test]
    fn ids_beyond_the_input_length_carry_no_tokens() {
        let requests = vec![request(600, vec![1, 2, 3]), request(600, vec![1, 2, 3])];
        // Id 3 lies past 600 tokens in both; the repeat hits 599 tokens, cut to 576.
        assert_eq!(oracle_hits(&requests, 64), vec![0, 576]);
    }

    #[test]
    fn a_partial_block_seen_before_only_covers_what_was_seen() {
        let requests = vec![request(600, vec![1, 2]), request(1100, vec![1, 2, 3])];
        // Request 1 carried 88 tokens of id 2: 512 + 88 = 600, cut to 576.
        assert_eq!(oracle_hits(&requests, 64), vec![0, 576]);
    }
}

/// A plot panel: its title and the (mean, p90) it draws per configuration.
type Panel = (&'static str, fn(&PolicyReport) -> (f64, f64));

/// Writes grouped bars of TTFT and ITL (mean and p90) per configuration as
/// an SVG file.
pub fn write_plot(report: &ReplayReport, path: &std::path::Path) -> anyhow::Result<()> {
    let panels: [Panel; 2] = [
        ("time to first token (ms)", |p| (p.ttft.mean_ms, p.ttft.p90_ms)),
        ("inter-token latency (ms)", |p| (p.itl.mean_ms, p.itl.p90_ms)),
    ];
    let (width, panel_height, left, top) = (120.0 + 110.0 * report.policies.len() as f64, 300.0, 70.0, 50.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"22\" font-size=\"15\">{}</text>\n",
        top + 2.0 * (panel_height + 60.0),
        escape(&format!("{} (arrivals {}x, engines {}x): mean (dark) and p90 (light)", report.trace.rsplit('/').next().unwrap_or(&report.trace), report.speedup, report.engine_speedup)),
    );
    for (index, (title, values)) in panels.iter().enumerate() {
        let y0 = top + index as f64 * (panel_height + 60.0);
        let max = report.policies.iter().map(|p| values(p).1.max(values(p).0)).fold(1e-9, f64::max) * 1.1;
        let plot_height = panel_height - 40.0;
        svg += &format!("<text x=\"{left}\" y=\"{}\" font-size=\"13\">{}</text>\n", y0 + 12.0, escape(title));
        let base = y0 + 20.0 + plot_height;
        svg += &format!("<line x1=\"{left}\" y1=\"{base}\" x2=\"{}\" y2=\"{base}\" stroke=\"black\"/>\n", width - 20.0);
        for tick in 0..=4 {
            let value = max * tick as f64 / 4.0;
            let y = base - plot_height * tick as f64 / 4.0;
            svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{value:.0}</text>\n", left - 6.0, y + 4.0);
            svg += &format!("<line x1=\"{left}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/>\n", width - 20.0);
        }
        for (slot, policy) in report.policies.iter().enumerate() {
            let (mean, p90) = values(policy);
            let x = left + 20.0 + slot as f64 * 110.0;
            let color = if policy.prefill_workers > 0 { ("#1f5fa8", "#8fb4e0") } else { ("#555555", "#b0b0b0") };
            for (offset, value, fill) in [(0.0, mean, color.0), (40.0, p90, color.1)] {
                let height = plot_height * value / max;
                svg += &format!("<rect x=\"{}\" y=\"{}\" width=\"38\" height=\"{height}\" fill=\"{fill}\"/>\n", x + offset, base - height);
                svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"10\">{value:.0}</text>\n", x + offset + 19.0, base - height - 3.0);
            }
            svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x + 39.0, base + 16.0, escape(&policy.router));
        }
    }
    svg += "</svg>\n";
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
