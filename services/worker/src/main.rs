//! `turbine-worker`: one inference engine behind gRPC.

use clap::Parser;
use turbine_runtime::config::Layered;
use turbine_worker::WorkerConfig;

/// Serve a model with one engine over gRPC (turbine.worker.v1), registering
/// in the Redis registry when --redis is given.
#[derive(Debug, Parser)]
#[command(name = "turbine-worker", version)]
struct Cli {
    #[command(flatten)]
    config: Layered<WorkerConfig>,
}

fn main() -> std::process::ExitCode {
    turbine_worker::main(Cli::parse().config.into_inner())
}
