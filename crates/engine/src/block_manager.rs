//! The paged KV block pool with prefix caching.
//!
//! Blocks are fixed-size slots (`block_size` tokens) identified by dense
//! [`BlockId`]s. A block is *referenced* while some sequence's block table
//! holds it, *cached* when it is full and registered under its
//! [`SequenceHash`], and *free* when no sequence references it. Free cached
//! blocks stay reusable by later prompts with the same prefix until space is
//! needed; then the least recently released is evicted. Free blocks without
//! a hash are reused first.
//!
//! Tenants share the cache fairly, as the tiers below do
//! (`turbine_kv::fair`): each cached block is its registering sequence's
//! tenant's, and a block allocated for a tenant while blocks of several
//! tenants are cached is, when it must evict, taken first from a tenant
//! above its share (the pool over the tenants holding cached blocks, the
//! allocating one counted): another tenant holding more than the allocator
//! (counting the block) gives up its least recently released block, else
//! the allocator its own if it is above its share, else any tenant above
//! its share. So one tenant's flood of new prompts evicts its own blocks,
//! not another's prefixes. Below every share, or with one tenant, least
//! recently released decides; blocks in use are never taken.
//!
//! Every change to the set of cached blocks is recorded as a [`KvEvent`]
//! (only newly stored blocks emit `Stored`), for the router's index.

use std::collections::HashMap;

use turbine_kv::{BlockHashes, CachedBlock, KvEvent, KvTenant, LocalBlockHash, SequenceHash, StoredBlock, Tier, TierSet};

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct BlockMeta {
    ref_count: u32,
    /// Set while the block is registered in the prefix cache.
    hash: Option<SequenceHash>,
    /// Hash of the block's own tokens (meaningful while `hash` is set).
    local: LocalBlockHash,
    /// Links of the eviction list (free cached blocks only).
    prev: u32,
    next: u32,
    in_lru: bool,
    /// Whose block it is (meaningful while `hash` is set).
    tenant: KvTenant,
    /// Links of its tenant's eviction list (while `in_lru`).
    tenant_prev: u32,
    tenant_next: u32,
}

/// One tenant's cached blocks.
#[derive(Debug, Clone, Copy)]
struct TenantBlocks {
    /// Its cached blocks, referenced or free.
    cached: usize,
    /// Its free cached blocks, least recently released at `head`.
    head: u32,
    tail: u32,
}

/// The pool of KV blocks, the prefix cache and its eviction order.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    /// Free blocks holding nothing reusable; a stack.
    free_uncached: Vec<BlockId>,
    /// Free cached blocks, least recently released at `lru_head`.
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    /// Registered blocks by sequence hash.
    cached: HashMap<SequenceHash, BlockId>,
    /// Tenants holding cached blocks.
    tenants: HashMap<KvTenant, TenantBlocks>,
    /// Free cached blocks evicted because their tenant held more than its
    /// share, since start.
    fair_share_evictions: u64,
    prefix_caching: bool,
    events: Vec<KvEvent>,
    /// Newly registered blocks, kept for [`take_stored`](Self::take_stored)
    /// while a lower tier wants them (see [`record_stored`](Self::record_stored)).
    stored: Option<Vec<RegisteredBlock>>,
}

