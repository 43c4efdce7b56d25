//! `turbine bench adapter`: what a worker in front of an external engine
//! costs per streamed token, against calling the engine directly, in one
//! run.
//!
//! Starts the engine (`--upstream-kind`: vLLM's CPU build or llama.cpp's
//! server, the installs the test command makes, `scripts/install-vllm.sh`
//! and `scripts/install-llama-cpp.sh`) and `turbine worker --engine
//! external` in front of it, then alternates two phases of the same load
//! (`--requests` streams of `--output-tokens` tokens, `--concurrency` at a
//! time, unique prompts of `--prompt-tokens` ids):
//!
//! - direct: this process posts to the engine exactly the body the adapter
//!   sends (token ids in, token ids out) and reads the event stream as the
//!   adapter does;
//! - adapter: this process calls the worker's gRPC `Generate`, which does
//!   the same against the engine and streams token chunks back.
//!
//! With `--tls` (vLLM only) both of the worker's links are encrypted, as
//! a deployment has them: vLLM serves HTTPS, asking for a certificate of
//! the deployment's CA and an API key (`turbine certs --engine-host`),
//! the worker dials it with its own certificate and the key, and serves
//! its gRPC over mutual TLS (this process dials it as a gateway); the
//! direct phase calls vLLM over the same TLS with the worker's
//! certificate and the key.
//!
//! CPU comes from /proc (every thread of the worker; every process of
//! vLLM's process group, every thread of llama-server): the adapter's CPU
//! per streamed token is the cost; the engine's, per phase, shows the
//! engine did the same work.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::ValueEnum;
use futures::StreamExt;
use serde::Serialize;
use turbine_api::worker::WorkerClient;
use turbine_api::{GenerateRequest, StopConditions};
use turbine_harness::{LlamaCppInstall, LlamaCppServer, STARTUP_TIMEOUT, ServiceProcess, VllmInstall, VllmServer};
use turbine_runtime::host::Role;
use turbine_tokens::{ModelCard, Preprocessor};
use turbine_worker::config::UpstreamKind;
use turbine_worker::external::Dialect;

use crate::gateway::{cpu_between, thread_cpu};

/// Flags of `turbine bench adapter`.
#[derive(Debug, Clone, clap::Args)]
pub struct AdapterBenchArgs {
    /// Rounds (each: one direct phase and one adapter phase, in alternating
    /// order); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Streams per phase.
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Streams at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Tokens streamed per request (end of generation ignored).
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// The engine: vLLM (on the default model converted to Hugging Face
    /// format) or llama.cpp's server (on its GGUF, from the model cache);
    /// `openai`: llama.cpp's server through its OpenAI endpoint, text
    /// re-tokenized.
    #[arg(long, value_enum, default_value_t = UpstreamKind::Vllm)]
    pub upstream_kind: UpstreamKind,
    /// The workspace whose `target/engines` holds the engines and vLLM's
    /// model (`$TURBINE_VLLM_PYTHON`, `$TURBINE_VLLM_MODEL`,
    /// `$TURBINE_LLAMA_SERVER` override).
    #[arg(long, default_value = ".")]
    pub workspace: PathBuf,
    /// Encrypt both of the worker's links (vLLM only): vLLM over HTTPS
    /// requiring the deployment's client certificate and an API key, the
    /// worker's gRPC over mutual TLS; the direct phase over the same TLS.
    #[arg(long)]
    pub tls: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The certificates of a `--tls` run (`turbine certs`), and the engine's
/// API key, in a folder of their own.
struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    fn make(exe: &std::path::Path) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let made = Command::new(exe).args(["certs", "--worker", "bench-adapter", "--engine-host", "127.0.0.1", "--out"]).arg(dir.path()).output()?;
        anyhow::ensure!(made.status.success(), "turbine certs failed: {}", String::from_utf8_lossy(&made.stderr));
        let mut random = [0_u8; 16];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut random)?;
        std::fs::write(dir.path().join("engine-api-key"), format!("sk-bench-{}\n", hex::encode(random)))?;
        Ok(Self { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn file(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }

    /// How the worker, and this process's direct phase, reach the engine.
    fn link(&self) -> turbine_worker::external::LinkSettings {
        turbine_worker::external::LinkSettings {
            ca: Some(self.path("ca.crt")),
            identity: Some((self.path("workers/bench-adapter.crt"), self.path("workers/bench-adapter.key"))),
            api_key: Some(self.path("engine-api-key")),
        }
    }
}

/// One phase's figures.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterPhase {
    /// `direct` or `adapter`.
    pub path: &'static str,
    pub tokens: usize,
    pub wall_secs: f64,
    pub tokens_per_sec: f64,
    /// The worker's CPU per streamed token (0 when it is not in the path).
    pub adapter_cpu_us_per_token: f64,
    /// vLLM's CPU (every process of its group) per streamed token.
    pub engine_cpu_us_per_token: f64,
    /// This process's (the client's) CPU per streamed token.
    pub client_cpu_us_per_token: f64,
}

