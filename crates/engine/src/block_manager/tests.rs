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
    let blocks = manager.allocate(3, KvTenant::SHARED).unwrap();
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
    let blocks = manager.allocate(3, KvTenant::SHARED).unwrap();
    let pairs: Vec<_> = blocks.iter().copied().zip(block_hashes.iter().copied()).collect();
    manager.register(None, KvTenant::SHARED, &pairs);
    drain(&mut manager);
    // Released tail first: block 2 is the least recently released.
    manager.release(blocks.iter().rev().copied());
    let fresh = manager.allocate(1, KvTenant::SHARED).unwrap();
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
    let blocks = manager.allocate(1, KvTenant::SHARED).unwrap();
    manager.register(None, KvTenant::SHARED, &[(blocks[0], block_hashes[0])]);
    let shared = manager.acquire_cached(&[block_hashes[0].sequence]);
    assert_eq!(shared, blocks);
    assert_eq!(manager.ref_count(blocks[0]), 2);
    manager.release(blocks.clone());
    // Still held once: only the other block can be allocated.
    assert!(manager.allocate(2, KvTenant::SHARED).is_none());
    let other = manager.allocate(1, KvTenant::SHARED).unwrap();
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
    let a = manager.allocate(1, KvTenant::SHARED).unwrap();
    let b = manager.allocate(1, KvTenant::SHARED).unwrap();
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
    let held = manager.allocate(1, KvTenant::SHARED).unwrap();
    assert!(manager.allocate(2, KvTenant::SHARED).is_none());
    assert_eq!(manager.num_free(), 1);
    manager.release(held);
    manager.check_invariants();
}

#[test]
fn prefix_caching_off_never_matches_or_emits() {
    let mut manager = BlockManager::new(2, 2, false);
    let block_hashes = hashes(&[1, 2], 2);
    let blocks = manager.allocate(1, KvTenant::SHARED).unwrap();
    manager.register(None, KvTenant::SHARED, &[(blocks[0], block_hashes[0])]);
    manager.release(blocks);
    assert_eq!(manager.match_prefix(&[block_hashes[0].sequence]), 0);
    assert!(drain(&mut manager).is_empty());
}

#[test]
fn clearing_empties_the_free_cache() {
    let mut manager = BlockManager::new(4, 2, true);
    let block_hashes = hashes(&[1, 2, 3, 4], 2);
    let blocks = manager.allocate(2, KvTenant::SHARED).unwrap();
    manager.register(None, KvTenant::SHARED, &[(blocks[0], block_hashes[0]), (blocks[1], block_hashes[1])]);
    manager.release(blocks);
    drain(&mut manager);
    manager.clear_free_cached();
    assert_eq!(drain(&mut manager), vec![KvEvent::Cleared]);
    assert_eq!(manager.num_cached(), 0);
    manager.check_invariants();
}

/// Admits and finishes one sequence of `tokens` for `tenant` (its full
/// blocks registered); false if the pool had no room.
fn run_once(manager: &mut BlockManager, tokens: &[u32], tenant: KvTenant) -> bool {
    let block_hashes = hashes(tokens, 4);
    let wanted = sequence_hashes(&block_hashes);
    let hit = manager.match_prefix(&wanted);
    let needed = manager.blocks_for(tokens.len()) - hit;
    if needed > manager.num_free() - manager.count_free_among_cached(&wanted[..hit]) {
        return false;
    }
    let mut table = manager.acquire_cached(&wanted[..hit]);
    table.extend(manager.allocate(needed, tenant).unwrap());
    let pairs: Vec<_> = (hit..tokens.len() / 4).map(|i| (table[i], block_hashes[i])).collect();
    manager.register(hit.checked_sub(1).map(|i| block_hashes[i].sequence), tenant, &pairs);
    manager.release(table.into_iter().rev());
    true
}

/// One tenant's flood of new prompts evicts its own cached blocks, not
/// another tenant's prefix under its share; in one namespace, least
/// recently released takes the prefix.
#[test]
fn a_flooding_tenant_evicts_its_own_blocks_not_anothers_prefix() {
    let (a, b) = (KvTenant::of(&["a"]), KvTenant::of(&["b"]));
    let prefix: Vec<u32> = (1000..1016).collect();
    for (flooder, owner) in [(a, b), (KvTenant::SHARED, KvTenant::SHARED)] {
        let mut manager = BlockManager::new(16, 4, true);
        assert!(run_once(&mut manager, &prefix, owner));
        for n in 0..40u32 {
            let prompt: Vec<u32> = (10_000 + n * 100..10_000 + n * 100 + 16).collect();
            assert!(run_once(&mut manager, &prompt, flooder));
            manager.check_invariants();
        }
        let held = manager.match_prefix(&sequence_hashes(&hashes(&prefix, 4)));
        if flooder == owner {
            assert_eq!((held, manager.fair_share_evictions()), (0, 0), "one namespace: least recently released");
        } else {
            assert_eq!(held, 4, "b's prefix is whole");
            assert_eq!((manager.cached_of(a), manager.cached_of(b)), (12, 4));
            assert_eq!(manager.fair_share_evictions(), 37 * 4, "every block a evicted was its own");
        }
    }
}

