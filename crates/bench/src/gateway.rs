//! `turbine bench gateway`: what the gateway and router add on top of a
//! worker.
//!
//! Starts a real distributed stack as separate processes (redis-server, a
//! mocker worker, a router, a gateway), then:
//!
//! 1. latency: the same prompt sent alternately straight to the worker's
//!    gRPC `Generate` and through the gateway's streaming
//!    `/v1/completions`; the difference of the distributions is the added
//!    latency;
//! 2. CPU: gateway + router CPU time (from /proc, background subtracted)
//!    over many streamed requests, at `max_tokens` = N and = 1; the
//!    difference divided by N-1 is the CPU per streamed token.
//!
//! The mocker runs 10× faster than its model of a GPU by default: engine
//! time is small, yet each decode step (~0.6 ms) still takes longer than
//! the gateway needs for the tokens of 32 concurrent streams, so every
//! token reaches the client as its own SSE event, as in real serving. At a
//! very high speedup (`--speedup 1000000`) the engine takes no time, the
//! worker hands the gateway tokens in bursts and the gateway streams each
//! burst as one event: cheaper, but per-token costs then mostly vanish from
//! the measurement. The report shows text events per request so the two
//! regimes are not confused.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use turbine_harness::{RedisServer, STARTUP_TIMEOUT, ServiceProcess};
use turbine_proto::MessageLimits;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::worker_client::WorkerClient;
use turbine_runtime::host::Role;
use turbine_tokens::{ModelCard, Preprocessor};

/// Flags of `turbine bench gateway`.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayBenchArgs {
    /// Requests per path in the latency phase (alternating direct and gateway).
    #[arg(long, default_value_t = 200)]
    pub latency_requests: usize,
    /// Requests per CPU phase.
    #[arg(long, default_value_t = 640)]
    pub cpu_requests: usize,
    /// Prompt length in tokens (the gateway receives it as text).
    #[arg(long, default_value_t = 1000)]
    pub prompt_tokens: usize,
    /// Tokens streamed per request.
    #[arg(long, default_value_t = 100)]
    pub output_tokens: u32,
    /// Concurrent clients in the CPU phases (comma-separated: one pair of
    /// phases per value).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub concurrency: Vec<usize>,
    /// Mocker speedup: high enough that engine time is small, low enough
    /// that tokens arrive one per event (see the module docs).
    #[arg(long, default_value_t = 10.0)]
    pub speedup: f64,
    /// Every gRPC hop over mutual TLS (certificates from `turbine certs`
    /// in a temporary folder; this process calls the worker directly as a
    /// gateway): what TLS adds, against a plaintext run.
    #[arg(long)]
    pub tls: bool,
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

pub(crate) fn summarize(samples: &mut [Duration]) -> Latency {
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
    /// SSE events carrying text per request, on average (equal to the
    /// tokens per request when every token streams on its own).
    pub text_events_per_request: f64,
    /// Gateway CPU per request (µs), background subtracted.
    pub gateway_cpu_us_per_request: f64,
    /// Router CPU per request (µs), background subtracted.
    pub router_cpu_us_per_request: f64,
}

/// Everything `turbine bench gateway` measures.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayBenchReport {
    /// Whether every gRPC hop was mutual TLS.
    pub tls: bool,
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
    /// CPU measurements, one per concurrency.
    pub cpu: Vec<CpuResult>,
}

/// CPU cost at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct CpuResult {
    /// Concurrent clients.
    pub concurrency: usize,
    /// Phase at `output_tokens`.
    pub full: CpuPhase,
    /// Phase at one token.
    pub one_token: CpuPhase,
    /// Gateway + router CPU per request at one token: the fixed cost of a
    /// request (µs).
    pub cpu_us_per_request: f64,
    /// Gateway + router CPU per streamed token (µs): the difference of the
    /// two phases over `output_tokens - 1`.
    pub cpu_us_per_streamed_token: f64,
}

/// CPU time (user + system, nanoseconds) of every live thread of a
/// process, from `/proc/<pid>/task/<tid>/schedstat` (nanosecond precision,
/// unlike the 10 ms ticks of `/proc/<pid>/stat`).
pub(crate) fn thread_cpu(pid: u32) -> anyhow::Result<HashMap<u32, u64>> {
    let mut threads = HashMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).with_context(|| format!("listing threads of {pid}"))? {
        let entry = entry?;
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A thread may exit between listing and reading.
        let Ok(schedstat) = std::fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        let on_cpu_ns: u64 = schedstat.split_whitespace().next().context("empty schedstat")?.parse()?;
        threads.insert(tid, on_cpu_ns);
    }
    Ok(threads)
}

