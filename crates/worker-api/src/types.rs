//! The domain types of `turbine.worker.v1` that belong to the worker's API
//! (the engine's request and result types live in `turbine-engine`), with
//! their conversions from and to the wire.

use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use tonic::Code;
use turbine_api::wire::{finish_reason, generate_request};
use turbine_api::{FinishReason, GenerateRequest, KvLayout, TokenLogprobs, Usage};
use turbine_kv::{BlockHashes, LocalBlockHash, SequenceHash, WorkerId};
use turbine_proto::worker::v1 as pb;
use turbine_proto::{ConversionError, ConversionResult};

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
    /// The worker failed.
    #[error("{0}")]
    Internal(String),
}

impl From<ConversionError> for WorkerError {
    fn from(error: ConversionError) -> Self {
        WorkerError::InvalidArgument(error.to_string())
    }
}

impl From<WorkerError> for tonic::Status {
    fn from(error: WorkerError) -> Self {
        match error {
            WorkerError::InvalidArgument(message) => tonic::Status::invalid_argument(message),
            WorkerError::Overloaded(message) => tonic::Status::resource_exhausted(message),
            WorkerError::Unavailable(message) => tonic::Status::unavailable(message),
            WorkerError::NotFound(message) => tonic::Status::not_found(message),
            WorkerError::Internal(message) => tonic::Status::internal(message),
        }
    }
}

