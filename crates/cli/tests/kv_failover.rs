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
use std::time::{Duration, Instant};

use common::{metric, post, wait_for_model};
use serde_json::json;
use turbine_testkit::{ChildProcess, RedisServer, STARTUP_TIMEOUT, free_port, workspace_binary};

const BLOCK: usize = 16;
const CONVERSATIONS: usize = 6;

fn spawn(binary: &str, args: &[&str]) -> ChildProcess {
    let mut command = Command::new(workspace_binary(binary));
    command.args(args);
    ChildProcess::spawn(binary, command)
}

fn start_kv_index(redis: &str, port: u16) -> ChildProcess {
    let grpc = format!("127.0.0.1:{port}");
    let args = ["--grpc-addr", &grpc, "--admin-addr", "127.0.0.1:0", "--redis", redis, "--namespace", "kv", "--snapshot-interval-secs", "0.5"];
    let mut process = spawn("turbine-kv-index", &args);
    process.wait_for_line("kv-index listening", STARTUP_TIMEOUT);
    process
}

/// Turn `turn` of conversation `c`: the previous turn's prompt plus two
/// blocks (token ids of its own per conversation).
fn prompt(c: usize, turn: usize) -> Vec<u32> {
    (0..BLOCK * 2 * (turn + 1)).map(|i| (1000 + c * 5000 + i) as u32).collect()
}

/// Sends one turn; returns (HTTP status, cached prompt tokens).
async fn send(base: &str, c: usize, turn: usize) -> (u16, u64) {
    let body = json!({"model": "smollm2-135m", "prompt": prompt(c, turn), "max_tokens": 2, "ignore_eos": true});
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

#[tokio::test]
async fn kv_routing_survives_the_kv_index_and_redis_being_killed() {
    let mut redis = RedisServer::start();
    let redis_url = redis.url();
    let mut workers = Vec::new();
    for index in 0..3 {
        let id = format!("worker-{index}");
        let args = [
            "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--engine", "mock", "--speedup", "1000", "--block-size", "16",
            "--redis", &redis_url, "--namespace", "kv", "--worker-id", &id, "--lease-ttl-secs", "6",
        ];
        let mut process = spawn("turbine-worker", &args);
        process.wait_for_line("worker ready", STARTUP_TIMEOUT);
        workers.push(process);
    }
    let kv_index_port = free_port();
    let mut kv_index = start_kv_index(&redis_url, kv_index_port);
    let (router_port, router_admin) = (free_port(), free_port());
    let kv_index_url = format!("http://127.0.0.1:{kv_index_port}");
    let args = [
        "--grpc-addr", &format!("127.0.0.1:{router_port}"), "--admin-addr", &format!("127.0.0.1:{router_admin}"), "--redis", &redis_url,
        "--namespace", "kv", "--policy", "kv", "--kv-index", &kv_index_url,
    ];
    let mut router = spawn("turbine-router", &args);
    router.wait_for_line("router listening", STARTUP_TIMEOUT);
    let router_admin = format!("http://127.0.0.1:{router_admin}");
    let http_port = free_port();
    let args = ["--http-addr", &format!("127.0.0.1:{http_port}"), "--grpc-addr", "127.0.0.1:0", "--router", &format!("127.0.0.1:{router_port}")];
    let mut gateway = spawn("turbine-gateway", &args);
    gateway.wait_for_line("gateway listening", STARTUP_TIMEOUT);
    let base = format!("http://127.0.0.1:{http_port}");
    wait_for_model(&base).await;
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    while metric(&router_admin, "turbine_router_live_workers").await < 3.0 {
        assert!(Instant::now() < deadline, "workers never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut failed = 0;
    let mut turn = 0;
    // Healthy: after the first turn every turn lands on its prefix.
    round(&base, turn, &mut failed).await;
    for _ in 0..3 {
        turn += 1;
        // Events reach the kv-index through Redis asynchronously.
        tokio::time::sleep(Duration::from_millis(300)).await;
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

    // Restarted: from the snapshot and the log it knows the turns routed
    // while it was down, and every turn hits again.
    let mut restarted = start_kv_index(&redis_url, kv_index_port);
    let restarted_at = Instant::now();
    loop {
        turn += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
        if round(&base, turn, &mut failed).await == CONVERSATIONS {
            break;
        }
        if restarted_at.elapsed() > Duration::from_secs(10) {
            eprintln!("router:\n{}\nkv-index:\n{}", router.drain().join("\n"), restarted.drain().join("\n"));
            panic!("hits did not come back within 10 s of the restart");
        }
    }
    println!("every conversation hit again {:?} after the kv-index restarted", restarted_at.elapsed());

    // Redis killed: the kv-index's answers go stale, routing by load,
    // nothing fails; Redis back (empty): workers re-register, events flow.
    let redis_port = redis.port();
    let errors_before = metric(&router_admin, "turbine_router_kv_index_errors_total").await;
    redis.kill();
    for _ in 0..2 {
        turn += 1;
        round(&base, turn, &mut failed).await;
    }
    assert_eq!(failed, 0, "no request failed while Redis was down");
    let errors = metric(&router_admin, "turbine_router_kv_index_errors_total").await;
    assert!(errors > errors_before, "the kv-index reported its answers stale while its log was down");
    let _redis = RedisServer::start_on(redis_port);
    let back_at = Instant::now();
    // Long enough for the router to list the empty new Redis (it polls
    // every 250 ms), before the workers' next lease renewal re-registers
    // them: the router must keep them meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    loop {
        turn += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
        if round(&base, turn, &mut failed).await == CONVERSATIONS {
            break;
        }
        assert!(back_at.elapsed() < Duration::from_secs(15), "hits did not come back within 15 s of Redis");
    }
    println!("every conversation hit again {:?} after Redis restarted", back_at.elapsed());
    assert_eq!(failed, 0);
    assert!(router.drain().iter().any(|line| line.contains("Redis restarted")), "the router noticed the registry's restart");
}
