//! `turbine-kv-store` and two native `turbine-worker`s as separate
//! processes: worker A computes a prompt and its blocks go to the store;
//! worker B, asked for the same prompt, gets it from the store with the
//! same greedy tokens; with the store SIGKILLed as B is asked again (and
//! once more after it is gone), B's requests complete with the same tokens
//! (computed), never an error. The store announces its blocks in the KV
//! event log (a real Redis): B's registry record names the store, and a
//! follower of the log credits A's prefix to the store's name. A block
//! corrupted on the store's disk is caught by its checksum: B computes from
//! there with A's text, and its put restores a sound copy.

mod common;

use std::time::Duration;

use common::{MODEL, metric, service, wait_until};
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::worker_client::WorkerClient;
use turbine_testkit::{ServiceProcess, metric_where};

fn greedy(prompt: &[u32]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: String::new(),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        stop: Some(pb::StopConditions { max_tokens: 8, stop_token_ids: vec![], ignore_eos: true }),
        remote_prefill: None,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    }
}

/// The greedy tokens of `prompt` on `worker`, within two minutes.
async fn generate(worker: &ServiceProcess, prompt: &[u32]) -> Vec<u32> {
    let run = async {
        let mut client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();
        let mut stream = client.generate(greedy(prompt)).await.expect("the worker accepts the request").into_inner();
        let mut tokens = Vec::new();
        while let Some(message) = stream.message().await.expect("the stream carries no error") {
            tokens.extend(&message.token_ids);
            if message.finish_reason() != pb::FinishReason::Unspecified {
                return tokens;
            }
        }
        panic!("the stream ended without a finish reason");
    };
    tokio::time::timeout(Duration::from_secs(120), run).await.expect("a request finishes within 120 s")
}

