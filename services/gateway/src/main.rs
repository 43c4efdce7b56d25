//! `turbine-gateway`: OpenAI REST and gRPC in front of the router.

use clap::Parser;

/// Serve the OpenAI-compatible REST API and turbine.gateway.v1 gRPC,
/// routing through a turbine-router.
#[derive(Debug, Parser)]
#[command(name = "turbine-gateway", version)]
struct Cli {
    #[command(flatten)]
    args: turbine_gateway::GatewayArgs,
}

fn main() -> std::process::ExitCode {
    turbine_gateway::serve::main(Cli::parse().args)
}
