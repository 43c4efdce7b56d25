//! The kv-store's client: [`KvStoreApi`] (what a store does for its
//! callers), [`GrpcKvStore`] (that over `turbine.kvstore.v1`), and
//! [`KvStoreClient`], the handle callers hold. Domain types in and out;
//! the contract's messages convert here and nowhere else on the caller's
//! side, and every failure is a [`KvStoreError`].

use std::sync::Arc;

use tokio_stream::StreamExt;
use turbine_kv::{CachedBlock, Dump, HostBlock, KvTenant, LocalBlockHash, SequenceHash, Tier, TierSet};
use turbine_proto::MessageLimits;
use turbine_proto::kvstore::v1::{self as pb, kv_store_client::KvStoreClient as PbClient};
use turbine_runtime::grpc::TracedChannel;
use turbine_runtime::host::Role;

use super::{Fingerprint, Lease, LeasedBlock, PutOutcome, StoreStats, TierUsage};
use crate::error::{ApiError, ErrorCode, from_status};

/// The role a kv-store's certificate names: who this client calls.
pub const ROLE: Role = Role::KvStore;

/// Most bytes one PutFrom may stage (the store reads them into one buffer).
/// (Counted beyond the memory tier: keep it small next to it.)
pub const MAX_PUT_FROM_BYTES: u64 = 16 << 20;

/// Block bytes sent per Put message at most (well under the message limit).
const PUT_MESSAGE_BYTES: usize = turbine_proto::MAX_MESSAGE_BYTES / 4;

/// Why a call to the store failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvStoreError {
    /// The call was malformed (a zero fingerprint, too many blocks, a block
    /// that does not match its checksum or its fingerprint's size).
    #[error("the kv-store refused the call: {0}")]
    Invalid(String),
    /// The store cannot serve this call as configured (no UCX data path).
    #[error("the kv-store cannot: {0}")]
    NotServed(String),
    /// The store or its leases are full.
    #[error("the kv-store is full: {0}")]
    Full(String),
    /// Bytes were damaged on the way (a block read over UCX failed its
    /// checksum).
    #[error("kv-store blocks were damaged: {0}")]
    Damaged(String),
    /// The store could not be reached in time, or the endpoint is
    /// malformed.
    #[error("kv-store unavailable: {0}")]
    Unavailable(String),
    /// The caller may not make this call.
    #[error("the kv-store denied the call ({code:?}): {message}")]
    Denied {
        /// Unauthenticated or PermissionDenied.
        code: ErrorCode,
        /// The store's words.
        message: String,
    },
    /// The store failed, or answered what this client does not understand.
    #[error("the kv-store failed ({code:?}): {message}")]
    Failed {
        /// Its kind.
        code: ErrorCode,
        /// The store's words.
        message: String,
    },
}

impl ApiError for KvStoreError {
    fn code(&self) -> ErrorCode {
        match self {
            KvStoreError::Invalid(_) => ErrorCode::InvalidArgument,
            KvStoreError::NotServed(_) => ErrorCode::FailedPrecondition,
            KvStoreError::Full(_) => ErrorCode::ResourceExhausted,
            KvStoreError::Damaged(_) => ErrorCode::DataLoss,
            KvStoreError::Unavailable(_) => ErrorCode::Unavailable,
            KvStoreError::Denied { code, .. } | KvStoreError::Failed { code, .. } => *code,
        }
    }

    fn message(&self) -> String {
        match self {
            KvStoreError::Invalid(message)
            | KvStoreError::NotServed(message)
            | KvStoreError::Full(message)
            | KvStoreError::Damaged(message)
            | KvStoreError::Unavailable(message)
            | KvStoreError::Denied { message, .. }
            | KvStoreError::Failed { message, .. } => message.clone(),
        }
    }

