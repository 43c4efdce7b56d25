//! The local-disk tier (G3): one file per block in a directory this
//! engine alone uses (an exclusive lock on `<dir>/.lock`), its index a
//! byte-bounded `moka` cache (least recently used evicted first, its file
//! deleted), shared fairly among tenants as the host tier is
//! ([`FairShare`]; a block's tenant is in its file's header).
//!
//! A file is `<sequence hash, 16 hex digits>.kvb` in the format of
//! [`block_file`](super::block_file): written whole or not at all, checked
//! (header, length, payload checksum) on every read; a block that fails is
//! deleted and computed instead, never served.
//!
//! At start the tier rebuilds its index from the files whose header is
//! sound and whose fingerprint matches (blocks of another model or layout
//! are deleted, as are leftover `.tmp` files), so a restarted worker keeps
//! its disk tier.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use moka::ops::compute::{CompResult, Op};
use turbine_kv::fair::{EVICTIONS_PER_PUT, FairShare};
use turbine_kv::{BlockHashes, CachedBlock, KvEvent, KvTenant, LocalBlockHash, SequenceHash, StoredBlock, Tier, TierSet};

use super::block_file::{self, HEADER_BYTES, block_path};
use super::{EvictionSink, HostBlock, PendingEvents, TierStats, push_removed};

/// What the index keeps of a block on disk.
#[derive(Debug, Clone, Copy)]
struct DiskEntry {
    local: LocalBlockHash,
    bytes: u64,
    /// Whose block it is (as its file says).
    tenant: KvTenant,
    /// When it was indexed, in the tier's fair-share books.
    stamp: u64,
}

/// The disk tier (G3). Cloning shares it.
#[derive(Clone)]
pub struct DiskTier {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    fingerprint: u64,
    index: moka::sync::Cache<SequenceHash, DiskEntry>,
    /// Each tenant's share of the files.
    fair: Arc<FairShare<SequenceHash>>,
    events: PendingEvents,
    stats: Arc<TierStats>,
    capacity_bytes: u64,
    /// Bytes each block counts for, if modelled (else its file's length).
    modelled_block_bytes: Option<u64>,
    /// Where evicted blocks go (the shared tier, on eviction), read back
    /// from their files before those are deleted.
    evicted: EvictionSink,
    /// Blocks queued for writing (a host tier's evictions on their way
    /// here): found and read from memory until their file is written, so
    /// a block is never in neither tier while it moves.
    writing: parking_lot::Mutex<std::collections::HashMap<SequenceHash, Arc<HostBlock>>>,
    /// Held for the tier's life: no other engine uses the directory.
    _lock: File,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("dir", &self.inner.dir).field("capacity_bytes", &self.inner.capacity_bytes).finish_non_exhaustive()
    }
}

/// An evicted block's file: read back for the shared tier when it takes
/// evictions, deleted, announced removed, counted.
fn evict_file(dir: &Path, fingerprint: u64, stats: &TierStats, evicted: &EvictionSink, events: &PendingEvents, hash: SequenceHash) {
    stats.evicted_blocks.fetch_add(1, Ordering::Relaxed);
    let path = block_path(dir, hash);
    if evicted.is_connected()
        && let Some(block) = block_file::read_block(&path, fingerprint, hash)
        && block.is_intact()
    {
        evicted.offer(hash, Arc::new(block));
    }
    let _ = std::fs::remove_file(path);
    push_removed(events, hash, Tier::Disk);
}

impl DiskTier {
    /// Opens (creating it if needed) the tier in `dir`, holding at most
    /// `capacity_bytes` of block files, for blocks of the pool layout
    /// `fingerprint`; rebuilds its index from the files already there.
    pub fn open(dir: &Path, capacity_bytes: u64, fingerprint: u64) -> std::io::Result<Self> {
        Self::open_with(dir, capacity_bytes, fingerprint, None)
    }

    /// Opens the tier of an engine whose transfers are modelled
    /// ([`ModelledTransfer`](super::ModelledTransfer)): every block counts
    /// as `block_bytes` against `capacity_bytes`.
    pub fn open_modelled(dir: &Path, capacity_bytes: u64, fingerprint: u64, block_bytes: u64) -> std::io::Result<Self> {
        Self::open_with(dir, capacity_bytes, fingerprint, Some(block_bytes))
    }

