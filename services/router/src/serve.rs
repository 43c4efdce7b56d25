//! Serving a router, and the registry watch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rustc_hash::FxHashSet;
use tokio::task::JoinHandle;
use turbine_api::kv_index::KvIndexClient;
use turbine_api::worker::WorkerClients;
use turbine_kv::{KvIndex, Unregistered, WorkerId};
use turbine_kv_log::{EventLog, FollowerStatus, dumps_from, replicate};
use turbine_proto::router::v1::{FILE_DESCRIPTOR_SET, router_server::RouterServer};
use turbine_proto::service_names;
use turbine_registry::{RedisRegistry, Registry, RestartGrace};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Host, HostSpec, Listeners, Role, RpcRoles, Running};

use crate::config::RouterConfig;
use crate::kv::KvState;
use crate::peers::{PeerLoad, share_load};
use crate::router::Router;
use crate::service::RouterService;

/// A worker in the KV index but not in the registry is dropped after this.
const UNREGISTERED_GRACE: Duration = Duration::from_secs(5);

/// Where a router's `kv` decisions look blocks up.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant, reason = "one value per process, built at startup")]
pub enum IndexSource {
    /// A replica of its own, following the namespace's event log.
    Log(EventLog),
    /// An index fed by the workers of this process (the embedded cluster).
    Shared(Arc<KvIndex>),
    /// A kv-index service.
    Service(KvIndexClient),
    /// Its own decisions (approximate mode, engines without KV events).
    Approximate,
}

/// What a router needs besides its configuration.
#[derive(Debug, Clone)]
pub struct RouterDeps {
    /// The worker registry.
    pub registry: Registry,
    /// Where `kv` decisions look blocks up.
    pub index: IndexSource,
    /// The load the other router replicas booked (none: this one is alone).
    pub peers: Option<PeerLoad>,
    /// How to reach workers for their dumps.
    pub workers: WorkerClients,
}

impl RouterDeps {
    /// A standalone router's: the registry, the event log or kv-index, and
    /// the load exchange, all through Redis.
    pub fn from_config(config: &RouterConfig) -> anyhow::Result<Self> {
        let redis = config
            .cluster
            .redis
            .as_deref()
            .context("turbine-router needs the worker registry: pass --redis redis://HOST:PORT/ (or run everything in one process with `turbine run`)")?;
        let namespace = &config.cluster.namespace;
        let kv = &config.routing.kv;
        let index = match &kv.index {
            Some(endpoint) => IndexSource::Service(KvIndexClient::connect(endpoint)?),
            None if kv.approximate => IndexSource::Approximate,
            None => IndexSource::Log(EventLog::new(redis, namespace).context("bad Redis URL for the KV event log")?),
        };
        let router_id = format!("{:016x}", rand::random::<u64>());
        Ok(Self {
            registry: Registry::Redis(RedisRegistry::new(redis, namespace)?),
            index,
            peers: Some(PeerLoad::new(redis, namespace, &router_id).context("bad Redis URL for sharing load")?),
            workers: WorkerClients::default(),
        })
    }
}

const SPEC: HostSpec =
    HostSpec { name: "router", health: &[service_names::ROUTER], descriptors: &[FILE_DESCRIPTOR_SET], handler_timeout: Duration::from_secs(30), roles: ROLES };

/// Who may call each rpc (enforced when the router serves mutual TLS):
/// gateways route and book; operators and scrapers may list the workers.
pub const ROLES: &[RpcRoles] = &[
    RpcRoles { method: "/turbine.router.v1.Router/Route", roles: &[Role::Gateway] },
    RpcRoles { method: "/turbine.router.v1.Router/RequestFinished", roles: &[Role::Gateway] },
    RpcRoles { method: "/turbine.router.v1.Router/PrefillDone", roles: &[Role::Gateway] },
    RpcRoles { method: "/turbine.router.v1.Router/ListWorkers", roles: &[Role::Gateway, Role::Operator, Role::Monitoring] },
];

/// Serves a router on `listeners` until `shutdown` fires, then drains.
pub async fn serve(config: RouterConfig, deps: RouterDeps, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    start(config, deps, listeners, shutdown).await?.finished().await
}

