//! `turbine run`: gateway, router and workers in one process, with an
//! in-memory registry. The default model is fetched on first use.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use turbine_gateway::serve::{GatewayListeners, serve as serve_gateway};
use turbine_gateway::{GatewayConfig, WorkerPool};
use turbine_registry::{MemoryRegistry, Registry};
use turbine_router::peers::{PeerLoad, share_load};
use turbine_router::serve::watch_registry;
use turbine_kv::KvIndex;
use turbine_router::{DisaggPolicy, KvConfig, KvState, KvWeights, Policy, Router, RouterClient};
use turbine_runtime::CancellationToken;
use turbine_tokens::pull::{Progress, catalog_entry, default_cache_dir, pull};
use turbine_kv_log::{DumpFetcher, EventLog, FollowerStatus, follow};
use turbine_worker::kv_events::{feed_index, publish_events};
use turbine_worker::metrics::register_engine;
use turbine_worker::serve::{register_local, serve_transfer_loopback};
use turbine_worker::{EngineKind, KvTransport, Worker, WorkerConfig, WorkerRole};

/// The kv policy's weights, as flags (shared by `turbine run` and
/// `turbine bench replay`).
#[derive(Debug, Clone, clap::Args)]
pub struct KvFlags {
    /// kv policy: weight of prefill work against decode load.
    #[arg(long, env = "TURBINE_ROUTER_KV_PREFILL_LOAD_SCALE", default_value_t = KvWeights::default().prefill_load_scale)]
    pub kv_prefill_load_scale: f64,
    /// kv policy: prefill blocks one cached device block is worth (above 1
    /// keeps a conversation on the worker holding its prefix under load);
    /// host, disk and remote blocks are worth 0.75, 0.25 and 0.1 of it.
    #[arg(long, env = "TURBINE_ROUTER_KV_DEVICE_CREDIT", default_value_t = KvWeights::default().device_credit)]
    pub kv_device_credit: f64,
    /// kv policy: 0 picks the cheapest worker; above 0 samples by cost.
    #[arg(long, env = "TURBINE_ROUTER_KV_TEMPERATURE", default_value_t = 0.0)]
    pub kv_temperature: f64,
}

impl KvFlags {
    /// The weights these flags set.
    pub fn weights(&self) -> KvWeights {
        KvWeights { prefill_load_scale: self.kv_prefill_load_scale, temperature: self.kv_temperature, ..KvWeights::default() }
            .with_device_credit(self.kv_device_credit)
    }
}

