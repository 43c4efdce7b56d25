//! The planner sizing a real fleet: `turbine-router`, `turbine-gateway`
//! and `turbine-planner` as processes on a real Redis, the planner's
//! `local` connector starting `turbine-worker` processes (the real-time
//! mocker). The planner brings the pool to its minimum; a worker killed
//! with SIGKILL is replaced at a later interval (under a new name, the
//! decision saying why), the gateway keeps serving, and the fleet is back
//! at its size. A planner SIGKILLed while it starts workers, restarted on
//! the same Postgres and state folder, adopts them and finishes the action
//! without starting any worker twice; with Postgres down under it, it
//! replaces a worker that crashed meanwhile and records that decision once
//! the database is back.

mod common;

use std::path::Path;
use std::time::Duration;

use std::time::Instant;

use common::{MODEL, post, service, until_listed, wait_until};
use serde_json::json;
use turbine_planner::{ActionState, PlannerClient, PoolKind, PoolLimits, Predictor, Targets};
use turbine_registry::{RedisRegistry, Registry};
use turbine_testkit::{PostgresServer, RedisServer, ServiceProcess};

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
    let mut ids: Vec<String> =
        registry.list().await.map(|workers| workers.into_iter().map(|live| live.record.worker_id.to_string()).collect()).unwrap_or_default();
    ids.sort();
    ids
}

/// Redis, a router and a gateway as processes; the planner's profile and
/// its local workers' state folder.
struct Stack {
    redis: RedisServer,
    _router: ServiceProcess,
    _gateway: ServiceProcess,
    base: String,
    dir: tempfile::TempDir,
}

impl Stack {
    async fn start() -> Self {
        let redis = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let decode: Vec<_> = [(256, 1, 2.0), (256, 16, 4.0), (4096, 1, 2.0), (4096, 16, 4.0)]
            .into_iter()
            .map(|(context, concurrency, itl_ms)| json!({"context": context, "concurrency": concurrency, "itl_ms": itl_ms}))
            .collect();
        let profile = json!({"version": 1, "worker": "test", "prefill": [{"isl": 128, "ttft_ms": 50.0}, {"isl": 4096, "ttft_ms": 50.0}], "decode": decode});
        std::fs::write(dir.path().join("profile.json"), profile.to_string()).unwrap();
        let router = service("turbine-router", &["--redis", &redis.url(), "--namespace", NAMESPACE, "--policy", "round-robin"], &[], false).await;
        let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
        let base = gateway.http_url();
        Self { redis, _router: router, _gateway: gateway, base, dir }
    }

    fn state(&self) -> std::path::PathBuf {
        self.dir.path().join("workers")
    }

    /// A planner on `database` with the local connector.
    async fn planner(&self, database: &str) -> (ServiceProcess, PlannerClient) {
        let metrics = format!("{}/metrics", self.base);
        let profile = self.dir.path().join("profile.json");
        let state = self.state();
        let args = [
            "--redis",
            &self.redis.url(),
            "--namespace",
            NAMESPACE,
            "--database",
            database,
            "--gateway-metrics",
            &metrics,
            "--profile",
            profile.to_str().unwrap(),
            "--connector",
            "local",
            "--local-worker-args=--engine mock --speedup 50 --lease-ttl-secs 2",
            "--local-state-dir",
            state.to_str().unwrap(),
        ];
        let planner = service("turbine-planner", &args, &[], false).await;
        let client = PlannerClient::connect(&planner.grpc_endpoint()).unwrap();
        (planner, client)
    }

    fn registry(&self) -> Registry {
        Registry::Redis(RedisRegistry::new(&self.redis.url(), NAMESPACE).unwrap())
    }
}

/// One aggregated pool of `min` to 3 workers, 1-second intervals and a
/// long cool-down (a replacement must not wait for it).
fn targets(min: u32) -> Targets {
    let pool = PoolLimits { pool: "workers".into(), kind: PoolKind::Aggregated, min_replicas: min, max_replicas: 3 };
    Targets::new(2000.0, 50.0, 90.0, vec![pool], 3, Duration::from_secs(1), Duration::from_secs(3600), Predictor::Constant).unwrap()
}

fn names(workers: &[&str]) -> Vec<String> {
    workers.iter().map(|number| format!("{NAMESPACE}-workers-{number}")).collect()
}

