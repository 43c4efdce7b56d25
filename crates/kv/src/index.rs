//! The global KV index: which worker caches which block, in which tier.
//!
//! DESIGN §5's radix tree, addressed by sequence hash. A node is one prefix
//! of blocks; because a sequence hash is chained over every block before it,
//! it names the node's whole path from the root, so the tree is stored as a
//! flat map from sequence hash to node and walking one level down is one
//! lookup of the next sequence hash. A node holds the workers (with their
//! tiers) that cache it, sorted by worker slot; each worker keeps its own
//! set of sequence hashes, so removing a block, or a whole worker, touches
//! only what that worker holds.
//!
//! [`KvIndex::find_matches`] walks a request's sequence hashes from the root
//! and records the depth at which each worker drops out: the number of
//! leading blocks it could reuse. A worker missing a parent block (evicted
//! before its child) drops out there, exactly as its engine would.
//!
//! Writers take the lock one event (or one slice of a long `Stored`) at a
//! time, so a read never waits behind a long batch of writes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use crate::events::{CachedBlock, Dump, KvEvent, NumberedEvent, StoredBlock, Tier, TierSet};
use crate::{LocalBlockHash, SequenceHash, WorkerId};

/// Blocks of one `Stored` event applied per write-lock hold.
const STORE_SLICE: usize = 256;

/// Keys are already uniform 64-bit hashes: hash them by identity.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

type HashKeyed<V> = HashMap<SequenceHash, V, BuildHasherDefault<IdentityHasher>>;

/// A worker holding a node, in some tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    slot: u32,
    tiers: TierSet,
}

#[derive(Debug)]
struct Node {
    local: LocalBlockHash,
    /// Sorted by slot.
    holders: Vec<Holder>,
    /// XOR of [`holder_key`] over `holders`: equal signatures (and lengths)
    /// mean equal holder sets, so a lookup can skip levels where nothing
    /// changes. A false match needs two different sets of 64-bit mixes to
    /// XOR equal: chance 2⁻⁶⁴.
    signature: u64,
}

/// A holder's contribution to its node's signature (0 for no tiers).
fn holder_key(slot: u32, tiers: TierSet) -> u64 {
    if tiers.is_empty() {
        return 0;
    }
    // splitmix64's finaliser over (slot, tiers).
    let mut z = (u64::from(slot) << 8 | u64::from(tiers.0)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[derive(Debug)]
struct WorkerState {
    instance: u64,
    next_event_id: u64,
    /// Every block this worker holds in any tier.
    blocks: HashKeyed<()>,
}

/// Shards of the node map (a power of two).
const NODE_SHARDS: usize = 64;

/// The tree's nodes, in shards chosen by a few of the hash's bits, so that growing the map rehashes one shard at a time: a
/// write never holds the lock for a rehash of the whole index.
#[derive(Debug)]
struct Nodes {
    shards: Box<[HashKeyed<Node>; NODE_SHARDS]>,
}

impl Default for Nodes {
    fn default() -> Self {
        Self { shards: Box::new(std::array::from_fn(|_| HashKeyed::default())) }
    }
}

impl Nodes {
    /// Bits 51–56: below the top seven, which the maps keep as tags to
    /// filter probes, and above the low bits they index buckets with.
    fn shard_of(hash: SequenceHash) -> usize {
        (hash.0 >> 51) as usize % NODE_SHARDS
    }

    fn get(&self, hash: &SequenceHash) -> Option<&Node> {
        self.shards[Self::shard_of(*hash)].get(hash)
    }

    fn shard_mut(&mut self, hash: SequenceHash) -> &mut HashKeyed<Node> {
        &mut self.shards[Self::shard_of(hash)]
    }

    fn len(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }
}

/// Worker ids by slot; replaced (copy on write) when workers come or go,
/// so a lookup result keeps the names that were current when it was made.
type SlotNames = Arc<Vec<Option<WorkerId>>>;

#[derive(Debug, Default)]
struct Tree {
    nodes: Nodes,
    slots: Vec<Option<WorkerState>>,
    names: SlotNames,
    free_slots: Vec<u32>,
    by_id: rustc_hash::FxHashMap<WorkerId, u32>,
    events_applied: u64,
}

/// How long writers may keep re-taking the lock ahead of queued readers.
const WRITE_TURN: Duration = Duration::from_micros(100);

/// A write guard that unlocks fairly once the writers' turn is over (see
/// [`KvIndex::write`]).
struct FairWrite<'a> {
    guard: Option<RwLockWriteGuard<'a, Tree>>,
    index: &'a KvIndex,
}

impl std::ops::Deref for FairWrite<'_> {
    type Target = Tree;

    fn deref(&self) -> &Tree {
        self.guard.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for FairWrite<'_> {
    fn deref_mut(&mut self) -> &mut Tree {
        self.guard.as_mut().expect("held until drop")
    }
}

impl Drop for FairWrite<'_> {
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let mut turn_began = self.index.turn_began.lock();
        if turn_began.elapsed() < WRITE_TURN {
            drop(guard);
        } else {
            // Hand the lock to whoever queued (readers first), then start a
            // new turn.
            RwLockWriteGuard::unlock_fair(guard);
            *turn_began = Instant::now();
        }
    }
}

