//! `turbine-kv-store`: the shared KV block store.

use clap::Parser;
use turbine_kv_store::KvStoreConfig;
use turbine_runtime::config::Layered;

/// Serve the shared KV block store (turbine.kvstore.v1): workers put the
/// KV blocks they computed and others get them back instead of recomputing.
#[derive(Debug, Parser)]
#[command(name = "turbine-kv-store", version)]
struct Cli {
    #[command(flatten)]
    config: Layered<KvStoreConfig>,
}

fn main() -> std::process::ExitCode {
    turbine_kv_store::main(Cli::parse().config.into_inner())
}
