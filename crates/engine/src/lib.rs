//! The inference engine core shared by every engine: paged KV block pool
//! with prefix caching, continuous-batching scheduler, the engine loop, and
//! the mocker (simulated model).
//!
//! - [`block_manager`]: fixed-size blocks, prefix reuse by sequence hash,
//!   LRU eviction of free cached blocks, KV events.
//! - [`scheduler`]: waiting/running queues, per-step token budget, chunked
//!   prefill, sequence limit, LIFO preemption with recompute.
//! - [`core`]: the engine thread and its [`EngineHandle`]; an [`Executor`]
//!   plugs in the model (the mocker here, the native model elsewhere).
//! - [`mocker`]: the simulated executor.
//! - [`tiers`]: KV tiers below the pool (host memory, local disk),
//!   offloaded to in the background and onboarded from at admission.
//!
//! Nothing here knows about gRPC or protobuf.

pub mod block_manager;
pub mod core;
pub mod mocker;
pub mod request;
pub mod scheduler;
pub mod tiers;

pub use crate::core::{EngineHandle, EngineStats, Executor};

pub use request::{
    EngineOutput, FinishReason, GenerateRequest, Handoff, ImportedPrefix, Load, MAX_LOGPROBS, OutputFormat, PinnedPrefix, Sampled, SamplingError,
    SamplingParams, StopConditions, TokenLogprobs, Usage,
};
pub use scheduler::{AdmissionError, Batch, BatchItem, Scheduler, SchedulerConfig, SeqId};
pub use tiers::{
    DiskTier, FetchEstimates, FetchPolicy, HostBlock, HostTier, KvTiers, ModelledTransfer, RemoteGetError, RemoteOffload, RemoteStore, RemoteTier, TierStats,
};
/// The KV pool as transfers see it (in `turbine-kv`, which the kv-store and
/// the UCX agent share without an engine).
pub use turbine_kv::memory as kv_memory;
pub use turbine_kv::{DeviceKv, DeviceMemory, DeviceReadError, KvAllocator, KvBuffer, KvLayout, KvMemory, UcxRegion, block_checksum};
pub use turbine_kv::{Dump, KvEvent, NumberedEvent, StoredBlock, Tier};

/// Errors of an engine, as callers see them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The request can never run as asked.
    #[error("{0}")]
    InvalidRequest(String),
    /// Too many requests are queued; retry later.
    #[error("the engine is overloaded ({0} requests waiting)")]
    Overloaded(usize),
    /// The engine is stopping and takes no more work.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The model failed while computing a step.
    #[error("the model failed: {0}")]
    Executor(ExecutorError),
}

/// Why an [`Executor`] could not compute a step or install a block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecutorError {
    /// The step's computation failed (a kernel, the device, memory).
    #[error("{0}")]
    Compute(String),
    /// The executor answered a step with the wrong number of results.
    #[error("the executor returned {got} results for {expected} items")]
    WrongResults {
        /// Items in the step.
        expected: usize,
        /// Results returned.
        got: usize,
    },
    /// This engine keeps no KV memory another worker's blocks could be
    /// written into (it computes them instead).
    #[error("this engine cannot install KV blocks from another worker")]
    CannotInstall,
    /// A block's bytes are not the pool's block size.
    #[error("a block is {expected} bytes, got {got}")]
    BlockSize {
        /// The pool's block size.
        expected: usize,
        /// The bytes offered.
        got: usize,
    },
    /// Writing a block into the pool failed.
    #[error("cannot write the block: {0}")]
    Install(String),
}

impl From<AdmissionError> for EngineError {
    fn from(error: AdmissionError) -> Self {
        match error {
            AdmissionError::Invalid(message) => EngineError::InvalidRequest(message),
            AdmissionError::QueueFull(waiting) => EngineError::Overloaded(waiting),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
