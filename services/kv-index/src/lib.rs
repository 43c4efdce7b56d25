//! The kv-index service: the global KV index behind `turbine.kvindex.v1`.
//!
//! Every replica follows the namespace's KV event log (a Redis stream the
//! workers publish to, see `turbine-kv-log`) into its own
//! [`KvIndex`](turbine_kv::KvIndex), starting from the latest snapshot in
//! Redis; it writes a new snapshot periodically, and drops workers whose
//! registry lease has expired. Replicas never talk to each other: having
//! read the same log, they answer alike.
//!
//! - [`KvIndexService`]: the gRPC shell (PublishEvents, FindMatches, Dump,
//!   RemoveWorker, Stats).
//! - [`serve::run`]: the process: snapshot load, follower, snapshot writer,
//!   lease sweep, servers, health, drain.
//! - [`KvIndexConfig`] / [`KvIndexArgs`]: configuration and flags.

pub mod config;
pub mod serve;
pub mod service;

pub use config::{KvIndexArgs, KvIndexConfig};
pub use service::{KvIndexService, ReplicaCounters};
