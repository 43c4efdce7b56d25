//! The `virtual` connector over real sockets, on a real PostgreSQL and on
//! SQLite: a decision's action is published and stays pending until an
//! external system reports it with CompleteAction (bad reports refused by
//! field, a second report of the same outcome accepted, a different one
//! refused); a newer action on a pool supersedes the older pending one; a
//! restarted planner hands the newest pending action of each pool over
//! again, under the same id.

use std::time::Duration;

use tonic::Code;
use turbine_planner::act::connector::{self, Connector};
use turbine_planner::{Action, ActionState, Decision, Ledger, PlannerClient, PlannerClientError, PlannerState, PoolDecision};
use turbine_proto::planner::v1 as pb;
use turbine_runtime::CancellationToken;
use turbine_testkit::{PostgresServer, STARTUP_TIMEOUT};

const SERVICE: &str = "turbine.planner.v1.Planner";

/// A decision asking `pool` for `replicas`, its action pending.
fn decision(namespace: &str, id: u64, pool: &str, replicas: u32) -> Decision {
    Decision {
        id,
        at_unix_ms: 1_764_000_000_000 + id as i64 * 30_000,
        observed: Vec::new(),
        predicted: None,
        pools: vec![PoolDecision {
            pool: pool.into(),
            current_replicas: 2,
            proposed_replicas: replicas,
            desired_replicas: replicas,
            reason: "test".into(),
            action: Some(Action { id: Action::id_for(namespace, id, pool), pool: pool.into(), replicas, state: ActionState::Pending, message: String::new() }),
        }],
        reason: format!("decision {id}"),
        paused: false,
    }
}

/// Records `decision` and hands its actions to the state's connector, as
/// the cycle does.
async fn decide(state: &PlannerState, decision: Decision) -> Action {
    let action = decision.pools[0].action.clone().unwrap();
    state.record(decision).await.unwrap();
    connector::execute(state.ledger(), state.connector(), std::slice::from_ref(&action)).await.unwrap();
    state.ledger().action(&action.id).await.unwrap().unwrap()
}

fn code(error: PlannerClientError) -> (Code, String) {
    match error {
        PlannerClientError::Call { code, message } => (code.into(), message),
        other => panic!("{other}"),
    }
}

async fn serve(database: &str) -> (PlannerState, PlannerClient, String, CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let state = PlannerState::with_connector(Ledger::open(database, "test").await.unwrap(), Connector::Virtual);
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let config = turbine_planner::PlannerConfig {
        planning: turbine_planner::config::PlanningConfig { database: Some(database.to_owned()), ..Default::default() },
        ..Default::default()
    };
    let serving = tokio::spawn(turbine_planner::serve(config, state.clone(), None, listeners, shutdown.clone()));
    tokio::time::timeout(STARTUP_TIMEOUT, turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Planner, SERVICE))
        .await
        .expect("the planner serves");
    (state, PlannerClient::connect(&endpoint).unwrap(), endpoint, shutdown, serving)
}

