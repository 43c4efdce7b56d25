//! The shared tier (G4): a store other workers reach too (the kv-store
//! service), below the disk tier. The engine knows it only as a
//! [`RemoteStore`]: the worker supplies one over its client, so the engine
//! stays free of any transport.
//!
//! Both calls run on the tier threads, never on the engine's: a put is
//! handed over (the store queues it and returns), a get blocks the reader
//! thread for one round trip while the sequence waiting for it is
//! suspended and the engine keeps stepping the others.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use turbine_kv::{BlockHashes, SequenceHash};

use super::{HostBlock, TierStats};

/// A shared store of KV blocks, keyed by this engine's layout and the
/// blocks' sequence hashes.
pub trait RemoteStore: Send + Sync + 'static {
    /// Stores a run of consecutive blocks of one chain, as they reach the
    /// host tier (write-through). Must not wait on the network: queue the
    /// blocks (dropping them when the queue is full) and return how many
    /// were queued (blocks the store is known to hold count as queued).
    fn put_run(&self, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> usize;

    /// The leading blocks of `hashes` the store holds, each checked against
    /// its checksum and hashes; a block that fails ends the run. An error
    /// (the store down or slow) is a miss, counted as a failure: what is
    /// missing is computed.
    fn get_run(&self, hashes: &[BlockHashes]) -> Result<Vec<Arc<HostBlock>>, RemoteGetError>;

    /// Puts that failed since start (they happen off the engine's threads).
    fn failed_puts(&self) -> u64 {
        0
    }
}

/// Why the shared store gave no blocks. Either is a miss: the engine
/// computes what is missing and counts a failure.
#[derive(Debug, thiserror::Error)]
pub enum RemoteGetError {
    /// The store answered with an error, or could not be reached.
    #[error("the kv-store failed: {0}")]
    Failed(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// No answer within the reader's bound.
    #[error("no answer within {0:?}")]
    TimedOut(std::time::Duration),
}

/// Which blocks the engine puts to the shared tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RemoteOffload {
    /// Every block as the host tier stores it: a prefix computed anywhere
    /// is shared at once, at the cost of putting every block.
    #[default]
    WriteThrough,
    /// Only blocks the worker's lowest local tier evicts (the disk's, or
    /// the host tier's without one): the store keeps what the worker can
    /// no longer hold, and puts nothing it still holds.
    OnEvict,
    /// None: the tier is only read (blocks other workers put).
    Off,
}

/// The shared tier as the engine holds it. Cloning shares it.
#[derive(Clone)]
pub struct RemoteTier {
    store: Arc<dyn RemoteStore>,
    stats: Arc<TierStats>,
    min_blocks: usize,
    offload: RemoteOffload,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier").field("min_blocks", &self.min_blocks).finish_non_exhaustive()
    }
}

impl RemoteTier {
    /// The tier over `store`, asked for a waiting request's prefix only
    /// when at least `min_blocks` of its blocks are in no nearer tier (a
    /// shorter remainder is cheaper to compute than a round trip).
    pub fn new(store: Arc<dyn RemoteStore>, min_blocks: usize) -> Self {
        Self { store, stats: Arc::default(), min_blocks: min_blocks.max(1), offload: RemoteOffload::default() }
    }

    /// The tier, putting the blocks `offload` says.
    pub fn with_offload(self, offload: RemoteOffload) -> Self {
        Self { offload, ..self }
    }

    /// Which blocks are put to it.
    pub fn offload(&self) -> RemoteOffload {
        self.offload
    }

    /// The tier's counters (the store's own client may count more).
    pub fn stats(&self) -> &TierStats {
        &self.stats
    }

    pub(crate) fn shared_stats(&self) -> Arc<TierStats> {
        self.stats.clone()
    }

    /// Whether a remainder of `blocks` blocks is worth asking for.
    pub(crate) fn worth_asking(&self, blocks: usize) -> bool {
        blocks >= self.min_blocks
    }

    pub(crate) fn put_run(&self, blocks: &[(SequenceHash, Arc<HostBlock>)]) {
        if blocks.is_empty() {
            return;
        }
        let queued = self.store.put_run(blocks).min(blocks.len());
        let bytes: usize = blocks[..queued].iter().map(|(_, block)| block.bytes.len()).sum();
        self.stats.offloaded_blocks.fetch_add(queued as u64, Relaxed);
        self.stats.offloaded_bytes.fetch_add(bytes as u64, Relaxed);
        self.stats.offloads_skipped.fetch_add((blocks.len() - queued) as u64, Relaxed);
    }

    pub(crate) fn get_run(&self, hashes: &[BlockHashes]) -> Result<Vec<Arc<HostBlock>>, RemoteGetError> {
        if hashes.is_empty() { Ok(Vec::new()) } else { self.store.get_run(hashes) }
    }

    /// Failed reads and writes (the tier's own count plus the store's
    /// failed puts).
    pub fn failures(&self) -> u64 {
        self.stats.failures.load(Relaxed) + self.store.failed_puts()
    }
}
