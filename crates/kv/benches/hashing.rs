//! Block hashing and index lookups at prompt scale.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use turbine_kv::{BlockHasher, KvEvent, KvIndex, StoredBlock, Tier};

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..32_000u32).map(|i| i.wrapping_mul(2_654_435_761) % 49_152).collect();
    let hasher = BlockHasher::default();
    let mut group = c.benchmark_group("hash");
    group.throughput(Throughput::Elements(tokens.len() as u64));
    group.bench_function("32k_tokens_block_16", |b| b.iter(|| hasher.sequence_hashes(black_box(&tokens), 16)));
    group.bench_function("32k_tokens_block_64", |b| b.iter(|| hasher.sequence_hashes(black_box(&tokens), 64)));
    group.finish();
}

fn find_matches(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..32_000u32).collect();
    let hashes = BlockHasher::default().hash_blocks(&tokens, 16);
    let index = KvIndex::new();
    // 100 workers, worker w caching the first 20·w blocks of the prompt.
    for worker in 0..100 {
        let blocks = hashes[..(20 * worker).min(hashes.len())].iter().map(|h| StoredBlock { sequence_hash: h.sequence, local_hash: h.local }).collect();
        index.apply_unnumbered(&format!("worker-{worker}"), &KvEvent::Stored { parent: None, blocks, tier: Tier::Device });
    }
    let query: Vec<_> = hashes.iter().map(|h| h.sequence).collect();
    c.bench_function("find_matches/2000_blocks_100_workers", |b| b.iter(|| index.find_matches(black_box(&query))));
}

criterion_group!(benches, hashing, find_matches);
criterion_main!(benches);
