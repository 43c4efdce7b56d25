//! `turbine bench transfer`: how fast KV blocks move between two worker
//! processes, over UCX one-sided reads and over the TCP fallback stream,
//! side by side with `ucx_perftest` (Debian's `ucx-utils`) on the same
//! transport and message size, in the same run.
//!
//! The owner is a second `turbine` process (`--serve`): a KV pool of
//! `--blocks` blocks of `--block-bytes`, filled with random bytes,
//! registered for UCX and shared under one handle in a scattered block
//! order (as a prompt's blocks lie in a real pool), served by the worker's
//! own `KvTransfer` service. This process reads the whole handle per batch
//! with the decode worker's code: the UCX thread's batched gets, or the
//! `ReadBlocks` stream, and checks every block's checksum once.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use prost::Message;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use turbine_api::kv_transfer::KvTransferClient;
use turbine_api::worker::KvHandle;
use turbine_engine::{Batch, EngineHandle, Executor, KvBuffer, KvLayout, KvMemory, Sampled, SchedulerConfig, block_checksum};
use turbine_kv::{BlockHashes, LocalBlockHash, SequenceHash, WorkerId};
use turbine_proto::MessageLimits;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::kv_transfer_server::KvTransferServer;
use turbine_worker::disagg::{Disagg, DisaggOptions, PinBudget, SharedKvPool};
use turbine_worker::service::{KvTransferService, Loaded};
use turbine_worker::{KvTransport, WorkerRole};

/// A transport to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchTransport {
    /// UCX one-sided gets of the owner's registered pool (transports as
    /// `UCX_TLS` selects; the baseline runs with the same environment).
    Ucx,
    /// The `KvTransfer/ReadBlocks` gRPC stream (baseline: `ucx_perftest`
    /// with `UCX_TLS=tcp`).
    Tcp,
}

/// Flags of `turbine bench transfer`.
#[derive(Debug, Clone, clap::Args)]
pub struct TransferBenchArgs {
    /// Transports to measure, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ucx,tcp")]
    pub transport: Vec<BenchTransport>,
    /// Bytes per KV block (default: one 16-token block of SmolLM2-135M).
    #[arg(long, default_value_t = 368_640)]
    pub block_bytes: usize,
    /// Blocks read per batch (one batch is one prompt's blocks).
    #[arg(long, default_value_t = 1000)]
    pub blocks: usize,
    /// Batches measured per transport, after one warm-up batch.
    #[arg(long, default_value_t = 10)]
    pub batches: usize,
    /// Iterations of the `ucx_perftest` baseline.
    #[arg(long, default_value_t = 2000)]
    pub perftest_iterations: usize,
    /// Skip the `ucx_perftest` baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Internal: be the owner process (serve the blocks until stdin closes).
    #[arg(long, hide = true)]
    pub serve: bool,
}

/// One transport's numbers.
#[derive(Debug, Serialize)]
pub struct TransportReport {
    /// The transport.
    pub transport: BenchTransport,
    /// `UCX_TLS` in effect for the baseline ("" when unset: UCX's choice).
    pub ucx_tls: String,
    /// Median batch bandwidth, bytes per second.
    pub median_bytes_per_sec: f64,
    /// Best batch bandwidth, bytes per second.
    pub best_bytes_per_sec: f64,
    /// Median time to post one batch's reads (UCX only), microseconds.
    pub median_post_us: Option<f64>,
    /// Best time to post one batch's reads (UCX only), microseconds.
    pub best_post_us: Option<f64>,
    /// `ucx_perftest -t ucp_get` bandwidth for the same message size and
    /// transport, bytes per second. It reads one buffer over and over, so
    /// at block sizes that fit the CPU caches this is a cache-to-cache
    /// copy rate.
    pub perftest_bytes_per_sec: Option<f64>,
    /// Median bandwidth over that baseline's.
    pub ratio: Option<f64>,
    /// `ucx_perftest -t ucp_get` reading the whole batch's bytes as one
    /// message (memory-bound, as the batch is), bytes per second.
    pub perftest_batch_bytes_per_sec: Option<f64>,
    /// Median bandwidth over that baseline's.
    pub batch_ratio: Option<f64>,
}

/// The report.
#[derive(Debug, Serialize)]
pub struct TransferReport {
    /// Bytes per block.
    pub block_bytes: usize,
    /// Blocks per batch.
    pub blocks: usize,
    /// Batches measured per transport.
    pub batches: usize,
    /// Per transport.
    pub transports: Vec<TransportReport>,
}

