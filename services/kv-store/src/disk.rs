//! The store's disk tier: one file per block, in a directory per layout
//! fingerprint (`<dir>/<fingerprint, 16 hex digits>/<sequence hash>.kvb`,
//! the engine's block-file format), its index a byte-bounded `moka` cache
//! (least recently used evicted first, its file deleted). The directory is
//! this process's alone (an exclusive lock on `<dir>/.lock`).
//!
//! A file is written whole or not at all (a `.tmp` renamed into place) and
//! checked on every read (header, length, checksum); a block that fails is
//! deleted and reported missing, never served. At start the index is
//! rebuilt from the sound files, so a restarted store keeps its blocks.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use moka::ops::compute::{CompResult, Op};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use turbine_kv::SequenceHash;
use turbine_kv::block_file::{self, block_path};
use turbine_kv::{HostBlock, KvTenant};

use crate::events::Announcer;
use crate::fair::{self, FairShare};
use crate::keys::{BlockKey, Fingerprint};
use crate::store::TierUsage;

/// A block file as the index holds it.
#[derive(Debug, Clone, Copy)]
struct DiskEntry {
    /// The file's length.
    bytes: u64,
    /// Whose block it is (as its file says).
    tenant: KvTenant,
    /// When it was written, in the tier's fair-share books.
    stamp: u64,
}

/// The disk tier. Cloning shares it.
#[derive(Clone)]
pub struct DiskBlocks {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    /// Each block's file.
    index: moka::sync::Cache<BlockKey, DiskEntry>,
    /// Per fingerprint: how many blocks are on disk.
    layouts: Arc<Mutex<FxHashMap<Fingerprint, u64>>>,
    /// Each tenant's share of the files.
    fair: Arc<FairShare<BlockKey>>,
    evicted_blocks: Arc<AtomicU64>,
    corrupt_blocks: AtomicU64,
    write_failures: AtomicU64,
    capacity_bytes: u64,
    /// The store's announcements: with a disk tier, its files are what the
    /// store holds.
    announcer: Announcer,
    _lock: File,
}

impl std::fmt::Debug for DiskBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskBlocks").field("dir", &self.inner.dir).field("capacity_bytes", &self.inner.capacity_bytes).finish_non_exhaustive()
    }
}

fn fingerprint_dir(dir: &Path, fingerprint: Fingerprint) -> PathBuf {
    dir.join(format!("{:016x}", fingerprint.get()))
}

