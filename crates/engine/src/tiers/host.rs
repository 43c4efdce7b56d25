//! The host-memory tier (G2): checksummed blocks by sequence hash, bounded
//! in bytes (`moka`, least recently used evicted first), shared fairly
//! among tenants ([`FairShare`]: room for a tenant above its share comes
//! from its own blocks, so one tenant's flood does not push out another's
//! prefixes). What it evicts goes down to the disk tier when there is one,
//! written by a thread of its own (a full queue skips the block: nothing
//! waits on the disk).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;

use moka::ops::compute::{CompResult, Op};
use turbine_kv::fair::{EVICTIONS_PER_PUT, FairShare};
use turbine_kv::{BlockHashes, CachedBlock, KvEvent, KvTenant, SequenceHash, StoredBlock, Tier, TierSet};

use super::disk::DiskTier;
use super::{EvictionSink, HostBlock, PendingEvents, TierStats, push_removed};

/// The share of the host tier's capacity that evictions waiting for the
/// disk writer may hold (past it the tier's memory would grow unseen).
const SPILL_SHARE_OF_CAPACITY: u64 = 8;

/// Bytes evictions waiting for the disk writer may hold however small the
/// tier (a tier of a few blocks still rides out a burst).
const SPILL_MIN_BYTES: u64 = 64 << 20;

/// Evictions waiting for the disk writer at most, whatever their bytes
/// (a modelled block holds a few bytes but still costs a write).
const SPILL_MAX_BLOCKS: u64 = 65_536;

/// Where host-tier evictions go to be written to disk: a queue bounded in
/// bytes (an eighth of the host tier's capacity or 64 MiB, whichever is
/// more, and always room for one block) and in blocks. An eviction that finds it full skips the disk.
struct Spill {
    queue: Sender<(SequenceHash, Arc<HostBlock>)>,
    /// Bytes and blocks queued, taken back by the writer once written.
    queued: Arc<SpillBacklog>,
    max_bytes: u64,
}

#[derive(Default)]
struct SpillBacklog {
    bytes: AtomicU64,
    blocks: AtomicU64,
}

impl Spill {
    /// Queues `block` for the disk; false (the block is not queued) if
    /// the queue is full or the writer is gone.
    fn offer(&self, hash: SequenceHash, block: Arc<HostBlock>) -> bool {
        let bytes = block.bytes.len() as u64;
        let held = self.queued.bytes.load(Ordering::Relaxed);
        if (held > 0 && held + bytes > self.max_bytes) || self.queued.blocks.load(Ordering::Relaxed) >= SPILL_MAX_BLOCKS {
            return false;
        }
        self.queued.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.queued.blocks.fetch_add(1, Ordering::Relaxed);
        self.queue.send((hash, block)).is_ok()
    }
}

/// A block as the tier holds it: with its stamp in the fair-share books.
#[derive(Clone)]
struct Held {
    block: Arc<HostBlock>,
    stamp: u64,
}

/// Where the tier's evicted blocks go: announced removed, counted, and down
/// to the disk (or the shared tier on eviction).
struct Evictions {
    events: PendingEvents,
    stats: Arc<TierStats>,
    disk: Option<DiskTier>,
    spill: Option<Spill>,
    evicted: EvictionSink,
}