/// An executor that computes nothing: the owner process only lends its
/// pool's memory.
struct NoModel;

impl Executor for NoModel {
    fn execute(&mut self, _batch: &Batch<'_>) -> Result<Vec<Option<Sampled>>, turbine_engine::ExecutorError> {
        Err(turbine_engine::ExecutorError::Compute("the transfer benchmark's owner runs no model".into()))
    }
}

/// The owner process: shares a random pool under one handle, prints it,
/// serves until stdin closes.
pub async fn serve(args: &TransferBenchArgs) -> anyhow::Result<()> {
    // The pool comes from where a prefill worker's would (UCX shared
    // memory when it can), so the benchmark reads it the way a decode
    // worker would.
    let pool = SharedKvPool::for_role(WorkerRole::Prefill, KvTransport::Auto);
    let bytes = args.blocks * args.block_bytes;
    let mut buffer = pool.allocator().map_or_else(|| KvBuffer::zeroed(bytes), |allocator| allocator.allocate(bytes));
    eprintln!("owner pool: {} MiB, {}", bytes >> 20, if buffer.is_provided() { "UCX shared memory" } else { "heap" });
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for chunk in buffer.as_mut_slice().chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
    let layout = KvLayout::opaque(args.block_bytes, "benchmark");
    let memory = KvMemory::new(Arc::new(buffer), layout, args.blocks);
    let engine = EngineHandle::spawn(SchedulerConfig { num_blocks: 1, block_size: 1, ..SchedulerConfig::default() }, vec![], Box::new(NoModel));
    let options = DisaggOptions {
        role: WorkerRole::Prefill,
        lease: Duration::from_secs(3600),
        transport: KvTransport::Auto,
        transfer_mib: 1,
        pinned: PinBudget::WHOLE_POOL,
        network: turbine_kv::UcxNetwork::Any,
        keys: turbine_kv::UcxKeys::WholePool,
        simulated: None,
        pool,
    };
    let disagg = Arc::new(Disagg::new(&WorkerId::from("bench-owner"), engine.clone(), Some(memory), &options));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    disagg.set_endpoint(endpoint);
    // The worker's own KvTransfer service, over the bare pool.
    let routes = tonic::service::Routes::new(KvTransferServer::new(KvTransferService::new(Loaded::with(disagg.clone()))).with_message_limits());
    let stop = turbine_runtime::CancellationToken::new();
    let plaintext = turbine_runtime::grpc::ServerSecurity::Plaintext;
    let server = tokio::spawn(turbine_runtime::grpc::serve(
        listener,
        routes,
        stop.clone(),
        Duration::from_millis(100),
        Duration::from_secs(600),
        1024,
        plaintext,
        &[],
        turbine_runtime::grpc::Accepting::default(),
    ));
    // A prompt's blocks are scattered over a real pool: read them in a
    // shuffled order.
    let mut order: Vec<u32> = (0..args.blocks as u32).collect();
    for i in (1..order.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let blocks: Vec<(u32, BlockHashes)> =
        order.iter().map(|&block| (block, BlockHashes { local: LocalBlockHash(block as u64), sequence: SequenceHash(block as u64) })).collect();
    // Pin id 0 belongs to no engine pin: nothing to unpin on release.
    let handle = disagg.share("bench", 0, &blocks, Duration::from_secs(3600)).await.map_err(|error| anyhow::anyhow!("{error}"))?;
    println!("handle {}", hex::encode(pb::KvHandle::from(handle).encode_to_vec()));
    tokio::task::spawn_blocking(|| std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())).await??;
    stop.cancel();
    let _ = server.await;
    engine.shutdown();
    Ok(())
}

