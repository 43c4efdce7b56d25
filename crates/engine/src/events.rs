//! KV cache events: what a worker's prefix cache gained or lost, in order.
//!
//! The router's index consumes them to know which worker holds which block.
//! Events are numbered per worker from 0 when published, so a consumer can
//! detect a gap and ask for a dump instead.

use turbine_kv::{LocalBlockHash, SequenceHash};

/// One block newly stored in a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    /// The block's identity (chained over its prefix).
    pub sequence_hash: SequenceHash,
    /// Hash of the block's own tokens.
    pub local_hash: LocalBlockHash,
}

/// A change to the set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one chain became cached; `parent` is the
    /// sequence hash of the block before the first (`None` at the root).
    Stored {
        /// The block before the first stored one.
        parent: Option<SequenceHash>,
        /// The stored blocks, in chain order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted.
    Removed {
        /// Their sequence hashes.
        sequence_hashes: Vec<SequenceHash>,
    },
    /// The whole cache was emptied.
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
