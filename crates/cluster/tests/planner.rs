//! `turbine run --planner`: the embedded cluster's planner sizes the
//! cluster's own workers (the `hosted` connector) in SQLite, over real
//! sockets: targets raise the pool to their minimum (a worker started in
//! the process, registered, routable), a lower maximum drains the newest
//! worker while streams are in flight (none lost), and a cluster started
//! again on the same database has the same targets.

use std::time::Duration;

use serde_json::json;
use turbine_cluster::sandbox::{Sandbox, read_events};
use turbine_planner::act::scale::WorkerHost;
use turbine_planner::plan::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, Profile};
use turbine_planner::{ActionState, PlannerClient, PoolKind, PoolLimits, Predictor, Targets};
use turbine_testkit::wait_until;

const MODEL: &str = "smollm2-135m";

/// Longest a pool may take to reach its size (a worker loads the mocker's
/// tokenizer; the planner acts once an interval).
const RESIZE_TIMEOUT: Duration = Duration::from_secs(120);

fn profile() -> Profile {
    let decode = [(256, 1, 10.0), (256, 8, 12.0), (4096, 1, 10.0), (4096, 8, 12.0)]
        .into_iter()
        .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
        .collect();
    Profile {
        version: PROFILE_VERSION,
        worker: "test".into(),
        prefill: vec![PrefillPoint { isl: 128, ttft_ms: 20.0 }, PrefillPoint { isl: 2048, ttft_ms: 80.0 }],
        decode,
    }
}

fn targets(min_replicas: u32, max_replicas: u32) -> Targets {
    let pool = PoolLimits { pool: "workers".into(), kind: PoolKind::Aggregated, min_replicas, max_replicas };
    Targets::new(2000.0, 200.0, 90.0, vec![pool], 4, Duration::from_secs(1), Duration::from_secs(1), Predictor::Constant).unwrap()
}

async fn start(database: &str, profile: &std::path::Path) -> (Sandbox, PlannerClient) {
    let mut config = Sandbox::mock(2.0);
    config.planner_port = Some(0);
    config.planner.database = Some(database.to_owned());
    config.planner.profile = Some(profile.to_owned());
    let sandbox = Sandbox::start(config).await;
    let planner = sandbox.cluster().planner().expect("a planner");
    let client = PlannerClient::connect(&format!("http://{planner}")).unwrap();
    (sandbox, client)
}

async fn until_serving(sandbox: &Sandbox, workers: usize) {
    let hosted = sandbox.cluster().hosted_workers();
    wait_until(&format!("{workers} aggregated workers serve"), RESIZE_TIMEOUT, async || {
        let listed = sandbox.cluster().registry().list().await.map(|live| live.len()).unwrap_or(0);
        hosted.workers("workers", PoolKind::Aggregated).len() == workers && listed == workers
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_of_turbine_run_starts_and_drains_the_process_own_workers() {
    let folder = tempfile::tempdir().unwrap();
    let profile_path = folder.path().join("profile.json");
    std::fs::write(&profile_path, serde_json::to_vec(&profile()).unwrap()).unwrap();
    let database = format!("sqlite:{}", folder.path().join("planner.db").display());

    let (sandbox, planner) = start(&database, &profile_path).await;
    assert_eq!(sandbox.cluster().hosted_workers().workers("workers", PoolKind::Aggregated).len(), 1, "turbine run starts one worker");

    // The minimum raises the pool: a second worker starts in the process.
    planner.set_targets(&targets(2, 3)).await.unwrap();
    until_serving(&sandbox, 2).await;
    let (status, body) = sandbox.post("/v1/completions", &json!({"model": MODEL, "prompt": "hello", "max_tokens": 4})).await;
    assert_eq!(status, 200, "{body}");

    // Streams in flight while the maximum drains a worker: none is lost.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let streams: Vec<_> = (0..8)
        .map(|i| {
            let request = http
                .post(format!("{}/v1/completions", sandbox.base()))
                .json(&json!({"model": MODEL, "prompt": format!("stream {i}"), "max_tokens": 300, "ignore_eos": true, "stream": true}));
            tokio::spawn(async move {
                let response = request.send().await.expect("the gateway answers");
                assert_eq!(response.status(), 200);
                read_events(response).await
            })
        })
        .collect();
    planner.set_targets(&targets(1, 1)).await.unwrap();
    until_serving(&sandbox, 1).await;
    for stream in streams {
        // Ended by its length (tokens that come together share an event),
        // not cut off.
        let events = stream.await.unwrap();
        let last: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    }

    // Both actions were carried out, and say so.
    let history = planner.history(20, None).await.unwrap().decisions;
    let actions: Vec<_> = history.iter().flat_map(|decision| &decision.pools).filter_map(|pool| pool.action.as_ref()).collect();
    assert!(actions.iter().any(|action| action.replicas == 2 && action.state == ActionState::Done && action.message.starts_with("started")), "{actions:?}");
    assert!(actions.iter().any(|action| action.replicas == 1 && action.state == ActionState::Done && action.message.starts_with("draining")), "{actions:?}");
    sandbox.stop().await;

    // Started again on the same database: the same targets, and the pool
    // kept at them.
    let (sandbox, planner) = start(&database, &profile_path).await;
    let kept = planner.plan().await.unwrap().targets.expect("targets kept");
    assert_eq!(kept.pools()[0].max_replicas, 1);
    until_serving(&sandbox, 1).await;
    sandbox.stop().await;
}

#[test]
fn a_planner_without_a_profile_is_refused() {
    let mut config = Sandbox::mock(1.0);
    config.planner_port = Some(0);
    let refused = turbine_runtime::config::Settings::validate(&config).unwrap_err();
    assert_eq!(refused.setting, "planner.profile");
    assert!(refused.problem.contains("--planner-profile"), "{refused}");
}
