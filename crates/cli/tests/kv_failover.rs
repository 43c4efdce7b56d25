//! KV-aware routing through the kv-index service while its dependencies
//! fail: `turbine-worker` ×3 (mocker), `turbine-kv-index`, `turbine-router
//! --policy kv --kv-index` and `turbine-gateway` as processes on a real
//! Redis. Conversations grow turn by turn, so every turn after the first
//! can hit the previous turn's prefix. The kv-index is killed with SIGKILL
//! and restarted, then Redis is: no request fails, and once the kv-index
//! is back (from its snapshot and the event log) every turn hits again
//! within 10 s.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{MODEL, metric, post, service, until_listed, until_registered, wait_until};
use serde_json::json;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use turbine_api::kv_index::{KvIndexClient, MatchQuery};
use turbine_api::router::RouterClient;
use turbine_kv::BlockHasher;
use turbine_testkit::{RedisServer, STARTUP_TIMEOUT, ServiceProcess, workspace_binary};

const BLOCK: usize = 16;
const CONVERSATIONS: usize = 6;

/// A kv-index replica; `grpc`: its address (a restart takes the same one).
async fn start_kv_index(redis: &str, grpc: &str) -> ServiceProcess {
    let mut command = Command::new(workspace_binary("turbine-kv-index"));
    command.args(["--grpc-addr", grpc, "--redis", redis, "--namespace", "kv", "--snapshot-interval-secs", "0.5"]);
    let mut process = ServiceProcess::spawn("turbine-kv-index", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::Index, "", STARTUP_TIMEOUT).await.unwrap();
    process
}

/// Turn `turn` of conversation `c`: the previous turn's prompt plus two
/// blocks (token ids of its own per conversation).
fn prompt(c: usize, turn: usize) -> Vec<u32> {
    (0..BLOCK * 2 * (turn + 1)).map(|i| (1000 + c * 5000 + i) as u32).collect()
}

