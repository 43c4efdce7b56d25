//! `turbine bench kv-store`: how fast a kv-store takes and serves a
//! prompt's KV blocks, over the gRPC stream and over UCX, side by side with
//! `ucx_perftest` at the same sizes in the same run; and how much memory
//! the store takes under a write storm many times its capacity.
//!
//! The store is a second process (`turbine kv-store`, as deployed) on
//! loopback. Each batch is `--blocks` blocks of `--block-bytes` random
//! bytes, one prefix's chain:
//! - Put (gRPC): the batch put as `KvStoreClient::put` streams it (the
//!   store checks every checksum and copies the blocks into its arena);
//!   the store's copy is deleted between batches, untimed.
//! - Put (UCX): the batch staged in this process's registered memory
//!   (256 MiB at a time) and read by the store (`PutFrom`), which checks
//!   and stores it as a Put.
//! - Get (gRPC): the batch read back as the `Get` stream, every block
//!   checked on arrival, as a worker's tier reads it without UCX.
//! - Get (UCX): `Lease`, then the leased segments read out of the store's
//!   registered memory by this process's UCX thread into one reused
//!   buffer, then `Release`; every block's checksum is checked on the
//!   first batch (`ucx_perftest` checks nothing). And the same as a
//!   worker's tier does it (`UcxLink::get`: fresh buffers, every block
//!   checked and copied out into its own allocation).
//! - Storm: blocks worth `--storm-factor` times the store's capacity are
//!   put, and the store's resident memory (`VmRSS`, shared memory
//!   included) is sampled after every put.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use turbine_api::kv_store::{Fingerprint, KvStoreClient};
use turbine_engine::{HostBlock, block_checksum};
use turbine_kv::{LocalBlockHash, SequenceHash};

use crate::transfer::{median, perftest};

