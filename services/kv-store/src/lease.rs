//! The UCX data path's server side: leases that keep blocks' segments in
//! place while a remote reader copies them out of the registered arena.
//!
//! A leased block is held by its [`MemoryBlock`] handle, so its segments
//! cannot be reused (nor the block evicted from under the reader) until
//! the lease is released or expires; the number of blocks leased at once
//! is bounded, so readers cannot pin the whole tier.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use turbine_api::UcxRegion;

use crate::store::MemoryBlock;

/// How long a lease lasts unless released.
pub const LEASE_TTL: Duration = Duration::from_secs(10);

/// Blocks leased at once at most (four calls of the most blocks a call
/// may name, by default).
pub const MAX_LEASED_BLOCKS: usize = 32_768;

/// An arena of `bytes` and, when this build has UCX, the data path that
/// serves it (None when UCX cannot start: readers use Get). The arena
/// comes from UCX's shared-memory allocator when it can, so readers on the
/// same machine map it and copy blocks with no help from the store.
///
/// Keyed [`UcxKeys::PerHandle`](turbine_kv::UcxKeys::PerHandle), no
/// network-facing key of the whole arena exists: each lease's segments are
/// registered for it alone and unregistered when it goes.
pub fn arena_with_data_path(bytes: usize, network: &turbine_kv::UcxNetwork, keys: turbine_kv::UcxKeys) -> (Arc<crate::Arena>, Option<Arc<DataPath>>) {
    #[cfg(feature = "ucx")]
    {
        let pool = turbine_ucx_agent::ShmPool::open();
        let buffer = match &pool {
            Some(pool) => pool.allocator().allocate(bytes),
            None => turbine_kv::KvBuffer::zeroed(bytes),
        };
        let arena = crate::Arena::new(buffer);
        match turbine_ucx_agent::UcxAgent::start(Some(&arena.memory()), pool, network, keys) {
            Ok(agent) => match agent.region().cloned() {
                Some(region) => {
                    let path = DataPath::new(region, agent, MAX_LEASED_BLOCKS, LEASE_TTL);
                    return (arena, Some(Arc::new(path)));
                }
                None => tracing::warn!("UCX registered no region for the store's memory; readers use Get"),
            },
            Err(error) => tracing::warn!(%error, "cannot start UCX; readers use Get"),
        }
        (arena, None)
    }
    #[cfg(not(feature = "ucx"))]
    {
        let _ = (network, keys);
        (crate::Arena::on_heap(bytes), None)
    }
}

struct Granted {
    expires: Instant,
    /// The lease's segments registered for it alone (keyed per lease),
    /// unregistered when it goes; dropped before the blocks.
    #[cfg(feature = "ucx")]
    _keys: Option<LeaseKeys>,
    blocks: Vec<Arc<MemoryBlock>>,
}

#[cfg(feature = "ucx")]
static LEASE_KEYS: std::sync::LazyLock<prometheus::IntGauge> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::gauge(
        "turbine_kv_store_ucx_lease_keys",
        "Runs of leased segments registered with UCX for their lease alone (memory keyed per lease: serving certificates with a network named for UCX), each unregistered when its lease is released, or at the first lease granted or released after it expired",
        &[],
    )
    .with_label_values::<&str>(&[])
});

/// A lease's segments registered with UCX for it alone, counted in
/// `turbine_kv_store_ucx_lease_keys` until dropped (unregistered).
#[cfg(feature = "ucx")]
struct LeaseKeys(turbine_ucx_agent::Exposed);

#[cfg(feature = "ucx")]
impl LeaseKeys {
    fn new(exposed: turbine_ucx_agent::Exposed) -> Self {
        LEASE_KEYS.add(exposed.range_keys().len() as i64);
        Self(exposed)
    }
}

#[cfg(feature = "ucx")]
impl Drop for LeaseKeys {
    fn drop(&mut self) {
        LEASE_KEYS.sub(self.0.range_keys().len() as i64);
    }
}

#[derive(Default)]
struct Leases {
    by_id: FxHashMap<u64, Granted>,
    blocks: usize,
}

/// Too many blocks are leased.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{leased} blocks are leased, at most {limit} at once; read with Get or retry later")]
pub struct TooManyLeased {
    /// Blocks leased now.
    pub leased: usize,
    /// The bound.
    pub limit: usize,
}

/// Why a caller's staged blocks could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StagedReadError {
    /// This build has no UCX data path.
    #[error("this build has no UCX")]
    NoUcx,
    /// The read from the caller's region failed.
    #[cfg(feature = "ucx")]
    #[error(transparent)]
    Pull(#[from] turbine_ucx_agent::PullError),
    /// Storing the bytes read failed (its thread panicked).
    #[error("the store failed while storing staged blocks")]
    Panicked,
}

/// The store's UCX data path: where its arena lies for UCX readers, and
/// the leases outstanding.
pub struct DataPath {
    region: UcxRegion,
    leases: Mutex<Leases>,
    max_leased_blocks: usize,
    ttl: Duration,
    /// The UCX thread: keeps the region registered, and reads what
    /// callers stage for PutFrom.
    #[cfg(feature = "ucx")]
    agent: turbine_ucx_agent::UcxAgent,
    /// PutFrom's read buffer, reused (one PutFrom reads at a time).
    #[cfg(feature = "ucx")]
    staged: tokio::sync::Mutex<Vec<u8>>,
}

impl std::fmt::Debug for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let leases = self.leases.lock();
        f.debug_struct("DataPath").field("leases", &leases.by_id.len()).field("leased_blocks", &leases.blocks).finish()
    }
}

