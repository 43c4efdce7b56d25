//! The host (G2) and disk (G3) tiers under a real engine loop: blocks
//! evicted from the pool come back from host memory or from disk, the
//! output equals recomputing them, a corrupt block is recomputed, never
//! served, and the disk tier outlives its engine.
//!
//! The executor keeps its KV in a real pool ([`KvMemory`]) and its every
//! token depends on what the pool holds for all earlier positions: each
//! position stores a hash chained over the previous position's stored value,
//! and the sampled token is read from the last one. An onboarded block with
//! wrong bytes changes every later token.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use turbine_engine::{
    Batch, DiskTier, EngineHandle, EngineOutput, Executor, ExecutorError, FetchPolicy, GenerateRequest, HostBlock, HostTier, KvBuffer, KvLayout, KvMemory,
    KvTiers, RemoteGetError, RemoteStore, RemoteTier, Sampled, SchedulerConfig, StopConditions, Tier,
};
use turbine_kv::{BlockHasher, BlockHashes, KvEvent, SequenceHash};
use turbine_testkit::wait_until;

const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 24;
const SLOT: usize = 8;

/// Computes each position's value from the previous position's value in
/// the pool, and samples from the last one.
struct ChainExecutor {
    buffer: Arc<KvBuffer>,
}

impl ChainExecutor {
    fn new() -> (Self, KvMemory) {
        let block_bytes = BLOCK_SIZE * SLOT;
        let buffer = Arc::new(KvBuffer::zeroed(NUM_BLOCKS * block_bytes));
        let layout = KvLayout::opaque(block_bytes, "chain");
        let memory = KvMemory::new(buffer.clone(), layout, NUM_BLOCKS);
        (Self { buffer }, memory)
    }

    fn slot(&self, block_table: &[u32], position: usize) -> *mut u64 {
        let block = block_table[position / BLOCK_SIZE] as usize;
        let offset = block * BLOCK_SIZE * SLOT + position % BLOCK_SIZE * SLOT;
        assert!(offset + SLOT <= self.buffer.len());
        // SAFETY: in bounds (checked); the engine thread is the only writer
        // and writes only the positions it computes.
        unsafe { self.buffer.as_ptr().add(offset).cast::<u64>() }
    }
}

impl Executor for ChainExecutor {
    fn execute(&mut self, batch: &Batch<'_>) -> Result<Vec<Option<Sampled>>, ExecutorError> {
        let mut sampled = Vec::new();
        for item in &batch.items {
            let mut last = 0;
            for position in item.start..item.start + item.len {
                let previous = if position == 0 { 0x9e37_79b9 } else { unsafe { self.slot(item.block_table, position - 1).read_unaligned() } };
                last = previous.rotate_left(7) ^ u64::from(item.tokens[position]).wrapping_mul(0x2545_f491_4f6c_dd1d);
                unsafe { self.slot(item.block_table, position).write_unaligned(last) };
            }
            sampled.push(item.sample.then(|| Sampled { token: 10 + (last % 1000) as u32, logprobs: None }));
        }
        Ok(sampled)
    }

    fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), ExecutorError> {
        let block_bytes = BLOCK_SIZE * SLOT;
        if bytes.len() != block_bytes {
            return Err(ExecutorError::BlockSize { expected: block_bytes, got: bytes.len() });
        }
        // SAFETY: a free block the engine handed over for this write.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.buffer.as_ptr().add(block as usize * block_bytes), block_bytes) };
        Ok(())
    }
}

fn config() -> SchedulerConfig {
    SchedulerConfig { block_size: BLOCK_SIZE, num_blocks: NUM_BLOCKS, max_model_len: 64, ..SchedulerConfig::default() }
}

fn engine(host: Option<HostTier>) -> EngineHandle {
    let (executor, memory) = ChainExecutor::new();
    EngineHandle::spawn_with_tiers(
        config(),
        vec![],
        Box::new(executor),
        KvTiers { host, memory: Some(memory), modelled: None, remote: None, fetch: FetchPolicy::Always },
    )
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..41).map(|i| 100 + (i * 7 + seed * 13) % 500).collect()
}

