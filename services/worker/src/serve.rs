//! Serving a worker: servers up first (NOT_SERVING), model loaded,
//! registered under a lease, SERVING; on shutdown: NOT_SERVING,
//! deregistered, in-flight streams drained, engine stopped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use turbine_api::kv_store::KvStoreClient;

use anyhow::Context;
use turbine_api::worker::{WorkerClient, WorkerClients};
use turbine_kv::{KvIndex, UcxKeys, UcxNetwork};
use turbine_kv_log::EventLog;
use turbine_proto::service_names;
use turbine_proto::worker::v1::{FILE_DESCRIPTOR_SET, kv_transfer_server::KvTransferServer, worker_server::WorkerServer};
use turbine_registry::{Lease, ReadCost, ReadCosts, RedisRegistry, Registry, WorkerRecord};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Host, HostSpec, Listeners, Role, RpcRoles};

use crate::config::{EngineKind, WorkerConfig};
use crate::kv_events::{feed_index, publish_events};
use crate::metrics::register_engine;
use crate::service::{KvTransferService, Loaded, Served, WorkerService};
use crate::worker::Worker;

/// Where a worker's KV events go.
#[derive(Debug, Clone, Default)]
#[allow(clippy::large_enum_variant, reason = "one value per process, built at startup")]
pub enum KvEventSink {
    /// Nowhere (no router follows this worker's cache).
    #[default]
    None,
    /// The namespace's event log in Redis, for every router and kv-index.
    Log(EventLog),
    /// Straight into an index in this process.
    Index(Arc<KvIndex>),
}

/// What a worker needs besides its configuration.
#[derive(Debug, Clone, Default)]
pub struct WorkerDeps {
    /// The registry it joins (none: it is reached directly).
    pub registry: Option<Registry>,
    /// Where its KV events go.
    pub events: KvEventSink,
    /// The clients of this process's workers: once loaded, the worker adds
    /// itself, so callers in this process skip gRPC.
    pub local: Option<WorkerClients>,
    /// The kv-store of this process, called directly (`--kv-store` still
    /// names its endpoint, which the worker advertises to its peers).
    pub kv_store: Option<KvStoreClient>,
}

impl WorkerDeps {
    /// A standalone worker's: with `--redis`, the Redis registry and event
    /// log of the namespace.
    pub fn from_config(config: &WorkerConfig) -> anyhow::Result<Self> {
        let Some(url) = &config.cluster.redis else {
            return Ok(Self::default());
        };
        Ok(Self {
            registry: Some(Registry::Redis(RedisRegistry::new(url, &config.cluster.namespace)?)),
            events: KvEventSink::Log(EventLog::new(url, &config.cluster.namespace).context("bad Redis URL for the KV event log")?),
            local: None,
            kv_store: None,
        })
    }
}

/// The host's view of a worker.
const SPEC: HostSpec = HostSpec {
    name: "worker",
    health: &[service_names::WORKER],
    descriptors: &[FILE_DESCRIPTOR_SET],
    // A prefill is a unary call as long as the prompt's compute (and its
    // wait in the queue).
    handler_timeout: Duration::from_secs(600),
    roles: ROLES,
};

/// Who may call each rpc (enforced when the worker serves mutual TLS).
/// Generation and prefill come from gateways only, and the KV a request
/// left is read by the decode worker it was handed to (and released by
/// it or the gateway): no operator reads a request's KV. The index and
/// routers rebuild from a worker's dump.
pub const ROLES: &[RpcRoles] = &[
    RpcRoles { method: "/turbine.worker.v1.Worker/Generate", roles: &[Role::Gateway] },
    RpcRoles { method: "/turbine.worker.v1.Worker/Prefill", roles: &[Role::Gateway] },
    RpcRoles { method: "/turbine.worker.v1.Worker/Load", roles: &[Role::Router, Role::Planner, Role::Operator, Role::Monitoring] },
    RpcRoles { method: "/turbine.worker.v1.Worker/GetModelCard", roles: &[Role::Gateway, Role::Router, Role::Operator] },
    RpcRoles { method: "/turbine.worker.v1.Worker/DumpKvCache", roles: &[Role::Router, Role::Index, Role::Operator] },
    RpcRoles { method: "/turbine.worker.v1.KvTransfer/Describe", roles: &[Role::Worker] },
    RpcRoles { method: "/turbine.worker.v1.KvTransfer/ReadBlocks", roles: &[Role::Worker] },
    RpcRoles { method: "/turbine.worker.v1.KvTransfer/Release", roles: &[Role::Worker, Role::Gateway] },
];

