//! `turbine run`: the embedded cluster (`turbine-cluster`) until SIGTERM.

use turbine_cluster::{Cluster, ClusterOptions, RunConfig};
use turbine_runtime::CancellationToken;

/// Runs everything until SIGTERM/SIGINT, then drains and returns.
pub async fn run(config: RunConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let workers = config.roles().len();
    let cluster = Cluster::start(config, ClusterOptions { progress: true, ..ClusterOptions::default() }, shutdown).await?;
    print_banner(&cluster, workers);
    cluster.finished().await
}

fn print_banner(cluster: &Cluster, workers: usize) {
    let base = cluster.http_url();
    let model = cluster.model();
    println!();
    println!("Turbine is ready: {model} on {workers} worker(s)");
    println!("  OpenAI API  {base}/v1");
    println!("  gRPC        {} (turbine.gateway.v1.Inference)", cluster.grpc_endpoint().trim_start_matches("http://"));
    if let Some((_, kv_index)) = cluster.kv_index() {
        println!("  kv-index    {} (turbine.kvindex.v1.KvIndex)", kv_index.grpc);
    }
    if let Some(kv_store) = cluster.kv_store() {
        println!("  kv-store    {kv_store} (turbine.kvstore.v1.KvStore)");
    }
    if let Some(planner) = cluster.planner() {
        println!("  planner     {planner} (turbine.planner.v1.Planner: SetTargets to start sizing the workers)");
    }
    println!("  metrics     {base}/metrics");
    println!();
    println!("Try it:");
    println!(
        "  curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    );
    println!();
}
