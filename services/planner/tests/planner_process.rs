//! The `turbine-planner` binary over real sockets, on a real PostgreSQL
//! (spawned here with `initdb` and `postgres` on a free port) and on
//! SQLite: targets and the pause switch survive a SIGKILL of the planner;
//! bad targets and bad pages get INVALID_ARGUMENT naming the field and the
//! planner keeps serving; with its database down the planner answers
//! UNAVAILABLE and recovers when the database is back; decisions recorded
//! in the ledger page through History newest first and reach watchers,
//! each action recorded once; intervals with and without latencies are
//! kept on both databases.

use std::process::Command;
use std::time::Duration;

use tokio_stream::StreamExt;
use tonic::Code;
use turbine_planner::{
    Action, ActionState, Decision, Ledger, Observation, PlannerClient, PlannerClientError, PlannerState, PoolDecision, PoolKind, PoolLimits, Prediction,
    Predictor, Targets, plan::predict::Load,
};
use turbine_proto::planner::v1 as pb;
use turbine_testkit::{PostgresServer, STARTUP_TIMEOUT, ServiceProcess, wait_until};

const SERVICE: &str = "turbine.planner.v1.Planner";

async fn start(database: &str) -> (ServiceProcess, PlannerClient) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-planner"));
    command.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--namespace", "test", "--database", database]);
    let mut process = ServiceProcess::spawn("turbine-planner", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::Planner, SERVICE, STARTUP_TIMEOUT).await.unwrap();
    let client = PlannerClient::connect(&process.grpc_endpoint()).unwrap();
    (process, client)
}

fn targets() -> Targets {
    let pool = |name: &str, kind, min, max| PoolLimits { pool: name.into(), kind, min_replicas: min, max_replicas: max };
    Targets::new(
        250.0,
        40.0,
        90.0,
        vec![pool("prefill", PoolKind::Prefill, 1, 4), pool("decode", PoolKind::Decode, 1, 6)],
        8,
        Duration::from_secs(30),
        Duration::from_secs(120),
        Predictor::Seasonal,
    )
    .unwrap()
}

fn code(error: PlannerClientError) -> (Code, String) {
    match error {
        PlannerClientError::Call { code, message } => (code.into(), message),
        other => panic!("{other}"),
    }
}

/// A decision scaling `pool` to `replicas`, its action pending.
fn decision(namespace: &str, id: u64, pool: &str, replicas: u32) -> Decision {
    let load = Load { request_rate: 3.5 * id as f64, isl_mean: 1800.0, osl_mean: 150.0 };
    Decision {
        id,
        at_unix_ms: 1_764_000_000_000 + id as i64 * 30_000,
        observed: vec![Observation {
            pool: pool.into(),
            load,
            ttft_ms: Some(310.0),
            itl_ms: Some(38.0),
            queue_depth: 4.0,
            kv_usage: 0.7,
            replicas: replicas - 1,
            running: 12,
            context_tokens: 1_150.0,
            finish_rate: 4.5,
            itl_mean_ms: Some(31.5),
            token_gap_ms: Some(30.2),
            started_isl_mean: 1_020.0,
            served_rate: 0.0,
            awaiting_first_token: 0.0,
        }],
        predicted: Some(Prediction { predictor: Predictor::MovingAverage, load }),
        pools: vec![PoolDecision {
            pool: pool.into(),
            current_replicas: replicas - 1,
            proposed_replicas: replicas + 1,
            desired_replicas: replicas,
            reason: "TTFT p90 310 ms over the 250 ms target; one step per interval".into(),
            action: Some(Action { id: Action::id_for(namespace, id, pool), pool: pool.into(), replicas, state: ActionState::Pending, message: String::new() }),
        }],
        reason: format!("decision {id}"),
        paused: false,
    }
}

