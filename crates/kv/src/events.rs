//! KV cache events: what a worker's prefix cache gained or lost, in order.
//!
//! Block managers record them; the index consumes them to know which worker
//! holds which block in which tier. Events are numbered per worker from 0
//! when published, so a consumer can detect a gap (or a restarted worker)
//! and resynchronise from a dump instead.

use crate::{LocalBlockHash, SequenceHash, WorkerId};

/// Where a cached block lives, fastest first (DESIGN §5: G1 to G4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Tier {
    /// Engine (accelerator) memory: usable at once.
    #[default]
    Device = 0,
    /// Host memory: onboarded before use.
    Host = 1,
    /// Local disk.
    Disk = 2,
    /// A remote KV store.
    Remote = 3,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::Remote];

    /// The tier's bit in a [`TierSet`].
    pub const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of tiers, one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct TierSet(pub u8);

impl TierSet {
    /// Whether no tier is in the set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether `tier` is in the set.
    pub fn contains(self, tier: Tier) -> bool {
        self.0 & tier.bit() != 0
    }

    /// The fastest tier in the set.
    pub fn best(self) -> Option<Tier> {
        (self.0 != 0).then(|| Tier::ALL[self.0.trailing_zeros() as usize])
    }

    /// Adds a tier.
    pub fn insert(&mut self, tier: Tier) {
        self.0 |= tier.bit();
    }

    /// Removes a tier.
    pub fn remove(&mut self, tier: Tier) {
        self.0 &= !tier.bit();
    }
}

/// One block newly stored in a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The block's identity (chained over its prefix).
    pub sequence_hash: SequenceHash,
    /// Hash of the block's own tokens.
    pub local_hash: LocalBlockHash,
}

/// A change to the set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one chain became cached in `tier`; `parent` is
    /// the sequence hash of the block before the first (`None` at the root).
    Stored {
        /// The block before the first stored one.
        parent: Option<SequenceHash>,
        /// The stored blocks, in chain order.
        blocks: Vec<StoredBlock>,
        /// Where they are stored.
        tier: Tier,
    },
    /// Blocks left `tier`.
    Removed {
        /// Their sequence hashes.
        sequence_hashes: Vec<SequenceHash>,
        /// The tier they left.
        tier: Tier,
    },
    /// The whole cache, every tier, was emptied.
    Cleared,
}

/// An event with its per-worker number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumberedEvent {
    /// Monotonic per worker, from 0.
    pub event_id: u64,
    /// The change.
    pub event: KvEvent,
}

/// One cached block as a dump lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CachedBlock {
    /// The block's identity.
    pub sequence_hash: SequenceHash,
    /// Hash of its own tokens.
    pub local_hash: LocalBlockHash,
    /// Tiers holding it.
    pub tiers: TierSet,
}

/// Every block a worker caches, as of one event number: a consumer that
/// replaces its view of the worker with `blocks` then applies events from
/// `next_event_id` on is in sync again.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Dump {
    /// The first event not reflected in `blocks`.
    pub next_event_id: u64,
    /// The cached blocks.
    pub blocks: Vec<CachedBlock>,
}

/// One worker's events as published to the KV event log, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its incarnation (random per start): events of an older one are stale.
    pub instance: u64,
    /// Its events, numbered consecutively.
    pub events: Vec<NumberedEvent>,
}

/// A worker's whole cache as of one event number, with whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerDump {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its incarnation.
    pub instance: u64,
    /// The blocks and the first event they do not reflect.
    pub dump: Dump,
}
