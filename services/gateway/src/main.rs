//! `turbine-gateway`: OpenAI REST and gRPC in front of the router.

use clap::Parser;
use turbine_gateway::GatewayConfig;
use turbine_runtime::config::Layered;

/// Serve the OpenAI-compatible REST API and turbine.gateway.v1 gRPC,
/// routing through a turbine-router.
#[derive(Debug, Parser)]
#[command(name = "turbine-gateway", version)]
struct Cli {
    #[command(flatten)]
    config: Layered<GatewayConfig>,
}

fn main() -> std::process::ExitCode {
    turbine_gateway::main(Cli::parse().config.into_inner())
}
