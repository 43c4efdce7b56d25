use proptest::prelude::*;
use turbine_kv::{BlockHasher, BlockHashes};

use super::*;

fn hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHashes> {
    BlockHasher::default().hash_blocks(tokens, block_size)
}

fn sequence_hashes(blocks: &[BlockHashes]) -> Vec<SequenceHash> {
    blocks.iter().map(|b| b.sequence).collect()
}

fn drain(manager: &mut BlockManager) -> Vec<KvEvent> {
    let mut events = Vec::new();
    manager.drain_events(&mut events);
    events
}

#[test]
fn released_cached_blocks_are_reused_by_a_matching_prefix() {
    let mut manager = BlockManager::new(8, 4, true);
    let tokens: Vec<u32> = (0..12).collect();
    let block_hashes = hashes(&tokens, 4);
    let blocks = manager.allocate(3).unwrap();
    let pairs: Vec<_> = blocks.iter().copied().zip(block_hashes.iter().copied()).collect();
    manager.register(None, KvTenant::SHARED, &pairs);
    assert_eq!(drain(&mut manager).len(), 1, "one run, one Stored event");
    manager.release(blocks.iter().rev().copied());
    assert_eq!(manager.num_free(), 8);
    assert_eq!(manager.num_cached(), 3);

    let wanted = sequence_hashes(&block_hashes);
    assert_eq!(manager.match_prefix(&wanted), 3);
    assert_eq!(manager.count_free_among_cached(&wanted), 3);
    let reused = manager.acquire_cached(&wanted[..2]);
    assert_eq!(reused, blocks[..2]);
    assert_eq!(manager.num_free(), 6);
    manager.check_invariants();
}

#[test]
fn eviction_takes_the_least_recently_released_block_and_reports_it() {
    let mut manager = BlockManager::new(3, 2, true);
    let block_hashes = hashes(&[1, 2, 3, 4, 5, 6], 2);
    let blocks = manager.allocate(3).unwrap();
    let pairs: Vec<_> = blocks.iter().copied().zip(block_hashes.iter().copied()).collect();
    manager.register(None, KvTenant::SHARED, &pairs);
    drain(&mut manager);
    // Released tail first: block 2 is the least recently released.
    manager.release(blocks.iter().rev().copied());
    let fresh = manager.allocate(1).unwrap();
    assert_eq!(fresh, vec![blocks[2]]);
    assert_eq!(drain(&mut manager), vec![KvEvent::Removed { sequence_hashes: vec![block_hashes[2].sequence], tier: turbine_kv::Tier::Device }]);
    // The first two blocks still form a matchable prefix.
    assert_eq!(manager.match_prefix(&sequence_hashes(&block_hashes)), 2);
    manager.check_invariants();
}

#[test]
fn a_shared_block_is_not_evictable_until_every_holder_releases_it() {
    let mut manager = BlockManager::new(2, 2, true);
    let block_hashes = hashes(&[7, 7], 2);
    let blocks = manager.allocate(1).unwrap();
    manager.register(None, KvTenant::SHARED, &[(blocks[0], block_hashes[0])]);
    let shared = manager.acquire_cached(&[block_hashes[0].sequence]);
    assert_eq!(shared, blocks);
    assert_eq!(manager.ref_count(blocks[0]), 2);
    manager.release(blocks.clone());
    // Still held once: only the other block can be allocated.
    assert!(manager.allocate(2).is_none());
    let other = manager.allocate(1).unwrap();
    assert_ne!(other, blocks);
    manager.release(shared);
    manager.release(other);
    assert_eq!(manager.num_free(), 2);
    manager.check_invariants();
}

#[test]
fn a_duplicate_hash_stays_private_and_emits_nothing() {
    let mut manager = BlockManager::new(4, 2, true);
    let block_hashes = hashes(&[1, 2], 2);
    let a = manager.allocate(1).unwrap();
    let b = manager.allocate(1).unwrap();
    manager.register(None, KvTenant::SHARED, &[(a[0], block_hashes[0])]);
    manager.register(None, KvTenant::SHARED, &[(b[0], block_hashes[0])]);
    assert_eq!(drain(&mut manager).len(), 1, "only the first registration is a new block");
    assert_eq!(manager.cached_hash(b[0]), None);
    manager.release(b);
    manager.check_invariants();
}

