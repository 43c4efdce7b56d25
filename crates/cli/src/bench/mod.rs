//! `turbine bench`: benchmarks that start real processes and report numbers
//! measured side by side in one run.

pub mod gateway;

use std::process::ExitCode;

/// `turbine bench` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchCommand {
    /// Gateway + router overhead versus calling the worker's gRPC directly.
    Gateway(gateway::GatewayBenchArgs),
}

/// Runs a benchmark and prints its report.
pub fn main(command: BenchCommand) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = runtime.block_on(async move {
        match command {
            BenchCommand::Gateway(args) => {
                let json = args.json.clone();
                let report = gateway::run(args).await?;
                gateway::print(&report);
                if let Some(path) = json {
                    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
                    println!("wrote {}", path.display());
                }
                anyhow::Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turbine bench: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