/// Sets targets (refusing bad ones by field) and pauses, SIGKILLs the
/// planner and restarts it on `database`: the same targets, still paused.
/// Answers the restarted planner.
async fn targets_and_pause_survive_a_sigkill(database: &str) -> (ServiceProcess, PlannerClient) {
    let (mut process, client) = start(database).await;

    let plan = client.plan().await.unwrap();
    assert_eq!((plan.targets, plan.paused, plan.pools.len(), plan.latest), (None, false, 0, None), "a new planner has no targets");

    // Each bad field is refused by name, and the planner keeps serving.
    let valid = pb::Targets::from(&targets());
    let endpoint = process.grpc_endpoint();
    let refused = async |change: fn(&mut pb::Targets)| {
        let mut targets = valid.clone();
        change(&mut targets);
        // Sent as they are on the wire: the planner's own checks answer.
        let mut raw = pb::planner_client::PlannerClient::new(tonic::transport::Channel::from_shared(endpoint.clone()).unwrap().connect_lazy());
        let status = raw.set_targets(pb::SetTargetsRequest { targets: Some(targets) }).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{}", status.message());
        status.message().to_owned()
    };
    assert!(refused(|t| t.ttft_ms = -5.0).await.starts_with("targets.ttft_ms:"));
    assert!(refused(|t| t.percentile = 100.0).await.starts_with("targets.percentile:"));
    assert!(refused(|t| t.pools[1].min_replicas = 9).await.starts_with("targets.pools[1].min_replicas:"));
    assert!(refused(|t| t.pools[1].pool = "prefill".into()).await.starts_with("targets.pools[1].pool:"));
    assert!(refused(|t| t.budget_workers = 1).await.starts_with("targets.budget_workers:"));
    assert!(refused(|t| t.interval_secs = 0).await.starts_with("targets.interval_secs:"));
    assert!(refused(|t| t.predictor = "crystal-ball".into()).await.starts_with("targets.predictor:"));
    assert_eq!(client.plan().await.unwrap().targets, None, "nothing refused was stored");

    assert_eq!(client.set_targets(&targets()).await.unwrap(), targets());
    let paused = client.pause("load test until 14:00").await.unwrap();
    assert!(paused.paused);
    assert_eq!(
        paused.pools.iter().map(|pool| (pool.pool.as_str(), pool.kind)).collect::<Vec<_>>(),
        [("prefill", PoolKind::Prefill), ("decode", PoolKind::Decode)]
    );
    let (code_, message) = code(client.pause(&"x".repeat(2000)).await.unwrap_err());
    assert_eq!(code_, Code::InvalidArgument, "{message}");

    // History: empty, and a page token the planner did not issue is refused.
    assert_eq!(client.history(0, None).await.unwrap().decisions, []);
    assert_eq!(code(client.history(10, Some("page-2")).await.unwrap_err()).0, Code::InvalidArgument);
    assert_eq!(code(client.history(5000, None).await.unwrap_err()).0, Code::InvalidArgument);

    // SIGKILL: the restarted planner has the same targets and is paused.
    process.kill();
    let (process, client) = start(database).await;
    let plan = client.plan().await.unwrap();
    assert_eq!((plan.targets, plan.paused), (Some(targets()), true));
    assert!(!client.resume().await.unwrap().paused);
    (process, client)
}

#[tokio::test]
async fn on_sqlite_targets_and_pause_survive_a_sigkill_and_bad_input_is_refused_by_field() {
    let dir = tempfile::tempdir().unwrap();
    targets_and_pause_survive_a_sigkill(&format!("sqlite:{}", dir.path().join("planner.sqlite").display())).await;
}

#[tokio::test]
async fn on_postgres_targets_and_pause_survive_a_sigkill_and_the_planner_rides_out_a_database_restart() {
    let mut postgres = PostgresServer::start();
    postgres.create_database("planner");
    let (_process, client) = targets_and_pause_survive_a_sigkill(&postgres.url("planner")).await;

    // The database down: UNAVAILABLE, not a made-up plan; back: answers.
    postgres.kill();
    assert_eq!(code(client.plan().await.unwrap_err()).0, Code::Unavailable);
    postgres.restart();
    wait_until("the planner answers again once Postgres is back", Duration::from_secs(30), async || client.plan().await.is_ok()).await;
    let plan = client.plan().await.unwrap();
    assert_eq!((plan.targets, plan.paused), (Some(targets()), false));
}

