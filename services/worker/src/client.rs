//! One client for a worker, local or remote: callers never know which.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tonic::Code;
use turbine_engine::{EngineError, EngineOutput, FinishReason, GenerateRequest, Handoff, Load, TokenLogprobs, Usage};
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::worker_client::WorkerClient as GrpcWorkerClient;
use turbine_runtime::grpc::{MAX_MESSAGE_BYTES, TracedChannel, traced_channel};
use turbine_tokens::ModelCard;

use crate::convert::{card_from_proto, finish_reason_from_proto, generate_request_to_proto, load_from_proto, logprobs_from_proto, usage_from_proto};
use crate::disagg::Prefilled;
use crate::worker::Worker;

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
    /// The worker failed.
    #[error("{0}")]
    Internal(String),
}

impl From<EngineError> for WorkerError {
    fn from(error: EngineError) -> Self {
        match error {
            EngineError::InvalidRequest(message) => WorkerError::InvalidArgument(message),
            EngineError::Overloaded(_) => WorkerError::Overloaded(error.to_string()),
            EngineError::ShuttingDown => WorkerError::Unavailable(error.to_string()),
            EngineError::Executor(_) => WorkerError::Internal(error.to_string()),
        }
    }
}

impl From<WorkerError> for tonic::Status {
    fn from(error: WorkerError) -> Self {
        match error {
            WorkerError::InvalidArgument(message) => tonic::Status::invalid_argument(message),
            WorkerError::Overloaded(message) => tonic::Status::resource_exhausted(message),
            WorkerError::Unavailable(message) => tonic::Status::unavailable(message),
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
            Code::Ok
            | Code::Unknown
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss
            | Code::Unauthenticated => WorkerError::Internal(format!("{}: {message}", status.code())),
        }
    }
}

/// A stream of token chunks; ends after the chunk that carries `finished`.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<TokenChunk, WorkerError>> + Send>>;

/// A worker, in this process or behind gRPC.
#[derive(Debug, Clone)]
pub enum WorkerClient {
    /// In this process.
    Local(Arc<Worker>),
    /// Behind gRPC.
    Remote(GrpcWorkerClient<TracedChannel>),
}

impl WorkerClient {
    /// A lazily connecting client for the worker at `endpoint`.
    pub fn connect(endpoint: &str) -> Result<Self, WorkerError> {
        let channel = traced_channel(endpoint).map_err(|error| WorkerError::Unavailable(format!("bad worker endpoint {endpoint:?}: {error}")))?;
        Ok(WorkerClient::Remote(
            GrpcWorkerClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES),
        ))
    }

    /// Starts generating; tokens arrive on the returned stream. Dropping the
    /// stream cancels the sequence on the worker.
    pub async fn generate(&self, request: GenerateRequest) -> Result<TokenStream, WorkerError> {
        match self {
            WorkerClient::Local(worker) => {
                let outputs = worker.engine().generate(request)?;
                Ok(engine_chunks(outputs))
            }
            WorkerClient::Remote(client) => {
                let mut client = client.clone();
                let response = client.generate(generate_request_to_proto(&request)).await?;
                Ok(Box::pin(response.into_inner().map(|message| Ok(chunk_from_proto(message?)))))
            }
        }
    }

    /// Computes the prompt and first token on this (prefill) worker and
    /// pins the prompt's KV blocks for a decode worker.
    pub async fn prefill(&self, request: GenerateRequest) -> Result<Prefilled, WorkerError> {
        match self {
            WorkerClient::Local(worker) => worker.disagg().prefill(request, None).await,
            WorkerClient::Remote(client) => {
                let message = generate_request_to_proto(&request);
                let message = pb::PrefillRequest {
                    request_id: message.request_id,
                    prompt_token_ids: message.prompt_token_ids,
                    sampling: message.sampling,
                    stop: message.stop,
                    lease_ms: 0,
                };
                let response = client.clone().prefill(message).await?.into_inner();
                let first = response.first.unwrap_or_default();
                Ok(Prefilled { first: chunk_from_proto(first), handle: response.handle, cached_prompt_tokens: response.cached_prompt_tokens })
            }
        }
    }

    /// Continues `request` after a prefill elsewhere: this (decode) worker
    /// reads the handle's blocks (or computes the prompt if it cannot) and
    /// streams the tokens after `remote.generated_token_ids`.
    pub async fn generate_after_prefill(&self, request: GenerateRequest, remote: pb::RemotePrefill) -> Result<TokenStream, WorkerError> {
        match self {
            WorkerClient::Local(worker) => Ok(engine_chunks(decode_after_prefill(worker, request, &remote).await?)),
            WorkerClient::Remote(client) => {
                let mut message = generate_request_to_proto(&request);
                message.remote_prefill = Some(remote);
                let response = client.clone().generate(message).await?;
                Ok(Box::pin(response.into_inner().map(|message| Ok(chunk_from_proto(message?)))))
            }
        }
    }

    /// The served model's card.
    pub async fn model_card(&self) -> Result<ModelCard, WorkerError> {
        match self {
            WorkerClient::Local(worker) => Ok(worker.card().clone()),
            WorkerClient::Remote(client) => {
                let card = client.clone().get_model_card(pb::GetModelCardRequest {}).await?.into_inner().card;
                card_from_proto(card.ok_or_else(|| WorkerError::Internal("worker sent no model card".into()))?).map_err(WorkerError::Internal)
            }
        }
    }

    /// The worker's current load.
    pub async fn load(&self) -> Result<Load, WorkerError> {
        match self {
            WorkerClient::Local(worker) => Ok(worker.load()),
            WorkerClient::Remote(client) => {
                let load = client.clone().load(pb::LoadRequest {}).await?.into_inner().load;
                Ok(load_from_proto(load.unwrap_or_default()))
            }
        }
    }
}

