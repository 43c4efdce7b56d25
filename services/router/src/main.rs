//! `turbine-router`: chooses the worker for each request.

use clap::Parser;

/// Route requests to workers found in the Redis registry (turbine.router.v1).
#[derive(Debug, Parser)]
#[command(name = "turbine-router", version)]
struct Cli {
    #[command(flatten)]
    args: turbine_router::RouterArgs,
}

fn main() -> std::process::ExitCode {
    turbine_router::serve::main(Cli::parse().args)
}
