//! Serving a worker in front of an external engine: servers up first
//! (NOT_SERVING), the engine waited for, then SERVING and listed in the
//! registry while the engine answers; unlisted (and NOT_SERVING) while it
//! does not, listed again when it answers again.

use std::sync::Arc;
use std::time::Duration;

use turbine_api::worker::WorkerClient;
use turbine_registry::{Lease, ReadCosts, WorkerRecord, WorkerRole};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::Serving;

use super::{ExternalWorker, unhealthy};
use crate::config::WorkerConfig;
use crate::kv_events::{feed_index, publish_events};
use crate::serve::{KvEventSink, WorkerDeps};
use crate::service::{Loaded, Served};

/// Serves `worker`'s engine until `shutdown`, then drains.
pub async fn serve(
    config: WorkerConfig,
    deps: WorkerDeps,
    mut serving: Serving,
    loaded: Loaded<Arc<dyn Served>>,
    endpoint: String,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let worker = tokio::select! {
        connected = ExternalWorker::connect(&config, &shutdown) => connected?,
        () = shutdown.cancelled() => return serving.until_shutdown(async {}).await,
    };
    loaded.set(worker.clone());
    if let Some(local) = &deps.local {
        local.add_local(worker.id().clone(), WorkerClient::new(worker.clone()));
    }
    serving.spawn(tokio::spawn(worker.clone().watch(shutdown.clone())));
    serving.spawn(tokio::spawn(worker.clone().receive_events(shutdown.clone())));
    match deps.events.clone() {
        KvEventSink::None => {}
        KvEventSink::Log(log) => serving.spawn(publish_events(worker.clone(), log, shutdown.clone())),
        KvEventSink::Index(index) => serving.spawn(feed_index(worker.clone(), index, shutdown.clone())),
    }
    // Listed in the registry while the engine answers.
    let ttl = Duration::from_secs_f64(config.lease_ttl_secs);
    let (listed_tx, listed) = tokio::sync::watch::channel(false);
    let listing = deps.registry.clone().map(|registry| {
        let (worker, endpoint, shutdown) = (worker.clone(), endpoint.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut state = worker.state();
            loop {
                let _ = state.wait_for(|state| state.healthy).await;
                let lease = {
                    let (worker, endpoint) = (worker.clone(), endpoint.clone());
                    Lease::start(registry.clone(), ttl, move || record(&worker, &endpoint))
                };
                let mut registration = lease.registration();
                let relay = async {
                    loop {
                        listed_tx.send_replace(*registration.borrow_and_update());
                        if registration.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                };
                tokio::select! {
                    () = shutdown.cancelled() => {
                        listed_tx.send_replace(false);
                        lease.revoke().await;
                        return;
                    }
                    () = unhealthy(&mut state) => {
                        tracing::warn!(worker = %worker.id(), "leaving the registry while the engine does not answer");
                        listed_tx.send_replace(false);
                        lease.revoke().await;
                    }
                    () = relay => {}
                }
            }
        })
    });
    let with_registry = deps.registry.is_some();
    let probed = worker.clone();
    serving
        .ready_when(Duration::from_secs(1), move || {
            let (healthy, listed) = (probed.state().borrow().healthy, *listed.borrow());
            async move { healthy && (listed || !with_registry) }
        })
        .await;
    tracing::info!(worker = %worker.id(), model = %worker.card().name, %endpoint, "worker ready");
    serving
        .until_shutdown(async {
            // Leave the registry first: no new request is routed here while
            // the ones in flight finish.
            if let Some(listing) = listing {
                let _ = listing.await;
            }
            if let Some(local) = &deps.local {
                local.remove_local(worker.id());
            }
        })
        .await
}

/// The registry record of `worker` with its engine's current load.
fn record(worker: &ExternalWorker, endpoint: &str) -> WorkerRecord {
    WorkerRecord {
        worker_id: worker.id().clone(),
        endpoint: endpoint.to_owned(),
        model: worker.card().name.clone(),
        load: worker.state().borrow().load,
        kv_block_size: worker.card().kv_block_size,
        instance: worker.instance(),
        role: WorkerRole::Aggregated,
        read_costs: ReadCosts::default(),
        kv_store: None,
        shared_cache_only: worker.shared_cache_only(),
        output_formats: worker.output_formats(),
    }
}
