use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;
use crate::BlockHasher;

fn stored(hashes: &[u64], tier: Tier) -> KvEvent {
    KvEvent::Stored {
        parent: None,
        blocks: hashes.iter().map(|&h| StoredBlock { sequence_hash: SequenceHash(h), local_hash: LocalBlockHash(h ^ 1) }).collect(),
        tier,
    }
}

fn removed(hashes: &[u64], tier: Tier) -> KvEvent {
    KvEvent::Removed { sequence_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(), tier }
}

fn seq(hashes: &[u64]) -> Vec<SequenceHash> {
    hashes.iter().map(|&h| SequenceHash(h)).collect()
}

fn depths(matches: &FindMatches) -> BTreeMap<String, u32> {
    matches.iter().map(|m| (m.worker_id.to_string(), m.blocks)).collect()
}

#[test]
fn workers_drop_out_where_their_prefix_ends() {
    let index = KvIndex::new();
    index.apply_unnumbered("a", &stored(&[1, 2, 3, 4], Tier::Device));
    index.apply_unnumbered("b", &stored(&[1, 2], Tier::Device));
    index.apply_unnumbered("c", &stored(&[9], Tier::Device));
    let matches = index.find_matches(&seq(&[1, 2, 3, 5]));
    assert_eq!(depths(&matches), BTreeMap::from([("a".into(), 3), ("b".into(), 2)]));
    assert_eq!(matches.deepest(), 3);
    assert!(index.find_matches(&seq(&[7, 1])).is_empty(), "no match without the first block");
    assert!(index.find_matches(&[]).is_empty());
}

#[test]
fn an_evicted_parent_ends_the_match_even_if_children_remain() {
    let index = KvIndex::new();
    index.apply_unnumbered("a", &stored(&[1, 2, 3], Tier::Device));
    index.apply_unnumbered("a", &removed(&[2], Tier::Device));
    assert_eq!(depths(&index.find_matches(&seq(&[1, 2, 3]))), BTreeMap::from([("a".into(), 1)]));
}

#[test]
fn tiers_are_counted_by_the_fastest_copy() {
    let index = KvIndex::new();
    index.apply_unnumbered("a", &stored(&[1, 2, 3], Tier::Host));
    index.apply_unnumbered("a", &stored(&[1], Tier::Device));
    let matches = index.find_matches(&seq(&[1, 2, 3]));
    let a = matches.of("a").unwrap();
    assert_eq!((a.blocks, a.in_tier(Tier::Device), a.in_tier(Tier::Host)), (3, 1, 2));
    // Leaving the host tier keeps the device copy of block 1 only.
    index.apply_unnumbered("a", &removed(&[1, 2], Tier::Host));
    let a = index.find_matches(&seq(&[1, 2, 3])).of("a").unwrap();
    assert_eq!((a.blocks, a.in_tier(Tier::Device), a.in_tier(Tier::Host)), (1, 1, 0));
}

#[test]
fn numbering_detects_duplicates_gaps_and_restarts() {
    let index = KvIndex::new();
    let event = |id, hashes: &[u64]| NumberedEvent { event_id: id, event: stored(hashes, Tier::Device) };
    assert_eq!(index.apply("w", 7, &event(0, &[1])), Applied::Applied);
    assert_eq!(index.apply("w", 7, &event(0, &[1])), Applied::Duplicate);
    assert_eq!(index.apply("w", 7, &event(2, &[2])), Applied::Gap { expected: 1 });
    assert_eq!(index.cached_blocks("w"), 1, "a gapped event is not applied");
    // A dump brings the view back in sync as of its event number.
    let dump = Dump {
        next_event_id: 3,
        blocks: vec![CachedBlock { sequence_hash: SequenceHash(5), local_hash: LocalBlockHash(5), tiers: TierSet(Tier::Device.bit()) }],
    };
    index.load_dump("w", 7, &dump);
    assert_eq!(index.apply("w", 7, &event(2, &[2])), Applied::Duplicate);
    assert_eq!(index.apply("w", 7, &event(3, &[6])), Applied::Applied);
    assert_eq!(depths(&index.find_matches(&seq(&[5, 6]))), BTreeMap::from([("w".into(), 2)]));
    assert_eq!(index.find_matches(&seq(&[1])).len(), 0, "the dump replaced the old view");
    // A restarted worker (new instance) starts from nothing at event 0.
    assert_eq!(index.apply("w", 8, &event(0, &[9])), Applied::Applied);
    assert_eq!(index.cached_blocks("w"), 1);
    assert!(index.find_matches(&seq(&[5])).is_empty());
}

#[test]
fn removing_a_worker_frees_its_nodes_and_slot() {
    let index = KvIndex::new();
    index.apply_unnumbered("a", &stored(&[1, 2], Tier::Device));
    index.apply_unnumbered("b", &stored(&[1], Tier::Device));
    assert_eq!(index.stats().nodes, 2);
    assert!(index.remove_worker("a"));
    assert!(!index.remove_worker("a"));
    assert_eq!(index.stats(), IndexStats { workers: 1, nodes: 1, entries: 1, events_applied: 2 });
    index.apply_unnumbered("c", &stored(&[1, 2], Tier::Device));
    assert_eq!(depths(&index.find_matches(&seq(&[1, 2]))), BTreeMap::from([("b".into(), 1), ("c".into(), 2)]));
}