/// How a numbered event was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied; the worker's view advanced by one event.
    Applied,
    /// Already reflected (a replay or a dump covered it); ignored.
    Duplicate,
    /// Events before this one are missing: the worker's view is stale until
    /// a [`Dump`] is loaded. The event was not applied.
    Gap {
        /// The event number the index expected.
        expected: u64,
    },
}

/// One worker's match for a request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkerMatch {
    /// The worker.
    pub worker_id: WorkerId,
    /// Leading blocks of the request the worker holds, in any tier.
    pub blocks: u32,
    /// Of those, how many are at best in each tier (index: [`Tier`] as usize).
    pub by_tier: [u32; 4],
}

impl WorkerMatch {
    /// Matched blocks whose fastest copy is in `tier`.
    pub fn in_tier(&self, tier: Tier) -> u32 {
        self.by_tier[tier as usize]
    }
}

/// The result of [`KvIndex::find_matches`]: every worker holding at least
/// the request's first block, in no particular order.
///
/// Kept compact because on a big fleet a popular first block has thousands
/// of holders, most of which hold nothing after it: the first block's
/// holders are one copied list (one block each, in their tier), and only
/// the workers that matched more have an entry of their own. Names are
/// resolved on access.
#[derive(Debug, Clone, Default)]
pub struct FindMatches {
    names: SlotNames,
    /// Holders of the first block, sorted by slot.
    first: Vec<Holder>,
    /// Workers that matched more than the first block, sorted by slot.
    deeper: Vec<MatchEntry>,
}

#[derive(Debug, Clone, Copy)]
struct MatchEntry {
    slot: u32,
    blocks: u32,
    by_tier: [u32; 4],
}

impl MatchEntry {
    /// A holder of the first block, credited with it.
    fn first_block(holder: &Holder) -> Self {
        let mut by_tier = [0; 4];
        by_tier[best_tier(holder.tiers) as usize] = 1;
        Self { slot: holder.slot, blocks: 1, by_tier }
    }
}

impl FindMatches {
    /// Matching workers.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// Whether no worker holds the first block.
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Every matching worker.
    pub fn iter(&self) -> impl Iterator<Item = WorkerMatch> + '_ {
        let mut deeper = self.deeper.iter().peekable();
        self.first.iter().map(move |holder| {
            let entry = match deeper.next_if(|entry| entry.slot == holder.slot) {
                Some(entry) => *entry,
                None => MatchEntry::first_block(holder),
            };
            WorkerMatch { worker_id: self.name(entry.slot).clone(), blocks: entry.blocks, by_tier: entry.by_tier }
        })
    }

    /// The match of one worker, if it holds the first block (a linear scan).
    pub fn of(&self, worker_id: &str) -> Option<WorkerMatch> {
        self.iter().find(|m| &*m.worker_id == worker_id)
    }

    /// The deepest match, in blocks (0 when no worker matched).
    pub fn deepest(&self) -> u32 {
        self.deeper.iter().map(|entry| entry.blocks).max().unwrap_or(u32::from(!self.first.is_empty()))
    }

    fn name(&self, slot: u32) -> &WorkerId {
        self.names[slot as usize].as_ref().expect("a match names a live slot")
    }

    fn sorted(&self) -> Vec<WorkerMatch> {
        let mut all: Vec<WorkerMatch> = self.iter().collect();
        all.sort_unstable();
        all
    }
}

