//! `turbine-planner`: the planner service.

use clap::Parser;
use turbine_planner::PlannerConfig;
use turbine_runtime::config::Layered;

/// Serve the planner (turbine.planner.v1): it keeps the targets (TTFT and
/// ITL at a percentile, replicas per pool, a budget) and every decision in
/// its database, for operators to set, pause and audit.
#[derive(Debug, Parser)]
#[command(name = "turbine-planner", version)]
struct Cli {
    #[command(flatten)]
    config: Layered<PlannerConfig>,
}

fn main() -> std::process::ExitCode {
    turbine_planner::main(Cli::parse().config.into_inner())
}