/// Sends one turn; returns (HTTP status, cached prompt tokens).
async fn send(base: &str, c: usize, turn: usize) -> (u16, u64) {
    let body = json!({"model": MODEL, "prompt": prompt(c, turn), "max_tokens": 2, "ignore_eos": true});
    let (status, body) = post(base, "/v1/completions", &body).await;
    if status != 200 {
        eprintln!("conversation {c} turn {turn} failed: {status} {body}");
    }
    (status, body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

/// One turn of every conversation; returns how many hit the whole previous turn.
async fn round(base: &str, turn: usize, failed: &mut usize) -> usize {
    let mut hits = 0;
    for c in 0..CONVERSATIONS {
        let (status, cached) = send(base, c, turn).await;
        if status != 200 {
            *failed += 1;
        }
        if turn > 0 && cached as usize >= prompt(c, turn - 1).len() {
            hits += 1;
        }
    }
    hits
}

/// Whether the kv-index knows a worker holding every conversation's turn
/// `turn` whole (the events of that round reached it through Redis).
async fn indexed(kv_index: &KvIndexClient, turn: usize) -> bool {
    for c in 0..CONVERSATIONS {
        let hashes = BlockHasher::default().sequence_hashes(&prompt(c, turn), BLOCK);
        let blocks = hashes.len() as u32;
        let query = MatchQuery { hashes, cached_blocks_of: Vec::new() };
        let Ok(answer) = kv_index.find_matches(&query).await else {
            return false;
        };
        if !answer.matches.iter().any(|found| found.blocks == blocks) {
            return false;
        }
    }
    true
}

async fn serving(service: &ServiceProcess) -> ServingStatus {
    let Ok(channel) = tonic::transport::Channel::from_shared(service.grpc_endpoint()).unwrap().connect().await else {
        return ServingStatus::Unknown;
    };
    let answer = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await;
    answer.map_or(ServingStatus::Unknown, |response| response.into_inner().status())
}

#[tokio::test]
async fn kv_routing_survives_the_kv_index_and_redis_being_killed() {
    let mut redis = RedisServer::start();
    let redis_url = redis.url();
    let mut workers = Vec::new();
    for index in 0..3 {
        let id = format!("worker-{index}");
        let args = [
            "--engine",
            "mock",
            "--speedup",
            "1000",
            "--block-size",
            "16",
            "--redis",
            &redis_url,
            "--namespace",
            "kv",
            "--worker-id",
            &id,
            "--lease-ttl-secs",
            "6",
        ];
        workers.push(service("turbine-worker", &args, &[], false).await);
    }
    let mut kv_index = start_kv_index(&redis_url, "127.0.0.1:0").await;
    let kv_index_addr = kv_index.addresses().grpc.to_string();
    let kv_index_client = KvIndexClient::connect(&kv_index.grpc_endpoint()).unwrap();
    let args = ["--redis", &redis_url, "--namespace", "kv", "--policy", "kv", "--kv-index", &kv_index.grpc_endpoint()];
    let router = service("turbine-router", &args, &[], false).await;
    until_registered(&router, 3).await;
    let router_admin = router.admin_url();
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;

    let mut failed = 0;
    let mut turn = 0;
    // Healthy: after the first turn every turn lands on its prefix.
    round(&base, turn, &mut failed).await;
    for _ in 0..3 {
        // Events reach the kv-index through Redis asynchronously.
        wait_until("the kv-index learns the last turn", Duration::from_secs(10), async || indexed(&kv_index_client, turn).await).await;
        turn += 1;
        assert_eq!(round(&base, turn, &mut failed).await, CONVERSATIONS, "turn {turn}: every conversation hits its prefix");
    }

    // kv-index killed: routing by load, nothing fails.
    kv_index.kill();
    for _ in 0..2 {
        turn += 1;
        round(&base, turn, &mut failed).await;
    }
    assert!(metric(&router_admin, "turbine_router_kv_index_errors_total").await > 0.0, "the router noticed the kv-index was gone");
    assert_eq!(failed, 0, "no request failed while the kv-index was down");

    // Restarted at the same address: from the snapshot and the log it knows
    // the turns routed while it was down, and every turn hits again.
    let restarted = start_kv_index(&redis_url, &kv_index_addr).await;
    wait_until("the restarted kv-index catches up with the log", Duration::from_secs(10), async || indexed(&kv_index_client, turn).await).await;
    let took = wait_until("every conversation hits again after the kv-index restarted", Duration::from_secs(10), async || {
        turn += 1;
        round(&base, turn, &mut failed).await == CONVERSATIONS
    })
    .await;
    println!("every conversation hit again {took:?} after the kv-index caught up");

    // Redis killed: the kv-index's answers go stale, routing by load,
    // nothing fails; Redis back (empty): workers re-register, events flow.
    let redis_port = redis.port();
    let errors_before = metric(&router_admin, "turbine_router_kv_index_errors_total").await;
    redis.kill();
    wait_until("the router reports its registry gone", Duration::from_secs(10), async || serving(&router).await == ServingStatus::NotServing).await;
    for _ in 0..2 {
        turn += 1;
        round(&base, turn, &mut failed).await;
    }
    assert_eq!(failed, 0, "no request failed while Redis was down");
    let errors = metric(&router_admin, "turbine_router_kv_index_errors_total").await;
    assert!(errors > errors_before, "the kv-index reported its answers stale while its log was down");
    let _redis = RedisServer::start_on(redis_port);
    // The router lists the empty new Redis before the workers' next lease
    // renewal re-registers them: it keeps them meanwhile.
    let router_client = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    wait_until("the router answers on the new Redis", Duration::from_secs(10), async || {
        assert_eq!(router_client.workers(None).await.unwrap().len(), 3, "the router kept every worker while Redis came back empty");
        serving(&router).await == ServingStatus::Serving
    })
    .await;
    let took = wait_until("every conversation hits again after Redis restarted", Duration::from_secs(15), async || {
        turn += 1;
        round(&base, turn, &mut failed).await == CONVERSATIONS
    })
    .await;
    println!("every conversation hit again {took:?} after the router saw Redis back");
    assert_eq!(failed, 0);
    drop((restarted, workers, gateway));
}
