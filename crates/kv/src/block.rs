//! A KV block's bytes away from any pool, as tiers below the device and
//! the shared store hold and move them, and the checksum every
//! transferred block carries.

use xxhash_rust::xxh3::xxh3_64;

use crate::{KvTenant, LocalBlockHash, SequenceHash};

/// A block held below an engine's pool (host memory, disk, the shared
/// store), its bytes in the pool's layout.
#[derive(Debug)]
pub struct HostBlock {
    /// Hash of the block's own tokens.
    pub local: LocalBlockHash,
    /// The sequence hash of the block before it (None: the first block).
    pub parent: Option<SequenceHash>,
    /// XXH3-64 of `bytes`, taken when the block was copied out of G1.
    pub checksum: u64,
    /// The block's bytes.
    pub bytes: Box<[u8]>,
    /// Whose block it is (the shared store charges it to that tenant).
    pub tenant: KvTenant,
}

impl HostBlock {
    /// Whether the bytes still match their checksum.
    pub fn is_intact(&self) -> bool {
        block_checksum(&self.bytes) == self.checksum
    }
}

/// The checksum every transferred block carries (XXH3-64 of its bytes).
pub fn block_checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}
