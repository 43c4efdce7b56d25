//! `turbine bench gateway`: what the gateway and router add on top of a
//! worker.
//!
//! Starts a real distributed stack as separate processes (redis-server, a
//! mocker worker at a very high speedup so the engine costs ~nothing, a
//! router, a gateway), then:
//!
//! 1. latency: the same prompt sent alternately straight to the worker's
//!    gRPC `Generate` and through the gateway's streaming
//!    `/v1/completions`; the difference of the distributions is the added
//!    latency;
//! 2. CPU: gateway + router CPU time (from /proc, background subtracted)
//!    over many streamed requests, at `max_tokens` = N and = 1; the
//!    difference divided by N-1 is the CPU per streamed token.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use serde::Serialize;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::worker_client::WorkerClient;
use turbine_testkit::{ChildProcess, RedisServer, STARTUP_TIMEOUT, free_port};
use turbine_tokens::{ModelCard, Preprocessor};

/// Flags of `turbine bench gateway`.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayBenchArgs {
    /// Requests per path in the latency phase (alternating direct and gateway).
    #[arg(long, default_value_t = 300)]
    pub latency_requests: usize,
    /// Requests per CPU phase.
    #[arg(long, default_value_t = 1000)]
    pub cpu_requests: usize,
    /// Prompt length in tokens (the gateway receives it as text).
    #[arg(long, default_value_t = 1000)]
    pub prompt_tokens: usize,
    /// Tokens streamed per request.
    #[arg(long, default_value_t = 100)]
    pub output_tokens: u32,
    /// Concurrent clients in the CPU phases.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Mocker speedup (very high: engine time ~0).
    #[arg(long, default_value_t = 1e6)]
    pub speedup: f64,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Latency summary in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Mean.
    pub mean_us: f64,
}

fn summarize(samples: &mut [Duration]) -> Latency {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e6;
    let mean = samples.iter().map(Duration::as_secs_f64).sum::<f64>() / samples.len() as f64 * 1e6;
    Latency { p50_us: pick(0.5), p90_us: pick(0.9), p99_us: pick(0.99), mean_us: mean }
}

/// CPU cost of one phase.
#[derive(Debug, Clone, Serialize)]
pub struct CpuPhase {
    /// Tokens streamed per request.
    pub output_tokens: u32,
    /// Requests sent.
    pub requests: usize,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Wall time of the phase in seconds.
    pub wall_secs: f64,
    /// Gateway CPU per request (µs), background subtracted.
    pub gateway_cpu_us_per_request: f64,
    /// Router CPU per request (µs), background subtracted.
    pub router_cpu_us_per_request: f64,
}

/// Everything `turbine bench gateway` measures.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayBenchReport {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens streamed per request.
    pub output_tokens: u32,
    /// Worker gRPC Generate, end to end (client side).
    pub direct_end_to_end: Latency,
    /// Through the gateway, end to end (client side, until `[DONE]`).
    pub gateway_end_to_end: Latency,
    /// Worker gRPC Generate, time to first token.
    pub direct_ttft: Latency,
    /// Through the gateway, time to first token.
    pub gateway_ttft: Latency,
    /// Gateway minus direct, end to end, at each percentile.
    pub added_end_to_end: Latency,
    /// CPU phase at `output_tokens`.
    pub cpu_full: CpuPhase,
    /// CPU phase at one token.
    pub cpu_one_token: CpuPhase,
    /// Gateway + router CPU per request at `output_tokens` (µs).
    pub cpu_us_per_request: f64,
    /// Gateway + router CPU per streamed token (µs): the difference of the
    /// two phases over `output_tokens - 1`.
    pub cpu_us_per_streamed_token: f64,
}

/// CPU time (user + system) a process has used, from /proc.
fn process_cpu(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name may contain spaces; fields after the closing paren are fixed.
    let after = stat.rsplit_once(')').context("malformed /proc stat")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: u64 = fields[11].parse()?;
    let stime: u64 = fields[12].parse()?;
    // SAFETY: sysconf only reads a configuration value.
    #[allow(unsafe_code)]
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(Duration::from_secs_f64((utime + stime) as f64 / ticks_per_second))
}

