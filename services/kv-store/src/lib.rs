//! The kv-store service: a shared store of KV blocks (the G4 tier) behind
//! `turbine.kvstore.v1` (its client and words are `turbine_api::kv_store`).
//!
//! A block is keyed by (layout fingerprint, sequence hash), so blocks of
//! different models or KV layouts never mix, and carries the XXH3-64 of its
//! bytes, checked when it arrives and again before it is served.
//!
//! - [`keys`]: what a block is keyed by ([`Fingerprint`], [`BlockKey`])
//!   and why blocks are refused ([`StoreError`]); [`wire`]: the contract's
//!   blocks to and from the store's types, and its limits.
//! - [`Store`]: the blocks in memory, bounded in bytes, least recently used
//!   evicted first, written through to a disk tier ([`DiskBlocks`]) that
//!   survives a restart.
//! - [`fair`]: each tenant's fair share of the memory tier: a tenant above
//!   its share makes room from its own blocks, so one tenant's flood does
//!   not evict another's working set.
//! - [`Arena`]: the memory tier's bytes, one allocation cut into equal
//!   segments, so that remote readers can be given the whole tier as one
//!   region.
//! - [`Announcer`]: what the store holds, as numbered KV events (tier
//!   remote) and dumps, for the KV event log.
//! - [`LocalKvStore`]: the store as an in-process caller calls it;
//!   [`KvStoreService`]: the gRPC shell over it.
//! - [`serve()`]: the store on the service host.
//! - [`KvStoreConfig`]: configuration and flags; [`metrics`]: the store's
//!   Prometheus metrics.

pub mod arena;
pub mod config;
pub mod disk;
pub mod events;
pub mod fair;
pub mod keys;
pub mod lease;
pub mod local;
pub mod metrics;
pub mod serve;
pub mod service;
pub mod store;
pub mod wire;

pub use arena::Arena;
pub use config::KvStoreConfig;
pub use disk::DiskBlocks;
pub use events::{Announced, Announcer, StoreEventSink};
pub use keys::{BlockKey, Fingerprint, StoreError};
pub use lease::DataPath;
pub use local::LocalKvStore;
pub use serve::{ROLES, main, serve};
pub use service::KvStoreService;
pub use store::{BlockRef, MemoryBlock, PutOutcome, Store, StoreStats, TierUsage, arena_bytes};
