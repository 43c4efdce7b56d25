//! The worker's words (a call to generate or prefill, the token chunks
//! that come back, a prefill worker's handle on pinned blocks, why a call
//! failed) and its client ([`WorkerClient`]; [`WorkerClients`] finds the
//! one for a routed worker, in this process or over gRPC). The engine's
//! request and result words are the crate's own ([`GenerateRequest`]...).

use std::pin::Pin;
use std::time::{Duration, SystemTime};

use tokio_stream::Stream;
use turbine_kv::{BlockHashes, WorkerId};

use crate::error::{ApiError, ErrorCode};
use crate::{FinishReason, GenerateRequest, KvLayout, TokenLogprobs, Usage};

mod client;

#[cfg(feature = "mock")]
pub use client::MockWorkerApi;
pub use client::{GrpcWorker, ROLE, WorkerApi, WorkerClient, WorkerClients};

/// Tokens produced since the previous chunk, and the end of the stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenChunk {
    /// Generated token ids, in order.
    pub tokens: Vec<u32>,
    /// Their log-probabilities (one per token) when the request asked.
    pub logprobs: Vec<TokenLogprobs>,
    /// Set on the last chunk.
    pub finished: Option<(FinishReason, Usage)>,
}

/// A stream of token chunks; ends after the chunk that carries `finished`.
/// Dropping it cancels the sequence on the worker.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<TokenChunk, WorkerError>> + Send>>;

/// Why a worker call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerError {
    /// The request is invalid for this worker (prompt too long, bad ids...).
    #[error("{0}")]
    InvalidArgument(String),
    /// The worker is at capacity; retry later or elsewhere.
    #[error("{0}")]
    Overloaded(String),
    /// The worker cannot be reached or is shutting down; another may serve.
    #[error("{0}")]
    Unavailable(String),
    /// The handle or block asked for does not exist (released, expired).
    #[error("{0}")]
    NotFound(String),
    /// The caller may not make this call.
    #[error("the worker denied the call ({code:?}): {message}")]
    Denied {
        /// Unauthenticated or PermissionDenied.
        code: ErrorCode,
        /// The worker's words.
        message: String,
    },
    /// The worker failed.
    #[error("{0}")]
    Internal(String),
}

impl ApiError for WorkerError {
    fn code(&self) -> ErrorCode {
        match self {
            WorkerError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            WorkerError::Overloaded(_) => ErrorCode::ResourceExhausted,
            WorkerError::Unavailable(_) => ErrorCode::Unavailable,
            WorkerError::NotFound(_) => ErrorCode::NotFound,
            WorkerError::Denied { code, .. } => *code,
            WorkerError::Internal(_) => ErrorCode::Internal,
        }
    }

    fn message(&self) -> String {
        match self {
            WorkerError::InvalidArgument(message)
            | WorkerError::Overloaded(message)
            | WorkerError::Unavailable(message)
            | WorkerError::NotFound(message)
            | WorkerError::Denied { message, .. }
            | WorkerError::Internal(message) => message.clone(),
        }
    }

    fn from_parts(code: ErrorCode, _reason: Option<&str>, message: String) -> Self {
        match code {
            ErrorCode::InvalidArgument | ErrorCode::FailedPrecondition => WorkerError::InvalidArgument(message),
            ErrorCode::ResourceExhausted => WorkerError::Overloaded(message),
            ErrorCode::Unavailable | ErrorCode::Cancelled | ErrorCode::DeadlineExceeded => {
                WorkerError::Unavailable(if message.is_empty() { "worker unavailable".into() } else { message })
            }
            ErrorCode::NotFound => WorkerError::NotFound(message),
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => WorkerError::Denied { code, message },
            ErrorCode::Internal => WorkerError::Internal(message),
            ErrorCode::DataLoss | ErrorCode::Unimplemented => WorkerError::Internal(format!("{code:?}: {message}")),
        }
    }
}

/// One block behind a [`KvHandle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBlockRef {
    /// The block's hashes (they must match the prompt's).
    pub hashes: BlockHashes,
    /// Its offset in the owner's pool.
    pub offset: u64,
    /// XXH3-64 of its bytes when pinned.
    pub checksum: u64,
}

