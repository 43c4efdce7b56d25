//! The kv-transfer client: [`KvTransferApi`] (a worker's `KvTransfer`
//! service: the worker itself in its process, [`GrpcKvTransfer`] over the
//! wire, the TCP data path), [`KvTransferClient`] (the handle callers
//! hold), and the conversions to and from its messages.

use std::sync::Arc;

use tokio_stream::StreamExt;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::kv_transfer_client::KvTransferClient as PbKvTransferClient;
use turbine_proto::{ConversionError, ConversionResult, MessageLimits};
use turbine_runtime::grpc::TracedChannel;
use turbine_runtime::host::Role;

use super::Described;
use crate::worker::{HandleKey, WorkerError};
use crate::{KvLayout, UcxRegion};

/// The role whose certificate a `KvTransfer` server names: a worker (a
/// prefill worker serves its pinned blocks).
pub const ROLE: Role = Role::Worker;

impl From<Described> for pb::DescribeResponse {
    fn from(described: Described) -> Self {
        let Described { layout, ucx, memory_id } = described;
        pb::DescribeResponse { layout: Some(pb::KvLayout::from(&layout)), ucx: ucx.as_ref().map(pb::UcxRegion::from), memory_id }
    }
}

impl TryFrom<pb::DescribeResponse> for Described {
    type Error = ConversionError;

    fn try_from(response: pb::DescribeResponse) -> ConversionResult<Self> {
        let pb::DescribeResponse { layout, ucx, memory_id } = response;
        Ok(Described { layout: KvLayout::try_from(layout.ok_or(ConversionError::Missing("layout"))?)?, ucx: ucx.map(UcxRegion::from), memory_id })
    }
}

/// What a worker's `KvTransfer` service does for its peers.
#[cfg_attr(feature = "mock", mockall::automock)]
#[tonic::async_trait]
pub trait KvTransferApi: Send + Sync + 'static {
    /// How to read `handle`'s blocks.
    async fn describe(&self, handle: HandleKey) -> Result<Described, WorkerError>;

    /// Blocks `indices` of a handle (indices into its block list), each
    /// `block_bytes` long, back to back into `into` (cleared first; pass a
    /// used buffer to skip faulting in fresh pages).
    async fn read_blocks(&self, handle: HandleKey, indices: &[usize], block_bytes: usize, into: Vec<u8>) -> Result<Vec<u8>, WorkerError>;

    /// Unpins a handle's blocks; false if it was unknown (released or
    /// expired) or the token was not its.
    async fn release(&self, handle: HandleKey) -> Result<bool, WorkerError>;
}

/// A worker's `KvTransfer` service, in this process or behind gRPC.
#[derive(Clone)]
pub struct KvTransferClient {
    inner: Arc<dyn KvTransferApi>,
}

impl std::fmt::Debug for KvTransferClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvTransferClient").finish_non_exhaustive()
    }
}

impl KvTransferClient {
    /// A client for `transfer`, called directly.
    pub fn new(transfer: Arc<dyn KvTransferApi>) -> Self {
        Self { inner: transfer }
    }

    /// The service at `endpoint` (a handle's `transfer_endpoint`), over the
    /// process's shared channel to it.
    pub fn connect(endpoint: &str) -> Result<Self, WorkerError> {
        let channel =
            turbine_runtime::grpc::channel(endpoint, ROLE).map_err(|error| WorkerError::Unavailable(format!("bad transfer endpoint {endpoint:?}: {error}")))?;
        Ok(Self::new(Arc::new(GrpcKvTransfer { client: PbKvTransferClient::new(channel).with_message_limits() })))
    }

    /// See [`KvTransferApi::describe`].
    pub async fn describe(&self, handle: HandleKey) -> Result<Described, WorkerError> {
        self.inner.describe(handle).await
    }

    /// See [`KvTransferApi::read_blocks`].
    pub async fn read_blocks(&self, handle: HandleKey, indices: &[usize], block_bytes: usize, into: Vec<u8>) -> Result<Vec<u8>, WorkerError> {
        self.inner.read_blocks(handle, indices, block_bytes, into).await
    }

    /// See [`KvTransferApi::release`].
    pub async fn release(&self, handle: HandleKey) -> Result<bool, WorkerError> {
        self.inner.release(handle).await
    }

    /// Releases a handle in the background on the current runtime (none:
    /// nothing is sent); a failed release leaves the handle's lease to free
    /// its blocks. For a decode worker done reading, or a caller that will
    /// not pass the handle on (a cancelled request).
    pub fn release_in_background(&self, handle: HandleKey) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.clone();
        runtime.spawn(async move {
            if let Err(error) = client.release(handle).await {
                tracing::debug!(handle_id = handle.id, %error, "releasing a KV handle failed; its lease frees it");
            }
        });
    }
}

/// [`KvTransferApi`] over gRPC; `ReadBlocks` is the TCP data path.
#[derive(Debug, Clone)]
pub struct GrpcKvTransfer {
    client: PbKvTransferClient<TracedChannel>,
}

#[tonic::async_trait]
impl KvTransferApi for GrpcKvTransfer {
    async fn describe(&self, handle: HandleKey) -> Result<Described, WorkerError> {
        let request = pb::DescribeRequest { handle_id: handle.id, token: handle.token.as_bytes().to_vec() };
        Ok(Described::try_from(self.client.clone().describe(request).await?.into_inner())?)
    }

    async fn read_blocks(&self, handle: HandleKey, indices: &[usize], block_bytes: usize, mut into: Vec<u8>) -> Result<Vec<u8>, WorkerError> {
        let request =
            pb::ReadBlocksRequest { handle_id: handle.id, token: handle.token.as_bytes().to_vec(), indices: indices.iter().map(|&i| i as u32).collect() };
        let mut stream = self.client.clone().read_blocks(request).await?.into_inner();
        into.clear();
        into.reserve(indices.len() * block_bytes);
        for &index in indices {
            let pb::BlockData { index: sent, data } = stream.next().await.ok_or_else(|| WorkerError::Unavailable("the block stream ended early".into()))??;
            if sent as usize != index || data.len() != block_bytes {
                return Err(WorkerError::Internal(format!("block {sent} of {} bytes where block {index} of {block_bytes} was due", data.len())));
            }
            into.extend_from_slice(&data);
        }
        Ok(into)
    }

    async fn release(&self, handle: HandleKey) -> Result<bool, WorkerError> {
        let request = pb::ReleaseRequest { handle_id: handle.id, token: handle.token.as_bytes().to_vec() };
        Ok(self.client.clone().release(request).await?.into_inner().released)
    }
}
