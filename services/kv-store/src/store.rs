//! The blocks: in memory (in the tier's [`Arena`]), bounded in bytes,
//! least recently used evicted first, over an optional disk tier ([`DiskBlocks`]) that every put is
//! written through to and that survives a restart; every block checked
//! against its checksum when it arrives and before it is served.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use moka::ops::compute::{CompResult, Op};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use turbine_kv::{HostBlock, KvTenant, block_checksum};
use turbine_kv::{SequenceHash, UcxNetwork};

use crate::arena::{Arena, Slots};
use crate::disk::DiskBlocks;
use crate::events::Announcer;
use crate::fair::{self, FairShare};
use crate::keys::{BlockKey, Fingerprint, StoreError, TenantScope};
use crate::lease::DataPath;
pub use turbine_api::kv_store::{PutOutcome, StoreStats, TierUsage};

/// What each block costs beyond its bytes (key, entry, bookkeeping of the
/// cache), counted against the capacity so that the bound holds for the
/// process's memory too.
const ENTRY_OVERHEAD: u64 = 200;

static CONFLICTS: std::sync::LazyLock<prometheus::IntCounter> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_kv_store_conflicting_blocks_total",
        "Puts of a block the store already held with other bytes (another checksum): the held block is dropped from every tier and the new one not stored, so a key two writers disagree on is never served",
        &[],
    )
    .with_label_values(&[] as &[&str])
});

static AGREEING: std::sync::LazyLock<prometheus::IntCounter> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_kv_store_agreeing_blocks_total",
        "Puts of a block the store already held with the same bytes (another writer computed the same prefix alike): nothing stored",
        &[],
    )
    .with_label_values(&[] as &[&str])
});

/// Bytes stored between runs of the memory tier's pending evictions.
const EVICT_EVERY_BYTES: usize = 4 << 20;

/// The arena a memory tier of `capacity_bytes` needs: the capacity, and
/// room for blocks stored before the least recently used ones are evicted
/// and for evicted blocks remote readers still hold: a thirty-second more,
/// at least 16 MiB (address space; pages are touched only as used).
pub fn arena_bytes(capacity_bytes: u64) -> usize {
    (capacity_bytes + (capacity_bytes / 32).max(16 << 20)) as usize
}

#[derive(Debug, Default)]
struct Counters {
    evicted_blocks: AtomicU64,
    corrupt_blocks: AtomicU64,
    put_blocks: AtomicU64,
    get_blocks: AtomicU64,
    misses: AtomicU64,
}

/// A block in the memory tier: its bytes in the arena.
#[derive(Debug)]
pub struct MemoryBlock {
    /// Hash of the block's own tokens.
    pub local: turbine_kv::LocalBlockHash,
    /// The sequence hash of the block before it (None: the first block).
    pub parent: Option<SequenceHash>,
    /// XXH3-64 of the bytes, as the block arrived.
    pub checksum: u64,
    /// The bytes.
    pub slots: Slots,
    /// Whose block it is.
    pub tenant: KvTenant,
    /// When it was stored, in the tier's fair-share books.
    stamp: u64,
}

impl MemoryBlock {
    /// What the block costs the memory tier: its segments and bookkeeping.
    fn weight(&self) -> u64 {
        self.slots.footprint() as u64 + ENTRY_OVERHEAD
    }

    /// Whether the bytes still match their checksum.
    pub fn is_intact(&self) -> bool {
        self.slots.checksum() == self.checksum
    }

    /// A copy of the block off the arena.
    pub fn to_host(&self) -> HostBlock {
        HostBlock { local: self.local, parent: self.parent, checksum: self.checksum, bytes: self.slots.to_vec().into_boxed_slice(), tenant: self.tenant }
    }
}

/// A block to store, its bytes borrowed (from a message, a staging read).
#[derive(Debug, Clone, Copy)]
pub struct BlockRef<'a> {
    /// Hash of the block's own tokens.
    pub local: turbine_kv::LocalBlockHash,
    /// The sequence hash of the block before it (None: the first block).
    pub parent: Option<SequenceHash>,
    /// XXH3-64 of the bytes, as the sender computed it.
    pub checksum: u64,
    /// The bytes.
    pub bytes: &'a [u8],
    /// Whose block it is.
    pub tenant: KvTenant,
}

impl<'a> From<&'a HostBlock> for BlockRef<'a> {
    fn from(block: &'a HostBlock) -> Self {
        Self { local: block.local, parent: block.parent, checksum: block.checksum, bytes: &block.bytes, tenant: block.tenant }
    }
}

/// The store. Cloning shares it.
#[derive(Clone)]
pub struct Store {
    blocks: moka::sync::Cache<BlockKey, Arc<MemoryBlock>>,
    arena: Arc<Arena>,
    layouts: Arc<Mutex<FxHashMap<Fingerprint, u64>>>,
    counters: Arc<Counters>,
    fair: Arc<FairShare<BlockKey>>,
    capacity_bytes: u64,
    disk: Option<DiskBlocks>,
    announcer: Announcer,
    data_path: Option<Arc<DataPath>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("capacity_bytes", &self.capacity_bytes).field("blocks", &self.blocks.entry_count()).finish()
    }
}

