//! `turbine.worker.v1.KvTransfer`: the control path of KV transfers (and
//! the TCP data path, `ReadBlocks`).

use std::pin::Pin;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_proto::worker::v1 as pb;

use std::sync::{Arc, OnceLock};

use super::Disagg;

/// The KvTransfer service of a worker; UNAVAILABLE until its state is set
/// (the model is still loading).
#[derive(Debug, Clone, Default)]
pub struct KvTransferService {
    disagg: Arc<OnceLock<Arc<Disagg>>>,
}

impl KvTransferService {
    /// A service whose worker is still loading.
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves `disagg`'s handles from now on.
    pub fn set(&self, disagg: Arc<Disagg>) {
        let _ = self.disagg.set(disagg);
    }

    fn disagg(&self) -> Result<&Arc<Disagg>, Status> {
        self.disagg.get().ok_or_else(|| Status::unavailable("the worker is still loading its model"))
    }
}

type BlockStream = Pin<Box<dyn Stream<Item = Result<pb::BlockData, Status>> + Send>>;

#[tonic::async_trait]
impl pb::kv_transfer_server::KvTransfer for KvTransferService {
    type ReadBlocksStream = BlockStream;

    async fn describe(&self, request: Request<pb::DescribeRequest>) -> Result<Response<pb::DescribeResponse>, Status> {
        Ok(Response::new(self.disagg()?.describe(request.into_inner().handle_id)?))
    }

    async fn read_blocks(&self, request: Request<pb::ReadBlocksRequest>) -> Result<Response<BlockStream>, Status> {
        let disagg = self.disagg()?.clone();
        let request = request.into_inner();
        let handle_id = request.handle_id;
        let indices: Vec<u32> = if request.indices.is_empty() {
            let count = disagg.block_count(handle_id)?;
            (0..count as u32).collect()
        } else {
            request.indices
        };
        // One block at a time, copied under the pin table's lock.
        let stream = futures::stream::iter(indices).map(move |index| {
            let data = disagg.copy_block(handle_id, index as usize)?;
            Ok(pb::BlockData { index, data })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        Ok(Response::new(pb::ReleaseResponse { released: self.disagg()?.release(request.into_inner().handle_id) }))
    }
}
