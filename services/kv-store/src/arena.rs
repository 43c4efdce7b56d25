//! The memory tier's bytes: one allocation of the tier's capacity, cut into
//! equal segments, so that the whole tier is one region a reader can be
//! given (UCX registers it once; a reader on the same machine maps it) and
//! the tier's memory is bounded by construction.
//!
//! A block occupies as many segments as its bytes need, not necessarily
//! adjacent. The segment size is chosen when the first block arrives: the
//! largest power of two up to 64 KiB that divides the block's size (8 KiB
//! for a 16-token block of SmolLM2-135M, 64 KiB for most larger models), so
//! the first layout's blocks waste nothing; a block size with no such
//! divisor of at least 4 KiB gets segments of its own size (up to 64 KiB).
//!
//! The rule that keeps this sound: a block's segments are written once, by
//! the [`Arena::store`] that took them, before anyone else can see them,
//! and go back to the free list only when the last [`Slots`] handle drops;
//! readers (the store's own, and remote readers holding a lease) only read.

#![allow(unsafe_code)]

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use turbine_kv::{KvBuffer, KvLayout, KvMemory};
use xxhash_rust::xxh3::Xxh3;

/// The largest segment.
const MAX_SEGMENT: usize = 64 << 10;

/// The smallest power-of-two segment worth its bookkeeping.
const MIN_POWER_SEGMENT: usize = 4 << 10;

/// How the arena is cut, fixed by the first block.
#[derive(Debug)]
struct Cut {
    segment: usize,
    free: Mutex<Vec<u32>>,
}

/// The memory tier's bytes.
pub struct Arena {
    buffer: Arc<KvBuffer>,
    cut: OnceLock<Cut>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("bytes", &self.buffer.len()).field("segment", &self.segment()).finish()
    }
}

/// The segment size for an arena whose first block is `block_bytes`.
fn segment_for(block_bytes: usize) -> usize {
    let power = 1usize << block_bytes.trailing_zeros().min(MAX_SEGMENT.trailing_zeros());
    if power >= MIN_POWER_SEGMENT { power } else { block_bytes.clamp(1, MAX_SEGMENT) }
}

impl Arena {
    /// An arena over `buffer` (its length is the tier's capacity).
    pub fn new(buffer: KvBuffer) -> Arc<Self> {
        Arc::new(Self { buffer: Arc::new(buffer), cut: OnceLock::new() })
    }

    /// An arena of `bytes` on the heap (pages are touched as blocks fill them).
    pub fn on_heap(bytes: usize) -> Arc<Self> {
        Self::new(KvBuffer::zeroed(bytes))
    }

    /// The arena as a memory region for transfers (an opaque layout of
    /// 4 KiB "blocks": readers address it by byte offsets).
    pub fn memory(&self) -> KvMemory {
        const PAGE: usize = 4096;
        KvMemory::new(self.buffer.clone(), KvLayout::opaque(PAGE, "kv-store arena"), self.buffer.len() / PAGE)
    }

    /// Bytes in the arena.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    /// Whether the arena has no bytes.
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// The segment size (None until the first block arrived).
    pub fn segment(&self) -> Option<usize> {
        self.cut.get().map(|cut| cut.segment)
    }

    /// Segments not held by any block.
    pub fn free_segments(&self) -> usize {
        self.cut.get().map_or(0, |cut| cut.free.lock().len())
    }

    fn cut(&self, first_block: usize) -> &Cut {
        self.cut.get_or_init(|| {
            let segment = segment_for(first_block);
            let count = u32::try_from(self.buffer.len() / segment).unwrap_or(u32::MAX);
            // Handed out lowest first, so a lightly used tier touches few pages.
            Cut { segment, free: Mutex::new((0..count).rev().collect()) }
        })
    }

    /// Segments `bytes` needs, in the arena's cut (fixing it if this is the
    /// first block).
    pub fn segments_for(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.cut(bytes).segment).max(1)
    }

    /// Copies `bytes` into free segments; None when too few are free.
    pub fn store(self: &Arc<Self>, bytes: &[u8]) -> Option<Slots> {
        let cut = self.cut(bytes.len());
        let needed = bytes.len().div_ceil(cut.segment).max(1);
        let segments: Box<[u32]> = {
            let mut free = cut.free.lock();
            let from = free.len().checked_sub(needed)?;
            let mut taken = free.split_off(from);
            // The stack keeps runs descending (see Drop): taken in
            // ascending order, a block on an unfragmented stretch is one
            // contiguous span, which readers copy in one piece.
            taken.reverse();
            taken.into_boxed_slice()
        };
        for (chunk, &segment) in bytes.chunks(cut.segment).zip(segments.iter()) {
            // SAFETY: the segment lies in the buffer (the cut's count) and
            // was just taken off the free list: nothing else reads or
            // writes it until these slots drop.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.buffer.as_ptr().add(segment as usize * cut.segment), chunk.len()) };
        }
        Some(Slots { arena: self.clone(), segments, len: bytes.len() })
    }
}