async fn virtual_actions_are_reported_once_and_resumed_after_a_restart(database: &str) {
    let (state, client, endpoint, shutdown, serving) = serve(database).await;

    // Published: pending, saying what the external system is to do.
    let first = decide(&state, decision("test", 1, "decode", 4)).await;
    assert_eq!(first.state, ActionState::Pending);
    assert!(first.message.contains("set decode to 4 replicas"), "{}", first.message);

    // Bad reports are refused by field; the action stays pending.
    let raw = |id: &str, state: pb::ActionState, message: &str| pb::CompleteActionRequest { id: id.into(), state: state as i32, message: message.into() };
    let mut grpc = pb::planner_client::PlannerClient::connect(endpoint).await.unwrap();
    for (request, field) in [
        (raw(&first.id, pb::ActionState::Pending, ""), "state"),
        (raw(&first.id, pb::ActionState::Unspecified, ""), "state"),
        (pb::CompleteActionRequest { id: first.id.clone(), state: 42, message: String::new() }, "state"),
        (raw("", pb::ActionState::Done, ""), "id"),
        (raw(&first.id, pb::ActionState::Done, &"x".repeat(2000)), "message"),
    ] {
        let status = grpc.complete_action(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    let (code_of, message) = code(client.complete_action("test/99/decode", ActionState::Done, "").await.unwrap_err());
    assert_eq!(code_of, Code::NotFound, "{message}");
    let (code_of, _) = code(client.complete_action("other/1/decode", ActionState::Done, "").await.unwrap_err());
    assert_eq!(code_of, Code::NotFound, "another namespace's ids are not this planner's");
    assert_eq!(state.ledger().action(&first.id).await.unwrap().unwrap().state, ActionState::Pending);

    // Reported done; the same report again is accepted, another refused.
    let done = client.complete_action(&first.id, ActionState::Done, "decode at 4").await.unwrap();
    assert_eq!((done.state, done.message.as_str(), done.replicas), (ActionState::Done, "decode at 4", 4));
    assert_eq!(client.complete_action(&first.id, ActionState::Done, "decode at 4").await.unwrap(), done);
    let (code_of, message) = code(client.complete_action(&first.id, ActionState::Failed, "no").await.unwrap_err());
    assert_eq!(code_of, Code::FailedPrecondition, "{message}");
    assert!(message.contains("already ended done"), "{message}");
    let history = client.history(1, None).await.unwrap();
    assert_eq!(history.decisions[0].pools[0].action.as_ref(), Some(&done), "History shows the outcome");

    // A newer action on the pool supersedes the pending one: it can no
    // longer be reported done.
    let second = decide(&state, decision("test", 2, "decode", 6)).await;
    let third = decide(&state, decision("test", 3, "decode", 5)).await;
    let superseded = state.ledger().action(&second.id).await.unwrap().unwrap();
    assert_eq!(superseded.state, ActionState::Failed);
    assert!(superseded.message.contains(&format!("superseded by {}", third.id)), "{}", superseded.message);
    let (code_of, _) = code(client.complete_action(&second.id, ActionState::Done, "").await.unwrap_err());
    assert_eq!(code_of, Code::FailedPrecondition);

    // Stopped with two pending actions on another pool, and the newest on
    // decode pending: a restarted planner hands over the newest of each
    // pool again, under the same id, and supersedes the older.
    let prefill_old = decide(&state, decision("test", 4, "prefill", 2)).await;
    let prefill_new = decide(&state, decision("test", 5, "prefill", 3)).await;
    // (As if the planner had stopped between recording and superseding.)
    state.ledger().set_action_state(&prefill_old.id, ActionState::Pending, "", 0).await.unwrap();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), serving).await.unwrap().unwrap().unwrap();

    let (state, client, _, shutdown, serving) = serve(database).await;
    connector::resume(state.ledger(), state.connector()).await.unwrap();
    let pending: Vec<String> = state.ledger().pending_actions().await.unwrap().into_iter().map(|action| action.id).collect();
    assert_eq!(pending, [third.id.clone(), prefill_new.id.clone()]);
    assert!(state.ledger().action(&prefill_old.id).await.unwrap().unwrap().message.contains("superseded"));
    let reported = client.complete_action(&third.id, ActionState::Failed, "quota exceeded").await.unwrap();
    assert_eq!((reported.state, reported.message.as_str()), (ActionState::Failed, "quota exceeded"));
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), serving).await.unwrap().unwrap().unwrap();
}

#[tokio::test]
async fn on_postgres_virtual_actions_are_reported_once_and_resumed_after_a_restart() {
    let postgres = PostgresServer::start();
    virtual_actions_are_reported_once_and_resumed_after_a_restart(&postgres.url("postgres")).await;
}

#[tokio::test]
async fn on_sqlite_virtual_actions_are_reported_once_and_resumed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    virtual_actions_are_reported_once_and_resumed_after_a_restart(&format!("sqlite:{}", dir.path().join("planner.sqlite").display())).await;
}

/// A planner whose connector acts itself takes no reports.
#[tokio::test]
async fn a_planner_that_acts_itself_refuses_reports() {
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite:{}", dir.path().join("planner.sqlite").display());
    let settings = turbine_planner::act::local::LocalSettings {
        worker_binary: "turbine-worker".into(),
        worker_subcommand: None,
        worker_args: Vec::new(),
        state_dir: dir.path().join("fleet"),
        redis: "redis://127.0.0.1:1/".into(),
        namespace: "test".into(),
        ready_timeout: Duration::from_secs(1),
        drain_timeout: Duration::from_secs(1),
    };
    let local = Connector::Local(turbine_planner::act::local::LocalConnector::open(settings).unwrap());
    let state = PlannerState::with_connector(Ledger::open(&database, "test").await.unwrap(), local);
    state.record(decision("test", 1, "decode", 4)).await.unwrap();
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let config = turbine_planner::PlannerConfig {
        planning: turbine_planner::config::PlanningConfig { database: Some(database), ..Default::default() },
        ..Default::default()
    };
    let serving = tokio::spawn(turbine_planner::serve(config, state, None, listeners, shutdown.clone()));
    tokio::time::timeout(STARTUP_TIMEOUT, turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Planner, SERVICE))
        .await
        .expect("the planner serves");
    let client = PlannerClient::connect(&endpoint).unwrap();
    let (code_of, message) = code(client.complete_action("test/1/decode", ActionState::Done, "").await.unwrap_err());
    assert_eq!(code_of, Code::FailedPrecondition, "{message}");
    assert!(message.contains("Local"), "{message}");
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), serving).await.unwrap().unwrap().unwrap();
}
