//! `turbine.worker.v1.KvTransfer`: the control path of KV transfers (and
//! the TCP data path, `ReadBlocks`).

use std::pin::Pin;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_proto::worker::v1 as pb;

use crate::service::WorkerService;

/// The KvTransfer service of the worker behind a [`WorkerService`].
#[derive(Debug, Clone)]
pub struct KvTransferService {
    worker: WorkerService,
}

impl KvTransferService {
    /// Serves the transfers of `worker`'s (eventually loaded) worker.
    pub fn new(worker: WorkerService) -> Self {
        Self { worker }
    }
}

type BlockStream = Pin<Box<dyn Stream<Item = Result<pb::BlockData, Status>> + Send>>;

#[tonic::async_trait]
impl pb::kv_transfer_server::KvTransfer for KvTransferService {
    type ReadBlocksStream = BlockStream;

    async fn describe(&self, request: Request<pb::DescribeRequest>) -> Result<Response<pb::DescribeResponse>, Status> {
        let worker = self.worker.worker()?;
        Ok(Response::new(worker.disagg().describe(request.into_inner().handle_id)?))
    }

    async fn read_blocks(&self, request: Request<pb::ReadBlocksRequest>) -> Result<Response<BlockStream>, Status> {
        let worker = self.worker.worker()?.clone();
        let request = request.into_inner();
        let handle_id = request.handle_id;
        let indices: Vec<u32> = if request.indices.is_empty() {
            let count = worker.disagg().block_count(handle_id)?;
            (0..count as u32).collect()
        } else {
            request.indices
        };
        // One block at a time, copied under the pin table's lock.
        let stream = futures::stream::iter(indices).map(move |index| {
            let data = worker.disagg().copy_block(handle_id, index as usize)?;
            Ok(pb::BlockData { index, data })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        let worker = self.worker.worker()?;
        Ok(Response::new(pb::ReleaseResponse { released: worker.disagg().release(request.into_inner().handle_id) }))
    }
}
