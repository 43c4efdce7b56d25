//! KV tiers below the engine's pool (G1): host memory (G2).
//!
//! A block registered in G1 is full and never written again, so it is
//! copied to the host tier as soon as it is registered (write-through), by
//! a thread of its own: the engine pins the block (one more reference, so
//! it is neither evicted nor reused) and hands it over; the thread copies
//! its bytes out of the pool, checksums them, stores them under the
//! block's sequence hash and gives the block back. Nothing of this runs on
//! a step's critical path, and a G1 eviction loses nothing the host tier
//! holds. When copies fall behind, new blocks are skipped rather than
//! pinned without bound.
//!
//! A request whose prompt continues past its G1 prefix hit into blocks the
//! host tier holds gets those blocks onboarded before it is admitted: each
//! is checked against its checksum and written into a free G1 block, then
//! registered, exactly as blocks read from another worker are installed;
//! the request then hits them like any cached prefix. A block whose bytes
//! do not match its checksum is dropped from the tier, never served.
//!
//! The host tier is a capacity-bounded cache (`moka`, weighed in bytes,
//! least recently used evicted first). Every block it stores or evicts is a
//! `Stored`/`Removed` event with tier `host`, numbered by the engine loop
//! with the pool's own events, so the router credits host hits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use turbine_kv::{BlockHashes, CachedBlock, KvEvent, LocalBlockHash, SequenceHash, StoredBlock, Tier, TierSet};

use crate::kv_memory::{KvMemory, block_checksum};

/// A block held in host memory.
#[derive(Debug)]
pub struct HostBlock {
    /// Hash of the block's own tokens.
    pub local: LocalBlockHash,
    /// XXH3-64 of `bytes`, taken when the block was copied out of G1.
    pub checksum: u64,
    /// The block's bytes, in the pool's layout.
    pub bytes: Box<[u8]>,
}

impl HostBlock {
    /// Whether the bytes still match their checksum.
    pub fn is_intact(&self) -> bool {
        block_checksum(&self.bytes) == self.checksum
    }
}

/// Counters of one tier, readable from any thread.
#[derive(Debug, Default)]
pub struct TierStats {
    /// Blocks copied into the tier.
    pub offloaded_blocks: AtomicU64,
    /// Bytes copied into the tier.
    pub offloaded_bytes: AtomicU64,
    /// Blocks not copied because copies fell behind.
    pub offloads_skipped: AtomicU64,
    /// Blocks onboarded from the tier into G1.
    pub onboarded_blocks: AtomicU64,
    /// Blocks dropped because their bytes no longer matched their checksum.
    pub corrupt_blocks: AtomicU64,
    /// Blocks evicted for room.
    pub evicted_blocks: AtomicU64,
}

/// Events of a tier, waiting for the engine loop to number them.
type PendingEvents = Arc<Mutex<Vec<KvEvent>>>;

/// The host-memory tier (G2): blocks by sequence hash, bounded in bytes.
#[derive(Clone)]
pub struct HostTier {
    cache: moka::sync::Cache<SequenceHash, Arc<HostBlock>>,
    events: PendingEvents,
    capacity_bytes: u64,
    stats: Arc<TierStats>,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier").field("capacity_bytes", &self.capacity_bytes).field("blocks", &self.cache.entry_count()).finish()
    }
}

impl HostTier {
    /// A tier holding at most `capacity_bytes` of block bytes.
    pub fn new(capacity_bytes: u64) -> Self {
        let events = PendingEvents::default();
        let stats = Arc::new(TierStats::default());
        let cache = {
            let events = events.clone();
            let stats = stats.clone();
            moka::sync::Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(|_, block: &Arc<HostBlock>| u32::try_from(block.bytes.len()).unwrap_or(u32::MAX))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .eviction_listener(move |hash: Arc<SequenceHash>, _, cause| {
                    if cause.was_evicted() {
                        stats.evicted_blocks.fetch_add(1, Ordering::Relaxed);
                        push_removed(&events, *hash);
                    }
                })
                .build()
        };
        Self { cache, events, capacity_bytes, stats }
    }

    /// Bytes the tier may hold.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes held now (after pending evictions ran).
    pub fn used_bytes(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }

    /// Blocks held now (after pending evictions ran).
    pub fn blocks(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.entry_count()
    }