impl DiskBlocks {
    /// Opens (creating it if needed) the tier in `dir`, holding at most
    /// `capacity_bytes` of block files; indexes the sound blocks already
    /// there and deletes the rest.
    pub fn open(dir: &Path, capacity_bytes: u64) -> std::io::Result<Self> {
        let lock = block_file::lock_dir(dir, "Turbine kv-store")?;
        let layouts: Arc<Mutex<FxHashMap<Fingerprint, u64>>> = Arc::default();
        let evicted_blocks = Arc::new(AtomicU64::new(0));
        let announcer = Announcer::new();
        let fair = Arc::new(FairShare::new(capacity_bytes));
        let index = {
            let dir = dir.to_path_buf();
            let layouts = layouts.clone();
            let fair = fair.clone();
            let evicted_blocks = evicted_blocks.clone();
            let announcer = announcer.clone();
            moka::sync::Cache::builder()
                .max_capacity(capacity_bytes)
                .weigher(|_, entry: &DiskEntry| u32::try_from(entry.bytes).unwrap_or(u32::MAX))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .eviction_listener(move |key: Arc<BlockKey>, entry: DiskEntry, cause| {
                    fair.remove(entry.tenant, entry.stamp, entry.bytes);
                    if matches!(cause, moka::notification::RemovalCause::Replaced) {
                        return;
                    }
                    if cause.was_evicted() {
                        evicted_blocks.fetch_add(1, Relaxed);
                        let _ = std::fs::remove_file(block_path(&fingerprint_dir(&dir, key.fingerprint), key.sequence));
                    }
                    announcer.removed(key.fingerprint, key.sequence);
                    let mut layouts = layouts.lock();
                    if let Some(blocks) = layouts.get_mut(&key.fingerprint) {
                        *blocks = blocks.saturating_sub(1);
                        if *blocks == 0 {
                            layouts.remove(&key.fingerprint);
                        }
                    }
                })
                .build()
        };
        let disk = Self {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                index,
                layouts,
                fair,
                evicted_blocks,
                corrupt_blocks: AtomicU64::new(0),
                write_failures: AtomicU64::new(0),
                capacity_bytes,
                announcer,
                _lock: lock,
            }),
        };
        disk.rebuild()?;
        Ok(disk)
    }

    /// Indexes the sound files of every fingerprint's directory. A file in
    /// the wrong directory, or of a size other than its fingerprint
    /// declares ([`Fingerprint::block_bytes`]), is deleted.
    fn rebuild(&self) -> std::io::Result<()> {
        let mut kept = 0u64;
        for entry in std::fs::read_dir(&self.inner.dir)? {
            let path = entry?.path();
            let Some(fingerprint) = path
                .file_name()
                .and_then(|name| name.to_str())
                .filter(|name| name.len() == 16)
                .and_then(|name| u64::from_str_radix(name, 16).ok())
                .and_then(Fingerprint::new)
            else {
                continue;
            };
            if !path.is_dir() {
                continue;
            }
            for header in block_file::scan_dir(&path)? {
                let fits = header.fingerprint == fingerprint.get() && fingerprint.block_bytes() == Some(header.len as usize);
                if fits {
                    *self.inner.layouts.lock().entry(fingerprint).or_default() += 1;
                }
                if fits {
                    self.inner.announcer.stored(fingerprint, header.sequence, header.local, header.parent);
                    let key = BlockKey { fingerprint, sequence: header.sequence };
                    self.index(key, header.file_bytes(), header.tenant);
                    kept += 1;
                } else {
                    let _ = std::fs::remove_file(block_path(&path, header.sequence));
                }
            }
        }
        self.inner.index.run_pending_tasks();
        if kept > 0 {
            tracing::info!(dir = %self.inner.dir.display(), blocks = kept, "kv-store disk tier: blocks kept from before");
        }
        Ok(())
    }

    /// What the store holds, announced (every file written or deleted).
    pub fn announcer(&self) -> &Announcer {
        &self.inner.announcer
    }

    /// Whose block `key` is, if the tier holds it.
    pub fn tenant_of(&self, key: &BlockKey) -> Option<KvTenant> {
        self.inner.index.get(key).map(|entry| entry.tenant)
    }

    /// Whether the tier holds `key`.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.inner.index.contains_key(key)
    }

    /// Writes a block (one already held is left as it is); false if the
    /// write failed (counted and logged: the block is then not on disk).
    pub fn write(&self, key: BlockKey, block: &HostBlock) -> bool {
        if self.contains(&key) {
            return true;
        }
        let dir = fingerprint_dir(&self.inner.dir, key.fingerprint);
        let path = block_path(&dir, key.sequence);
        let written = std::fs::create_dir_all(&dir).and_then(|()| block_file::write_block(&path, key.fingerprint.get(), key.sequence, block));
        match written {
            Ok(bytes) => {
                // Counted before it is in, so that its eviction always finds it counted.
                *self.inner.layouts.lock().entry(key.fingerprint).or_default() += 1;
                // Announced before it is in, so that its removal always
                // follows its announcement.
                self.inner.announcer.stored(key.fingerprint, key.sequence, block.local, block.parent);
                self.make_room_fairly(block.tenant, bytes);
                self.index(key, bytes, block.tenant);
                self.inner.index.run_pending_tasks();
                true
            }
            Err(error) => {
                self.inner.write_failures.fetch_add(1, Relaxed);
                tracing::warn!(%error, path = %path.display(), "cannot write a KV block to the kv-store's disk tier");
                false
            }
        }
    }

    /// Indexes a file, counted in its tenant's share.
    fn index(&self, key: BlockKey, bytes: u64, tenant: KvTenant) {
        let stamp = self.inner.fair.stamp();
        self.inner.fair.add(tenant, stamp, key, bytes);
        self.inner.index.insert(key, DiskEntry { bytes, tenant, stamp });
    }

    /// Makes room for `tenant` to keep a file of `bytes` from tenants above
    /// their fair share (`crate::fair`), deleting their oldest files.
    fn make_room_fairly(&self, tenant: KvTenant, bytes: u64) {
        for _ in 0..fair::EVICTIONS_PER_PUT {
            let Some((stamp, key)) = self.inner.fair.victim(tenant, bytes) else { return };
            let outcome = self.inner.index.entry(key).and_compute_with(|held| match held {
                Some(held) if held.value().stamp == stamp => Op::Remove,
                _ => Op::Nop,
            });
            if !matches!(outcome, CompResult::Removed(_)) {
                return;
            }
            let _ = std::fs::remove_file(block_path(&fingerprint_dir(&self.inner.dir, key.fingerprint), key.sequence));
            self.inner.evicted_blocks.fetch_add(1, Relaxed);
            fair::evicted("disk");
        }
    }

    /// Reads a block, checked; one that fails is deleted (and counted).
    pub fn read(&self, key: &BlockKey) -> Option<HostBlock> {
        let held = self.inner.index.get(key)?;
        let path = block_path(&fingerprint_dir(&self.inner.dir, key.fingerprint), key.sequence);
        let block = block_file::read_block(&path, key.fingerprint.get(), key.sequence);
        if block.is_none() {
            self.drop_corrupt(key, held.stamp, &path);
        }
        block
    }

    /// Drops the file indexed with `stamp` that a read found corrupt, once:
    /// of readers that found it at the same time, only the one whose removal
    /// takes the entry deletes and counts it, and a sound copy put since is
    /// kept.
    fn drop_corrupt(&self, key: &BlockKey, stamp: u64, path: &Path) {
        let outcome = self.inner.index.entry(*key).and_compute_with(|held| match held {
            Some(held) if held.value().stamp == stamp => Op::Remove,
            _ => Op::Nop,
        });
        if !matches!(outcome, CompResult::Removed(_)) {
            return;
        }
        let _ = std::fs::remove_file(path);
        self.inner.index.run_pending_tasks();
        self.inner.corrupt_blocks.fetch_add(1, Relaxed);
        tracing::warn!(sequence_hash = key.sequence.0, fingerprint = key.fingerprint.get(), "a kv-store disk block is unreadable or corrupt; dropped");
    }

    /// The checksum a held block was written with (its file's header; no
    /// payload is read).
    pub fn checksum(&self, key: &BlockKey) -> Option<u64> {
        self.inner.index.get(key)?;
        let path = block_path(&fingerprint_dir(&self.inner.dir, key.fingerprint), key.sequence);
        block_file::read_header(&path).map(|header| header.checksum)
    }

    /// Drops a block, deleting its file; whether it was held.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let _ = std::fs::remove_file(block_path(&fingerprint_dir(&self.inner.dir, key.fingerprint), key.sequence));
        let held = self.inner.index.remove(key).is_some();
        self.inner.index.run_pending_tasks();
        held
    }

    /// The hashes of every block of `fingerprint` on disk.
    pub fn hashes_of(&self, fingerprint: Fingerprint) -> Vec<SequenceHash> {
        self.inner.index.iter().filter(|(key, _)| key.fingerprint == fingerprint).map(|(key, _)| key.sequence).collect()
    }

    /// Sizes and counters now (after pending evictions ran).
    pub fn usage(&self) -> TierUsage {
        self.inner.index.run_pending_tasks();
        TierUsage {
            blocks: self.inner.index.entry_count(),
            bytes: self.inner.index.weighted_size(),
            capacity_bytes: self.inner.capacity_bytes,
            evicted_blocks: self.inner.evicted_blocks.load(Relaxed),
            corrupt_blocks: self.inner.corrupt_blocks.load(Relaxed),
        }
    }

    /// Writes that failed.
    pub fn write_failures(&self) -> u64 {
        self.inner.write_failures.load(Relaxed)
    }

    /// The file of a block (for tests that corrupt one).
    #[doc(hidden)]
    pub fn path_for_test(&self, key: &BlockKey) -> PathBuf {
        block_path(&fingerprint_dir(&self.inner.dir, key.fingerprint), key.sequence)
    }
}