fn chunk_from_proto(message: pb::GenerateResponse) -> TokenChunk {
    let finished = finish_reason_from_proto(message.finish_reason()).map(|reason| (reason, usage_from_proto(message.usage.unwrap_or_default())));
    let logprobs = message.logprobs.into_iter().map(logprobs_from_proto).collect();
    TokenChunk { tokens: message.token_ids, logprobs, finished }
}

/// Submits a decode after a remote prefill to a local worker's engine:
/// installs whatever blocks could be read, then continues after the
/// prefill's tokens.
pub(crate) async fn decode_after_prefill(
    worker: &Worker,
    request: GenerateRequest,
    remote: &pb::RemotePrefill,
) -> Result<tokio::sync::mpsc::UnboundedReceiver<EngineOutput>, EngineError> {
    worker.engine().config().validate(&request)?;
    let vocab = worker.card().tokenizer.tokens.len();
    if let Some(bad) = remote.generated_token_ids.iter().find(|&&token| token as usize >= vocab) {
        return Err(EngineError::InvalidRequest(format!("generated token id {bad} is outside the vocabulary of {vocab} tokens")));
    }
    let import = worker.disagg().import(&request, remote).await;
    let handoff = Handoff::Decode { generated: remote.generated_token_ids.clone(), import };
    worker.engine().submit(request, handoff)
}

/// Turns an engine output channel into token chunks, coalescing whatever
/// tokens are already queued into one chunk.
pub fn engine_chunks(receiver: tokio::sync::mpsc::UnboundedReceiver<EngineOutput>) -> TokenStream {
    Box::pin(futures::stream::unfold(Some(receiver), |state| async move {
        let mut receiver = state?;
        let mut chunk = TokenChunk::default();
        let mut next = receiver.recv().await;
        loop {
            match next {
                Some(EngineOutput::Token(token, logprobs)) => {
                    chunk.tokens.push(token);
                    chunk.logprobs.extend(logprobs);
                }
                Some(EngineOutput::Finished { reason, usage }) => {
                    chunk.finished = Some((reason, usage));
                    return Some((Ok(chunk), None));
                }
                Some(EngineOutput::Failed(error)) => return Some((Err(WorkerError::from(error)), None)),
                // Only prefills pin, and they do not stream through here.
                Some(EngineOutput::Pinned(_)) => {}
                None => return Some((Err(WorkerError::Unavailable("the engine stopped".into())), None)),
            }
            match receiver.try_recv() {
                Ok(output) => next = Some(output),
                Err(_) => return Some((Ok(chunk), Some(receiver))),
            }
        }
    }))
}