#[test]
fn allocation_failure_changes_nothing() {
    let mut manager = BlockManager::new(2, 4, true);
    let held = manager.allocate(1).unwrap();
    assert!(manager.allocate(2).is_none());
    assert_eq!(manager.num_free(), 1);
    manager.release(held);
    manager.check_invariants();
}

#[test]
fn prefix_caching_off_never_matches_or_emits() {
    let mut manager = BlockManager::new(2, 2, false);
    let block_hashes = hashes(&[1, 2], 2);
    let blocks = manager.allocate(1).unwrap();
    manager.register(None, KvTenant::SHARED, &[(blocks[0], block_hashes[0])]);
    manager.release(blocks);
    assert_eq!(manager.match_prefix(&[block_hashes[0].sequence]), 0);
    assert!(drain(&mut manager).is_empty());
}

#[test]
fn clearing_empties_the_free_cache() {
    let mut manager = BlockManager::new(4, 2, true);
    let block_hashes = hashes(&[1, 2, 3, 4], 2);
    let blocks = manager.allocate(2).unwrap();
    manager.register(None, KvTenant::SHARED, &[(blocks[0], block_hashes[0]), (blocks[1], block_hashes[1])]);
    manager.release(blocks);
    drain(&mut manager);
    manager.clear_free_cached();
    assert_eq!(drain(&mut manager), vec![KvEvent::Cleared]);
    assert_eq!(manager.num_cached(), 0);
    manager.check_invariants();
}

#[derive(Debug, Clone)]
enum Op {
    /// Allocate a sequence of `len` tokens drawn from a small alphabet (so
    /// prefixes collide), reusing cached blocks.
    Admit { tokens: Vec<u32> },
    /// Release the i-th live sequence.
    Finish(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![prop::collection::vec(0u32..3, 1..24).prop_map(|tokens| Op::Admit { tokens }), (0usize..8).prop_map(Op::Finish),]
}

proptest! {
    /// After any sequence of admissions and releases: invariants hold, the
    /// event stream replayed into a set equals the cache's contents, and a
    /// block is never handed to two sequences unless it is a cached prefix.
    #[test]
    fn events_mirror_the_cache_and_invariants_hold(ops in prop::collection::vec(op(), 1..60)) {
        let block_size = 4;
        let mut manager = BlockManager::new(12, block_size, true);
        let mut live: Vec<Vec<BlockId>> = Vec::new();
        let mut mirror = std::collections::HashSet::new();
        for op in ops {
            match op {
                Op::Admit { tokens } => {
                    let block_hashes = hashes(&tokens, block_size);
                    let wanted = sequence_hashes(&block_hashes);
                    let hit = manager.match_prefix(&wanted);
                    let needed = manager.blocks_for(tokens.len()) - hit;
                    let free_hit = manager.count_free_among_cached(&wanted[..hit]);
                    if needed > manager.num_free() - free_hit {
                        continue;
                    }
                    let mut table = manager.acquire_cached(&wanted[..hit]);
                    table.extend(manager.allocate(needed).unwrap());
                    let full = tokens.len() / block_size;
                    let pairs: Vec<_> = (hit..full).map(|i| (table[i], block_hashes[i])).collect();
                    let parent = hit.checked_sub(1).map(|i| block_hashes[i].sequence);
                    manager.register(parent, KvTenant::SHARED, &pairs);
                    live.push(table);
                }
                Op::Finish(index) => {
                    if !live.is_empty() {
                        let table = live.remove(index % live.len());
                        manager.release(table.into_iter().rev());
                    }
                }
            }
            manager.check_invariants();
            for event in drain(&mut manager) {
                match event {
                    KvEvent::Stored { blocks, .. } => for block in blocks { prop_assert!(mirror.insert(block.sequence_hash)); },
                    KvEvent::Removed { sequence_hashes, .. } => for hash in sequence_hashes { prop_assert!(mirror.remove(&hash)); },
                    KvEvent::Cleared => mirror.clear(),
                }
            }
            let cached: std::collections::HashSet<_> = manager.cached_blocks().into_iter().map(|block| block.sequence_hash).collect();
            prop_assert_eq!(&cached, &mirror);
            let referenced: usize = live.iter().map(Vec::len).sum();
            prop_assert!(manager.num_used() <= referenced);
        }
    }
}