/// Flags of `turbine bench kv-store`.
#[derive(Debug, Clone, clap::Args)]
pub struct KvStoreBenchArgs {
    /// Bytes per KV block (default: one 16-token block of SmolLM2-135M).
    #[arg(long, default_value_t = 368_640)]
    pub block_bytes: usize,
    /// Blocks per batch (one prompt's blocks).
    #[arg(long, default_value_t = 1000)]
    pub blocks: usize,
    /// Batches measured per path, after one warm-up batch.
    #[arg(long, default_value_t = 10)]
    pub batches: usize,
    /// The store's memory tier in MiB (it must hold a batch).
    #[arg(long, default_value_t = 1024)]
    pub memory_mib: u64,
    /// The write storm puts this many times the store's capacity.
    #[arg(long, default_value_t = 10)]
    pub storm_factor: u64,
    /// Iterations of the `ucx_perftest` baseline at the block size.
    #[arg(long, default_value_t = 2000)]
    pub perftest_iterations: usize,
    /// Skip the `ucx_perftest` baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One path's bandwidth.
#[derive(Debug, Serialize)]
pub struct PathReport {
    /// What was measured.
    pub path: String,
    /// Median batch bandwidth, bytes per second.
    pub median_bytes_per_sec: f64,
    /// Best batch bandwidth, bytes per second.
    pub best_bytes_per_sec: f64,
    /// Median over `ucx_perftest -t ucp_get` reading the batch as one
    /// message (None without the baseline).
    pub batch_ratio: Option<f64>,
    /// UCX: median milliseconds of the lease, the read and the release.
    pub phases_ms: Option<[f64; 3]>,
    /// The data path alone, with the baseline: `ucx_perftest` reading the
    /// batch as one message run just before each batch, and the median of
    /// the per-batch ratios (the VM's bandwidth drifts between runs
    /// minutes apart; pairs cancel most of it).
    pub paired: Option<PairedBaseline>,
}

/// Each batch next to a `ucx_perftest` run just before it.
#[derive(Debug, Serialize)]
pub struct PairedBaseline {
    /// `ucx_perftest` bandwidth before each batch, bytes per second.
    pub perftest_bytes_per_sec: Vec<f64>,
    /// The batch's bandwidth over the perftest's before it, per batch.
    pub ratios: Vec<f64>,
    /// Their median.
    pub median_ratio: f64,
}

/// The write storm.
#[derive(Debug, Serialize)]
pub struct StormReport {
    /// The store's memory capacity, bytes.
    pub capacity_bytes: u64,
    /// Bytes put.
    pub written_bytes: u64,
    /// The store's largest resident size sampled, bytes.
    pub peak_rss_bytes: u64,
    /// Its resident size before the storm, bytes.
    pub rss_before_bytes: u64,
    /// Peak resident size over capacity.
    pub peak_over_capacity: f64,
    /// At the peak: anonymous, file-backed (the binary's pages) and shared
    /// (the arena, with UCX) resident bytes.
    pub peak_anon_file_shmem_bytes: [u64; 3],
}

/// The report.
#[derive(Debug, Serialize)]
pub struct KvStoreReport {
    /// Bytes per block.
    pub block_bytes: usize,
    /// Blocks per batch.
    pub blocks: usize,
    /// Batches measured per path.
    pub batches: usize,
    /// `UCX_TLS` in effect ("" when unset: UCX's choice).
    pub ucx_tls: String,
    /// `ucx_perftest -t ucp_get` at the block size, bytes per second.
    pub perftest_block_bytes_per_sec: Option<f64>,
    /// `ucx_perftest -t ucp_get` reading a whole batch as one message.
    pub perftest_batch_bytes_per_sec: Option<f64>,
    /// Per path.
    pub paths: Vec<PathReport>,
    /// The write storm.
    pub storm: StormReport,
}

/// A chain of `count` blocks of random bytes, hashed from `first`.
fn chain(first: u64, count: usize, block_bytes: usize) -> Vec<(SequenceHash, Arc<HostBlock>)> {
    (0..count as u64)
        .map(|n| {
            let mut bytes = vec![0u8; block_bytes];
            let mut state = (first + n).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for chunk in bytes.chunks_mut(8) {
                // xorshift64: cheap, incompressible bytes.
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
            }
            let parent = n.checked_sub(1).map(|p| SequenceHash(first + p));
            let bytes = bytes.into_boxed_slice();
            (
                SequenceHash(first + n),
                Arc::new(HostBlock { local: LocalBlockHash(first + n), parent, checksum: block_checksum(&bytes), bytes, tenant: turbine_kv::KvTenant::SHARED }),
            )
        })
        .collect()
}

/// A process's resident bytes: `VmRSS` (anonymous, file and shared
/// memory), then those three parts.
fn rss_bytes(pid: u32) -> anyhow::Result<[u64; 4]> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|value| value.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {name} in /proc/<pid>/status"))?;
        Ok(kib << 10)
    };
    Ok([field("VmRSS:")?, field("RssAnon:")?, field("RssFile:")?, field("RssShmem:")?])
}