/// Runs the benchmark.
pub async fn run(args: &TransferBenchArgs) -> anyhow::Result<TransferReport> {
    anyhow::ensure!(args.blocks > 0 && args.block_bytes > 0 && args.batches > 0, "--blocks, --block-bytes and --batches must be positive");
    let mut owner = tokio::process::Command::new(std::env::current_exe()?)
        .args(["bench", "transfer", "--serve", "--block-bytes", &args.block_bytes.to_string(), "--blocks", &args.blocks.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the owner process")?;
    let mut lines = BufReader::new(owner.stdout.take().expect("piped")).lines();
    let handle = loop {
        let line = lines.next_line().await?.context("the owner process exited before sharing its blocks")?;
        if let Some(encoded) = line.strip_prefix("handle ") {
            break KvHandle::try_from(pb::KvHandle::decode(hex::decode(encoded)?.as_slice())?)?;
        }
    };
    let client = KvTransferClient::connect(&handle.transfer_endpoint)?;
    let wanted: Vec<usize> = (0..handle.blocks.len()).collect();
    let total_bytes = (args.blocks * args.block_bytes) as f64;
    let mut transports = Vec::new();
    for &transport in &args.transport {
        let (seconds, posts) = match transport {
            BenchTransport::Ucx => read_ucx(args, &handle, client.clone()).await?,
            BenchTransport::Tcp => {
                let mut seconds = Vec::new();
                // One buffer for every batch, as the decode worker reuses its own.
                let mut buffer = Vec::new();
                for batch in 0..=args.batches {
                    let started = Instant::now();
                    buffer = client.read_blocks(handle.key(), &wanted, args.block_bytes, buffer).await?;
                    let elapsed = started.elapsed().as_secs_f64();
                    if batch == 0 {
                        verify(&handle, &buffer, args.block_bytes)?;
                    } else {
                        seconds.push(elapsed);
                    }
                }
                (seconds, Vec::new())
            }
        };
        let ucx_tls = match transport {
            BenchTransport::Ucx => std::env::var("UCX_TLS").unwrap_or_default(),
            BenchTransport::Tcp => "tcp".to_owned(),
        };
        let perftest_same = if args.no_baseline { None } else { Some(perftest(args.block_bytes, args.perftest_iterations, &ucx_tls).await?) };
        let batch_bytes = args.blocks * args.block_bytes;
        let perftest_batch = if args.no_baseline { None } else { Some(perftest(batch_bytes, args.batches.max(5), &ucx_tls).await?) };
        let typical = total_bytes / median(&seconds);
        let best = total_bytes / seconds.iter().copied().fold(f64::INFINITY, f64::min);
        transports.push(TransportReport {
            transport,
            ucx_tls,
            median_bytes_per_sec: typical,
            best_bytes_per_sec: best,
            median_post_us: (!posts.is_empty()).then(|| median(&posts) * 1e6),
            best_post_us: (!posts.is_empty()).then(|| posts.iter().copied().fold(f64::INFINITY, f64::min) * 1e6),
            perftest_bytes_per_sec: perftest_same,
            ratio: perftest_same.map(|baseline| typical / baseline),
            perftest_batch_bytes_per_sec: perftest_batch,
            batch_ratio: perftest_batch.map(|baseline| typical / baseline),
        });
    }
    drop(owner.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(5), owner.wait()).await;
    Ok(TransferReport { block_bytes: args.block_bytes, blocks: args.blocks, batches: args.batches, transports })
}

/// Reads the handle over UCX: (batch seconds, post seconds).
#[cfg(feature = "ucx")]
async fn read_ucx(args: &TransferBenchArgs, handle: &KvHandle, client: KvTransferClient) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    use turbine_ucx_agent::UcxAgent;
    let agent = UcxAgent::start(None, None, &turbine_kv::UcxNetwork::Any, turbine_kv::UcxKeys::WholePool).map_err(anyhow::Error::msg)?;
    let described = client.describe(handle.key()).await?;
    let region = described.ucx.context("the owner has no UCX")?;
    let offsets: Vec<u64> = handle.blocks.iter().map(|block| block.offset).collect();
    let (mut seconds, mut posts) = (Vec::new(), Vec::new());
    // One buffer for every batch, as the decode worker reuses its own.
    let mut buffer = Vec::new();
    for batch in 0..=args.batches {
        let pulled = agent.pull(&region, &offsets, args.block_bytes, buffer, Duration::from_secs(5)).await?;
        if batch == 0 {
            verify(handle, &pulled.bytes, args.block_bytes)?;
        } else {
            seconds.push(pulled.total.as_secs_f64());
            posts.push(pulled.post.as_secs_f64());
        }
        buffer = pulled.bytes;
    }
    Ok((seconds, posts))
}

#[cfg(not(feature = "ucx"))]
async fn read_ucx(_: &TransferBenchArgs, _: &KvHandle, _: KvTransferClient) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    anyhow::bail!("this build has no UCX; rebuild with --features ucx")
}

