//! `turbine`: one command for every way to run Turbine.

mod certs;
mod keys;
mod model;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use turbine_cluster::RunConfig;
use turbine_gateway::GatewayConfig;
use turbine_kv_index::KvIndexConfig;
use turbine_kv_store::KvStoreConfig;
use turbine_router::RouterConfig;
use turbine_runtime::config::Layered;
use turbine_worker::WorkerConfig;

/// Turbine serves language models across many machines.
///
/// `turbine run` starts everything in one process (the quick start). The
/// service subcommands run one service each, as the turbine-gateway,
/// turbine-router, turbine-worker, turbine-kv-index and turbine-kv-store
/// binaries do.
#[derive(Debug, Parser)]
#[command(name = "turbine", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run gateway, router and workers in one process (fetches the default model).
    Run(Box<Layered<RunConfig>>),
    /// Manage the model cache.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Run the gateway service (OpenAI REST + gRPC).
    Gateway(Box<Layered<GatewayConfig>>),
    /// Run the router service.
    Router(Box<Layered<RouterConfig>>),
    /// Run a worker service.
    Worker(Box<Layered<WorkerConfig>>),
    /// Run the kv-index service (the global KV index over the event log).
    KvIndex(Box<Layered<KvIndexConfig>>),
    /// Run the kv-store service (the shared KV block store, the G4 tier).
    KvStore(Box<Layered<KvStoreConfig>>),
    /// The planner: run its service, or backtest its predictors.
    #[command(subcommand)]
    Planner(PlannerCommand),
    /// Measure a worker configuration (TTFT by input length, ITL by context
    /// and concurrency) and write the profile the planner sizes pools from.
    Profile(Box<turbine_bench::profile::ProfileArgs>),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Box<turbine_bench::BenchCommand>),
    /// Make a CA for one deployment and a certificate per role (and per
    /// --worker id) for the services' --tls-cert, --tls-key and --tls-ca.
    Certs(certs::CertsArgs),
    /// API keys for the gateway's --api-keys file.
    #[command(subcommand)]
    Keys(keys::KeysCommand),
}

#[derive(Debug, clap::Subcommand)]
enum PlannerCommand {
    /// Run the planner service (turbine.planner.v1): it keeps the targets
    /// and every decision in its database (--database).
    Serve(Box<Layered<turbine_planner::PlannerConfig>>),
    /// Each predictor's one-step-ahead error (MAPE of request rate, input
    /// and output length) on recorded traces.
    Backtest(turbine_planner::plan::backtest::BacktestArgs),
    /// Past decisions, newest first: what was observed and forecast, each
    /// pool's replicas before, proposed and asked for, why, and how the
    /// connector's action ended.
    History(turbine_planner::audit::HistoryArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run(config) => turbine_runtime::run_service("turbine", move |shutdown| run::run(config.into_inner(), shutdown)),
        Command::Model(command) => match model::run(command) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("turbine: error: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Gateway(config) => turbine_gateway::main(config.into_inner()),
        Command::Router(config) => turbine_router::main(config.into_inner()),
        Command::Worker(config) => turbine_worker::main(config.into_inner()),
        Command::KvIndex(config) => turbine_kv_index::main(config.into_inner()),
        Command::KvStore(config) => turbine_kv_store::main(config.into_inner()),
        Command::Planner(PlannerCommand::Serve(config)) => turbine_planner::main(config.into_inner()),
        Command::Planner(PlannerCommand::Backtest(args)) => match turbine_planner::plan::backtest::run(&args) {
            Ok(_) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("turbine: error: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Planner(PlannerCommand::History(args)) => match turbine_planner::audit::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("turbine: error: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Profile(args) => turbine_bench::profile_main(*args),
        Command::Bench(command) => turbine_bench::main(*command),
        Command::Keys(command) => match keys::run(&command) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("turbine: error: {error:#}");
                ExitCode::FAILURE
            }
        },
        Command::Certs(args) => match certs::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("turbine: error: {error:#}");
                ExitCode::FAILURE
            }
        },
    }
}