/// Serves a worker on `listeners` until `shutdown` fires, then drains.
pub async fn serve(config: WorkerConfig, deps: WorkerDeps, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let bound = listeners.grpc.local_addr()?;
    let endpoint = advertised_endpoint(config.advertise.as_deref(), bound);
    let (host_tls, endpoint_ip) = (config.server.tls.tls_cert.is_some(), bound.ip());
    let (loaded, pool) = (Loaded::<Arc<dyn Served>>::default(), Loaded::default());
    let mut host = Host::new(SPEC, &config.server, listeners).await?;
    host.add_service(WorkerServer::new(WorkerService::new(loaded.clone())));
    if config.engine.engine == EngineKind::External {
        // The engine's blocks are not on Turbine's transfer plane.
        host.add_service(KvTransferServer::new(KvTransferService::refusing(
            "this worker fronts an external engine: its KV blocks are the engine's own, not on Turbine's transfer plane",
        )));
        let serving = host.start(shutdown.clone())?;
        tracing::info!(%endpoint, upstream = ?config.engine.upstream, "waiting for the engine");
        return crate::external::serve::serve(config, deps, serving, loaded, endpoint, shutdown).await;
    }
    host.add_service(KvTransferServer::new(KvTransferService::new(pool.clone())));
    let mut serving = host.start(shutdown.clone())?;
    tracing::info!(%endpoint, "loading the model");

    // UCX reaches no further than this gRPC port (see UcxNetwork).
    let ucx = UcxNetwork::for_service(config.transfer.kv_ucx_devices.as_deref(), host_tls, endpoint_ip);
    // Under certificates, a handle's holder gets keys of its blocks only.
    let keys = UcxKeys::for_service(&ucx, host_tls);
    if host_tls && config.transfer.kv_ucx_devices.is_some() {
        tracing::warn!(
            devices = ?config.transfer.kv_ucx_devices,
            "UCX checks no certificate: over TCP any host that reaches these devices may read and write this worker's memory; on RDMA only a handle's blocks, through keys revoked at its release"
        );
    }
    let loading = tokio::task::spawn_blocking({
        let (config, kv_store) = (config.clone(), deps.kv_store.clone());
        move || Worker::start(&config, kv_store, &ucx, keys)
    });
    let worker = tokio::select! {
        loaded = loading => loaded.context("model loading panicked")??,
        () = shutdown.cancelled() => return serving.until_shutdown(async {}).await,
    };
    worker.disagg().set_endpoint(endpoint.clone());
    pool.set(worker.disagg().clone());
    loaded.set(worker.clone() as Arc<dyn Served>);
    let _metrics = register_engine(worker.id(), worker.engine().clone());
    if let Some(local) = &deps.local {
        local.add_local(worker.id().clone(), WorkerClient::new(worker.clone()));
    }
    let lease = deps.registry.clone().map(|registry| {
        let (worker, endpoint) = (worker.clone(), endpoint.clone());
        Lease::start(registry, Duration::from_secs_f64(config.lease_ttl_secs), move || worker_record(&worker, &endpoint))
    });
    serving.spawn(tokio::spawn(worker.clone().learn_kv_store_name(shutdown.clone())));
    match deps.events {
        KvEventSink::None => {}
        KvEventSink::Log(log) => serving.spawn(publish_events(worker.clone(), log, shutdown.clone())),
        KvEventSink::Index(index) => serving.spawn(feed_index(worker.clone(), index, shutdown.clone())),
    }
    // Ready once the registry answers and this worker is listed in it (the
    // lease's first put is its own task's): whoever waits for SERVING then
    // finds the worker listed too.
    let registry = deps.registry.clone();
    let registered = lease.as_ref().map(Lease::registration);
    serving
        .ready_when(Duration::from_secs(1), move || {
            let (registry, registered) = (registry.clone(), registered.clone());
            async move {
                let Some(registry) = &registry else { return true };
                let listed = async {
                    match registered {
                        Some(mut registered) => {
                            tokio::time::timeout(Duration::from_secs(1), registered.wait_for(|listed| *listed)).await.is_ok_and(|listed| listed.is_ok())
                        }
                        None => true,
                    }
                };
                registry.ping().await.is_ok() && listed.await
            }
        })
        .await;
    tracing::info!(worker = %worker.id(), model = %worker.card().name, %endpoint, "worker ready");

    let served = serving
        .until_shutdown(async {
            // Leave the registry first: no new request is routed here while
            // the ones in flight finish.
            if let Some(lease) = lease {
                lease.revoke().await;
            }
            if let Some(local) = &deps.local {
                local.remove_local(worker.id());
            }
        })
        .await;
    worker.shutdown();
    served
}