impl Store {
    /// A store holding at most `capacity_bytes` (block bytes plus their
    /// bookkeeping) in an arena on the heap.
    pub fn new(capacity_bytes: u64) -> Self {
        Self::in_arena(capacity_bytes, Arena::on_heap(arena_bytes(capacity_bytes)), None)
    }

    /// A store holding at most `capacity_bytes` in memory over `disk`:
    /// every block put is written to disk too, and a block read from disk
    /// is kept in memory again.
    pub fn with_disk(capacity_bytes: u64, disk: DiskBlocks) -> Self {
        Self::in_arena(capacity_bytes, Arena::on_heap(arena_bytes(capacity_bytes)), Some(disk))
    }

    /// A store as the service runs it: at most `capacity_bytes` in memory,
    /// over `disk` if given, its memory served over UCX too when `ucx` is
    /// set (its devices, and whether readers get the memory's key or each
    /// lease's own) and this build and machine have UCX.
    pub fn open(capacity_bytes: u64, disk: Option<DiskBlocks>, ucx: Option<(UcxNetwork, turbine_kv::UcxKeys)>) -> Self {
        let bytes = arena_bytes(capacity_bytes);
        let Some((network, keys)) = ucx else {
            return Self::in_arena(capacity_bytes, Arena::on_heap(bytes), disk);
        };
        let (arena, data_path) = crate::lease::arena_with_data_path(bytes, &network, keys);
        Self { data_path, ..Self::in_arena(capacity_bytes, arena, disk) }
    }

    /// The UCX data path serving the memory tier, if any.
    pub fn data_path(&self) -> Option<&Arc<DataPath>> {
        self.data_path.as_ref()
    }

    /// A store holding at most `capacity_bytes` in memory, in `arena`
    /// (of [`arena_bytes`] for that capacity), over `disk` if given.
    pub fn in_arena(capacity_bytes: u64, arena: Arc<Arena>, disk: Option<DiskBlocks>) -> Self {
        // The lowest tier announces what the store holds.
        let announcer = disk.as_ref().map_or_else(Announcer::new, |disk| disk.announcer().clone());
        let memory_announces = disk.is_none().then(|| announcer.clone());
        let layouts: Arc<Mutex<FxHashMap<Fingerprint, u64>>> = Arc::default();
        let counters = Arc::new(Counters::default());
        let fair = Arc::new(FairShare::new(capacity_bytes));
        let blocks = {
            let layouts = layouts.clone();
            let counters = counters.clone();
            let fair = fair.clone();
            moka::sync::Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(|_, block: &Arc<MemoryBlock>| u32::try_from(block.weight()).unwrap_or(u32::MAX))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .eviction_listener(move |key: Arc<BlockKey>, block: Arc<MemoryBlock>, cause| {
                    if cause.was_evicted() {
                        counters.evicted_blocks.fetch_add(1, Relaxed);
                    }
                    if !matches!(cause, moka::notification::RemovalCause::Replaced) {
                        fair.remove(block.tenant, block.stamp, block.weight());
                        if let Some(announcer) = &memory_announces {
                            announcer.removed(key.fingerprint, key.sequence);
                        }
                        let mut layouts = layouts.lock();
                        if let Some(blocks) = layouts.get_mut(&key.fingerprint) {
                            *blocks = blocks.saturating_sub(1);
                            if *blocks == 0 {
                                layouts.remove(&key.fingerprint);
                            }
                        }
                    }
                })
                .build()
        };
        Self { blocks, arena, layouts, counters, fair, capacity_bytes, disk, announcer, data_path: None }
    }

    /// The memory tier's arena.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// `block` copied into the arena; None when the arena has no room even
    /// after pending evictions ran (blocks read by remote readers stay
    /// until they let go).
    fn copy_into_arena(&self, block: BlockRef<'_>) -> Option<Arc<MemoryBlock>> {
        let slots = self.arena.store(block.bytes).or_else(|| {
            self.blocks.run_pending_tasks();
            self.arena.store(block.bytes)
        })?;
        Some(Arc::new(MemoryBlock {
            local: block.local,
            parent: block.parent,
            checksum: block.checksum,
            slots,
            tenant: block.tenant,
            stamp: self.fair.stamp(),
        }))
    }

    /// What the store holds, announced as KV events.
    pub fn announcer(&self) -> &Announcer {
        &self.announcer
    }

    /// The disk tier, if the store has one.
    pub fn disk(&self) -> Option<&DiskBlocks> {
        self.disk.as_ref()
    }

    /// Keeps `block` in memory; whether it was not there yet.
    fn remember(&self, key: BlockKey, block: Arc<MemoryBlock>) -> bool {
        self.make_room_fairly(block.tenant, block.weight());
        // Counted before it is in, so that its eviction always finds it counted.
        *self.layouts.lock().entry(key.fingerprint).or_default() += 1;
        let (tenant, stamp, weight) = (block.tenant, block.stamp, block.weight());
        self.fair.add(tenant, stamp, key, weight);
        let announce = self.disk.is_none();
        let entry = self.blocks.entry(key).or_insert_with(|| {
            // Announced before it is in, so that its removal always
            // follows its announcement.
            if announce {
                self.announcer.stored(key.fingerprint, key.sequence, block.local, block.parent);
            }
            block
        });
        if entry.is_fresh() {
            return true;
        }
        if let Some(blocks) = self.layouts.lock().get_mut(&key.fingerprint) {
            *blocks -= 1;
        }
        self.fair.remove(tenant, stamp, weight);
        false
    }