/// A block just registered in the prefix cache, with its place in the
/// chain: what a lower tier copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisteredBlock {
    /// The block.
    pub block: BlockId,
    /// Sequence hash of the block before it (None: the first block).
    pub parent: Option<SequenceHash>,
    /// Its hashes.
    pub hashes: BlockHashes,
    /// Whose block it is (the sequence's that registered it).
    pub tenant: KvTenant,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0 && num_blocks > 0, "pool must have blocks of positive size");
        assert!(num_blocks < NIL as usize, "too many blocks");
        let blocks = vec![
            BlockMeta {
                ref_count: 0,
                hash: None,
                local: LocalBlockHash(0),
                prev: NIL,
                next: NIL,
                in_lru: false,
                tenant: KvTenant::SHARED,
                tenant_prev: NIL,
                tenant_next: NIL,
            };
            num_blocks
        ];
        // Pop order 0, 1, 2, ... for readable block tables.
        let free_uncached = (0..num_blocks as BlockId).rev().collect();
        Self {
            block_size,
            blocks,
            free_uncached,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            cached: HashMap::new(),
            tenants: HashMap::new(),
            fair_share_evictions: 0,
            prefix_caching,
            events: Vec::new(),
            stored: None,
        }
    }

    /// Keeps every newly registered block for [`take_stored`](Self::take_stored).
    pub fn record_stored(&mut self) {
        self.stored.get_or_insert_with(Vec::new);
    }

    /// The blocks registered since the last call (none unless
    /// [`record_stored`](Self::record_stored) was called).
    pub fn take_stored(&mut self) -> Vec<RegisteredBlock> {
        self.stored.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Takes one more reference on `block` if it is still cached under
    /// `hash` (so that it is neither evicted nor reused while a lower tier
    /// copies it); false, changing nothing, otherwise.
    pub fn pin_cached(&mut self, block: BlockId, hash: SequenceHash) -> bool {
        if self.blocks[block as usize].hash != Some(hash) {
            return false;
        }
        if self.blocks[block as usize].ref_count == 0 {
            self.lru_unlink(block);
        }
        self.blocks[block as usize].ref_count += 1;
        true
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free, cached or not).
    pub fn num_free(&self) -> usize {
        self.free_uncached.len() + self.lru_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Blocks registered in the prefix cache (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// How many leading blocks of `hashes` are cached. Takes no references.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        hashes.iter().take_while(|hash| self.cached.contains_key(hash)).count()
    }

    /// Of the leading cached blocks of `hashes`, how many are currently free
    /// (acquiring them takes them out of the free pool).
    pub fn count_free_among_cached(&self, hashes: &[SequenceHash]) -> usize {
        hashes.iter().filter_map(|hash| self.cached.get(hash)).filter(|&&block| self.blocks[block as usize].ref_count == 0).count()
    }

    /// Takes a reference on the cached block of each hash; every hash must be
    /// cached (see [`match_prefix`](Self::match_prefix)).
    pub fn acquire_cached(&mut self, hashes: &[SequenceHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map(|hash| {
                let block = *self.cached.get(hash).expect("acquire_cached: hash must be cached");
                if self.blocks[block as usize].ref_count == 0 {
                    self.lru_unlink(block);
                }
                self.blocks[block as usize].ref_count += 1;
                block
            })
            .collect()
    }

    /// Allocates `count` blocks for a sequence of `tenant`, evicting cached
    /// blocks if needed (fair shares first, then least recently released).
    /// Returns `None`, changing nothing, when fewer are free.
    pub fn allocate(&mut self, count: usize, tenant: KvTenant) -> Option<Vec<BlockId>> {
        if count > self.num_free() {
            return None;
        }
        let mut allocated = Vec::with_capacity(count);
        for _ in 0..count {
            let block = match self.free_uncached.pop() {
                Some(block) => block,
                None => self.evict_one(tenant),
            };
            debug_assert_eq!(self.blocks[block as usize].ref_count, 0);
            self.blocks[block as usize].ref_count = 1;
            allocated.push(block);
        }
        Some(allocated)
    }

    /// Registers full, referenced blocks under their hashes, in chain order
    /// (`parent` is the sequence hash before the first). Blocks whose hash is
    /// already cached elsewhere stay private; the rest emit one `Stored`
    /// event per contiguous run.
    pub fn register(&mut self, parent: Option<SequenceHash>, tenant: KvTenant, blocks: &[(BlockId, BlockHashes)]) {
        if !self.prefix_caching {
            return;
        }
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = parent;
        let mut previous = parent;
        for &(block, hashes) in blocks {
            debug_assert!(self.blocks[block as usize].ref_count > 0, "registering an unreferenced block");
            let newly_stored = self.blocks[block as usize].hash.is_none() && !self.cached.contains_key(&hashes.sequence);
            if newly_stored {
                self.cached.insert(hashes.sequence, block);
                self.blocks[block as usize].hash = Some(hashes.sequence);
                self.blocks[block as usize].local = hashes.local;
                self.blocks[block as usize].tenant = tenant;
                self.tenants.entry(tenant).or_insert(TenantBlocks { cached: 0, head: NIL, tail: NIL }).cached += 1;
                if run.is_empty() {
                    run_parent = previous;
                }
                run.push(StoredBlock { sequence_hash: hashes.sequence, local_hash: hashes.local });
                if let Some(stored) = &mut self.stored {
                    stored.push(RegisteredBlock { block, parent: previous, hashes, tenant });
                }
            } else if !run.is_empty() {
                self.events.push(KvEvent::Stored { parent: run_parent, blocks: std::mem::take(&mut run), tier: Tier::Device });
            }
            previous = Some(hashes.sequence);
        }
        if !run.is_empty() {
            self.events.push(KvEvent::Stored { parent: run_parent, blocks: run, tier: Tier::Device });
        }
    }

    /// Drops one reference on each block. Released blocks become reusable in
    /// the order given (pass a block table reversed so that its tail, the
    /// least shareable part, is evicted first).
    pub fn release(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for block in blocks {
            let meta = &mut self.blocks[block as usize];
            assert!(meta.ref_count > 0, "releasing free block {block}");
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                if meta.hash.is_some() {
                    self.lru_push_back(block);
                } else {
                    self.free_uncached.push(block);
                }
            }
        }
    }

    /// Drops every free cached block from the prefix cache (e.g. on a model
    /// reload); referenced blocks stay.
    pub fn clear_free_cached(&mut self) {
        let mut removed = Vec::new();
        while self.lru_head != NIL {
            let block = self.lru_head;
            self.lru_unlink(block);
            if let Some(hash) = self.blocks[block as usize].hash.take() {
                self.cached.remove(&hash);
                self.uncount(block);
                removed.push(hash);
            }
            self.free_uncached.push(block);
        }
        if self.cached.is_empty() {
            self.events.push(KvEvent::Cleared);
        } else if !removed.is_empty() {
            self.events.push(KvEvent::Removed { sequence_hashes: removed, tier: Tier::Device });
        }
    }

    /// Every cached block, for an index resynchronisation dump.
    pub fn cached_blocks(&self) -> Vec<CachedBlock> {
        self.cached
            .iter()
            .map(|(&sequence_hash, &block)| CachedBlock { sequence_hash, local_hash: self.blocks[block as usize].local, tiers: TierSet(Tier::Device.bit()) })
            .collect()
    }

    /// Moves the events recorded since the last call into `out`.
    pub fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// The reference count of a block (for tests and invariants).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_count
    }

    /// The hash a block is cached under, if any.
    pub fn cached_hash(&self, block: BlockId) -> Option<SequenceHash> {
        self.blocks[block as usize].hash
    }

    /// Free cached blocks evicted because their tenant held more than its
    /// share of the pool, since start.
    pub fn fair_share_evictions(&self) -> u64 {
        self.fair_share_evictions
    }

    /// Cached blocks (referenced or free) of `tenant`.
    pub fn cached_of(&self, tenant: KvTenant) -> usize {
        self.tenants.get(&tenant).map_or(0, |blocks| blocks.cached)
    }

    /// The free cached block to evict for a block of `tenant`: the least
    /// recently released of a tenant above its share (another holding more
    /// than `tenant` would with the block, else `tenant` itself, else the
    /// one holding the most; only tenants with a free cached block count);
    /// else the least recently released of all.
    fn victim(&self, tenant: KvTenant) -> BlockId {
        let tenants = self.tenants.len() + usize::from(!self.tenants.contains_key(&tenant));
        if tenants < 2 {
            return self.lru_head;
        }
        let share = self.blocks.len() / tenants;
        let own = self.cached_of(tenant) + 1;
        let freeable = |(_, blocks): &(&KvTenant, &TenantBlocks)| blocks.cached > share && blocks.head != NIL;
        let largest_other = self.tenants.iter().filter(|(other, _)| **other != tenant).filter(freeable).max_by_key(|(_, blocks)| blocks.cached);
        match (largest_other, self.tenants.get(&tenant)) {
            (Some((_, other)), _) if other.cached > own => other.head,
            (_, Some(mine)) if own > share && mine.head != NIL => mine.head,
            (Some((_, other)), _) => other.head,
            _ => self.lru_head,
        }
    }

    /// Takes a block leaving the cache out of its tenant's count.
    fn uncount(&mut self, block: BlockId) {
        let tenant = self.blocks[block as usize].tenant;
        if let Some(blocks) = self.tenants.get_mut(&tenant) {
            blocks.cached -= 1;
            if blocks.cached == 0 {
                self.tenants.remove(&tenant);
            }
        }
    }

    fn evict_one(&mut self, tenant: KvTenant) -> BlockId {
        let block = self.victim(tenant);
        assert_ne!(block, NIL, "evict_one called with no free cached block");
        if block != self.lru_head {
            self.fair_share_evictions += 1;
        }
        self.lru_unlink(block);
        let hash = self.blocks[block as usize].hash.take().expect("lru blocks are cached");
        self.cached.remove(&hash);
        self.uncount(block);
        match self.events.last_mut() {
            Some(KvEvent::Removed { sequence_hashes, .. }) => sequence_hashes.push(hash),
            _ => self.events.push(KvEvent::Removed { sequence_hashes: vec![hash], tier: Tier::Device }),
        }
        block
    }

    fn lru_push_back(&mut self, block: BlockId) {
        let tail = self.lru_tail;
        {
            let meta = &mut self.blocks[block as usize];
            debug_assert!(!meta.in_lru);
            meta.prev = tail;
            meta.next = NIL;
            meta.in_lru = true;
        }
        if tail == NIL {
            self.lru_head = block;
        } else {
            self.blocks[tail as usize].next = block;
        }
        self.lru_tail = block;
        self.lru_len += 1;
        let tenant = self.blocks[block as usize].tenant;
        let blocks = self.tenants.get_mut(&tenant).expect("a cached block's tenant is counted");
        let tail = std::mem::replace(&mut blocks.tail, block);
        if tail == NIL {
            blocks.head = block;
        } else {
            self.blocks[tail as usize].tenant_next = block;
        }
        let meta = &mut self.blocks[block as usize];
        meta.tenant_prev = tail;
        meta.tenant_next = NIL;
    }

    fn lru_unlink(&mut self, block: BlockId) {
        let (prev, next) = {
            let meta = &mut self.blocks[block as usize];
            debug_assert!(meta.in_lru);
            meta.in_lru = false;
            (std::mem::replace(&mut meta.prev, NIL), std::mem::replace(&mut meta.next, NIL))
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.lru_len -= 1;
        let (tenant, prev, next) = {
            let meta = &mut self.blocks[block as usize];
            (meta.tenant, std::mem::replace(&mut meta.tenant_prev, NIL), std::mem::replace(&mut meta.tenant_next, NIL))
        };
        let blocks = self.tenants.get_mut(&tenant).expect("a cached block's tenant is counted");
        if prev == NIL {
            blocks.head = next;
        } else {
            self.blocks[prev as usize].tenant_next = next;
        }
        if next == NIL {
            blocks.tail = prev;
        } else {
            self.blocks[next as usize].tenant_prev = prev;
        }
    }

    /// Checks every internal invariant; panics with a description if one
    /// fails. Used by tests and debug builds.
    pub fn check_invariants(&self) {
        let mut free_count = 0;
        let mut lru_count = 0;
        let mut cursor = self.lru_head;
        let mut previous = NIL;
        while cursor != NIL {
            let meta = &self.blocks[cursor as usize];
            assert!(meta.in_lru && meta.ref_count == 0 && meta.hash.is_some(), "bad lru block {cursor}");
            assert_eq!(meta.prev, previous, "broken lru back link at {cursor}");
            previous = cursor;
            cursor = meta.next;
            lru_count += 1;
        }
        assert_eq!(previous, self.lru_tail, "lru tail");
        assert_eq!(lru_count, self.lru_len, "lru length");
        for &block in &self.free_uncached {
            let meta = &self.blocks[block as usize];
            assert!(meta.ref_count == 0 && meta.hash.is_none() && !meta.in_lru, "bad free block {block}");
            free_count += 1;
        }
        let zero_refs = self.blocks.iter().filter(|meta| meta.ref_count == 0).count();
        assert_eq!(zero_refs, free_count + lru_count, "every unreferenced block is free exactly once");
        for (hash, &block) in &self.cached {
            assert_eq!(self.blocks[block as usize].hash, Some(*hash), "cache map and block disagree");
        }
        let hashed = self.blocks.iter().filter(|meta| meta.hash.is_some()).count();
        assert_eq!(hashed, self.cached.len(), "every hashed block is in the cache map");
        let mut in_tenant_lists = 0;
        for (tenant, blocks) in &self.tenants {
            let held = self.blocks.iter().filter(|meta| meta.hash.is_some() && meta.tenant == *tenant).count();
            assert!(blocks.cached > 0 && blocks.cached == held, "tenant {tenant:?} counts {} cached blocks, holds {held}", blocks.cached);
            let (mut cursor, mut previous) = (blocks.head, NIL);
            while cursor != NIL {
                let meta = &self.blocks[cursor as usize];
                assert!(meta.in_lru && meta.tenant == *tenant, "bad tenant lru block {cursor}");
                assert_eq!(meta.tenant_prev, previous, "broken tenant lru back link at {cursor}");
                previous = cursor;
                cursor = meta.tenant_next;
                in_tenant_lists += 1;
            }
            assert_eq!(previous, blocks.tail, "tenant lru tail");
        }
        assert_eq!(in_tenant_lists, self.lru_len, "every free cached block is in its tenant's list");
    }
}

#[cfg(test)]
mod tests;