/// CPU a process used between two [`thread_cpu`] readings (threads that
/// appeared count in full; threads that exited are lost, a negligible
/// error for long-lived service threads).
pub(crate) fn cpu_between(before: &HashMap<u32, u64>, after: &HashMap<u32, u64>) -> Duration {
    let nanos: u64 = after.iter().map(|(tid, &ns)| ns.saturating_sub(before.get(tid).copied().unwrap_or(0))).sum();
    Duration::from_nanos(nanos)
}

pub(crate) struct Stack {
    /// The certificates, with --tls.
    certs: Option<tempfile::TempDir>,
    redis: RedisServer,
    pub(crate) worker: ServiceProcess,
    pub(crate) router: ServiceProcess,
    pub(crate) gateway: ServiceProcess,
}

impl Stack {
    /// The folder of the certificates (`turbine certs`), with TLS.
    pub(crate) fn certs(&self) -> Option<&std::path::Path> {
        self.certs.as_ref().map(tempfile::TempDir::path)
    }

    /// The Redis the stack's registry is in.
    pub(crate) fn redis_url(&self) -> String {
        self.redis.url()
    }
}

/// The model the stack's worker serves (asked as a gateway).
pub(crate) async fn model_of(stack: &Stack) -> anyhow::Result<String> {
    let mut worker = WorkerClient::new(direct_channel(&stack.worker.grpc_endpoint()).await?).with_message_limits();
    let card = worker.get_model_card(pb::GetModelCardRequest {}).await?.into_inner().card.context("no card")?;
    Ok(ModelCard::try_from(card)?.name)
}

/// `turbine <service>` (this binary) with `args`, on free ports.
async fn turbine(name: &str, args: &[String], http: bool) -> anyhow::Result<ServiceProcess> {
    let exe = std::env::current_exe().context("locating the turbine binary")?;
    let mut command = Command::new(exe);
    command.arg(name).args(args).env("RUST_LOG", "warn,turbine=info");
    let mut service = ServiceProcess::spawn(name, command, http).await?;
    let role = match name {
        "worker" => Role::Worker,
        "router" => Role::Router,
        _ => Role::Gateway,
    };
    service.until_serving(role, "", STARTUP_TIMEOUT).await?;
    Ok(service)
}

/// The stack's worker id.
const BENCH_WORKER: &str = "bench-worker";

/// With `tls`: a CA and certificates for every role in a temporary folder
/// (`turbine certs`), this process made a gateway; the folder, and each
/// role's `--tls-*` flags.
fn certificates(tls: bool) -> anyhow::Result<(Option<tempfile::TempDir>, impl Fn(Role) -> Vec<String>)> {
    let dir = if tls { Some(tempfile::tempdir()?) } else { None };
    if let Some(dir) = &dir {
        let exe = std::env::current_exe().context("locating the turbine binary")?;
        // The worker's certificate names its worker id (its sealed
        // registry record is refused otherwise).
        let made = Command::new(exe).args(["certs", "--worker", BENCH_WORKER, "--out"]).arg(dir.path()).output()?;
        anyhow::ensure!(made.status.success(), "turbine certs: {}", String::from_utf8_lossy(&made.stderr));
    }
    let path = dir.as_ref().map(|dir| dir.path().to_owned());
    if let Some(path) = &path {
        turbine_runtime::trust::TlsConfig {
            tls_cert: Some(path.join("gateway.crt")),
            tls_key: Some(path.join("gateway.key")),
            tls_ca: Some(path.join("ca.crt")),
        }
        .establish()?;
    }
    let flags = move |role: Role| -> Vec<String> {
        let Some(path) = &path else { return Vec::new() };
        let file = |name: String| path.join(name).display().to_string();
        let name = if role == Role::Worker { format!("workers/{BENCH_WORKER}") } else { role.as_str().to_owned() };
        vec!["--tls-cert".into(), file(format!("{name}.crt")), "--tls-key".into(), file(format!("{name}.key")), "--tls-ca".into(), file("ca.crt".into())]
    };
    Ok((dir, flags))
}

/// The channel this process calls the worker on directly: plain tonic (no
/// trace context), over TLS as a gateway with --tls.
async fn direct_channel(endpoint: &str) -> anyhow::Result<tonic::transport::Channel> {
    let uri = match (turbine_runtime::trust::dialing_as(), endpoint.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => endpoint.to_owned(),
    };
    let mut endpoint = tonic::transport::Endpoint::from_shared(uri)?;
    if let Some(trust) = turbine_runtime::trust::dialing_as() {
        endpoint = endpoint.tls_config(trust.client_config(Role::Worker))?;
    }
    Ok(endpoint.connect().await?)
}

