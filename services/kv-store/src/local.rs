//! The store as its callers use it, in its own process: [`LocalKvStore`]
//! implements `turbine_api::kv_store::KvStoreApi` over a [`Store`] (and its
//! UCX data path), with the store's limits and refusals. The gRPC shell
//! ([`crate::KvStoreService`]) is this behind `turbine.kvstore.v1`;
//! `turbine run` hands it to its workers, which call it directly.

use std::sync::Arc;
use std::time::Duration;

use turbine_api::ErrorCode;
use turbine_api::UcxRegion;
use turbine_api::kv_store::{KvStoreApi, KvStoreError, Lease, LeasedBlock, MAX_PUT_FROM_BYTES};
use turbine_kv::{Dump, HostBlock, KvTenant, LocalBlockHash, SequenceHash};

use crate::keys::{Fingerprint, StoreError, TenantScope};
use crate::lease::{DataPath, StagedReadError};
use crate::store::{BlockRef, MemoryBlock, PutOutcome, Store, StoreStats};

static OUT_OF_SCOPE: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_kv_store_tenant_refused_blocks_total",
        "Blocks of KV tenants a worker's certificate does not allow it (turbine certs --worker-tenant), by op: write (blocks of a Put or PutFrom refused whole with PERMISSION_DENIED), read (held, but not served nor reported held to it)",
        &["op"],
    )
});

/// Refuses a write of `blocks` (sequence hash, tenant) unless `scope`
/// allows every one of them (a strike against the caller's connection).
fn check_writes(scope: &TenantScope, blocks: impl Iterator<Item = (SequenceHash, KvTenant)>) -> Result<(), KvStoreError> {
    if *scope == TenantScope::Any {
        return Ok(());
    }
    let refused: Vec<(SequenceHash, KvTenant)> = blocks.filter(|&(_, tenant)| !scope.allows(tenant)).collect();
    let Some(&(sequence, tenant)) = refused.first() else { return Ok(()) };
    OUT_OF_SCOPE.with_label_values(&["write"]).inc_by(refused.len() as u64);
    // Refused call after call on one connection, the worker loses it.
    turbine_runtime::strikes::strike_caller();
    Err(KvStoreError::Denied { code: ErrorCode::PermissionDenied, message: scope.refusal(sequence, tenant) })
}

/// Ends `run` at its first block `scope` does not allow (the blocks not
/// served counted, as Lookup counts the blocks it hides).
fn within_scope<T>(scope: &TenantScope, run: &mut Vec<T>, tenant: impl Fn(&T) -> KvTenant) {
    if let Some(first) = run.iter().position(|block| !scope.allows(tenant(block))) {
        OUT_OF_SCOPE.with_label_values(&["read"]).inc_by((run.len() - first) as u64);
        run.truncate(first);
    }
}

/// How long the store waits for its read of staged blocks.
pub const PUT_FROM_TIMEOUT: Duration = Duration::from_secs(10);

/// A block staged in a caller's region, as PutFrom names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedBlock {
    /// The prefix it ends.
    pub sequence: SequenceHash,
    /// Hash of its own tokens.
    pub local: LocalBlockHash,
    /// The block before it.
    pub parent: Option<SequenceHash>,
    /// XXH3-64 of its bytes.
    pub checksum: u64,
    /// Its length in bytes.
    pub length: u64,
    /// Where it starts in the caller's region.
    pub offset: u64,
    /// Whose block it is.
    pub tenant: KvTenant,
}

/// The store, called in its own process. Cloning shares it.
#[derive(Debug, Clone)]
pub struct LocalKvStore {
    store: Store,
    max_blocks_per_call: usize,
    announced_as: Option<String>,
    data_path: Option<Arc<DataPath>>,
}

impl From<StoreError> for KvStoreError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::TooLarge(..) => KvStoreError::Full(error.to_string()),
            StoreError::Corrupt(_) | StoreError::WrongSize { .. } | StoreError::Undeclared(_) => KvStoreError::Invalid(error.to_string()),
        }
    }
}

/// The store's own work failed (its blocking task panicked).
fn failed(what: &str) -> KvStoreError {
    KvStoreError::Failed { code: ErrorCode::Internal, message: format!("the store failed while {what}") }
}

impl LocalKvStore {
    /// `store`; a call may name at most `max_blocks_per_call` blocks.
    pub fn new(store: Store, max_blocks_per_call: usize) -> Self {
        Self { store, max_blocks_per_call, announced_as: None, data_path: None }
    }

    /// `store` as `config` serves it: its per-call bound, its UCX data path
    /// if it has one, and the id it announces its blocks under when
    /// `announces` (its events go somewhere).
    pub fn configured(store: Store, config: &crate::KvStoreConfig, announces: bool) -> Self {
        let mut local = Self::new(store.clone(), config.max_blocks_per_call);
        if announces {
            local = local.announcing_as(&config.store_id);
        }
        if let Some(data_path) = store.data_path() {
            local = local.with_data_path(data_path.clone());
        }
        local
    }

