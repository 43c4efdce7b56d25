//! The worker's client: [`WorkerApi`] (what a worker does for its
//! callers: the worker itself in its process, [`GrpcWorker`] over the
//! wire, or a test's double), [`WorkerClient`] (the handle callers hold)
//! and [`WorkerClients`]; the conversions between the worker's words and
//! `turbine.worker.v1`, which the worker's gRPC shell uses too.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use tokio_stream::StreamExt;
use turbine_kv::{BlockHashes, LocalBlockHash, SequenceHash, WorkerDump, WorkerId};
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::worker_client::WorkerClient as PbWorkerClient;
use turbine_proto::{ConversionError, ConversionResult, MessageLimits};
use turbine_runtime::grpc::TracedChannel;
use turbine_runtime::host::Role;
use turbine_tokens::ModelCard;

use super::{GenerateCall, HandleToken, KvBlockRef, KvHandle, PrefillCall, Prefilled, RemotePrefill, TokenChunk, TokenStream, WorkerError};
use crate::error::{from_status, to_status};
use crate::wire::{finish_reason, generate_request};
use crate::{GenerateRequest, KvLayout, Load, TokenLogprobs, Usage};

/// The role a worker's certificate names: who this client calls.
pub const ROLE: Role = Role::Worker;

impl From<ConversionError> for WorkerError {
    fn from(error: ConversionError) -> Self {
        WorkerError::InvalidArgument(error.to_string())
    }
}

impl From<WorkerError> for tonic::Status {
    fn from(error: WorkerError) -> Self {
        to_status(&error)
    }
}

impl From<tonic::Status> for WorkerError {
    fn from(status: tonic::Status) -> Self {
        from_status(&status)
    }
}

/// What a worker does for its callers. The worker implements it in its own
/// process; [`GrpcWorker`] implements it over the wire; a test may
/// implement it too.
#[cfg_attr(feature = "mock", mockall::automock)]
#[tonic::async_trait]
pub trait WorkerApi: Send + Sync + 'static {
    /// Starts generating; the stream ends after the finishing chunk.
    /// `remote`: continue after a prefill on another worker (read its
    /// blocks, or compute the prompt here when they cannot be read).
    async fn generate(&self, request: GenerateRequest, remote: Option<RemotePrefill>) -> Result<TokenStream, WorkerError>;

    /// Computes the prompt and the first token, and pins the prompt's KV
    /// blocks for a decode worker (for `lease`, or the worker's default).
    async fn prefill(&self, request: GenerateRequest, lease: Option<Duration>) -> Result<Prefilled, WorkerError>;

    /// The served model's card.
    async fn model_card(&self) -> Result<ModelCard, WorkerError>;

    /// The engine's current load.
    async fn load(&self) -> Result<Load, WorkerError>;

    /// Every block the worker caches, as of one KV event number.
    async fn dump_kv_cache(&self) -> Result<WorkerDump, WorkerError>;
}

/// A worker, in this process or behind gRPC; cheap to clone.
#[derive(Clone)]
pub struct WorkerClient {
    inner: Arc<dyn WorkerApi>,
}

impl std::fmt::Debug for WorkerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerClient").finish_non_exhaustive()
    }
}

impl WorkerClient {
    /// A client for `worker`, called directly.
    pub fn new(worker: Arc<dyn WorkerApi>) -> Self {
        Self { inner: worker }
    }

    /// A client for the worker at `endpoint`, over the process's shared
    /// channel to it (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, WorkerError> {
        Ok(Self::new(Arc::new(GrpcWorker::connect(endpoint)?)))
    }

    /// Starts generating; tokens arrive on the returned stream. Dropping the
    /// stream cancels the sequence on the worker.
    pub async fn generate(&self, request: GenerateRequest) -> Result<TokenStream, WorkerError> {
        self.inner.generate(request, None).await
    }

    /// Continues `request` after a prefill elsewhere: this (decode) worker
    /// reads the handle's blocks, or computes the prompt if it cannot, and
    /// streams the tokens after `remote.generated_token_ids`.
    pub async fn generate_after_prefill(&self, request: GenerateRequest, remote: RemotePrefill) -> Result<TokenStream, WorkerError> {
        self.inner.generate(request, Some(remote)).await
    }

    /// Computes the prompt and first token on this (prefill) worker and
    /// pins the prompt's blocks for the worker's default lease.
    pub async fn prefill(&self, request: GenerateRequest) -> Result<Prefilled, WorkerError> {
        self.inner.prefill(request, None).await
    }

    /// The served model's card.
    pub async fn model_card(&self) -> Result<ModelCard, WorkerError> {
        self.inner.model_card().await
    }

    /// The worker's current load.
    pub async fn load(&self) -> Result<Load, WorkerError> {
        self.inner.load().await
    }

    /// The worker's cached blocks.
    pub async fn dump_kv_cache(&self) -> Result<WorkerDump, WorkerError> {
        self.inner.dump_kv_cache().await
    }
}

