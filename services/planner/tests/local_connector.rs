//! The `local` connector with real `turbine-worker` processes (the
//! real-time mocker) on a real Redis: scaling up starts workers that serve
//! and register with the pool's role; an action handed over again starts
//! nothing more; scaling down drains the newest worker: it leaves the
//! registry and a stream in flight on it finishes whole; a connector
//! opened again on the same folder (a restarted planner) adopts the
//! workers still running; a worker that cannot start fails the action,
//! naming its log.

use std::path::Path;
use std::time::Duration;

use turbine_planner::act::connector::Outcome;
use turbine_planner::act::local::{LocalConnector, LocalSettings};
use turbine_planner::{Action, ActionState, PoolKind};
use turbine_proto::worker::v1::{self as pb, worker_client::WorkerClient};
use turbine_registry::{RedisRegistry, Registry, WorkerRole};
use turbine_testkit::{RedisServer, STARTUP_TIMEOUT, wait_until, workspace_binary};

const NAMESPACE: &str = "local-test";

fn settings(redis: &RedisServer, state_dir: &Path, worker_args: &[&str]) -> LocalSettings {
    LocalSettings {
        worker_binary: workspace_binary("turbine-worker"),
        worker_subcommand: None,
        worker_args: worker_args.iter().map(|arg| (*arg).to_owned()).collect(),
        state_dir: state_dir.to_owned(),
        redis: redis.url(),
        namespace: NAMESPACE.into(),
        ready_timeout: STARTUP_TIMEOUT,
        drain_timeout: Duration::from_secs(60),
    }
}

fn action(decision: u64, replicas: u32) -> Action {
    Action { id: Action::id_for(NAMESPACE, decision, "decode"), pool: "decode".into(), replicas, state: ActionState::Pending, message: String::new() }
}

/// Kills every worker the state folder records, whatever the test did.
struct Fleet<'a>(&'a Path);

impl Drop for Fleet<'_> {
    fn drop(&mut self) {
        for entry in std::fs::read_dir(self.0).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            if let Some(pid) = serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|record| record["pid"].as_u64()) {
                let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}

async fn registered(registry: &Registry) -> Vec<(String, WorkerRole, String)> {
    let mut workers: Vec<_> =
        registry.list().await.unwrap().into_iter().map(|live| (live.record.worker_id.to_string(), live.record.role, live.record.endpoint)).collect();
    workers.sort_by(|a, b| a.0.cmp(&b.0));
    workers
}

fn done(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Done(message) => message,
        other => panic!("not done: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_workers_start_drain_and_are_adopted_after_a_restart() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let _fleet = Fleet(dir.path());
    let settings = settings(&redis, dir.path(), &["--engine", "mock", "--speedup", "1", "--lease-ttl-secs", "2"]);
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), NAMESPACE).unwrap());
    let connector = LocalConnector::open(settings.clone()).unwrap();

    // Up to two: both serve, registered as decode workers.
    let up = connector.execute(&action(1, 2), PoolKind::Decode).await;
    assert!(done(&up).contains("started local-test-decode-0, local-test-decode-1"), "{up:?}");
    let workers = registered(&registry).await;
    assert_eq!(
        workers.iter().map(|(id, role, _)| (id.as_str(), *role)).collect::<Vec<_>>(),
        [("local-test-decode-0", WorkerRole::Decode), ("local-test-decode-1", WorkerRole::Decode)]
    );
    // Handed over again (as after a restart): the same answer, nothing started.
    assert_eq!(connector.execute(&action(1, 2), PoolKind::Decode).await, up);
    assert_eq!(connector.serving("decode"), 2);
    // Their processes count for any connector on the folder.
    assert_eq!((connector.running(), LocalConnector::open(settings.clone()).unwrap().running()), (2, 2));

    // A stream in flight on the newest worker finishes through its drain.
    let newest = workers[1].2.clone();
    let mut client = WorkerClient::connect(newest).await.unwrap();
    let request = pb::GenerateRequest {
        request_id: "drain".into(),
        prompt_token_ids: (0..200).map(|i| 100 + i).collect(),
        sampling: None,
        stop: Some(pb::StopConditions { max_tokens: 150, stop_token_ids: vec![], ignore_eos: true }),
        remote_prefill: None,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut tokens = stream.message().await.unwrap().unwrap().token_ids.len();
    let down = connector.execute(&action(2, 1), PoolKind::Decode).await;
    assert!(done(&down).contains("draining local-test-decode-1"), "{down:?}");
    assert_eq!(connector.serving("decode"), 1);
    assert_eq!(connector.running(), 2, "a draining worker still runs");
    assert_eq!(connector.running_by_pool(), std::collections::BTreeMap::from([("decode".to_owned(), 2)]));
    wait_until("the draining worker leaves the registry", Duration::from_secs(30), async || registered(&registry).await.len() == 1).await;
    let finish = loop {
        let message = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("tokens keep coming")
            .expect("the stream is not cut")
            .expect("a finish reason before the end");
        tokens += message.token_ids.len();
        if message.finish_reason() != pb::FinishReason::Unspecified {
            break message.finish_reason();
        }
    };
    assert_eq!((tokens, finish), (150, pb::FinishReason::Length));
    wait_until("the drained worker exits", Duration::from_secs(60), async || connector.draining() == 0).await;
    assert_eq!(connector.running(), 1);

    // A restarted planner adopts the worker still running, and numbers the
    // next one after every name used.
    drop(connector);
    let connector = LocalConnector::open(settings.clone()).unwrap();
    assert_eq!(connector.serving("decode"), 1);
    let up = connector.execute(&action(3, 2), PoolKind::Decode).await;
    assert!(done(&up).contains("started local-test-decode-2"), "{up:?}");
    let ids: Vec<String> = registered(&registry).await.into_iter().map(|(id, _, _)| id).collect();
    assert_eq!(ids, ["local-test-decode-0", "local-test-decode-2"]);
    // Down to none drains the adopted worker too.
    done(&connector.execute(&action(4, 0), PoolKind::Decode).await);
    wait_until("every worker drains and exits", Duration::from_secs(60), async || connector.draining() == 0).await;
    wait_until("the registry empties", Duration::from_secs(30), async || registered(&registry).await.is_empty()).await;
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().flatten().filter(|entry| entry.path().extension().is_some_and(|ext| ext == "worker")).count(),
        0,
        "no records left"
    );

    // A worker that cannot start fails the action, naming its log.
    let broken_dir = tempfile::tempdir().unwrap();
    let _broken_fleet = Fleet(broken_dir.path());
    let broken = LocalConnector::open(self::settings(&redis, broken_dir.path(), &["--no-such-flag"])).unwrap();
    match broken.execute(&action(5, 1), PoolKind::Decode).await {
        Outcome::Failed(message) => assert!(message.contains("exited") && message.contains(".log"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(broken.serving("decode"), 0);
}
