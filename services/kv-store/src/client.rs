//! [`KvStoreClient`]: the typed client of `turbine.kvstore.v1` (domain types
//! in and out; the wire types stay here).

use std::sync::Arc;

use tokio_stream::StreamExt;
use turbine_engine::HostBlock;
use turbine_kv::SequenceHash;
use turbine_proto::MessageLimits;
use turbine_proto::kvstore::v1::{self as pb, kv_store_client::KvStoreClient as PbClient};
use turbine_runtime::grpc::TracedChannel;

use crate::keys::Fingerprint;
use crate::lease::{Lease, LeasedBlock};
use crate::store::PutOutcome;
use crate::wire::{from_pb, to_pb};

/// Why a call to the store failed.
#[derive(Debug, thiserror::Error)]
pub enum KvStoreClientError {
    /// The endpoint is malformed.
    #[error("bad kv-store endpoint {0:?}: {1}")]
    Endpoint(String, String),
    /// The store refused the call or could not be reached.
    #[error("kv-store: {0}")]
    Rpc(#[from] tonic::Status),
}

/// Block bytes sent per Put message at most (well under the message limit).
const PUT_MESSAGE_BYTES: usize = turbine_proto::MAX_MESSAGE_BYTES / 4;

/// A kv-store over gRPC. Cloning shares the connection.
#[derive(Debug, Clone)]
pub struct KvStoreClient {
    client: PbClient<TracedChannel>,
}

impl KvStoreClient {
    /// The store at `endpoint` (`http://host:port`), over the process's
    /// shared channel to it (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, KvStoreClientError> {
        let channel = turbine_runtime::grpc::channel(endpoint).map_err(|error| KvStoreClientError::Endpoint(endpoint.to_owned(), error.to_string()))?;
        Ok(Self { client: PbClient::new(channel).with_message_limits() })
    }

