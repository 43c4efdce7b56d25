//! A worker's `KvTransfer` service, as a decode worker reads a prefill
//! worker's pinned blocks: how to read them ([`Described`]) and the
//! client ([`KvTransferClient`]). Its errors are the worker's
//! ([`WorkerError`](crate::worker::WorkerError)).

use crate::{KvLayout, UcxRegion};

mod client;

#[cfg(feature = "mock")]
pub use client::MockKvTransferApi;
pub use client::{GrpcKvTransfer, KvTransferApi, KvTransferClient, ROLE};

/// How to read a worker's pinned blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    /// The layout of its blocks.
    pub layout: KvLayout,
    /// How to read its pool with UCX (`None`: it has no UCX).
    pub ucx: Option<UcxRegion>,
    /// Random per start of its pool (descriptions are cached by it).
    pub memory_id: u64,
}