impl Evictions {
    fn evicted(&self, hash: SequenceHash, block: Arc<HostBlock>) {
        self.stats.evicted_blocks.fetch_add(1, Ordering::Relaxed);
        push_removed(&self.events, hash, Tier::Host);
        match (&self.spill, &self.disk) {
            (Some(spill), Some(disk)) => {
                if !disk.contains(hash) {
                    // Findable from here until its file is written.
                    disk.queued(hash, block.clone());
                    if !spill.offer(hash, block) {
                        disk.unqueued(hash);
                        disk.stats().offloads_skipped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            _ => self.evicted.offer(hash, block),
        }
    }
}

/// The host-memory tier (G2): blocks by sequence hash, bounded in bytes.
#[derive(Clone)]
pub struct HostTier {
    cache: moka::sync::Cache<SequenceHash, Held>,
    /// Each tenant's share of the tier.
    fair: Arc<FairShare<SequenceHash>>,
    evictions: Arc<Evictions>,
    events: PendingEvents,
    capacity_bytes: u64,
    /// Bytes each block counts for, if modelled (else its own length).
    modelled_block_bytes: Option<u64>,
    stats: Arc<TierStats>,
    disk: Option<DiskTier>,
    /// Where evictions go besides the disk (the shared tier, on eviction,
    /// when there is no disk).
    evicted: EvictionSink,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier").field("capacity_bytes", &self.capacity_bytes).field("blocks", &self.cache.entry_count()).field("disk", &self.disk).finish()
    }
}

/// What a block counts for against the tier's bytes: its own length, or
/// the modelled block size.
fn weight(modelled_block_bytes: Option<u64>, block: &HostBlock) -> u64 {
    modelled_block_bytes.unwrap_or(block.bytes.len() as u64)
}

impl HostTier {
    /// A tier holding at most `capacity_bytes` of block bytes; what it
    /// evicts is gone.
    pub fn new(capacity_bytes: u64) -> Self {
        Self::build(capacity_bytes, None, None)
    }

    /// A tier holding at most `capacity_bytes` of block bytes, whose
    /// evictions are written to `disk`.
    pub fn with_disk(capacity_bytes: u64, disk: DiskTier) -> Self {
        Self::build(capacity_bytes, Some(Self::spill_to(disk, capacity_bytes)), None)
    }

    /// A tier of an engine whose transfers are modelled
    /// ([`ModelledTransfer`](super::ModelledTransfer)): every block counts
    /// as `block_bytes` against `capacity_bytes`; evictions go to `disk`,
    /// if given.
    pub fn modelled(capacity_bytes: u64, block_bytes: u64, disk: Option<DiskTier>) -> Self {
        Self::build(capacity_bytes, disk.map(|disk| Self::spill_to(disk, capacity_bytes)), Some(block_bytes))
    }

    /// Starts the thread that writes the evictions of a tier of
    /// `capacity_bytes` to `disk`.
    fn spill_to(disk: DiskTier, capacity_bytes: u64) -> (DiskTier, Spill) {
        let (queue, spilled) = std::sync::mpsc::channel::<(SequenceHash, Arc<HostBlock>)>();
        let queued = Arc::new(SpillBacklog::default());
        let writer = disk.clone();
        let backlog = queued.clone();
        std::thread::Builder::new()
            .name("turbine-kv-disk".into())
            .spawn(move || {
                while let Ok((hash, block)) = spilled.recv() {
                    writer.write(hash, &block);
                    backlog.bytes.fetch_sub(block.bytes.len() as u64, Ordering::Relaxed);
                    backlog.blocks.fetch_sub(1, Ordering::Relaxed);
                }
            })
            .expect("spawn the KV disk writer thread");
        (disk, Spill { queue, queued, max_bytes: (capacity_bytes / SPILL_SHARE_OF_CAPACITY).max(SPILL_MIN_BYTES) })
    }

    fn build(capacity_bytes: u64, disk: Option<(DiskTier, Spill)>, modelled_block_bytes: Option<u64>) -> Self {
        let events = PendingEvents::default();
        let stats = Arc::new(TierStats::default());
        let (disk, spill) = disk.unzip();
        let evicted = EvictionSink::default();
        let fair = Arc::new(FairShare::new(capacity_bytes));
        let evictions = Arc::new(Evictions { events: events.clone(), stats: stats.clone(), disk: disk.clone(), spill, evicted: evicted.clone() });
        let cache = {
            let fair = fair.clone();
            let evictions = evictions.clone();
            moka::sync::Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(move |_, held: &Held| u32::try_from(weight(modelled_block_bytes, &held.block)).unwrap_or(u32::MAX))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .eviction_listener(move |hash: Arc<SequenceHash>, held: Held, cause| {
                    // Every block leaving (replaced, removed, evicted) leaves the books.
                    fair.remove(held.block.tenant, held.stamp, weight(modelled_block_bytes, &held.block));
                    if cause.was_evicted() {
                        evictions.evicted(*hash, held.block);
                    }
                })
                .build()
        };
        Self { cache, fair, evictions, events, capacity_bytes, modelled_block_bytes, stats, disk, evicted }
    }

    /// Where this tier's evictions go besides a disk.
    pub(crate) fn eviction_sink(&self) -> &EvictionSink {
        &self.evicted
    }

    /// The disk tier below, if any.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
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

    /// Stores a run of consecutive blocks of one chain, announcing them
    /// with one `Stored` event.
    pub fn insert_run(&self, blocks: Vec<(SequenceHash, HostBlock)>) {
        self.insert_shared_run(blocks.into_iter().map(|(hash, block)| (hash, Arc::new(block))).collect());
    }

    /// [`insert_run`](Self::insert_run) of blocks shared with another
    /// tier.
    pub fn insert_shared_run(&self, blocks: Vec<(SequenceHash, Arc<HostBlock>)>) {
        let Some((_, first)) = blocks.first() else { return };
        let stored = blocks.iter().map(|(hash, block)| StoredBlock { sequence_hash: *hash, local_hash: block.local }).collect();
        // Announced before the cache can evict them, so that a consumer
        // never sees a block removed before it was stored.
        self.events.lock().push(KvEvent::Stored { parent: first.parent, blocks: stored, tier: Tier::Host });
        for (hash, block) in blocks {
            let bytes = weight(self.modelled_block_bytes, &block);
            self.stats.offloaded_bytes.fetch_add(bytes, Ordering::Relaxed);
            self.stats.offloaded_blocks.fetch_add(1, Ordering::Relaxed);
            self.make_room_fairly(block.tenant, bytes);
            // Counted before it is in, so that its eviction always finds it counted.
            let stamp = self.fair.stamp();
            self.fair.add(block.tenant, stamp, hash, bytes);
            self.cache.insert(hash, Held { block, stamp });
        }
        self.cache.run_pending_tasks();
    }

    /// Makes room for `tenant` to store a block of `bytes` from tenants
    /// above their fair share ([`FairShare`]), evicting their least
    /// recently stored blocks as least recently used ones are evicted
    /// (down to the disk, announced, counted).
    fn make_room_fairly(&self, tenant: KvTenant, bytes: u64) {
        // Bounded: a block another thread changed meanwhile ends the round
        // (least recently used then decides).
        for _ in 0..EVICTIONS_PER_PUT {
            let Some((stamp, hash)) = self.fair.victim(tenant, bytes) else { return };
            // Removed only if it is still the block the books name.
            let outcome = self.cache.entry(hash).and_compute_with(|held| match held {
                Some(held) if held.value().stamp == stamp => Op::Remove,
                _ => Op::Nop,
            });
            let CompResult::Removed(entry) = outcome else { return };
            self.stats.fair_share_evictions.fetch_add(1, Ordering::Relaxed);
            self.evictions.evicted(hash, entry.into_value().block);
        }
    }

    /// Bytes `tenant`'s blocks hold in the tier.
    pub fn bytes_of(&self, tenant: KvTenant) -> u64 {
        self.fair.bytes_of(tenant)
    }

    /// The leading blocks of `hashes` the tier holds, checked against their
    /// checksums; a corrupt block is dropped from the tier and ends the run.
    pub fn lookup_run(&self, hashes: &[BlockHashes]) -> Vec<Arc<HostBlock>> {
        let mut run = Vec::new();
        for hashes in hashes {
            let Some(Held { block, .. }) = self.cache.get(&hashes.sequence) else { break };
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
            push_removed(&self.events, hash, Tier::Host);
        }
    }

    /// Every block the tier holds, for a dump.
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.cache.iter().map(|(hash, held)| CachedBlock { sequence_hash: *hash, local_hash: held.block.local, tiers: TierSet(Tier::Host.bit()) }).collect()
    }

    /// Moves the tier's events since the last call into `out`, then the
    /// disk tier's.
    pub fn drain_events(&self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events.lock());
        if let Some(disk) = &self.disk {
            disk.drain_events(out);
        }
    }

