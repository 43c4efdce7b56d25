//! The gRPC shells of a worker: `turbine.worker.v1.Worker` and
//! `turbine.worker.v1.KvTransfer`. They convert the wire to domain types at
//! the edge and call the same [`WorkerApi`] a local client calls.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_api::GenerateRequest;
use turbine_api::worker::{GenerateCall, HandleKey, HandleToken, PrefillCall, Prefilled, WorkerApi, WorkerError};
use turbine_proto::worker::v1 as pb;
use turbine_runtime::trust::Peer;
use turbine_tokens::ModelCard;

use crate::disagg::Disagg;
use crate::external::ExternalWorker;
use crate::worker::Worker;

/// What the gRPC shell serves: a worker with its own engine, or one in
/// front of an external engine.
#[tonic::async_trait]
pub trait Served: WorkerApi + std::fmt::Debug {
    /// The served model's card.
    fn card(&self) -> &ModelCard;

    /// [`WorkerApi::prefill`] for `requester` (the caller's certificate),
    /// whose handles may pin only its share of the pool.
    async fn prefill_for(&self, requester: &str, request: GenerateRequest, lease: Option<std::time::Duration>) -> Result<Prefilled, WorkerError>;
}

#[tonic::async_trait]
impl Served for Worker {
    fn card(&self) -> &ModelCard {
        Worker::card(self)
    }

    async fn prefill_for(&self, requester: &str, request: GenerateRequest, lease: Option<std::time::Duration>) -> Result<Prefilled, WorkerError> {
        Worker::prefill_for(self, requester, request, lease).await
    }
}

#[tonic::async_trait]
impl Served for ExternalWorker {
    fn card(&self) -> &ModelCard {
        ExternalWorker::card(self)
    }

    async fn prefill_for(&self, _requester: &str, request: GenerateRequest, lease: Option<std::time::Duration>) -> Result<Prefilled, WorkerError> {
        WorkerApi::prefill(self, request, lease).await
    }
}

/// What a service serves, once the model has loaded: until then every
/// call is UNAVAILABLE.
#[derive(Debug)]
pub struct Loaded<T>(Arc<OnceLock<T>>);

impl<T> Clone for Loaded<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> Default for Loaded<T> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<T> Loaded<T> {
    /// Already loaded.
    pub fn with(value: T) -> Self {
        let loaded = Self::default();
        loaded.set(value);
        loaded
    }

    /// Hands the loaded value to the services (once).
    pub fn set(&self, value: T) {
        let _ = self.0.set(value);
    }

    fn get(&self) -> Result<&T, Status> {
        self.0.get().ok_or_else(|| Status::unavailable("the worker is still loading its model"))
    }
}

/// `turbine.worker.v1.Worker`.
#[derive(Debug, Clone, Default)]
pub struct WorkerService {
    loaded: Loaded<Arc<dyn Served>>,
    /// The model card as sent (a vocabulary of MiBs: converted once).
    card: Arc<OnceLock<pb::ModelCard>>,
}

impl WorkerService {
    /// Serves the worker `loaded` will hold.
    pub fn new(loaded: Loaded<Arc<dyn Served>>) -> Self {
        Self { loaded, card: Arc::default() }
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = GenerateStream;

    #[tracing::instrument(skip_all, name = "worker.generate", fields(request_id))]
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let worker = self.loaded.get()?;
        let GenerateCall { request, remote } = GenerateCall::try_from(request.into_inner())?;
        tracing::Span::current().record("request_id", request.request_id.as_str());
        let chunks = WorkerApi::generate(&**worker, request, remote).await?;
        Ok(Response::new(Box::pin(chunks.map(|chunk| Ok(pb::GenerateResponse::from(chunk?))))))
    }

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<pb::LoadResponse>, Status> {
        let load = self.loaded.get()?.load().await?;
        Ok(Response::new(pb::LoadResponse { load: Some(pb::WorkerLoad::from(load)) }))
    }

    async fn get_model_card(&self, _request: Request<pb::GetModelCardRequest>) -> Result<Response<pb::GetModelCardResponse>, Status> {
        let worker = self.loaded.get()?;
        let card = self.card.get_or_init(|| pb::ModelCard::from(worker.card())).clone();
        Ok(Response::new(pb::GetModelCardResponse { card: Some(card) }))
    }