    /// Makes room for `tenant` to store a block of `bytes` (as the memory
    /// tier weighs it) from tenants above their fair share ([`FairShare`]).
    fn make_room_fairly(&self, tenant: KvTenant, bytes: u64) {
        // Bounded: a block another thread changed meanwhile ends the round
        // (least recently used then decides).
        for _ in 0..fair::EVICTIONS_PER_PUT {
            let Some((stamp, key)) = self.fair.victim(tenant, bytes) else { return };
            // Removed only if it is still the block the books name.
            let outcome = self.blocks.entry(key).and_compute_with(|held| match held {
                Some(held) if held.value().stamp == stamp => Op::Remove,
                _ => Op::Nop,
            });
            if !matches!(outcome, CompResult::Removed(_)) {
                return;
            }
            self.counters.evicted_blocks.fetch_add(1, Relaxed);
            fair::evicted("memory");
        }
    }

    /// Stores blocks of one fingerprint. Every block is checked first;
    /// nothing is stored if one fails.
    pub fn put(&self, fingerprint: Fingerprint, blocks: Vec<(SequenceHash, HostBlock)>) -> Result<PutOutcome, StoreError> {
        let refs: Vec<(SequenceHash, BlockRef<'_>)> = blocks.iter().map(|(sequence, block)| (*sequence, block.into())).collect();
        self.put_refs(fingerprint, &refs)
    }

    /// [`put`](Self::put) with the blocks' bytes borrowed: copied straight
    /// into the arena (and to disk).
    pub fn put_refs(&self, fingerprint: Fingerprint, blocks: &[(SequenceHash, BlockRef<'_>)]) -> Result<PutOutcome, StoreError> {
        // The fingerprint declares its blocks' size; whoever stored first
        // has no say.
        let Some(expected) = fingerprint.block_bytes() else { return Err(StoreError::Undeclared(fingerprint.get())) };
        for (hash, block) in blocks {
            if block_checksum(block.bytes) != block.checksum {
                return Err(StoreError::Corrupt(hash.0));
            }
            let got = block.bytes.len();
            if got as u64 + ENTRY_OVERHEAD > self.capacity_bytes {
                return Err(StoreError::TooLarge(got, self.capacity_bytes));
            }
            if got != expected {
                return Err(StoreError::WrongSize { sequence: hash.0, fingerprint: fingerprint.get(), expected, got });
            }
        }
        let mut outcome = PutOutcome::default();
        let mut since_evictions = 0;
        for &(sequence, block) in blocks {
            // Evictions run every few MiB stored, so the arena's pages in
            // use stay near the capacity rather than a whole put above it.
            since_evictions += block.bytes.len();
            if since_evictions >= EVICT_EVERY_BYTES {
                self.blocks.run_pending_tasks();
                since_evictions = 0;
            }
            let key = BlockKey { fingerprint, sequence };
            // A key held with other bytes: two writers disagree on what
            // the prefix's KV is; neither copy is served.
            let held = self.blocks.get(&key).map(|held| held.checksum).or_else(|| self.disk.as_ref()?.checksum(&key));
            if let Some(checksum) = held {
                if checksum == block.checksum {
                    outcome.already_held += 1;
                    AGREEING.inc();
                } else {
                    self.blocks.remove(&key);
                    if let Some(disk) = &self.disk {
                        disk.remove(&key);
                    }
                    CONFLICTS.inc();
                    tracing::warn!(
                        sequence_hash = sequence.0,
                        fingerprint = fingerprint.get(),
                        "a put disagrees with the block held under its key: both dropped (turbine_kv_store_conflicting_blocks_total)"
                    );
                }
                continue;
            }
            let on_disk = self.disk.as_ref().is_some_and(|disk| {
                let held = disk.contains(&key);
                // Written through: a block the disk could not take is
                // still kept in memory.
                if !held {
                    let owned =
                        HostBlock { local: block.local, parent: block.parent, checksum: block.checksum, bytes: block.bytes.into(), tenant: block.tenant };
                    disk.write(key, &owned);
                }
                held
            });
            let fresh = match self.copy_into_arena(block) {
                Some(in_memory) => self.remember(key, in_memory),
                None => {
                    // No room while readers hold evicted blocks: as if
                    // evicted at once (the disk, if any, has it).
                    self.counters.evicted_blocks.fetch_add(1, Relaxed);
                    !on_disk
                }
            };
            if fresh && !on_disk {
                outcome.stored += 1;
            } else {
                outcome.already_held += 1;
            }
        }
        self.blocks.run_pending_tasks();
        self.counters.put_blocks.fetch_add(u64::from(outcome.stored), Relaxed);
        Ok(outcome)
    }

    /// The leading blocks of `hashes` the store holds, each checked; a
    /// corrupt one is dropped and ends the run.
    pub fn get(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Vec<(SequenceHash, Arc<MemoryBlock>)> {
        self.run(fingerprint, hashes, true)
    }

    /// The leading blocks of `hashes` the store holds, unchecked: for a
    /// remote reader that checks every block itself (a block that fails
    /// there is read again with [`get`](Self::get), which drops it).
    pub fn get_unchecked(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> Vec<(SequenceHash, Arc<MemoryBlock>)> {
        self.run(fingerprint, hashes, false)
    }

    fn run(&self, fingerprint: Fingerprint, hashes: &[SequenceHash], check: bool) -> Vec<(SequenceHash, Arc<MemoryBlock>)> {
        let mut run = Vec::new();
        for &sequence in hashes {
            let key = BlockKey { fingerprint, sequence };
            let Some(block) = self.blocks.get(&key).or_else(|| self.read_through_disk(key)) else {
                self.counters.misses.fetch_add(1, Relaxed);
                break;
            };
            if check && !block.is_intact() {
                self.drop_corrupt(key, &block);
                break;
            }
            run.push((sequence, block));
        }
        self.counters.get_blocks.fetch_add(run.len() as u64, Relaxed);
        run
    }

    /// Drops `block`, found corrupt, once: of readers that found it at the
    /// same time, only the one whose removal takes it counts it, and a sound
    /// copy put since is kept.
    fn drop_corrupt(&self, key: BlockKey, block: &Arc<MemoryBlock>) {
        let outcome = self.blocks.entry(key).and_compute_with(|held| match held {
            Some(held) if Arc::ptr_eq(held.value(), block) => Op::Remove,
            _ => Op::Nop,
        });
        if matches!(outcome, CompResult::Removed(_)) {
            self.counters.corrupt_blocks.fetch_add(1, Relaxed);
            tracing::warn!(sequence_hash = key.sequence.0, fingerprint = key.fingerprint.get(), "a stored KV block failed its checksum; dropped");
        }
    }

    /// A block read from disk (checked there), kept in memory again.
    fn read_through_disk(&self, key: BlockKey) -> Option<Arc<MemoryBlock>> {
        let block = self.copy_into_arena((&self.disk.as_ref()?.read(&key)?).into())?;
        self.remember(key, block.clone());
        Some(block)
    }

    /// Whether either tier holds `key`.
    fn holds(&self, key: &BlockKey) -> bool {
        self.blocks.contains_key(key) || self.disk.as_ref().is_some_and(|disk| disk.contains(key))
    }

    /// Which of `hashes` the store holds, and how many lead without a gap.
    pub fn lookup(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> (Vec<bool>, usize) {
        let (present, leading, _) = self.lookup_within(fingerprint, hashes, &TenantScope::Any);
        (present, leading)
    }

    /// [`lookup`](Self::lookup) for a caller of `scope`: a block of a
    /// tenant it does not allow is not held for it. Also how many such
    /// blocks were held.
    pub fn lookup_within(&self, fingerprint: Fingerprint, hashes: &[SequenceHash], scope: &TenantScope) -> (Vec<bool>, usize, usize) {
        let mut hidden = 0;
        let present: Vec<bool> = hashes
            .iter()
            .map(|&sequence| {
                let key = BlockKey { fingerprint, sequence };
                if *scope == TenantScope::Any {
                    return self.holds(&key);
                }
                let tenant = self.blocks.get(&key).map(|block| block.tenant).or_else(|| self.disk.as_ref()?.tenant_of(&key));
                hidden += usize::from(tenant.is_some_and(|tenant| !scope.allows(tenant)));
                tenant.is_some_and(|tenant| scope.allows(tenant))
            })
            .collect();
        let leading = present.iter().take_while(|&&p| p).count();
        self.counters.misses.fetch_add(present.iter().filter(|&&p| !p).count() as u64, Relaxed);
        (present, leading, hidden)
    }

    /// Drops blocks of a fingerprint (all of them when `hashes` is empty)
    /// from both tiers; returns how many were held.
    pub fn delete(&self, fingerprint: Fingerprint, hashes: &[SequenceHash]) -> u64 {
        let keys: Vec<BlockKey> = if hashes.is_empty() {
            let mut all: Vec<SequenceHash> = self.blocks.iter().filter(|(key, _)| key.fingerprint == fingerprint).map(|(key, _)| key.sequence).collect();
            all.extend(self.disk.iter().flat_map(|disk| disk.hashes_of(fingerprint)));
            all.sort_unstable();
            all.dedup();
            all.into_iter().map(|sequence| BlockKey { fingerprint, sequence }).collect()
        } else {
            hashes.iter().map(|&sequence| BlockKey { fingerprint, sequence }).collect()
        };
        let deleted = keys
            .iter()
            .filter(|key| {
                let in_memory = self.blocks.remove(*key).is_some();
                let on_disk = self.disk.as_ref().is_some_and(|disk| disk.remove(key));
                in_memory || on_disk
            })
            .count() as u64;
        self.blocks.run_pending_tasks();
        deleted
    }

    /// Sizes and counters now (after pending evictions ran).
    pub fn stats(&self) -> StoreStats {
        self.blocks.run_pending_tasks();
        StoreStats {
            memory: TierUsage {
                blocks: self.blocks.entry_count(),
                bytes: self.blocks.weighted_size(),
                capacity_bytes: self.capacity_bytes,
                evicted_blocks: self.counters.evicted_blocks.load(Relaxed),
                corrupt_blocks: self.counters.corrupt_blocks.load(Relaxed),
            },
            disk: self.disk.as_ref().map(DiskBlocks::usage).unwrap_or_default(),
            put_blocks: self.counters.put_blocks.load(Relaxed),
            get_blocks: self.counters.get_blocks.load(Relaxed),
            misses: self.counters.misses.load(Relaxed),
            fingerprints: self.layouts.lock().len() as u32,
            tenants: self.fair.tenants() as u32,
        }
    }

    /// Flips a byte of a held block, keeping its checksum: a test's way to
    /// corrupt the store. Returns whether the block was held.
    #[doc(hidden)]
    pub fn corrupt_for_test(&self, key: BlockKey) -> bool {
        let Some(block) = self.blocks.get(&key) else { return false };
        let mut copy = block.to_host();
        copy.bytes[0] ^= 0xff;
        let Some(slots) = self.arena.store(&copy.bytes) else { return false };
        // The same block in the fair-share books: its stamp kept.
        self.blocks.insert(
            key,
            Arc::new(MemoryBlock { slots, local: block.local, parent: block.parent, checksum: block.checksum, tenant: block.tenant, stamp: block.stamp }),
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use turbine_kv::{KvTenant, LocalBlockHash};

    use super::*;

    fn block(n: u64, len: usize) -> (SequenceHash, HostBlock) {
        let bytes: Box<[u8]> = (0..len).map(|i| (i as u64 * 7 + n) as u8).collect();
        (
            SequenceHash(1000 + n),
            HostBlock {
                local: LocalBlockHash(n),
                parent: n.checked_sub(1).map(|p| SequenceHash(1000 + p)),
                checksum: block_checksum(&bytes),
                bytes,
                tenant: turbine_kv::KvTenant::SHARED,
            },
        )
    }

    /// The fingerprint `n` of blocks of 1,024 bytes.
    fn fp(n: u64) -> Fingerprint {
        Fingerprint::declaring(n, 1024)
    }

    fn hashes(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(|n| SequenceHash(1000 + n)).collect()
    }

    /// A second put of a key with other bytes (a valid checksum of its
    /// own) is a conflict: the held block is dropped too and neither is
    /// served, whichever came first; the same bytes again are held as
    /// before.
    #[test]
    fn a_conflicting_put_drops_the_key_instead_of_serving_either() {
        let conflicts = || CONFLICTS.get();
        let zeroed = |n: u64, len: usize| {
            let (hash, genuine) = block(n, len);
            let zeroes: Box<[u8]> = vec![0u8; len].into();
            (
                hash,
                HostBlock {
                    local: genuine.local,
                    parent: genuine.parent,
                    checksum: block_checksum(&zeroes),
                    bytes: zeroes,
                    tenant: turbine_kv::KvTenant::SHARED,
                },
            )
        };
        let store = Store::new(1 << 20);
        assert_eq!(store.put(fp(1), (0..3).map(|n| block(n, 1024)).collect()), Ok(PutOutcome { stored: 3, already_held: 0 }));
        let before = conflicts();
        assert_eq!(store.put(fp(1), vec![zeroed(1, 1024)]), Ok(PutOutcome { stored: 0, already_held: 0 }));
        assert_eq!(conflicts() - before, 1);
        assert_eq!(store.get(fp(1), &hashes(0..3)).len(), 1, "the run stops where the disputed block was");
        // The forged block first, then the genuine one: the same.
        assert_eq!(store.put(fp(1), vec![zeroed(1, 1024)]), Ok(PutOutcome { stored: 1, already_held: 0 }));
        assert_eq!(store.put(fp(1), vec![block(1, 1024)]), Ok(PutOutcome { stored: 0, already_held: 0 }));
        assert_eq!(conflicts() - before, 2);
        assert_eq!(store.get(fp(1), &hashes(0..3)).len(), 1);
        // Agreement is no conflict.
        assert_eq!(store.put(fp(1), vec![block(1, 1024)]), Ok(PutOutcome { stored: 1, already_held: 0 }));
        assert_eq!(store.put(fp(1), vec![block(1, 1024)]), Ok(PutOutcome { stored: 0, already_held: 1 }));
        assert_eq!(conflicts() - before, 2);
        assert_eq!(store.get(fp(1), &hashes(0..3)).len(), 3);

        // A block held on disk only (evicted from memory) is checked by
        // its file's header, and dropped from the disk on a conflict.
        let dir = tempfile::tempdir().unwrap();
        let store = Store::with_disk(2 * (1024 + ENTRY_OVERHEAD), DiskBlocks::open(dir.path(), 1 << 20).unwrap());
        store.put(fp(1), (0..4).map(|n| block(n, 1024)).collect()).unwrap();
        let (hash, _) = block(0, 1024);
        assert!(!store.blocks.contains_key(&BlockKey { fingerprint: fp(1), sequence: hash }), "on disk only");
        assert_eq!(store.put(fp(1), vec![zeroed(0, 1024)]), Ok(PutOutcome { stored: 0, already_held: 0 }));
        assert_eq!(conflicts() - before, 3);
        assert!(store.get(fp(1), &hashes(0..1)).is_empty());
        assert_eq!(store.stats().disk.blocks, 3);
    }

    /// b's hit rate over `rounds` reads of its 20 two-block prefixes (40
    /// blocks, 40% of the store), each read putting what missed, while a
    /// puts `flood` unique blocks per read; `a` and `b` name their tenants.
    fn hit_rate_beside_a_flood(a: KvTenant, b: KvTenant, flood: u64, rounds: u64) -> (f64, Store) {
        let store = Store::new(100 * (1024 + ENTRY_OVERHEAD));
        let of = |tenant: KvTenant, (hash, block): (SequenceHash, HostBlock)| (hash, HostBlock { tenant, ..block });
        let mut hits = 0;
        let mut fresh = 10_000;
        for round in 0..rounds {
            let prefix = (round * 7) % 20;
            let wanted = hashes(prefix * 2..prefix * 2 + 2);
            if store.get(fp(1), &wanted).len() == 2 {
                hits += 1;
            } else {
                store.put(fp(1), (prefix * 2..prefix * 2 + 2).map(|n| of(b, block(n, 1024))).collect()).unwrap();
            }
            for _ in 0..flood {
                store.put(fp(1), vec![of(a, block(fresh, 1024))]).unwrap();
                fresh += 1;
            }
        }
        (f64::from(hits) / rounds as f64, store)
    }

    /// The judgement, in the store: tenant b's prefix-hit rate
    /// beside tenant a flooding stays within 5 points of b's alone, while
    /// the same flood with both as one tenant (least recently used alone)
    /// takes b's working set.
    #[test]
    fn a_flooding_tenant_evicts_its_own_blocks_not_anothers_working_set() {
        let (a, b) = (KvTenant::of(&["a"]), KvTenant::of(&["b"]));
        let before = fair::evictions("memory");
        let (alone, _) = hit_rate_beside_a_flood(a, b, 0, 2000);
        let (fair, store) = hit_rate_beside_a_flood(a, b, 5, 2000);
        let (unfair, _) = hit_rate_beside_a_flood(KvTenant::SHARED, KvTenant::SHARED, 5, 2000);
        println!("b's hit rate: alone {alone:.3}, beside a's flood {fair:.3} (fair shares), {unfair:.3} (one tenant, least recently used)");
        assert!(alone - fair <= 0.05, "alone {alone}, flooded {fair}");
        assert!(unfair < alone - 0.5, "the flood is strong enough to matter without fair shares: {unfair}");
        let stats = store.stats();
        assert_eq!(stats.tenants, 2);
        assert!(stats.memory.bytes <= stats.memory.capacity_bytes, "{stats:?}");
        assert!(fair::evictions("memory") - before >= 9000, "a's flood evicted a's own blocks");
        assert_eq!(store.fair.bytes_of(b), 40 * (1024 + ENTRY_OVERHEAD), "b keeps its whole working set");
    }

    /// The disk tier keeps fair shares too, and its files keep their
    /// tenant across a restart: a flood after the reopen still evicts the
    /// flooder's own files.
    #[test]
    fn the_disk_tier_keeps_fair_shares_across_a_restart() {
        let (a, b) = (KvTenant::of(&["a"]), KvTenant::of(&["b"]));
        let of = |tenant: KvTenant, n: u64| {
            let (hash, block) = block(n, 1024);
            (hash, HostBlock { tenant, ..block })
        };
        let dir = tempfile::tempdir().unwrap();
        let file = 1024 + turbine_kv::block_file::HEADER_BYTES as u64;
        let held =
            |store: &Store| (0..10).filter(|&n| store.disk().unwrap().contains(&BlockKey { fingerprint: fp(1), sequence: SequenceHash(1000 + n) })).count();
        let before = fair::evictions("disk");
        {
            let store = Store::with_disk(4 * (1024 + ENTRY_OVERHEAD), DiskBlocks::open(dir.path(), 30 * file).unwrap());
            store.put(fp(1), (0..10).map(|n| of(b, n)).collect()).unwrap();
            for n in 100..200 {
                store.put(fp(1), vec![of(a, n)]).unwrap();
            }
            assert_eq!(held(&store), 10, "b's files stay");
            assert_eq!(store.stats().disk.blocks, 30);
            assert!(fair::evictions("disk") - before >= 80, "a's flood deleted a's own files");
        }
        let store = Store::with_disk(4 * (1024 + ENTRY_OVERHEAD), DiskBlocks::open(dir.path(), 30 * file).unwrap());
        for n in 200..300 {
            store.put(fp(1), vec![of(a, n)]).unwrap();
        }
        assert_eq!(held(&store), 10, "b's files are still b's after the restart");
        let run = store.get(fp(1), &hashes(0..10));
        assert_eq!(run.len(), 10);
        assert!(run.iter().all(|(_, block)| block.tenant == b), "read back as b's");
    }

    #[test]
    fn blocks_come_back_by_fingerprint_and_hash_only() {
        let store = Store::new(1 << 20);
        assert_eq!(store.put(fp(1), (0..4).map(|n| block(n, 1024)).collect()), Ok(PutOutcome { stored: 4, already_held: 0 }));
        assert_eq!(store.put(fp(1), vec![block(0, 1024)]), Ok(PutOutcome { stored: 0, already_held: 1 }));
        let got = store.get(fp(1), &hashes(0..6));
        assert_eq!(got.len(), 4, "the run stops at the first block not held");
        assert_eq!(got[2].1.slots.to_vec(), &block(2, 1024).1.bytes[..]);
        assert!(store.get(fp(2), &hashes(0..4)).is_empty(), "another layout's blocks never mix");
        assert_eq!(store.lookup(fp(1), &[SequenceHash(1000), SequenceHash(5), SequenceHash(1002)]), (vec![true, false, true], 1));
        assert_eq!(store.delete(fp(1), &hashes(1..2)), 1);
        assert_eq!(store.get(fp(1), &hashes(0..4)).len(), 1);
        assert_eq!(store.delete(fp(1), &[]), 3);
        assert_eq!(store.stats().memory.blocks, 0);
        assert_eq!(store.stats().fingerprints, 0);
    }

    #[test]
    fn bad_blocks_are_refused_whole() {
        let store = Store::new(1 << 20);
        let (hash, mut bad) = block(1, 1024);
        bad.bytes[3] ^= 1;
        assert_eq!(store.put(fp(1), vec![block(0, 1024), (hash, bad)]), Err(StoreError::Corrupt(1001)));
        assert_eq!(store.stats().memory.blocks, 0, "nothing of a refused put is stored");
        store.put(fp(1), vec![block(0, 1024)]).unwrap();
        assert!(matches!(store.put(fp(1), vec![block(1, 32)]), Err(StoreError::WrongSize { expected: 1024, got: 32, .. })));
        assert!(matches!(store.put(fp(2), vec![block(1, 2 << 20)]), Err(StoreError::TooLarge(..))));
    }

    /// A writer that stores first with another size than the fingerprint
    /// declares fixes nothing: it is refused, and the declared size stored
    /// after it; a fingerprint that declares no size stores nothing.
    #[test]
    fn the_fingerprint_not_the_first_writer_fixes_the_block_size() {
        let store = Store::new(1 << 20);
        assert!(matches!(store.put(fp(3), vec![block(0, 64)]), Err(StoreError::WrongSize { expected: 1024, got: 64, .. })));
        assert_eq!(store.put(fp(3), vec![block(0, 1024)]), Ok(PutOutcome { stored: 1, already_held: 0 }));
        let undeclared = Fingerprint::new(3).unwrap();
        assert_eq!(store.put(undeclared, vec![block(0, 1024)]), Err(StoreError::Undeclared(3)));
        assert_eq!(store.stats().memory.blocks, 1);
    }

    #[test]
    fn the_store_stays_within_its_bytes_and_drops_corrupt_blocks() {
        let store = Store::new(10 * (1024 + ENTRY_OVERHEAD));
        for n in 0..50 {
            store.put(fp(1), vec![block(n, 1024)]).unwrap();
        }
        let stats = store.stats().memory;
        assert!(stats.bytes <= stats.capacity_bytes, "{stats:?}");
        assert_eq!(stats.blocks, 10);
        assert_eq!(stats.evicted_blocks, 40);
        assert_eq!(store.get(fp(1), &hashes(49..50)).len(), 1, "the most recent blocks stay");

        assert!(store.corrupt_for_test(BlockKey { fingerprint: fp(1), sequence: SequenceHash(1048) }));
        assert!(store.get(fp(1), &hashes(48..50)).is_empty(), "a corrupt block is never served");
        assert_eq!(store.stats().memory.corrupt_blocks, 1);
        assert_eq!(store.lookup(fp(1), &hashes(48..49)).1, 0, "and is gone");
    }

    #[test]
    fn the_disk_tier_keeps_what_memory_evicted_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let key = |n: u64| BlockKey { fingerprint: fp(1), sequence: SequenceHash(1000 + n) };
        {
            let store = Store::with_disk(4 * (1024 + ENTRY_OVERHEAD), DiskBlocks::open(dir.path(), 1 << 20).unwrap());
            assert!(DiskBlocks::open(dir.path(), 1 << 20).is_err(), "a second store cannot use the directory");
            assert_eq!(store.put(fp(1), (0..10).map(|n| block(n, 1024)).collect()).unwrap().stored, 10);
            assert_eq!(store.put(fp(2), vec![block(0, 1024)]).unwrap().stored, 1);
            let stats = store.stats();
            assert_eq!((stats.memory.blocks, stats.disk.blocks), (4, 11), "{stats:?}");
            assert_eq!(store.put(fp(1), vec![block(0, 1024)]).unwrap().already_held, 1, "held on disk only");
            let run = store.get(fp(1), &hashes(0..10));
            assert_eq!(run.len(), 10, "evicted from memory, read back from disk");
            assert_eq!(run[3].1.slots.to_vec(), &block(3, 1024).1.bytes[..]);
            assert!(
                matches!(store.put(fp(1), vec![block(20, 64)]), Err(StoreError::WrongSize { expected: 1024, got: 64, .. })),
                "the declared size holds after a restart"
            );
        }
        // A torn file and a leftover .tmp, as after a crash.
        let store = Store::with_disk(1 << 20, DiskBlocks::open(dir.path(), 1 << 20).unwrap());
        let torn = store.disk().unwrap().path_for_test(&key(5));
        drop(store);
        let full = std::fs::read(&torn).unwrap();
        std::fs::write(&torn, &full[..100]).unwrap();
        std::fs::write(torn.with_extension("tmp"), b"partial").unwrap();
        let store = Store::with_disk(1 << 20, DiskBlocks::open(dir.path(), 1 << 20).unwrap());
        assert_eq!(store.stats().disk.blocks, 10, "the torn block was dropped at start, the others kept");
        assert_eq!(store.lookup(fp(1), &hashes(0..10)).1, 5);
        assert_eq!(store.get(fp(1), &hashes(0..5)).len(), 5);
        assert_eq!(store.get(fp(2), &hashes(0..1)).len(), 1, "every fingerprint's blocks are kept");

        // A block corrupted on disk is never served.
        let path = store.disk().unwrap().path_for_test(&key(7));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        assert!(store.get(fp(1), &hashes(7..8)).is_empty());
        assert!(!path.exists() && store.stats().disk.corrupt_blocks == 1);
        assert_eq!(store.delete(fp(1), &[]), 8, "deletes reach both tiers");
        assert_eq!(store.stats().disk.blocks, 1);
    }

    #[test]
    fn readers_that_find_a_corrupt_block_at_once_count_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::with_disk(1024 + ENTRY_OVERHEAD, DiskBlocks::open(dir.path(), 1 << 20).unwrap());
        store.put(fp(1), vec![block(0, 1024), block(1, 1024)]).unwrap();
        assert_eq!((store.stats().memory.blocks, store.stats().disk.blocks), (1, 2), "the first block is on disk only");
        let path = store.disk().unwrap().path_for_test(&BlockKey { fingerprint: fp(1), sequence: SequenceHash(1000) });
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| assert!(store.get(fp(1), &hashes(0..2)).is_empty(), "never served"));
            }
        });
        assert_eq!(store.stats().disk.corrupt_blocks, 1);
        store.put(fp(1), vec![block(0, 1024)]).unwrap();
        assert_eq!(store.get(fp(1), &hashes(0..2)).len(), 2, "a sound copy put again is served");
    }

    /// Each fingerprint's held blocks, as the announcements add up.
    fn announced(store: &Store, fingerprint: Fingerprint) -> Vec<u64> {
        let mut held: Vec<u64> = store.announcer().dump(fingerprint).blocks.iter().map(|block| block.sequence_hash.0).collect();
        held.sort_unstable();
        held
    }

    #[test]
    fn the_lowest_tier_announces_what_the_store_holds() {
        // Memory only: puts, evictions, deletes and corrupt blocks.
        let store = Store::new(4 * (1024 + ENTRY_OVERHEAD));
        let mut events = store.announcer().subscribe();
        store.put(fp(1), (0..6).map(|n| block(n, 1024)).collect()).unwrap();
        assert_eq!(announced(&store, fp(1)), [1002, 1003, 1004, 1005], "the evicted two were announced gone");
        assert_eq!(store.delete(fp(1), &hashes(5..6)), 1);
        assert!(store.corrupt_for_test(BlockKey { fingerprint: fp(1), sequence: SequenceHash(1004) }));
        assert!(store.get(fp(1), &hashes(4..5)).is_empty());
        assert_eq!(announced(&store, fp(1)), [1002, 1003]);
        let mut count = 0;
        while events.try_recv().is_ok() {
            count += 1;
        }
        assert_eq!((count, store.announcer().dump(fp(1)).next_event_id), (10, 10), "6 stored, 4 removed, numbered alike");

        // Over a disk: memory evicts freely, the files are what is held,
        // and a reopened store announces what it kept.
        let dir = tempfile::tempdir().unwrap();
        let file = 1024 + turbine_kv::block_file::HEADER_BYTES as u64;
        {
            let store = Store::with_disk(2 * (1024 + ENTRY_OVERHEAD), DiskBlocks::open(dir.path(), 5 * file).unwrap());
            store.put(fp(1), (0..4).map(|n| block(n, 1024)).collect()).unwrap();
            assert_eq!(announced(&store, fp(1)), [1000, 1001, 1002, 1003], "memory's evictions are not the store's");
            store.put(fp(1), (4..7).map(|n| block(n, 1024)).collect()).unwrap();
            assert_eq!(announced(&store, fp(1)), [1002, 1003, 1004, 1005, 1006], "the disk's are");
            assert_eq!(store.delete(fp(1), &hashes(6..7)), 1);
            assert_eq!(announced(&store, fp(1)), [1002, 1003, 1004, 1005]);
        }
        let store = Store::with_disk(1 << 20, DiskBlocks::open(dir.path(), 5 * file).unwrap());
        assert_eq!(announced(&store, fp(1)), [1002, 1003, 1004, 1005]);
        let dump = store.announcer().dump(fp(1));
        assert_eq!(dump.next_event_id, 4);
        assert!(dump.blocks.iter().all(|block| block.local_hash.0 == block.sequence_hash.0 - 1000), "local hashes come back from the files");
    }

    #[test]
    fn the_disk_tier_stays_within_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let file = 1024 + turbine_kv::block_file::HEADER_BYTES as u64;
        let store = Store::with_disk(1 << 20, DiskBlocks::open(dir.path(), 5 * file).unwrap());
        for n in 0..20 {
            store.put(fp(1), vec![block(n, 1024)]).unwrap();
        }
        let disk = store.stats().disk;
        assert_eq!((disk.blocks, disk.evicted_blocks), (5, 15), "{disk:?}");
        assert!(disk.bytes <= disk.capacity_bytes);
        let files = std::fs::read_dir(dir.path().join(format!("{:016x}", fp(1).get()))).unwrap().count();
        assert_eq!(files, 5, "evicted blocks' files are deleted");
    }
}
