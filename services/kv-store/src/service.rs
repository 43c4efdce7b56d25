//! The gRPC shell over a [`Store`]: `turbine.kvstore.v1.KvStore`.

use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use turbine_kv::{LocalBlockHash, SequenceHash};
use turbine_proto::kvstore::v1::{self as pb, kv_store_server::KvStore};

use crate::keys::{Fingerprint, StoreError};
use crate::lease::DataPath;
use crate::store::{BlockRef, Store};
use crate::wire::{MAX_PUT_FROM_BYTES, from_pb, held_to_pb};

/// The service.
#[derive(Debug, Clone)]
pub struct KvStoreService {
    store: Store,
    max_blocks_per_call: usize,
    announced_as: Option<String>,
    data_path: Option<Arc<DataPath>>,
}

impl KvStoreService {
    /// Serves `store`; a Get or Lookup may name at most
    /// `max_blocks_per_call` blocks.
    pub fn new(store: Store, max_blocks_per_call: usize) -> Self {
        Self { store, max_blocks_per_call, announced_as: None, data_path: None }
    }

    /// Serves Lease and Release: remote readers copy blocks out of the
    /// store's arena over UCX.
    pub fn with_data_path(mut self, data_path: Arc<DataPath>) -> Self {
        self.data_path = Some(data_path);
        self
    }

    /// Says in Stats that the store's blocks are announced as store
    /// `store_id`'s.
    pub fn announcing_as(mut self, store_id: &str) -> Self {
        self.announced_as = Some(store_id.to_owned());
        self
    }

    fn hashes(&self, hashes: Vec<u64>) -> Result<Vec<SequenceHash>, Status> {
        if hashes.len() > self.max_blocks_per_call {
            return Err(Status::invalid_argument(format!("sequence_hashes: {} hashes, at most {} per call", hashes.len(), self.max_blocks_per_call)));
        }
        Ok(hashes.into_iter().map(SequenceHash).collect())
    }
}

fn fingerprint(value: u64) -> Result<Fingerprint, Status> {
    Fingerprint::new(value).ok_or_else(|| Status::invalid_argument("fingerprint: must be set (nonzero)"))
}

fn status(error: StoreError) -> Status {
    match error {
        StoreError::TooLarge(..) => Status::resource_exhausted(error.to_string()),
        StoreError::Corrupt(_) | StoreError::WrongSize { .. } => Status::invalid_argument(error.to_string()),
    }
}

type GetStream = Pin<Box<dyn Stream<Item = Result<pb::GetResponse, Status>> + Send>>;
type DumpStream = Pin<Box<dyn Stream<Item = Result<pb::DumpResponse, Status>> + Send>>;

/// How long the store waits for its read of staged blocks.
const PUT_FROM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Blocks per Dump message (16 bytes each on the wire).
const DUMP_CHUNK: usize = 65_536;

#[tonic::async_trait]
impl KvStore for KvStoreService {
    async fn put(&self, request: Request<Streaming<pb::PutRequest>>) -> Result<Response<pb::PutResponse>, Status> {
        let mut stream = request.into_inner();
        let mut stream_fingerprint = None;
        let mut response = pb::PutResponse::default();
        while let Some(message) = stream.next().await {
            // tonic reports a streamed message over the size limit as
            // OUT_OF_RANGE; it is the same refusal as a unary one's.
            let pb::PutRequest { fingerprint: value, blocks } =
                message.map_err(|status| if status.code() == tonic::Code::OutOfRange { Status::resource_exhausted(status.message()) } else { status })?;
            let fingerprint = fingerprint(value)?;
            if *stream_fingerprint.get_or_insert(fingerprint) != fingerprint {
                return Err(Status::invalid_argument("fingerprint: changed within one Put stream"));
            }
            let store = self.store.clone();
            let blocks: Vec<_> = blocks.into_iter().map(from_pb).collect();
            // Checksumming is CPU work: off the runtime's threads.
            let outcome = tokio::task::spawn_blocking(move || store.put(fingerprint, blocks))
                .await
                .map_err(|_| Status::internal("the store failed while storing blocks"))?
                .map_err(status)?;
            response.stored += outcome.stored;
            response.already_held += outcome.already_held;
        }
        Ok(Response::new(response))
    }

