//! `turbine bench attack`: does legitimate traffic keep its latency while
//! the deployment is attacked?
//!
//! Starts the stack of `turbine bench gateway --tls` (redis-server, a mocker
//! worker, a router, a gateway; every gRPC hop mutual TLS), then runs
//! blocks of legitimate streamed completions through the gateway, each
//! block once without and once with attackers running, the order swapped
//! every other round so that drift falls on both. The attackers, from this
//! process, at `--attack-rate` calls per second in all:
//!
//! - `wrong_role_generate`: the router's certificate calls the worker's
//!   `Generate` (only gateways may);
//! - `wrong_role_route`: the worker's certificate books on the router
//!   (only gateways may);
//! - `no_certificate`: a new plaintext connection to the worker's gRPC
//!   port each time (the handshake fails);
//! - `bad_capability`: a worker's certificate `Describe`s a made-up KV
//!   handle with a made-up token;
//! - `rogue_record`: an unsealed worker record in Redis (anyone who can
//!   write to Redis) pointing at a listener of the attacker's.
//!
//! By default each call of the first, second and fourth attack dials a
//! connection of its own (its handshake is the attacker's cost, and the
//! service's connection gate refuses an address over its rate); with
//! `--kept-connections` each of them keeps one connection, as a gRPC
//! client does: the service closes a connection after 16 refusals (one
//! more a second), and the attacker connects again.
//!
//! Every attempt must be refused (a record: skipped by the router, and no
//! connection ever reaches the attacker's listener); the report counts
//! them, and gives the legitimate requests' p50 and p99, end to end and to
//! the first token, without and with the attack, and their ratios.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use turbine_proto::router::v1 as router_pb;
use turbine_proto::worker::v1 as worker_pb;
use turbine_registry::{RedisRegistry, Registry, WorkerLoad, WorkerRecord};
use turbine_runtime::grpc::{TracedChannel, tls_channel};
use turbine_runtime::host::Role;
use turbine_runtime::trust::{TlsConfig, Trust};

use crate::gateway::{Latency, gateway_request, start_stack, summarize};

/// Flags of `turbine bench attack`.
#[derive(Debug, Clone, clap::Args)]
pub struct AttackBenchArgs {
    /// Rounds: each one block without the attack and one with it.
    #[arg(long, default_value_t = 4)]
    pub rounds: usize,
    /// Legitimate requests per block.
    #[arg(long, default_value_t = 100)]
    pub requests_per_block: usize,
    /// Legitimate clients at once.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Attack calls per second, all attacks together.
    #[arg(long, default_value_t = 200.0)]
    pub attack_rate: f64,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 200)]
    pub prompt_tokens: usize,
    /// Tokens streamed per request.
    #[arg(long, default_value_t = 20)]
    pub output_tokens: u32,
    /// Mocker speedup.
    #[arg(long, default_value_t = 10.0)]
    pub speedup: f64,
    /// The wrong-role and bad-capability attackers keep one connection
    /// each (reconnecting when the service closes it) instead of dialing
    /// one per call.
    #[arg(long)]
    pub kept_connections: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What one kind of attack got.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AttackOutcome {
    /// The attack.
    pub attack: String,
    /// Calls made.
    pub attempts: u64,
    /// Calls refused as they must be.
    pub refused: u64,
    /// Of those, the calls whose connection the service closed: as it was
    /// accepted (its connection gate: the attacker's address over its
    /// rate), before TLS and before the call, or (a kept connection) once
    /// the connection had spent its refusals.
    pub closed: u64,
    /// Calls that got anything else (each one a defect).
    pub unexpected: u64,
    /// The first unexpected answer, if any.
    pub first_unexpected: Option<String>,
}

/// The legitimate requests of one kind of block.
#[derive(Debug, Clone, Serialize)]
pub struct Blocks {
    /// Requests measured.
    pub requests: usize,
    /// End to end (until `[DONE]`).
    pub end_to_end: Latency,
    /// To the first token.
    pub ttft: Latency,
}

