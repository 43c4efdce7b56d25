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

use parking_lot::RwLock;

use crate::events::{CachedBlock, Dump, KvEvent, NumberedEvent, StoredBlock, Tier, TierSet};
use crate::{LocalBlockHash, SequenceHash};

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
}

#[derive(Debug)]
struct WorkerState {
    id: Arc<str>,
    instance: u64,
    next_event_id: u64,
    /// Every block this worker holds in any tier.
    blocks: HashKeyed<()>,
}

#[derive(Debug, Default)]
struct Tree {
    nodes: HashKeyed<Node>,
    slots: Vec<Option<WorkerState>>,
    free_slots: Vec<u32>,
    by_id: HashMap<Arc<str>, u32>,
    events_applied: u64,
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerMatch {
    /// The worker.
    pub worker_id: Arc<str>,
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
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FindMatches {
    /// One entry per matching worker.
    pub workers: Vec<WorkerMatch>,
}

impl FindMatches {
    /// The match of one worker, if it holds the first block (a linear scan).
    pub fn of(&self, worker_id: &str) -> Option<&WorkerMatch> {
        self.workers.iter().find(|m| &*m.worker_id == worker_id)
    }

    /// The deepest match, in blocks (0 when no worker matched).
    pub fn deepest(&self) -> u32 {
        self.workers.iter().map(|m| m.blocks).max().unwrap_or(0)
    }
}

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
#[derive(Debug, Default)]
pub struct KvIndex {
    tree: RwLock<Tree>,
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
        {
            let mut tree = self.tree.write();
            let slot = tree.slot_for(worker_id, instance);
            let state = tree.slots[slot as usize].as_mut().expect("live slot");
            if event.event_id < state.next_event_id {
                return Applied::Duplicate;
            }
            if event.event_id > state.next_event_id {
                return Applied::Gap { expected: state.next_event_id };
            }
            state.next_event_id += 1;
        }
        self.apply_unnumbered(worker_id, &event.event);
        Applied::Applied
    }

    /// Applies an event without numbering (the router's own decisions in
    /// approximate mode, tests).
    pub fn apply_unnumbered(&self, worker_id: &str, event: &KvEvent) {
        match event {
            KvEvent::Stored { blocks, tier, .. } => {
                for slice in blocks.chunks(STORE_SLICE) {
                    let mut tree = self.tree.write();
                    let slot = tree.slot_or_create(worker_id);
                    tree.store(slot, slice, *tier);
                }
                self.tree.write().events_applied += 1;
            }
            KvEvent::Removed { sequence_hashes, tier } => {
                let mut tree = self.tree.write();
                if let Some(&slot) = tree.by_id.get(worker_id) {
                    for &hash in sequence_hashes {
                        tree.remove(slot, hash, Some(*tier));
                    }
                }
                tree.events_applied += 1;
            }
            KvEvent::Cleared => {
                let mut tree = self.tree.write();
                if let Some(&slot) = tree.by_id.get(worker_id) {
                    tree.clear_worker(slot);
                }
                tree.events_applied += 1;
            }
        }
    }

    /// Replaces a worker's view with a dump of its cache.
    pub fn load_dump(&self, worker_id: &str, instance: u64, dump: &Dump) {
        {
            let mut tree = self.tree.write();
            let slot = tree.slot_for(worker_id, instance);
            tree.clear_worker(slot);
            tree.slots[slot as usize].as_mut().expect("live slot").next_event_id = dump.next_event_id;
        }
        for slice in dump.blocks.chunks(STORE_SLICE) {
            let mut tree = self.tree.write();
            let Some(&slot) = tree.by_id.get(worker_id) else { return };
            for block in slice {
                for tier in Tier::ALL.into_iter().filter(|&tier| block.tiers.contains(tier)) {
                    tree.store(slot, &[StoredBlock { sequence_hash: block.sequence_hash, local_hash: block.local_hash }], tier);
                }
            }
        }
    }

    /// Forgets a worker and every block it held; false if it was unknown.
    pub fn remove_worker(&self, worker_id: &str) -> bool {
        let mut tree = self.tree.write();
        let Some(slot) = tree.by_id.remove(worker_id) else { return false };
        tree.clear_worker(slot);
        tree.slots[slot as usize] = None;
        tree.free_slots.push(slot);
        true
    }

    /// For each worker holding the first of `hashes`, how many leading
    /// blocks it holds (and in which tiers).
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> FindMatches {
        let tree = self.tree.read();
        let Some(first) = hashes.first().and_then(|hash| tree.nodes.get(hash)) else {
            return FindMatches::default();
        };
        struct Active {
            slot: u32,
            by_tier: [u32; 4],
        }
        let count = |by_tier: &mut [u32; 4], tiers: TierSet| {
            if let Some(best) = tiers.best() {
                by_tier[best as usize] += 1;
            }
        };
        let mut active: Vec<Active> = first
            .holders
            .iter()
            .map(|holder| {
                let mut by_tier = [0; 4];
                count(&mut by_tier, holder.tiers);
                Active { slot: holder.slot, by_tier }
            })
            .collect();
        let mut results = Vec::with_capacity(active.len());
        let mut depth = 1u32;
        let finish = |results: &mut Vec<WorkerMatch>, active: Active, depth: u32| {
            let state = tree.slots[active.slot as usize].as_ref().expect("holders name live slots");
            results.push(WorkerMatch { worker_id: state.id.clone(), blocks: depth, by_tier: active.by_tier });
        };
        for hash in &hashes[1..] {
            let Some(node) = tree.nodes.get(hash) else { break };
            // Both lists are sorted by slot: one merge pass.
            let holders = &node.holders;
            let mut cursor = 0;
            let mut kept = 0;
            for index in 0..active.len() {
                let slot = active[index].slot;
                while cursor < holders.len() && holders[cursor].slot < slot {
                    cursor += 1;
                }
                if cursor < holders.len() && holders[cursor].slot == slot {
                    count(&mut active[index].by_tier, holders[cursor].tiers);
                    // Survivors stay sorted: they are visited in order and
                    // each moves to the lowest free index.
                    active.swap(kept, index);
                    kept += 1;
                }
            }
            for dropped in active.drain(kept..) {
                finish(&mut results, dropped, depth);
            }
            if active.is_empty() {
                break;
            }
            depth += 1;
        }
        for survivor in active {
            finish(&mut results, survivor, depth);
        }
        FindMatches { workers: results }
    }

    /// Blocks a worker holds (0 if unknown): the size of its cached tree.
    pub fn cached_blocks(&self, worker_id: &str) -> usize {
        let tree = self.tree.read();
        tree.by_id.get(worker_id).and_then(|&slot| tree.slots[slot as usize].as_ref()).map_or(0, |state| state.blocks.len())
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
                let node = &tree.nodes[&hash];
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

impl Tree {
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
        let id: Arc<str> = Arc::from(worker_id);
        let state = WorkerState { id: id.clone(), instance: 0, next_event_id: 0, blocks: HashKeyed::default() };
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
        self.by_id.insert(id, slot);
        slot
    }

    fn store(&mut self, slot: u32, blocks: &[StoredBlock], tier: Tier) {
        let state = self.slots[slot as usize].as_mut().expect("live slot");
        for block in blocks {
            state.blocks.insert(block.sequence_hash, ());
            let node = self.nodes.entry(block.sequence_hash).or_insert_with(|| Node { local: block.local_hash, holders: Vec::new() });
            match node.holders.binary_search_by_key(&slot, |h| h.slot) {
                Ok(at) => node.holders[at].tiers.insert(tier),
                Err(at) => {
                    let mut tiers = TierSet::default();
                    tiers.insert(tier);
                    node.holders.insert(at, Holder { slot, tiers });
                }
            }
        }
    }

    /// Drops `hash` from `slot` in `tier` (every tier if None).
    fn remove(&mut self, slot: u32, hash: SequenceHash, tier: Option<Tier>) {
        let Some(node) = self.nodes.get_mut(&hash) else { return };
        let Ok(at) = node.holders.binary_search_by_key(&slot, |h| h.slot) else { return };
        match tier {
            Some(tier) => node.holders[at].tiers.remove(tier),
            None => node.holders[at].tiers = TierSet::default(),
        }
        if !node.holders[at].tiers.is_empty() {
            return;
        }
        node.holders.remove(at);
        if node.holders.is_empty() {
            self.nodes.remove(&hash);
        }
        if let Some(state) = self.slots[slot as usize].as_mut() {
            state.blocks.remove(&hash);
        }
    }

    fn clear_worker(&mut self, slot: u32) {
        let Some(state) = self.slots[slot as usize].as_mut() else { return };
        let hashes: Vec<SequenceHash> = state.blocks.drain().map(|(hash, ())| hash).collect();
        for hash in hashes {
            self.remove(slot, hash, None);
        }
    }
}

#[cfg(test)]
mod tests;
