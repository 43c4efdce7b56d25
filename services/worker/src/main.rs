//! `turbine-worker`: one inference engine behind gRPC.

use clap::Parser;

/// Serve a model with one engine over gRPC (turbine.worker.v1), registering
/// in the Redis registry when --redis is given.
#[derive(Debug, Parser)]
#[command(name = "turbine-worker", version)]
struct Cli {
    #[command(flatten)]
    args: turbine_worker::WorkerArgs,
}

fn main() -> std::process::ExitCode {
    turbine_worker::serve::main(Cli::parse().args)
}