/// Flags of `turbine run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Model: catalog name (fetched if missing) or path to a GGUF file.
    #[arg(long, env = "TURBINE_MODEL", default_value = turbine_tokens::pull::DEFAULT_MODEL)]
    pub model: String,
    /// Name clients use for the model [default: catalog name or file stem].
    #[arg(long, env = "TURBINE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Number of workers (engines) in the process.
    #[arg(long, env = "TURBINE_WORKERS", default_value_t = 1)]
    pub workers: usize,
    /// Disaggregated serving: prefill workers (with --decode-workers; the
    /// two replace --workers). Long prompts are computed on a prefill worker
    /// and their KV blocks read by a decode worker over loopback sockets.
    #[arg(long, env = "TURBINE_PREFILL_WORKERS", default_value_t = 0, requires = "decode_workers")]
    pub prefill_workers: usize,
    /// Disaggregated serving: decode workers (see --prefill-workers).
    #[arg(long, env = "TURBINE_DECODE_WORKERS", default_value_t = 0, requires = "prefill_workers")]
    pub decode_workers: usize,
    /// Disaggregated serving: prompts with more uncached tokens than this
    /// go to a prefill worker; shorter ones are computed by the decode worker.
    #[arg(long, env = "TURBINE_ROUTER_DISAGG_THRESHOLD_TOKENS", default_value_t = DisaggPolicy::default().threshold_tokens)]
    pub disagg_threshold_tokens: u32,
    /// Disaggregated serving: how decode workers read prefill workers' KV
    /// blocks (auto: UCX when this build has it, else TCP).
    #[arg(long, value_enum, env = "TURBINE_WORKER_KV_TRANSPORT", default_value = "auto")]
    pub kv_transport: KvTransport,
    /// Mocker as prefill/decode: modelled KV bytes per token.
    #[arg(long, env = "TURBINE_WORKER_MOCK_KV_BYTES_PER_TOKEN", default_value_t = turbine_worker::config::MOCK_KV_BYTES_PER_TOKEN)]
    pub mock_kv_bytes_per_token: usize,
    /// Mocker as prefill/decode: modelled KV transfer bandwidth in GB/s.
    #[arg(long, env = "TURBINE_WORKER_MOCK_TRANSFER_GBPS", default_value_t = turbine_worker::config::MOCK_TRANSFER_GBPS)]
    pub mock_transfer_gbps: f64,
    /// Engine of every worker: native computes the model, mock simulates it.
    #[arg(long, value_enum, env = "TURBINE_WORKER_ENGINE", default_value = "native")]
    pub engine: EngineKind,
    /// Address to listen on.
    #[arg(long, env = "TURBINE_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// OpenAI REST port.
    #[arg(long, env = "TURBINE_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,
    /// gRPC port (turbine.gateway.v1.Inference).
    #[arg(long, env = "TURBINE_GRPC_PORT", default_value_t = 50050)]
    pub grpc_port: u16,
    /// Worker selection policy (kv: cache overlap against load, fed by the
    /// workers' KV events).
    #[arg(long, value_enum, env = "TURBINE_ROUTER_POLICY", default_value = "kv")]
    pub policy: Policy,
    #[command(flatten)]
    pub kv: KvFlags,
    /// Mocker: divide simulated durations by this factor.
    #[arg(long, env = "TURBINE_WORKER_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,
    /// Tokens per KV block [default: 16 native, 64 mock].
    #[arg(long, env = "TURBINE_WORKER_BLOCK_SIZE")]
    pub block_size: Option<usize>,
    /// KV blocks per worker; overrides --kv-cache-mib [default: from --kv-cache-mib, mock 16384].
    #[arg(long, env = "TURBINE_WORKER_NUM_BLOCKS")]
    pub num_blocks: Option<usize>,
    /// Native: KV cache pool per worker in MiB.
    #[arg(long, env = "TURBINE_WORKER_KV_CACHE_MIB", default_value_t = 512)]
    pub kv_cache_mib: usize,
    /// Native: kernel threads per worker [default: the available cores shared among the workers].
    #[arg(long, env = "TURBINE_WORKER_THREADS")]
    pub threads: Option<usize>,
    /// Native: device to run on: cpu, cuda or cuda:N.
    #[arg(long, env = "TURBINE_WORKER_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Override the model's context length in tokens (e.g. long mocker prompts).
    #[arg(long, env = "TURBINE_WORKER_CONTEXT_LENGTH")]
    pub context_length: Option<u32>,
    /// Sequences running at once per worker.
    #[arg(long, visible_alias = "max-seqs", env = "TURBINE_WORKER_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Tokens computed per engine step.
    #[arg(long, env = "TURBINE_WORKER_MAX_BATCHED_TOKENS", default_value_t = 8192)]
    pub max_batched_tokens: usize,
    /// Requests served at once before 429.
    #[arg(long, env = "TURBINE_GATEWAY_MAX_CONCURRENT_REQUESTS", default_value_t = 4096)]
    pub max_concurrent_requests: usize,
    /// Seconds in-flight streams get to finish after SIGTERM.
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS", default_value_t = 30.0)]
    pub shutdown_grace_secs: f64,
    /// Router replicas, each behind its own gateway (0 or 1: one). More
    /// than one needs `event_log`. Set by `turbine bench replay`.
    #[arg(skip)]
    pub routers: usize,
    /// KV events through Redis instead of in process: the workers publish
    /// to this (URL, namespace)'s event log and every router follows it
    /// into its own index replica. Set by `turbine bench replay`.
    #[arg(skip)]
    pub event_log: Option<(String, String)>,
}

/// Runs everything until SIGTERM/SIGINT, then drains and returns.
pub async fn run(args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let workers = if args.prefill_workers + args.decode_workers > 0 { args.prefill_workers + args.decode_workers } else { args.workers };
    let stack = start(args, shutdown).await?;
    print_banner(stack.http_port, stack.grpc_port, &stack.model, workers);
    stack.finished.await.context("turbine panicked")?
}

