//! `turbine`: one command for every way to run Turbine.

mod bench;
mod model;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Turbine serves language models across many machines.
///
/// `turbine run` starts everything in one process (the quick start). The
/// service subcommands run one service each, as the turbine-gateway,
/// turbine-router, turbine-worker and turbine-kv-index binaries do.
#[derive(Debug, Parser)]
#[command(name = "turbine", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run gateway, router and workers in one process (fetches the default model).
    Run(Box<run::RunArgs>),
    /// Manage the model cache.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Run the gateway service (OpenAI REST + gRPC).
    Gateway(Box<turbine_gateway::GatewayArgs>),
    /// Run the router service.
    Router(Box<turbine_router::RouterArgs>),
    /// Run a worker service.
    Worker(Box<turbine_worker::WorkerArgs>),
    /// Run the kv-index service (the global KV index over the event log).
    KvIndex(Box<turbine_kv_index::KvIndexArgs>),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Box<bench::BenchCommand>),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run(args) => turbine_runtime::run_service("turbine", move |shutdown| run::run(*args, shutdown)),
        Command::Model(command) => match model::run(command) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("turbine: error: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Gateway(args) => turbine_gateway::serve::main(*args),
        Command::Router(args) => turbine_router::serve::main(*args),
        Command::Worker(args) => turbine_worker::serve::main(*args),
        Command::KvIndex(args) => turbine_kv_index::serve::main(*args),
        Command::Bench(command) => bench::main(*command),
    }
}