/// A block's bytes in the arena; its segments are free again when the last
/// handle drops.
pub struct Slots {
    arena: Arc<Arena>,
    segments: Box<[u32]>,
    len: usize,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots").field("len", &self.len).field("segments", &self.segments.len()).finish()
    }
}

impl Slots {
    /// The block's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The segments, in order.
    pub fn segments(&self) -> &[u32] {
        &self.segments
    }

    /// Bytes of arena the block holds (whole segments).
    pub fn footprint(&self) -> usize {
        self.segments.len() * self.segment()
    }

    fn segment(&self) -> usize {
        self.arena.segment().expect("an arena holding blocks is cut")
    }

    /// The block's bytes, piece by piece, in order.
    fn pieces(&self) -> impl Iterator<Item = &[u8]> {
        let segment = self.segment();
        let mut left = self.len;
        self.segments.iter().map(move |&index| {
            let take = left.min(segment);
            left -= take;
            // SAFETY: the segment lies in the buffer, was written before
            // these slots existed and is not written while they live.
            unsafe { std::slice::from_raw_parts(self.arena.buffer.as_ptr().add(index as usize * segment), take) }
        })
    }

    /// Appends the block's bytes to `into`.
    pub fn read_into(&self, into: &mut Vec<u8>) {
        into.reserve(self.len);
        self.pieces().for_each(|piece| into.extend_from_slice(piece));
    }

    /// The block's bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.len);
        self.read_into(&mut bytes);
        bytes
    }

    /// XXH3-64 of the block's bytes (the blocks' checksum), read in place.
    pub fn checksum(&self) -> u64 {
        let mut hasher = Xxh3::new();
        self.pieces().for_each(|piece| hasher.update(piece));
        hasher.digest()
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if let Some(cut) = self.arena.cut.get() {
            // Pushed back descending, so the next block of this size takes
            // them as the same ascending run.
            cut.free.lock().extend(self.segments.iter().rev());
        }
    }
}

#[cfg(test)]
mod tests {
    use turbine_kv::block_checksum;

    use super::*;

    #[test]
    fn segments_fit_the_first_layout() {
        assert_eq!(segment_for(368_640), 8192, "SmolLM2-135M's block is 45 segments of 8 KiB");
        assert_eq!(segment_for(2 << 20), MAX_SEGMENT);
        assert_eq!(segment_for(1024), 1024);
        assert_eq!(segment_for(1000), 1000);
        assert_eq!(segment_for(100_001), MAX_SEGMENT);
    }

    #[test]
    fn blocks_round_trip_and_give_their_segments_back() {
        let arena = Arena::on_heap(10 * 1024);
        let block = |n: u8, len: usize| -> Vec<u8> { (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(n)).collect() };
        let first = arena.store(&block(0, 1000)).unwrap();
        let a = arena.store(&block(1, 3000)).unwrap();
        assert_eq!((arena.segment(), first.segments().len(), a.segments().len(), a.footprint()), (Some(1000), 1, 3, 3000));
        assert_eq!(a.segments(), [1, 2, 3], "a fresh arena hands out ascending runs");
        drop(first);
        let b = arena.store(&block(2, 2500)).unwrap();
        assert_eq!(b.segments().len(), 3, "a second layout's block rounds up to whole segments");
        assert_eq!(a.to_vec(), block(1, 3000));
        assert_eq!(b.to_vec(), block(2, 2500));
        assert_eq!(b.checksum(), block_checksum(&block(2, 2500)));
        assert_eq!(arena.free_segments(), 4);
        assert!(arena.store(&block(3, 5000)).is_none(), "five segments do not fit in four");
        drop(a);
        assert_eq!(arena.free_segments(), 7);
        let again = arena.store(&block(4, 3000)).unwrap();
        assert_eq!(again.segments(), [1, 2, 3], "a freed run is taken again as the same run");
        drop(again);
        let c = arena.store(&block(3, 5000)).unwrap();
        assert_eq!(c.to_vec(), block(3, 5000), "reused segments hold the new block");
        assert_eq!(b.to_vec(), block(2, 2500), "and nothing else changed");
    }
}
