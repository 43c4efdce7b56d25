//! Running a router process, and the registry watch shared with embedded
//! mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use turbine_proto::router::v1::{FILE_DESCRIPTOR_SET, router_server::RouterServer};
use turbine_proto::service_names;
use rustc_hash::FxHashSet;
use turbine_kv::{KvIndex, Unregistered};
use turbine_kv_log::{DumpFetcher, EventLog, FollowerStatus, follow_from, grpc_dump_fetcher};
use turbine_registry::{RedisRegistry, Registry, RestartGrace};
use turbine_runtime::grpc::{base_routes, serve as serve_grpc};
use turbine_runtime::health::Readiness;
use turbine_runtime::{CancellationToken, admin};

use crate::config::RouterConfig;
use crate::kv::{KvState, RemoteIndex};
use crate::peers::{PeerLoad, share_load};
use crate::router::Router;
use crate::service::RouterService;

/// A worker in the KV index but not in the registry is dropped after this.
const UNREGISTERED_GRACE: Duration = Duration::from_secs(5);

/// Mirrors the registry into `router` every `interval` until `shutdown`:
/// joins and departures, lease deadlines, stale bookings. While the
/// registry is unreachable the last known workers are kept (their leases
/// cannot be renewed either) and routing goes on.
pub fn watch_registry(router: Arc<Router>, registry: Registry, interval: Duration, shutdown: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reachable = true;
        let mut restart = RestartGrace::new(RestartGrace::DEFAULT);
        let mut unregistered = Unregistered::new(UNREGISTERED_GRACE);
        loop {
            match registry.list().await {
                Ok(workers) => {
                    if !reachable {
                        tracing::info!(registry = %registry.describe(), "registry reachable again");
                        reachable = true;
                    }
                    // Known workers stay until they re-register or their
                    // leases run out.
                    if restart.lenient(&registry).await {
                        router.merge_workers(workers);
                        unregistered.reset();
                    } else {
                        let live: FxHashSet<String> = workers.iter().map(|w| w.record.worker_id.clone()).collect();
                        router.update_workers(workers);
                        // Views of workers the registry does not list (gone
                        // before this router replayed their events) leave the
                        // index after a grace.
                        if let Some(kv) = router.kv() {
                            for (worker_id, blocks) in unregistered.sweep(kv.index(), |id| live.contains(id), Instant::now()) {
                                tracing::info!(worker = worker_id, blocks, "unregistered worker dropped from the KV index");
                            }
                        }
                    }
                }
                Err(error) => {
                    if reachable {
                        tracing::warn!(%error, "registry unreachable; keeping the last known workers");
                        reachable = false;
                    }
                    router.extend_leases(interval * 4);
                }
            }
            router.expire(Instant::now());
            crate::metrics::workers(&router.workers(None));
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
        }
    })
}

/// Runs a router process until `shutdown` fires, then drains and returns.
pub async fn run(config: RouterConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let redis = config.redis.as_deref().context(
        "turbine-router needs the worker registry: pass --redis redis://HOST:PORT/ (or run everything in one process with `turbine run`)",
    )?;
    let registry = Registry::Redis(RedisRegistry::new(redis, &config.namespace)?);
    let grpc_listener = TcpListener::bind(config.grpc_addr).await.with_context(|| format!("cannot bind gRPC on {}", config.grpc_addr))?;
    let admin_listener = TcpListener::bind(config.admin_addr).await.with_context(|| format!("cannot bind admin on {}", config.admin_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let mut kv = KvState::new(config.kv(), Arc::new(KvIndex::new()));
    if let Some(endpoint) = &config.kv_index {
        kv = kv.with_remote(RemoteIndex::connect(endpoint, Duration::from_millis(config.kv_index_timeout_ms)).map_err(anyhow::Error::msg)?);
    }
    // Exact mode without a kv-index: the router's own replica follows the
    // workers' KV event log.
    let events = (!config.kv().approximate && config.kv_index.is_none()).then(|| Arc::new(FollowerStatus::default()));
    if let Some(status) = &events {
        kv = kv.with_event_status(status.clone());
    }
    let kv = Arc::new(kv);
    let router = Arc::new(Router::with_kv(config.policy, Duration::from_secs_f64(config.booking_ttl_secs), kv.clone()).with_disagg(config.disagg()));
    // Know the workers (and their endpoints, for dumps) before following.
    if let Ok(workers) = registry.list().await {
        router.update_workers(workers);
    }
    let follower = match &events {
        Some(status) => {
            let log = EventLog::new(redis, &config.namespace).context("bad Redis URL for the KV event log")?;
            let start = turbine_kv_log::start_from_snapshot(&log, kv.index()).await;
            let metrics = turbine_kv_log::export_metrics("router", kv.index().clone(), status.clone(), shutdown.clone());
            Some([metrics, follow_from(kv.index().clone(), &log, start, dump_fetcher(router.clone()), status.clone(), shutdown.clone())])
        }
        None => None,
    };
    let (readiness, health) = Readiness::new(&[service_names::ROUTER]).await;
    let routes = base_routes(health, &[FILE_DESCRIPTOR_SET]).add_service(RouterServer::new(RouterService::new(router.clone())));
    let grace = Duration::from_secs_f64(config.shutdown_grace_secs);
    let grpc_task = tokio::spawn(serve_grpc(grpc_listener, routes, shutdown.clone(), grace));
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(admin_listener, readiness.clone(), admin_stop.clone()));
    let interval = Duration::from_millis(config.poll_interval_ms);
    let watch = watch_registry(router.clone(), registry.clone(), interval, shutdown.clone());
    // Other replicas' bookings count in this one's decisions.
    let router_id = format!("{:016x}", rand::random::<u64>());
    let peers = PeerLoad::new(redis, &config.namespace, &router_id).context("bad Redis URL for sharing load")?;
    let sharing = share_load(router.clone(), peers, shutdown.clone());
    readiness.watch_dependencies(Duration::from_secs(1), shutdown.clone(), move || {
        let registry = registry.clone();
        async move { registry.ping().await.is_ok() }
    })
    .await;
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, policy = config.policy.name(), "router listening");

    shutdown.cancelled().await;
    readiness.drain().await;
    let served = grpc_task.await.context("gRPC server panicked")?;
    let _ = watch.await;
    let _ = sharing.await;
    for task in follower.into_iter().flatten() {
        let _ = task.await;
    }
    admin_stop.cancel();
    let _ = admin_task.await;
    served.context("gRPC server failed")?;
    tracing::info!("router stopped");
    Ok(())
}

/// Fetches a worker's KV cache dump over its gRPC endpoint (as the
/// registry gives it) for the event-log follower.
pub fn dump_fetcher(router: Arc<Router>) -> DumpFetcher {
    grpc_dump_fetcher(move |worker_id| router.workers(None).into_iter().find(|w| w.worker_id == worker_id).map(|w| w.endpoint))
}

/// Entry point shared by `turbine-router` and `turbine router`.
pub fn main(args: crate::RouterArgs) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-router", move |shutdown| async move {
        let config = args.load()?;
        run(config, shutdown).await
    })
}
