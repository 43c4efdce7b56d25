//! `turbine run`: the embedded cluster (`turbine-cluster`) until SIGTERM.

use turbine_cluster::{Cluster, ClusterOptions, RunConfig};
use turbine_runtime::CancellationToken;

/// Runs everything until SIGTERM/SIGINT, then drains and returns.
pub async fn run(config: RunConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let (workers, keys) = (config.roles().len(), config.gateway.keys_required());
    let cluster = Cluster::start(config, ClusterOptions { progress: true, ..ClusterOptions::default() }, shutdown).await?;
    print_banner(&cluster, workers, keys);
    cluster.finished().await
}

fn print_banner(cluster: &Cluster, workers: usize, keys: bool) {
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
    // With API keys the metrics are on a loopback port of their own.
    let metrics = cluster.gateways()[0].admin.map_or_else(|| format!("{base}/metrics"), |admin| format!("http://{admin}/metrics"));
    println!("  metrics     {metrics}");
    println!();
    println!("Try it:");
    let authorization = if keys { " -H \"Authorization: Bearer $TURBINE_API_KEY\"" } else { "" };
    println!(
        "  curl {base}/v1/chat/completions{authorization} -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    );
    println!();
}
