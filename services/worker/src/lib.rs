//! The worker service: an inference engine behind `turbine.worker.v1`.
//!
//! - [`Worker`]: the loaded model card and running engine; it implements
//!   [`WorkerApi`](turbine_api::worker::WorkerApi) itself ([`local`]), so a
//!   client in this process calls it directly and the gRPC shell
//!   ([`service`]) serves the same calls.
//! - [`disagg`]: disaggregated serving: prefill handles and the blocks
//!   behind them, reading a prefill worker's blocks (UCX or TCP).
//! - [`kv_events`]: the engine's KV events, into an index in this process
//!   or onto the event log in Redis.
//! - [`store_tier`]: the kv-store as the engine's shared tier (over gRPC,
//!   or UCX where this build and the store have it).
//! - [`external`]: a worker in front of an external engine server (vLLM),
//!   token ids in and out, its load and health from the engine's own.
//! - [`serve()`](serve::serve): the service on the host: model load,
//!   registry lease, health, graceful drain.
//! - [`WorkerConfig`]: configuration, flags and the sections `turbine run`
//!   shares ([`EngineConfig`], [`TransferConfig`]).
//!
//! Callers elsewhere use its client, `turbine_api::worker`.

pub mod config;
pub mod disagg;
pub mod external;
pub mod kv_events;
pub mod local;
pub mod metrics;
pub mod serve;
pub mod service;
pub mod store_tier;
pub mod worker;

pub use config::{EngineConfig, EngineKind, KvFetch, KvStoreOffload, KvTransport, TransferConfig, UpstreamKind, WorkerConfig, WorkerRole};
pub use serve::{KvEventSink, WorkerDeps, main, serve};
pub use turbine_kv::UcxNetwork;
pub use worker::Worker;
