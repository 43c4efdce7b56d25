//! The kv-index service: the global KV index behind `turbine.kvindex.v1`,
//! and the client every other service uses to ask an index.
//!
//! Every replica follows the namespace's KV event log (a Redis stream the
//! workers publish to, see `turbine-kv-log`) into its own
//! [`KvIndex`](turbine_kv::KvIndex), starting from the latest snapshot in
//! Redis; it writes a new snapshot periodically, and drops workers whose
//! registry lease has expired. Replicas never talk to each other: having
//! read the same log, they answer alike.
//!
//! - [`KvIndexClient`] over a [`KvIndexApi`]: a replica in this process
//!   ([`LocalKvIndex`]) or the service ([`GrpcKvIndex`]); callers never
//!   know which.
//! - [`KvIndexService`]: the gRPC shell over a [`LocalKvIndex`].
//! - [`serve()`]: the replica on the service host: snapshot load, follower,
//!   snapshot writer, lease sweep, health, drain.
//! - [`KvIndexConfig`]: configuration and flags.

pub mod api;
pub mod config;
pub mod local;
pub mod serve;
pub mod service;

pub use api::{GrpcKvIndex, IndexStats, KvIndexApi, KvIndexClient, KvIndexError, MatchAnswer, MatchQuery};
pub use config::KvIndexConfig;
pub use local::{LocalKvIndex, ReplicaCounters};
pub use serve::{IndexFeed, KvIndexDeps, main, serve};
pub use service::KvIndexService;