    fn from_parts(code: ErrorCode, _reason: Option<&str>, message: String) -> Self {
        match code {
            ErrorCode::InvalidArgument => KvStoreError::Invalid(message),
            ErrorCode::FailedPrecondition => KvStoreError::NotServed(message),
            ErrorCode::ResourceExhausted => KvStoreError::Full(message),
            ErrorCode::DataLoss => KvStoreError::Damaged(message),
            ErrorCode::Unavailable => KvStoreError::Unavailable(message),
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => KvStoreError::Denied { code, message },
            ErrorCode::NotFound | ErrorCode::DeadlineExceeded | ErrorCode::Cancelled | ErrorCode::Unimplemented | ErrorCode::Internal => {
                KvStoreError::Failed { code, message }
            }
        }
    }
}

impl From<tonic::Status> for KvStoreError {
    fn from(status: tonic::Status) -> Self {
        from_status(&status)
    }
}

/// What a kv-store does for its callers: [`GrpcKvStore`] over the wire,
/// or a test's double.
#[cfg_attr(feature = "mock", mockall::automock)]
#[tonic::async_trait]
pub trait KvStoreApi: Send + Sync + 'static {
    /// Stores blocks of one fingerprint.
    async fn put(&self, fingerprint: Fingerprint, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> Result<PutOutcome, KvStoreError>;

    /// The leading blocks of `hashes` the store holds, in order, each
    /// intact (the run ends before the first that is not).
    async fn get(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Vec<(SequenceHash, HostBlock)>, KvStoreError>;

    /// Leases the leading blocks of `hashes` the store holds in memory, for
    /// reading over UCX.
    async fn lease(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Lease, KvStoreError>;

    /// Stores blocks staged at `i × length` of the caller's `region`.
    async fn put_from(
        &self,
        fingerprint: Fingerprint,
        region: &crate::UcxRegion,
        blocks: &[(SequenceHash, Arc<HostBlock>)],
    ) -> Result<PutOutcome, KvStoreError>;

    /// Lets go of a lease.
    async fn release(&self, lease_id: u64) -> Result<(), KvStoreError>;

    /// Which of `hashes` the store holds, and how many lead without a gap.
    async fn lookup(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<(Vec<bool>, usize), KvStoreError>;

    /// Drops blocks of a fingerprint (all of them when `hashes` is empty);
    /// how many were held.
    async fn delete(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<u64, KvStoreError>;

    /// Every block of `fingerprint` the store holds, as of its announced
    /// events, with the store's incarnation.
    async fn dump(&self, fingerprint: Fingerprint) -> Result<(u64, Dump), KvStoreError>;

    /// The store's sizes and counters, and the id it announces its blocks
    /// under in the KV event log (None: it announces nothing).
    async fn stats(&self) -> Result<(StoreStats, Option<String>), KvStoreError>;
}

/// A kv-store, over gRPC or a test's double; cheap to clone (clones share
/// the connection).
#[derive(Clone)]
pub struct KvStoreClient {
    inner: Arc<dyn KvStoreApi>,
}

impl std::fmt::Debug for KvStoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStoreClient").finish_non_exhaustive()
    }
}

impl KvStoreClient {
    /// A client calling `store` directly.
    pub fn new(store: Arc<dyn KvStoreApi>) -> Self {
        Self { inner: store }
    }

    /// The store at `endpoint` (`http://host:port`), over the process's
    /// shared channel to it (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, KvStoreError> {
        Ok(Self::new(Arc::new(GrpcKvStore::connect(endpoint)?)))
    }

    /// Stores blocks of one fingerprint.
    pub async fn put(&self, fingerprint: Fingerprint, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> Result<PutOutcome, KvStoreError> {
        self.inner.put(fingerprint, blocks).await
    }

    /// The leading blocks of `hashes` the store holds, in order; each is
    /// checked against its checksum on arrival, and the run ends before the
    /// first that fails (never returned).
    pub async fn get(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Vec<(SequenceHash, HostBlock)>, KvStoreError> {
        self.inner.get(fingerprint, hashes).await
    }

    /// Leases the leading blocks of `hashes` the store holds in memory, for
    /// reading over UCX (see [`Lease`]); release it when read.
    pub async fn lease(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Lease, KvStoreError> {
        self.inner.lease(fingerprint, hashes).await
    }

    /// Stores blocks of one fingerprint and one length that are staged at
    /// `i × length` of the caller's `region` (block `i`): the store reads
    /// them over UCX. The staged bytes must stay unchanged until this
    /// returns.
    pub async fn put_from(
        &self,
        fingerprint: Fingerprint,
        region: &crate::UcxRegion,
        blocks: &[(SequenceHash, Arc<HostBlock>)],
    ) -> Result<PutOutcome, KvStoreError> {
        self.inner.put_from(fingerprint, region, blocks).await
    }

    /// Lets go of a lease.
    pub async fn release(&self, lease_id: u64) -> Result<(), KvStoreError> {
        self.inner.release(lease_id).await
    }

    /// Which of `hashes` the store holds, and how many lead without a gap.
    pub async fn lookup(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<(Vec<bool>, usize), KvStoreError> {
        self.inner.lookup(fingerprint, hashes).await
    }

    /// Drops blocks of a fingerprint (all of them when `hashes` is empty);
    /// returns how many were held.
    pub async fn delete(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<u64, KvStoreError> {
        self.inner.delete(fingerprint, hashes).await
    }

    /// Every block of `fingerprint` the store holds, as of its announced
    /// events (with the store's incarnation).
    pub async fn dump(&self, fingerprint: Fingerprint) -> Result<(u64, Dump), KvStoreError> {
        self.inner.dump(fingerprint).await
    }

    /// The id the store announces its blocks under in the KV event log
    /// (None: it announces nothing).
    pub async fn announced_as(&self) -> Result<Option<String>, KvStoreError> {
        Ok(self.inner.stats().await?.1)
    }

    /// The store's sizes and counters.
    pub async fn stats(&self) -> Result<StoreStats, KvStoreError> {
        Ok(self.inner.stats().await?.0)
    }
}

/// [`KvStoreApi`] over `turbine.kvstore.v1`.
#[derive(Debug, Clone)]
pub struct GrpcKvStore {
    client: PbClient<TracedChannel>,
}

impl GrpcKvStore {
    /// The store at `endpoint`, over the process's shared channel to it.
    pub fn connect(endpoint: &str) -> Result<Self, KvStoreError> {
        let channel = turbine_runtime::grpc::channel(endpoint, ROLE)
            .map_err(|error| KvStoreError::Unavailable(format!("bad kv-store endpoint {endpoint:?}: {error}")))?;
        Ok(Self { client: PbClient::new(channel).with_message_limits() })
    }
}

fn hashes_of(hashes: &[SequenceHash]) -> Vec<u64> {
    hashes.iter().map(|hash| hash.0).collect()
}

#[tonic::async_trait]
impl KvStoreApi for GrpcKvStore {
    async fn put(&self, fingerprint: Fingerprint, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> Result<PutOutcome, KvStoreError> {
        // As few messages of one stream as the message limit allows.
        let mut messages = Vec::new();
        let mut current = pb::PutRequest { fingerprint: fingerprint.get(), blocks: Vec::new() };
        let mut bytes = 0;
        for (sequence, block) in blocks {
            if bytes + block.bytes.len() > PUT_MESSAGE_BYTES && !current.blocks.is_empty() {
                messages.push(std::mem::replace(&mut current, pb::PutRequest { fingerprint: fingerprint.get(), blocks: Vec::new() }));
                bytes = 0;
            }
            bytes += block.bytes.len();
            current.blocks.push(block_to_pb(*sequence, block));
        }
        messages.push(current);
        let pb::PutResponse { stored, already_held } = self.client.clone().put(tokio_stream::iter(messages)).await?.into_inner();
        Ok(PutOutcome { stored, already_held })
    }

    async fn get(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Vec<(SequenceHash, HostBlock)>, KvStoreError> {
        let request = pb::GetRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes_of(hashes) };
        let mut stream = self.client.clone().get(request).await?.into_inner();
        let mut run = Vec::new();
        while let Some(message) = stream.next().await {
            let Some(block) = message?.block else { break };
            let (sequence, block) = block_from_pb(block);
            if hashes.get(run.len()) != Some(&sequence) || !block.is_intact() {
                tracing::warn!(sequence_hash = sequence.0, "a block from the kv-store is out of order or fails its checksum; not used");
                break;
            }
            run.push((sequence, block));
        }
        Ok(run)
    }

    async fn lease(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Lease, KvStoreError> {
        let request = pb::LeaseRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes_of(hashes) };
        let pb::LeaseResponse { lease_id, expires_in_ms: _, segment_bytes, region, blocks } = self.client.clone().lease(request).await?.into_inner();
        Ok(Lease {
            id: lease_id,
            region: region.map(Into::into).unwrap_or_default(),
            segment_bytes: segment_bytes as usize,
            blocks: blocks
                .into_iter()
                .map(|pb::LeasedBlock { sequence_hash, local_hash, parent_hash, checksum, length, segments }| LeasedBlock {
                    sequence: SequenceHash(sequence_hash),
                    local: LocalBlockHash(local_hash),
                    parent: parent_hash.map(SequenceHash),
                    checksum,
                    length: length as usize,
                    segments,
                })
                .collect(),
        })
    }

    async fn put_from(
        &self,
        fingerprint: Fingerprint,
        region: &crate::UcxRegion,
        blocks: &[(SequenceHash, Arc<HostBlock>)],
    ) -> Result<PutOutcome, KvStoreError> {
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
                    tenant: block.tenant.get(),
                })
                .collect(),
        };
        let pb::PutResponse { stored, already_held } = self.client.clone().put_from(request).await?.into_inner();
        Ok(PutOutcome { stored, already_held })
    }

    async fn release(&self, lease_id: u64) -> Result<(), KvStoreError> {
        self.client.clone().release(pb::ReleaseRequest { lease_id }).await?;
        Ok(())
    }

    async fn lookup(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<(Vec<bool>, usize), KvStoreError> {
        let request = pb::LookupRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes_of(hashes) };
        let pb::LookupResponse { present, leading } = self.client.clone().lookup(request).await?.into_inner();
        Ok((present, leading as usize))
    }

    async fn delete(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<u64, KvStoreError> {
        let request = pb::DeleteRequest { fingerprint: fingerprint.get(), sequence_hashes: hashes_of(hashes) };
        Ok(self.client.clone().delete(request).await?.into_inner().deleted)
    }

    async fn dump(&self, fingerprint: Fingerprint) -> Result<(u64, Dump), KvStoreError> {
        let mut stream = self.client.clone().dump(pb::DumpRequest { fingerprint: fingerprint.get() }).await?.into_inner();
        let (mut instance, mut dump) = (0, Dump::default());
        while let Some(message) = stream.next().await {
            let pb::DumpResponse { instance: of, next_event_id, sequence_hashes, local_hashes } = message?;
            if sequence_hashes.len() != local_hashes.len() {
                return Err(KvStoreError::Failed { code: ErrorCode::Internal, message: "a dump's hashes and local hashes differ in number".into() });
            }
            (instance, dump.next_event_id) = (of, next_event_id);
            let tiers = TierSet(Tier::Remote.bit());
            dump.blocks.extend(sequence_hashes.into_iter().zip(local_hashes).map(|(sequence, local)| CachedBlock {
                sequence_hash: SequenceHash(sequence),
                local_hash: LocalBlockHash(local),
                tiers,
            }));
        }
        Ok((instance, dump))
    }

    async fn stats(&self) -> Result<(StoreStats, Option<String>), KvStoreError> {
        let response = self.client.clone().stats(pb::StatsRequest {}).await?.into_inner();
        let store_id = (!response.store_id.is_empty()).then(|| response.store_id.clone());
        Ok((StoreStats::from(response), store_id))
    }
}

/// A block off the wire.
pub fn block_from_pb(block: pb::Block) -> (SequenceHash, HostBlock) {
    let pb::Block { sequence_hash, local_hash, parent_hash, checksum, data, tenant } = block;
    (
        SequenceHash(sequence_hash),
        HostBlock {
            local: LocalBlockHash(local_hash),
            parent: parent_hash.map(SequenceHash),
            checksum,
            bytes: data.into_boxed_slice(),
            tenant: KvTenant::new(tenant),
        },
    )
}

/// A block for the wire (as put: its tenant named).
pub fn block_to_pb(sequence: SequenceHash, block: &HostBlock) -> pb::Block {
    pb::Block { tenant: block.tenant.get(), ..block_message(sequence, block.local, block.parent, block.checksum, block.bytes.to_vec()) }
}

/// A block for the wire, from its parts, its tenant unset (as Get answers:
/// a store's held blocks are not [`HostBlock`]s).
pub fn block_message(sequence: SequenceHash, local: LocalBlockHash, parent: Option<SequenceHash>, checksum: u64, data: Vec<u8>) -> pb::Block {
    pb::Block { sequence_hash: sequence.0, local_hash: local.0, parent_hash: parent.map(|p| p.0), checksum, data, tenant: 0 }
}

impl From<pb::TierStats> for TierUsage {
    fn from(stats: pb::TierStats) -> Self {
        let pb::TierStats { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks } = stats;
        TierUsage { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks }
    }
}

impl From<TierUsage> for pb::TierStats {
    fn from(usage: TierUsage) -> Self {
        let TierUsage { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks } = usage;
        pb::TierStats { blocks, bytes, capacity_bytes, evicted_blocks, corrupt_blocks }
    }
}

impl From<pb::StatsResponse> for StoreStats {
    /// The store's id is read apart (see [`KvStoreApi::stats`]).
    fn from(stats: pb::StatsResponse) -> Self {
        let pb::StatsResponse { memory, disk, put_blocks, get_blocks, misses, fingerprints, store_id: _, tenants } = stats;
        StoreStats { memory: memory.unwrap_or_default().into(), disk: disk.unwrap_or_default().into(), put_blocks, get_blocks, misses, fingerprints, tenants }
    }
}

impl StoreStats {
    /// The Stats answer of a store announcing its blocks as `store_id`
    /// (None: it announces nothing).
    pub fn to_pb(self, store_id: Option<String>) -> pb::StatsResponse {
        let StoreStats { memory, disk, put_blocks, get_blocks, misses, fingerprints, tenants } = self;
        pb::StatsResponse {
            memory: Some(memory.into()),
            disk: Some(disk.into()),
            put_blocks,
            get_blocks,
            misses,
            fingerprints,
            store_id: store_id.unwrap_or_default(),
            tenants,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::to_status;

    #[test]
    fn every_error_a_store_sends_comes_back_as_itself() {
        for code in ErrorCode::ALL {
            let error = KvStoreError::from_parts(code, None, format!("{code:?} happened"));
            assert_eq!(error.code(), code);
            let status = to_status(&error);
            assert_eq!(status.code(), tonic::Code::from(code));
            assert_eq!(status.message(), format!("{code:?} happened"), "the status carries the store's words, not the client's prefix");
            assert_eq!(KvStoreError::from(status), error);
        }
        let refused = KvStoreError::from(tonic::Status::failed_precondition("this kv-store has no UCX data path; read with Get"));
        assert!(matches!(refused, KvStoreError::NotServed(_)), "{refused:?}");
        let unknown = KvStoreError::from(tonic::Status::unknown("?"));
        assert_eq!(unknown.code(), ErrorCode::Internal);
    }

    #[test]
    fn stats_convert_both_ways() {
        let stats = StoreStats {
            memory: TierUsage { blocks: 1, bytes: 2, capacity_bytes: 3, evicted_blocks: 4, corrupt_blocks: 5 },
            disk: TierUsage { blocks: 6, bytes: 7, capacity_bytes: 8, evicted_blocks: 9, corrupt_blocks: 10 },
            put_blocks: 11,
            get_blocks: 12,
            misses: 13,
            fingerprints: 14,
            tenants: 15,
        };
        let wire = stats.to_pb(Some("s".into()));
        assert_eq!(wire.store_id, "s");
        assert_eq!(StoreStats::from(wire), stats);
    }
}