/// Everything `turbine bench attack` measures.
#[derive(Debug, Clone, Serialize)]
pub struct AttackBenchReport {
    /// Legitimate clients at once.
    pub clients: usize,
    /// Attack calls per second asked for.
    pub attack_rate: f64,
    /// Attack calls per second made.
    pub attack_rate_achieved: f64,
    /// Whether the attackers kept their connections.
    pub kept_connections: bool,
    /// Without the attack.
    pub unattacked: Blocks,
    /// With it.
    pub attacked: Blocks,
    /// Attacked over unattacked p99, end to end.
    pub p99_end_to_end_ratio: f64,
    /// Attacked over unattacked p99, to the first token.
    pub p99_ttft_ratio: f64,
    /// Legitimate requests that failed (each one a defect).
    pub failed_requests: usize,
    /// Connections that reached the attacker's listener (each one a
    /// request sent to a rogue worker).
    pub rogue_connections: u64,
    /// Each attack's outcome.
    pub attacks: Vec<AttackOutcome>,
    /// What the services counted: (metric and labels, its value) on the
    /// worker, the router.
    pub counted: Vec<(String, f64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attack {
    WrongRoleGenerate,
    WrongRoleRoute,
    NoCertificate,
    BadCapability,
    RogueRecord,
}

impl Attack {
    const ALL: [Attack; 5] = [Attack::WrongRoleGenerate, Attack::WrongRoleRoute, Attack::NoCertificate, Attack::BadCapability, Attack::RogueRecord];

    fn name(self) -> &'static str {
        match self {
            Attack::WrongRoleGenerate => "wrong_role_generate",
            Attack::WrongRoleRoute => "wrong_role_route",
            Attack::NoCertificate => "no_certificate",
            Attack::BadCapability => "bad_capability",
            Attack::RogueRecord => "rogue_record",
        }
    }
}

#[derive(Default)]
struct Tally {
    attempts: AtomicU64,
    refused: AtomicU64,
    closed: AtomicU64,
    unexpected: AtomicU64,
    first_unexpected: parking_lot::Mutex<Option<String>>,
}

impl Tally {
    fn record(&self, refused: Result<Refused, String>) {
        self.attempts.fetch_add(1, Relaxed);
        match refused {
            Ok(how) => {
                self.refused.fetch_add(1, Relaxed);
                if how == Refused::Closed {
                    self.closed.fetch_add(1, Relaxed);
                }
            }
            Err(answer) => {
                self.unexpected.fetch_add(1, Relaxed);
                self.first_unexpected.lock().get_or_insert(answer);
            }
        }
    }
}

/// What the attackers hold: the stack's addresses, certificates of other
/// roles, write access to Redis, and a listener of their own.
struct Attacker {
    worker: String,
    router: String,
    redis: String,
    as_router: Trust,
    as_worker: Trust,
    rogue: String,
    /// Connections kept across calls (`--kept-connections`).
    kept: Option<Kept>,
}

/// One connection per attack that keeps its connection: each a channel
/// that connects again when the service closes it.
struct Kept {
    generate: TracedChannel,
    route: TracedChannel,
    describe: TracedChannel,
}

fn trust_of(certs: &Path, role: &str) -> anyhow::Result<Trust> {
    let config =
        TlsConfig { tls_cert: Some(certs.join(format!("{role}.crt"))), tls_key: Some(certs.join(format!("{role}.key"))), tls_ca: Some(certs.join("ca.crt")) };
    config.load()?.context("certificates")
}

/// How an attempt was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// By the service's answer (or a failed handshake).
    Answered,
    /// Its connection closed as accepted, before TLS.
    Closed,
}

/// A status the attack must get, or its connection closed by the service:
/// before TLS (the connection gate: the client's handshake fails on a
/// closed socket), or under the call on a kept connection (cut off once it
/// had spent its refusals: the client sees its transport end, UNAVAILABLE
/// or UNKNOWN "transport error", or CANCELLED for a call queued on it).
fn must_be(result: Result<impl std::fmt::Debug, tonic::Status>, code: tonic::Code) -> Result<Refused, String> {
    match result {
        Err(status) if status.code() == code => Ok(Refused::Answered),
        Err(status) if matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled) && closed_by_the_service(&status) => {
            Ok(Refused::Closed)
        }
        other => Err(format!("{other:?}")),
    }
}

/// Whether `status` is a connection the server closed (during the TLS
/// handshake: what a client sees of the connection gate; or under a call).
fn closed_by_the_service(status: &tonic::Status) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = cause {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(io.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe)
        {
            return true;
        }
        // A call queued on a kept connection as the service closed it.
        if let Some(hyper) = error.downcast_ref::<hyper::Error>()
            && hyper.is_canceled()
        {
            return true;
        }
        cause = error.source();
    }
    false
}

