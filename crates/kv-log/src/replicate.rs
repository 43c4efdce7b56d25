//! [`replicate`]: how every replica of the index (a router's own, the
//! kv-index service's) starts following the log.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turbine_api::worker::WorkerClients;
use turbine_kv::KvIndex;

use crate::{DumpFetcher, EventLog, FollowerStatus, LogPosition, dump_fetcher, export_metrics, follow_from, start_from_snapshot, with_store_dumps};

/// A replica following the log: where it started and its tasks (the
/// follower and its metrics), to run until shutdown.
#[derive(Debug)]
pub struct Replicating {
    /// The snapshot's position it started after, or [`LogPosition::START`].
    pub start: LogPosition,
    /// The follower and the metrics exporter.
    pub tasks: [JoinHandle<()>; 2],
}

/// Loads the newest snapshot into `index`, follows the log from there
/// (a gap answered by `fetch`'s dumps) and exports the follower's metrics
/// under `component`.
pub async fn replicate(
    component: &'static str,
    index: Arc<KvIndex>,
    log: &EventLog,
    fetch: DumpFetcher,
    status: Arc<FollowerStatus>,
    shutdown: CancellationToken,
) -> Replicating {
    let start = start_from_snapshot(log, &index).await;
    let metrics = export_metrics(component, index.clone(), status.clone(), shutdown.clone());
    let follower = follow_from(index, log, start, fetch, status, shutdown);
    Replicating { start, tasks: [follower, metrics] }
}

/// The dumps a replica asks for on a gap: a worker's from the worker at
/// the endpoint `worker_endpoint` gives, a kv-store's (named
/// [`WorkerId::of_store`](turbine_kv::WorkerId::of_store)) from the store
/// at the endpoint `store_endpoint` gives.
pub fn dumps_from(
    workers: WorkerClients,
    worker_endpoint: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    store_endpoint: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> DumpFetcher {
    with_store_dumps(dump_fetcher(workers, worker_endpoint), store_endpoint)
}