/// What the benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterBenchReport {
    /// The engine (`vllm`, `llama-cpp`).
    pub engine: UpstreamKind,
    /// Both of the worker's links over TLS (`--tls`).
    pub tls: bool,
    pub requests: usize,
    pub concurrency: usize,
    pub output_tokens: u32,
    pub prompt_tokens: usize,
    pub phases: Vec<AdapterPhase>,
    /// Medians over the rounds.
    pub adapter_cpu_us_per_token: f64,
    pub engine_cpu_us_per_token_direct: f64,
    pub engine_cpu_us_per_token_adapter: f64,
    /// Per round: (engine + adapter) CPU per token through the adapter over
    /// the engine's CPU per token called directly (the same round: the
    /// engine's own CPU drifts over a run).
    pub pair_cpu_ratios: Vec<f64>,
    /// Per round: tokens/s through the adapter over tokens/s direct.
    pub pair_throughput_ratios: Vec<f64>,
    /// Medians of the rounds' ratios.
    pub cpu_ratio: f64,
    pub throughput_ratio: f64,
}

/// CPU (every thread) of every live process in the process group `pgid`.
fn group_cpu(pgid: u32) -> anyhow::Result<std::collections::HashMap<(u32, u32), u64>> {
    let mut all = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so after ')'.
        let Some(after) = stat.rsplit_once(')').map(|(_, after)| after) else { continue };
        if after.split_whitespace().nth(2).and_then(|pgrp| pgrp.parse::<u32>().ok()) != Some(pgid) {
            continue;
        }
        if let Ok(threads) = thread_cpu(pid) {
            all.extend(threads.into_iter().map(|(tid, ns)| ((pid, tid), ns)));
        }
    }
    Ok(all)
}

fn group_cpu_between(before: &std::collections::HashMap<(u32, u32), u64>, after: &std::collections::HashMap<(u32, u32), u64>) -> Duration {
    Duration::from_nanos(after.iter().map(|(key, &ns)| ns.saturating_sub(before.get(key).copied().unwrap_or(0))).sum())
}

/// CPU time of this process so far.
fn own_cpu() -> anyhow::Result<std::collections::HashMap<u32, u64>> {
    thread_cpu(std::process::id())
}

/// Streams `request` directly from the engine, as the adapter would; the
/// tokens it carried.
async fn direct(http: &turbine_worker::external::EngineLink, engine: &Engine, dialect: &Dialect, request: &GenerateRequest) -> anyhow::Result<usize> {
    let (post, mut completion) = dialect.request(http, &engine.url(), request)?;
    let response = http.send(&post).await?;
    anyhow::ensure!(response.status().is_success(), "the engine answered {}", response.status());
    let (mut bytes, mut events, mut tokens) = (response.bytes_stream(), turbine_worker::external::vllm::EventStream::default(), 0);
    while let Some(read) = bytes.next().await {
        for data in events.push(&read?)? {
            if let Some(chunk) = completion.event(&data)? {
                tokens += chunk.tokens.len();
            }
        }
        if completion.is_done() {
            // The adapter stops reading at the finishing chunk and closes
            // the response (llama.cpp's stream may carry on past a stop
            // id): so does this.
            break;
        }
    }
    anyhow::ensure!(completion.is_done(), "the engine's stream ended unfinished");
    Ok(tokens)
}

/// The engine under the benchmark.
enum Engine {
    Vllm(VllmServer),
    /// Serving HTTPS.
    VllmTls(VllmServer),
    LlamaCpp(LlamaCppServer),
}