    /// Serves Lease, Release and PutFrom: remote readers copy blocks out of
    /// the store's arena over UCX, and the store reads staged blocks.
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

    /// Whether it serves the UCX data path (Lease, PutFrom).
    pub fn has_data_path(&self) -> bool {
        self.data_path.is_some()
    }

    /// `count` of `field` (its `noun`s) in one call, or why not.
    fn check_count(&self, field: &str, noun: &str, count: usize) -> Result<(), KvStoreError> {
        if count > self.max_blocks_per_call {
            return Err(KvStoreError::Invalid(format!("{field}: {count} {noun}, at most {} per call", self.max_blocks_per_call)));
        }
        Ok(())
    }

    fn data_path(&self, instead: &str) -> Result<Arc<DataPath>, KvStoreError> {
        self.data_path.clone().ok_or_else(|| KvStoreError::NotServed(format!("this kv-store has no UCX data path; {instead}")))
    }

    /// Stores blocks whose bytes the caller lends (checksummed on a
    /// blocking thread).
    pub async fn put_refs(&self, fingerprint: Fingerprint, blocks: Vec<(SequenceHash, Arc<HostBlock>)>) -> Result<PutOutcome, KvStoreError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<(SequenceHash, BlockRef<'_>)> = blocks.iter().map(|(sequence, block)| (*sequence, BlockRef::from(&**block))).collect();
            store.put_refs(fingerprint, &refs)
        })
        .await
        .map_err(|_| failed("storing blocks"))?
        .map_err(KvStoreError::from)
    }

    /// Stores owned blocks (a Put message's), all of tenants `scope`
    /// allows.
    pub async fn put_owned(&self, fingerprint: Fingerprint, blocks: Vec<(SequenceHash, HostBlock)>, scope: &TenantScope) -> Result<PutOutcome, KvStoreError> {
        check_writes(scope, blocks.iter().map(|(sequence, block)| (*sequence, block.tenant)))?;
        let store = self.store.clone();
        // Checksumming is CPU work: off the runtime's threads.
        tokio::task::spawn_blocking(move || store.put(fingerprint, blocks)).await.map_err(|_| failed("storing blocks"))?.map_err(KvStoreError::from)
    }

    /// The leading blocks of `hashes` held, each checked, as they lie in
    /// the arena; the run ends at a block of a tenant `scope` does not
    /// allow.
    pub async fn held(
        &self,
        fingerprint: Fingerprint,
        hashes: Vec<SequenceHash>,
        scope: &TenantScope,
    ) -> Result<Vec<(SequenceHash, Arc<MemoryBlock>)>, KvStoreError> {
        self.check_count("sequence_hashes", "hashes", hashes.len())?;
        let store = self.store.clone();
        let mut run = tokio::task::spawn_blocking(move || store.get(fingerprint, &hashes)).await.map_err(|_| failed("reading blocks"))?;
        within_scope(scope, &mut run, |(_, block)| block.tenant);
        Ok(run)
    }

    /// Which of `hashes` are held as blocks of tenants `scope` allows, and
    /// how many lead without a gap.
    pub fn lookup_for(&self, fingerprint: Fingerprint, hashes: &[SequenceHash], scope: &TenantScope) -> Result<(Vec<bool>, usize), KvStoreError> {
        self.check_count("sequence_hashes", "hashes", hashes.len())?;
        let (present, leading, hidden) = self.store.lookup_within(fingerprint, hashes, scope);
        if hidden > 0 {
            OUT_OF_SCOPE.with_label_values(&["read"]).inc_by(hidden as u64);
        }
        Ok((present, leading))
    }

    /// Stores the blocks staged in the caller's `region`, read over UCX,
    /// all of tenants `scope` allows.
    pub async fn put_staged(
        &self,
        fingerprint: Fingerprint,
        region: &UcxRegion,
        blocks: Vec<StagedBlock>,
        scope: &TenantScope,
    ) -> Result<PutOutcome, KvStoreError> {
        let data_path = self.data_path("put with Put")?;
        self.check_count("blocks", "blocks", blocks.len())?;
        check_writes(scope, blocks.iter().map(|block| (block.sequence, block.tenant)))?;
        let Some(first) = blocks.first() else { return Ok(PutOutcome::default()) };
        let length = first.length;
        if length == 0 || blocks.iter().any(|block| block.length != length) {
            return Err(KvStoreError::Invalid("blocks: every block must have the same nonzero length".into()));
        }
        // Refused before a byte is read.
        if fingerprint.block_bytes() != Some(length as usize) {
            let error = match fingerprint.block_bytes() {
                None => StoreError::Undeclared(fingerprint.get()),
                Some(expected) => StoreError::WrongSize { sequence: first.sequence.0, fingerprint: fingerprint.get(), expected, got: length as usize },
            };
            return Err(error.into());
        }
        if length.saturating_mul(blocks.len() as u64) > MAX_PUT_FROM_BYTES {
            return Err(KvStoreError::Invalid(format!("blocks: more than {} MiB in one call", MAX_PUT_FROM_BYTES >> 20)));
        }
        if let Some(block) = blocks.iter().find(|block| block.offset.checked_add(length).is_none_or(|end| end > region.length)) {
            return Err(KvStoreError::Invalid(format!("blocks: block {:016x} lies outside the region", block.sequence.0)));
        }
        let offsets: Vec<u64> = blocks.iter().map(|block| block.offset).collect();
        // Checked and copied into the arena straight from the read buffer.
        let store = self.store.clone();
        data_path
            .read_staged(region, &offsets, length as usize, PUT_FROM_TIMEOUT, move |bytes| {
                let refs: Vec<(SequenceHash, BlockRef<'_>)> = blocks
                    .iter()
                    .zip(bytes.chunks(length as usize))
                    .map(|(block, bytes)| {
                        (block.sequence, BlockRef { local: block.local, parent: block.parent, checksum: block.checksum, bytes, tenant: block.tenant })
                    })
                    .collect();
                store.put_refs(fingerprint, &refs)
            })
            .await
            .map_err(|error| match error {
                StagedReadError::Panicked => failed("storing staged blocks"),
                other => KvStoreError::Unavailable(format!("cannot read the staged blocks: {other}")),
            })?
            .map_err(KvStoreError::from)
    }

    /// The dump of `fingerprint`'s announced blocks, with the store's
    /// incarnation.
    pub fn dump_of(&self, fingerprint: Fingerprint) -> (u64, Dump) {
        let announcer = self.store.announcer();
        (announcer.instance(), announcer.dump(fingerprint))
    }

    /// A lease of the leading blocks of `hashes` held, unchecked (the
    /// reader checks them), ending at a block of a tenant `scope` does not
    /// allow: only the blocks granted are readable with its id.
    pub async fn lease_for(&self, fingerprint: Fingerprint, hashes: &[SequenceHash], scope: &TenantScope) -> Result<Lease, KvStoreError> {
        let data_path = self.data_path("read with Get")?;
        self.check_count("sequence_hashes", "hashes", hashes.len())?;
        let (store, hashes) = (self.store.clone(), hashes.to_vec());
        let mut run = tokio::task::spawn_blocking(move || store.get_unchecked(fingerprint, &hashes)).await.map_err(|_| failed("reading blocks"))?;
        within_scope(scope, &mut run, |(_, block)| block.tenant);
        let blocks = run
            .iter()
            .map(|(sequence, block)| LeasedBlock {
                sequence: *sequence,
                local: block.local,
                parent: block.parent,
                checksum: block.checksum,
                length: block.slots.len(),
                segments: block.slots.segments().to_vec(),
            })
            .collect();
        let segment_bytes = self.store.arena().segment().unwrap_or_default();
        let (id, region) = if run.is_empty() {
            (0, data_path.region().clone())
        } else {
            data_path.grant(run.into_iter().map(|(_, block)| block).collect(), segment_bytes).map_err(|error| KvStoreError::Full(error.to_string()))?
        };
        Ok(Lease { id, region, segment_bytes, blocks })
    }

    /// How long a lease lasts (zero without a data path).
    pub fn lease_ttl(&self) -> Duration {
        self.data_path.as_ref().map_or(Duration::ZERO, |data_path| data_path.ttl())
    }
}

