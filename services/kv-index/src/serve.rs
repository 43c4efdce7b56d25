//! Serving a kv-index replica.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use tokio::task::JoinHandle;
use turbine_api::worker::WorkerClients;
use turbine_kv::{KvIndex, Unregistered, WorkerId};
use turbine_kv_log::{EventLog, FollowerStatus, LogPosition, dumps_from, replicate};
use turbine_proto::kvindex::v1::{FILE_DESCRIPTOR_SET, kv_index_server::KvIndexServer};
use turbine_proto::service_names;
use turbine_registry::{RedisRegistry, Registry, RestartGrace, WorkerRecord};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Host, HostSpec, Listeners, Role, RpcRoles};

use crate::config::KvIndexConfig;
use crate::service::KvIndexService;
use turbine_kv_log::{LocalKvIndex, ReplicaCounters};

/// How a replica's index is kept current.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant, reason = "one value per process, built at startup")]
pub enum IndexFeed {
    /// Following the namespace's event log (a standalone replica).
    Log(EventLog),
    /// Fed by the workers of this process (the embedded cluster): the
    /// service answers from that index.
    InProcess(Arc<KvIndex>),
}

/// What a kv-index needs besides its configuration.
#[derive(Debug, Clone)]
pub struct KvIndexDeps {
    /// The worker registry (endpoints for dumps; expired leases).
    pub registry: Registry,
    /// How the index is fed.
    pub feed: IndexFeed,
    /// How to reach workers for their dumps.
    pub workers: WorkerClients,
}

impl KvIndexDeps {
    /// A standalone replica's: the registry and event log in Redis.
    pub fn from_config(config: &KvIndexConfig) -> anyhow::Result<Self> {
        let redis = config.cluster.redis.as_deref().context("turbine-kv-index follows the KV event log in Redis: pass --redis redis://HOST:PORT/")?;
        Ok(Self {
            registry: Registry::Redis(RedisRegistry::new(redis, &config.cluster.namespace)?),
            feed: IndexFeed::Log(EventLog::new(redis, &config.cluster.namespace).context("bad Redis URL for the KV event log")?),
            workers: WorkerClients::default(),
        })
    }
}

/// Registered workers' gRPC endpoints, by id (where dumps come from).
type Endpoints = Arc<RwLock<FxHashMap<WorkerId, String>>>;

const SPEC: HostSpec = HostSpec {
    name: "kv-index",
    health: &[service_names::KV_INDEX],
    descriptors: &[FILE_DESCRIPTOR_SET],
    handler_timeout: Duration::from_secs(30),
    roles: ROLES,
};

/// Who may call each rpc (enforced when the index serves mutual TLS):
/// workers and kv-stores publish what they hold; routers ask for matches
/// and dumps; a worker's entries are dropped by the worker leaving or by
/// a router that saw it gone.
pub const ROLES: &[RpcRoles] = &[
    RpcRoles { method: "/turbine.kvindex.v1.KvIndex/PublishEvents", roles: &[Role::Worker, Role::KvStore] },
    RpcRoles { method: "/turbine.kvindex.v1.KvIndex/FindMatches", roles: &[Role::Router, Role::Operator] },
    RpcRoles { method: "/turbine.kvindex.v1.KvIndex/Dump", roles: &[Role::Router, Role::Operator] },
    RpcRoles { method: "/turbine.kvindex.v1.KvIndex/RemoveWorker", roles: &[Role::Worker, Role::Router, Role::Operator] },
    RpcRoles { method: "/turbine.kvindex.v1.KvIndex/Stats", roles: &[Role::Operator, Role::Monitoring, Role::Planner] },
];

/// Serves a replica on `listeners` until `shutdown` fires, then drains.
pub async fn serve(config: KvIndexConfig, deps: KvIndexDeps, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    let replica = match deps.feed {
        IndexFeed::InProcess(index) => LocalKvIndex::new(index),
        IndexFeed::Log(log) => {
            let index = Arc::new(KvIndex::new());
            let counters = Arc::new(ReplicaCounters::default());
            let status = Arc::new(FollowerStatus::default());
            let endpoints: Endpoints = Arc::default();
            // Know the workers' endpoints before the first gap needs a dump.
            if let Ok(workers) = deps.registry.list().await {
                *endpoints.write() = holders(workers.into_iter().map(|w| w.record));
            }
            // Workers' and kv-stores' names alike: the stores' endpoints
            // come from the records of the workers that read them.
            let (workers, stores) = (endpoints.clone(), endpoints.clone());
            let fetch = dumps_from(deps.workers.clone(), move |worker_id| workers.read().get(worker_id).cloned(), move |name| stores.read().get(name).cloned());
            let replicating = replicate("kv-index", index.clone(), &log, fetch, status.clone(), shutdown.clone()).await;
            if !replicating.start.is_start() {
                *counters.started_from_snapshot.lock() = Some(replicating.start);
            }
            tasks.extend(replicating.tasks);
            tasks.push(sweep_expired(index.clone(), deps.registry.clone(), endpoints, &config, counters.clone(), shutdown.clone()));
            if config.snapshot_interval_secs > 0.0 {
                let interval = Duration::from_secs_f64(config.snapshot_interval_secs);
                tasks.push(write_snapshots(index.clone(), log.clone(), status.clone(), counters.clone(), interval, shutdown.clone()));
            }
            LocalKvIndex::new(index).with_follower(Some(status)).with_log(log).with_counters(counters)
        }
    };
    let mut host = Host::new(SPEC, &config.server, listeners).await?;
    host.add_service(KvIndexServer::new(KvIndexService::new(replica)));
    let mut serving = host.start(shutdown)?;
    for task in tasks {
        serving.spawn(task);
    }
    let registry = deps.registry;
    serving
        .ready_when(Duration::from_secs(1), move || {
            let registry = registry.clone();
            async move { registry.ping().await.is_ok() }
        })
        .await;
    serving.until_shutdown(async {}).await
}

