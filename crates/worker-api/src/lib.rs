//! How the rest of Turbine talks to a worker.
//!
//! The gateway, the event-log followers and other workers need a worker's
//! API, not its engine: this crate holds the domain types of
//! `turbine.worker.v1` and one client per service, so none of them links
//! the native engine.
//!
//! - [`WorkerClient`]: `Generate`, `Prefill`, the model card, load and KV
//!   cache dumps, over a [`WorkerApi`]: the worker itself when it lives in
//!   this process, or [`GrpcWorker`] over a pooled channel. Callers never
//!   know which. [`WorkerClients`] finds the client for a routed worker.
//! - [`KvTransferClient`]: a prefill worker's pinned blocks, read by a
//!   decode worker (`Describe`, `ReadBlocks`, `Release`).
//! - [`types`]: [`KvHandle`], [`RemotePrefill`], [`TokenChunk`],
//!   [`Prefilled`], [`WorkerError`], and their checked conversions from
//!   the wire.

mod client;
mod transfer;
pub mod types;

pub use client::{GrpcWorker, WorkerApi, WorkerClient, WorkerClients};
pub use transfer::{Described, GrpcKvTransfer, KvTransferApi, KvTransferClient};
pub use types::{GenerateCall, KvBlockRef, KvHandle, PrefillCall, Prefilled, RemotePrefill, TokenChunk, TokenStream, WorkerError};