struct Stack {
    _redis: RedisServer,
    worker: ChildProcess,
    router: ChildProcess,
    gateway: ChildProcess,
    worker_endpoint: String,
    gateway_url: String,
}

fn turbine(name: &str, args: &[String]) -> anyhow::Result<ChildProcess> {
    let exe = std::env::current_exe().context("locating the turbine binary")?;
    let mut command = Command::new(exe);
    command.arg(name).args(args).env("RUST_LOG", "warn,turbine=info");
    Ok(ChildProcess::spawn(name, command))
}

fn start_stack(speedup: f64) -> anyhow::Result<Stack> {
    if Command::new(std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())).arg("--version").output().is_err() {
        bail!("redis-server is needed for the distributed stack; install it (Debian: apt-get install redis-server)");
    }
    let redis = RedisServer::start();
    let (worker_port, router_port, gateway_port) = (free_port(), free_port(), free_port());
    let s = |v: &str| v.to_owned();
    let mut worker = turbine(
        "worker",
        &[
            s("--grpc-addr"),
            format!("127.0.0.1:{worker_port}"),
            s("--admin-addr"),
            s("127.0.0.1:0"),
            s("--engine"),
            s("mock"),
            s("--speedup"),
            speedup.to_string(),
            s("--redis"),
            redis.url(),
            s("--namespace"),
            s("bench"),
            s("--worker-id"),
            s("bench-worker"),
        ],
    )?;
    worker.wait_for_line("worker ready", STARTUP_TIMEOUT);
    let mut router = turbine(
        "router",
        &[s("--grpc-addr"), format!("127.0.0.1:{router_port}"), s("--admin-addr"), s("127.0.0.1:0"), s("--redis"), redis.url(), s("--namespace"), s("bench")],
    )?;
    router.wait_for_line("router listening", STARTUP_TIMEOUT);
    let mut gateway = turbine(
        "gateway",
        &[s("--http-addr"), format!("127.0.0.1:{gateway_port}"), s("--grpc-addr"), s("127.0.0.1:0"), s("--router"), format!("http://127.0.0.1:{router_port}")],
    )?;
    gateway.wait_for_line("gateway listening", STARTUP_TIMEOUT);
    Ok(Stack {
        _redis: redis,
        worker,
        router,
        gateway,
        worker_endpoint: format!("http://127.0.0.1:{worker_port}"),
        gateway_url: format!("http://127.0.0.1:{gateway_port}"),
    })
}

/// Text that the model's tokenizer turns into exactly `tokens` tokens.
fn prompt_of(preprocessor: &Preprocessor, tokens: usize) -> anyhow::Result<(String, Vec<u32>)> {
    const WORDS: &[&str] = &["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"];
    let mut text = String::from("Summarize:");
    let mut index = 0usize;
    loop {
        let word = format!(" {}", WORDS[index % WORDS.len()]);
        let candidate = format!("{text}{word}");
        if preprocessor.encode_text(&candidate)?.len() > tokens {
            break;
        }
        text = candidate;
        index += 1;
    }
    // Top up with single-token punctuation.
    while preprocessor.encode_text(&text)?.len() < tokens {
        text.push('.');
    }
    let ids = preprocessor.encode_text(&text)?;
    anyhow::ensure!(ids.len() == tokens, "could not build a {tokens}-token prompt (got {})", ids.len());
    Ok((text, ids))
}

async fn direct_request(client: &mut WorkerClient<tonic::transport::Channel>, ids: &[u32], max_tokens: u32) -> anyhow::Result<(Duration, Duration)> {
    let started = Instant::now();
    let request = pb::GenerateRequest {
        request_id: "bench".into(),
        prompt_token_ids: ids.to_vec(),
        sampling: None,
        stop: Some(pb::StopConditions { max_tokens, stop_token_ids: vec![], ignore_eos: true }),
    };
    let mut stream = client.generate(request).await?.into_inner();
    let mut first = None;
    let mut tokens = 0;
    while let Some(message) = stream.message().await? {
        tokens += message.token_ids.len();
        if first.is_none() && !message.token_ids.is_empty() {
            first = Some(started.elapsed());
        }
        if message.finish_reason() != pb::FinishReason::Unspecified {
            break;
        }
    }
    anyhow::ensure!(tokens == max_tokens as usize, "worker streamed {tokens} tokens, expected {max_tokens}");
    Ok((first.unwrap_or_default(), started.elapsed()))
}

