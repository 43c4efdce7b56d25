//! `turbine-router`: chooses the worker for each request.

use clap::Parser;
use turbine_router::RouterConfig;
use turbine_runtime::config::Layered;

/// Route requests to workers found in the Redis registry (turbine.router.v1).
#[derive(Debug, Parser)]
#[command(name = "turbine-router", version)]
struct Cli {
    #[command(flatten)]
    config: Layered<RouterConfig>,
}

fn main() -> std::process::ExitCode {
    turbine_router::main(Cli::parse().config.into_inner())
}
