//! The kv-index service: the global KV index behind `turbine.kvindex.v1`
//! (the client every other service uses to ask an index, and its words,
//! are `turbine_api::kv_index`; a replica, `turbine_kv_log::LocalKvIndex`).
//!
//! Every replica follows the namespace's KV event log (a Redis stream the
//! workers publish to, see `turbine-kv-log`) into its own
//! [`KvIndex`](turbine_kv::KvIndex), starting from the latest snapshot in
//! Redis; it writes a new snapshot periodically, and drops workers whose
//! registry lease has expired. Replicas never talk to each other: having
//! read the same log, they answer alike.
//!
//! - [`KvIndexService`]: the gRPC shell over a replica
//!   (`turbine_kv_log::LocalKvIndex`, which callers in one process call
//!   directly through `turbine_api::kv_index::KvIndexClient`).
//! - [`serve()`]: the replica on the service host: snapshot load, follower,
//!   snapshot writer, lease sweep, health, drain.
//! - [`KvIndexConfig`]: configuration and flags.

pub mod config;
pub mod serve;
pub mod service;

pub use config::KvIndexConfig;
pub use serve::{IndexFeed, KvIndexDeps, main, serve};
pub use service::KvIndexService;
