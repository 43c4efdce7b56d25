//! Onboard bandwidth of the host (G2) and disk (G3) tiers on this machine:
//! a run of 2 MiB blocks (one 16-token block of an 8B-class model in f16)
//! looked up, checked against its checksums and copied into a pool-sized
//! buffer, as an onboard does. The mocker's modelled tier bandwidths
//! (`--mock-host-gbps`, `--mock-disk-gbps`) are these figures.
//!
//! `cargo bench -p turbine-engine --bench tiers`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use turbine_engine::{DiskTier, HostBlock, HostTier, block_checksum};
use turbine_kv::{BlockHashes, LocalBlockHash, SequenceHash};

const BLOCK_BYTES: usize = 2 << 20;
const BLOCKS: usize = 32;

fn blocks() -> (Vec<BlockHashes>, Vec<HostBlock>) {
    let hashes: Vec<BlockHashes> = (0..BLOCKS as u64).map(|n| BlockHashes { local: LocalBlockHash(n), sequence: SequenceHash(1 << 40 | n) }).collect();
    let blocks = hashes
        .iter()
        .enumerate()
        .map(|(n, h)| {
            let bytes: Box<[u8]> = (0..BLOCK_BYTES).map(|i| (i * 31 + n) as u8).collect();
            HostBlock {
                local: h.local,
                parent: n.checked_sub(1).map(|p| hashes[p].sequence),
                checksum: block_checksum(&bytes),
                bytes,
                tenant: turbine_kv::KvTenant::SHARED,
            }
        })
        .collect();
    (hashes, blocks)
}

fn onboard(c: &mut Criterion) {
    let (hashes, blocks) = blocks();
    let mut pool = vec![0u8; BLOCK_BYTES * BLOCKS];
    let mut group = c.benchmark_group("onboard");
    group.throughput(Throughput::Bytes((BLOCK_BYTES * BLOCKS) as u64));
    group.sample_size(20);

    let host = HostTier::new(4 * (BLOCK_BYTES * BLOCKS) as u64);
    let dir = tempfile::tempdir().expect("temp dir");
    let disk = DiskTier::open(dir.path(), 4 * (BLOCK_BYTES * BLOCKS) as u64, 7).expect("disk tier");
    for (h, block) in hashes.iter().zip(&blocks) {
        disk.write(h.sequence, block);
    }
    host.insert_run(hashes.iter().map(|h| h.sequence).zip(blocks).collect());

    let mut copy_in = |run: &[std::sync::Arc<HostBlock>]| {
        assert_eq!(run.len(), BLOCKS);
        for (slot, block) in pool.chunks_mut(BLOCK_BYTES).zip(run) {
            slot.copy_from_slice(&block.bytes);
        }
    };
    group.bench_function("host", |b| b.iter(|| copy_in(&host.lookup_run(&hashes))));
    // Warm page cache: what a recently spilled block costs.
    group.bench_function("disk", |b| b.iter(|| copy_in(&disk.read_run(&hashes))));
    group.finish();
}

criterion_group!(benches, onboard);
criterion_main!(benches);