/// Every block's checksum matches the owner's.
fn verify(handle: &KvHandle, bytes: &[u8], block_bytes: usize) -> anyhow::Result<()> {
    anyhow::ensure!(bytes.len() == handle.blocks.len() * block_bytes, "read {} bytes, expected {}", bytes.len(), handle.blocks.len() * block_bytes);
    for (index, (chunk, block)) in bytes.chunks(block_bytes).zip(&handle.blocks).enumerate() {
        anyhow::ensure!(block_checksum(chunk) == block.checksum, "block {index} failed its checksum");
    }
    Ok(())
}

/// `ucx_perftest -t ucp_get` bandwidth (bytes/s) for one message size over
/// loopback, server and client under the same `UCX_TLS`.
pub(crate) async fn perftest(message_bytes: usize, iterations: usize, ucx_tls: &str) -> anyhow::Result<f64> {
    // ucx_perftest binds its own port: one that was free a moment ago.
    let port = turbine_harness::free_port().to_string();
    let command = |extra: &[&str]| {
        let mut command = tokio::process::Command::new("ucx_perftest");
        command.args(extra).kill_on_drop(true).stdout(Stdio::piped()).stderr(Stdio::null());
        if !ucx_tls.is_empty() {
            command.env("UCX_TLS", ucx_tls);
        }
        command
    };
    let mut server = command(&["-p", &port]).spawn().context("running ucx_perftest (Debian package ucx-utils)")?;
    let size = message_bytes.to_string();
    let warmup = (iterations / 10).max(1).to_string();
    let iterations = iterations.to_string();
    let mut output = None;
    // The server needs a moment to listen.
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let result = command(&["127.0.0.1", "-p", &port, "-t", "ucp_get", "-s", &size, "-n", &iterations, "-w", &warmup, "-f"]).output().await?;
        if result.status.success() {
            output = Some(String::from_utf8_lossy(&result.stdout).into_owned());
            break;
        }
    }
    let _ = server.kill().await;
    let output = output.context("ucx_perftest never connected")?;
    // `-f` prints one line of numbers: iterations, latency 50%/avg/overall
    // (µs), bandwidth avg/overall (MB/s), message rate avg/overall.
    let fields: Vec<f64> = output
        .lines()
        .map(|line| line.trim_start_matches("Final:").split_whitespace().map(str::parse::<f64>).collect::<Result<Vec<f64>, _>>())
        .filter_map(Result::ok)
        .rfind(|fields| fields.len() >= 8)
        .context("no result line in ucx_perftest's output")?;
    let mb_per_sec = fields[5];
    // ucx_perftest's MB is 2^20 bytes.
    Ok(mb_per_sec * (1u64 << 20) as f64)
}

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Prints the report as a table.
pub fn print(report: &TransferReport) {
    println!(
        "\nKV transfer: {} blocks of {} bytes ({:.1} MiB) per batch, median of {} batches",
        report.blocks,
        report.block_bytes,
        (report.blocks * report.block_bytes) as f64 / (1 << 20) as f64,
        report.batches
    );
    println!(
        "{:<10} {:>10} {:>12} {:>10} {:>15} {:>6} {:>17} {:>6} {:>9}",
        "transport", "UCX_TLS", "median GB/s", "best GB/s", "perftest block", "ratio", "perftest batch", "ratio", "post µs"
    );
    for t in &report.transports {
        let tls = if t.ucx_tls.is_empty() { "(default)" } else { &t.ucx_tls };
        let gbps = |value: Option<f64>| value.map_or("-".to_owned(), |v| format!("{:.2}", v / 1e9));
        let times = |value: Option<f64>| value.map_or("-".to_owned(), |v| format!("{v:.2}"));
        let post = t.median_post_us.map_or("-".to_owned(), |v| format!("{v:.1}"));
        let name = match t.transport {
            BenchTransport::Ucx => "ucx",
            BenchTransport::Tcp => "tcp",
        };
        println!(
            "{:<10} {:>10} {:>12.2} {:>10.2} {:>15} {:>6} {:>17} {:>6} {:>9}",
            name,
            tls,
            t.median_bytes_per_sec / 1e9,
            t.best_bytes_per_sec / 1e9,
            gbps(t.perftest_bytes_per_sec),
            times(t.ratio),
            gbps(t.perftest_batch_bytes_per_sec),
            times(t.batch_ratio),
            post
        );
    }
}