#[tonic::async_trait]
impl KvStoreApi for LocalKvStore {
    async fn put(&self, fingerprint: Fingerprint, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> Result<PutOutcome, KvStoreError> {
        self.put_refs(fingerprint, blocks.to_vec()).await
    }

    async fn get(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Vec<(SequenceHash, HostBlock)>, KvStoreError> {
        let run = self.held(fingerprint, hashes.to_vec(), &TenantScope::Any).await?;
        Ok(run.into_iter().map(|(sequence, block)| (sequence, block.to_host())).collect())
    }

    async fn lease(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<Lease, KvStoreError> {
        self.lease_for(fingerprint, hashes, &TenantScope::Any).await
    }

    async fn put_from(&self, fingerprint: Fingerprint, region: &UcxRegion, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> Result<PutOutcome, KvStoreError> {
        let length = blocks.first().map_or(0, |(_, block)| block.bytes.len()) as u64;
        let staged = blocks
            .iter()
            .enumerate()
            .map(|(i, (sequence, block))| StagedBlock {
                sequence: *sequence,
                local: block.local,
                parent: block.parent,
                checksum: block.checksum,
                length: block.bytes.len() as u64,
                offset: i as u64 * length,
                tenant: block.tenant,
            })
            .collect();
        self.put_staged(fingerprint, region, staged, &TenantScope::Any).await
    }

    async fn release(&self, lease_id: u64) -> Result<(), KvStoreError> {
        if let Some(data_path) = &self.data_path {
            data_path.release(lease_id);
        }
        Ok(())
    }

    async fn lookup(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<(Vec<bool>, usize), KvStoreError> {
        self.lookup_for(fingerprint, hashes, &TenantScope::Any)
    }

    async fn delete(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Result<u64, KvStoreError> {
        let (store, hashes) = (self.store.clone(), hashes.to_vec());
        tokio::task::spawn_blocking(move || store.delete(fingerprint, &hashes)).await.map_err(|_| failed("deleting blocks"))
    }

    async fn dump(&self, fingerprint: Fingerprint) -> Result<(u64, Dump), KvStoreError> {
        Ok(self.dump_of(fingerprint))
    }

    async fn stats(&self) -> Result<(StoreStats, Option<String>), KvStoreError> {
        Ok((self.store.stats(), self.announced_as.clone()))
    }
}

#[cfg(test)]
mod tests {
    use turbine_kv::block_checksum;

    use super::*;

    fn block(n: u64, len: usize) -> (SequenceHash, Arc<HostBlock>) {
        let bytes: Box<[u8]> = (0..len).map(|i| (i as u64 * 7 + n) as u8).collect();
        let parent = n.checked_sub(1).map(|p| SequenceHash(1000 + p));
        (
            SequenceHash(1000 + n),
            Arc::new(HostBlock { local: LocalBlockHash(n), parent, checksum: block_checksum(&bytes), bytes, tenant: turbine_kv::KvTenant::SHARED }),
        )
    }

    #[tokio::test]
    async fn in_process_callers_get_what_grpc_callers_get() {
        let local = LocalKvStore::new(Store::open(1 << 20, None, None), 4);
        let fingerprint = Fingerprint::declaring(9, 256);
        let blocks: Vec<_> = (0..3).map(|n| block(n, 256)).collect();
        let hashes: Vec<SequenceHash> = blocks.iter().map(|(sequence, _)| *sequence).collect();
        assert_eq!(local.put(fingerprint, &blocks).await.unwrap(), PutOutcome { stored: 3, already_held: 0 });
        assert_eq!(local.put(fingerprint, &blocks[..1]).await.unwrap(), PutOutcome { stored: 0, already_held: 1 });
        let got = local.get(fingerprint, &hashes).await.unwrap();
        assert_eq!(
            got.iter().map(|(sequence, block)| (*sequence, &block.bytes)).collect::<Vec<_>>(),
            blocks.iter().map(|(sequence, block)| (*sequence, &block.bytes)).collect::<Vec<_>>()
        );
        assert_eq!(local.lookup(fingerprint, &[hashes[0], SequenceHash(1), hashes[2]]).await.unwrap(), (vec![true, false, true], 1));
        assert_eq!(local.delete(fingerprint, &hashes[2..]).await.unwrap(), 1);
        assert_eq!(local.stats().await.unwrap().0.memory.blocks, 2);

        // The refusals the gRPC shell answers, as errors of the client.
        assert!(
            matches!(local.get(fingerprint, &[SequenceHash(1); 5]).await, Err(KvStoreError::Invalid(message)) if message.starts_with("sequence_hashes: 5 hashes"))
        );
        let (_, intact) = block(7, 256);
        let damaged = HostBlock { checksum: intact.checksum ^ 1, bytes: intact.bytes.clone(), ..*intact };
        assert!(matches!(local.put(fingerprint, &[(SequenceHash(7), Arc::new(damaged))]).await, Err(KvStoreError::Invalid(_))));
        assert!(
            matches!(local.put(fingerprint, &[block(8, 512)]).await, Err(KvStoreError::Invalid(message)) if message.contains("512")),
            "the size the fingerprint declares"
        );
        assert!(
            matches!(local.put(Fingerprint::new(9).unwrap(), &blocks).await, Err(KvStoreError::Invalid(message)) if message.contains("declares no block size")),
            "a fingerprint that declares no size stores nothing"
        );
        assert!(matches!(local.lease(fingerprint, &hashes).await, Err(KvStoreError::NotServed(message)) if message.contains("read with Get")));
        assert!(matches!(local.put_from(fingerprint, &UcxRegion::default(), &blocks).await, Err(KvStoreError::NotServed(_))));
        let too_large: Vec<_> = vec![block(20, 4 << 20)];
        assert!(matches!(local.put(Fingerprint::declaring(10, 4 << 20), &too_large).await, Err(KvStoreError::Full(_))));
    }
}