/// Entry point shared by `turbine-worker` and `turbine worker`.
pub fn main(config: WorkerConfig) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-worker", move |shutdown| async move {
        // The identity first: every client made below dials with it.
        config.server.tls.establish()?;
        let listeners = Listeners::bind(&config.server).await?;
        let deps = WorkerDeps::from_config(&config)?;
        serve(config, deps, listeners, shutdown).await
    })
}

/// The registry record of a worker with its current load.
pub fn worker_record(worker: &Worker, endpoint: &str) -> WorkerRecord {
    WorkerRecord {
        worker_id: worker.id().clone(),
        endpoint: endpoint.to_owned(),
        model: worker.card().name.clone(),
        load: worker.load(),
        kv_block_size: worker.block_size() as u32,
        instance: worker.instance(),
        role: worker.role(),
        read_costs: worker.engine().fetch_estimates().map_or_else(ReadCosts::default, |estimates| read_costs(&estimates, worker.block_size())),
        kv_store: worker.kv_store_ref(),
        shared_cache_only: false,
        output_formats: worker.output_formats(),
    }
}

/// The engine's measured read costs in blocks of its measured compute (the
/// marginal cost of one more block of prompt), as routers credit them.
fn read_costs(estimates: &turbine_engine::FetchEstimates, block_size: usize) -> ReadCosts {
    let Some(compute_block) = estimates.token_seconds.map(|token| token * block_size as f64).filter(|&seconds| seconds > 0.0) else {
        return ReadCosts::default();
    };
    let tier = |tier: &turbine_engine::tiers::fetch::TierEstimate| {
        Some(ReadCost { fixed_blocks: (tier.fixed_seconds? / compute_block) as f32, per_block: (tier.block_seconds? / compute_block) as f32 })
    };
    ReadCosts { host: tier(&estimates.host), disk: tier(&estimates.disk), remote: tier(&estimates.remote) }
}

/// The endpoint other services should use to reach a server bound at `bound`.
pub fn advertised_endpoint(configured: Option<&str>, bound: SocketAddr) -> String {
    if let Some(endpoint) = configured {
        return turbine_runtime::grpc::endpoint_uri(endpoint);
    }
    if bound.ip().is_unspecified() { format!("http://{}:{}", hostname(), bound.port()) } else { format!("http://{bound}") }
}

fn hostname() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own
    // and NUL-terminates on success; we read only up to the first NUL.
    #[allow(unsafe_code)]
    let result = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if result != 0 {
        return "localhost".to_owned();
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_rpc_has_one_row_naming_who_may_call_it() {
        super::SPEC.check_roles(&[turbine_proto::service_names::WORKER, turbine_proto::service_names::KV_TRANSFER]).unwrap();
    }

    use turbine_engine::FetchEstimates;
    use turbine_engine::tiers::fetch::TierEstimate;

    use super::*;

    #[test]
    fn read_costs_are_in_blocks_of_compute() {
        // 1 ms a token, 16-token blocks: 16 ms a block of compute.
        let estimates = FetchEstimates {
            token_seconds: Some(0.001),
            step_seconds: Some(0.01),
            host: TierEstimate { fixed_seconds: Some(0.0), block_seconds: Some(0.00016), ..TierEstimate::default() },
            disk: TierEstimate { fixed_seconds: Some(0.008), block_seconds: Some(0.004), ..TierEstimate::default() },
            ..FetchEstimates::default()
        };
        let costs = read_costs(&estimates, 16);
        assert_eq!(costs.host, Some(ReadCost { fixed_blocks: 0.0, per_block: 0.01 }));
        assert_eq!(costs.disk, Some(ReadCost { fixed_blocks: 0.5, per_block: 0.25 }));
        assert_eq!(costs.remote, None, "not measured");
        assert!(read_costs(&FetchEstimates::default(), 16).is_unmeasured(), "compute not measured: nothing to compare with");
    }
}