impl Attacker {
    async fn attempt(&self, attack: Attack, n: u64) -> Result<Refused, String> {
        let timeout = Duration::from_secs(5);
        match attack {
            Attack::WrongRoleGenerate => {
                let channel = match &self.kept {
                    Some(kept) => kept.generate.clone(),
                    None => tls_channel(&self.worker, &self.as_router, Role::Worker).map_err(|error| error.to_string())?,
                };
                let request = worker_pb::GenerateRequest { request_id: format!("attack-{n}"), prompt_token_ids: vec![1, 2, 3], ..Default::default() };
                let mut client = worker_pb::worker_client::WorkerClient::new(channel);
                let call = client.generate(request);
                must_be(tokio::time::timeout(timeout, call).await.map_err(|_| "no answer".to_owned())?, tonic::Code::PermissionDenied)
            }
            Attack::WrongRoleRoute => {
                let channel = match &self.kept {
                    Some(kept) => kept.route.clone(),
                    None => tls_channel(&self.router, &self.as_worker, Role::Router).map_err(|error| error.to_string())?,
                };
                let request = router_pb::RouteRequest { request_id: format!("attack-{n}"), prompt_tokens: 100_000, ..Default::default() };
                let mut client = router_pb::router_client::RouterClient::new(channel);
                let call = client.route(request);
                must_be(tokio::time::timeout(timeout, call).await.map_err(|_| "no answer".to_owned())?, tonic::Code::PermissionDenied)
            }
            Attack::NoCertificate => {
                // A fresh connection each time: its failed handshake is the cost.
                let endpoint = tonic::transport::Endpoint::from_shared(self.worker.clone()).map_err(|error| error.to_string())?;
                let connected = tokio::time::timeout(timeout, endpoint.connect()).await.map_err(|_| "no answer".to_owned())?;
                let Ok(channel) = connected else { return Ok(Refused::Answered) };
                let mut client = worker_pb::worker_client::WorkerClient::new(channel);
                let call = client.get_model_card(worker_pb::GetModelCardRequest {});
                match tokio::time::timeout(timeout, call).await {
                    Ok(Ok(answer)) => Err(format!("answered a plaintext caller: {answer:?}")),
                    _ => Ok(Refused::Answered),
                }
            }
            Attack::BadCapability => {
                let channel = match &self.kept {
                    Some(kept) => kept.describe.clone(),
                    None => tls_channel(&self.worker, &self.as_worker, Role::Worker).map_err(|error| error.to_string())?,
                };
                let request = worker_pb::DescribeRequest { handle_id: n, token: n.to_le_bytes().repeat(2) };
                let mut client = worker_pb::kv_transfer_client::KvTransferClient::new(channel);
                let call = client.describe(request);
                must_be(tokio::time::timeout(timeout, call).await.map_err(|_| "no answer".to_owned())?, tonic::Code::NotFound)
            }
            Attack::RogueRecord => {
                // Unsealed, as any Redis client can write it; the router
                // must skip it (the rogue listener counts what reaches it).
                let registry = Registry::Redis(RedisRegistry::new(&self.redis, "bench").map_err(|error| error.to_string())?.with_trust(None));
                let record = WorkerRecord {
                    worker_id: format!("rogue-{}", n % 8).as_str().into(),
                    endpoint: self.rogue.clone(),
                    model: String::new(),
                    load: WorkerLoad::default(),
                    kv_block_size: 16,
                    instance: n,
                    role: Default::default(),
                    read_costs: Default::default(),
                    kv_store: None,
                    shared_cache_only: false,
                    output_formats: Default::default(),
                };
                registry.put(&record, Duration::from_secs(5)).await.map(|()| Refused::Answered).map_err(|error| format!("Redis refused the write: {error}"))
            }
        }
    }
}

/// One block of legitimate requests from `clients` clients: (ttft, e2e)
/// of each, and how many failed.
async fn legitimate_block(http: &reqwest::Client, url: &str, body: &serde_json::Value, requests: usize, clients: usize) -> (Vec<(Duration, Duration)>, usize) {
    let per_client = requests.div_ceil(clients);
    let runs = (0..clients).map(|_| async move {
        let mut samples = Vec::new();
        let mut failed = 0;
        for _ in 0..per_client {
            match gateway_request(http, url, body).await {
                Ok((ttft, e2e, _)) => samples.push((ttft, e2e)),
                Err(error) => {
                    failed += 1;
                    tracing::warn!(%error, "a legitimate request failed");
                }
            }
        }
        (samples, failed)
    });
    let mut all = Vec::new();
    let mut failed = 0;
    for (samples, failures) in futures::future::join_all(runs).await {
        all.extend(samples);
        failed += failures;
    }
    (all, failed)
}

