//! The kv-store's words (what a block is keyed by, what a put did, the
//! store's sizes, a lease on blocks for reading over UCX) and, with the
//! `grpc` feature, its client ([`KvStoreClient`]).

use turbine_kv::{HostBlock, LocalBlockHash, SequenceHash, block_checksum};

#[cfg(feature = "grpc")]
mod client;

#[cfg(feature = "mock")]
pub use client::MockKvStoreApi;
#[cfg(feature = "grpc")]
pub use client::{GrpcKvStore, KvStoreApi, KvStoreClient, KvStoreError, MAX_PUT_FROM_BYTES, ROLE, block_from_pb, block_message, block_to_pb};

/// Model and KV layout of a block's bytes (nonzero): blocks of different
/// fingerprints never mix. A fingerprint's top 32 bits declare the bytes
/// of each of its blocks ([`declaring`](Self::declaring)): the store
/// refuses every block of another size, so no writer, first or not,
/// decides the size for the others. One below 2^32 declares none; the
/// store serves it no blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(u64);

impl Fingerprint {
    /// A fingerprint; None for 0 (unset on the wire).
    pub fn new(value: u64) -> Option<Self> {
        (value != 0).then_some(Self(value))
    }

    /// The fingerprint of blocks of `block_bytes` (nonzero) each, of the
    /// model and layout that hash to `identity` (its low 32 bits count).
    pub const fn declaring(identity: u64, block_bytes: u32) -> Self {
        assert!(block_bytes > 0, "a fingerprint declares blocks of at least one byte");
        Self(((block_bytes as u64) << 32) | (identity & 0xffff_ffff))
    }

    /// The bytes of each block it declares (None: it declares none).
    pub fn block_bytes(self) -> Option<usize> {
        let bytes = (self.0 >> 32) as usize;
        (bytes > 0).then_some(bytes)
    }

    /// Its value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// What a put did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOutcome {
    /// Blocks written.
    pub stored: u32,
    /// Blocks already held.
    pub already_held: u32,
}

/// Sizes and counters of one tier of the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierUsage {
    /// Blocks held.
    pub blocks: u64,
    /// Bytes held (memory: block bytes and their bookkeeping; disk: files).
    pub bytes: u64,
    /// Bytes the tier may hold.
    pub capacity_bytes: u64,
    /// Blocks evicted for room.
    pub evicted_blocks: u64,
    /// Blocks found corrupt in the tier (dropped).
    pub corrupt_blocks: u64,
}

/// Sizes and counters of the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// The memory tier.
    pub memory: TierUsage,
    /// The disk tier (all zero without one).
    pub disk: TierUsage,
    /// Blocks stored by puts.
    pub put_blocks: u64,
    /// Blocks served by gets.
    pub get_blocks: u64,
    /// Hashes asked for that the store did not hold.
    pub misses: u64,
    /// Fingerprints with blocks held in memory.
    pub fingerprints: u32,
    /// Tenants with blocks held in memory (each one's fair share of the
    /// memory tier is its capacity over this).
    pub tenants: u32,
}

/// A lease as a reader holds it: where the blocks' segments lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Names it for Release (0: nothing was leased).
    pub id: u64,
    /// The store's memory tier.
    pub region: crate::UcxRegion,
    /// Bytes per segment.
    pub segment_bytes: usize,
    /// The leading blocks held, in order.
    pub blocks: Vec<LeasedBlock>,
}

/// Why a lease the store answered cannot be read: the answer is
/// inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// Blocks without a segment size.
    #[error("the lease has no segment size")]
    NoSegmentSize,
    /// A block whose segments cannot hold it (or more than it needs).
    #[error("block {sequence:016x}: {segments} segments for {length} bytes")]
    WrongSegments {
        /// The block's sequence hash.
        sequence: u64,
        /// Its segments.
        segments: usize,
        /// Its length in bytes.
        length: usize,
    },
    /// A segment past the end of the store's region.
    #[error("block {sequence:016x}: segment {segment} lies outside the region")]
    OutsideRegion {
        /// The block's sequence hash.
        sequence: u64,
        /// The segment.
        segment: u32,
    },
}

/// One leased block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedBlock {
    /// The prefix it ends.
    pub sequence: SequenceHash,
    /// Hash of its own tokens.
    pub local: LocalBlockHash,
    /// The block before it.
    pub parent: Option<SequenceHash>,
    /// XXH3-64 of its bytes.
    pub checksum: u64,
    /// Its length in bytes.
    pub length: usize,
    /// Its segments, in order.
    pub segments: Vec<u32>,
}

