//! The embedded cluster: what `turbine run` starts, as a library.
//!
//! Every service runs through its own `serve` (the same code as its
//! binary), on loopback listeners with free ports — only the gateway's
//! listeners are the configured ones — and they find each other the way
//! separate processes do (a registry, KV events), in memory: the registry
//! is a `MemoryRegistry`, the workers feed one shared KV index, and the
//! gateway calls the router and the workers through their clients, which
//! call them directly in this process. [`Cluster`] hands out those clients
//! and the bound addresses, so `turbine run`, the benchmarks and the tests
//! drive the same thing.
//!
//! With a planner (`--planner`), the planner sizes the cluster's own
//! workers: it starts and drains them in this process ([`HostedWorkers`],
//! the planner's `hosted` connector).
//!
//! Readiness comes from the services themselves: each worker's gRPC health
//! turns SERVING once its model is loaded and it is registered, and the
//! cluster is ready when every gateway lists the model.

mod config;
#[cfg(feature = "sandbox")]
pub mod sandbox;
mod workers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;
use turbine_api::kv_index::KvIndexClient;
use turbine_api::kv_store::KvStoreClient;
use turbine_api::router::RouterClient;
use turbine_api::worker::{WorkerClient, WorkerClients};
use turbine_gateway::{GatewayConfig, GatewayDeps};
use turbine_kv::{KvIndex, WorkerId};
use turbine_kv_index::{IndexFeed, KvIndexConfig, KvIndexDeps};
use turbine_kv_log::EventLog;
use turbine_kv_log::LocalKvIndex;
use turbine_kv_store::{KvStoreConfig, LocalKvStore, Store as KvStore, StoreEventSink};
use turbine_planner::act::connector::Connector;
use turbine_planner::act::scale::Scaler;
use turbine_planner::config::PlanningConfig;
use turbine_planner::cycle::Sizing;
use turbine_planner::observe::Observer;
use turbine_planner::plan::profile::Profile;
use turbine_planner::{Ledger, PlannerConfig, PlannerState};
use turbine_proto::gateway::v1::ListModelsRequest;
use turbine_proto::gateway::v1::inference_client::InferenceClient;
use turbine_registry::{MemoryRegistry, Registry};
use turbine_router::peers::PeerLoad;
use turbine_router::{IndexSource, RouterConfig, RouterDeps};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{BoundAddrs, Listeners, bind};
use turbine_tokens::pull::{Progress, catalog_entry, default_cache_dir, pull};
use turbine_worker::{KvEventSink, WorkerConfig, WorkerDeps};

pub use config::{RUN_PLANNER_DATABASE, RunConfig, RunWorkerConfig};
pub use workers::HostedWorkers;
use workers::WorkerTemplate;

/// How the cluster is laid out beyond what `turbine run` offers as flags
/// (set by the benchmarks and tests).
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// Router replicas, each behind its own gateway (0 or 1: one). More
    /// than one needs `event_log`; the extra gateways take free ports.
    pub routers: usize,
    /// KV events through Redis instead of in this process: the workers
    /// publish to this (URL, namespace)'s event log and every router
    /// follows it into its own index replica.
    pub event_log: Option<(String, String)>,
    /// Prefixed to every worker id (keeps clusters in one process apart).
    pub worker_id_prefix: String,
    /// Progress bars while the model downloads.
    pub progress: bool,
}

/// A worker of the cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedWorker {
    /// Its id.
    pub id: WorkerId,
    /// Its client (called directly).
    pub client: WorkerClient,
    /// Where it listens (gRPC: `Worker` and `KvTransfer`; admin).
    pub addresses: BoundAddrs,
}

/// A started cluster.
#[derive(Debug)]
pub struct Cluster {
    gateways: Vec<BoundAddrs>,
    routers: Vec<RouterClient>,
    workers: Vec<EmbeddedWorker>,
    kv_index: Option<(KvIndexClient, BoundAddrs)>,
    kv_store: Option<std::net::SocketAddr>,
    model: String,
    registry: Registry,
    /// The workers (those started with the cluster, and the planner's).
    hosted: HostedWorkers,
    /// Where the planner listens, when asked for.
    planner: Option<SocketAddr>,
    /// The gateways' public certificate, when their API serves TLS: this
    /// process checks them through channels pinned to it.
    public_tls: Option<turbine_runtime::public_tls::PublicTls>,
    /// The gateways' tasks: they drain first, on the caller's token.
    front: Vec<(String, JoinHandle<anyhow::Result<()>>)>,
    /// Everything behind the gateways (workers, routers, kv-index): stopped
    /// only once the gateways have drained, so a stream in flight at
    /// shutdown still has its router and worker until it completes.
    services: Vec<(String, JoinHandle<anyhow::Result<()>>)>,
    /// Stops `services` when cancelled, or when the cluster is dropped.
    backend: tokio_util::sync::DropGuard,
}