    /// Stores blocks of one fingerprint, in as few messages of one stream
    /// as the message limit allows.
    pub async fn put(&self, fingerprint: Fingerprint, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> Result<PutOutcome, KvStoreClientError> {
        let mut messages = Vec::new();
        let mut current = pb::PutRequest { fingerprint: fingerprint.get(), blocks: Vec::new() };
        let mut bytes = 0;
        for (sequence, block) in blocks {
            if bytes + block.bytes.len() > PUT_MESSAGE_BYTES && !current.blocks.is_empty() {
                messages.push(std::mem::replace(&mut current, pb::PutRequest { fingerprint: fingerprint.get(), blocks: Vec::new() }));
                bytes = 0;
            }
            bytes += block.bytes.len();
            current.blocks.push(to_pb(*sequence, block));
        }
        messages.push(current);
        let response = self.client.clone().put(tokio_stream::iter(messages)).await?.into_inner();
        Ok(PutOutcome { stored: response.stored, already_held: response.already_held })
    }

    /// The leading blocks of `hashes` the store holds, in order; each is
    /// checked against its checksum on arrival, and the run ends before the
    /// first that fails (never returned).
    pub async fn get(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Vec<(SequenceHash, HostBlock)>, KvStoreClientError> {
        let request = pb::GetRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes.iter().map(|h| h.0).collect() };
        let mut stream = self.client.clone().get(request).await?.into_inner();
        let mut run = Vec::new();
        while let Some(message) = stream.next().await {
            let Some(block) = message?.block else { break };
            let (sequence, block) = from_pb(block);
            if hashes.get(run.len()) != Some(&sequence) || !block.is_intact() {
                tracing::warn!(sequence_hash = sequence.0, "a block from the kv-store is out of order or fails its checksum; not used");
                break;
            }
            run.push((sequence, block));
        }
        Ok(run)
    }

    /// Leases the leading blocks of `hashes` the store holds in memory, for
    /// reading over UCX (see [`Lease`]); release it when read.
    pub async fn lease(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Lease, KvStoreClientError> {
        let request = pb::LeaseRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes.iter().map(|h| h.0).collect() };
        let pb::LeaseResponse { lease_id, expires_in_ms: _, segment_bytes, region, blocks } = self.client.clone().lease(request).await?.into_inner();
        Ok(Lease {
            id: lease_id,
            region: region.map(Into::into).unwrap_or_default(),
            segment_bytes: segment_bytes as usize,
            blocks: blocks
                .into_iter()
                .map(|block| LeasedBlock {
                    sequence: SequenceHash(block.sequence_hash),
                    local: turbine_kv::LocalBlockHash(block.local_hash),
                    parent: block.parent_hash.map(SequenceHash),
                    checksum: block.checksum,
                    length: block.length as usize,
                    segments: block.segments,
                })
                .collect(),
        })
    }

    /// Stores blocks of one fingerprint and one length that are staged at
    /// `i × length` of the caller's `region` (block `i`): the store reads
    /// them over UCX. The staged bytes must stay unchanged until this
    /// returns.
    pub async fn put_from(
        &self,
        fingerprint: Fingerprint,
        region: &turbine_engine::UcxRegion,
        blocks: &[(SequenceHash, Arc<HostBlock>)],
    ) -> Result<PutOutcome, KvStoreClientError> {
        let length = blocks.first().map_or(0, |(_, block)| block.bytes.len()) as u64;
        let request = pb::PutFromRequest {
            fingerprint: fingerprint.get(),
            region: Some(region.into()),
            blocks: blocks
                .iter()
                .enumerate()
                .map(|(i, (sequence, block))| pb::StagedBlock {
                    sequence_hash: sequence.0,
                    local_hash: block.local.0,
                    parent_hash: block.parent.map(|p| p.0),
                    checksum: block.checksum,
                    length: block.bytes.len() as u64,
                    offset: i as u64 * length,
                })
                .collect(),
        };
        let response = self.client.clone().put_from(request).await?.into_inner();
        Ok(PutOutcome { stored: response.stored, already_held: response.already_held })
    }

    /// Lets go of a lease.
    pub async fn release(&self, lease_id: u64) -> Result<(), KvStoreClientError> {
        self.client.clone().release(pb::ReleaseRequest { lease_id }).await?;
        Ok(())
    }

    /// Which of `hashes` the store holds, and how many lead without a gap.
    pub async fn lookup(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<(Vec<bool>, usize), KvStoreClientError> {
        let request = pb::LookupRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes.iter().map(|h| h.0).collect() };
        let response = self.client.clone().lookup(request).await?.into_inner();
        Ok((response.present, response.leading as usize))
    }

    /// Drops blocks of a fingerprint (all of them when `hashes` is empty);
    /// returns how many were held.
    pub async fn delete(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<u64, KvStoreClientError> {
        let request = pb::DeleteRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes.iter().map(|h| h.0).collect() };
        Ok(self.client.clone().delete(request).await?.into_inner().deleted)
    }

    /// Every block of `fingerprint` the store holds, as of its announced
    /// events (with the store's incarnation).
    pub async fn dump(&self, fingerprint: Fingerprint) -> Result<(u64, turbine_kv::Dump), KvStoreClientError> {
        let mut stream = self.client.clone().dump(pb::DumpRequest { fingerprint: fingerprint.get() }).await?.into_inner();
        let (mut instance, mut dump) = (0, turbine_kv::Dump::default());
        while let Some(message) = stream.next().await {
            let pb::DumpResponse { instance: of, next_event_id, sequence_hashes, local_hashes } = message?;
            if sequence_hashes.len() != local_hashes.len() {
                return Err(tonic::Status::internal("kv-store dump: hashes and local hashes differ in number").into());
            }
            (instance, dump.next_event_id) = (of, next_event_id);
            let tiers = turbine_kv::TierSet(turbine_kv::Tier::Remote.bit());
            dump.blocks.extend(sequence_hashes.into_iter().zip(local_hashes).map(|(sequence, local)| turbine_kv::CachedBlock {
                sequence_hash: SequenceHash(sequence),
                local_hash: turbine_kv::LocalBlockHash(local),
                tiers,
            }));
        }
        Ok((instance, dump))
    }

    /// The id the store announces its blocks under in the KV event log
    /// (None: it announces nothing).
    pub async fn announced_as(&self) -> Result<Option<String>, KvStoreClientError> {
        let store_id = self.client.clone().stats(pb::StatsRequest {}).await?.into_inner().store_id;
        Ok((!store_id.is_empty()).then_some(store_id))
    }

    /// The store's sizes and counters.
    pub async fn stats(&self) -> Result<crate::StoreStats, KvStoreClientError> {
        let pb::StatsResponse { memory, disk, put_blocks, get_blocks, misses, fingerprints, store_id: _ } =
            self.client.clone().stats(pb::StatsRequest {}).await?.into_inner();
        let tier = |stats: Option<pb::TierStats>| {
            let pb::TierStats { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks } = stats.unwrap_or_default();
            crate::TierUsage { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks }
        };
        Ok(crate::StoreStats { memory: tier(memory), disk: tier(disk), put_blocks, get_blocks, misses, fingerprints })
    }
}