    fn open_with(dir: &Path, capacity_bytes: u64, fingerprint: u64, modelled_block_bytes: Option<u64>) -> std::io::Result<Self> {
        let lock = block_file::lock_dir(dir, "Turbine worker")?;
        let events = PendingEvents::default();
        let stats = Arc::new(TierStats::default());
        let evicted = EvictionSink::default();
        let fair = Arc::new(FairShare::new(capacity_bytes));
        let index = {
            let events = events.clone();
            let stats = stats.clone();
            let dir = dir.to_path_buf();
            let evicted = evicted.clone();
            let fair = fair.clone();
            moka::sync::Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(|_, entry: &DiskEntry| u32::try_from(entry.bytes).unwrap_or(u32::MAX))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .eviction_listener(move |hash: Arc<SequenceHash>, entry: DiskEntry, cause| {
                    // Every entry leaving (replaced, removed, evicted) leaves the books.
                    fair.remove(entry.tenant, entry.stamp, entry.bytes);
                    if cause.was_evicted() {
                        evict_file(&dir, fingerprint, &stats, &evicted, &events, *hash);
                    }
                })
                .build()
        };
        let tier = Self {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                fingerprint,
                index,
                fair,
                events,
                stats,
                capacity_bytes,
                modelled_block_bytes,
                evicted,
                writing: parking_lot::Mutex::default(),
                _lock: lock,
            }),
        };
        tier.rebuild()?;
        Ok(tier)
    }

    /// Indexes the sound block files of this layout; deletes the rest of
    /// this tier's files.
    fn rebuild(&self) -> std::io::Result<()> {
        let mut found = block_file::scan_dir(&self.inner.dir)?;
        found.retain(|header| {
            let ours = header.fingerprint == self.inner.fingerprint;
            if !ours {
                let _ = std::fs::remove_file(block_path(&self.inner.dir, header.sequence));
            }
            ours
        });
        for header in &found {
            self.inner.events.lock().push(KvEvent::Stored {
                parent: header.parent,
                blocks: vec![StoredBlock { sequence_hash: header.sequence, local_hash: header.local }],
                tier: Tier::Disk,
            });
            self.index(header.sequence, header.local, self.weight(header.len), header.tenant);
        }
        self.inner.index.run_pending_tasks();
        if !found.is_empty() {
            tracing::info!(dir = %self.inner.dir.display(), blocks = found.len(), "disk KV tier: blocks kept from before");
        }
        Ok(())
    }

    /// What a block of `len` payload bytes counts for: its file, or the
    /// modelled block size.
    fn weight(&self, len: u64) -> u64 {
        self.inner.modelled_block_bytes.unwrap_or(len + HEADER_BYTES as u64)
    }

    /// Bytes the tier may hold.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    /// Bytes held now (after pending evictions ran).
    pub fn used_bytes(&self) -> u64 {
        self.inner.index.run_pending_tasks();
        self.inner.index.weighted_size()
    }

    /// Blocks held now (after pending evictions ran).
    pub fn blocks(&self) -> u64 {
        self.inner.index.run_pending_tasks();
        self.inner.index.entry_count()
    }

    /// The tier's counters.
    pub fn stats(&self) -> &TierStats {
        &self.inner.stats
    }

    /// Whether the tier holds `hash` (on disk, or queued for writing).
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.inner.index.contains_key(&hash) || self.inner.writing.lock().contains_key(&hash)
    }

    /// `block` is queued to be [`write`](Self::write)n: until it is, the
    /// tier answers for it from memory.
    pub(crate) fn queued(&self, hash: SequenceHash, block: Arc<HostBlock>) {
        self.inner.writing.lock().insert(hash, block);
    }

    /// The queued `hash` will not be written after all (the queue refused
    /// it).
    pub(crate) fn unqueued(&self, hash: SequenceHash) {
        self.inner.writing.lock().remove(&hash);
    }

    /// Where this tier's evictions go.
    pub(crate) fn eviction_sink(&self) -> &EvictionSink {
        &self.inner.evicted
    }

    /// Writes a block (a failed write is counted and logged; the block is
    /// then simply not on disk).
    pub fn write(&self, hash: SequenceHash, block: &HostBlock) {
        self.write_file(hash, block);
        self.unqueued(hash);
    }

    fn write_file(&self, hash: SequenceHash, block: &HostBlock) {
        if self.inner.index.contains_key(&hash) {
            return;
        }
        let path = block_path(&self.inner.dir, hash);
        if let Err(error) = block_file::write_block(&path, self.inner.fingerprint, hash, block) {
            self.inner.stats.offloads_skipped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, path = %path.display(), "cannot write a KV block to the disk tier");
            return;
        }
        self.inner.events.lock().push(KvEvent::Stored {
            parent: block.parent,
            blocks: vec![StoredBlock { sequence_hash: hash, local_hash: block.local }],
            tier: Tier::Disk,
        });
        self.inner.stats.offloaded_blocks.fetch_add(1, Ordering::Relaxed);
        let bytes = self.weight(block.bytes.len() as u64);
        self.inner.stats.offloaded_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.make_room_fairly(block.tenant, bytes);
        self.index(hash, block.local, bytes, block.tenant);
        self.inner.index.run_pending_tasks();
    }

    /// Indexes a file, counted in its tenant's share (before it is in, so
    /// that its eviction always finds it counted).
    fn index(&self, hash: SequenceHash, local: LocalBlockHash, bytes: u64, tenant: KvTenant) {
        let stamp = self.inner.fair.stamp();
        self.inner.fair.add(tenant, stamp, hash, bytes);
        self.inner.index.insert(hash, DiskEntry { local, bytes, tenant, stamp });
    }

    /// Makes room for `tenant` to keep a file of `bytes` from tenants above
    /// their fair share ([`FairShare`]): their oldest files go as least
    /// recently used ones do (read back for the shared tier if it takes
    /// evictions, deleted, announced, counted).
    fn make_room_fairly(&self, tenant: KvTenant, bytes: u64) {
        for _ in 0..EVICTIONS_PER_PUT {
            let Some((stamp, hash)) = self.inner.fair.victim(tenant, bytes) else { return };
            let outcome = self.inner.index.entry(hash).and_compute_with(|held| match held {
                Some(held) if held.value().stamp == stamp => Op::Remove,
                _ => Op::Nop,
            });
            if !matches!(outcome, CompResult::Removed(_)) {
                return;
            }
            self.inner.stats.fair_share_evictions.fetch_add(1, Ordering::Relaxed);
            let inner = &self.inner;
            evict_file(&inner.dir, inner.fingerprint, &inner.stats, &inner.evicted, &inner.events, hash);
        }
    }

    /// Bytes `tenant`'s files hold in the tier.
    pub fn bytes_of(&self, tenant: KvTenant) -> u64 {
        self.inner.fair.bytes_of(tenant)
    }

    /// Reads the leading blocks of `hashes` the tier holds, each checked
    /// (header, length, checksum); one that fails is deleted and ends the
    /// run.
    pub fn read_run(&self, hashes: &[BlockHashes]) -> Vec<Arc<HostBlock>> {
        let mut run = Vec::new();
        for hashes in hashes {
            let queued = self.inner.writing.lock().get(&hashes.sequence).cloned();
            if let Some(block) = queued {
                if block.local != hashes.local || !block.is_intact() {
                    break;
                }
                run.push(block);
                continue;
            }
            let Some(entry) = self.inner.index.get(&hashes.sequence) else { break };
            match self.read(hashes.sequence) {
                Some(block) if block.local == hashes.local && block.local == entry.local => run.push(Arc::new(block)),
                _ => {
                    self.inner.stats.corrupt_blocks.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(sequence_hash = hashes.sequence.0, "a disk-tier KV block is unreadable or corrupt; dropped, computing it instead");
                    self.remove(hashes.sequence);
                    break;
                }
            }
        }
        run
    }

    fn read(&self, hash: SequenceHash) -> Option<HostBlock> {
        block_file::read_block(&block_path(&self.inner.dir, hash), self.inner.fingerprint, hash)
    }

    /// Drops a block from the tier, deleting its file.
    pub fn remove(&self, hash: SequenceHash) {
        let _ = std::fs::remove_file(block_path(&self.inner.dir, hash));
        if self.inner.index.remove(&hash).is_some() {
            push_removed(&self.inner.events, hash, Tier::Disk);
        }
    }

    /// Every block the tier holds, for a dump.
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.inner.index.iter().map(|(hash, entry)| CachedBlock { sequence_hash: *hash, local_hash: entry.local, tiers: TierSet(Tier::Disk.bit()) }).collect()
    }

    /// Moves the tier's events since the last call into `out`.
    pub fn drain_events(&self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.inner.events.lock());
    }

    /// The file of a block (for tests that corrupt one).
    #[doc(hidden)]
    pub fn path_for_test(&self, hash: SequenceHash) -> PathBuf {
        block_path(&self.inner.dir, hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbine_kv::block_checksum;

    fn block(byte: u8, len: usize, parent: Option<u64>) -> HostBlock {
        let bytes: Box<[u8]> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
        HostBlock {
            local: LocalBlockHash(u64::from(byte)),
            parent: parent.map(SequenceHash),
            checksum: block_checksum(&bytes),
            bytes,
            tenant: turbine_kv::KvTenant::SHARED,
        }
    }

    fn hashes(n: u8) -> BlockHashes {
        BlockHashes { local: LocalBlockHash(u64::from(n)), sequence: SequenceHash(1000 + u64::from(n)) }
    }

    #[test]
    fn blocks_survive_a_reopen_and_other_layouts_and_torn_files_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        {
            let tier = DiskTier::open(dir.path(), 1 << 20, 11).unwrap();
            assert!(DiskTier::open(dir.path(), 1 << 20, 11).is_err(), "a second engine cannot use the directory");
            for n in 1..=3u8 {
                tier.write(SequenceHash(1000 + u64::from(n)), &block(n, 4096, (n > 1).then(|| 1000 + u64::from(n) - 1)));
            }
            assert_eq!(tier.read_run(&[hashes(1), hashes(2), hashes(3)]).len(), 3);
        }
        // A torn file (a crash after the rename, before the data reached the disk).
        let torn = dir.path().join(format!("{:016x}.kvb", 1003));
        let full = std::fs::read(&torn).unwrap();
        std::fs::write(&torn, &full[..100]).unwrap();
        std::fs::write(dir.path().join("0000000000000001.tmp"), b"partial").unwrap();
        let tier = DiskTier::open(dir.path(), 1 << 20, 11).unwrap();
        assert_eq!(tier.blocks(), 2, "the torn block was dropped at start");
        assert!(!torn.exists() && !dir.path().join("0000000000000001.tmp").exists());
        let run = tier.read_run(&[hashes(1), hashes(2), hashes(3)]);
        assert_eq!(run.len(), 2);
        assert_eq!(run[1].bytes, block(2, 4096, None).bytes, "the bytes written are the bytes read");
        assert_eq!(run[1].parent, Some(SequenceHash(1001)));
        let mut events = Vec::new();
        tier.drain_events(&mut events);
        assert_eq!(events.iter().filter(|e| matches!(e, KvEvent::Stored { tier: Tier::Disk, .. })).count(), 2, "kept blocks are announced");
        drop(tier);
        let other_layout = DiskTier::open(dir.path(), 1 << 20, 12).unwrap();
        assert_eq!(other_layout.blocks(), 0, "blocks of another layout are never served");
    }

    #[test]
    fn a_corrupt_block_is_deleted_and_ends_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::open(dir.path(), 1 << 20, 1).unwrap();
        for n in 1..=3u8 {
            tier.write(SequenceHash(1000 + u64::from(n)), &block(n, 512, None));
        }
        let path = tier.path_for_test(SequenceHash(1002));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER_BYTES + 10] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(tier.read_run(&[hashes(1), hashes(2), hashes(3)]).len(), 1);
        assert!(!path.exists() && !tier.contains(SequenceHash(1002)));
        assert_eq!(tier.stats().corrupt_blocks.load(Ordering::Relaxed), 1);
    }

    /// One tenant writing far past the tier deletes its own files, and the
    /// books survive a restart: a block's tenant is in its file.
    #[test]
    fn a_flooding_tenant_deletes_its_own_files_not_anothers() {
        let of = |tenant: &str, n: u8| HostBlock { tenant: turbine_kv::KvTenant::of(&[tenant]), ..block(n, 4096, None) };
        let dir = tempfile::tempdir().unwrap();
        let file = 4096 + HEADER_BYTES as u64;
        {
            let tier = DiskTier::open(dir.path(), 10 * file, 1).unwrap();
            for n in 0..3u8 {
                tier.write(SequenceHash(1000 + u64::from(n)), &of("b", n));
            }
            for n in 10..60u8 {
                tier.write(SequenceHash(1000 + u64::from(n)), &of("a", n));
            }
            assert_eq!(tier.read_run(&[hashes(0), hashes(1), hashes(2)]).len(), 3, "b's blocks are whole");
            assert!(tier.stats().fair_share_evictions.load(Ordering::Relaxed) >= 40);
            assert_eq!(tier.blocks(), 10);
            let files = std::fs::read_dir(dir.path()).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "kvb")).count();
            assert_eq!(files, 10, "evicted blocks' files are deleted");
        }
        let tier = DiskTier::open(dir.path(), 10 * file, 1).unwrap();
        assert_eq!(tier.bytes_of(turbine_kv::KvTenant::of(&["b"])), 3 * file, "b's files counted as b's after a restart");
        for n in 60..80u8 {
            tier.write(SequenceHash(1000 + u64::from(n)), &of("a", n));
        }
        assert_eq!(tier.read_run(&[hashes(0), hashes(1), hashes(2)]).len(), 3, "b's blocks are whole after the restart too");
    }

    #[test]
    fn the_tier_stays_within_its_bytes_deleting_what_it_evicts() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::open(dir.path(), 4 * (4096 + HEADER_BYTES as u64), 1).unwrap();
        for n in 0..10u8 {
            tier.write(SequenceHash(1000 + u64::from(n)), &block(n, 4096, None));
        }
        assert_eq!(tier.blocks(), 4);
        let files = std::fs::read_dir(dir.path()).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "kvb")).count();
        assert_eq!(files, 4, "evicted blocks' files are deleted");
        assert_eq!(tier.stats().evicted_blocks.load(Ordering::Relaxed), 6);
    }
}
