//! The KV event log.
//!
//! Workers publish their numbered KV events in batches
//! (`turbine.kvindex.v1.EventBatch`, protobuf) to one Redis stream per
//! namespace, `turbine:<namespace>:kv:events`, field `b`. Every consumer of
//! the index (a router's replica, the kv-index service) runs a [`follow`]
//! task that reads the stream in order and applies the events to its
//! [`KvIndex`](turbine_kv::KvIndex); on a gap in a worker's numbering (the
//! stream was trimmed, a publish failed) or an unknown incarnation it asks
//! the worker for a dump of its cache and continues from there. Every
//! replica that has read the same stream entries holds the same index.

pub mod convert;
mod follower;
mod log;

pub use follower::{DumpFetcher, FollowerStatus, follow};
pub use log::{EventLog, EventReader};