impl Cluster {
    /// Starts every service and returns once every worker is SERVING and
    /// every gateway lists the model; the services drain and stop when
    /// `shutdown` fires (see [`finished`](Self::finished)).
    pub async fn start(config: RunConfig, options: ClusterOptions, shutdown: CancellationToken) -> anyhow::Result<Self> {
        // The gateways stop with `shutdown`, the services behind them after
        // the gateways have drained; all of them when the start fails half way.
        let (front, backend) = (shutdown.child_token(), CancellationToken::new());
        let started = Self::start_services(config, options, front.clone(), backend.clone()).await;
        if started.is_err() {
            front.cancel();
            backend.cancel();
        }
        started
    }

    async fn start_services(config: RunConfig, options: ClusterOptions, front: CancellationToken, backend: CancellationToken) -> anyhow::Result<Self> {
        let shutdown = backend.clone();
        turbine_runtime::config::Settings::validate(&config).map_err(anyhow::Error::msg)?;
        let routers = options.routers.max(1);
        anyhow::ensure!(routers == 1 || options.event_log.is_some(), "several routers share their KV index through Redis: an event log is needed");
        // Bind first: a busy port should fail before the model loads.
        let mut gateway_listeners =
            vec![gateway_listeners(SocketAddr::new(config.host, config.grpc_port), SocketAddr::new(config.host, config.http_port)).await?];
        for _ in 1..routers {
            gateway_listeners.push(gateway_listeners_on(config.host).await?);
        }
        let kv_index_listeners = match config.kv_index_port {
            Some(port) => Some(Listeners { grpc: bind(SocketAddr::new(config.host, port), "kv-index gRPC").await?, admin: None, http: None }),
            None => None,
        };
        let kv_store_listeners = match config.kv_store_port {
            Some(port) => Some(Listeners { grpc: bind(SocketAddr::new(config.host, port), "kv-store gRPC").await?, admin: None, http: None }),
            None => None,
        };
        let planner_listeners = match config.planner_port {
            Some(port) => Some(Listeners { grpc: bind(SocketAddr::new(config.host, port), "planner gRPC").await?, admin: None, http: None }),
            None => None,
        };
        let cache_dir = config.worker.engine.cache_dir.clone().unwrap_or_else(default_cache_dir);
        let planner_database = config.planner.database.clone().unwrap_or_else(|| format!("sqlite:{}", cache_dir.join(RUN_PLANNER_DATABASE).display()));
        // Fetch the model up front, once, before the workers look for it.
        if let Some(entry) = catalog_entry(&config.worker.engine.model) {
            let (model, progress) = (config.worker.engine.model.clone(), if options.progress { Progress::Bars } else { Progress::Quiet });
            tokio::task::spawn_blocking(move || pull(entry, &cache_dir, progress)).await?.with_context(|| format!("fetching model {model}"))?;
        }

        let registry = Registry::Memory(MemoryRegistry::new());
        let clients = WorkerClients::default();
        let shared_index = Arc::new(KvIndex::new());
        let log = match &options.event_log {
            Some((url, namespace)) => Some(EventLog::new(url, namespace).context("bad Redis URL for the KV event log")?),
            None => None,
        };
        let mut services = Vec::new();

        // The kv-store first: the workers connect to it as they start.
        let mut worker_engine = config.worker.engine.clone();
        // The store in this process: its workers call it directly.
        let mut local_store = None;
        let kv_store = match kv_store_listeners {
            Some(listeners) => {
                let address = listeners.grpc.local_addr()?;
                let mut store_config = KvStoreConfig::default();
                store_config.server.shutdown_grace_secs = config.shutdown_grace_secs;
                store_config.server.insecure = config.insecure;
                store_config.store_id = "embedded".to_owned();
                // Its UCX on the loopback device, as its gRPC.
                let ucx = store_config.ucx.then(|| (turbine_kv::UcxNetwork::for_service(None, false, address.ip()), turbine_kv::UcxKeys::WholePool));
                let store = KvStore::open(store_config.memory_mib << 20, None, ucx);
                let events = match &log {
                    Some(log) => StoreEventSink::Log(log.clone()),
                    None => StoreEventSink::Index(shared_index.clone()),
                };
                // It announces its blocks (to the log or the shared index).
                local_store = Some(KvStoreClient::new(Arc::new(LocalKvStore::configured(store.clone(), &store_config, true))));
                services.push(("kv-store".to_owned(), tokio::spawn(turbine_kv_store::serve(store_config, store, events, listeners, shutdown.clone()))));
                worker_engine.kv_store.get_or_insert_with(|| format!("http://{}", loopback(address)));
                Some(address)
            }
            None => None,
        };

        let roles = config.roles();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = config.worker.engine.threads.unwrap_or_else(|| (cores / roles.len()).max(1));
        let mut template = WorkerConfig { engine: worker_engine, transfer: config.worker.transfer.clone(), ..WorkerConfig::default() };
        template.engine.threads = Some(threads);
        template.server.shutdown_grace_secs = config.shutdown_grace_secs;
        let events = match &log {
            Some(log) => KvEventSink::Log(log.clone()),
            None => KvEventSink::Index(shared_index.clone()),
        };
        let deps = WorkerDeps { registry: Some(registry.clone()), events, local: Some(clients.clone()), kv_store: local_store };
        let hosted = HostedWorkers::new(WorkerTemplate { config: template, deps, prefix: options.worker_id_prefix.clone() }, shutdown.clone());
        let mut workers = Vec::new();
        for (_, role) in roles {
            workers.push(hosted.spawn(role).await?);
        }
        // Workers load their models side by side; each is ready when its
        // health says so.
        let mut embedded = Vec::new();
        for (id, addresses) in workers {
            embedded.push(hosted.until_serving(&id, addresses).await?);
        }
        let model = embedded[0].client.model_card().await?.name;

        let mut router_clients = Vec::new();
        for replica in 0..routers {
            let mut router = RouterConfig { routing: config.router.clone(), poll_interval_ms: 100, ..RouterConfig::default() };
            router.server.shutdown_grace_secs = config.shutdown_grace_secs;
            let (index, peers) = match (&log, &options.event_log) {
                (Some(log), Some((url, namespace))) => {
                    // Replicas see each other's bookings, as separate processes do.
                    let peers = (routers > 1).then(|| PeerLoad::new(url, namespace, &format!("embedded-{}-{replica}", std::process::id()))).transpose()?;
                    (IndexSource::Log(log.clone()), peers)
                }
                _ => (IndexSource::Shared(shared_index.clone()), None),
            };
            let deps = RouterDeps { registry: registry.clone(), index, peers, workers: clients.clone() };
            let running = turbine_router::start(router, deps, Listeners::loopback().await?, shutdown.clone()).await?;
            router_clients.push(RouterClient::new(running.local.clone()));
            services.push((format!("router {replica}"), tokio::spawn(running.finished())));
        }

        let kv_index = match kv_index_listeners {
            Some(listeners) => {
                let addresses = BoundAddrs { grpc: listeners.grpc.local_addr()?, admin: None, http: None };
                let mut kv_config = KvIndexConfig::default();
                kv_config.server.shutdown_grace_secs = config.shutdown_grace_secs;
                kv_config.server.insecure = config.insecure;
                let feed = match &log {
                    Some(log) => IndexFeed::Log(log.clone()),
                    None => IndexFeed::InProcess(shared_index.clone()),
                };
                let deps = KvIndexDeps { registry: registry.clone(), feed, workers: clients.clone() };
                services.push(("kv-index".to_owned(), tokio::spawn(turbine_kv_index::serve(kv_config, deps, listeners, shutdown.clone()))));
                let client = match &log {
                    Some(_) => KvIndexClient::connect(&addresses.grpc_endpoint())?,
                    None => KvIndexClient::new(Arc::new(LocalKvIndex::new(shared_index.clone()))),
                };
                Some((client, addresses))
            }
            None => None,
        };

        let mut gateways = Vec::new();
        let mut front_tasks = Vec::new();
        // With API keys, this process asks its gateways with a key of its
        // own, made now and kept in memory only.
        let own_key = config.gateway.keys_required().then(turbine_gateway::keys::new_key);
        for (replica, (mut listeners, router)) in gateway_listeners.into_iter().zip(&router_clients).enumerate() {
            // With API keys, /metrics and the probes leave the API's port
            // for one on loopback.
            if config.gateway.keys_required() {
                listeners.admin = Some(bind(SocketAddr::new([127, 0, 0, 1].into(), 0), "gateway admin").await?);
            }
            let mut gateway = GatewayConfig { admission: config.gateway.clone(), ..GatewayConfig::default() };
            gateway.server.shutdown_grace_secs = config.shutdown_grace_secs;
            gateway.server.clients = config.clients.clone();
            // With API keys every call of its gRPC API is authenticated by
            // key, as the REST API's are (what --host asks for).
            gateway.server.insecure = config.insecure || config.gateway.keys_required();
            if replica == 0 {
                gateway.server.addresses_file = config.addresses_file.clone();
            }
            let addresses = BoundAddrs {
                grpc: listeners.grpc.local_addr()?,
                admin: listeners.admin.as_ref().map(|l| l.local_addr()).transpose()?,
                http: listeners.http.as_ref().map(|l| l.local_addr()).transpose()?,
            };
            let deps = GatewayDeps { router: router.clone(), workers: clients.clone(), own_key: own_key.clone() };
            front_tasks.push((format!("gateway {replica}"), tokio::spawn(turbine_gateway::serve(gateway, deps, listeners, front.clone()))));
            gateways.push(addresses);
        }
        let planner = match planner_listeners {
            Some(listeners) => {
                let address = listeners.grpc.local_addr()?;
                let metrics = format!("http://{}/metrics", loopback(gateways[0].admin.or(gateways[0].http).context("gateways serve HTTP")?));
                let planning = PlanningConfig { database: Some(planner_database.clone()), ..config.planner.clone() };
                let mut planner = PlannerConfig { planning, ..PlannerConfig::default() };
                planner.server.shutdown_grace_secs = config.shutdown_grace_secs;
                planner.server.insecure = config.insecure;
                let ledger = Ledger::open(&planner_database, &planner.cluster.namespace).await.context("cannot open the planner's database")?;
                let profile = planner.planning.profile.as_deref().context("--planner needs --planner-profile")?;
                let sizing = Sizing { profile: Profile::read(profile)?, season_intervals: planner.planning.season_intervals };
                let observer = Observer::new(vec![metrics], registry.clone());
                let state = PlannerState::with_connector(ledger, Connector::Hosted(Scaler::new(Arc::new(hosted.clone()))));
                tracing::info!(%address, database = state.ledger().backend().name(), "planner listening: it sizes this process's workers once targets are set (SetTargets)");
                services
                    .push(("planner".to_owned(), tokio::spawn(turbine_planner::serve(planner, state, Some((observer, sizing)), listeners, shutdown.clone()))));
                Some(address)
            }
            None => None,
        };
        let public_tls = config.gateway.public_tls()?;
        let cluster = Self {
            public_tls,
            gateways,
            routers: router_clients,
            workers: embedded,
            kv_index,
            kv_store,
            model,
            registry,
            hosted,
            planner,
            front: front_tasks,
            services,
            backend: backend.drop_guard(),
        };
        let mut cluster = cluster;
        for index in 0..cluster.gateways.len() {
            let gateway = cluster.gateways[index];
            if let Err(waiting) = cluster.until_listed(&gateway, own_key.as_deref()).await {
                // A gateway that stopped (its keys file, say) says why.
                if let Some(position) = cluster.front.iter().position(|(_, task)| task.is_finished()) {
                    let (name, task) = cluster.front.remove(position);
                    let stopped = match task.await {
                        Ok(Ok(())) => anyhow::anyhow!("{name} stopped"),
                        Ok(Err(error)) => error.context(format!("{name} stopped")),
                        Err(error) => anyhow::anyhow!("{name} panicked: {error}"),
                    };
                    return Err(stopped);
                }
                return Err(waiting);
            }
        }
        Ok(cluster)
    }