    /// The tier's counters.
    pub fn stats(&self) -> &TierStats {
        &self.stats
    }

    /// Whether the tier holds `hash`.
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.cache.contains_key(&hash)
    }

    /// Stores a run of consecutive blocks of one chain (`parent` before the
    /// first), announcing them with one `Stored` event.
    pub fn insert_run(&self, parent: Option<SequenceHash>, blocks: Vec<(SequenceHash, HostBlock)>) {
        if blocks.is_empty() {
            return;
        }
        let stored = blocks.iter().map(|(hash, block)| StoredBlock { sequence_hash: *hash, local_hash: block.local }).collect();
        // Announced before the cache can evict them, so that a consumer
        // never sees a block removed before it was stored.
        self.events.lock().push(KvEvent::Stored { parent, blocks: stored, tier: Tier::Host });
        for (hash, block) in blocks {
            self.stats.offloaded_bytes.fetch_add(block.bytes.len() as u64, Ordering::Relaxed);
            self.stats.offloaded_blocks.fetch_add(1, Ordering::Relaxed);
            self.cache.insert(hash, Arc::new(block));
        }
        self.cache.run_pending_tasks();
    }

    /// The leading blocks of `hashes` the tier holds, checked against their
    /// checksums; a corrupt block is dropped from the tier and ends the run.
    pub fn lookup_run(&self, hashes: &[BlockHashes]) -> Vec<Arc<HostBlock>> {
        let mut run = Vec::new();
        for hashes in hashes {
            let Some(block) = self.cache.get(&hashes.sequence) else { break };
            if !block.is_intact() || block.local != hashes.local {
                self.stats.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(sequence_hash = hashes.sequence.0, "a host-tier KV block failed its checksum; dropped, computing it instead");
                self.remove(hashes.sequence);
                break;
            }
            run.push(block);
        }
        run
    }

    /// Drops a block from the tier.
    pub fn remove(&self, hash: SequenceHash) {
        if self.cache.remove(&hash).is_some() {
            push_removed(&self.events, hash);
        }
    }

    /// Every block the tier holds, for a dump.
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.cache
            .iter()
            .map(|(hash, block)| CachedBlock { sequence_hash: *hash, local_hash: block.local, tiers: TierSet(Tier::Host.bit()) })
            .collect()
    }

    /// Moves the tier's events since the last call into `out`.
    pub fn drain_events(&self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events.lock());
    }

    /// Flips a byte of a held block, keeping its checksum: a test's way to
    /// corrupt the tier. Returns whether the block was held.
    #[doc(hidden)]
    pub fn corrupt_for_test(&self, hash: SequenceHash) -> bool {
        let Some(block) = self.cache.get(&hash) else { return false };
        let mut bytes = block.bytes.to_vec();
        bytes[0] ^= 0xff;
        self.cache.insert(hash, Arc::new(HostBlock { local: block.local, checksum: block.checksum, bytes: bytes.into_boxed_slice() }));
        true
    }
}

fn push_removed(events: &PendingEvents, hash: SequenceHash) {
    let mut events = events.lock();
    match events.last_mut() {
        Some(KvEvent::Removed { sequence_hashes, tier: Tier::Host }) => sequence_hashes.push(hash),
        _ => events.push(KvEvent::Removed { sequence_hashes: vec![hash], tier: Tier::Host }),
    }
}

/// The tiers an engine keeps below its pool.
#[derive(Debug, Clone, Default)]
pub struct KvTiers {
    /// Host memory (G2).
    pub host: Option<HostTier>,
    /// The pool's bytes, where offloads copy from. Without it (an engine
    /// that exposes no KV memory, such as the mocker) nothing is offloaded.
    pub memory: Option<KvMemory>,
}

/// A registered block handed to the offload thread, pinned until it is
/// given back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OffloadBlock {
    pub block: u32,
    pub parent: Option<SequenceHash>,
    pub hashes: BlockHashes,
}