#[test]
fn a_dump_round_trips_a_view() {
    let index = KvIndex::new();
    let hashes = BlockHasher::default().hash_blocks(&(0..64).collect::<Vec<u32>>(), 16);
    index.apply_unnumbered(
        "a",
        &KvEvent::Stored {
            parent: None,
            blocks: hashes.iter().map(|h| StoredBlock { sequence_hash: h.sequence, local_hash: h.local }).collect(),
            tier: Tier::Device,
        },
    );
    let (instance, dump) = index.dump("a").unwrap();
    let copy = KvIndex::new();
    copy.load_dump("a", instance, &dump);
    let query: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
    assert_eq!(copy.find_matches(&query), index.find_matches(&query));
    assert_eq!(copy.dump("a").unwrap().1.blocks.len(), 4);
}

#[derive(Debug, Clone)]
enum Op {
    Store(usize, Vec<u64>, usize),
    Remove(usize, Vec<u64>, usize),
    Clear(usize),
    RemoveWorker(usize),
    Find(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = proptest::collection::vec(1u64..10, 0..6);
    prop_oneof![
        4 => (0usize..5, hashes.clone(), 0usize..4).prop_map(|(w, h, t)| Op::Store(w, h, t)),
        2 => (0usize..5, hashes.clone(), 0usize..4).prop_map(|(w, h, t)| Op::Remove(w, h, t)),
        1 => (0usize..5).prop_map(Op::Clear),
        1 => (0usize..5).prop_map(Op::RemoveWorker),
        4 => hashes.prop_map(Op::Find),
    ]
}

/// The obvious model: per worker, the tiers of each hash.
fn brute_force(model: &HashMap<String, HashMap<u64, TierSet>>, query: &[u64]) -> BTreeMap<String, (u32, [u32; 4])> {
    let mut out = BTreeMap::new();
    for (worker, blocks) in model {
        let mut by_tier = [0u32; 4];
        let mut depth = 0;
        for hash in query {
            let Some(best) = blocks.get(hash).and_then(|tiers| tiers.best()) else { break };
            by_tier[best as usize] += 1;
            depth += 1;
        }
        if depth > 0 {
            out.insert(worker.clone(), (depth, by_tier));
        }
    }
    out
}

proptest! {
    #[test]
    fn find_matches_equals_a_brute_force_scan(ops in proptest::collection::vec(op(), 1..80)) {
        let index = KvIndex::new();
        let mut model: HashMap<String, HashMap<u64, TierSet>> = HashMap::new();
        let name = |w: usize| format!("w{w}");
        for op in ops {
            match op {
                Op::Store(w, hashes, t) => {
                    let tier = Tier::ALL[t];
                    index.apply_unnumbered(&name(w), &stored(&hashes, tier));
                    let blocks = model.entry(name(w)).or_default();
                    for h in hashes { blocks.entry(h).or_default().insert(tier); }
                }
                Op::Remove(w, hashes, t) => {
                    let tier = Tier::ALL[t];
                    index.apply_unnumbered(&name(w), &removed(&hashes, tier));
                    if let Some(blocks) = model.get_mut(&name(w)) {
                        for h in hashes {
                            if let Some(tiers) = blocks.get_mut(&h) {
                                tiers.remove(tier);
                                if tiers.is_empty() { blocks.remove(&h); }
                            }
                        }
                    }
                }
                Op::Clear(w) => {
                    index.apply_unnumbered(&name(w), &KvEvent::Cleared);
                    if let Some(blocks) = model.get_mut(&name(w)) { blocks.clear(); }
                }
                Op::RemoveWorker(w) => {
                    index.remove_worker(&name(w));
                    model.remove(&name(w));
                }
                Op::Find(query) => {
                    let got: BTreeMap<String, (u32, [u32; 4])> = index
                        .find_matches(&seq(&query))
                        .iter()
                        .map(|m| (m.worker_id.to_string(), (m.blocks, m.by_tier)))
                        .collect();
                    prop_assert_eq!(got, brute_force(&model, &query));
                }
            }
            let entries: usize = model.values().map(|blocks| blocks.len()).sum();
            prop_assert_eq!(index.stats().entries, entries);
            let nodes: std::collections::HashSet<u64> = model.values().flat_map(|blocks| blocks.keys().copied()).collect();
            prop_assert_eq!(index.stats().nodes, nodes.len());
        }
    }
}

/// Lopsided holder sets (one side more than 8× the other) take the
/// binary-search paths of the intersection; they must agree with the brute
/// force too. All 120 workers hold block 1, six hold the chain 1..=9, and
/// the 60 odd ones hold 3..=6 without 2 (orphans): level 2 has 6 holders
/// against 120 active, level 3 has 66 holders against 6 active.
#[test]
fn lopsided_holder_sets_agree_with_a_brute_force_scan() {
    let index = KvIndex::new();
    let mut model: HashMap<String, HashMap<u64, TierSet>> = HashMap::new();
    for worker in 0..120u64 {
        let hashes: Vec<u64> = match worker {
            w if w % 20 == 0 => (1..=9).collect(),
            w if w % 2 == 1 => vec![1, 3, 4, 5, 6],
            _ => vec![1],
        };
        let tier = Tier::ALL[(worker * 7 % 4) as usize];
        index.apply_unnumbered(&format!("w{worker}"), &stored(&hashes, tier));
        let blocks = model.entry(format!("w{worker}")).or_default();
        for h in hashes {
            blocks.entry(h).or_default().insert(tier);
        }
    }
    for query in [vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10], vec![1, 3, 4], vec![1, 2, 2, 3], vec![3, 4, 5]] {
        let got: BTreeMap<String, (u32, [u32; 4])> =
            index.find_matches(&seq(&query)).iter().map(|m| (m.worker_id.to_string(), (m.blocks, m.by_tier))).collect();
        assert_eq!(got, brute_force(&model, &query), "query {query:?}");
    }
}