/// Decisions recorded in a ledger come back through History and WatchPlan.
async fn decisions_page_and_reach_watchers(database: &str) {
    let namespace = "test";
    let ledger = Ledger::open(database, namespace).await.unwrap();
    let state = PlannerState::new(ledger.clone());
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let shutdown = turbine_runtime::CancellationToken::new();
    let config = turbine_planner::PlannerConfig {
        planning: turbine_planner::config::PlanningConfig { database: Some(database.to_owned()), ..Default::default() },
        ..Default::default()
    };
    let serving = tokio::spawn(turbine_planner::serve(config, state.clone(), None, listeners, shutdown.clone()));
    tokio::time::timeout(STARTUP_TIMEOUT, turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Planner, SERVICE))
        .await
        .expect("the planner serves");
    let client = PlannerClient::connect(&endpoint).unwrap();

    assert_eq!(ledger.next_decision_id().await.unwrap(), 1);
    for id in 1..=5 {
        state.record(decision(namespace, id, "decode", 2 + id as u32)).await.unwrap();
    }
    assert_eq!(ledger.next_decision_id().await.unwrap(), 6);
    assert!(state.record(decision(namespace, 3, "decode", 9)).await.is_err(), "a decision id is recorded once");

    // The watcher gets the latest first, then each new decision.
    let mut watch = client.watch().await.unwrap();
    let next = async |watch: &mut turbine_api::planner::DecisionStream| {
        tokio::time::timeout(Duration::from_secs(10), watch.next()).await.expect("a decision within 10 s").unwrap().unwrap()
    };
    assert_eq!(next(&mut watch).await.id, 5);
    state.record(decision(namespace, 6, "decode", 8)).await.unwrap();
    assert_eq!(next(&mut watch).await, decision(namespace, 6, "decode", 8));

    // The connector's result shows in History; recording an action id again
    // keeps its state.
    let id = Action::id_for(namespace, 6, "decode");
    ledger.set_action_state(&id, ActionState::Done, "scaled to 8", 1).await.unwrap();
    let mut again = decision(namespace, 7, "decode", 8);
    again.pools[0].action.as_mut().unwrap().id = id.clone();
    state.record(again).await.unwrap();
    let newest = client.history(2, None).await.unwrap();
    assert_eq!(newest.decisions.iter().map(|d| d.id).collect::<Vec<_>>(), [7, 6]);
    for decision in &newest.decisions {
        let action = decision.pools[0].action.as_ref().unwrap();
        assert_eq!((action.state, action.message.as_str()), (ActionState::Done, "scaled to 8"), "decision {}", decision.id);
    }

    // Pages of 3, newest first, to the end.
    let mut ids = Vec::new();
    let mut token = None;
    loop {
        let page = client.history(3, token.as_deref()).await.unwrap();
        ids.extend(page.decisions.iter().map(|d| d.id));
        match page.next_page_token {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    assert_eq!(ids, [7, 6, 5, 4, 3, 2, 1]);
    let plan = client.plan().await.unwrap();
    assert_eq!(plan.latest.map(|d| d.id), Some(7));

    // Observations: each interval back, oldest first, gaps as None.
    let seen = |pool: &str, ttft_ms| Observation {
        pool: pool.into(),
        load: Load { request_rate: 2.5, isl_mean: 1000.0, osl_mean: 90.5 },
        ttft_ms,
        itl_ms: None,
        queue_depth: 1.5,
        kv_usage: 0.25,
        replicas: 3,
        running: 17,
        context_tokens: 1_048.5,
        finish_rate: 2.25,
        itl_mean_ms: None,
        token_gap_ms: None,
        started_isl_mean: 0.0,
        served_rate: 0.0,
        awaiting_first_token: 0.0,
    };
    for at in [1_000, 2_000, 3_000] {
        ledger.record_observations(at, &[seen("decode", Some(120.5)), seen("prefill", None)]).await.unwrap();
    }
    let history = ledger.observations(2).await.unwrap();
    assert_eq!(history, [(2_000, vec![seen("decode", Some(120.5)), seen("prefill", None)]), (3_000, vec![seen("decode", Some(120.5)), seen("prefill", None)])]);

    // Another namespace in the same database sees none of it.
    let other = Ledger::open(database, "other").await.unwrap();
    assert_eq!(other.history(None, 10).await.unwrap(), []);
    assert_eq!(other.observations(10).await.unwrap(), []);
    shutdown.cancel();
    serving.await.unwrap().unwrap();
}

#[tokio::test]
async fn decisions_page_and_reach_watchers_on_postgres() {
    let postgres = PostgresServer::start();
    postgres.create_database("planner");
    decisions_page_and_reach_watchers(&postgres.url("planner")).await;
}

#[tokio::test]
async fn decisions_page_and_reach_watchers_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    decisions_page_and_reach_watchers(&format!("sqlite:{}", dir.path().join("planner.sqlite").display())).await;
}