/// A started stack.
#[derive(Debug)]
pub struct Stack {
    /// Bound OpenAI REST port (of the first gateway).
    pub http_port: u16,
    /// Every gateway's REST port, one per router replica.
    pub http_ports: Vec<u16>,
    /// Bound gRPC port.
    pub grpc_port: u16,
    /// The served model name.
    pub model: String,
    /// Resolves once the stack has drained after its shutdown token fired.
    pub finished: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Starts everything (ports 0 pick free ones) and returns once it serves.
pub async fn start(args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<Stack> {
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    let disaggregated = args.prefill_workers + args.decode_workers > 0;
    anyhow::ensure!(
        !disaggregated || (args.prefill_workers >= 1 && args.decode_workers >= 1),
        "disaggregated serving needs at least one prefill and one decode worker"
    );
    let roles: Vec<(String, WorkerRole)> = if disaggregated {
        (0..args.prefill_workers)
            .map(|i| (format!("prefill-{i}"), WorkerRole::Prefill))
            .chain((0..args.decode_workers).map(|i| (format!("decode-{i}"), WorkerRole::Decode)))
            .collect()
    } else {
        (0..args.workers).map(|i| (format!("worker-{i}"), WorkerRole::Aggregated)).collect()
    };
    let routers = args.routers.max(1);
    anyhow::ensure!(routers == 1 || args.event_log.is_some(), "several routers share their KV index through Redis: an event log is needed");
    let cache_dir = default_cache_dir();
    // Fetch the model up front, with progress bars, so workers find it cached.
    if let Some(entry) = catalog_entry(&args.model) {
        let model = args.model.clone();
        tokio::task::spawn_blocking(move || pull(entry, &cache_dir, Progress::Bars))
            .await?
            .with_context(|| format!("fetching model {model}"))?;
    }
    let gateway_config = GatewayConfig {
        http_addr: SocketAddr::new(args.host, args.http_port),
        grpc_addr: SocketAddr::new(args.host, args.grpc_port),
        router: None,
        max_concurrent_requests: args.max_concurrent_requests,
        shutdown_grace_secs: args.shutdown_grace_secs,
        model_refresh_ms: 500,
        ..GatewayConfig::default()
    };
    gateway_config.validate().map_err(anyhow::Error::msg)?;
    // Bind first: a busy port should fail before the model loads. Extra
    // gateways (one per extra router) take free ports.
    let mut listeners = vec![GatewayListeners::bind(&gateway_config).await?];
    for _ in 1..routers {
        let extra = GatewayConfig { http_addr: SocketAddr::new(args.host, 0), grpc_addr: SocketAddr::new(args.host, 0), ..gateway_config.clone() };
        listeners.push(GatewayListeners::bind(&extra).await?);
    }
    let http_ports = listeners.iter().map(|l| l.http.local_addr().map(|a| a.port())).collect::<Result<Vec<u16>, _>>()?;
    let http_port = http_ports[0];
    let grpc_port = listeners[0].grpc.local_addr()?.port();

    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = args.threads.unwrap_or_else(|| (cores / roles.len()).max(1));
    let mut workers = Vec::with_capacity(roles.len());
    for (worker_id, role) in roles {
        let config = WorkerConfig {
            worker_id: Some(worker_id),
            role,
            kv_transport: args.kv_transport,
            mock_kv_bytes_per_token: args.mock_kv_bytes_per_token,
            mock_transfer_gbps: args.mock_transfer_gbps,
            model: args.model.clone(),
            served_model_name: args.served_model_name.clone(),
            engine: args.engine,
            speedup: args.speedup,
            block_size: args.block_size,
            num_blocks: args.num_blocks,
            kv_cache_mib: args.kv_cache_mib,
            threads: Some(threads),
            device: args.device.clone(),
            max_num_seqs: args.max_num_seqs,
            max_batched_tokens: args.max_batched_tokens,
            context_length: args.context_length,
            ..WorkerConfig::default()
        };
        config.validate().map_err(anyhow::Error::msg)?;
        let worker: Arc<Worker> = tokio::task::spawn_blocking(move || Worker::start(&config)).await??;
        workers.push(worker);
    }
    let model_name = workers[0].card().name.clone();
    // Prefill workers' blocks are read over real loopback sockets.
    let mut transfer_servers = Vec::new();
    for worker in workers.iter().filter(|worker| worker.role() != WorkerRole::Aggregated) {
        let (endpoint, task) = serve_transfer_loopback(worker.clone(), shutdown.clone()).await?;
        tracing::info!(worker = worker.id(), role = %worker.role(), %endpoint, ucx = worker.disagg().has_ucx(), "KV transfer endpoint");
        transfer_servers.push(task);
    }
    let engine_metrics: Vec<_> = workers.iter().map(|worker| register_engine(worker.id(), worker.engine().clone())).collect();

    let registry = Registry::Memory(MemoryRegistry::new());
    let lease_ttl = Duration::from_secs(5);
    let leases: Vec<_> = workers.iter().map(|worker| register_local(registry.clone(), worker.clone(), lease_ttl)).collect();
    let kv_config = KvConfig {
        weights: args.kv.weights(),
        ..KvConfig::default()
    };
    kv_config.validate().map_err(anyhow::Error::msg)?;
    // KV events: straight into one shared index, or through Redis into one
    // replica per router.
    let log = match &args.event_log {
        Some((url, namespace)) => Some(EventLog::new(url, namespace).context("bad Redis URL for the KV event log")?),
        None => None,
    };
    let shared_index = Arc::new(KvIndex::new());
    let feeds: Vec<_> = match &log {
        None => workers.iter().map(|worker| feed_index(worker.clone(), shared_index.clone(), shutdown.clone())).collect(),
        Some(log) => workers.iter().map(|worker| publish_events(worker.clone(), log.clone(), shutdown.clone())).collect(),
    };
    let pool = WorkerPool::new(&workers);
    let mut tasks = Vec::new();
    let mut gateways = Vec::new();
    for (replica, listeners) in listeners.into_iter().enumerate() {
        let kv = match &log {
            None => KvState::new(kv_config, shared_index.clone()),
            Some(log) => {
                let (index, status) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()));
                tasks.push(follow(index.clone(), log, local_dumps(&workers), status.clone(), shutdown.clone()));
                KvState::new(kv_config, index).with_event_status(status)
            }
        };
        let disagg = DisaggPolicy { threshold_tokens: args.disagg_threshold_tokens, ..DisaggPolicy::default() };
        let router = Arc::new(Router::with_kv(args.policy, Duration::from_secs(600), Arc::new(kv)).with_disagg(disagg));
        tasks.push(watch_registry(router.clone(), registry.clone(), Duration::from_millis(100), shutdown.clone()));
        if let (Some((url, namespace)), true) = (&args.event_log, routers > 1) {
            // Replicas see each other's bookings, as separate processes do.
            let peers = PeerLoad::new(url, namespace, &format!("embedded-{}-{replica}", std::process::id())).context("bad Redis URL for sharing load")?;
            tasks.push(share_load(router.clone(), peers, shutdown.clone()));
        }
        let (config, pool, shutdown) = (gateway_config.clone(), pool.clone(), shutdown.clone());
        gateways.push(tokio::spawn(async move { serve_gateway(&config, listeners, RouterClient::Local(router), pool, shutdown).await }));
    }

