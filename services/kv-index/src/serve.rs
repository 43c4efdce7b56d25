//! Running a kv-index replica.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use turbine_kv::{KvIndex, Unregistered};
use turbine_kv_log::{EventLog, FollowerStatus, follow_from, grpc_dump_fetcher, start_from_snapshot};
use turbine_proto::kvindex::v1::{FILE_DESCRIPTOR_SET, kv_index_server::KvIndexServer};
use turbine_proto::service_names;
use turbine_registry::{RedisRegistry, Registry, RestartGrace};
use turbine_runtime::grpc::{MAX_MESSAGE_BYTES, base_routes, serve as serve_grpc};
use turbine_runtime::health::Readiness;
use turbine_runtime::{CancellationToken, admin};

use crate::config::KvIndexConfig;
use crate::service::{KvIndexService, ReplicaCounters};

/// Registered workers' gRPC endpoints, by id (where dumps come from).
type Endpoints = Arc<RwLock<FxHashMap<String, String>>>;



/// Runs a replica until `shutdown` fires, then drains and returns.
pub async fn run(config: KvIndexConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let redis = config.redis.as_deref().context("turbine-kv-index follows the KV event log in Redis: pass --redis redis://HOST:PORT/")?;
    let registry = Registry::Redis(RedisRegistry::new(redis, &config.namespace)?);
    let log = EventLog::new(redis, &config.namespace).context("bad Redis URL for the KV event log")?;
    let grpc_listener = TcpListener::bind(config.grpc_addr).await.with_context(|| format!("cannot bind gRPC on {}", config.grpc_addr))?;
    let admin_listener = TcpListener::bind(config.admin_addr).await.with_context(|| format!("cannot bind admin on {}", config.admin_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let index = Arc::new(KvIndex::new());
    let counters = Arc::new(ReplicaCounters::default());
    let start = start_from_snapshot(&log, &index).await;
    if start != "0-0" {
        *counters.started_from_snapshot.lock() = start.clone();
    }
    let status = Arc::new(FollowerStatus::default());
    let endpoints: Endpoints = Arc::default();
    // Know the workers' endpoints before the first gap needs a dump.
    if let Ok(workers) = registry.list().await {
        *endpoints.write() = workers.into_iter().map(|w| (w.record.worker_id, w.record.endpoint)).collect();
    }
    let fetch = {
        let endpoints = endpoints.clone();
        grpc_dump_fetcher(move |worker_id| endpoints.read().get(worker_id).cloned())
    };
    let follower = follow_from(index.clone(), &log, start, fetch, status.clone(), shutdown.clone());
    let metrics = turbine_kv_log::export_metrics("kv-index", index.clone(), status.clone(), shutdown.clone());
    let sweeper = sweep_expired(index.clone(), registry.clone(), endpoints, &config, counters.clone(), shutdown.clone());
    let snapshots = (config.snapshot_interval_secs > 0.0).then(|| {
        let interval = Duration::from_secs_f64(config.snapshot_interval_secs);
        write_snapshots(index.clone(), log.clone(), status.clone(), counters.clone(), interval, shutdown.clone())
    });

    let (readiness, health) = Readiness::new(&[service_names::KV_INDEX]).await;
    let service = KvIndexService::new(index, log, status, counters);
    let server = KvIndexServer::new(service).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES);
    let routes = base_routes(health, &[FILE_DESCRIPTOR_SET]).add_service(server);
    let grace = Duration::from_secs_f64(config.shutdown_grace_secs);
    let grpc_task = tokio::spawn(serve_grpc(grpc_listener, routes, shutdown.clone(), grace));
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(admin_listener, readiness.clone(), admin_stop.clone()));
    readiness
        .watch_dependencies(Duration::from_secs(1), shutdown.clone(), move || {
            let registry = registry.clone();
            async move { registry.ping().await.is_ok() }
        })
        .await;
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, namespace = config.namespace, "kv-index listening");

    shutdown.cancelled().await;
    readiness.drain().await;
    let served = grpc_task.await.context("gRPC server panicked")?;
    for task in [Some(follower), Some(sweeper), Some(metrics), snapshots].into_iter().flatten() {
        let _ = task.await;
    }
    admin_stop.cancel();
    let _ = admin_task.await;
    served.context("gRPC server failed")?;
    tracing::info!("kv-index stopped");
    Ok(())
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
                let live: FxHashMap<String, String> =
                    workers.into_iter().filter(|w| w.expires_at > now).map(|w| (w.record.worker_id, w.record.endpoint)).collect();
                // A Redis that restarted empty lists nobody until the
                // workers' next renewal: no worker leaves meanwhile.
                if restart.lenient(&registry).await {
                    unregistered.reset();
                } else {
                    for (worker_id, blocks) in unregistered.sweep(&index, |id| live.contains_key(id), now) {
                        counters.workers_expired.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(worker = worker_id, blocks, "worker's registry lease expired; its blocks left the KV index");
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
        let mut last_written = None;
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
            // The position first: the dumps taken after it reflect at least
            // that much of the log.
            let position = status.position();
            if !status.reachable() || position == "0-0" || last_written.as_ref() == Some(&position) {
                continue;
            }
            let started = Instant::now();
            match log.save_snapshot(index.clone(), position.clone(), status.stale_workers()).await {
                Ok(Some(bytes)) => {
                    counters.snapshots_written.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(position, bytes, took_ms = started.elapsed().as_millis() as u64, "KV index snapshot written");
                    last_written = Some(position);
                }
                Ok(None) => {
                    tracing::debug!(position, "a newer KV index snapshot is already stored");
                    last_written = Some(position);
                }
                Err(error) => tracing::warn!(%error, "could not write the KV index snapshot"),
            }
        }
    })
}

/// Entry point shared by `turbine-kv-index` and `turbine kv-index`.
pub fn main(args: crate::KvIndexArgs) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-kv-index", move |shutdown| async move {
        let config = args.load()?;
        run(config, shutdown).await
    })
}