impl Lease {
    /// Every segment's offset from the region's base, block by block; an
    /// error when the store's answer is inconsistent (a block whose
    /// segments cannot hold it, a segment outside the region).
    pub fn segment_offsets(&self) -> Result<Vec<u64>, LeaseError> {
        let segment = self.segment_bytes as u64;
        if segment == 0 && !self.blocks.is_empty() {
            return Err(LeaseError::NoSegmentSize);
        }
        let mut offsets = Vec::with_capacity(self.blocks.iter().map(|block| block.segments.len()).sum());
        for block in &self.blocks {
            if block.segments.len() as u64 != (block.length as u64).div_ceil(segment).max(1) {
                return Err(LeaseError::WrongSegments { sequence: block.sequence.0, segments: block.segments.len(), length: block.length });
            }
            for &index in &block.segments {
                let offset = u64::from(index) * segment;
                if offset + segment > self.region.length {
                    return Err(LeaseError::OutsideRegion { sequence: block.sequence.0, segment: index });
                }
                offsets.push(offset);
            }
        }
        Ok(offsets)
    }

    /// What to read: an offset per piece and the piece's length. Blocks
    /// whose segments all form one ascending run of the same length are
    /// read as one piece each; otherwise every segment is a piece. Either
    /// way the pieces land back to back as [`blocks_from`](Self::blocks_from)
    /// expects.
    pub fn pieces(&self) -> Result<(Vec<u64>, usize), LeaseError> {
        let offsets = self.segment_offsets()?;
        let Some(first) = self.blocks.first() else { return Ok((offsets, self.segment_bytes)) };
        let per_block = first.segments.len();
        let whole =
            self.blocks.iter().all(|block| block.segments.len() == per_block && block.segments.windows(2).all(|pair| pair[1] == pair[0].wrapping_add(1)));
        if !whole || per_block == 1 {
            return Ok((offsets, self.segment_bytes));
        }
        Ok((offsets.into_iter().step_by(per_block).collect(), per_block * self.segment_bytes))
    }

    /// The blocks out of `pulled` (every segment, `segment_bytes` each, in
    /// [`segment_offsets`](Self::segment_offsets)' order), each checked
    /// against its checksum: the run ends before the first that fails.
    pub fn blocks_from(&self, pulled: &[u8]) -> Vec<(SequenceHash, HostBlock)> {
        let mut run = Vec::with_capacity(self.blocks.len());
        let mut at = 0;
        for block in &self.blocks {
            let span = block.segments.len() * self.segment_bytes;
            let Some(bytes) = pulled.get(at..at + block.length) else { break };
            at += span;
            if block_checksum(bytes) != block.checksum {
                tracing::warn!(sequence_hash = block.sequence.0, "a block read from the kv-store over UCX fails its checksum; not used");
                break;
            }
            run.push((
                block.sequence,
                HostBlock { local: block.local, parent: block.parent, checksum: block.checksum, bytes: bytes.into(), tenant: turbine_kv::KvTenant::SHARED },
            ));
        }
        run
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::UcxRegion;

    fn lease(blocks: &[(&[u32], usize)], bytes: &[u8]) -> Lease {
        let mut at = 0;
        Lease {
            id: 1,
            region: UcxRegion { length: 1 << 20, ..UcxRegion::default() },
            segment_bytes: 4,
            blocks: blocks
                .iter()
                .enumerate()
                .map(|(n, &(segments, length))| {
                    let checksum = block_checksum(&bytes[at..at + length]);
                    at += segments.len() * 4;
                    LeasedBlock {
                        sequence: SequenceHash(n as u64),
                        local: LocalBlockHash(n as u64),
                        parent: None,
                        checksum,
                        length,
                        segments: segments.to_vec(),
                    }
                })
                .collect(),
        }
    }

    #[test]
    fn adjacent_segments_are_read_as_one_piece_and_blocks_are_checked() {
        let bytes: Vec<u8> = (0..32).collect();
        let whole = lease(&[(&[4, 5], 8), (&[0, 1], 8)], &bytes);
        assert_eq!(whole.pieces().unwrap(), (vec![16, 0], 8), "one piece per block");
        let scattered = lease(&[(&[4, 6], 8), (&[0, 1], 7)], &bytes);
        assert_eq!(scattered.pieces().unwrap(), (vec![16, 24, 0, 4], 4), "a gap: every segment is a piece");
        assert_eq!(scattered.blocks_from(&bytes[..16]).len(), 2, "the last block's tail segment is partly used");
        let mut bad = bytes.clone();
        bad[9] ^= 1;
        assert_eq!(whole.blocks_from(&bad).len(), 1, "the run ends before the block that fails its checksum");
        let lying = lease(&[(&[4, 5], 12)], &bytes);
        assert_eq!(lying.segment_offsets(), Err(LeaseError::WrongSegments { sequence: 0, segments: 2, length: 12 }), "two segments cannot hold 12 bytes");
        let outside = Lease { region: UcxRegion { length: 16, ..UcxRegion::default() }, ..whole };
        assert_eq!(
            outside.segment_offsets(),
            Err(LeaseError::OutsideRegion { sequence: 0, segment: 4 }),
            "segment 4 (bytes 16..20) is the first outside a 16-byte region"
        );
    }
}