    let finished = tokio::spawn(async move {
        // Engine metrics stay registered while the stack runs.
        let _engine_metrics = engine_metrics;
        let mut served = Ok(());
        for gateway in gateways {
            let result = gateway.await.context("gateway panicked")?;
            served = served.and(result);
        }
        for task in tasks {
            let _ = task.await;
        }
        for lease in leases {
            lease.revoke().await;
        }
        for worker in &workers {
            worker.shutdown();
        }
        for feed in feeds {
            let _ = feed.await;
        }
        for server in transfer_servers {
            let _ = server.await;
        }
        served?;
        tracing::info!("turbine stopped");
        Ok(())
    });
    Ok(Stack { http_port, http_ports, grpc_port, model: model_name, finished })
}

/// Dumps straight from the in-process workers, for event-log followers.
fn local_dumps(workers: &[Arc<Worker>]) -> DumpFetcher {
    let workers = workers.to_vec();
    Arc::new(move |worker_id: String| {
        let worker = workers.iter().find(|w| w.id() == worker_id).cloned();
        Box::pin(async move {
            let worker = worker?;
            let dump = worker.engine().dump().await.ok()?;
            Some((worker.instance(), dump))
        })
    })
}

fn print_banner(http_port: u16, grpc_port: u16, model: &str, workers: usize) {
    let base = format!("http://localhost:{http_port}");
    println!();
    println!("Turbine is ready: {model} on {workers} worker(s)");
    println!("  OpenAI API  {base}/v1");
    println!("  gRPC        localhost:{grpc_port} (turbine.gateway.v1.Inference)");
    println!("  metrics     {base}/metrics");
    println!();
    println!("Try it:");
    println!(
        "  curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    );
    println!();
}
