//! Serving the store on the service host.

use std::time::Duration;

use turbine_proto::kvstore::v1::{FILE_DESCRIPTOR_SET, kv_store_server::KvStoreServer};
use turbine_proto::service_names;
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Host, HostSpec, Listeners, Role, RpcRoles};

use anyhow::Context;

use crate::config::KvStoreConfig;
use crate::disk::DiskBlocks;
use crate::events::StoreEventSink;
use crate::local::LocalKvStore;
use crate::service::KvStoreService;
use crate::store::Store;
use turbine_kv::UcxNetwork;
use turbine_kv_log::EventLog;

/// Who may call each rpc of `turbine.kvstore.v1.KvStore`.
pub const ROLES: &[RpcRoles] = &[
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Put", roles: &[Role::Worker] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Get", roles: &[Role::Worker] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Lookup", roles: &[Role::Worker, Role::Router] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Delete", roles: &[Role::Operator] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Stats", roles: &[Role::Operator, Role::Monitoring, Role::Planner] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Dump", roles: &[Role::Router, Role::Index, Role::Operator] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Lease", roles: &[Role::Worker] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/PutFrom", roles: &[Role::Worker] },
    RpcRoles { method: "/turbine.kvstore.v1.KvStore/Release", roles: &[Role::Worker] },
];

const SPEC: HostSpec = HostSpec {
    name: "kv-store",
    health: &[service_names::KV_STORE],
    descriptors: &[FILE_DESCRIPTOR_SET],
    handler_timeout: Duration::from_secs(30),
    roles: ROLES,
};

/// Serves `store` on `listeners` until `shutdown` fires, then drains;
/// announces what it holds to `events`.
pub async fn serve(config: KvStoreConfig, store: Store, events: StoreEventSink, listeners: Listeners, shutdown: CancellationToken) -> anyhow::Result<()> {
    let mut host = Host::new(SPEC, &config.server, listeners).await?;
    let _metrics = crate::metrics::register(store.clone());
    let announcing = crate::events::announce(store.announcer().clone(), &config.store_id, events, shutdown.clone());
    let service = KvStoreService::over(LocalKvStore::configured(store.clone(), &config, announcing.is_some()));
    host.add_service(KvStoreServer::new(service));
    let mut serving = host.start(shutdown)?;
    if let Some(task) = announcing {
        serving.spawn(task);
    }
    // Nothing to wait for: the store is in this process.
    serving.ready_when(Duration::from_secs(1), || async { true }).await;
    serving.until_shutdown(async {}).await
}

/// Entry point shared by `turbine-kv-store` and `turbine kv-store`.
pub fn main(config: KvStoreConfig) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-kv-store", move |shutdown| async move {
        // The identity first: every client made below dials with it.
        config.server.tls.establish()?;
        let memory_bytes = config.memory_mib << 20;
        let tls = config.server.tls.tls_cert.is_some();
        let ucx = config.ucx.then(|| {
            let network = UcxNetwork::for_service(config.ucx_devices.as_deref(), tls, config.server.grpc_addr.ip());
            // Under certificates a lease's holder gets keys of its segments only.
            let keys = turbine_kv::UcxKeys::for_service(&network, tls);
            (network, keys)
        });
        let store = match &config.disk_dir {
            None => Store::open(memory_bytes, None, ucx),
            Some(dir) => {
                let (dir, capacity) = (dir.clone(), config.disk_gib << 30);
                // Rebuilding the index reads every block file's header.
                let disk = tokio::task::spawn_blocking(move || DiskBlocks::open(&dir, capacity))
                    .await?
                    .with_context(|| format!("cannot open the disk tier in {}", config.disk_dir.as_ref().expect("set").display()))?;
                Store::open(memory_bytes, Some(disk), ucx)
            }
        };
        let events = match &config.cluster.redis {
            Some(url) => StoreEventSink::Log(EventLog::new(url, &config.cluster.namespace).context("bad Redis URL for the KV event log")?),
            None => StoreEventSink::None,
        };
        let listeners = Listeners::bind(&config.server).await?;
        tracing::info!(memory_mib = config.memory_mib, disk_dir = ?config.disk_dir, disk_gib = config.disk_gib, store_id = config.store_id, announcing = config.cluster.redis.is_some(), ucx = store.data_path().is_some(), "kv-store listening");
        serve(config, store, events, listeners, shutdown).await
    })
}

#[cfg(test)]
mod role_table {
    #[test]
    fn every_rpc_has_one_row_naming_who_may_call_it() {
        super::SPEC.check_roles(&[turbine_proto::service_names::KV_STORE]).unwrap();
    }
}
