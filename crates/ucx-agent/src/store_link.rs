//! A kv-store client's side of the store's UCX data path ([`KvStoreLink`]):
//! its own UCX thread, staging memory it puts blocks through, and reads of
//! leased blocks out of the store's memory. The worker's shared tier uses
//! it; so do the store's own tests and benchmarks.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use turbine_api::UcxRegion;
use turbine_api::kv_store::{Fingerprint, KvStoreClient, KvStoreError, Lease, LeaseError, MAX_PUT_FROM_BYTES, PutOutcome};
use turbine_kv::KvBuffer;

/// Why a read of leased blocks failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkReadError {
    /// The store's answer is inconsistent.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// UCX failed the read.
    #[error(transparent)]
    Pull(#[from] crate::PullError),
}

/// A reader's side of the UCX data path: its own UCX thread, which reads
/// leased segments out of the store's memory (copies them from the mapped
/// region on the same machine, one-sided gets from another).
#[derive(Debug)]
pub struct KvStoreLink {
    agent: crate::UcxAgent,
    /// The last read's buffer, reused so that its pages are not faulted in
    /// again (one reader reads at a time: a worker's reader thread).
    spare: Mutex<Vec<u8>>,
    /// Where puts are staged for the store to read, and where that memory
    /// lies for it (None: this link only reads).
    staging: Option<(tokio::sync::Mutex<Staging>, UcxRegion)>,
}

impl KvStoreLink {
    /// Starts the link's UCX thread, for reads only, on the devices
    /// `network` allows.
    pub fn start(network: &crate::UcxNetwork) -> Result<Self, crate::StartError> {
        Ok(Self { agent: crate::UcxAgent::start(None, None, network, crate::UcxKeys::WholePool)?, spare: Mutex::default(), staging: None })
    }

    /// Starts the link's UCX thread with `staging_bytes` of memory that
    /// puts are staged in for the store to read (from UCX's shared-memory
    /// allocator when it can, so a store on the same machine maps it).
    pub fn with_staging(staging_bytes: usize, network: &crate::UcxNetwork) -> Result<Self, crate::StartError> {
        let pool = crate::ShmPool::open();
        let buffer = Arc::new(match &pool {
            Some(pool) => pool.allocator().allocate(staging_bytes),
            None => turbine_kv::KvBuffer::zeroed(staging_bytes),
        });
        const PAGE: usize = 4096;
        let memory = turbine_kv::KvMemory::new(buffer.clone(), turbine_kv::KvLayout::opaque(PAGE, "kv-store staging"), staging_bytes / PAGE);
        let agent = crate::UcxAgent::start(Some(&memory), pool, network, crate::UcxKeys::WholePool)?;
        let region = agent.region().cloned().ok_or(crate::StartError::NoRegion)?;
        Ok(Self { agent, spare: Mutex::default(), staging: Some((tokio::sync::Mutex::new(Staging::new(buffer)), region)) })
    }

    /// Whether this link can put.
    pub fn can_put(&self) -> bool {
        self.staging.is_some()
    }

    /// Stores blocks of one fingerprint (and one length) through the
    /// staging memory: as many as it holds per `PutFrom`, which the store
    /// answers once it has read and stored them.
    pub async fn put(
        &self,
        client: &KvStoreClient,
        fingerprint: Fingerprint,
        blocks: &[(turbine_kv::SequenceHash, Arc<turbine_kv::HostBlock>)],
    ) -> Result<PutOutcome, KvStoreError> {
        let Some((staging, region)) = &self.staging else {
            return Err(KvStoreError::NotServed("this UCX link has no staging memory".into()));
        };
        let mut outcome = PutOutcome::default();
        let Some((_, first)) = blocks.first() else { return Ok(outcome) };
        let length = first.bytes.len();
        if length == 0 || blocks.iter().any(|(_, block)| block.bytes.len() != length) {
            return Err(KvStoreError::Invalid("blocks of one put must have one nonzero length".into()));
        }
        let mut staging = staging.lock().await;
        let per_call = (staging.len() / length).min(MAX_PUT_FROM_BYTES as usize / length);
        if per_call == 0 {
            return Err(KvStoreError::Invalid(format!("a block of {length} bytes does not fit the staging memory")));
        }
        for chunk in blocks.chunks(per_call) {
            for (i, (_, block)) in chunk.iter().enumerate() {
                staging.write(i * length, &block.bytes);
            }
            let stored = client.put_from(fingerprint, region, chunk).await?;
            outcome.stored += stored.stored;
            outcome.already_held += stored.already_held;
        }
        Ok(outcome)
    }

    /// Every segment of `lease`, `segment_bytes` each, in order (a block
    /// whose segments are adjacent in one piece), into
    /// `into` (resized; pass a used buffer back to skip faulting in fresh
    /// pages), giving up after `timeout`.
    pub async fn read(&self, lease: &Lease, into: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, LinkReadError> {
        let (offsets, piece) = lease.pieces()?;
        if offsets.is_empty() {
            return Ok(into);
        }
        Ok(self.agent.pull(&lease.region, &offsets, piece, into, timeout).await?.bytes)
    }

    /// The leading blocks of `hashes` the store behind `client` holds, read
    /// over UCX and each checked: lease, read, release (in the background).
    pub async fn get(
        &self,
        client: &KvStoreClient,
        fingerprint: Fingerprint,
        hashes: &[turbine_kv::SequenceHash],
        timeout: Duration,
    ) -> Result<Vec<(turbine_kv::SequenceHash, turbine_kv::HostBlock)>, KvStoreError> {
        let lease = client.lease(fingerprint, hashes).await?;
        if lease.id == 0 {
            return Ok(Vec::new());
        }
        let spare = std::mem::take(&mut *self.spare.lock());
        let read = self.read(&lease, spare, timeout).await;
        let releasing = client.clone();
        tokio::spawn(async move {
            // An unreleased lease expires on its own.
            let _ = releasing.release(lease.id).await;
        });
        let bytes = read.map_err(|error| KvStoreError::Unavailable(format!("UCX read of leased blocks failed: {error}")))?;
        let mut run = lease.blocks_from(&bytes);
        *self.spare.lock() = bytes;
        if run.len() < lease.blocks.len() {
            // The store leases blocks unchecked: read them with Get, which
            // checks them in the store and drops the one that failed.
            return Err(KvStoreError::Damaged("a block read over UCX failed its checksum".into()));
        }
        // The store's run follows the asked order; anything else is not used.
        let in_order = run.iter().zip(hashes).take_while(|((sequence, _), want)| sequence == *want).count();
        run.truncate(in_order);
        Ok(run)
    }
}

/// A caller's staging memory for `PutFrom`: blocks are copied in, then the
/// store reads them (registered with UCX by the caller's UCX thread).
#[derive(Debug)]
struct Staging {
    buffer: Arc<KvBuffer>,
}

impl Staging {
    /// Staging memory over `buffer`.
    fn new(buffer: Arc<KvBuffer>) -> Self {
        Self { buffer }
    }

    /// Bytes it holds.
    fn len(&self) -> usize {
        self.buffer.len()
    }

    /// Copies `bytes` to `offset`.
    ///
    /// The caller holds the staging memory exclusively (`&mut self`) and
    /// no store is reading it: the `PutFrom` that named it has returned.
    #[allow(unsafe_code)]
    fn write(&mut self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.buffer.len(), "staged bytes exceed the staging memory");
        // SAFETY: in bounds (checked); nothing else writes the buffer, and
        // no reader is reading it (the contract above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.buffer.as_ptr().add(offset), bytes.len()) };
    }
}