/// Runs the attackers until `stop`, each kind at its share of `rate`.
fn spawn_attackers(attacker: &Arc<Attacker>, tallies: &Arc<Vec<Tally>>, rate: f64, stop: &CancellationToken) -> Vec<tokio::task::JoinHandle<()>> {
    let period = Duration::from_secs_f64(Attack::ALL.len() as f64 / rate.max(0.001));
    Attack::ALL
        .iter()
        .enumerate()
        .map(|(index, &attack)| {
            let (attacker, tallies, stop) = (attacker.clone(), tallies.clone(), stop.clone());
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(period);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut n = 0u64;
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        _ = ticks.tick() => {}
                    }
                    n += 1;
                    tallies[index].record(attacker.attempt(attack, n).await);
                }
            })
        })
        .collect()
}

/// Runs the benchmark.
pub async fn run(args: AttackBenchArgs) -> anyhow::Result<AttackBenchReport> {
    anyhow::ensure!(args.rounds >= 1 && args.requests_per_block >= 1 && args.clients >= 1, "--rounds, --requests-per-block and --clients must be at least 1");
    eprintln!("starting redis, worker, router and gateway, every hop mutual TLS...");
    let stack = start_stack(args.speedup, true).await?;
    let certs = stack.certs().context("certificates")?.to_owned();
    // The attacker's own listener: a rogue worker's address.
    let rogue = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let rogue_address = format!("http://{}", rogue.local_addr()?);
    let rogue_connections = Arc::new(AtomicU64::new(0));
    let counting = rogue_connections.clone();
    let rogue_task = tokio::spawn(async move {
        while let Ok((socket, _)) = rogue.accept().await {
            counting.fetch_add(1, Relaxed);
            drop(socket);
        }
    });
    let (worker, router) = (stack.worker.grpc_endpoint(), stack.router.grpc_endpoint());
    let (as_router, as_worker) = (trust_of(&certs, "router")?, trust_of(&certs, "worker")?);
    let kept = match args.kept_connections {
        true => Some(Kept {
            generate: tls_channel(&worker, &as_router, Role::Worker)?,
            route: tls_channel(&router, &as_worker, Role::Router)?,
            describe: tls_channel(&worker, &as_worker, Role::Worker)?,
        }),
        false => None,
    };
    let attacker = Arc::new(Attacker { worker, router, redis: stack.redis_url(), as_router, as_worker, rogue: rogue_address, kept });

    let model = crate::gateway::model_of(&stack).await?;
    let prompt = "Turbine keeps every tenant's work apart. ".repeat(args.prompt_tokens.div_ceil(8));
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
    let url = format!("{}/v1/completions", stack.gateway.http_url());
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": args.output_tokens, "stream": true, "ignore_eos": true});
    // Warm the path.
    let deadline = Instant::now() + turbine_harness::STARTUP_TIMEOUT;
    while let Err(error) = gateway_request(&http, &url, &body).await {
        anyhow::ensure!(Instant::now() < deadline, "the gateway never served the model: {error:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    legitimate_block(&http, &url, &body, 20, args.clients).await;

    let tallies: Arc<Vec<Tally>> = Arc::new(Attack::ALL.iter().map(|_| Tally::default()).collect());
    let (mut quiet, mut loud) = (Vec::new(), Vec::new());
    let mut failed_requests = 0;
    let mut attack_time = Duration::ZERO;
    for round in 0..args.rounds {
        // Pairs in both orders: drift over the run falls on both sides.
        let order = if round % 2 == 0 { [false, true] } else { [true, false] };
        for attacked in order {
            eprintln!(
                "round {}/{}: {} legitimate requests {}...",
                round + 1,
                args.rounds,
                args.requests_per_block,
                if attacked { "under attack" } else { "unattacked" }
            );
            let stop = CancellationToken::new();
            let attackers = if attacked { spawn_attackers(&attacker, &tallies, args.attack_rate, &stop) } else { Vec::new() };
            let started = Instant::now();
            let (samples, failed) = legitimate_block(&http, &url, &body, args.requests_per_block, args.clients).await;
            stop.cancel();
            for attacker in attackers {
                let _ = attacker.await;
            }
            if attacked {
                attack_time += started.elapsed();
            }
            failed_requests += failed;
            if attacked { &mut loud } else { &mut quiet }.extend(samples);
        }
    }
    // The rogue records live for 5 s: the router's next registry poll
    // reads (and must skip) them, however short the attack was.
    let rogue_writes = tallies[Attack::ALL.iter().position(|&attack| attack == Attack::RogueRecord).expect("an attack")].attempts.load(Relaxed);
    let router_metrics = format!("{}/metrics", stack.router.admin_url());
    let deadline = Instant::now() + Duration::from_secs(10);
    while rogue_writes > 0 && Instant::now() < deadline {
        let page = http.get(&router_metrics).send().await?.text().await?;
        if page.lines().any(|line| line.starts_with("turbine_registry_refused_records_total{reason=\"unsigned\"}")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rogue_task.abort();
    let mut counted = Vec::new();
    for (service, admin) in [("worker", stack.worker.admin_url()), ("router", stack.router.admin_url())] {
        let page = http.get(format!("{admin}/metrics")).send().await?.text().await?;
        for line in page.lines().filter(|line| {
            line.starts_with("turbine_rpc_refused_total")
                || line.starts_with("turbine_registry_refused_records_total")
                || line.starts_with("turbine_grpc_connections_refused_total")
                || line.starts_with("turbine_grpc_connections_struck_off_total")
        }) {
            if let Some((series, value)) = line.rsplit_once(' ') {
                counted.push((format!("{service}: {series}"), value.parse().unwrap_or(f64::NAN)));
            }
        }
    }

    let blocks = |samples: &[(Duration, Duration)]| {
        let (mut ttft, mut e2e): (Vec<Duration>, Vec<Duration>) = samples.iter().copied().unzip();
        Blocks { requests: samples.len(), end_to_end: summarize(&mut e2e), ttft: summarize(&mut ttft) }
    };
    anyhow::ensure!(!quiet.is_empty() && !loud.is_empty(), "no legitimate request succeeded");
    let (unattacked, attacked) = (blocks(&quiet), blocks(&loud));
    let attacks: Vec<AttackOutcome> = Attack::ALL
        .iter()
        .zip(tallies.iter())
        .map(|(attack, tally)| AttackOutcome {
            attack: attack.name().to_owned(),
            attempts: tally.attempts.load(Relaxed),
            refused: tally.refused.load(Relaxed),
            closed: tally.closed.load(Relaxed),
            unexpected: tally.unexpected.load(Relaxed),
            first_unexpected: tally.first_unexpected.lock().clone(),
        })
        .collect();
    let attempts: u64 = attacks.iter().map(|outcome| outcome.attempts).sum();
    Ok(AttackBenchReport {
        clients: args.clients,
        attack_rate: args.attack_rate,
        attack_rate_achieved: attempts as f64 / attack_time.as_secs_f64().max(1e-9),
        kept_connections: args.kept_connections,
        p99_end_to_end_ratio: attacked.end_to_end.p99_us / unattacked.end_to_end.p99_us,
        p99_ttft_ratio: attacked.ttft.p99_us / unattacked.ttft.p99_us,
        unattacked,
        attacked,
        failed_requests,
        rogue_connections: rogue_connections.load(Relaxed),
        attacks,
        counted,
    })
}

/// Prints the report as a table.
pub fn print(report: &AttackBenchReport) {
    println!(
        "{} legitimate clients through the gateway, every hop mutual TLS; attack {:.0} calls/s asked, {:.0} made, {}",
        report.clients,
        report.attack_rate,
        report.attack_rate_achieved,
        if report.kept_connections { "connections kept" } else { "a connection per call" }
    );
    println!("{:<22} {:>9} {:>12} {:>12} {:>12} {:>12}", "legitimate (µs)", "requests", "e2e p50", "e2e p99", "ttft p50", "ttft p99");
    for (name, blocks) in [("unattacked", &report.unattacked), ("under attack", &report.attacked)] {
        println!(
            "{name:<22} {:>9} {:>12.0} {:>12.0} {:>12.0} {:>12.0}",
            blocks.requests, blocks.end_to_end.p50_us, blocks.end_to_end.p99_us, blocks.ttft.p50_us, blocks.ttft.p99_us
        );
    }
    println!("p99 under attack / unattacked: end to end {:.2}×, first token {:.2}×", report.p99_end_to_end_ratio, report.p99_ttft_ratio);
    println!("legitimate requests failed: {}; connections to the rogue worker: {}", report.failed_requests, report.rogue_connections);
    println!("{:<22} {:>9} {:>9} {:>9} {:>11}", "attack", "attempts", "refused", "closed", "unexpected");
    for outcome in &report.attacks {
        println!("{:<22} {:>9} {:>9} {:>9} {:>11}", outcome.attack, outcome.attempts, outcome.refused, outcome.closed, outcome.unexpected);
        if let Some(answer) = &outcome.first_unexpected {
            println!("    first unexpected: {answer}");
        }
    }
    println!("counted by the services:");
    for (series, value) in &report.counted {
        println!("  {series} {value}");
    }
}
