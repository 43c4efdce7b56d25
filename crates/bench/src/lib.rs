//! `turbine bench`: benchmarks that start real processes (or the embedded
//! cluster) and report numbers measured side by side in one run.
//!
//! - [`gateway`]: what the gateway and router add on top of a worker.
//! - [`engine`]: the native engine against llama.cpp.
//! - [`replay`]: a production trace through the routing policies.
//! - [`indexer`]: the KV index under a trace's events and lookups.
//! - [`transfer`]: KV block transfer over UCX and TCP against
//!   `ucx_perftest`.
//! - [`kv_store`]: the kv-store's Put and Get over gRPC and UCX against
//!   `ucx_perftest`, and its memory under a write storm.
//! - [`tiers`]: time to first token with a prompt's KV onboarded from
//!   host memory or disk, against computing it.
//! - [`profile`]: `turbine profile`, a worker configuration's TTFT and ITL
//!   for the planner.

pub mod adapter;
pub mod attack;
pub mod engine;
pub mod gateway;
pub mod indexer;
pub mod kv_store;
pub mod planner;
pub mod planner_plot;
pub mod profile;
pub mod replay;
pub mod tiers;
pub mod transfer;

use std::process::ExitCode;

use anyhow::Context as _;

/// `turbine bench` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
#[allow(clippy::large_enum_variant, reason = "one value per process, built at startup")]
pub enum BenchCommand {
    /// Gateway + router overhead versus calling the worker's gRPC directly.
    Gateway(gateway::GatewayBenchArgs),
    /// Legitimate latency with and without attackers (wrong-role calls,
    /// plaintext callers, forged KV handles, rogue registry records) on a
    /// mutual-TLS stack; every attack must be refused.
    Attack(attack::AttackBenchArgs),
    /// The native engine's speed, side by side with llama.cpp.
    Engine(engine::EngineBenchArgs),
    /// A worker in front of vLLM (--engine external): its CPU per streamed
    /// token, against calling vLLM directly, in one run.
    Adapter(adapter::AdapterBenchArgs),
    /// A Mooncake-format trace through gateway and router onto mocker
    /// workers, once per routing policy.
    Replay(replay::ReplayArgs),
    /// The KV index applying a trace's events under concurrent lookups.
    Indexer(indexer::IndexerBenchArgs),
    /// KV block transfer between two processes over UCX and TCP, side by
    /// side with ucx_perftest.
    Transfer(transfer::TransferBenchArgs),
    /// The kv-store's Put and Get bandwidth over gRPC and UCX, side by
    /// side with ucx_perftest, and its memory under a write storm.
    KvStore(kv_store::KvStoreBenchArgs),
    /// Time to first token of long prompts onboarded from the host and
    /// disk KV tiers, against computing them.
    Tiers(tiers::TiersBenchArgs),
    /// An Azure trace through gateway and router onto mocker worker
    /// processes: a static fleet sized for the peak, then a fleet the
    /// planner sizes (local connector), side by side.
    Planner(planner::PlannerBenchArgs),
}

/// Runs a benchmark and prints its report.
pub fn main(command: BenchCommand) -> ExitCode {
    if let BenchCommand::Engine(args) = &command {
        return finish(engine::run_bench(args).and_then(|report| {
            engine::print(&report);
            write_json(args.json.as_deref(), &report)
        }));
    }
    if let BenchCommand::Tiers(args) = &command {
        return finish(tiers::run(args).and_then(|report| {
            tiers::print(&report);
            write_json(args.json.as_deref(), &report)
        }));
    }
    if let BenchCommand::Indexer(args) = &command {
        return finish(indexer::run(args).and_then(|report| {
            indexer::print(&report);
            write_json(args.json.as_deref(), &report)
        }));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async move {
        match command {
            BenchCommand::Gateway(args) => {
                let json = args.json.clone();
                let report = gateway::run(args).await?;
                gateway::print(&report);
                write_json(json.as_deref(), &report)
            }
            BenchCommand::Attack(args) => {
                let json = args.json.clone();
                let report = attack::run(args).await?;
                attack::print(&report);
                write_json(json.as_deref(), &report)
            }
            BenchCommand::Adapter(args) => {
                let json = args.json.clone();
                let report = adapter::run(args).await?;
                adapter::print(&report);
                write_json(json.as_deref(), &report)
            }
            BenchCommand::Replay(args) => {
                let (json, plot) = (args.json.clone(), args.plot.clone());
                let report = replay::run(args).await?;
                replay::print(&report);
                if let Some(plot) = plot {
                    replay::write_plot(&report, &plot)?;
                }
                write_json(json.as_deref(), &report)
            }
            BenchCommand::Transfer(args) if args.serve => transfer::serve(&args).await,
            BenchCommand::Transfer(args) => {
                let report = transfer::run(&args).await?;
                transfer::print(&report);
                write_json(args.json.as_deref(), &report)
            }
            BenchCommand::Planner(args) => {
                let report = planner::run(&args).await?;
                planner::print(&report);
                if let Some(path) = &args.svg {
                    std::fs::write(path, planner_plot::svg(&report)).with_context(|| format!("cannot write {}", path.display()))?;
                    println!("wrote {}", path.display());
                }
                write_json(args.json.as_deref(), &report)
            }
            BenchCommand::KvStore(args) => {
                let report = kv_store::run(&args).await?;
                kv_store::print(&report);
                write_json(args.json.as_deref(), &report)
            }
            BenchCommand::Engine(_) | BenchCommand::Indexer(_) | BenchCommand::Tiers(_) => unreachable!("handled above"),
        }
    });
    finish(result)
}

/// Reads a server-sent-events response, handing each event's `data:`
/// payload to `on_data` until it returns false (true: the stream was
/// stopped there, false: it ended first).
async fn for_each_sse_data(response: reqwest::Response, mut on_data: impl FnMut(&[u8]) -> anyhow::Result<bool>) -> anyhow::Result<bool> {
    use futures::StreamExt;
    let mut stream = response.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(bytes) = stream.next().await {
        pending.extend_from_slice(&bytes?);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            if let Some(data) = event.strip_prefix(b"data: ")
                && !on_data(data.trim_ascii_end())?
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Whether a completion chunk carries non-empty text.
fn carries_text(data: &[u8]) -> bool {
    data.windows(8).any(|w| w == b"\"text\":\"") && !data.windows(9).any(|w| w == b"\"text\":\"\"")
}

/// `turbine profile`: measures and writes the profile, prints it.
pub fn profile_main(args: profile::ProfileArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match runtime.block_on(profile::run(&args)) {
        Ok(profile) => {
            println!("wrote {} ({} prefill and {} decode points; {})", args.output.display(), profile.prefill.len(), profile.decode.len(), profile.worker);
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("turbine profile: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn write_json(path: Option<&std::path::Path>, report: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(report)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turbine bench: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
