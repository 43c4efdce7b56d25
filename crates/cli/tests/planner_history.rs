//! `turbine planner history` against a planner serving real decisions over
//! gRPC (SQLite ledger): newest first, as many as asked, each with its
//! reasons and action, as text or JSON; a planner that does not answer is
//! a clear error and a failed exit.

use std::time::Duration;

use turbine_planner::{Action, ActionState, Decision, Ledger, PlannerState, PoolDecision};
use turbine_testkit::STARTUP_TIMEOUT;

fn decision(id: u64) -> Decision {
    Decision {
        id,
        at_unix_ms: 1_795_692_605_000 + id as i64 * 30_000,
        observed: Vec::new(),
        predicted: None,
        pools: vec![PoolDecision {
            pool: "decode".into(),
            current_replicas: 2,
            proposed_replicas: 4,
            desired_replicas: 3,
            reason: format!("reason {id}; one step per interval"),
            action: Some(Action {
                id: Action::id_for("default", id, "decode"),
                pool: "decode".into(),
                replicas: 3,
                state: ActionState::Pending,
                message: String::new(),
            }),
        }],
        reason: format!("forecast for decision {id}"),
        paused: false,
    }
}

async fn history(args: &[&str]) -> (bool, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_turbine")).args(["planner", "history"]).args(args).output().await.unwrap();
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned())
}

#[tokio::test]
async fn history_shows_the_newest_decisions_with_their_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite:{}", dir.path().join("planner.sqlite").display());
    let state = PlannerState::new(Ledger::open(&database, "default").await.unwrap());
    for id in 1..=3 {
        state.record(decision(id)).await.unwrap();
    }
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let shutdown = turbine_runtime::CancellationToken::new();
    let config = turbine_planner::PlannerConfig {
        planning: turbine_planner::config::PlanningConfig { database: Some(database), ..Default::default() },
        ..Default::default()
    };
    let serving = tokio::spawn(turbine_planner::serve(config, state, None, listeners, shutdown.clone()));
    tokio::time::timeout(
        STARTUP_TIMEOUT,
        turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Planner, "turbine.planner.v1.Planner"),
    )
    .await
    .expect("the planner serves");

    let (ok, text, stderr) = history(&["--planner", &endpoint, "--limit", "2"]).await;
    assert!(ok, "{stderr}");
    let headers: Vec<&str> = text.lines().filter(|line| line.starts_with('#')).collect();
    assert_eq!(headers, ["#3 2026-11-26T11:31:35Z  forecast for decision 3", "#2 2026-11-26T11:31:05Z  forecast for decision 2"], "{text}");
    assert!(
        text.contains("  decode: 2 -> 3 (proposed 4)")
            && text.contains("why: reason 3; one step per interval")
            && text.contains("action default/3/decode: pending"),
        "{text}"
    );

    let (ok, json, stderr) = history(&["--planner", &endpoint, "--json"]).await;
    assert!(ok, "{stderr}");
    let decisions: Vec<Decision> = serde_json::from_str(&json).unwrap();
    assert_eq!(decisions.iter().map(|decision| decision.id).collect::<Vec<_>>(), [3, 2, 1]);
    assert_eq!(decisions[2], decision(1));

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), serving).await.unwrap().unwrap().unwrap();
    let (ok, _, stderr) = history(&["--planner", &endpoint]).await;
    assert!(!ok);
    assert!(stderr.contains(&format!("cannot reach the planner at {endpoint}")), "{stderr}");
    let (ok, _, stderr) = history(&["--planner", &endpoint, "--limit", "0"]).await;
    assert!(!ok && stderr.contains("--limit"), "{stderr}");
}

#[tokio::test]
async fn history_reads_a_planner_over_mutual_tls_with_an_operators_certificate() {
    use turbine_runtime::host::Role;
    let dir = tempfile::tempdir().unwrap();
    let ca = turbine_testkit::tls::TestCa::new("turbine test CA");
    let database = format!("sqlite:{}", dir.path().join("planner.sqlite").display());
    let state = PlannerState::new(Ledger::open(&database, "default").await.unwrap());
    state.record(decision(7)).await.unwrap();
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let shutdown = turbine_runtime::CancellationToken::new();
    let mut config = turbine_planner::PlannerConfig {
        planning: turbine_planner::config::PlanningConfig { database: Some(database), ..Default::default() },
        ..Default::default()
    };
    config.server.tls = ca.issue(Role::Planner, "planner-0").write(dir.path(), "planner");
    let serving = tokio::spawn(turbine_planner::serve(config, state, None, listeners, shutdown.clone()));
    // This process now dials as the planner: health is open to any holder.
    tokio::time::timeout(STARTUP_TIMEOUT, turbine_runtime::health::until_serving(&endpoint, Role::Planner, "turbine.planner.v1.Planner"))
        .await
        .expect("the planner serves over TLS");

    let flags = |stem: &str, role: Role| {
        let tls = ca.issue(role, stem).write(dir.path(), stem);
        let path = |path: Option<std::path::PathBuf>| path.unwrap().display().to_string();
        vec!["--tls-cert".to_owned(), path(tls.tls_cert), "--tls-key".to_owned(), path(tls.tls_key), "--tls-ca".to_owned(), path(tls.tls_ca)]
    };
    let operator = flags("alice", Role::Operator);
    let mut args = vec!["--planner", endpoint.as_str()];
    args.extend(operator.iter().map(String::as_str));
    let (ok, text, stderr) = history(&args).await;
    assert!(ok, "{stderr}");
    assert!(text.contains("#7 "), "{text}");
    // Without a certificate the planner gives no answer.
    let (ok, _, stderr) = history(&["--planner", &endpoint]).await;
    assert!(!ok, "{stderr}");
    // A worker's certificate may not read the planner's history.
    let worker = flags("worker-0", Role::Worker);
    let mut args = vec!["--planner", endpoint.as_str()];
    args.extend(worker.iter().map(String::as_str));
    let (ok, _, stderr) = history(&args).await;
    assert!(!ok && stderr.contains("may not call /turbine.planner.v1.Planner/History"), "{stderr}");
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), serving).await.unwrap().unwrap().unwrap();
}