/// The tokens and the prompt tokens reported cached.
async fn generate(engine: &EngineHandle, prompt: &[u32]) -> (Vec<u32>, u32) {
    let request = GenerateRequest {
        request_id: "tiers".into(),
        prompt: prompt.to_vec(),
        stop: StopConditions { max_tokens: 8, ignore_eos: true, ..Default::default() },
        ..Default::default()
    };
    let mut outputs = engine.generate(request).unwrap();
    let mut tokens = Vec::new();
    while let Some(output) = tokio::time::timeout(Duration::from_secs(30), outputs.recv()).await.expect("an output within 30 s") {
        match output {
            EngineOutput::Token(token, _) => tokens.push(token),
            EngineOutput::Finished { usage, .. } => return (tokens, usage.cached_prompt_tokens),
            other => panic!("{other:?}"),
        }
    }
    panic!("the stream ended without finishing");
}

/// Fills the pool with other prompts, so that `prompt(0)`'s blocks leave it.
async fn evict_from_the_pool(engine: &EngineHandle) {
    for seed in 1..4 {
        generate(engine, &prompt(seed)).await;
    }
    let first = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
    assert_eq!(engine.cached_prefix(first).await.unwrap(), 0, "the first prompt left the pool");
}

async fn wait_for_copies(engine: &EngineHandle, host: &HostTier, blocks: u64) {
    wait_until("copies to the host tier", Duration::from_secs(10), async || {
        host.stats().offloaded_blocks.load(Ordering::Relaxed) >= blocks && engine.load().blocks_used == 0
    })
    .await;
}