/// Equal when the same workers match equally (slot numbering aside).
impl PartialEq for FindMatches {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.sorted() == other.sorted()
    }
}

impl Eq for FindMatches {}

/// Sizes of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Workers with a view in the index.
    pub workers: usize,
    /// Distinct blocks (tree nodes).
    pub nodes: usize,
    /// (worker, block) pairs.
    pub entries: usize,
    /// Events applied since creation.
    pub events_applied: u64,
}

/// The index; cheap to share (`Arc`), safe to read and write from many
/// threads.
#[derive(Debug)]
pub struct KvIndex {
    tree: RwLock<Tree>,
    /// When the writers' current turn began (see [`KvIndex::write`]).
    turn_began: Mutex<Instant>,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self { tree: RwLock::default(), turn_began: Mutex::new(Instant::now()) }
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies worker `worker_id`'s event number `event.event_id` of
    /// incarnation `instance`. A new instance (the worker restarted) drops
    /// everything the old one held; its events count from 0 again.
    pub fn apply(&self, worker_id: &str, instance: u64, event: &NumberedEvent) -> Applied {
        let mut tree = self.write();
        let slot = tree.slot_for(worker_id, instance);
        let state = tree.slots[slot as usize].as_mut().expect("live slot");
        if event.event_id < state.next_event_id {
            return Applied::Duplicate;
        }
        if event.event_id > state.next_event_id {
            return Applied::Gap { expected: state.next_event_id };
        }
        state.next_event_id += 1;
        self.change(tree, worker_id, &event.event);
        Applied::Applied
    }

    /// Applies an event without numbering (the router's own decisions in
    /// approximate mode, tests).
    pub fn apply_unnumbered(&self, worker_id: &str, event: &KvEvent) {
        self.change(self.write(), worker_id, event);
    }

