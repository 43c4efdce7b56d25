//! [`WorkerClient`]: one client for a worker, in this process or over gRPC.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use parking_lot::RwLock;
use turbine_api::{GenerateRequest, Load};
use turbine_kv::{WorkerDump, WorkerId};
use turbine_proto::MessageLimits;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::worker_client::WorkerClient as PbWorkerClient;
use turbine_runtime::grpc::TracedChannel;
use turbine_tokens::ModelCard;

use crate::types::{GenerateCall, PrefillCall, Prefilled, RemotePrefill, TokenChunk, TokenStream, WorkerError};

/// What a worker does for its callers. The worker implements it in its own
/// process; [`GrpcWorker`] implements it over the wire; a test may
/// implement it too.
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
            turbine_runtime::grpc::channel(endpoint).map_err(|error| WorkerError::Unavailable(format!("bad worker endpoint {endpoint:?}: {error}")))?;
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
