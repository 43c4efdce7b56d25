//! The gRPC shell over a [`LocalKvStore`]: `turbine.kvstore.v1.KvStore`.
//! Each rpc reads its message into the store's words, calls the store as
//! an in-process caller would, and answers its result or its refusal
//! (`turbine_api::to_status`).

use std::pin::Pin;

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use turbine_api::kv_store::{KvStoreApi, KvStoreError};
use turbine_api::to_status;
use turbine_kv::{KvTenant, LocalBlockHash, SequenceHash};
use turbine_proto::kvstore::v1::{self as pb, kv_store_server::KvStore};

use crate::keys::{Fingerprint, TenantScope};
use crate::local::{LocalKvStore, StagedBlock};
use crate::wire::{from_pb, held_to_pb};

/// The service.
#[derive(Debug, Clone)]
pub struct KvStoreService {
    local: LocalKvStore,
}

impl KvStoreService {
    /// Serves `local`, the store as its process calls it.
    pub fn over(local: LocalKvStore) -> Self {
        Self { local }
    }
}

fn fingerprint(value: u64) -> Result<Fingerprint, Status> {
    Fingerprint::new(value).ok_or_else(|| Status::invalid_argument("fingerprint: must be set (nonzero)"))
}

fn hashes(values: Vec<u64>) -> Vec<SequenceHash> {
    values.into_iter().map(SequenceHash).collect()
}

/// Whose blocks the caller may write and read: its certificate's tenants
/// (every tenant's for a plaintext caller).
fn scope_of<T>(request: &Request<T>) -> TenantScope {
    TenantScope::of(request.extensions().get::<turbine_runtime::trust::Peer>())
}

fn refused(error: KvStoreError) -> Status {
    to_status(&error)
}

type GetStream = Pin<Box<dyn Stream<Item = Result<pb::GetResponse, Status>> + Send>>;
type DumpStream = Pin<Box<dyn Stream<Item = Result<pb::DumpResponse, Status>> + Send>>;

/// Blocks per Dump message (16 bytes each on the wire).
const DUMP_CHUNK: usize = 65_536;

#[tonic::async_trait]
impl KvStore for KvStoreService {
    async fn put(&self, request: Request<Streaming<pb::PutRequest>>) -> Result<Response<pb::PutResponse>, Status> {
        let scope = scope_of(&request);
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
            let outcome = self.local.put_owned(fingerprint, blocks.into_iter().map(from_pb).collect(), &scope).await.map_err(refused)?;
            response.stored += outcome.stored;
            response.already_held += outcome.already_held;
        }
        Ok(Response::new(response))
    }

    type GetStream = GetStream;

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<GetStream>, Status> {
        let scope = scope_of(&request);
        let pb::GetRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        // The held blocks go on the wire straight off the arena.
        let run = self.local.held(fingerprint(value)?, hashes(sequence_hashes), &scope).await.map_err(refused)?;
        let stream = tokio_stream::iter(run).map(|(sequence, block)| Ok(pb::GetResponse { block: Some(held_to_pb(sequence, &block)) }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn lookup(&self, request: Request<pb::LookupRequest>) -> Result<Response<pb::LookupResponse>, Status> {
        let scope = scope_of(&request);
        let pb::LookupRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let (present, leading) = self.local.lookup_for(fingerprint(value)?, &hashes(sequence_hashes), &scope).map_err(refused)?;
        Ok(Response::new(pb::LookupResponse { present, leading: leading as u32 }))
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Result<Response<pb::DeleteResponse>, Status> {
        let pb::DeleteRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let deleted = self.local.delete(fingerprint(value)?, &hashes(sequence_hashes)).await.map_err(refused)?;
        Ok(Response::new(pb::DeleteResponse { deleted }))
    }

    type DumpStream = DumpStream;

    async fn dump(&self, request: Request<pb::DumpRequest>) -> Result<Response<DumpStream>, Status> {
        let (instance, dump) = self.local.dump_of(fingerprint(request.into_inner().fingerprint)?);
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
        let scope = scope_of(&request);
        let pb::LeaseRequest { fingerprint: value, sequence_hashes } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        let lease = self.local.lease_for(fingerprint, &hashes(sequence_hashes), &scope).await.map_err(refused)?;
        Ok(Response::new(pb::LeaseResponse {
            lease_id: lease.id,
            expires_in_ms: self.local.lease_ttl().as_millis() as u64,
            segment_bytes: lease.segment_bytes as u64,
            region: Some((&lease.region).into()),
            blocks: lease
                .blocks
                .into_iter()
                .map(|block| pb::LeasedBlock {
                    sequence_hash: block.sequence.0,
                    local_hash: block.local.0,
                    parent_hash: block.parent.map(|p| p.0),
                    checksum: block.checksum,
                    length: block.length as u64,
                    segments: block.segments,
                })
                .collect(),
        }))
    }

    async fn put_from(&self, request: Request<pb::PutFromRequest>) -> Result<Response<pb::PutResponse>, Status> {
        let scope = scope_of(&request);
        let pb::PutFromRequest { fingerprint: value, region, blocks } = request.into_inner();
        let fingerprint = fingerprint(value)?;
        let staged: Vec<StagedBlock> = blocks
            .into_iter()
            .map(|pb::StagedBlock { sequence_hash, local_hash, parent_hash, checksum, length, offset, tenant }| StagedBlock {
                sequence: SequenceHash(sequence_hash),
                local: LocalBlockHash(local_hash),
                parent: parent_hash.map(SequenceHash),
                checksum,
                length,
                offset,
                tenant: KvTenant::new(tenant),
            })
            .collect();
        let region = region.map(turbine_api::UcxRegion::from);
        if region.is_none() && !staged.is_empty() && self.local.has_data_path() {
            return Err(Status::invalid_argument("region: must be set"));
        }
        let outcome = self.local.put_staged(fingerprint, &region.unwrap_or_default(), staged, &scope).await.map_err(refused)?;
        Ok(Response::new(pb::PutResponse { stored: outcome.stored, already_held: outcome.already_held }))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.local.release(request.into_inner().lease_id).await.map_err(refused)?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        let (stats, announced_as) = self.local.stats().await.map_err(refused)?;
        Ok(Response::new(stats.to_pb(announced_as)))
    }
}