impl DataPath {
    /// The arena registered as `region` by `agent`; at most
    /// `max_leased_blocks` leased at once, each lease for `ttl`.
    #[cfg(feature = "ucx")]
    pub fn new(region: UcxRegion, agent: turbine_ucx_agent::UcxAgent, max_leased_blocks: usize, ttl: Duration) -> Self {
        Self { region, leases: Mutex::default(), max_leased_blocks, ttl, agent, staged: tokio::sync::Mutex::default() }
    }

    /// Reads staged blocks of `block_bytes` at `offsets` of a caller's
    /// `region`, back to back, giving up after `timeout`; `with` gets the
    /// bytes on a blocking thread. One read at a time: its buffer is
    /// reused by the next.
    #[cfg(feature = "ucx")]
    pub async fn read_staged<R: Send + 'static>(
        &self,
        region: &UcxRegion,
        offsets: &[u64],
        block_bytes: usize,
        timeout: Duration,
        with: impl FnOnce(&[u8]) -> R + Send + 'static,
    ) -> Result<R, StagedReadError> {
        let mut buffer = self.staged.lock().await;
        let pulled = self.agent.pull(region, offsets, block_bytes, std::mem::take(&mut *buffer), timeout).await?;
        let (result, bytes) = tokio::task::spawn_blocking(move || (with(&pulled.bytes), pulled.bytes)).await.map_err(|_| StagedReadError::Panicked)?;
        *buffer = bytes;
        Ok(result)
    }

    /// Without UCX in the build there is no data path to read with.
    #[cfg(not(feature = "ucx"))]
    pub async fn read_staged<R: Send + 'static>(
        &self,
        _: &UcxRegion,
        _: &[u64],
        _: usize,
        _: Duration,
        _: impl FnOnce(&[u8]) -> R + Send + 'static,
    ) -> Result<R, StagedReadError> {
        Err(StagedReadError::NoUcx)
    }

    /// Where the arena lies for readers.
    pub fn region(&self) -> &UcxRegion {
        &self.region
    }

    /// How long a lease lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Leases `blocks` (held in segments of `segment_bytes`); returns the
    /// lease's id and where its readers read: the arena's region, with
    /// keys of the lease's own segments when the arena is keyed per lease.
    pub fn grant(&self, blocks: Vec<Arc<MemoryBlock>>, segment_bytes: usize) -> Result<(u64, UcxRegion), TooManyLeased> {
        // Registered before the leases' lock (UCX may take its time on
        // RDMA); dropped again if the lease is refused.
        #[cfg(feature = "ucx")]
        let keys = {
            let offsets: Vec<u64> =
                blocks.iter().flat_map(|block| block.slots.segments().iter().map(|&segment| segment as u64 * segment_bytes as u64)).collect();
            let runs = turbine_ucx_agent::runs(&offsets, segment_bytes as u64);
            match self.agent.expose(&runs) {
                None => None,
                Some(Ok(exposed)) => Some(LeaseKeys::new(exposed)),
                Some(Err(error)) => {
                    // No key: the reader finds nothing to read over UCX
                    // and uses Get.
                    tracing::warn!(%error, runs = runs.len(), "UCX registered none of a lease's segments");
                    None
                }
            }
        };
        let now = Instant::now();
        let mut leases = self.leases.lock();
        // Expired leases go first, so what they held counts as free.
        let _expired = Self::sweep(&mut leases, now);
        if leases.blocks + blocks.len() > self.max_leased_blocks {
            return Err(TooManyLeased { leased: leases.blocks, limit: self.max_leased_blocks });
        }
        let id = loop {
            let id = uuid::Uuid::new_v4().as_u64_pair().0;
            if id != 0 && !leases.by_id.contains_key(&id) {
                break id;
            }
        };
        #[cfg(not(feature = "ucx"))]
        let _ = segment_bytes;
        #[cfg(feature = "ucx")]
        let region = match &keys {
            Some(keys) => UcxRegion { range_keys: keys.0.range_keys().to_vec(), ..self.region.clone() },
            None => self.region.clone(),
        };
        #[cfg(not(feature = "ucx"))]
        let region = self.region.clone();
        leases.blocks += blocks.len();
        let granted = Granted {
            expires: now + self.ttl,
            #[cfg(feature = "ucx")]
            _keys: keys,
            blocks,
        };
        leases.by_id.insert(id, granted);
        Ok((id, region))
    }

    /// Lets go of a lease (and of any that expired); whether it was
    /// outstanding.
    pub fn release(&self, id: u64) -> bool {
        let (lease, _expired) = {
            let mut leases = self.leases.lock();
            let expired = Self::sweep(&mut leases, Instant::now());
            let lease = leases.by_id.remove(&id);
            if let Some(lease) = &lease {
                leases.blocks -= lease.blocks.len();
            }
            (lease, expired)
        };
        // The blocks' segments went back to the arena outside the lock.
        lease.is_some()
    }

    /// Takes the leases expired by `now` out of `leases` (their blocks and
    /// keys go when the caller drops them, outside the lock).
    fn sweep(leases: &mut Leases, now: Instant) -> Vec<Granted> {
        let expired: Vec<u64> = leases.by_id.iter().filter(|(_, lease)| lease.expires <= now).map(|(&id, _)| id).collect();
        let mut swept = Vec::with_capacity(expired.len());
        for id in expired {
            if let Some(lease) = leases.by_id.remove(&id) {
                leases.blocks -= lease.blocks.len();
                swept.push(lease);
            }
        }
        swept
    }

    /// Blocks leased now.
    pub fn leased_blocks(&self) -> usize {
        self.leases.lock().blocks
    }
}