async fn worker(store: &str, id: &str, redis: &str) -> ServiceProcess {
    let args =
        ["--engine", "native", "--model", MODEL, "--threads", "1", "--kv-cache-mib", "32", "--host-cache-mib", "64", "--kv-store", store, "--worker-id", id];
    let cluster = ["--redis", redis, "--namespace", "t"];
    service("turbine-worker", &[&args[..], &cluster].concat(), &[], false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_moves_between_worker_processes_through_the_store_and_a_killed_store_costs_only_recompute() {
    let redis = turbine_testkit::RedisServer::start();
    // Memory for about two blocks: the rest are read back from the disk tier.
    let disk = tempfile::tempdir().unwrap();
    let store_args = ["--memory-mib", "1", "--disk-dir", disk.path().to_str().unwrap(), "--disk-gib", "1", "--redis", &redis.url(), "--namespace", "t"];
    let mut store = service("turbine-kv-store", &store_args, &[], false).await;
    let endpoint = store.grpc_endpoint();
    let redis_url = redis.url();
    let (a, b) = tokio::join!(worker(&endpoint, "store-a", &redis_url), worker(&endpoint, "store-b", &redis_url));
    // 24 blocks of 16 tokens: token ids the model's vocabulary holds.
    let prompt: Vec<u32> = (0..384u32).map(|i| 200 + (i * 37) % 20_000).collect();

    let computed = generate(&a, &prompt).await;
    let store_client = turbine_api::kv_store::KvStoreClient::connect(&endpoint).unwrap();
    wait_until("A's blocks are in the store", Duration::from_secs(30), async || store_client.stats().await.is_ok_and(|stats| stats.put_blocks >= 23)).await;
    assert_eq!(generate(&b, &prompt).await, computed, "B decodes A's prefix from the store");

    // Routers would credit the store's blocks to B: its record names the
    // store, and the store's announcements reach the log's followers.
    let registry = turbine_registry::Registry::Redis(turbine_registry::RedisRegistry::new(&redis.url(), "t").unwrap());
    let mut name = None;
    wait_until("B's registry record names the store", Duration::from_secs(30), async || {
        let records = registry.list().await.unwrap_or_default();
        name = records.into_iter().find(|w| w.record.worker_id == "store-b").and_then(|w| w.record.kv_store).map(|store| store.name);
        name.is_some()
    })
    .await;
    let name = name.expect("named");
    assert_eq!(name.store_part().map(|(store_id, _)| store_id), Some("kv-store"), "{name}");
    let index = std::sync::Arc::new(turbine_kv::KvIndex::new());
    let no_workers: turbine_kv_log::DumpFetcher = std::sync::Arc::new(|_| Box::pin(async { None }));
    let fetch = turbine_kv_log::with_store_dumps(no_workers, {
        let endpoint = endpoint.clone();
        move |_| Some(endpoint.clone())
    });
    let log = turbine_kv_log::EventLog::new(&redis.url(), "t").unwrap();
    let status = std::sync::Arc::new(turbine_kv_log::FollowerStatus::default());
    let following = turbine_runtime::CancellationToken::new();
    let _follower = turbine_kv_log::follow(index.clone(), &log, fetch, status, following.clone());
    let hashes = turbine_kv::BlockHasher::default().sequence_hashes(&prompt, 16);
    wait_until("a follower of the log credits A's prefix to the store", Duration::from_secs(30), async || {
        index.find_matches(&hashes).of(&name).is_some_and(|m| m.blocks >= 23 && m.in_tier(turbine_kv::Tier::Remote) == m.blocks)
    })
    .await;
    following.cancel();

    // A block corrupted on the store's disk is caught by its checksum and
    // never served: B reads the blocks before it and computes from there,
    // with A's text.
    let fourth: Vec<u32> = prompt.iter().map(|t| t + 3).collect();
    let computed_fourth = generate(&a, &fourth).await;
    let (_, fingerprint) = name.store_part().expect("a store's name");
    let fingerprint_dir = disk.path().join(format!("{fingerprint:016x}"));
    let fourth_hashes = turbine_kv::BlockHasher::default().sequence_hashes(&fourth, 16);
    let file = |n: usize| turbine_engine::tiers::block_file::block_path(&fingerprint_dir, fourth_hashes[n]);
    wait_until("A's blocks of the fourth prompt are on the store's disk", Duration::from_secs(30), async || (0..23).all(|n| file(n).exists())).await;
    let mut bytes = std::fs::read(file(10)).unwrap();
    let payload = turbine_engine::tiers::block_file::HEADER_BYTES + 100;
    bytes[payload] ^= 0x5a;
    std::fs::write(file(10), bytes).unwrap();
    assert_eq!(generate(&b, &fourth).await, computed_fourth, "a corrupt block in the store costs a recompute, never wrong text");
    let corrupt = metric_where(&store.admin_url(), "turbine_kv_store_corrupt_blocks_total", &[("tier", "disk")]).await;
    assert_eq!(corrupt, 1.0, "the store found the corrupt block when B asked for it");
    // B computed block 10 on and put it: the store holds a sound copy again.
    let fingerprint = turbine_kv_store::Fingerprint::new(fingerprint).unwrap();
    wait_until("B's recomputed blocks replace the corrupt one", Duration::from_secs(30), async || {
        store_client.get(fingerprint, &fourth_hashes[..23]).await.is_ok_and(|run| run.len() == 23)
    })
    .await;
    let fetched = metric_where(&b.admin_url(), "turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "remote")]).await;
    assert!(fetched >= 23.0, "B fetched the prefix instead of computing it ({fetched} blocks)");

    // Another prompt computed on A, then asked of B while the store dies.
    let other: Vec<u32> = prompt.iter().map(|t| t + 1).collect();
    let computed_other = generate(&a, &other).await;
    let asked = tokio::spawn({
        let other = other.clone();
        let b_endpoint = b.grpc_endpoint();
        async move {
            let mut client = WorkerClient::connect(b_endpoint).await.unwrap();
            let mut stream = client.generate(greedy(&other)).await.expect("accepted").into_inner();
            let mut tokens: Vec<u32> = Vec::new();
            while let Some(message) = stream.message().await.expect("no error on the stream") {
                tokens.extend(&message.token_ids);
            }
            tokens
        }
    });
    store.kill();
    let during = tokio::time::timeout(Duration::from_secs(120), asked).await.expect("finishes within 120 s").unwrap();
    assert_eq!(during, computed_other, "a store killed mid-request costs a recompute, never wrong text");
    let third: Vec<u32> = prompt.iter().map(|t| t + 2).collect();
    assert_eq!(generate(&b, &third).await, generate(&a, &third).await, "with the store gone, requests are computed");
    assert!(metric(&b.admin_url(), "turbine_worker_generated_tokens_total").await >= 24.0);
}