    /// The cluster's worker registry (in memory): who serves, in which
    /// role, how loaded.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Waits until the gateway at `addresses` lists the model (its catalog
    /// learned it from the router), asking its own API.
    async fn until_listed(&self, addresses: &BoundAddrs, key: Option<&str>) -> anyhow::Result<()> {
        let endpoint = addresses.grpc_endpoint();
        let channel = || match &self.public_tls {
            Some(public) => public.pinned_channel(&endpoint),
            None => Ok(turbine_runtime::grpc::channel(&endpoint, turbine_runtime::host::Role::Gateway)?),
        };
        // Bounded, and cut short by a gateway that stopped (never serving).
        let serving = turbine_runtime::health::until_serving_over(|| channel().ok(), turbine_proto::service_names::GATEWAY_INFERENCE);
        let stopped = async {
            while !self.front.iter().any(|(_, task)| task.is_finished()) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            () = serving => {}
            () = stopped => anyhow::bail!("a gateway stopped while starting"),
            () = tokio::time::sleep(Duration::from_secs(60)) => anyhow::bail!("the gateway at {endpoint} did not serve within a minute"),
        }
        let mut client = InferenceClient::new(channel()?);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            anyhow::ensure!(!self.front.iter().any(|(_, task)| task.is_finished()), "a gateway stopped while starting");
            let mut request = tonic::Request::new(ListModelsRequest {});
            if let Some(key) = key {
                request.metadata_mut().insert("authorization", format!("Bearer {key}").parse().context("an API key is ASCII")?);
            }
            let listed = client.list_models(request).await?.into_inner().models;
            if listed.iter().any(|model| model.name == self.model) {
                return Ok(());
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "the gateway at {endpoint} did not list {} within a minute", self.model);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The first gateway's OpenAI base URL (`http://127.0.0.1:8000`;
    /// `https://` when its API serves TLS).
    pub fn http_url(&self) -> String {
        let scheme = if self.public_tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.gateways[0].http.expect("gateways serve HTTP"))
    }