/// Entry point shared by `turbine-kv-index` and `turbine kv-index`.
pub fn main(config: KvIndexConfig) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-kv-index", move |shutdown| async move {
        // The identity first: every client made below dials with it.
        config.server.tls.establish()?;
        let deps = KvIndexDeps::from_config(&config)?;
        let listeners = Listeners::bind(&config.server).await?;
        serve(config, deps, listeners, shutdown).await
    })
}

/// Every holder of blocks the registry's `records` make live, with its
/// endpoint: each worker, and each kv-store a worker reads (its blocks stay
/// in the index while a worker that can fetch them does).
fn holders(records: impl Iterator<Item = WorkerRecord>) -> FxHashMap<WorkerId, String> {
    let mut live = FxHashMap::default();
    for record in records {
        if let Some(store) = record.kv_store {
            live.insert(store.name, store.endpoint);
        }
        live.insert(record.worker_id, record.endpoint);
    }
    live
}

/// Reads the registry every poll: keeps the workers' endpoints for dumps,
/// and drops from the index every worker missing from the registry for the
/// grace period (its lease expired: it stopped or lost Redis). While the
/// registry is unreachable nothing is dropped.
fn sweep_expired(
    index: Arc<KvIndex>,
    registry: Registry,
    endpoints: Endpoints,
    config: &KvIndexConfig,
    counters: Arc<ReplicaCounters>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let poll = Duration::from_millis(config.registry_poll_ms);
    let grace = Duration::from_secs_f64(config.lease_grace_secs);
    tokio::spawn(async move {
        let mut unregistered = Unregistered::new(grace);
        let mut restart = RestartGrace::new(RestartGrace::DEFAULT);
        loop {
            if let Ok(workers) = registry.list().await {
                let now = Instant::now();
                let live = holders(workers.into_iter().filter(|w| w.expires_at > now).map(|w| w.record));
                // A Redis that restarted empty lists nobody until the
                // workers' next renewal: no worker leaves meanwhile.
                if restart.lenient(&registry).await {
                    unregistered.reset();
                } else {
                    for (worker_id, blocks) in unregistered.sweep(&index, |id| live.contains_key(id), now) {
                        counters.workers_expired.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(worker = %worker_id, blocks, "worker's registry lease expired; its blocks left the KV index");
                    }
                }
                *endpoints.write() = live;
            }
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                () = shutdown.cancelled() => return,
            }
        }
    })
}

/// Writes the index to Redis every `interval` while the log is followed
/// and something changed since the last snapshot.
fn write_snapshots(
    index: Arc<KvIndex>,
    log: EventLog,
    status: Arc<FollowerStatus>,
    counters: Arc<ReplicaCounters>,
    interval: Duration,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut last_written: Option<LogPosition> = None;
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
            // The position first: the dumps taken after it reflect at least
            // that much of the log.
            let position = status.position();
            if !status.reachable() || position.is_start() || last_written == Some(position) {
                continue;
            }
            let started = Instant::now();
            match log.save_snapshot(index.clone(), position, status.stale_workers()).await {
                Ok(Some(bytes)) => {
                    counters.snapshots_written.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%position, bytes, took_ms = started.elapsed().as_millis() as u64, "KV index snapshot written");
                    last_written = Some(position);
                }
                Ok(None) => {
                    tracing::debug!(%position, "a newer KV index snapshot is already stored");
                    last_written = Some(position);
                }
                Err(error) => tracing::warn!(%error, "could not write the KV index snapshot"),
            }
        }
    })
}

#[cfg(test)]
mod role_table {
    #[test]
    fn every_rpc_has_one_row_naming_who_may_call_it() {
        super::SPEC.check_roles(&[turbine_proto::service_names::KV_INDEX]).unwrap();
    }
}