async fn gateway_request(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> anyhow::Result<(Duration, Duration)> {
    let started = Instant::now();
    let response = client.post(url).json(body).send().await?;
    anyhow::ensure!(response.status().is_success(), "gateway answered {}", response.status());
    let mut stream = response.bytes_stream();
    let mut first = None;
    let mut tail: Vec<u8> = Vec::new();
    while let Some(bytes) = stream.next().await {
        let bytes = bytes?;
        if first.is_none() && bytes.windows(7).any(|w| w == b"\"text\":") {
            first = Some(started.elapsed());
        }
        tail.extend_from_slice(&bytes);
        if tail.len() > 64 {
            tail.drain(..tail.len() - 64);
        }
        if tail.windows(12).any(|w| w == b"data: [DONE]") {
            return Ok((first.unwrap_or_default(), started.elapsed()));
        }
    }
    bail!("the gateway stream ended without [DONE]")
}

async fn cpu_phase(stack: &Stack, http: &reqwest::Client, body: &serde_json::Value, requests: usize, concurrency: usize, idle_rate: (f64, f64)) -> anyhow::Result<CpuPhase> {
    let url = format!("{}/v1/completions", stack.gateway_url);
    let (gateway_before, router_before) = (process_cpu(stack.gateway.pid())?, process_cpu(stack.router.pid())?);
    let started = Instant::now();
    let per_client = requests.div_ceil(concurrency);
    let clients = (0..concurrency).map(|_| {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move {
            for _ in 0..per_client {
                gateway_request(&http, &url, &body).await?;
            }
            anyhow::Ok(())
        }
    });
    for result in futures::future::join_all(clients).await {
        result?;
    }
    let wall = started.elapsed().as_secs_f64();
    let sent = per_client * concurrency;
    let gateway = (process_cpu(stack.gateway.pid())? - gateway_before).as_secs_f64() - idle_rate.0 * wall;
    let router = (process_cpu(stack.router.pid())? - router_before).as_secs_f64() - idle_rate.1 * wall;
    Ok(CpuPhase {
        output_tokens: body["max_tokens"].as_u64().unwrap_or_default() as u32,
        requests: sent,
        concurrency,
        wall_secs: wall,
        gateway_cpu_us_per_request: gateway.max(0.0) / sent as f64 * 1e6,
        router_cpu_us_per_request: router.max(0.0) / sent as f64 * 1e6,
    })
}

/// Runs the benchmark.
pub async fn run(args: GatewayBenchArgs) -> anyhow::Result<GatewayBenchReport> {
    anyhow::ensure!(args.output_tokens >= 2, "--output-tokens must be at least 2");
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    eprintln!("starting redis, worker, router and gateway...");
    let stack = start_stack(args.speedup)?;
    let mut worker = WorkerClient::connect(stack.worker_endpoint.clone()).await?.max_decoding_message_size(64 << 20);
    let card = worker.get_model_card(pb::GetModelCardRequest {}).await?.into_inner().card.context("no card")?;
    let card: ModelCard = turbine_worker::convert::card_from_proto(card).map_err(anyhow::Error::msg)?;
    let model = card.name.clone();
    let preprocessor = Preprocessor::new(card)?;
    let (text, ids) = prompt_of(&preprocessor, args.prompt_tokens)?;

    let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
    let url = format!("{}/v1/completions", stack.gateway_url);
    let body = |max_tokens: u32| serde_json::json!({"model": model, "prompt": text, "max_tokens": max_tokens, "stream": true, "ignore_eos": true});
    // Wait until the gateway lists the model, then warm both paths.
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    while gateway_request(&http, &url, &body(2)).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the gateway never served the model");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..50 {
        gateway_request(&http, &url, &body(args.output_tokens)).await?;
        direct_request(&mut worker, &ids, args.output_tokens).await?;
    }

    eprintln!("measuring background CPU...");
    let idle = Duration::from_secs(2);
    let (gateway_idle, router_idle) = (process_cpu(stack.gateway.pid())?, process_cpu(stack.router.pid())?);
    tokio::time::sleep(idle).await;
    let idle_rate = (
        (process_cpu(stack.gateway.pid())? - gateway_idle).as_secs_f64() / idle.as_secs_f64(),
        (process_cpu(stack.router.pid())? - router_idle).as_secs_f64() / idle.as_secs_f64(),
    );

    eprintln!("latency phase: {} requests per path, alternating...", args.latency_requests);
    let (mut direct_e2e, mut gateway_e2e, mut direct_ttft, mut gateway_ttft) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let full = body(args.output_tokens);
    for _ in 0..args.latency_requests {
        let (ttft, e2e) = direct_request(&mut worker, &ids, args.output_tokens).await?;
        direct_ttft.push(ttft);
        direct_e2e.push(e2e);
        let (ttft, e2e) = gateway_request(&http, &url, &full).await?;
        gateway_ttft.push(ttft);
        gateway_e2e.push(e2e);
    }
    let direct_end_to_end = summarize(&mut direct_e2e);
    let gateway_end_to_end = summarize(&mut gateway_e2e);
    let added_end_to_end = Latency {
        p50_us: gateway_end_to_end.p50_us - direct_end_to_end.p50_us,
        p90_us: gateway_end_to_end.p90_us - direct_end_to_end.p90_us,
        p99_us: gateway_end_to_end.p99_us - direct_end_to_end.p99_us,
        mean_us: gateway_end_to_end.mean_us - direct_end_to_end.mean_us,
    };

    eprintln!("CPU phases: {} requests at {} and at 1 token(s), concurrency {}...", args.cpu_requests, args.output_tokens, args.concurrency);
    let cpu_full = cpu_phase(&stack, &http, &full, args.cpu_requests, args.concurrency, idle_rate).await?;
    let cpu_one_token = cpu_phase(&stack, &http, &body(1), args.cpu_requests, args.concurrency, idle_rate).await?;
    let per_request = |phase: &CpuPhase| phase.gateway_cpu_us_per_request + phase.router_cpu_us_per_request;
    let cpu_us_per_request = per_request(&cpu_full);
    let cpu_us_per_streamed_token = (per_request(&cpu_full) - per_request(&cpu_one_token)) / f64::from(args.output_tokens - 1);

    let report = GatewayBenchReport {
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        direct_end_to_end,
        gateway_end_to_end,
        direct_ttft: summarize(&mut direct_ttft),
        gateway_ttft: summarize(&mut gateway_ttft),
        added_end_to_end,
        cpu_full,
        cpu_one_token,
        cpu_us_per_request,
        cpu_us_per_streamed_token,
    };
    drop(stack.worker);
    drop(stack.router);
    drop(stack.gateway);
    Ok(report)
}