#[tokio::test]
async fn blocks_evicted_from_the_pool_come_back_from_host_memory_with_the_same_output() {
    let expected = computed_output().await;

    let host = HostTier::new(1 << 20);
    let engine = engine(Some(host.clone()));
    let mut events = engine.subscribe_events();
    let (first, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(first, expected);
    assert_eq!(cached, 0);
    // 41 prompt tokens and 7 generated ones before the last: 12 full blocks.
    wait_for_copies(&engine, &host, 10).await;
    evict_from_the_pool(&engine).await;

    let (again, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(again, expected, "onboarded blocks give the computed output");
    assert_eq!(cached, 40, "the prompt's 10 full blocks are hits");
    assert!(engine.stats().onboarded_prompt_tokens.load(Ordering::Relaxed) >= 40);
    assert!(host.stats().onboarded_blocks.load(Ordering::Relaxed) >= 10);
    assert_eq!(host.stats().corrupt_blocks.load(Ordering::Relaxed), 0);
    // What the copies into the pool took is measured, for routers to
    // weigh a host hit against computing it.
    let estimates = engine.fetch_estimates().expect("an engine with a host tier measures it");
    assert!(estimates.host.block_seconds.is_some_and(|seconds| seconds > 0.0), "{estimates:?}");
    assert!(estimates.token_seconds.is_some(), "{estimates:?}");

    let mut host_stored = 0;
    while let Ok(event) = events.try_recv() {
        if let KvEvent::Stored { blocks, tier: Tier::Host, .. } = event.event {
            host_stored += blocks.len();
        }
    }
    assert!(host_stored >= 10, "host-tier blocks are announced ({host_stored})");
    let dump = engine.dump().await.unwrap();
    assert!(dump.blocks.iter().filter(|block| block.tiers.contains(Tier::Host)).count() >= 10, "a dump lists the host tier");
    engine.shutdown();
}

/// An engine whose first prompt was computed, copied to a host tier, then
/// pushed out of the pool.
async fn first_prompt_in_host() -> (EngineHandle, HostTier) {
    let host = HostTier::new(1 << 20);
    let engine = engine(Some(host.clone()));
    generate(&engine, &prompt(0)).await;
    wait_for_copies(&engine, &host, 10).await;
    evict_from_the_pool(&engine).await;
    (engine, host)
}

/// Onboarding happens as a request reaches the front of the queue, not
/// when it arrives: a request queued behind others that fill the pool still
/// gets its prefix back from the host tier.
#[tokio::test]
async fn a_queued_request_gets_its_prefix_back_when_it_is_admitted() {
    let expected = computed_output().await;
    let (engine, host) = first_prompt_in_host().await;

    // Three prompts that need the whole pool between them, then the first
    // one again, all queued at once.
    let prompts = [prompt(4), prompt(5), prompt(6), prompt(0)];
    let (_, _, _, (again, cached)) =
        tokio::join!(generate(&engine, &prompts[0]), generate(&engine, &prompts[1]), generate(&engine, &prompts[2]), generate(&engine, &prompts[3]));
    assert_eq!(again, expected);
    assert_eq!(cached, 40, "the prompt's 10 full blocks came back from the host tier at admission");
    assert!(host.stats().onboarded_blocks.load(Ordering::Relaxed) >= 10, "they were onboarded, not found in the pool");
    engine.shutdown();
}

#[tokio::test]
async fn a_corrupt_host_block_is_recomputed_never_served() {
    let expected = computed_output().await;
    let (engine, host) = first_prompt_in_host().await;
    let hashes = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
    assert!(host.corrupt_for_test(hashes[3]));

    let (again, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(again, expected, "the corrupt block was computed again");
    assert_eq!(cached, 12, "only the three blocks before the corrupt one were hits");
    assert_eq!(host.stats().corrupt_blocks.load(Ordering::Relaxed), 1);
    engine.shutdown();
}

#[tokio::test]
async fn a_small_host_tier_stays_within_its_bytes() {
    let block_bytes = (BLOCK_SIZE * SLOT) as u64;
    let host = HostTier::new(6 * block_bytes);
    let engine = engine(Some(host.clone()));
    for seed in 0..4 {
        generate(&engine, &prompt(seed)).await;
    }
    wait_until("copies to finish", Duration::from_secs(10), async || engine.load().blocks_used == 0).await;
    assert!(host.used_bytes() <= 6 * block_bytes, "{} bytes held", host.used_bytes());
    assert!(host.stats().evicted_blocks.load(Ordering::Relaxed) > 0);
    engine.shutdown();
}

const BLOCK_BYTES: u64 = (BLOCK_SIZE * SLOT) as u64;

/// A host tier of two blocks over a disk tier in `dir`: nearly everything
/// offloaded ends up on disk.
fn host_over_disk(dir: &std::path::Path) -> HostTier {
    let disk = DiskTier::open(dir, 1 << 20, 7).unwrap();
    HostTier::with_disk(2 * BLOCK_BYTES, disk)
}

async fn wait_for_disk(host: &HostTier, blocks: u64) {
    let disk = host.disk().unwrap().clone();
    wait_until("writes to the disk tier", Duration::from_secs(10), async || disk.stats().offloaded_blocks.load(Ordering::Relaxed) >= blocks).await;
}

/// The first prompt's tokens computed by an engine without tiers.
async fn computed_output() -> Vec<u32> {
    let reference = engine(None);
    let (expected, _) = generate(&reference, &prompt(0)).await;
    reference.shutdown();
    expected
}

/// An engine whose first prompt was computed, then pushed out of the pool
/// and down to disk.
async fn first_prompt_on_disk(dir: &std::path::Path) -> (EngineHandle, HostTier) {
    let host = host_over_disk(dir);
    let engine = engine(Some(host.clone()));
    generate(&engine, &prompt(0)).await;
    wait_for_copies(&engine, &host, 10).await;
    evict_from_the_pool(&engine).await;
    wait_for_disk(&host, 8).await;
    (engine, host)
}

#[tokio::test]
async fn blocks_evicted_down_to_disk_come_back_with_the_same_output() {
    let expected = computed_output().await;
    let dir = tempfile::tempdir().unwrap();
    let (engine, host) = first_prompt_on_disk(dir.path()).await;

    let (again, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(again, expected, "blocks read back from disk give the computed output");
    assert_eq!(cached, 40, "the prompt's 10 full blocks are hits");
    let disk = host.disk().unwrap();
    assert!(disk.stats().onboarded_blocks.load(Ordering::Relaxed) >= 8, "most blocks came from disk");
    assert_eq!(disk.stats().corrupt_blocks.load(Ordering::Relaxed), 0);
    let dump = engine.dump().await.unwrap();
    assert!(dump.blocks.iter().any(|block| block.tiers.contains(Tier::Disk)), "a dump lists the disk tier");
    engine.shutdown();
}

#[tokio::test]
async fn a_corrupt_disk_block_is_recomputed_never_served() {
    let expected = computed_output().await;
    let dir = tempfile::tempdir().unwrap();
    let (engine, host) = first_prompt_on_disk(dir.path()).await;
    let hashes = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
    let disk = host.disk().unwrap().clone();
    let path = disk.path_for_test(hashes[2]);
    let mut bytes = std::fs::read(&path).expect("the third block is on disk");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    let corrupted = bytes.clone();
    std::fs::write(&path, bytes).unwrap();

    let (again, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(again, expected, "the corrupt block was computed again");
    assert_eq!(cached, 8, "only the two blocks before the corrupt one were hits");
    assert_eq!(disk.stats().corrupt_blocks.load(Ordering::Relaxed), 1);
    // Deleted; the recomputed block may have been written down again since.
    assert!(std::fs::read(&path).map_or(true, |now| now != corrupted), "the corrupt file was deleted");
    engine.shutdown();
}

#[tokio::test]
async fn the_disk_tier_outlives_its_engine() {
    let expected = computed_output().await;
    let dir = tempfile::tempdir().unwrap();
    {
        let (engine, _host) = first_prompt_on_disk(dir.path()).await;
        engine.shutdown();
    }
    // The threads of the first engine let go of the directory.
    let mut reopened = None;
    wait_until("the disk tier's directory is free", Duration::from_secs(10), async || {
        reopened = DiskTier::open(dir.path(), 1 << 20, 7).ok();
        reopened.is_some()
    })
    .await;
    let disk = reopened.unwrap();
    assert!(disk.blocks() >= 8, "blocks kept on disk: {}", disk.blocks());
    let host = HostTier::with_disk(2 * BLOCK_BYTES, disk.clone());
    let engine = engine(Some(host));
    let (again, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(again, expected);
    assert!(cached >= 8, "blocks written by the first engine were hits ({cached} cached tokens)");
    assert!(disk.stats().onboarded_blocks.load(Ordering::Relaxed) >= 2);
    engine.shutdown();
}

/// A chain leaves host memory head first: its head is on disk while its
/// tail is still in memory, and the whole prefix comes back (the onboard
/// once read the disk's part only and computed the rest).
#[tokio::test]
async fn a_prefix_whose_head_is_on_disk_and_tail_in_host_memory_comes_back_whole() {
    let expected = computed_output().await;
    let hashes = BlockHasher::default().hash_blocks(&prompt(0), BLOCK_SIZE);
    let blocks = {
        let host = HostTier::new(1 << 20);
        let engine = engine(Some(host.clone()));
        generate(&engine, &prompt(0)).await;
        wait_for_copies(&engine, &host, 10).await;
        engine.shutdown();
        host.lookup_run(&hashes[..10])
    };
    assert_eq!(blocks.len(), 10);
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskTier::open(dir.path(), 1 << 20, 7).unwrap();
    for (hashes, block) in hashes[..4].iter().zip(&blocks) {
        disk.write(hashes.sequence, block);
    }
    let host = HostTier::with_disk(1 << 20, disk.clone());
    host.insert_shared_run(hashes[4..10].iter().zip(&blocks[4..]).map(|(hashes, block)| (hashes.sequence, block.clone())).collect());
    assert!(!host.contains(hashes[0].sequence) && disk.contains(hashes[0].sequence) && !disk.contains(hashes[4].sequence));

    let engine = engine(Some(host.clone()));
    let (output, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(output, expected);
    assert_eq!(cached, 40, "4 blocks from disk, then 6 from host memory");
    assert_eq!(disk.stats().onboarded_blocks.load(Ordering::Relaxed), 4);
    assert_eq!(host.stats().onboarded_blocks.load(Ordering::Relaxed), 6);
    engine.shutdown();
}

/// The mocker holds no KV bytes: its tiers keep stamps that count as the
/// modelled block size, and its onboards take modelled time.
#[tokio::test]
async fn the_mocker_models_its_tiers_without_kv_bytes() {
    use turbine_engine::ModelledTransfer;
    use turbine_engine::mocker::{MockExecutor, MockTiming};

    const MODELLED: u64 = 1 << 20;
    let modelled = ModelledTransfer { block_bytes: MODELLED, host_bytes_per_sec: 1e12, disk_bytes_per_sec: 1e12, remote_bytes_per_sec: 1e12 };
    let dir = tempfile::tempdir().unwrap();
    let disk = DiskTier::open_modelled(dir.path(), 1 << 30, 7, MODELLED).unwrap();
    let host = HostTier::modelled(3 * MODELLED, MODELLED, Some(disk.clone()));
    let executor = MockExecutor::new(MockTiming { speedup: 1e6 }, vec![5, 6, 7], None);
    let engine = EngineHandle::spawn_with_tiers(
        config(),
        vec![],
        Box::new(executor),
        KvTiers { host: Some(host.clone()), memory: None, modelled: Some(modelled), remote: None, fetch: FetchPolicy::Always },
    );

    let (first, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(cached, 0);
    wait_for_copies(&engine, &host, 10).await;
    evict_from_the_pool(&engine).await;
    let hashes = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
    wait_until("the first prompt's blocks in the host or disk tier", Duration::from_secs(10), async || {
        hashes[..10].iter().all(|&hash| host.contains(hash) || disk.contains(hash))
    })
    .await;
    assert!(
        host.blocks() <= 3 && host.used_bytes() <= 3 * MODELLED,
        "the host tier counts modelled bytes: {} blocks, {} bytes",
        host.blocks(),
        host.used_bytes()
    );
    assert!(disk.used_bytes() >= 7 * MODELLED, "so does the disk tier: {} bytes", disk.used_bytes());

    let (again, cached) = generate(&engine, &prompt(0)).await;
    assert_eq!(again, first);
    assert_eq!(cached, 40, "the prompt's 10 full blocks came back from the modelled tiers");
    assert!(disk.stats().onboarded_blocks.load(Ordering::Relaxed) >= 7);
    assert_eq!(disk.stats().corrupt_blocks.load(Ordering::Relaxed) + host.stats().corrupt_blocks.load(Ordering::Relaxed), 0);
    engine.shutdown();
}

#[test]
fn modelled_onboard_time_is_bytes_over_each_tiers_bandwidth() {
    let modelled = turbine_engine::ModelledTransfer { block_bytes: 2_000_000, host_bytes_per_sec: 20e9, disk_bytes_per_sec: 2e9, remote_bytes_per_sec: 1e9 };
    let ms = |host, disk| modelled.onboard_time(host, disk).as_secs_f64() * 1e3;
    for (host, disk, expected) in [(10, 0, 1.0), (0, 10, 10.0), (10, 10, 11.0)] {
        assert!((ms(host, disk) - expected).abs() < 1e-6, "{host} host and {disk} disk blocks: {} ms", ms(host, disk));
    }
}

/// A shared store in this process: what the kv-store keeps for many
/// engines, behind the engine's [`RemoteStore`] interface (the kv-store
/// service itself is tested against workers in `services/worker`).
#[derive(Default)]
struct SharedStore {
    blocks: parking_lot::Mutex<std::collections::HashMap<SequenceHash, Arc<HostBlock>>>,
    /// While set, every get fails (the store is down).
    down: std::sync::atomic::AtomicBool,
}

impl RemoteStore for SharedStore {
    fn put_run(&self, blocks: &[(SequenceHash, Arc<HostBlock>)]) -> usize {
        self.blocks.lock().extend(blocks.iter().cloned());
        blocks.len()
    }

    fn get_run(&self, hashes: &[BlockHashes]) -> Result<Vec<Arc<HostBlock>>, RemoteGetError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(RemoteGetError::Failed("down".into()));
        }
        let blocks = self.blocks.lock();
        Ok(hashes.iter().map_while(|h| blocks.get(&h.sequence).filter(|b| b.local == h.local && b.is_intact()).cloned()).collect())
    }
}

fn engine_over(store: &Arc<SharedStore>) -> (EngineHandle, RemoteTier) {
    let (executor, memory) = ChainExecutor::new();
    let remote = RemoteTier::new(store.clone(), 2);
    let tiers = KvTiers { host: Some(HostTier::new(1 << 20)), memory: Some(memory), modelled: None, remote: Some(remote.clone()), fetch: FetchPolicy::Always };
    (EngineHandle::spawn_with_tiers(config(), vec![], Box::new(executor), tiers), remote)
}

#[tokio::test]
async fn a_prefix_computed_by_one_engine_is_onboarded_by_another_from_the_shared_tier() {
    let expected = computed_output().await;
    let store = Arc::new(SharedStore::default());
    let (first, first_remote) = engine_over(&store);
    assert_eq!(generate(&first, &prompt(0)).await, (expected.clone(), 0));
    wait_until("write-through to the shared tier", Duration::from_secs(10), async || first_remote.stats().offloaded_blocks.load(Ordering::Relaxed) >= 10).await;
    first.shutdown();

    // Another engine, its own pool and host tier empty.
    let (second, remote) = engine_over(&store);
    let (again, cached) = generate(&second, &prompt(0)).await;
    assert_eq!(again, expected, "blocks from the shared tier give the computed output");
    assert_eq!(cached, 40, "the prompt's 10 full blocks are hits");
    assert_eq!(remote.stats().onboarded_blocks.load(Ordering::Relaxed), 10);
    assert_eq!(remote.stats().read_bytes.load(Ordering::Relaxed), 10 * (BLOCK_SIZE * SLOT) as u64, "the fetched bytes are counted");

    // The store down: a third engine computes the prompt, same output.
    store.down.store(true, Ordering::Relaxed);
    let (third, remote) = engine_over(&store);
    assert_eq!(generate(&third, &prompt(0)).await, (expected, 0), "a failed fetch is a miss, never an error");
    assert_eq!(remote.stats().onboarded_blocks.load(Ordering::Relaxed), 0);
    assert_eq!(remote.failures(), 1, "the failed fetch is counted");
    second.shutdown();
    third.shutdown();
}

/// Fetch or recompute: once the engine has measured (by a probe of a few
/// blocks) that its disk is slower than computing (a modelled disk of 20 MB/s for 1 MiB blocks:
/// 50 ms a block, against a mocker computing in microseconds), a prefix on
/// disk is computed instead; `always` reads it anyway.
#[tokio::test]
async fn a_prefix_on_a_disk_slower_than_compute_is_computed() {
    use turbine_engine::ModelledTransfer;
    use turbine_engine::mocker::{MockExecutor, MockTiming};

    const MODELLED: u64 = 1 << 20;
    for policy in [FetchPolicy::Auto, FetchPolicy::Always] {
        let modelled = ModelledTransfer { block_bytes: MODELLED, host_bytes_per_sec: 1e12, disk_bytes_per_sec: 20e6, remote_bytes_per_sec: 1e12 };
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskTier::open_modelled(dir.path(), 1 << 30, 7, MODELLED).unwrap();
        let host = HostTier::modelled(MODELLED, MODELLED, Some(disk.clone()));
        let executor = MockExecutor::new(MockTiming { speedup: 1e6 }, vec![5, 6, 7], None);
        let tiers = KvTiers { host: Some(host.clone()), memory: None, modelled: Some(modelled), remote: None, fetch: policy };
        let engine = EngineHandle::spawn_with_tiers(config(), vec![], Box::new(executor), tiers);
        let hashes = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
        let (first, _) = generate(&engine, &prompt(0)).await;
        let onboarded = || disk.stats().onboarded_blocks.load(Ordering::Relaxed);
        let mut cached_tokens = Vec::new();
        for _ in 0..2 {
            wait_for_copies(&engine, &host, 10).await;
            evict_from_the_pool(&engine).await;
            wait_until("the prompt's blocks on disk", Duration::from_secs(10), async || hashes[1..10].iter().all(|&hash| disk.contains(hash))).await;
            let before = onboarded();
            let (again, cached) = generate(&engine, &prompt(0)).await;
            assert_eq!(again, first, "{policy:?}: the same output whichever way the prefix came");
            cached_tokens.push((cached, onboarded() - before));
        }
        let estimates = engine.fetch_estimates().expect("an engine with a disk tier decides");
        match policy {
            FetchPolicy::Auto => {
                // Never measured: probed, a few blocks read.
                assert_eq!(cached_tokens[0].1, 2, "the disk is measured by a probe of 2 blocks: {cached_tokens:?}");
                assert_eq!(cached_tokens[1].1, 0, "measured slower than compute: computed ({cached_tokens:?}, {estimates:?})");
                assert!(estimates.disk.decisions.skip >= 1, "{estimates:?}");
                let per_block = estimates.disk.block_seconds.unwrap() + estimates.disk.fixed_seconds.unwrap() / 8.0;
                assert!(per_block > 0.02, "the disk's modelled 50 ms a block was measured: {estimates:?}");
            }
            _ => {
                assert!(cached_tokens[0].1 >= 8 && cached_tokens[1].1 >= 8, "always: read every time ({cached_tokens:?})");
                assert_eq!(estimates.disk.decisions.skip, 0, "{estimates:?}");
            }
        }
        engine.shutdown();
    }
}

/// `--kv-store-offload on-evict`: the shared tier gets only what the host
/// tier (the lowest local one here) evicts, and another engine reads those
/// back; `off`: it gets nothing.
#[tokio::test]
async fn on_evict_the_shared_tier_gets_what_the_host_tier_evicts_and_off_nothing() {
    use turbine_engine::RemoteOffload;

    let expected = computed_output().await;
    let hashes = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
    for offload in [RemoteOffload::OnEvict, RemoteOffload::Off] {
        let store = Arc::new(SharedStore::default());
        let (executor, memory) = ChainExecutor::new();
        let remote = RemoteTier::new(store.clone(), 2).with_offload(offload);
        // Room for 3 of the prompt's 10 blocks.
        let host = HostTier::new(3 * BLOCK_BYTES);
        let tiers = KvTiers { host: Some(host.clone()), memory: Some(memory), modelled: None, remote: Some(remote.clone()), fetch: FetchPolicy::Always };
        let engine = EngineHandle::spawn_with_tiers(config(), vec![], Box::new(executor), tiers);
        assert_eq!(generate(&engine, &prompt(0)).await, (expected.clone(), 0));
        wait_for_copies(&engine, &host, 10).await;
        let stored = || store.blocks.lock().len();
        match offload {
            RemoteOffload::OnEvict => {
                wait_until("the host tier's evictions put to the shared tier", Duration::from_secs(10), async || stored() >= 7).await;
                let held: Vec<_> = hashes[..10].iter().filter(|&&hash| host.contains(hash)).collect();
                assert!(!held.is_empty() && held.iter().all(|hash| !store.blocks.lock().contains_key(hash)), "blocks the host tier still holds are not put");
                assert_eq!(remote.stats().offloaded_blocks.load(Ordering::Relaxed), stored() as u64);
                // Another engine, its tiers empty, reads the evicted prefix back.
                let (second, _) = engine_over(&store);
                let (again, cached) = generate(&second, &prompt(0)).await;
                assert_eq!(again, expected, "blocks put on eviction give the computed output");
                assert!(cached >= 20, "the evicted leading blocks are hits ({cached} cached tokens)");
                second.shutdown();
            }
            _ => {
                assert_eq!(stored(), 0, "off: nothing is put");
                assert_eq!(remote.stats().offloaded_blocks.load(Ordering::Relaxed), 0);
            }
        }
        engine.shutdown();
    }
}

/// With a disk tier, on-eviction puts are what the disk evicts, read back
/// from its files before they are deleted.
#[tokio::test]
async fn on_evict_with_a_disk_the_shared_tier_gets_what_the_disk_evicts() {
    use turbine_engine::RemoteOffload;
    use turbine_engine::tiers::block_file::HEADER_BYTES;

    let expected = computed_output().await;
    let store = Arc::new(SharedStore::default());
    let (executor, memory) = ChainExecutor::new();
    let remote = RemoteTier::new(store.clone(), 2).with_offload(RemoteOffload::OnEvict);
    let dir = tempfile::tempdir().unwrap();
    // Room for 3 block files on disk, 2 blocks in host memory.
    let disk = DiskTier::open(dir.path(), 3 * (BLOCK_BYTES + HEADER_BYTES as u64), 7).unwrap();
    let host = HostTier::with_disk(2 * BLOCK_BYTES, disk.clone());
    let tiers = KvTiers { host: Some(host.clone()), memory: Some(memory), modelled: None, remote: Some(remote.clone()), fetch: FetchPolicy::Always };
    let engine = EngineHandle::spawn_with_tiers(config(), vec![], Box::new(executor), tiers);
    assert_eq!(generate(&engine, &prompt(0)).await, (expected.clone(), 0));
    wait_for_copies(&engine, &host, 10).await;
    wait_until("the disk's evictions put to the shared tier", Duration::from_secs(10), async || store.blocks.lock().len() >= 3).await;
    assert!(disk.stats().evicted_blocks.load(Ordering::Relaxed) >= 3);
    assert!(store.blocks.lock().values().all(|block| block.is_intact()), "what the store got was read back whole");
    let hashes = BlockHasher::default().sequence_hashes(&prompt(0), BLOCK_SIZE);
    assert!(hashes[..10].iter().filter(|&&hash| host.contains(hash)).all(|hash| !store.blocks.lock().contains_key(hash)), "the host tier's blocks are not put");
    engine.shutdown();
}