impl Engine {
    async fn start(args: &AdapterBenchArgs, model: &'static str, certs: Option<&Certs>) -> anyhow::Result<Self> {
        Ok(match args.upstream_kind {
            UpstreamKind::Vllm if let Some(certs) = certs => {
                let install = VllmInstall::find(&args.workspace).map_err(anyhow::Error::msg)?;
                eprintln!("starting vLLM ({}) over HTTPS and a worker in front of it...", install.python.display());
                let key = std::fs::read_to_string(certs.path("engine-api-key"))?.trim().to_owned();
                let ssl = ["--ssl-certfile", &certs.file("engine.crt"), "--ssl-keyfile", &certs.file("engine.key")].map(str::to_owned);
                let ssl = [&ssl[..], &["--ssl-ca-certs".into(), certs.file("ca.crt"), "--ssl-cert-reqs".into(), "2".into(), "--api-key".into(), key]].concat();
                let mut server =
                    tokio::task::spawn_blocking(move || VllmServer::spawn(&install, model, &ssl.iter().map(String::as_str).collect::<Vec<_>>())).await?;
                let link = turbine_worker::external::EngineLink::new(&certs.link())?;
                let health = link.get(&format!("{}/health", server.https_url()))?;
                let deadline = Instant::now() + Duration::from_secs(900);
                while !link.send_once(&health).await.is_ok_and(|answer| answer.status().is_success()) {
                    if let Some(status) = server.exited() {
                        anyhow::bail!("vLLM exited ({status}) before serving:\n{}", server.output().join("\n"));
                    }
                    anyhow::ensure!(Instant::now() < deadline, "vLLM did not answer /health over TLS within 15 minutes");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Self::VllmTls(server)
            }
            UpstreamKind::Vllm => {
                let install = VllmInstall::find(&args.workspace).map_err(anyhow::Error::msg)?;
                eprintln!("starting vLLM ({}) and a worker in front of it...", install.python.display());
                Self::Vllm(tokio::task::spawn_blocking(move || VllmServer::start(&install, model, &[])).await?)
            }
            // The OpenAI dialect against llama-server's OpenAI endpoint.
            UpstreamKind::LlamaCpp | UpstreamKind::Openai => {
                let install = LlamaCppInstall::find(&args.workspace).map_err(anyhow::Error::msg)?;
                let cache = turbine_tokens::pull::default_cache_dir();
                let gguf = turbine_tokens::pull::resolve_model(model, None, &cache, turbine_tokens::pull::Progress::Quiet)?.path;
                eprintln!("starting llama-server ({}) on {} and a worker in front of it...", install.server.display(), gguf.display());
                Self::LlamaCpp(tokio::task::spawn_blocking(move || LlamaCppServer::start(&install, &gguf, model, &[])).await?)
            }
        })
    }

    fn url(&self) -> String {
        match self {
            Self::Vllm(server) => server.url(),
            Self::VllmTls(server) => server.https_url(),
            Self::LlamaCpp(server) => server.url(),
        }
    }

    /// CPU of every thread of the engine's processes so far.
    fn cpu(&self) -> anyhow::Result<std::collections::HashMap<(u32, u32), u64>> {
        match self {
            Self::Vllm(server) | Self::VllmTls(server) => group_cpu(server.pid()),
            Self::LlamaCpp(server) => Ok(thread_cpu(server.pid())?.into_iter().map(|(tid, ns)| ((server.pid(), tid), ns)).collect()),
        }
    }
}

/// Streams `request` through the adapter; the tokens it carried.
async fn through_adapter(worker: &WorkerClient, request: GenerateRequest) -> anyhow::Result<usize> {
    let mut stream = worker.generate(request).await?;
    let mut tokens = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        tokens += chunk.tokens.len();
        if chunk.finished.is_some() {
            return Ok(tokens);
        }
    }
    anyhow::bail!("the adapter's stream ended unfinished")
}