/// Prints the report as a table.
pub fn print(report: &GatewayBenchReport) {
    let row = |name: &str, l: &Latency| println!("{name:<28} {:>10.0} {:>10.0} {:>10.0} {:>10.0}", l.p50_us, l.p90_us, l.p99_us, l.mean_us);
    println!("prompt {} tokens, {} streamed tokens per request", report.prompt_tokens, report.output_tokens);
    println!("{:<28} {:>10} {:>10} {:>10} {:>10}", "latency (µs)", "p50", "p90", "p99", "mean");
    row("worker gRPC, end to end", &report.direct_end_to_end);
    row("gateway SSE, end to end", &report.gateway_end_to_end);
    row("added by gateway + router", &report.added_end_to_end);
    row("worker gRPC, first token", &report.direct_ttft);
    row("gateway SSE, first token", &report.gateway_ttft);
    println!();
    for phase in [&report.cpu_full, &report.cpu_one_token] {
        println!(
            "CPU at {:>3} tokens, {} requests, concurrency {}: gateway {:.0} µs + router {:.0} µs per request ({:.1} s wall)",
            phase.output_tokens, phase.requests, phase.concurrency, phase.gateway_cpu_us_per_request, phase.router_cpu_us_per_request, phase.wall_secs
        );
    }
    println!("gateway + router CPU per request: {:.0} µs", report.cpu_us_per_request);
    println!("gateway + router CPU per streamed token: {:.2} µs", report.cpu_us_per_streamed_token);
}
