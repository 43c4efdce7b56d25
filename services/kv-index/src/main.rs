//! `turbine-kv-index`: the global KV index over the workers' event log.

use clap::Parser;
use turbine_kv_index::KvIndexConfig;
use turbine_runtime::config::Layered;

/// Serve the global KV index (turbine.kvindex.v1), following the workers'
/// KV event log in Redis.
#[derive(Debug, Parser)]
#[command(name = "turbine-kv-index", version)]
struct Cli {
    #[command(flatten)]
    config: Layered<KvIndexConfig>,
}

fn main() -> std::process::ExitCode {
    turbine_kv_index::main(Cli::parse().config.into_inner())
}