pub(crate) async fn start_stack(speedup: f64, tls: bool) -> anyhow::Result<Stack> {
    if Command::new(std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())).arg("--version").output().is_err() {
        bail!("redis-server is needed for the distributed stack; install it (Debian: apt-get install redis-server)");
    }
    let (certs, tls_flags) = certificates(tls)?;
    let redis = RedisServer::start();
    let s = |v: &str| v.to_owned();
    let cluster = [s("--redis"), redis.url(), s("--namespace"), s("bench")];
    let worker_args = [s("--engine"), s("mock"), s("--speedup"), speedup.to_string(), s("--worker-id"), s(BENCH_WORKER)];
    let worker = turbine("worker", &[&cluster[..], &worker_args[..], &tls_flags(Role::Worker)[..]].concat(), false).await?;
    let router = turbine("router", &[&cluster[..], &tls_flags(Role::Router)[..]].concat(), false).await?;
    let gateway = turbine("gateway", &[&[s("--router"), router.grpc_endpoint()][..], &tls_flags(Role::Gateway)[..]].concat(), true).await?;
    Ok(Stack { certs, redis, worker, router, gateway })
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
        remote_prefill: None,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
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

/// One streamed completion through the gateway: (time to first text, time
/// to `[DONE]`, SSE events that carried text).
pub(crate) async fn gateway_request(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> anyhow::Result<(Duration, Duration, usize)> {
    let started = Instant::now();
    let response = client.post(url).json(body).send().await?;
    anyhow::ensure!(response.status().is_success(), "gateway answered {}", response.status());
    let mut first = None;
    let mut text_events = 0;
    let done = crate::for_each_sse_data(response, |data| {
        if data == b"[DONE]" {
            return Ok(false);
        }
        if crate::carries_text(data) {
            text_events += 1;
            first.get_or_insert_with(|| started.elapsed());
        }
        Ok(true)
    })
    .await?;
    if !done {
        bail!("the gateway stream ended without [DONE]");
    }
    Ok((first.unwrap_or_default(), started.elapsed(), text_events))
}

async fn cpu_phase(
    stack: &Stack,
    http: &reqwest::Client,
    body: &serde_json::Value,
    requests: usize,
    concurrency: usize,
    idle_rate: (f64, f64),
) -> anyhow::Result<CpuPhase> {
    let url = format!("{}/v1/completions", stack.gateway.http_url());
    let (gateway_before, router_before) = (thread_cpu(stack.gateway.pid())?, thread_cpu(stack.router.pid())?);
    let started = Instant::now();
    let per_client = requests.div_ceil(concurrency);
    let clients = (0..concurrency).map(|_| {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move {
            let mut events = 0;
            for _ in 0..per_client {
                events += gateway_request(&http, &url, &body).await?.2;
            }
            anyhow::Ok(events)
        }
    });
    let mut events = 0;
    for result in futures::future::join_all(clients).await {
        events += result?;
    }
    let wall = started.elapsed().as_secs_f64();
    let sent = per_client * concurrency;
    let gateway = cpu_between(&gateway_before, &thread_cpu(stack.gateway.pid())?).as_secs_f64() - idle_rate.0 * wall;
    let router = cpu_between(&router_before, &thread_cpu(stack.router.pid())?).as_secs_f64() - idle_rate.1 * wall;
    Ok(CpuPhase {
        output_tokens: body["max_tokens"].as_u64().unwrap_or_default() as u32,
        requests: sent,
        concurrency,
        wall_secs: wall,
        text_events_per_request: events as f64 / sent as f64,
        gateway_cpu_us_per_request: gateway.max(0.0) / sent as f64 * 1e6,
        router_cpu_us_per_request: router.max(0.0) / sent as f64 * 1e6,
    })
}

/// Runs the benchmark.
pub async fn run(args: GatewayBenchArgs) -> anyhow::Result<GatewayBenchReport> {
    anyhow::ensure!(args.output_tokens >= 2, "--output-tokens must be at least 2");
    anyhow::ensure!(!args.concurrency.is_empty() && args.concurrency.iter().all(|&c| c >= 1), "--concurrency values must be at least 1");
    eprintln!("starting redis, worker, router and gateway...");
    let stack = start_stack(args.speedup, args.tls).await?;
    let mut worker = WorkerClient::new(direct_channel(&stack.worker.grpc_endpoint()).await?).with_message_limits();
    let card = worker.get_model_card(pb::GetModelCardRequest {}).await?.into_inner().card.context("no card")?;
    let card = ModelCard::try_from(card)?;
    let model = card.name.clone();
    let preprocessor = Preprocessor::new(card)?;
    let (text, ids) = prompt_of(&preprocessor, args.prompt_tokens)?;

    let http = reqwest::Client::builder().pool_max_idle_per_host(256).build()?;
    let url = format!("{}/v1/completions", stack.gateway.http_url());
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
    let idle = Duration::from_secs(3);
    let (gateway_idle, router_idle) = (thread_cpu(stack.gateway.pid())?, thread_cpu(stack.router.pid())?);
    tokio::time::sleep(idle).await;
    let idle_rate = (
        cpu_between(&gateway_idle, &thread_cpu(stack.gateway.pid())?).as_secs_f64() / idle.as_secs_f64(),
        cpu_between(&router_idle, &thread_cpu(stack.router.pid())?).as_secs_f64() / idle.as_secs_f64(),
    );

    eprintln!("latency phase: {} requests per path, alternating...", args.latency_requests);
    let (mut direct_e2e, mut gateway_e2e, mut direct_ttft, mut gateway_ttft) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let full = body(args.output_tokens);
    for _ in 0..args.latency_requests {
        let (ttft, e2e) = direct_request(&mut worker, &ids, args.output_tokens).await?;
        direct_ttft.push(ttft);
        direct_e2e.push(e2e);
        let (ttft, e2e, _) = gateway_request(&http, &url, &full).await?;
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

    let per_request = |phase: &CpuPhase| phase.gateway_cpu_us_per_request + phase.router_cpu_us_per_request;
    let mut cpu = Vec::new();
    for &concurrency in &args.concurrency {
        eprintln!("CPU phases: {} requests at {} and at 1 token(s), concurrency {concurrency}...", args.cpu_requests, args.output_tokens);
        let full_phase = cpu_phase(&stack, &http, &full, args.cpu_requests, concurrency, idle_rate).await?;
        let one_token = cpu_phase(&stack, &http, &body(1), args.cpu_requests, concurrency, idle_rate).await?;
        cpu.push(CpuResult {
            concurrency,
            cpu_us_per_request: per_request(&one_token),
            cpu_us_per_streamed_token: (per_request(&full_phase) - per_request(&one_token)) / f64::from(args.output_tokens - 1),
            full: full_phase,
            one_token,
        });
    }

    let report = GatewayBenchReport {
        tls: args.tls,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        direct_end_to_end,
        gateway_end_to_end,
        direct_ttft: summarize(&mut direct_ttft),
        gateway_ttft: summarize(&mut gateway_ttft),
        added_end_to_end,
        cpu,
    };
    drop(stack.worker);
    drop(stack.router);
    drop(stack.gateway);
    Ok(report)
}

/// Prints the report as a table.
pub fn print(report: &GatewayBenchReport) {
    let row = |name: &str, l: &Latency| println!("{name:<28} {:>10.0} {:>10.0} {:>10.0} {:>10.0}", l.p50_us, l.p90_us, l.p99_us, l.mean_us);
    let hops = if report.tls { "every gRPC hop mutual TLS" } else { "plaintext gRPC" };
    println!("prompt {} tokens, {} streamed tokens per request, {hops}", report.prompt_tokens, report.output_tokens);
    println!("{:<28} {:>10} {:>10} {:>10} {:>10}", "latency (µs)", "p50", "p90", "p99", "mean");
    row("worker gRPC, end to end", &report.direct_end_to_end);
    row("gateway SSE, end to end", &report.gateway_end_to_end);
    row("added by gateway + router", &report.added_end_to_end);
    row("worker gRPC, first token", &report.direct_ttft);
    row("gateway SSE, first token", &report.gateway_ttft);
    for result in &report.cpu {
        println!();
        for phase in [&result.full, &result.one_token] {
            println!(
                "CPU at {:>3} tokens ({:.1} text events/request), {} requests, concurrency {}: gateway {:.0} µs + router {:.0} µs per request ({:.1} s wall)",
                phase.output_tokens,
                phase.text_events_per_request,
                phase.requests,
                phase.concurrency,
                phase.gateway_cpu_us_per_request,
                phase.router_cpu_us_per_request,
                phase.wall_secs
            );
        }
        println!(
            "concurrency {}: gateway + router CPU per request {:.0} µs, per streamed token {:.2} µs",
            result.concurrency, result.cpu_us_per_request, result.cpu_us_per_streamed_token
        );
    }
}
