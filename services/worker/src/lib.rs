//! The worker service: an inference engine behind `turbine.worker.v1`.
//!
//! - [`Worker`]: the loaded model card and running engine.
//! - [`WorkerService`]: the gRPC shell (`Generate`, `Load`, `GetModelCard`).
//! - [`WorkerClient`]: how other services call a worker, in-process or over
//!   gRPC, through one type.
//! - [`disagg`]: disaggregated serving: prefill handles, the KvTransfer
//!   service, reading a prefill worker's blocks (UCX or TCP).
//! - [`kv_events::feed_index`]: the engine's KV events into an index in the
//!   same process.
//! - [`serve::run`]: the process: servers, model load, registry lease,
//!   health, graceful drain.
//! - [`WorkerConfig`] / [`WorkerArgs`]: configuration and flags.

pub mod client;
pub mod config;
pub mod convert;
pub mod disagg;
pub mod kv_events;
pub mod metrics;
pub mod serve;
pub mod service;
pub mod worker;

pub use client::{TokenChunk, TokenStream, WorkerClient, WorkerError};
pub use config::{EngineKind, KvTransport, WorkerArgs, WorkerConfig, WorkerRole};
pub use service::WorkerService;
pub use worker::Worker;
