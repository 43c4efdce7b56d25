//! The planner sizing a real fleet: `turbine-router`, `turbine-gateway`
//! and `turbine-planner` as processes on a real Redis, the planner's
//! `local` connector starting `turbine-worker` processes (the real-time
//! mocker). The planner brings the pool to its minimum; a worker killed
//! with SIGKILL is replaced at a later interval (under a new name, the
//! decision saying why), the gateway keeps serving, and the fleet is back
//! at its size.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{MODEL, post, service, until_listed, wait_until};
use serde_json::json;
use turbine_planner::{PlannerClient, PoolKind, PoolLimits, Predictor, Targets};
use turbine_registry::{RedisRegistry, Registry};
use turbine_testkit::RedisServer;

const NAMESPACE: &str = "fleet";

/// The local workers' records in the state folder: (name, pid).
fn records(dir: &Path) -> Vec<(String, u32)> {
    let mut records: Vec<(String, u32)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().extension().is_some_and(|extension| extension == "worker"))
        .filter_map(|entry| {
            let record: serde_json::Value = serde_json::from_slice(&std::fs::read(entry.path()).ok()?).ok()?;
            Some((record["name"].as_str()?.to_owned(), u32::try_from(record["pid"].as_u64()?).ok()?))
        })
        .collect();
    records.sort();
    records
}

fn kill(pid: u32) {
    let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
}

/// Kills every worker the state folder records, whatever the test did
/// (local workers outlive their planner by design).
struct Fleet<'a>(&'a Path);

impl Drop for Fleet<'_> {
    fn drop(&mut self) {
        for (_, pid) in records(self.0) {
            kill(pid);
        }
    }
}

async fn registered(registry: &Registry) -> Vec<String> {
    let mut ids: Vec<String> = registry.list().await.map(|workers| workers.into_iter().map(|live| live.record.worker_id.to_string()).collect()).unwrap_or_default();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_replaces_a_worker_that_crashed() {
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("workers");
    let _fleet = Fleet(&state);
    let profile = dir.path().join("profile.json");
    let decode: Vec<_> = [(256, 1, 2.0), (256, 16, 4.0), (4096, 1, 2.0), (4096, 16, 4.0)]
        .into_iter()
        .map(|(context, concurrency, itl_ms)| json!({"context": context, "concurrency": concurrency, "itl_ms": itl_ms}))
        .collect();
    let written = json!({"version": 1, "worker": "test", "prefill": [{"isl": 128, "ttft_ms": 50.0}, {"isl": 4096, "ttft_ms": 50.0}], "decode": decode});
    std::fs::write(&profile, written.to_string()).unwrap();

    let router = service("turbine-router", &["--redis", &url, "--namespace", NAMESPACE, "--policy", "round-robin"], &[], false).await;
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
    let base = gateway.http_url();
    let database = format!("sqlite:{}", dir.path().join("planner.db").display());
    let metrics = format!("{base}/metrics");
    let planner = service(
        "turbine-planner",
        &[
            "--redis",
            &url,
            "--namespace",
            NAMESPACE,
            "--database",
            &database,
            "--gateway-metrics",
            &metrics,
            "--profile",
            profile.to_str().unwrap(),
            "--connector",
            "local",
            "--local-worker-args=--engine mock --speedup 50 --lease-ttl-secs 2",
            "--local-state-dir",
            state.to_str().unwrap(),
        ],
        &[],
        false,
    )
    .await;
    let client = PlannerClient::connect(&planner.grpc_endpoint()).unwrap();
    // Two workers at least: an idle deployment is held at its minimum. A
    // long cool-down: the replacement must not wait for it.
    let pool = PoolLimits { pool: "workers".into(), kind: PoolKind::Aggregated, min_replicas: 2, max_replicas: 3 };
    let targets = Targets::new(2000.0, 50.0, 90.0, vec![pool], 3, Duration::from_secs(1), Duration::from_secs(3600), Predictor::Constant).unwrap();
    client.set_targets(&targets).await.unwrap();

    let registry = Registry::Redis(RedisRegistry::new(&url, NAMESPACE).unwrap());
    let first = [format!("{NAMESPACE}-workers-0"), format!("{NAMESPACE}-workers-1")];
    wait_until("the planner starts the pool's two workers", Duration::from_secs(120), async || registered(&registry).await == first).await;
    until_listed(&base).await;
    let ask = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": true});
    let (status, body) = post(&base, "/v1/completions", &ask).await;
    assert_eq!(status, 200, "{body}");

    // A crash: the newest worker is killed outright (it never deregisters).
    let crashed = records(&state).into_iter().find(|(name, _)| *name == first[1]).expect("the worker's record");
    kill(crashed.1);
    let replaced = [format!("{NAMESPACE}-workers-0"), format!("{NAMESPACE}-workers-2")];
    wait_until("the planner replaces the crashed worker", Duration::from_secs(120), async || {
        records(&state).iter().map(|(name, _)| name.clone()).collect::<Vec<_>>() == replaced && registered(&registry).await == replaced
    })
    .await;
    let decisions = client.history(100, None).await.unwrap().decisions;
    let replacement = decisions
        .iter()
        .flat_map(|decision| &decision.pools)
        .find(|pool| pool.current_replicas == 1 && pool.desired_replicas == 2)
        .unwrap_or_else(|| panic!("no decision replaced the worker: {decisions:#?}"));
    assert!(replacement.reason.contains("workers runs 1, not the 2 decided"), "{}", replacement.reason);
    assert!(replacement.action.as_ref().is_some_and(|action| action.message.contains(&replaced[1])), "{replacement:?}");
    for _ in 0..4 {
        let (status, body) = post(&base, "/v1/completions", &ask).await;
        assert_eq!(status, 200, "{body}");
    }
}