impl From<tonic::Status> for WorkerError {
    fn from(status: tonic::Status) -> Self {
        let message = status.message().to_owned();
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => WorkerError::InvalidArgument(message),
            Code::ResourceExhausted => WorkerError::Overloaded(message),
            Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded | Code::Aborted => {
                WorkerError::Unavailable(if message.is_empty() { "worker unavailable".into() } else { message })
            }
            Code::NotFound => WorkerError::NotFound(message),
            Code::Ok
            | Code::Unknown
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss
            | Code::Unauthenticated => WorkerError::Internal(format!("{}: {message}", status.code())),
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

fn unix_ms(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

impl From<TokenChunk> for pb::GenerateResponse {
    fn from(chunk: TokenChunk) -> Self {
        let TokenChunk { tokens, logprobs, finished } = chunk;
        let (finish_reason, usage) = match finished {
            Some((reason, usage)) => (pb::FinishReason::from(reason) as i32, Some(pb::Usage::from(usage))),
            None => (pb::FinishReason::Unspecified as i32, None),
        };
        pb::GenerateResponse { token_ids: tokens, finish_reason, usage, logprobs: logprobs.into_iter().map(pb::TokenLogprobs::from).collect() }
    }
}

impl TryFrom<pb::GenerateResponse> for TokenChunk {
    type Error = ConversionError;

    fn try_from(response: pb::GenerateResponse) -> ConversionResult<Self> {
        let pb::GenerateResponse { token_ids, finish_reason: reason, usage, logprobs } = response;
        let finished = match finish_reason(reason)? {
            Some(reason) => Some((reason, Usage::from(usage.ok_or(ConversionError::Missing("usage"))?))),
            None => None,
        };
        Ok(TokenChunk { tokens: token_ids, logprobs: logprobs.into_iter().map(TokenLogprobs::from).collect(), finished })
    }
}

impl From<KvBlockRef> for pb::KvBlockRef {
    fn from(block: KvBlockRef) -> Self {
        let KvBlockRef { hashes: BlockHashes { local, sequence }, offset, checksum } = block;
        pb::KvBlockRef { sequence_hash: sequence.0, local_hash: local.0, offset, checksum }
    }
}

impl From<pb::KvBlockRef> for KvBlockRef {
    fn from(block: pb::KvBlockRef) -> Self {
        let pb::KvBlockRef { sequence_hash, local_hash, offset, checksum } = block;
        KvBlockRef { hashes: BlockHashes { local: LocalBlockHash(local_hash), sequence: SequenceHash(sequence_hash) }, offset, checksum }
    }
}

impl From<KvHandle> for pb::KvHandle {
    fn from(handle: KvHandle) -> Self {
        let KvHandle { worker_id, transfer_endpoint, handle_id, layout, blocks, lease_expires, memory_id } = handle;
        pb::KvHandle {
            worker_id: worker_id.to_string(),
            transfer_endpoint,
            handle_id,
            layout: Some(pb::KvLayout::from(&layout)),
            blocks: blocks.into_iter().map(pb::KvBlockRef::from).collect(),
            lease_expires_unix_ms: unix_ms(lease_expires),
            memory_id,
        }
    }
}

impl TryFrom<pb::KvHandle> for KvHandle {
    type Error = ConversionError;

    fn try_from(handle: pb::KvHandle) -> ConversionResult<Self> {
        let pb::KvHandle { worker_id, transfer_endpoint, handle_id, layout, blocks, lease_expires_unix_ms, memory_id } = handle;
        if transfer_endpoint.is_empty() {
            return Err(ConversionError::Missing("handle.transfer_endpoint"));
        }
        let lease_ms = u64::try_from(lease_expires_unix_ms).map_err(|_| ConversionError::invalid("handle.lease_expires_unix_ms", "must not be negative"))?;
        Ok(KvHandle {
            worker_id: WorkerId::from(worker_id),
            transfer_endpoint,
            handle_id,
            layout: KvLayout::try_from(layout.ok_or(ConversionError::Missing("handle.layout"))?)?,
            blocks: blocks.into_iter().map(KvBlockRef::from).collect(),
            lease_expires: UNIX_EPOCH + Duration::from_millis(lease_ms),
            memory_id,
        })
    }
}

impl From<RemotePrefill> for pb::RemotePrefill {
    fn from(remote: RemotePrefill) -> Self {
        let RemotePrefill { handle, generated_token_ids } = remote;
        pb::RemotePrefill { handle: handle.map(pb::KvHandle::from), generated_token_ids }
    }
}

impl TryFrom<pb::RemotePrefill> for RemotePrefill {
    type Error = ConversionError;

    fn try_from(remote: pb::RemotePrefill) -> ConversionResult<Self> {
        let pb::RemotePrefill { handle, generated_token_ids } = remote;
        Ok(RemotePrefill { handle: handle.map(KvHandle::try_from).transpose()?, generated_token_ids })
    }
}

impl From<Prefilled> for pb::PrefillResponse {
    fn from(prefilled: Prefilled) -> Self {
        let Prefilled { first, handle, cached_prompt_tokens } = prefilled;
        pb::PrefillResponse { first: Some(pb::GenerateResponse::from(first)), handle: handle.map(pb::KvHandle::from), cached_prompt_tokens }
    }
}

impl TryFrom<pb::PrefillResponse> for Prefilled {
    type Error = ConversionError;

    fn try_from(response: pb::PrefillResponse) -> ConversionResult<Self> {
        let pb::PrefillResponse { first, handle, cached_prompt_tokens } = response;
        Ok(Prefilled {
            first: TokenChunk::try_from(first.ok_or(ConversionError::Missing("first"))?)?,
            handle: handle.map(KvHandle::try_from).transpose()?,
            cached_prompt_tokens,
        })
    }
}

impl From<&GenerateCall> for pb::GenerateRequest {
    fn from(call: &GenerateCall) -> Self {
        let GenerateCall { request, remote } = call;
        pb::GenerateRequest { remote_prefill: remote.clone().map(pb::RemotePrefill::from), ..pb::GenerateRequest::from(request) }
    }
}

impl TryFrom<pb::GenerateRequest> for GenerateCall {
    type Error = ConversionError;

    fn try_from(request: pb::GenerateRequest) -> ConversionResult<Self> {
        let pb::GenerateRequest { request_id, prompt_token_ids, sampling, stop, remote_prefill } = request;
        Ok(GenerateCall {
            request: generate_request(request_id, prompt_token_ids, sampling, stop)?,
            remote: remote_prefill.map(RemotePrefill::try_from).transpose()?,
        })
    }
}

impl From<&PrefillCall> for pb::PrefillRequest {
    fn from(call: &PrefillCall) -> Self {
        let PrefillCall { request, lease } = call;
        let pb::GenerateRequest { request_id, prompt_token_ids, sampling, stop, remote_prefill: _ } = pb::GenerateRequest::from(request);
        let lease_ms = lease.map_or(0, |lease| u32::try_from(lease.as_millis()).unwrap_or(u32::MAX));
        pb::PrefillRequest { request_id, prompt_token_ids, sampling, stop, lease_ms }
    }
}

impl TryFrom<pb::PrefillRequest> for PrefillCall {
    type Error = ConversionError;

    fn try_from(request: pb::PrefillRequest) -> ConversionResult<Self> {
        let pb::PrefillRequest { request_id, prompt_token_ids, sampling, stop, lease_ms } = request;
        Ok(PrefillCall {
            request: generate_request(request_id, prompt_token_ids, sampling, stop)?,
            lease: (lease_ms > 0).then(|| Duration::from_millis(u64::from(lease_ms))),
        })
    }
}

#[cfg(test)]
mod tests {
    use turbine_api::StopConditions;

    use super::*;

    fn handle() -> KvHandle {
        KvHandle {
            worker_id: "prefill-0".into(),
            transfer_endpoint: "http://127.0.0.1:1".into(),
            handle_id: 7,
            layout: KvLayout::opaque(4096, "test"),
            blocks: vec![KvBlockRef { hashes: BlockHashes { local: LocalBlockHash(1), sequence: SequenceHash(2) }, offset: 8192, checksum: 3 }],
            lease_expires: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            memory_id: 9,
        }
    }

    #[test]
    fn handles_and_calls_round_trip() {
        assert_eq!(KvHandle::try_from(pb::KvHandle::from(handle())).unwrap(), handle());
        let call = GenerateCall {
            request: GenerateRequest {
                request_id: "r".into(),
                prompt: vec![1, 2],
                stop: StopConditions { max_tokens: 3, ..Default::default() },
                ..Default::default()
            },
            remote: Some(RemotePrefill { handle: Some(handle()), generated_token_ids: vec![5] }),
        };
        assert_eq!(GenerateCall::try_from(pb::GenerateRequest::from(&call)).unwrap(), call);
        let prefill = PrefillCall { request: call.request.clone(), lease: Some(Duration::from_millis(250)) };
        assert_eq!(PrefillCall::try_from(pb::PrefillRequest::from(&prefill)).unwrap(), prefill);
        let chunk = TokenChunk {
            tokens: vec![4],
            logprobs: vec![],
            finished: Some((FinishReason::Stop, Usage { prompt_tokens: 2, completion_tokens: 1, cached_prompt_tokens: 0 })),
        };
        assert_eq!(TokenChunk::try_from(pb::GenerateResponse::from(chunk.clone())).unwrap(), chunk);
    }

    #[test]
    fn malformed_handles_are_refused() {
        let no_layout = pb::KvHandle { layout: None, ..pb::KvHandle::from(handle()) };
        assert_eq!(KvHandle::try_from(no_layout).unwrap_err(), ConversionError::Missing("handle.layout"));
        let no_endpoint = pb::KvHandle { transfer_endpoint: String::new(), ..pb::KvHandle::from(handle()) };
        assert!(KvHandle::try_from(no_endpoint).is_err());
        let finished_without_usage = pb::GenerateResponse { finish_reason: pb::FinishReason::Stop as i32, ..Default::default() };
        assert_eq!(TokenChunk::try_from(finished_without_usage).unwrap_err(), ConversionError::Missing("usage"));
    }
}
