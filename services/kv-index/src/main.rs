//! `turbine-kv-index`: the global KV index service.

use clap::Parser;

/// Answer which worker caches which prompt prefix (turbine.kvindex.v1),
/// following the workers' KV event log in Redis.
#[derive(Debug, Parser)]
#[command(name = "turbine-kv-index", version)]
struct Cli {
    #[command(flatten)]
    args: turbine_kv_index::KvIndexArgs,
}

fn main() -> std::process::ExitCode {
    turbine_kv_index::serve::main(Cli::parse().args)
}