/// Intervals without latencies (NULL) and with them, alternating, on every
/// connection of the pool: each is kept as observed.
async fn observations_with_and_without_latencies_are_kept(database: &str) {
    let ledger = Ledger::open(database, "test").await.unwrap();
    let seen = |ttft_ms: Option<f64>| Observation {
        pool: "workers".into(),
        load: Load { request_rate: 1.0, isl_mean: 100.0, osl_mean: 10.0 },
        ttft_ms,
        itl_ms: ttft_ms.map(|ms| ms / 10.0),
        queue_depth: 0.0,
        kv_usage: 0.5,
        replicas: 2,
        running: 3,
        context_tokens: 96.0,
        finish_rate: 0.5,
        itl_mean_ms: ttft_ms.map(|ms| ms / 12.0),
        token_gap_ms: None,
        started_isl_mean: 0.0,
        served_rate: 0.0,
        awaiting_first_token: 0.0,
    };
    let mut expected = Vec::new();
    for at in 1..=24 {
        let ttft_ms = (at % 2 == 0).then_some(f64::from(at as u32) * 7.5);
        ledger.record_observations(at, &[seen(ttft_ms)]).await.unwrap_or_else(|error| panic!("interval {at}: {error}"));
        expected.push((at, vec![seen(ttft_ms)]));
    }
    assert_eq!(ledger.observations(100).await.unwrap(), expected);
}

#[tokio::test]
async fn observations_with_and_without_latencies_are_kept_on_postgres() {
    let postgres = PostgresServer::start();
    observations_with_and_without_latencies_are_kept(&postgres.url("postgres")).await;
}

#[tokio::test]
async fn observations_with_and_without_latencies_are_kept_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    observations_with_and_without_latencies_are_kept(&format!("sqlite:{}", dir.path().join("planner.sqlite").display())).await;
}