/// Runs the benchmark.
pub async fn run(args: AdapterBenchArgs) -> anyhow::Result<AdapterBenchReport> {
    anyhow::ensure!(
        args.rounds >= 1 && args.requests >= 1 && args.concurrency >= 1 && args.output_tokens >= 2,
        "rounds, requests, concurrency must be positive, output tokens at least 2"
    );
    anyhow::ensure!(!args.tls || args.upstream_kind == UpstreamKind::Vllm, "--tls runs vLLM over HTTPS: --upstream-kind vllm");
    let model = "smollm2-135m";
    let exe = std::env::current_exe().context("locating the turbine binary")?;
    let certs = args.tls.then(|| Certs::make(&exe)).transpose()?;
    let engine = Engine::start(&args, model, certs.as_ref()).await?;
    let mut command = Command::new(exe);
    let kind = args.upstream_kind.to_possible_value().context("the engine's flag value")?;
    command
        .args(["worker", "--engine", "external", "--upstream-kind", kind.get_name()])
        .args(["--upstream", &engine.url(), "--worker-id", "bench-adapter"])
        .env("RUST_LOG", "warn");
    if let Some(certs) = &certs {
        command.args(["--upstream-ca", &certs.file("ca.crt"), "--upstream-api-key-file", &certs.file("engine-api-key")]).args([
            "--tls-cert",
            &certs.file("workers/bench-adapter.crt"),
            "--tls-key",
            &certs.file("workers/bench-adapter.key"),
            "--tls-ca",
            &certs.file("ca.crt"),
        ]);
        // This process calls the worker as the gateway does.
        turbine_runtime::trust::TlsConfig {
            tls_cert: Some(certs.path("gateway.crt")),
            tls_key: Some(certs.path("gateway.key")),
            tls_ca: Some(certs.path("ca.crt")),
        }
        .establish()?
        .context("the gateway's identity")?;
    }
    let mut worker_process = ServiceProcess::spawn("worker", command, false).await?;
    worker_process.until_serving(Role::Worker, "", STARTUP_TIMEOUT).await?;
    let worker = WorkerClient::connect(&worker_process.grpc_endpoint())?;
    let card: ModelCard = worker.model_card().await?;
    let dialect = Dialect::new(args.upstream_kind, model, &card)?;
    let preprocessor = Preprocessor::new(card)?;
    let filler = preprocessor.encode_text(&"many words make a prompt of some length ".repeat(args.prompt_tokens))?;
    let http = match &certs {
        Some(certs) => turbine_worker::external::EngineLink::new(&certs.link())?,
        None => turbine_worker::external::EngineLink::plain()?,
    };
    let mut counter = 0usize;
    let mut requests = |count: usize| -> Vec<GenerateRequest> {
        (0..count)
            .map(|_| {
                counter += 1;
                // A unique head: no request hits another's cached prefix.
                let mut prompt = preprocessor.encode_text(&format!("request {counter}:")).unwrap_or_default();
                prompt.extend_from_slice(&filler[..args.prompt_tokens.saturating_sub(prompt.len()).min(filler.len())]);
                GenerateRequest {
                    request_id: format!("bench-{counter}"),
                    prompt,
                    stop: StopConditions { max_tokens: args.output_tokens, stop_token_ids: vec![], ignore_eos: true },
                    ..GenerateRequest::default()
                }
            })
            .collect()
    };
    // Warm both paths.
    for request in requests(2) {
        direct(&http, &engine, &dialect, &request).await?;
        through_adapter(&worker, request).await?;
    }
    let mut phases = Vec::new();
    for round in 0..args.rounds {
        let order: [&'static str; 2] = if round % 2 == 0 { ["direct", "adapter"] } else { ["adapter", "direct"] };
        for path in order {
            let batch = requests(args.requests);
            let (adapter_before, engine_before, client_before) = (thread_cpu(worker_process.pid())?, engine.cpu()?, own_cpu()?);
            let started = Instant::now();
            let mut tokens = 0;
            let per_client = batch.len().div_ceil(args.concurrency);
            let clients = batch.chunks(per_client).map(|chunk| {
                let (http, engine, worker, dialect) = (&http, &engine, &worker, &dialect);
                async move {
                    let mut tokens = 0;
                    for request in chunk {
                        tokens += match path {
                            "direct" => direct(http, engine, dialect, request).await?,
                            _ => through_adapter(worker, request.clone()).await?,
                        };
                    }
                    anyhow::Ok(tokens)
                }
            });
            for result in futures::future::join_all(clients).await {
                tokens += result?;
            }
            let wall = started.elapsed().as_secs_f64();
            let per_token = |cpu: Duration| cpu.as_secs_f64() * 1e6 / tokens as f64;
            let adapter = match path {
                "direct" => 0.0,
                _ => per_token(cpu_between(&adapter_before, &thread_cpu(worker_process.pid())?)),
            };
            phases.push(AdapterPhase {
                path,
                tokens,
                wall_secs: wall,
                tokens_per_sec: tokens as f64 / wall,
                adapter_cpu_us_per_token: adapter,
                engine_cpu_us_per_token: per_token(group_cpu_between(&engine_before, &engine.cpu()?)),
                client_cpu_us_per_token: per_token(cpu_between(&client_before, &own_cpu()?)),
            });
            eprintln!("round {round} {path}: {tokens} tokens in {wall:.1} s");
        }
    }
    let median = |path: &str, value: fn(&AdapterPhase) -> f64| {
        let mut values: Vec<f64> = phases.iter().filter(|phase| phase.path == path).map(value).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let adapter_cpu = median("adapter", |phase| phase.adapter_cpu_us_per_token);
    let (engine_direct, engine_adapter) = (median("direct", |phase| phase.engine_cpu_us_per_token), median("adapter", |phase| phase.engine_cpu_us_per_token));
    let pairs: Vec<(&AdapterPhase, &AdapterPhase)> = phases
        .chunks(2)
        .filter_map(|pair| {
            let direct = pair.iter().find(|phase| phase.path == "direct")?;
            let adapter = pair.iter().find(|phase| phase.path == "adapter")?;
            Some((direct, adapter))
        })
        .collect();
    let pair_cpu_ratios: Vec<f64> =
        pairs.iter().map(|(direct, adapter)| (adapter.engine_cpu_us_per_token + adapter.adapter_cpu_us_per_token) / direct.engine_cpu_us_per_token).collect();
    let pair_throughput_ratios: Vec<f64> = pairs.iter().map(|(direct, adapter)| adapter.tokens_per_sec / direct.tokens_per_sec).collect();
    let median_of = |values: &[f64]| {
        let mut values = values.to_vec();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let (cpu_ratio, throughput_ratio) = (median_of(&pair_cpu_ratios), median_of(&pair_throughput_ratios));
    Ok(AdapterBenchReport {
        engine: args.upstream_kind,
        tls: args.tls,
        requests: args.requests,
        concurrency: args.concurrency,
        output_tokens: args.output_tokens,
        prompt_tokens: args.prompt_tokens,
        phases,
        adapter_cpu_us_per_token: adapter_cpu,
        engine_cpu_us_per_token_direct: engine_direct,
        engine_cpu_us_per_token_adapter: engine_adapter,
        pair_cpu_ratios,
        pair_throughput_ratios,
        cpu_ratio,
        throughput_ratio,
    })
}

/// Prints the report.
pub fn print(report: &AdapterBenchReport) {
    println!(
        "adapter overhead ({:?}{}): {} streams of {} tokens, {} at once, {}-token prompts",
        report.engine,
        if report.tls { ", over TLS" } else { "" },
        report.requests,
        report.output_tokens,
        report.concurrency,
        report.prompt_tokens
    );
    println!("{:<8} {:>7} {:>8} {:>10} {:>16} {:>16} {:>16}", "path", "tokens", "wall s", "tokens/s", "adapter µs/tok", "engine µs/tok", "client µs/tok");
    for phase in &report.phases {
        println!(
            "{:<8} {:>7} {:>8.1} {:>10.1} {:>16.1} {:>16.1} {:>16.1}",
            phase.path,
            phase.tokens,
            phase.wall_secs,
            phase.tokens_per_sec,
            phase.adapter_cpu_us_per_token,
            phase.engine_cpu_us_per_token,
            phase.client_cpu_us_per_token
        );
    }
    println!(
        "medians: the adapter {:.1} µs CPU per streamed token; the engine {:.1} µs direct, {:.1} µs behind the adapter",
        report.adapter_cpu_us_per_token, report.engine_cpu_us_per_token_direct, report.engine_cpu_us_per_token_adapter
    );
    let list = |values: &[f64]| values.iter().map(|value| format!("{value:.3}")).collect::<Vec<_>>().join(", ");
    println!(
        "adapter / direct, per round: CPU per token {} (median {:.3}x); tokens/s {} (median {:.3}x)",
        list(&report.pair_cpu_ratios),
        report.cpu_ratio,
        list(&report.pair_throughput_ratios),
        report.throughput_ratio
    );
}