    type GetStream = GetStream;

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<GetStream>, Status> {
        let pb::GetRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        let hashes = self.hashes(sequence_hashes)?;
        let store = self.store.clone();
        let run = tokio::task::spawn_blocking(move || store.get(fingerprint, &hashes))
            .await
            .map_err(|_| Status::internal("the store failed while reading blocks"))?;
        let stream = tokio_stream::iter(run).map(|(sequence, block)| Ok(pb::GetResponse { block: Some(held_to_pb(sequence, &block)) }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn lookup(&self, request: Request<pb::LookupRequest>) -> Result<Response<pb::LookupResponse>, Status> {
        let pb::LookupRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        let hashes = self.hashes(sequence_hashes)?;
        let (present, leading) = self.store.lookup(fingerprint, &hashes);
        Ok(Response::new(pb::LookupResponse { present, leading: leading as u32 }))
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Result<Response<pb::DeleteResponse>, Status> {
        let pb::DeleteRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        let hashes: Vec<SequenceHash> = sequence_hashes.into_iter().map(SequenceHash).collect();
        let store = self.store.clone();
        let deleted = tokio::task::spawn_blocking(move || store.delete(fingerprint, &hashes))
            .await
            .map_err(|_| Status::internal("the store failed while deleting blocks"))?;
        Ok(Response::new(pb::DeleteResponse { deleted }))
    }

    type DumpStream = DumpStream;

    async fn dump(&self, request: Request<pb::DumpRequest>) -> Result<Response<DumpStream>, Status> {
        let fingerprint = fingerprint(request.into_inner().fingerprint)?;
        let announcer = self.store.announcer();
        let instance = announcer.instance();
        let dump = announcer.dump(fingerprint);
        let next_event_id = dump.next_event_id;
        let mut messages: Vec<pb::DumpResponse> = dump
            .blocks
            .chunks(DUMP_CHUNK)
            .map(|chunk| pb::DumpResponse {
                instance,
                next_event_id,
                sequence_hashes: chunk.iter().map(|block| block.sequence_hash.0).collect(),
                local_hashes: chunk.iter().map(|block| block.local_hash.0).collect(),
            })
            .collect();
        if messages.is_empty() {
            messages.push(pb::DumpResponse { instance, next_event_id, ..Default::default() });
        }
        Ok(Response::new(Box::pin(tokio_stream::iter(messages.into_iter().map(Ok)))))
    }

    async fn lease(&self, request: Request<pb::LeaseRequest>) -> Result<Response<pb::LeaseResponse>, Status> {
        let Some(data_path) = self.data_path.clone() else {
            return Err(Status::failed_precondition("this kv-store has no UCX data path; read with Get"));
        };
        let pb::LeaseRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        let hashes = self.hashes(sequence_hashes)?;
        let store = self.store.clone();
        let run = tokio::task::spawn_blocking(move || store.get_unchecked(fingerprint, &hashes))
            .await
            .map_err(|_| Status::internal("the store failed while reading blocks"))?;
        let blocks: Vec<pb::LeasedBlock> = run
            .iter()
            .map(|(sequence, block)| pb::LeasedBlock {
                sequence_hash: sequence.0,
                local_hash: block.local.0,
                parent_hash: block.parent.map(|p| p.0),
                checksum: block.checksum,
                length: block.slots.len() as u64,
                segments: block.slots.segments().to_vec(),
            })
            .collect();
        let lease_id = if run.is_empty() {
            0
        } else {
            data_path.grant(run.into_iter().map(|(_, block)| block).collect()).map_err(|error| Status::resource_exhausted(error.to_string()))?
        };
        Ok(Response::new(pb::LeaseResponse {
            lease_id,
            expires_in_ms: data_path.ttl().as_millis() as u64,
            segment_bytes: self.store.arena().segment().unwrap_or_default() as u64,
            region: Some(data_path.region().into()),
            blocks,
        }))
    }

    async fn put_from(&self, request: Request<pb::PutFromRequest>) -> Result<Response<pb::PutResponse>, Status> {
        let Some(data_path) = self.data_path.clone() else {
            return Err(Status::failed_precondition("this kv-store has no UCX data path; put with Put"));
        };
        let pb::PutFromRequest { fingerprint: value, region, blocks } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        if blocks.len() > self.max_blocks_per_call {
            return Err(Status::invalid_argument(format!("blocks: {} blocks, at most {} per call", blocks.len(), self.max_blocks_per_call)));
        }
        let Some(first) = blocks.first() else { return Ok(Response::new(pb::PutResponse::default())) };
        let region = turbine_api::UcxRegion::from(region.ok_or_else(|| Status::invalid_argument("region: must be set"))?);
        let length = first.length;
        if length == 0 || blocks.iter().any(|block| block.length != length) {
            return Err(Status::invalid_argument("blocks: every block must have the same nonzero length"));
        }
        if length.saturating_mul(blocks.len() as u64) > MAX_PUT_FROM_BYTES {
            return Err(Status::invalid_argument(format!("blocks: more than {} MiB in one call", MAX_PUT_FROM_BYTES >> 20)));
        }
        if let Some(block) = blocks.iter().find(|block| block.offset.checked_add(length).is_none_or(|end| end > region.length)) {
            return Err(Status::invalid_argument(format!("blocks: block {:016x} lies outside the region", block.sequence_hash)));
        }
        let offsets: Vec<u64> = blocks.iter().map(|block| block.offset).collect();
        // Checked and copied into the arena straight from the read buffer.
        let store = self.store.clone();
        let outcome = data_path
            .read_staged(&region, &offsets, length as usize, PUT_FROM_TIMEOUT, move |bytes| {
                let refs: Vec<(SequenceHash, BlockRef<'_>)> = blocks
                    .iter()
                    .zip(bytes.chunks(length as usize))
                    .map(|(block, bytes)| {
                        let parent = block.parent_hash.map(SequenceHash);
                        (SequenceHash(block.sequence_hash), BlockRef { local: LocalBlockHash(block.local_hash), parent, checksum: block.checksum, bytes })
                    })
                    .collect();
                store.put_refs(fingerprint, &refs)
            })
            .await
            .map_err(|error| Status::unavailable(format!("cannot read the staged blocks: {error}")))?
            .map_err(status)?;
        Ok(Response::new(pb::PutResponse { stored: outcome.stored, already_held: outcome.already_held }))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        if let Some(data_path) = &self.data_path {
            data_path.release(request.into_inner().lease_id);
        }
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(self.store.stats().to_pb(self.announced_as.clone())))
    }
}