/// A newcomer's blocks come from the tenant above its share, and when that
/// tenant's blocks are all in use, from least recently released.
#[test]
fn room_comes_from_the_tenant_above_its_share_while_it_has_free_blocks() {
    let (a, b, c) = (KvTenant::of(&["a"]), KvTenant::of(&["b"]), KvTenant::of(&["c"]));
    let mut manager = BlockManager::new(12, 4, true);
    assert!(run_once(&mut manager, &(0..8).collect::<Vec<u32>>(), b));
    for n in 1..=10u32 {
        assert!(run_once(&mut manager, &(n * 100..n * 100 + 4).collect::<Vec<u32>>(), a));
    }
    // 12 cached: b 2, a 10. c's block comes from a (above 12 / 2), its oldest.
    let oldest_of_a = sequence_hashes(&hashes(&(100..104).collect::<Vec<u32>>(), 4));
    assert_eq!(manager.match_prefix(&oldest_of_a), 1);
    assert!(run_once(&mut manager, &(5000..5004).collect::<Vec<u32>>(), c));
    assert_eq!(manager.match_prefix(&oldest_of_a), 0, "a's oldest made room");
    assert_eq!((manager.cached_of(a), manager.cached_of(b), manager.cached_of(c)), (9, 2, 1));
    // a's nine in use: the next room is the least recently released (b's).
    let in_use = manager
        .acquire_cached(&(1..=10u32).skip(1).flat_map(|n| sequence_hashes(&hashes(&(n * 100..n * 100 + 4).collect::<Vec<u32>>(), 4))).collect::<Vec<_>>());
    assert_eq!(in_use.len(), 9);
    let before = manager.fair_share_evictions();
    assert!(manager.allocate(1, c).is_some());
    assert_eq!(manager.fair_share_evictions(), before, "nothing of a's was free");
    assert_eq!(manager.cached_of(b), 1, "least recently released: b's");
    manager.check_invariants();
}

#[derive(Debug, Clone)]
enum Op {
    /// Allocate a sequence of `len` tokens drawn from a small alphabet (so
    /// prefixes collide), reusing cached blocks.
    Admit { tokens: Vec<u32>, tenant: u8 },
    /// Release the i-th live sequence.
    Finish(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![(prop::collection::vec(0u32..3, 1..24), 0u8..3).prop_map(|(tokens, tenant)| Op::Admit { tokens, tenant }), (0usize..8).prop_map(Op::Finish),]
}

proptest! {
    /// After any sequence of admissions and releases: invariants hold, the
    /// event stream replayed into a set equals the cache's contents, and a
    /// block is never handed to two sequences unless it is a cached prefix;
    /// with sequences of three tenants (one of them the shared namespace)
    /// whose fair shares pick what is evicted.
    #[test]
    fn events_mirror_the_cache_and_invariants_hold(ops in prop::collection::vec(op(), 1..60)) {
        let block_size = 4;
        let mut manager = BlockManager::new(12, block_size, true);
        let mut live: Vec<Vec<BlockId>> = Vec::new();
        let mut mirror = std::collections::HashSet::new();
        for op in ops {
            match op {
                Op::Admit { tokens, tenant } => {
                    let tenant = if tenant == 0 { KvTenant::SHARED } else { KvTenant::of(&[&tenant.to_string()]) };
                    let block_hashes = hashes(&tokens, block_size);
                    let wanted = sequence_hashes(&block_hashes);
                    let hit = manager.match_prefix(&wanted);
                    let needed = manager.blocks_for(tokens.len()) - hit;
                    let free_hit = manager.count_free_among_cached(&wanted[..hit]);
                    if needed > manager.num_free() - free_hit {
                        continue;
                    }
                    let mut table = manager.acquire_cached(&wanted[..hit]);
                    table.extend(manager.allocate(needed, tenant).unwrap());
                    let full = tokens.len() / block_size;
                    let pairs: Vec<_> = (hit..full).map(|i| (table[i], block_hashes[i])).collect();
                    let parent = hit.checked_sub(1).map(|i| block_hashes[i].sequence);
                    manager.register(parent, tenant, &pairs);
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