#[test]
fn a_planner_without_a_database_says_what_it_needs() {
    let output =
        Command::new(env!("CARGO_BIN_EXE_turbine-planner")).args(["--grpc-addr", "127.0.0.1:0"]).env_remove("TURBINE_PLANNER_DATABASE").output().unwrap();
    assert!(!output.status.success());
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(text.contains("database: required"), "{text}");
    let output = Command::new(env!("CARGO_BIN_EXE_turbine-planner")).args(["--database", "mysql://db/planner"]).output().unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("postgres://"));
    let output = Command::new(env!("CARGO_BIN_EXE_turbine-planner"))
        .args(["--database", "sqlite::memory:", "--gateway-metrics", "http://gateway:8000/metrics"])
        .env_remove("TURBINE_REDIS_URL")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--redis"), "observing needs the registry");
    let output = Command::new(env!("CARGO_BIN_EXE_turbine-planner"))
        .args(["--database", "sqlite::memory:", "--gateway-metrics", "http://gateway:8000/metrics", "--redis", "redis://127.0.0.1:1/"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--profile"), "deciding needs the profile");
    let output = Command::new(env!("CARGO_BIN_EXE_turbine-planner"))
        .args(["--database", "sqlite::memory:", "--connector", "local"])
        .env_remove("TURBINE_REDIS_URL")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--redis"), "local workers need the registry");
    let output = Command::new(env!("CARGO_BIN_EXE_turbine-planner"))
        .args(["--database", "sqlite::memory:", "--connector", "kubernetes", "--kubernetes-deployments", "decode=Decode_Pool"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let text = String::from_utf8_lossy(&output.stderr);
    let expected = if cfg!(feature = "kubernetes") { "kubernetes_deployments" } else { "no kubernetes connector" };
    assert!(text.contains(expected), "{text}");
}

/// Postgres over TLS: a server that takes only TLS connections with a
/// client certificate of the deployment's CA. The planner connects with
/// its certificate (libpq's `sslmode=verify-full` parameters) and keeps
/// its state there; a plaintext connection, one without a certificate, and
/// one with another CA's certificate are refused.
#[tokio::test]
async fn on_postgres_over_tls_with_a_client_certificate() {
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("deployment");
    let mut postgres = PostgresServer::start();
    postgres.create_database("planner");
    postgres.require_tls(&ca.postgres_tls(dir.path()));
    let planner = ca.issue(Role::Planner, "planner").write(dir.path(), "planner");
    let file = |path: &Option<std::path::PathBuf>| path.clone().unwrap();
    let (ca_file, cert, key) = (file(&planner.tls_ca), file(&planner.tls_cert), file(&planner.tls_key));
    let url = postgres.tls_url("planner", &ca_file, &cert, &key);

    observations_with_and_without_latencies_are_kept(&url).await;
    let (_process, client) = start(&url).await;
    client.set_targets(&targets()).await.expect("the planner keeps its targets in Postgres over TLS");

    let plaintext = format!("{}?sslmode=disable", postgres.url("planner"));
    assert!(Ledger::open(&plaintext, "test").await.is_err(), "plaintext is refused");
    let no_certificate = format!("{}?sslmode=verify-full&sslrootcert={}", postgres.url("planner"), ca_file.display());
    assert!(Ledger::open(&no_certificate, "test").await.is_err(), "a client without a certificate is refused");
    let stranger = TestCa::new("attacker").issue(Role::Planner, "planner").write(dir.path(), "stranger");
    let foreign = postgres.tls_url("planner", &ca_file, &file(&stranger.tls_cert), &file(&stranger.tls_key));
    assert!(Ledger::open(&foreign, "test").await.is_err(), "another CA's certificate is refused");
}

/// A database a newer planner migrated (a planner migration this build
/// lacks) is refused with what to run, not read and written as if it were
/// this build's; the gateway's migrations beside them (from 1001) are not
/// the planner's and pass.
async fn a_schema_from_a_newer_planner_is_refused(database: &str) {
    drop(Ledger::open(database, "test").await.unwrap());
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(database).await.unwrap();
    let applied = async |version: i64| {
        sqlx::query("INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES ($1, 'applied elsewhere', $2, $3, 0)")
            .bind(version)
            .bind(true)
            .bind(vec![0_u8; 48])
            .execute(&pool)
            .await
            .unwrap();
    };
    applied(1999).await;
    drop(Ledger::open(database, "test").await.expect("another service's migration is not the planner's"));
    applied(999).await;
    let refused = Ledger::open(database, "test").await.expect_err("a newer planner's schema");
    let message = refused.to_string();
    assert!(message.contains("at migration 999, newer than this build's") && message.contains("a newer planner migrated it"), "{message}");
    pool.close().await;
}

#[tokio::test]
async fn a_schema_from_a_newer_planner_is_refused_on_postgres() {
    let postgres = PostgresServer::start();
    a_schema_from_a_newer_planner_is_refused(&postgres.url("postgres")).await;
}

#[tokio::test]
async fn a_schema_from_a_newer_planner_is_refused_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    a_schema_from_a_newer_planner_is_refused(&format!("sqlite:{}", dir.path().join("planner.sqlite").display())).await;
}