/// Starts the thread that copies pinned blocks from `memory` into `host`;
/// every batch's blocks come back on the returned receiver once copied
/// (or found unreadable), to be unpinned by the engine.
pub(crate) fn spawn_offload(
    memory: KvMemory,
    host: HostTier,
) -> (std::sync::mpsc::Sender<Vec<OffloadBlock>>, std::sync::mpsc::Receiver<Vec<u32>>) {
    let (jobs, job_receiver) = std::sync::mpsc::channel::<Vec<OffloadBlock>>();
    let (done_sender, done) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("turbine-kv-offload".into())
        .spawn(move || {
            let mut scratch = Vec::new();
            while let Ok(batch) = job_receiver.recv() {
                let mut run: Vec<(SequenceHash, HostBlock)> = Vec::new();
                let mut run_parent = None;
                for item in &batch {
                    // A new run where the chain breaks.
                    if run.last().map(|(hash, _)| Some(*hash)) != Some(item.parent) {
                        host.insert_run(run_parent, std::mem::take(&mut run));
                        run_parent = item.parent;
                    }
                    if host.contains(item.hashes.sequence) {
                        // Onboarded from this tier, or stored by another sequence.
                        host.insert_run(run_parent, std::mem::take(&mut run));
                        run_parent = Some(item.hashes.sequence);
                        continue;
                    }
                    #[allow(unsafe_code)]
                    // SAFETY: the engine pinned the block (a full, registered
                    // block it never writes) until this batch is given back.
                    let copied = unsafe { memory.with_block(item.block, &mut scratch, |bytes| HostBlock { local: item.hashes.local, checksum: block_checksum(bytes), bytes: bytes.into() }) };
                    match copied {
                        Ok(block) => run.push((item.hashes.sequence, block)),
                        Err(error) => tracing::warn!(%error, "cannot copy a KV block to the host tier"),
                    }
                }
                host.insert_run(run_parent, run);
                if done_sender.send(batch.iter().map(|item| item.block).collect()).is_err() {
                    break;
                }
            }
        })
        .expect("spawn the KV offload thread");
    (jobs, done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(byte: u8, len: usize) -> HostBlock {
        let bytes = vec![byte; len].into_boxed_slice();
        HostBlock { local: LocalBlockHash(u64::from(byte)), checksum: block_checksum(&bytes), bytes }
    }

    fn hashes(n: u64) -> BlockHashes {
        BlockHashes { local: LocalBlockHash(n), sequence: SequenceHash(1000 + n) }
    }

    #[test]
    fn the_tier_stays_within_its_bytes_and_announces_what_it_stores_and_evicts() {
        let tier = HostTier::new(4 * 1024);
        for n in 0..10u8 {
            tier.insert_run(None, vec![(SequenceHash(1000 + u64::from(n)), block(n, 1024))]);
        }
        assert!(tier.used_bytes() <= 4 * 1024, "{} bytes held", tier.used_bytes());
        assert_eq!(tier.blocks(), 4);
        let mut events = Vec::new();
        tier.drain_events(&mut events);
        let stored: usize = events.iter().map(|e| if let KvEvent::Stored { blocks, tier: Tier::Host, .. } = e { blocks.len() } else { 0 }).sum();
        let removed: usize = events.iter().map(|e| if let KvEvent::Removed { sequence_hashes, tier: Tier::Host } = e { sequence_hashes.len() } else { 0 }).sum();
        assert_eq!((stored, removed), (10, 6), "{events:?}");
        // The most recent blocks stay.
        assert_eq!(tier.lookup_run(&[hashes(9)]).len(), 1);
        assert_eq!(tier.lookup_run(&[hashes(0)]).len(), 0);
    }

    #[test]
    fn a_corrupt_block_is_dropped_and_ends_the_run() {
        let tier = HostTier::new(1 << 20);
        tier.insert_run(None, (1..=3u8).map(|n| (SequenceHash(1000 + u64::from(n)), block(n, 64))).collect());
        assert_eq!(tier.lookup_run(&[hashes(1), hashes(2), hashes(3)]).len(), 3);
        assert!(tier.corrupt_for_test(SequenceHash(1002)));
        assert_eq!(tier.lookup_run(&[hashes(1), hashes(2), hashes(3)]).len(), 1, "the run ends before the corrupt block");
        assert!(!tier.contains(SequenceHash(1002)), "the corrupt block left the tier");
        assert_eq!(tier.stats().corrupt_blocks.load(Ordering::Relaxed), 1);
        let mut events = Vec::new();
        tier.drain_events(&mut events);
        assert!(matches!(events.last(), Some(KvEvent::Removed { sequence_hashes, tier: Tier::Host }) if sequence_hashes == &[SequenceHash(1002)]));
    }
}