/// [`serve`] in the background; the router itself is handed out for
/// callers in this process.
pub async fn start(config: RouterConfig, deps: RouterDeps, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<Running<Arc<Router>>> {
    let RouterDeps { registry, index, peers, workers } = deps;
    let kv_config = config.routing.kv.clone();
    let (kv, log) = match index {
        IndexSource::Service(client) => (KvState::remote(kv_config, client), None),
        IndexSource::Shared(index) => (KvState::local(kv_config, index, None), None),
        IndexSource::Approximate => (KvState::local(kv_config, Arc::new(KvIndex::new()), None), None),
        IndexSource::Log(log) => {
            let (index, status) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()));
            (KvState::local(kv_config, index.clone(), Some(status.clone())), Some((log, index, status)))
        }
    };
    let router =
        Arc::new(Router::with_kv(config.routing.policy, Duration::from_secs_f64(config.booking_ttl_secs), Arc::new(kv)).with_disagg(config.routing.disagg()));
    // Know the workers (and their endpoints, for dumps) before following.
    if let Ok(listed) = registry.list().await {
        router.update_workers(listed);
    }
    let mut tasks = Vec::new();
    if let Some((log, index, status)) = log {
        let (endpoints, stores) = (router.clone(), router.clone());
        // kv-stores' names too, at the endpoints their readers name.
        let fetch = dumps_from(
            workers,
            move |worker_id| endpoints.workers(None).into_iter().find(|w| w.worker_id == worker_id).map(|w| w.endpoint),
            move |name| stores.store_endpoint(name),
        );
        tasks.extend(replicate("router", index, &log, fetch, status, shutdown.clone()).await.tasks);
    }
    tasks.push(watch_registry(router.clone(), registry.clone(), Duration::from_millis(config.poll_interval_ms), shutdown.clone()));
    if let Some(peers) = peers {
        // Other replicas' bookings count in this one's decisions.
        tasks.push(share_load(router.clone(), peers, shutdown.clone()));
    }
    let mut host = Host::new(SPEC, &config.server, listeners).await?;
    host.add_service(RouterServer::new(RouterService::new(router.clone())));
    let mut serving = host.start(shutdown)?;
    for task in tasks {
        serving.spawn(task);
    }
    serving
        .ready_when(Duration::from_secs(1), move || {
            let registry = registry.clone();
            async move { registry.ping().await.is_ok() }
        })
        .await;
    tracing::info!(policy = config.routing.policy.name(), "router ready");
    Ok(Running::spawn(router, serving.until_shutdown(async {})))
}

/// Entry point shared by `turbine-router` and `turbine router`.
pub fn main(config: RouterConfig) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-router", move |shutdown| async move {
        // The identity first: every client made below dials with it.
        config.server.tls.establish()?;
        let deps = RouterDeps::from_config(&config)?;
        let listeners = Listeners::bind(&config.server).await?;
        serve(config, deps, listeners, shutdown).await
    })
}

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
                        // Every worker, and every kv-store a worker reads.
                        let live: FxHashSet<WorkerId> = workers
                            .iter()
                            .flat_map(|w| std::iter::once(w.record.worker_id.clone()).chain(w.record.kv_store.as_ref().map(|store| store.name.clone())))
                            .collect();
                        router.update_workers(workers);
                        // Views of workers the registry does not list (gone
                        // before this router replayed their events) leave the
                        // index after a grace.
                        if let Some(replica) = router.kv().and_then(|kv| kv.replica()) {
                            for (worker_id, blocks) in unregistered.sweep(replica, |id| live.contains(id), Instant::now()) {
                                tracing::info!(worker = %worker_id, blocks, "unregistered worker dropped from the KV index");
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
            let workers = router.workers(None);
            crate::metrics::workers(workers.iter().map(|w| (w.model.as_str(), w.worker_id.as_str(), w.in_flight)));
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
        }
    })
}

#[cfg(test)]
mod role_table {
    #[test]
    fn every_rpc_has_one_row_naming_who_may_call_it() {
        super::SPEC.check_roles(&[turbine_proto::service_names::ROUTER]).unwrap();
    }
}