    /// The write lock. Writers take turns of [`WRITE_TURN`]: within a turn
    /// a writer re-takes the lock at once (no hand-off cost per event);
    /// when the turn is over the lock is released fairly, so readers queued
    /// behind a stream of events get in, and a lookup waits at most about
    /// one turn.
    fn write(&self) -> FairWrite<'_> {
        FairWrite { guard: Some(self.tree.write()), index: self }
    }

    /// Applies `event` under `tree`, letting readers in between slices of a
    /// long `Stored`.
    fn change<'a>(&'a self, mut tree: FairWrite<'a>, worker_id: &str, event: &KvEvent) {
        match event {
            KvEvent::Stored { blocks, tier, .. } => {
                for (at, slice) in blocks.chunks(STORE_SLICE).enumerate() {
                    if at > 0 {
                        drop(tree);
                        tree = self.write();
                    }
                    let slot = tree.slot_or_create(worker_id);
                    tree.store(slot, slice, *tier);
                }
            }
            KvEvent::Removed { sequence_hashes, tier } => {
                if let Some(&slot) = tree.by_id.get(worker_id) {
                    for &hash in sequence_hashes {
                        tree.remove(slot, hash, Some(*tier));
                    }
                }
            }
            KvEvent::Cleared => {
                if let Some(&slot) = tree.by_id.get(worker_id) {
                    tree.clear_worker(slot);
                }
            }
        }
        tree.events_applied += 1;
    }

    /// Replaces a worker's view with a dump of its cache.
    pub fn load_dump(&self, worker_id: &str, instance: u64, dump: &Dump) {
        {
            let mut tree = self.write();
            let slot = tree.slot_for(worker_id, instance);
            tree.clear_worker(slot);
            tree.slots[slot as usize].as_mut().expect("live slot").next_event_id = dump.next_event_id;
        }
        for slice in dump.blocks.chunks(STORE_SLICE) {
            let mut tree = self.write();
            let Some(&slot) = tree.by_id.get(worker_id) else {
                return;
            };
            for block in slice {
                for tier in Tier::ALL.into_iter().filter(|&tier| block.tiers.contains(tier)) {
                    tree.store(slot, &[StoredBlock { sequence_hash: block.sequence_hash, local_hash: block.local_hash }], tier);
                }
            }
        }
    }

    /// Forgets a worker and every block it held; false if it was unknown.
    pub fn remove_worker(&self, worker_id: &str) -> bool {
        let mut tree = self.write();
        let Some(slot) = tree.by_id.remove(worker_id) else {
            return false;
        };
        tree.clear_worker(slot);
        tree.slots[slot as usize] = None;
        Arc::make_mut(&mut tree.names)[slot as usize] = None;
        tree.free_slots.push(slot);
        true
    }

    /// For each worker holding the first of `hashes`, how many leading
    /// blocks it holds (and in which tiers).
    ///
    /// Walks down the request's path keeping the workers still matching.
    /// Runs of levels whose holder set equals the level above (the common
    /// case: a shared prefix held by the same workers) cost one lookup and
    /// one comparison each; the survivors are recomputed only where the set
    /// changes, by a merge or, when one side is much smaller, by binary
    /// search from the smaller side.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> FindMatches {
        let tree = self.tree.read();
        let Some(first) = hashes.first().and_then(|hash| tree.nodes.get(hash)) else {
            return FindMatches { names: tree.names.clone(), ..FindMatches::default() };
        };
        // The entries of workers matching beyond the first block, and the
        // ones still matching (in slot order), each credited only when it
        // drops out or its tier changes, not at every level. Until the
        // holder set first changes every holder is active and the list is
        // not built: on a big fleet the first block often has thousands of
        // holders and the second few, and those that stop after the first
        // block cost one copy of the holder list.
        let mut deeper: Vec<MatchEntry> = Vec::new();
        let mut active: Option<Vec<Active>> = None;
        let (mut signature, mut holders_len) = (first.signature, first.holders.len());
        let mut depth = 1u32;
        for hash in &hashes[1..] {
            let Some(node) = tree.nodes.get(hash) else {
                break;
            };
            if node.signature != signature || node.holders.len() != holders_len {
                (signature, holders_len) = (node.signature, node.holders.len());
                let still = match active.take() {
                    // The first change right after the first block: its
                    // survivors are this level's holders already.
                    None if depth == 1 => survivors_of_first(&first.holders, &node.holders, &mut deeper),
                    None => all_active(&first.holders, &mut deeper),
                    Some(still) => still,
                };
                let still = active.insert(still);
                if depth > 1 {
                    intersect(&mut deeper, still, &node.holders, depth);
                }
                if still.is_empty() {
                    break;
                }
            }
            depth += 1;
        }
        let active = match active {
            Some(active) => active,
            None if depth > 1 => all_active(&first.holders, &mut deeper),
            None => Vec::new(),
        };
        for item in &active {
            item.credit(&mut deeper, depth);
        }
        FindMatches { names: tree.names.clone(), first: first.holders.clone(), deeper }
    }

    /// Blocks a worker holds (0 if unknown): the size of its cached tree.
    pub fn cached_blocks(&self, worker_id: &str) -> usize {
        self.tree.read().tree_size(worker_id)
    }

    /// [`cached_blocks`](Self::cached_blocks) of several workers at once.
    pub fn cached_blocks_of<'a>(&self, worker_ids: impl IntoIterator<Item = &'a str>) -> Vec<usize> {
        let tree = self.tree.read();
        worker_ids.into_iter().map(|id| tree.tree_size(id)).collect()
    }

    /// Whether `worker_id` has a view in the index.
    pub fn has_worker(&self, worker_id: &str) -> bool {
        self.tree.read().by_id.contains_key(worker_id)
    }

    /// The workers with a view in the index, sorted.
    pub fn worker_ids(&self) -> Vec<WorkerId> {
        let mut ids: Vec<WorkerId> = self.tree.read().by_id.keys().cloned().collect();
        ids.sort_unstable();
        ids
    }

    /// Everything a worker holds, as a dump (None if unknown).
    pub fn dump(&self, worker_id: &str) -> Option<(u64, Dump)> {
        let tree = self.tree.read();
        let &slot = tree.by_id.get(worker_id)?;
        let state = tree.slots[slot as usize].as_ref()?;
        let blocks = state
            .blocks
            .keys()
            .map(|&hash| {
                let node = tree.nodes.get(&hash).expect("a worker's block has a node");
                let holder = node.holders.iter().find(|h| h.slot == slot).expect("a worker's block names it as holder");
                CachedBlock { sequence_hash: hash, local_hash: node.local, tiers: holder.tiers }
            })
            .collect();
        Some((state.instance, Dump { next_event_id: state.next_event_id, blocks }))
    }

    /// Sizes and counters.
    pub fn stats(&self) -> IndexStats {
        let tree = self.tree.read();
        IndexStats {
            workers: tree.by_id.len(),
            nodes: tree.nodes.len(),
            entries: tree.slots.iter().flatten().map(|state| state.blocks.len()).sum(),
            events_applied: tree.events_applied,
        }
    }
}