/// [`WorkerApi`] over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcWorker {
    client: PbWorkerClient<TracedChannel>,
}

impl GrpcWorker {
    /// The worker at `endpoint`, over the process's shared channel to it.
    pub fn connect(endpoint: &str) -> Result<Self, WorkerError> {
        let channel =
            turbine_runtime::grpc::channel(endpoint, ROLE).map_err(|error| WorkerError::Unavailable(format!("bad worker endpoint {endpoint:?}: {error}")))?;
        Ok(Self { client: PbWorkerClient::new(channel).with_message_limits() })
    }
}

#[tonic::async_trait]
impl WorkerApi for GrpcWorker {
    async fn generate(&self, request: GenerateRequest, remote: Option<RemotePrefill>) -> Result<TokenStream, WorkerError> {
        let message = pb::GenerateRequest::from(&GenerateCall { request, remote });
        let responses = self.client.clone().generate(message).await?.into_inner();
        Ok(Box::pin(responses.map(|message| Ok(TokenChunk::try_from(message?)?))))
    }

    async fn prefill(&self, request: GenerateRequest, lease: Option<Duration>) -> Result<Prefilled, WorkerError> {
        let message = pb::PrefillRequest::from(&PrefillCall { request, lease });
        Ok(Prefilled::try_from(self.client.clone().prefill(message).await?.into_inner())?)
    }

    async fn model_card(&self) -> Result<ModelCard, WorkerError> {
        let card = self.client.clone().get_model_card(pb::GetModelCardRequest {}).await?.into_inner().card;
        ModelCard::try_from(card.ok_or_else(|| WorkerError::Internal("the worker sent no model card".into()))?)
            .map_err(|error| WorkerError::Internal(format!("the worker's model card: {error}")))
    }

    async fn load(&self) -> Result<Load, WorkerError> {
        Ok(Load::from(self.client.clone().load(pb::LoadRequest {}).await?.into_inner().load.unwrap_or_default()))
    }

    async fn dump_kv_cache(&self) -> Result<WorkerDump, WorkerError> {
        let dump = self.client.clone().dump_kv_cache(pb::DumpKvCacheRequest {}).await?.into_inner().dump;
        let dump = dump.ok_or_else(|| WorkerError::Internal("the worker sent no dump".into()))?;
        WorkerDump::try_from(dump).map_err(|error| WorkerError::Internal(format!("the worker's dump: {error}")))
    }
}

/// Finds the client of a worker the registry or the router names: the
/// worker itself when it lives in this process (the embedded cluster
/// registers them), else its endpoint over gRPC.
#[derive(Debug, Clone, Default)]
pub struct WorkerClients {
    local: Arc<RwLock<HashMap<WorkerId, WorkerClient>>>,
}

impl WorkerClients {
    /// Workers of this process are called directly from now on.
    pub fn add_local(&self, worker_id: WorkerId, client: WorkerClient) {
        self.local.write().insert(worker_id, client);
    }

    /// A worker of this process that stopped.
    pub fn remove_local(&self, worker_id: &str) {
        self.local.write().remove(worker_id);
    }