/// Runs the benchmark.
pub async fn run(args: &KvStoreBenchArgs) -> anyhow::Result<KvStoreReport> {
    anyhow::ensure!(args.blocks > 0 && args.block_bytes > 0 && args.batches > 0, "--blocks, --block-bytes and --batches must be positive");
    let batch_bytes = args.blocks * args.block_bytes;
    anyhow::ensure!(
        (batch_bytes as u64) < (args.memory_mib << 20) / 2,
        "--memory-mib {} cannot hold two batches of {} MiB",
        args.memory_mib,
        batch_bytes >> 20
    );
    let port = turbine_harness::free_port();
    let mut store = tokio::process::Command::new(std::env::current_exe()?)
        .args(["kv-store", "--grpc-addr", &format!("127.0.0.1:{port}"), "--admin-addr", "127.0.0.1:0"])
        .args(["--memory-mib", &args.memory_mib.to_string(), "--max-blocks-per-call", &args.blocks.max(8192).to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting the kv-store")?;
    let pid = store.id().context("the kv-store exited at once")?;
    let client = KvStoreClient::connect(&format!("http://127.0.0.1:{port}"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.stats().await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the kv-store did not answer within 30 s");
        anyhow::ensure!(store.try_wait()?.is_none(), "the kv-store exited while starting");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let fingerprint = Fingerprint::declaring(0x656e_6368, u32::try_from(args.block_bytes).context("--block-bytes: at most 4 GiB")?);
    let batch = chain(1 << 32, args.blocks, args.block_bytes);
    let hashes: Vec<SequenceHash> = batch.iter().map(|(hash, _)| *hash).collect();
    let total = batch_bytes as f64;
    let mut paths = Vec::new();

    // Put: the store's copy is dropped before each batch (untimed).
    let mut seconds = Vec::new();
    for round in 0..=args.batches {
        client.delete(fingerprint, &[]).await?;
        let started = Instant::now();
        let outcome = client.put(fingerprint, &batch).await?;
        let elapsed = started.elapsed().as_secs_f64();
        anyhow::ensure!(outcome.stored as usize == args.blocks, "the store kept {} of {} blocks", outcome.stored, args.blocks);
        if round > 0 {
            seconds.push(elapsed);
        }
    }
    paths.push(("put, gRPC".to_owned(), seconds));
    if let Some(seconds) = put_ucx(args, &client, fingerprint, &batch).await? {
        paths.push(("put, UCX (staged, read by the store)".to_owned(), seconds));
    }

    let mut seconds = Vec::new();
    for round in 0..=args.batches {
        let started = Instant::now();
        let run = client.get(fingerprint, &hashes).await?;
        let elapsed = started.elapsed().as_secs_f64();
        anyhow::ensure!(run.len() == args.blocks, "the store served {} of {} blocks", run.len(), args.blocks);
        if round > 0 {
            seconds.push(elapsed);
        }
    }
    paths.push(("get, gRPC".to_owned(), seconds));
    let ucx_tls = std::env::var("UCX_TLS").unwrap_or_default();
    let (ucx_paths, phases, paired) = get_ucx(args, &client, fingerprint, &batch, &ucx_tls).await?;
    paths.extend(ucx_paths);

    let perftest_block = if args.no_baseline { None } else { Some(perftest(args.block_bytes, args.perftest_iterations, &ucx_tls).await?) };
    let perftest_batch = if args.no_baseline { None } else { Some(perftest(batch_bytes, args.batches.max(5), &ucx_tls).await?) };
    let paths = paths
        .into_iter()
        .map(|(path, seconds)| {
            let typical = total / median(&seconds);
            let raw = path.starts_with("get, UCX (");
            let phases_ms = phases.as_ref().filter(|_| raw).map(|phases| [median(&phases[0]) * 1e3, median(&phases[1]) * 1e3, median(&phases[2]) * 1e3]);
            let paired = paired.as_ref().filter(|_| raw).map(|baseline: &Vec<f64>| {
                let ratios: Vec<f64> = seconds.iter().zip(baseline).map(|(seconds, baseline)| total / seconds / baseline).collect();
                PairedBaseline { median_ratio: median(&ratios), ratios, perftest_bytes_per_sec: baseline.clone() }
            });
            PathReport {
                path,
                median_bytes_per_sec: typical,
                best_bytes_per_sec: total / seconds.iter().copied().fold(f64::INFINITY, f64::min),
                batch_ratio: perftest_batch.map(|baseline| typical / baseline),
                phases_ms,
                paired,
            }
        })
        .collect();

    // The storm: fresh chains (same bytes, new hashes) worth storm_factor × capacity.
    client.delete(fingerprint, &[]).await?;
    let capacity_bytes = args.memory_mib << 20;
    let rss_before = rss_bytes(pid)?;
    let (mut written, mut peak, mut chain_start) = (0u64, rss_before, 2u64 << 32);
    let rss_before = rss_before[0];
    while written < args.storm_factor * capacity_bytes {
        let renamed: Vec<(SequenceHash, Arc<HostBlock>)> =
            batch.iter().enumerate().map(|(n, (_, block))| (SequenceHash(chain_start + n as u64), block.clone())).collect();
        chain_start += args.blocks as u64;
        client.put(fingerprint, &renamed).await?;
        written += batch_bytes as u64;
        let now = rss_bytes(pid)?;
        if now[0] > peak[0] {
            peak = now;
        }
    }
    let storm = StormReport {
        capacity_bytes,
        written_bytes: written,
        peak_rss_bytes: peak[0],
        rss_before_bytes: rss_before,
        peak_over_capacity: peak[0] as f64 / capacity_bytes as f64,
        peak_anon_file_shmem_bytes: [peak[1], peak[2], peak[3]],
    };
    let _ = store.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), store.wait()).await;
    Ok(KvStoreReport {
        block_bytes: args.block_bytes,
        blocks: args.blocks,
        batches: args.batches,
        ucx_tls,
        perftest_block_bytes_per_sec: perftest_block,
        perftest_batch_bytes_per_sec: perftest_batch,
        paths,
        storm,
    })
}

/// Put over UCX (batch seconds): the batch staged in this process's
/// registered memory as much at a time as it holds, read by the store.
#[cfg(feature = "ucx")]
async fn put_ucx(
    args: &KvStoreBenchArgs,
    client: &KvStoreClient,
    fingerprint: Fingerprint,
    batch: &[(SequenceHash, Arc<HostBlock>)],
) -> anyhow::Result<Option<Vec<f64>>> {
    let link = turbine_ucx_agent::KvStoreLink::with_staging(turbine_api::kv_store::MAX_PUT_FROM_BYTES as usize, &turbine_kv::UcxNetwork::Any)
        .map_err(anyhow::Error::msg)?;
    let mut seconds = Vec::new();
    for round in 0..=args.batches {
        client.delete(fingerprint, &[]).await?;
        let started = Instant::now();
        let outcome = link.put(client, fingerprint, batch).await?;
        let elapsed = started.elapsed().as_secs_f64();
        anyhow::ensure!(outcome.stored as usize == args.blocks, "the store kept {} of {} blocks put over UCX", outcome.stored, args.blocks);
        if round > 0 {
            seconds.push(elapsed);
        }
    }
    Ok(Some(seconds))
}

#[cfg(not(feature = "ucx"))]
async fn put_ucx(_: &KvStoreBenchArgs, _: &KvStoreClient, _: Fingerprint, _: &[(SequenceHash, Arc<HostBlock>)]) -> anyhow::Result<Option<Vec<f64>>> {
    Ok(None)
}

/// The UCX gets' results: (path, batch seconds) for the data path alone
/// and as a worker's tier reads; the data path's phases (lease, read,
/// release); `ucx_perftest`'s bandwidth just before each of its batches.
type UcxGets = (Vec<(String, Vec<f64>)>, Option<[Vec<f64>; 3]>, Option<Vec<f64>>);

/// Get over UCX, the data path alone paired batch by batch with
/// `ucx_perftest` (unless `--no-baseline`), then as a worker's tier reads.
#[cfg(feature = "ucx")]
async fn get_ucx(
    args: &KvStoreBenchArgs,
    client: &KvStoreClient,
    fingerprint: Fingerprint,
    batch: &[(SequenceHash, Arc<HostBlock>)],
    ucx_tls: &str,
) -> anyhow::Result<UcxGets> {
    let reader = turbine_ucx_agent::KvStoreLink::start(&turbine_kv::UcxNetwork::Any).map_err(anyhow::Error::msg)?;
    let hashes: Vec<SequenceHash> = batch.iter().map(|(hash, _)| *hash).collect();
    let timeout = Duration::from_secs(10);
    let (mut raw, mut tier) = (Vec::new(), Vec::new());
    let mut phases: [Vec<f64>; 3] = Default::default();
    // One buffer for every batch, as a reader reuses its own.
    let mut buffer = Vec::new();
    let mut paired = Vec::new();
    for round in 0..=args.batches {
        if round > 0 && !args.no_baseline {
            paired.push(perftest(args.blocks * args.block_bytes, 5, ucx_tls).await?);
        }
        let started = Instant::now();
        let lease = client.lease(fingerprint, &hashes).await?;
        anyhow::ensure!(lease.blocks.len() == args.blocks, "the store leased {} of {} blocks (is it serving UCX?)", lease.blocks.len(), args.blocks);
        let leased = started.elapsed().as_secs_f64();
        buffer = reader.read(&lease, buffer, timeout).await.map_err(anyhow::Error::msg)?;
        let read = started.elapsed().as_secs_f64();
        client.release(lease.id).await?;
        let elapsed = started.elapsed().as_secs_f64();
        if round > 0 {
            phases[0].push(leased);
            phases[1].push(read - leased);
            phases[2].push(elapsed - read);
        }
        if round == 0 {
            let run = lease.blocks_from(&buffer);
            anyhow::ensure!(run.len() == args.blocks, "{} of {} blocks read over UCX passed their checksums", run.len(), args.blocks);
            anyhow::ensure!(run.iter().zip(batch).all(|((_, got), (_, want))| got.bytes == want.bytes), "blocks read over UCX differ from those put");
        } else {
            raw.push(elapsed);
        }
    }
    for round in 0..=args.batches {
        let started = Instant::now();
        let run = reader.get(client, fingerprint, &hashes, timeout).await?;
        let elapsed = started.elapsed().as_secs_f64();
        anyhow::ensure!(run.len() == args.blocks, "the tier's read got {} of {} blocks", run.len(), args.blocks);
        if round > 0 {
            tier.push(elapsed);
        }
    }
    Ok((
        vec![("get, UCX (lease, read, release)".to_owned(), raw), ("get, UCX as a worker's tier (each block checked and copied out)".to_owned(), tier)],
        Some(phases),
        (!args.no_baseline).then_some(paired),
    ))
}

#[cfg(not(feature = "ucx"))]
async fn get_ucx(_: &KvStoreBenchArgs, _: &KvStoreClient, _: Fingerprint, _: &[(SequenceHash, Arc<HostBlock>)], _: &str) -> anyhow::Result<UcxGets> {
    eprintln!("this build has no UCX: only the gRPC paths are measured");
    Ok((Vec::new(), None, None))
}

/// Prints the report as a table.
pub fn print(report: &KvStoreReport) {
    let gbps = |value: f64| format!("{:.2}", value / 1e9);
    println!(
        "\nkv-store: {} blocks of {} bytes ({:.1} MiB) per batch, median of {} batches; UCX_TLS {}",
        report.blocks,
        report.block_bytes,
        (report.blocks * report.block_bytes) as f64 / (1 << 20) as f64,
        report.batches,
        if report.ucx_tls.is_empty() { "(default)" } else { &report.ucx_tls }
    );
    if let (Some(block), Some(batch)) = (report.perftest_block_bytes_per_sec, report.perftest_batch_bytes_per_sec) {
        println!("ucx_perftest -t ucp_get: {} GB/s at the block size, {} GB/s with the batch as one message", gbps(block), gbps(batch));
    }
    println!("{:<66} {:>12} {:>10} {:>22}", "path", "median GB/s", "best GB/s", "ratio to perftest batch");
    for path in &report.paths {
        let ratio = path.batch_ratio.map_or("-".to_owned(), |ratio| format!("{ratio:.2}"));
        println!("{:<66} {:>12} {:>10} {:>22}", path.path, gbps(path.median_bytes_per_sec), gbps(path.best_bytes_per_sec), ratio);
        if let Some([lease, read, release]) = path.phases_ms {
            println!("    median lease {lease:.1} ms, read {read:.1} ms, release {release:.1} ms");
        }
        if let Some(paired) = &path.paired {
            let listed: Vec<String> = paired.ratios.iter().map(|ratio| format!("{ratio:.2}")).collect();
            println!(
                "    paired with ucx_perftest just before each batch ({}–{} GB/s): median ratio {:.2} (per batch {})",
                gbps(paired.perftest_bytes_per_sec.iter().copied().fold(f64::INFINITY, f64::min)),
                gbps(paired.perftest_bytes_per_sec.iter().copied().fold(0.0, f64::max)),
                paired.median_ratio,
                listed.join(" ")
            );
        }
    }
    let storm = &report.storm;
    println!(
        "write storm: {:.1} GiB put into {} MiB; store RSS {} MiB before, peak {} MiB = {:.2}x capacity (anonymous {} MiB, file {} MiB, shared {} MiB)",
        storm.written_bytes as f64 / (1u64 << 30) as f64,
        storm.capacity_bytes >> 20,
        storm.rss_before_bytes >> 20,
        storm.peak_rss_bytes >> 20,
        storm.peak_over_capacity,
        storm.peak_anon_file_shmem_bytes[0] >> 20,
        storm.peak_anon_file_shmem_bytes[1] >> 20,
        storm.peak_anon_file_shmem_bytes[2] >> 20,
    );
}