fn recorded(dir: &Path) -> Vec<String> {
    records(dir).into_iter().map(|(name, _)| name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_replaces_a_worker_that_crashed() {
    let stack = Stack::start().await;
    let state = stack.state();
    let _fleet = Fleet(&state);
    let database = format!("sqlite:{}", stack.dir.path().join("planner.db").display());
    let (_planner, client) = stack.planner(&database).await;
    // Two workers at least: an idle deployment is held at its minimum.
    client.set_targets(&targets(2)).await.unwrap();

    let registry = stack.registry();
    let first = names(&["0", "1"]);
    wait_until("the planner starts the pool's two workers", Duration::from_secs(120), async || registered(&registry).await == first).await;
    until_listed(&stack.base).await;
    let ask = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": true});
    let (status, body) = post(&stack.base, "/v1/completions", &ask).await;
    assert_eq!(status, 200, "{body}");

    // A crash: the newest worker is killed outright (it never deregisters).
    let crashed = records(&state).into_iter().find(|(name, _)| *name == first[1]).expect("the worker's record");
    kill(crashed.1);
    let replaced = names(&["0", "2"]);
    wait_until("the planner replaces the crashed worker", Duration::from_secs(120), async || {
        recorded(&state) == replaced && registered(&registry).await == replaced
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
        let (status, body) = post(&stack.base, "/v1/completions", &ask).await;
        assert_eq!(status, 200, "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_killed_while_it_starts_workers_resumes_from_postgres_and_starts_none_twice() {
    let stack = Stack::start().await;
    let state = stack.state();
    let _fleet = Fleet(&state);
    let mut postgres = PostgresServer::start();
    postgres.create_database("planner");
    let database = postgres.url("planner");
    let (mut planner, client) = stack.planner(&database).await;
    client.set_targets(&targets(2)).await.unwrap();

    // SIGKILL as soon as the first worker of the action is spawned (its
    // record is written before it serves).
    let deadline = Instant::now() + Duration::from_secs(120);
    while records(&state).is_empty() {
        assert!(Instant::now() < deadline, "the planner started no worker");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    planner.kill();
    assert_eq!(recorded(&state), names(&["0"]), "killed with the action half done");
    assert!(client.history(10, None).await.is_err(), "the planner is gone");

    // Restarted: it adopts what runs and carries the pending action out
    // under its id; the fleet is the two workers, named once each.
    let (_planner, client) = stack.planner(&database).await;
    let registry = stack.registry();
    let fleet = names(&["0", "1"]);
    wait_until("the restarted planner completes the pool", Duration::from_secs(120), async || {
        recorded(&state) == fleet && registered(&registry).await == fleet
    })
    .await;
    let settled = async || {
        let decisions = client.history(1000, None).await.unwrap().decisions;
        decisions.iter().flat_map(|decision| &decision.pools).filter_map(|pool| pool.action.clone()).all(|action| action.state != ActionState::Pending)
            && decisions.len() >= 5
    };
    wait_until("a few decisions after the restart, no action pending", Duration::from_secs(60), settled).await;
    let decisions = client.history(1000, None).await.unwrap().decisions;
    let actions: Vec<_> = decisions.iter().flat_map(|decision| &decision.pools).filter_map(|pool| pool.action.clone()).collect();
    let done: Vec<_> = actions.iter().filter(|action| action.state == ActionState::Done).collect();
    assert_eq!(done.len(), 1, "one action brought the pool to 2: {actions:#?}");
    assert_eq!(done[0].replicas, 2);
    assert_eq!(recorded(&state), fleet, "no worker started twice");
    assert_eq!(std::fs::read_to_string(state.join("next-worker")).unwrap().trim(), "2", "no third worker was ever started");

    // Postgres down under it: the planner goes on from memory. A worker
    // that crashes meanwhile is replaced (a scale-up on what it observes)
    // while the database is still down.
    let last = decisions[0].id;
    postgres.kill();
    assert!(client.plan().await.is_err(), "no plan without the database");
    let crashed = records(&state).into_iter().find(|(name, _)| *name == fleet[1]).expect("the worker's record");
    kill(crashed.1);
    let replaced = names(&["0", "2"]);
    wait_until("the planner replaces the crashed worker with its database down", Duration::from_secs(120), async || {
        recorded(&state) == replaced && registered(&registry).await == replaced
    })
    .await;
    assert!(client.plan().await.is_err(), "the database is still down");

    // Back: the decisions made meanwhile are recorded, in order, each id
    // once, the replacement's action done; then the planner decides from
    // the ledger again.
    postgres.restart();
    wait_until("decisions resume after Postgres is back", Duration::from_secs(60), async || {
        client
            .history(1, None)
            .await
            .is_ok_and(|page| page.decisions.first().is_some_and(|decision| decision.id > last && !decision.reason.contains("database was unreachable")))
    })
    .await;
    let decisions = client.history(1000, None).await.unwrap().decisions;
    let ids: Vec<u64> = decisions.iter().map(|decision| decision.id).collect();
    assert!(ids.windows(2).all(|pair| pair[0] > pair[1]), "each id once, newest first: {ids:?}");
    let from_memory: Vec<_> =
        decisions.iter().filter(|decision| decision.id > last && decision.reason.contains("decided while the database was unreachable")).collect();
    let replacement = from_memory
        .iter()
        .flat_map(|decision| &decision.pools)
        .find(|pool| pool.current_replicas == 1 && pool.desired_replicas == 2)
        .unwrap_or_else(|| panic!("no decision from memory replaced the worker: {decisions:#?}"));
    let action = replacement.action.as_ref().expect("the replacement's action");
    assert_eq!(action.state, ActionState::Done, "{action:?}");
    assert!(action.message.contains(&replaced[1]), "{action:?}");
    assert_eq!(registered(&registry).await, replaced);
    assert_eq!(recorded(&state), replaced);
    let (status, body) = post(&stack.base, "/v1/completions", &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": true})).await;
    assert_eq!(status, 200, "{body}");
}