    /// Flips a byte of a held block, keeping its checksum: a test's way to
    /// corrupt the tier. Returns whether the block was held.
    #[doc(hidden)]
    pub fn corrupt_for_test(&self, hash: SequenceHash) -> bool {
        let Some(Held { block, .. }) = self.cache.get(&hash) else { return false };
        let mut bytes = block.bytes.to_vec();
        bytes[0] ^= 0xff;
        let corrupt = HostBlock { local: block.local, parent: block.parent, checksum: block.checksum, bytes: bytes.into_boxed_slice(), tenant: block.tenant };
        // Counted anew: the replaced block leaves the books.
        let stamp = self.fair.stamp();
        self.fair.add(block.tenant, stamp, hash, weight(self.modelled_block_bytes, &block));
        self.cache.insert(hash, Held { block: Arc::new(corrupt), stamp });
        self.cache.run_pending_tasks();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbine_kv::LocalBlockHash;
    use turbine_kv::block_checksum;

    fn block(byte: u8, len: usize) -> HostBlock {
        let bytes = vec![byte; len].into_boxed_slice();
        HostBlock { local: LocalBlockHash(u64::from(byte)), parent: None, checksum: block_checksum(&bytes), bytes, tenant: turbine_kv::KvTenant::SHARED }
    }

    fn hashes(n: u64) -> BlockHashes {
        BlockHashes { local: LocalBlockHash(n), sequence: SequenceHash(1000 + n) }
    }

    #[test]
    fn the_tier_stays_within_its_bytes_and_announces_what_it_stores_and_evicts() {
        let tier = HostTier::new(4 * 1024);
        for n in 0..10u8 {
            tier.insert_run(vec![(SequenceHash(1000 + u64::from(n)), block(n, 1024))]);
        }
        assert!(tier.used_bytes() <= 4 * 1024, "{} bytes held", tier.used_bytes());
        assert_eq!(tier.blocks(), 4);
        let mut events = Vec::new();
        tier.drain_events(&mut events);
        let stored: usize = events.iter().map(|e| if let KvEvent::Stored { blocks, tier: Tier::Host, .. } = e { blocks.len() } else { 0 }).sum();
        let removed: usize =
            events.iter().map(|e| if let KvEvent::Removed { sequence_hashes, tier: Tier::Host } = e { sequence_hashes.len() } else { 0 }).sum();
        assert_eq!((stored, removed), (10, 6), "{events:?}");
        // The most recent blocks stay.
        assert_eq!(tier.lookup_run(&[hashes(9)]).len(), 1);
        assert_eq!(tier.lookup_run(&[hashes(0)]).len(), 0);
    }

    fn of(tenant: &str, byte: u8, len: usize) -> Arc<HostBlock> {
        Arc::new(HostBlock { tenant: turbine_kv::KvTenant::of(&[tenant]), ..block(byte, len) })
    }

    /// One tenant storing far past the tier evicts its own blocks: another
    /// tenant's prefix, under its share, stays whole, and the blocks
    /// evicted for fairness go down to the disk as any eviction does.
    #[test]
    fn a_flooding_tenant_evicts_its_own_blocks_not_anothers() {
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskTier::open(dir.path(), 1 << 30, 7).unwrap();
        let tier = HostTier::with_disk(10 * 1024, disk.clone());
        let prefix: Vec<_> = (0..3u8).map(|n| (SequenceHash(1000 + u64::from(n)), of("b", n, 1024))).collect();
        tier.insert_shared_run(prefix.clone());
        for n in 10..110u8 {
            tier.insert_shared_run(vec![(SequenceHash(1000 + u64::from(n)), of("a", n, 1024))]);
        }
        assert!(tier.used_bytes() <= 10 * 1024, "{} bytes held", tier.used_bytes());
        assert_eq!(tier.lookup_run(&[hashes(0), hashes(1), hashes(2)]).len(), 3, "b's prefix is whole");
        assert_eq!(tier.bytes_of(turbine_kv::KvTenant::of(&["b"])), 3 * 1024);
        assert!(tier.bytes_of(turbine_kv::KvTenant::of(&["a"])) <= 7 * 1024);
        let fair = tier.stats().fair_share_evictions.load(Ordering::Relaxed);
        assert!(fair >= 90, "a's flood evicted a's own blocks ({fair})");
        assert_eq!(tier.stats().evicted_blocks.load(Ordering::Relaxed), 93, "every block a stored past 7 was evicted, and counted");
        let mut events = Vec::new();
        tier.drain_events(&mut events);
        let removed: Vec<SequenceHash> = events
            .iter()
            .filter_map(|e| if let KvEvent::Removed { sequence_hashes, tier: Tier::Host } = e { Some(sequence_hashes.clone()) } else { None })
            .flatten()
            .collect();
        assert_eq!(removed.len(), 93, "each eviction announced");
        assert!(!removed.iter().any(|hash| prefix.iter().any(|(b, _)| b == hash)), "none of b's");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while disk.stats().offloaded_blocks.load(Ordering::Relaxed) < 93 {
            assert!(std::time::Instant::now() < deadline, "the disk writer wrote {} of 93", disk.stats().offloaded_blocks.load(Ordering::Relaxed));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(disk.read_run(&[hashes(10)]).len(), 1, "a's oldest block went down to the disk");

        // Unnamed (every block the shared namespace's): least recently
        // used takes the prefix.
        let plain = HostTier::new(10 * 1024);
        plain.insert_run((0..3u8).map(|n| (SequenceHash(1000 + u64::from(n)), block(n, 1024))).collect());
        for n in 10..110u8 {
            plain.insert_run(vec![(SequenceHash(1000 + u64::from(n)), block(n, 1024))]);
        }
        assert!(plain.lookup_run(&[hashes(0)]).is_empty());
        assert_eq!(plain.stats().fair_share_evictions.load(Ordering::Relaxed), 0);
    }

    /// A newcomer's room comes from the tenant above its share, oldest
    /// first; a replaced block leaves the books.
    #[test]
    fn a_newcomer_takes_room_from_the_tenant_above_its_share() {
        let tier = HostTier::new(8 * 1024);
        for n in 0..8u8 {
            tier.insert_shared_run(vec![(SequenceHash(1000 + u64::from(n)), of("a", n, 1024))]);
        }
        assert_eq!(tier.stats().evicted_blocks.load(Ordering::Relaxed), 0);
        tier.insert_shared_run(vec![(SequenceHash(2000), of("b", 50, 1024))]);
        assert_eq!(tier.stats().fair_share_evictions.load(Ordering::Relaxed), 1);
        assert!(!tier.contains(SequenceHash(1000)), "a's oldest made room");
        assert!(tier.contains(SequenceHash(1001)) && tier.contains(SequenceHash(2000)));
        assert!(tier.corrupt_for_test(SequenceHash(1001)));
        assert_eq!(tier.bytes_of(turbine_kv::KvTenant::of(&["a"])), 7 * 1024, "the replaced block counted once");
    }

    /// A burst of evictions far past what one write keeps up with (here
    /// 4,000 modelled blocks at once) all reach the disk: the writer's
    /// backlog is bounded in bytes, and modelled blocks are small.
    #[test]
    fn a_burst_of_evictions_reaches_the_disk_whole() {
        const MODELLED: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskTier::open_modelled(dir.path(), 1 << 40, 7, MODELLED).unwrap();
        let tier = HostTier::modelled(3 * MODELLED, MODELLED, Some(disk.clone()));
        for n in 0..4_000u64 {
            let bytes = n.to_le_bytes().to_vec().into_boxed_slice();
            tier.insert_run(vec![(
                SequenceHash(1_000_000 + n),
                HostBlock { local: LocalBlockHash(n), parent: None, checksum: block_checksum(&bytes), bytes, tenant: turbine_kv::KvTenant::SHARED },
            )]);
        }
        let evicted = tier.stats().evicted_blocks.load(Ordering::Relaxed);
        assert!(evicted >= 3_990, "{evicted} evicted");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while disk.stats().offloaded_blocks.load(Ordering::Relaxed) + disk.stats().offloads_skipped.load(Ordering::Relaxed) < evicted {
            assert!(std::time::Instant::now() < deadline, "the disk writer wrote {} of {evicted}", disk.stats().offloaded_blocks.load(Ordering::Relaxed));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(disk.stats().offloads_skipped.load(Ordering::Relaxed), 0, "no eviction skipped the disk");
        assert_eq!(disk.blocks(), evicted);
    }

    /// Blocks waiting for the writer hold at most an eighth of the host
    /// tier's bytes (and one block always fits).
    #[test]
    fn the_disk_backlog_is_bounded_in_bytes() {
        let (queue, _stalled_writer) = std::sync::mpsc::channel();
        let spill = Spill { queue, queued: Arc::default(), max_bytes: (64 * 1024) / SPILL_SHARE_OF_CAPACITY };
        let queued = (0..100u8).take_while(|&n| spill.offer(SequenceHash(u64::from(n)), Arc::new(block(n, 3 * 1024)))).count();
        assert_eq!(queued, 2, "8 KiB of 3 KiB blocks");
        assert_eq!(spill.queued.bytes.load(Ordering::Relaxed), 6 * 1024);
        let big = Spill { queue: spill.queue.clone(), queued: Arc::default(), max_bytes: 1024 };
        assert!(big.offer(SequenceHash(500), Arc::new(block(1, 4096))), "a block larger than the bound still goes when nothing waits");
        assert!(!big.offer(SequenceHash(501), Arc::new(block(2, 1))));
    }

    #[test]
    fn a_corrupt_block_is_dropped_and_ends_the_run() {
        let tier = HostTier::new(1 << 20);
        tier.insert_run((1..=3u8).map(|n| (SequenceHash(1000 + u64::from(n)), block(n, 64))).collect());
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