    /// The client for `worker_id`, reached at `endpoint` unless it lives in
    /// this process.
    pub fn client(&self, worker_id: &str, endpoint: &str) -> Result<WorkerClient, WorkerError> {
        if let Some(client) = self.local.read().get(worker_id) {
            return Ok(client.clone());
        }
        WorkerClient::connect(endpoint)
    }
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
        let KvHandle { worker_id, transfer_endpoint, handle_id, token, layout, blocks, lease_expires, memory_id } = handle;
        pb::KvHandle {
            worker_id: worker_id.to_string(),
            transfer_endpoint,
            handle_id,
            token: token.as_bytes().to_vec(),
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
        let pb::KvHandle { worker_id, transfer_endpoint, handle_id, layout, blocks, lease_expires_unix_ms, memory_id, token } = handle;
        if transfer_endpoint.is_empty() {
            return Err(ConversionError::Missing("handle.transfer_endpoint"));
        }
        let lease_ms = u64::try_from(lease_expires_unix_ms).map_err(|_| ConversionError::invalid("handle.lease_expires_unix_ms", "must not be negative"))?;
        Ok(KvHandle {
            worker_id: WorkerId::from(worker_id),
            transfer_endpoint,
            handle_id,
            token: HandleToken::try_from(token.as_slice())
                .map_err(|_| ConversionError::invalid("handle.token", format!("must be {} bytes", HandleToken::LEN)))?,
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
        let pb::GenerateRequest { request_id, prompt_token_ids, sampling, stop, remote_prefill, cache_salt, kv_tenant } = request;
        Ok(GenerateCall {
            request: generate_request(request_id, prompt_token_ids, sampling, stop, cache_salt, kv_tenant)?,
            remote: remote_prefill.map(RemotePrefill::try_from).transpose()?,
        })
    }
}

impl From<&PrefillCall> for pb::PrefillRequest {
    fn from(call: &PrefillCall) -> Self {
        let PrefillCall { request, lease } = call;
        let pb::GenerateRequest { request_id, prompt_token_ids, sampling, stop, remote_prefill: _, cache_salt, kv_tenant } = pb::GenerateRequest::from(request);
        let lease_ms = lease.map_or(0, |lease| u32::try_from(lease.as_millis()).unwrap_or(u32::MAX));
        pb::PrefillRequest { request_id, prompt_token_ids, sampling, stop, lease_ms, cache_salt, kv_tenant }
    }
}

impl TryFrom<pb::PrefillRequest> for PrefillCall {
    type Error = ConversionError;

    fn try_from(request: pb::PrefillRequest) -> ConversionResult<Self> {
        let pb::PrefillRequest { request_id, prompt_token_ids, sampling, stop, lease_ms, cache_salt, kv_tenant } = request;
        Ok(PrefillCall {
            request: generate_request(request_id, prompt_token_ids, sampling, stop, cache_salt, kv_tenant)?,
            lease: (lease_ms > 0).then(|| Duration::from_millis(u64::from(lease_ms))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FinishReason, StopConditions};

    fn handle() -> KvHandle {
        KvHandle {
            worker_id: "prefill-0".into(),
            transfer_endpoint: "http://127.0.0.1:1".into(),
            handle_id: 7,
            token: HandleToken::new([5; HandleToken::LEN]),
            layout: KvLayout::opaque(4096, "test"),
            blocks: vec![KvBlockRef { hashes: BlockHashes { local: LocalBlockHash(1), sequence: SequenceHash(2) }, offset: 8192, checksum: 3 }],
            lease_expires: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            memory_id: 9,
        }
    }

    #[test]
    fn a_handle_carries_its_token_and_never_prints_it() {
        let mut wire = pb::KvHandle::from(handle());
        assert_eq!(wire.token, vec![5; HandleToken::LEN]);
        assert!(!format!("{:?}", handle()).contains("5, 5"), "{:?}", handle());
        wire.token.pop();
        assert_eq!(KvHandle::try_from(wire).unwrap_err().to_string(), ConversionError::invalid("handle.token", "must be 16 bytes").to_string());
        let (a, b) = (HandleToken::new([1; 16]), HandleToken::new([2; 16]));
        assert!(a.matches(&a) && !a.matches(&b) && a != b);
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

    #[test]
    fn every_error_a_worker_sends_comes_back_as_itself() {
        let sent = [
            WorkerError::InvalidArgument("prompt_token_ids: id 70000 is outside the vocabulary".into()),
            WorkerError::Overloaded("the worker is at capacity".into()),
            WorkerError::Unavailable("the worker is shutting down".into()),
            WorkerError::NotFound("handle 7 is not pinned here".into()),
            WorkerError::Denied { code: crate::ErrorCode::PermissionDenied, message: "not a gateway".into() },
            WorkerError::Internal("the model failed".into()),
        ];
        for error in sent {
            assert_eq!(WorkerError::from(tonic::Status::from(error.clone())), error);
        }
        assert_eq!(WorkerError::from(tonic::Status::unavailable("")), WorkerError::Unavailable("worker unavailable".into()));
        assert_eq!(WorkerError::from(tonic::Status::deadline_exceeded("slow")), WorkerError::Unavailable("slow".into()));
    }
}
