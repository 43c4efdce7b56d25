//! The KV event log.
//!
//! Workers publish their numbered KV events in batches
//! ([`EventBatch`](turbine_kv::EventBatch), as `turbine.kvindex.v1.EventBatch`
//! protobuf) to one Redis stream per
//! namespace, `turbine:<namespace>:kv:events`, field `b`. Every consumer of
//! the index (a router's replica, the kv-index service) runs a [`follow`]
//! task that reads the stream in order and applies the events to its
//! [`KvIndex`](turbine_kv::KvIndex); on a gap in a worker's numbering (the
//! stream was trimmed, a publish failed) or an unknown incarnation it asks
//! the worker for a dump of its cache and continues from there. Every
//! replica that has read the same stream entries holds the same index.
//!
//! Snapshots (`turbine:<namespace>:kv:snapshot`, an `IndexSnapshot`) hold
//! the whole index at one stream position: a starting replica loads the
//! latest one and follows the stream from there.

mod follower;
mod log;
mod metrics;

mod publish;
mod replica;
mod replicate;
mod snapshot;

pub use follower::{DumpFetcher, FollowerStatus, dump_fetcher, follow, follow_from, with_store_dumps};
pub use log::{EventLog, EventReader, LogEntry, sealed_bytes};
pub use metrics::export_metrics;
pub use publish::{Publisher, publish_all};
pub use replica::{LocalKvIndex, MAX_PUBLISH_BATCHES, ReplicaCounters};
pub use replicate::{Replicating, dumps_from, replicate};
pub use snapshot::{LoadedSnapshot, start_from_snapshot};
pub use turbine_api::kv_index::{BadPosition, LogPosition};

use turbine_kv::WorkerId;
use turbine_runtime::host::Role;
use turbine_runtime::trust::Peer;

/// Whether `peer` may publish KV events in the name of `writer`: a worker
/// only under the worker id its certificate names, a kv-store only under
/// its own store names (`store:<its name>/...`, [`WorkerId::of_store`]);
/// no other role.
pub fn may_publish_for(peer: &Peer, writer: &WorkerId) -> bool {
    match (peer.role, writer.store_part()) {
        (Role::Worker, None) => peer.is_worker(writer.as_str()),
        (Role::KvStore, Some((store, _))) => store == peer.name,
        _ => false,
    }
}