    /// Every gateway's addresses (one per router replica).
    pub fn gateways(&self) -> &[BoundAddrs] {
        &self.gateways
    }

    /// The first gateway's gRPC endpoint (`turbine.gateway.v1`).
    pub fn grpc_endpoint(&self) -> String {
        self.gateways[0].grpc_endpoint()
    }

    /// The served model's name.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The first router's client.
    pub fn router(&self) -> &RouterClient {
        &self.routers[0]
    }

    /// The workers.
    pub fn workers(&self) -> &[EmbeddedWorker] {
        &self.workers
    }

    /// The kv-index, when asked for.
    pub fn kv_index(&self) -> Option<&(KvIndexClient, BoundAddrs)> {
        self.kv_index.as_ref()
    }

    /// Where the kv-store listens, when asked for.
    pub fn kv_store(&self) -> Option<SocketAddr> {
        self.kv_store
    }

    /// Where the planner listens, when asked for.
    pub fn planner(&self) -> Option<SocketAddr> {
        self.planner
    }

    /// The workers serving now, of every role: those started with the
    /// cluster and those its planner added, less those it drained.
    pub fn hosted_workers(&self) -> &HostedWorkers {
        &self.hosted
    }

    /// Resolves once every service has drained after the shutdown token
    /// fired — the gateways first, then what serves them — and returns the
    /// first failure, if any.
    pub async fn finished(self) -> anyhow::Result<()> {
        let mut result = Ok(());
        for (name, task) in self.front {
            keep_first_failure(&mut result, &name, task.await);
        }
        drop(self.backend);
        for (name, task) in self.services.into_iter().chain(self.hosted.take_tasks()) {
            keep_first_failure(&mut result, &name, task.await);
        }
        tracing::info!("turbine stopped");
        result
    }
}

/// `address`, with an unspecified IP (listening on every interface) as
/// the loopback one, to connect to.
fn loopback(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(if address.ip().is_unspecified() { [127, 0, 0, 1].into() } else { address.ip() }, address.port())
}

/// Folds a service task's outcome into `result`, keeping the first failure.
fn keep_first_failure(result: &mut anyhow::Result<()>, name: &str, ended: Result<anyhow::Result<()>, tokio::task::JoinError>) {
    let ended = ended.with_context(|| format!("{name} panicked")).and_then(|served| served.with_context(|| format!("{name} failed")));
    if let (Err(error), Ok(())) = (ended, &*result) {
        *result = Err(error);
    }
}

/// A gateway's gRPC and HTTP listeners at the given addresses.
async fn gateway_listeners(grpc: SocketAddr, http: SocketAddr) -> anyhow::Result<Listeners> {
    Ok(Listeners { grpc: bind(grpc, "gRPC").await?, admin: None, http: Some(bind(http, "HTTP").await?) })
}

/// A gateway's listeners on free ports of `host`.
async fn gateway_listeners_on(host: std::net::IpAddr) -> anyhow::Result<Listeners> {
    gateway_listeners(SocketAddr::new(host, 0), SocketAddr::new(host, 0)).await
}
