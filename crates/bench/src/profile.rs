//! `turbine profile`: measures one worker configuration (the engine flags
//! of `turbine worker`, native or mocker) through a gateway, as the
//! planner will see it, and writes the profile the planner sizes pools
//! from (`turbine_planner::plan::profile::Profile`):
//!
//! - prefill: for each `--isl`, `--samples` requests alone, one generated
//!   token each; the median time to first token;
//! - decode: for each `--context` and `--concurrency`, that many streamed
//!   requests at once, each with a prompt of `context` tokens generating
//!   `--decode-tokens`; the mean over requests of the time between tokens
//!   after the first.
//!
//! Every prompt is distinct (no prefix cache hits), so each point measures
//! computing, not reusing.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use turbine_cluster::{Cluster, ClusterOptions, RunConfig};
use turbine_planner::plan::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, Profile};
use turbine_runtime::CancellationToken;
use turbine_worker::EngineConfig;

use crate::replay::drive::stream_completion;

/// Flags of `turbine profile`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProfileArgs {
    /// The worker configuration measured.
    #[command(flatten)]
    pub engine: EngineConfig,
    /// Where to write the profile (JSON), for `turbine planner serve --profile`.
    #[arg(long)]
    pub output: PathBuf,
    /// Input lengths at which to measure the time to first token.
    #[arg(long, value_delimiter = ',', default_values_t = [128u32, 512, 2048])]
    pub isl: Vec<u32>,
    /// Contexts (prompt tokens) at which to measure the inter-token latency.
    #[arg(long, value_delimiter = ',', default_values_t = [512u32, 2048])]
    pub context: Vec<u32>,
    /// Sequences decoding together at which to measure the inter-token
    /// latency.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 4, 16])]
    pub concurrency: Vec<u32>,
    /// Tokens each decode request generates (more: steadier numbers).
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: u32,
    /// Requests per prefill point (the median is kept).
    #[arg(long, default_value_t = 3)]
    pub samples: u32,
}

/// How long one measured request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

fn ascending(values: &[u32], flag: &str) -> anyhow::Result<()> {
    anyhow::ensure!(!values.is_empty() && values.iter().all(|&v| v > 0), "--{flag}: at least one positive value");
    anyhow::ensure!(values.windows(2).all(|pair| pair[0] < pair[1]), "--{flag}: values must ascend, each once");
    Ok(())
}

/// Measures the configuration and writes the profile; answers it.
pub async fn run(args: &ProfileArgs) -> anyhow::Result<Profile> {
    ascending(&args.isl, "isl")?;
    ascending(&args.context, "context")?;
    ascending(&args.concurrency, "concurrency")?;
    anyhow::ensure!(args.decode_tokens >= 2, "--decode-tokens: at least 2 (the first token is not an inter-token gap)");
    anyhow::ensure!(args.samples >= 1, "--samples: at least 1");
    let shutdown = CancellationToken::new();
    let mut config = RunConfig { host: [127, 0, 0, 1].into(), http_port: 0, grpc_port: 0, workers: 1, shutdown_grace_secs: 1.0, ..RunConfig::default() };
    config.gateway.max_concurrent_requests = 65_536;
    config.worker.engine = args.engine.clone();
    // Distinct prompts never hit the prefix cache; no tier below it either.
    config.worker.engine.host_cache_mib = 0;
    config.worker.engine.disk_cache_dir = None;
    let cluster = Cluster::start(config, ClusterOptions::default(), shutdown.clone()).await.context("starting the worker to profile")?;
    let url = format!("{}/v1/completions", cluster.http_url());
    let model = cluster.model().to_owned();
    let http = reqwest::Client::builder().timeout(REQUEST_TIMEOUT).pool_max_idle_per_host(1024).build()?;
    let mut next_prompt = 0u32;
    let mut prompt = |tokens: u32| {
        next_prompt += 1;
        // Ids inside the default model's vocabulary, clear of its special tokens; distinct per prompt.
        (0..tokens).map(|t| 1000 + (next_prompt.wrapping_mul(7919).wrapping_add(t.wrapping_mul(31))) % 39_000).collect::<Vec<u32>>()
    };
    let body = |prompt: Vec<u32>, max_tokens: u32| serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});

    let mut prefill = Vec::new();
    for &isl in &args.isl {
        let mut ttfts = Vec::new();
        for _ in 0..args.samples {
            let outcome = stream_completion(&http, &url, &body(prompt(isl), 1)).await.with_context(|| format!("a prefill request of {isl} tokens"))?;
            ttfts.push(outcome.ttft.as_secs_f64() * 1e3);
        }
        ttfts.sort_by(f64::total_cmp);
        let ttft_ms = ttfts[ttfts.len() / 2];
        eprintln!("  prefill isl {isl}: ttft {ttft_ms:.1} ms");
        prefill.push(PrefillPoint { isl, ttft_ms });
    }

    let mut decode = Vec::new();
    for &context in &args.context {
        for &concurrency in &args.concurrency {
            let requests: Vec<_> = (0..concurrency)
                .map(|_| {
                    let (http, url, body) = (http.clone(), url.clone(), body(prompt(context), args.decode_tokens));
                    tokio::spawn(async move { stream_completion(&http, &url, &body).await })
                })
                .collect();
            let mut gaps = Vec::new();
            for request in requests {
                let outcome = request.await?.with_context(|| format!("a decode request of {context} tokens at concurrency {concurrency}"))?;
                anyhow::ensure!(outcome.completion_tokens >= 2, "a decode request generated {} tokens", outcome.completion_tokens);
                gaps.push((outcome.end_to_end - outcome.ttft).as_secs_f64() * 1e3 / (outcome.completion_tokens - 1) as f64);
            }
            let itl_ms = gaps.iter().sum::<f64>() / gaps.len() as f64;
            eprintln!("  decode context {context} x{concurrency}: itl {itl_ms:.2} ms");
            decode.push(DecodePoint { context, concurrency, itl_ms: itl_ms.max(1e-3) });
        }
    }
    shutdown.cancel();
    cluster.finished().await?;
    let engine = &args.engine;
    let mut worker = format!("{} engine, model {}", format!("{:?}", engine.engine).to_lowercase(), engine.model);
    if engine.engine == turbine_worker::EngineKind::Mock {
        worker += &format!(", speedup {}", engine.speedup);
    }
    for (what, value) in [("threads", engine.threads), ("KV blocks", engine.num_blocks), ("tokens per block", engine.block_size)] {
        if let Some(value) = value {
            worker += &format!(", {what} {value}");
        }
    }
    let profile = Profile { version: PROFILE_VERSION, worker, prefill, decode }.check(&args.output.display().to_string())?;
    std::fs::write(&args.output, serde_json::to_vec_pretty(&profile)?).with_context(|| format!("writing {}", args.output.display()))?;
    Ok(profile)
}