    #[tracing::instrument(skip_all, name = "worker.prefill", fields(request_id))]
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let worker = self.loaded.get()?;
        let requester = request.extensions().get::<Peer>().map_or_else(|| crate::local::ANONYMOUS.to_owned(), Peer::to_string);
        let PrefillCall { request, lease } = PrefillCall::try_from(request.into_inner())?;
        tracing::Span::current().record("request_id", request.request_id.as_str());
        let prefilled = worker.prefill_for(&requester, request, lease).await?;
        Ok(Response::new(pb::PrefillResponse::from(prefilled)))
    }

    async fn dump_kv_cache(&self, _request: Request<pb::DumpKvCacheRequest>) -> Result<Response<pb::DumpKvCacheResponse>, Status> {
        let dump = self.loaded.get()?.dump_kv_cache().await?;
        Ok(Response::new(pb::DumpKvCacheResponse { dump: Some(turbine_proto::kvindex::v1::WorkerDump::from(&dump)) }))
    }
}

/// `turbine.worker.v1.KvTransfer`: the control path of KV transfers, and
/// the TCP data path (`ReadBlocks`).
#[derive(Debug, Clone, Default)]
pub struct KvTransferService {
    loaded: Loaded<Arc<Disagg>>,
    /// Why this worker has no blocks to hand over, if it has none.
    refused: Option<&'static str>,
}

impl KvTransferService {
    /// Serves the blocks of the pool `loaded` will hold.
    pub fn new(loaded: Loaded<Arc<Disagg>>) -> Self {
        Self { loaded, refused: None }
    }

    /// Answers every call FAILED_PRECONDITION, saying `why` (a worker
    /// whose engine's blocks are not on Turbine's transfer plane).
    pub fn refusing(why: &'static str) -> Self {
        Self { loaded: Loaded::default(), refused: Some(why) }
    }

    fn pool(&self) -> Result<&Arc<Disagg>, Status> {
        match self.refused {
            Some(why) => Err(Status::failed_precondition(why)),
            None => self.loaded.get(),
        }
    }
}

type BlockStream = Pin<Box<dyn Stream<Item = Result<pb::BlockData, Status>> + Send>>;

#[tonic::async_trait]
impl pb::kv_transfer_server::KvTransfer for KvTransferService {
    type ReadBlocksStream = BlockStream;

    async fn describe(&self, request: Request<pb::DescribeRequest>) -> Result<Response<pb::DescribeResponse>, Status> {
        let pb::DescribeRequest { handle_id, token } = request.into_inner();
        let described = self.pool()?.describe(handle_key(handle_id, &token)?)?;
        Ok(Response::new(pb::DescribeResponse::from(described)))
    }

    async fn read_blocks(&self, request: Request<pb::ReadBlocksRequest>) -> Result<Response<BlockStream>, Status> {
        let disagg = self.pool()?.clone();
        let pb::ReadBlocksRequest { handle_id, indices, token } = request.into_inner();
        let handle = handle_key(handle_id, &token)?;
        // The handle and its token are checked here, before the stream (a
        // wrong token is refused once, within the call: a strike).
        let blocks = disagg.block_count(handle)?;
        let indices: Vec<u32> = if indices.is_empty() { (0..blocks as u32).collect() } else { indices };
        // One block at a time, copied under the pin table's lock.
        let stream = futures::stream::iter(indices).map(move |index| Ok(pb::BlockData { index, data: disagg.copy_block(handle, index as usize)? }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        let pb::ReleaseRequest { handle_id, token } = request.into_inner();
        Ok(Response::new(pb::ReleaseResponse { released: self.pool()?.release(handle_key(handle_id, &token)?) }))
    }
}

/// A request's handle id and token (INVALID_ARGUMENT when the token is not
/// a token's length, whatever the handle).
fn handle_key(id: u64, token: &[u8]) -> Result<HandleKey, Status> {
    Ok(HandleKey { id, token: HandleToken::try_from(token)? })
}