/// A worker still matching in [`KvIndex::find_matches`].
#[derive(Debug, Clone, Copy)]
struct Active {
    slot: u32,
    /// Its entry in the result.
    at: u32,
    /// The tier it holds the current run of levels in.
    tier: u8,
    /// Depth where that run began.
    since: u32,
}

impl Active {
    /// Credits the run `since..depth` and records `depth` as its match.
    fn credit(&self, entries: &mut [MatchEntry], depth: u32) {
        let entry = &mut entries[self.at as usize];
        entry.by_tier[self.tier as usize] += depth - self.since;
        entry.blocks = depth;
    }
}

/// Every holder of the first block, active since depth 1, with an entry
/// each (credited with the first block).
fn all_active(first: &[Holder], deeper: &mut Vec<MatchEntry>) -> Vec<Active> {
    deeper.clear();
    first
        .iter()
        .enumerate()
        .map(|(at, holder)| {
            deeper.push(MatchEntry::first_block(holder));
            Active { slot: holder.slot, at: at as u32, tier: best_tier(holder.tiers), since: 1 }
        })
        .collect()
}

/// The first block's holders (`first`) that also hold the second block
/// (`holders`), each with an entry in `deeper` credited with the first
/// block. The others matched one block, which the result's holder list
/// already says, so only the survivors are visited: from the smaller side
/// by binary search when the sides differ a lot.
fn survivors_of_first(first: &[Holder], holders: &[Holder], deeper: &mut Vec<MatchEntry>) -> Vec<Active> {
    deeper.clear();
    let mut out = Vec::new();
    let mut keep = |first: &Holder, second: &Holder| {
        out.push(Active { slot: second.slot, at: deeper.len() as u32, tier: best_tier(second.tiers), since: 1 });
        deeper.push(MatchEntry::first_block(first));
    };
    if holders.len() * 8 < first.len() {
        for holder in holders {
            if let Ok(at) = first.binary_search_by_key(&holder.slot, |h| h.slot) {
                keep(&first[at], holder);
            }
        }
    } else {
        let mut cursor = 0;
        for item in first {
            while cursor < holders.len() && holders[cursor].slot < item.slot {
                cursor += 1;
            }
            if cursor < holders.len() && holders[cursor].slot == item.slot {
                keep(item, &holders[cursor]);
            }
        }
    }
    out
}

fn best_tier(tiers: TierSet) -> u8 {
    tiers.best().map_or(0, |tier| tier as u8)
}

/// Level `depth` (0-based) has holder set `holders` (sorted by slot): the
/// entries of `active` not among them matched `depth` blocks, are credited
/// and leave. A survivor whose tier changes is credited for its run so far
/// and starts a new one.
fn intersect(entries: &mut [MatchEntry], active: &mut Vec<Active>, holders: &[Holder], depth: u32) {
    let mut step = |item: &mut Active, holder: Option<&Holder>| match holder {
        None => {
            item.credit(entries, depth);
            false
        }
        Some(holder) => {
            let tier = best_tier(holder.tiers);
            if tier != item.tier {
                item.credit(entries, depth);
                (item.tier, item.since) = (tier, depth);
            }
            true
        }
    };
    if active.len() * 8 < holders.len() {
        active.retain_mut(|item| step(item, holders.binary_search_by_key(&item.slot, |h| h.slot).ok().map(|at| &holders[at])));
    } else {
        let mut cursor = 0;
        active.retain_mut(|item| {
            while cursor < holders.len() && holders[cursor].slot < item.slot {
                cursor += 1;
            }
            step(item, holders.get(cursor).filter(|holder| holder.slot == item.slot))
        });
    }
}