/// A prefill worker's pinned prompt blocks, offered to a decode worker: a
/// capability to read them until the lease runs out or it is released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvHandle {
    /// The prefill worker.
    pub worker_id: WorkerId,
    /// Where its `KvTransfer` service listens.
    pub transfer_endpoint: String,
    /// The handle's id on that worker.
    pub handle_id: u64,
    /// The secret that lets its holder read and release the blocks.
    pub token: HandleToken,
    /// How its blocks are laid out.
    pub layout: KvLayout,
    /// The prompt's full blocks, in order.
    pub blocks: Vec<KvBlockRef>,
    /// When the prefill worker frees the blocks unless released earlier.
    pub lease_expires: SystemTime,
    /// Random per start of the owner's pool: a cached description of the
    /// pool is stale when it changes.
    pub memory_id: u64,
}

impl KvHandle {
    /// What a `KvTransfer` call names the handle by.
    pub fn key(&self) -> HandleKey {
        HandleKey { id: self.handle_id, token: self.token }
    }
}

/// A handle's capability: 16 random bytes its owner made for it alone.
/// Whoever holds it may read the handle's blocks, so it is compared in
/// constant time and never printed.
#[derive(Clone, Copy, Default)]
pub struct HandleToken([u8; HandleToken::LEN]);

impl HandleToken {
    /// Bytes in a token.
    pub const LEN: usize = 16;

    /// A token of these bytes (the owner draws them from a CSPRNG).
    pub const fn new(bytes: [u8; Self::LEN]) -> Self {
        Self(bytes)
    }

    /// The token's bytes, for the wire.
    pub fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.0
    }

    /// Whether `other` is this token, in time independent of where they
    /// differ (a caller probing byte by byte learns nothing).
    pub fn matches(&self, other: &HandleToken) -> bool {
        let difference = self.0.iter().zip(&other.0).fold(0u8, |difference, (a, b)| difference | (a ^ b));
        std::hint::black_box(difference) == 0
    }
}

impl TryFrom<&[u8]> for HandleToken {
    type Error = turbine_proto::ConversionError;

    fn try_from(bytes: &[u8]) -> Result<Self, Self::Error> {
        let bytes = <[u8; Self::LEN]>::try_from(bytes)
            .map_err(|_| turbine_proto::ConversionError::invalid("token", format!("must be {} bytes, got {}", Self::LEN, bytes.len())))?;
        Ok(Self(bytes))
    }
}

impl PartialEq for HandleToken {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other)
    }
}

impl Eq for HandleToken {}

impl std::fmt::Debug for HandleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandleToken(..)")
    }
}

/// How a `KvTransfer` call names a handle: its id, and its token to show
/// the caller was given it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleKey {
    /// The handle's id on its worker.
    pub id: u64,
    /// Its token.
    pub token: HandleToken,
}

/// A decode worker's part of a disaggregated request: the prefill's handle
/// (none when its prompt had no full block) and the tokens it sampled.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RemotePrefill {
    /// The pinned blocks to read.
    pub handle: Option<KvHandle>,
    /// Tokens already sampled by the prefill worker (not streamed again).
    pub generated_token_ids: Vec<u32>,
}

/// A prefill's outcome: the first token and, unless that finished the
/// request, the handle of the pinned blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefilled {
    /// The first token (finished when a stop token ended the request).
    pub first: TokenChunk,
    /// The pinned blocks; `None` when `first` finished the request or the
    /// prompt is shorter than a block.
    pub handle: Option<KvHandle>,
    /// Prompt tokens the prefill served from its prefix cache.
    pub cached_prompt_tokens: u32,
}

/// A `Generate` call: the request, and the prefill it continues, if any.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateCall {
    /// The request.
    pub request: GenerateRequest,
    /// Set on a decode worker after a prefill elsewhere.
    pub remote: Option<RemotePrefill>,
}

/// A `Prefill` call: the request and how long the blocks stay pinned.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillCall {
    /// The whole request (`max_tokens` included: the decode worker
    /// continues it).
    pub request: GenerateRequest,
    /// The pin's lease; `None`: the worker's default.
    pub lease: Option<Duration>,
}