impl Tree {
    /// Blocks `worker_id` holds (0 if unknown).
    fn tree_size(&self, worker_id: &str) -> usize {
        self.by_id.get(worker_id).and_then(|&slot| self.slots[slot as usize].as_ref()).map_or(0, |state| state.blocks.len())
    }

    /// The worker's slot, created if new; a different `instance` resets it.
    fn slot_for(&mut self, worker_id: &str, instance: u64) -> u32 {
        let slot = self.slot_or_create(worker_id);
        let state = self.slots[slot as usize].as_mut().expect("live slot");
        if state.instance != instance {
            state.instance = instance;
            state.next_event_id = 0;
            self.clear_worker(slot);
        }
        slot
    }

    fn slot_or_create(&mut self, worker_id: &str) -> u32 {
        if let Some(&slot) = self.by_id.get(worker_id) {
            return slot;
        }
        let id = WorkerId::from(worker_id);
        let state = WorkerState { instance: 0, next_event_id: 0, blocks: HashKeyed::default() };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(state);
                slot
            }
            None => {
                self.slots.push(Some(state));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 workers")
            }
        };
        let names = Arc::make_mut(&mut self.names);
        if names.len() <= slot as usize {
            names.resize(slot as usize + 1, None);
        }
        names[slot as usize] = Some(id.clone());
        self.by_id.insert(id, slot);
        slot
    }

    fn store(&mut self, slot: u32, blocks: &[StoredBlock], tier: Tier) {
        let state = self.slots[slot as usize].as_mut().expect("live slot");
        for block in blocks {
            state.blocks.insert(block.sequence_hash, ());
            let node = self.nodes.shard_mut(block.sequence_hash).entry(block.sequence_hash).or_insert_with(|| Node {
                local: block.local_hash,
                holders: Vec::new(),
                signature: 0,
            });
            match node.holders.binary_search_by_key(&slot, |h| h.slot) {
                Ok(at) => {
                    let holder = &mut node.holders[at];
                    node.signature ^= holder_key(slot, holder.tiers);
                    holder.tiers.insert(tier);
                    node.signature ^= holder_key(slot, holder.tiers);
                }
                Err(at) => {
                    let mut tiers = TierSet::default();
                    tiers.insert(tier);
                    node.signature ^= holder_key(slot, tiers);
                    node.holders.insert(at, Holder { slot, tiers });
                }
            }
        }
    }

    /// Drops `hash` from `slot` in `tier` (every tier if None).
    fn remove(&mut self, slot: u32, hash: SequenceHash, tier: Option<Tier>) {
        let Some(node) = self.nodes.shard_mut(hash).get_mut(&hash) else {
            return;
        };
        let Ok(at) = node.holders.binary_search_by_key(&slot, |h| h.slot) else {
            return;
        };
        let holder = &mut node.holders[at];
        node.signature ^= holder_key(slot, holder.tiers);
        match tier {
            Some(tier) => holder.tiers.remove(tier),
            None => holder.tiers = TierSet::default(),
        }
        node.signature ^= holder_key(slot, holder.tiers);
        if !node.holders[at].tiers.is_empty() {
            return;
        }
        node.holders.remove(at);
        if node.holders.is_empty() {
            self.nodes.shard_mut(hash).remove(&hash);
        }
        if let Some(state) = self.slots[slot as usize].as_mut() {
            state.blocks.remove(&hash);
        }
    }

    fn clear_worker(&mut self, slot: u32) {
        let Some(state) = self.slots[slot as usize].as_mut() else {
            return;
        };
        let hashes: Vec<SequenceHash> = state.blocks.drain().map(|(hash, ())| hash).collect();
        for hash in hashes {
            self.remove(slot, hash, None);
        }
    }
}

#[cfg(test)]
mod tests;
