//! Observing a running deployment: an in-process cluster of two mocker
//! workers behind a real gateway (real sockets), its metrics page scraped
//! and its registry read by the planner. The interval's request rate,
//! input and output lengths match what was sent, the latencies are read,
//! replicas are counted, the time between streamed tokens is read before
//! any request finishes; the planner's cycle keeps intervals in PostgreSQL
//! and decides from them: more workers for a burst, nothing while paused.

use std::time::Duration;

use serde_json::json;
use turbine_cluster::sandbox::Sandbox;
use turbine_planner::ActionState;
use turbine_planner::cycle::Sizing;
use turbine_planner::observe::Observer;
use turbine_planner::plan::profile::{DecodePoint, PROFILE_VERSION, PrefillPoint, Profile};
use turbine_planner::{Ledger, PlannerState, PoolKind, PoolLimits, Predictor, Targets};
use turbine_testkit::{PostgresServer, metric, wait_until};

const MODEL: &str = "smollm2-135m";

/// One sandbox at a time: the gateway's metrics are the process's, so a
/// test running beside another (cargo test runs a file's tests in one
/// process) would read the other's requests in its intervals.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A profile far slower than the mocker at speedup 20 (2 s to a first
/// token alone): the planner's correction (observed over expected, at
/// least ×0.25) still sizes a burst of requests beyond the two workers.
fn slow_profile() -> Profile {
    let decode = [(256, 1, 20.0), (256, 8, 40.0), (4096, 1, 20.0), (4096, 8, 40.0)]
        .into_iter()
        .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
        .collect();
    Profile {
        version: PROFILE_VERSION,
        worker: "test".into(),
        prefill: vec![PrefillPoint { isl: 128, ttft_ms: 2000.0 }, PrefillPoint { isl: 2048, ttft_ms: 2000.0 }],
        decode,
    }
}

fn targets(interval: Duration) -> Targets {
    let pool = PoolLimits { pool: "workers".into(), kind: PoolKind::Aggregated, min_replicas: 2, max_replicas: 4 };
    Targets::new(500.0, 50.0, 90.0, vec![pool], 4, interval, Duration::from_secs(60), Predictor::MovingAverage).unwrap()
}

/// `count` completions of 320 prompt tokens and 8 generated tokens.
async fn send_requests(sandbox: &Sandbox, count: u32) {
    for i in 0..count {
        let prompt: Vec<u32> = (0..320).map(|t| 1000 + i * 320 + t).collect();
        let (status, body) = sandbox.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": true})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 8);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_reads_rate_lengths_latencies_and_replicas_and_the_cycle_keeps_them() {
    let _turn = TURN.lock().await;
    let _telemetry = turbine_runtime::telemetry::init("observe-test");
    let mut config = Sandbox::mock(20.0);
    config.workers = 2;
    let sandbox = Sandbox::start(config).await;
    let metrics = format!("{}/metrics", sandbox.base());
    let mut observer = Observer::new(vec![metrics.clone()], sandbox.cluster().registry().clone());
    let targets = targets(Duration::from_secs(1));

    let started = std::time::Instant::now();
    assert_eq!(observer.observe(&targets).await.unwrap(), None, "the first reading is the baseline");
    send_requests(&sandbox, 20).await;
    let seen = observer.observe(&targets).await.unwrap().expect("an interval");
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(seen.len(), 1);
    let pool = &seen[0];
    assert_eq!((pool.pool.as_str(), pool.replicas), ("workers", 2));
    assert_eq!((pool.load.isl_mean, pool.load.osl_mean), (320.0, 8.0));
    // 20 requests over the interval between the two readings, which lies
    // within the time from before the first to after the second.
    let window = 20.0 / pool.load.request_rate;
    assert!(window > 0.0 && window <= elapsed, "{pool:?}: a window of {window} s within {elapsed} s");
    // Sent one after another: each arrived and got its first token in the
    // interval, none was left waiting; the demand is what was served.
    assert_eq!(pool.served_rate, pool.load.request_rate, "{pool:?}");
    assert_eq!(pool.awaiting_first_token, 0.0, "{pool:?}");
    // All 20 finished too, but the gateway records a request's duration
    // after its response reached this client (under load, several land
    // in the next interval): some, never more than the 20 sent.
    let finished = pool.finish_rate * window;
    assert!(finished > 0.0 && finished <= 20.0 + 1e-6, "{finished} of the 20 finished in the interval: {pool:?}");
    let (ttft, itl) = (pool.ttft_ms.expect("a TTFT"), pool.itl_ms.expect("an ITL"));
    assert!(ttft > 0.0 && itl > 0.0, "{pool:?}");
    // The mean of the 20 requests' ITL beside the percentile (one slow
    // request can put it either side).
    assert!(pool.itl_mean_ms.is_some_and(|mean| mean > 0.0 && mean.is_finite()), "{pool:?}");
    assert!((0.0..=1.0).contains(&pool.kv_usage));
    // Read as the tokens stream: the 20 prompts got their first token, and
    // their 140 later tokens each a gap.
    assert_eq!(pool.started_isl_mean, 320.0, "{pool:?}");
    assert!(pool.token_gap_ms.is_some_and(|gap| gap > 0.0 && gap.is_finite()), "{pool:?}");

    // Nothing sent: a zero rate and no latencies, not the last interval's.
    // The gateway counts a request once its response reached this client
    // (under the full suite's load, after the reading above): once it has
    // counted all 20, one reading takes those it counted late, and the
    // next interval has nothing.
    wait_until("the gateway counts the 20 requests", Duration::from_secs(30), async || {
        metric(sandbox.base(), "turbine_gateway_time_to_first_token_seconds_count").await >= 20.0
    })
    .await;
    observer.observe(&targets).await.unwrap().expect("an interval");
    let idle = observer.observe(&targets).await.unwrap().expect("an interval");
    assert_eq!((idle[0].load.request_rate, idle[0].ttft_ms, idle[0].itl_ms, idle[0].itl_mean_ms), (0.0, None, None, None));
    assert_eq!((idle[0].token_gap_ms, idle[0].started_isl_mean, idle[0].served_rate), (None, 0.0, 0.0));

    // Five requests: their rate, but too few for a percentile. Their
    // lengths are read with the intervals before (ten requests at least):
    // an observer that saw only these five has none.
    let mut fresh = Observer::new(vec![metrics.clone()], sandbox.cluster().registry().clone());
    assert_eq!(fresh.observe(&targets).await.unwrap(), None);
    send_requests(&sandbox, 5).await;
    let few = observer.observe(&targets).await.unwrap().expect("an interval");
    assert!(few[0].load.request_rate > 0.0 && few[0].load.isl_mean == 320.0, "{few:?}");
    assert_eq!((few[0].ttft_ms, few[0].itl_ms), (None, None), "{few:?}");
    let alone = fresh.observe(&targets).await.unwrap().expect("an interval");
    assert!(alone[0].load.request_rate > 0.0 && (alone[0].load.isl_mean, alone[0].load.osl_mean) == (0.0, 0.0), "{alone:?}");

    // A gateway that does not answer: an error naming it, no interval.
    let mut blind = Observer::new(vec!["http://127.0.0.1:9/metrics".into()], sandbox.cluster().registry().clone());
    assert!(blind.observe(&targets).await.unwrap_err().to_string().contains("127.0.0.1:9"));

    // The cycle records an interval per second in Postgres, and decides.
    let postgres = PostgresServer::start();
    let ledger = Ledger::open(&postgres.url("postgres"), "test").await.unwrap();
    ledger.set_targets(&targets, 0).await.unwrap();
    let shutdown = turbine_runtime::CancellationToken::new();
    let cycle = tokio::spawn(turbine_planner::cycle::run(
        PlannerState::new(ledger.clone()),
        Observer::new(vec![metrics], sandbox.cluster().registry().clone()),
        Sizing { profile: slow_profile(), season_intervals: 4 },
        shutdown.clone(),
    ));
    wait_until("the cycle records an interval", Duration::from_secs(30), async || !ledger.observations(10).await.unwrap().is_empty()).await;
    send_requests(&sandbox, 20).await;
    wait_until("the cycle records an interval with the requests", Duration::from_secs(30), async || {
        ledger.observations(100).await.unwrap().iter().any(|(_, pools)| pools[0].load.isl_mean > 0.0)
    })
    .await;
    let history = ledger.observations(100).await.unwrap();
    // (The 20 may span intervals: a percentile only where ten fell.)
    let finished: Vec<_> = history.iter().map(|(_, pools)| &pools[0]).filter(|pool| pool.load.isl_mean > 0.0).collect();
    assert!(finished.iter().all(|pool| pool.load.isl_mean == 320.0 && pool.replicas == 2), "{finished:?}");
    assert!(history.windows(2).all(|pair| pair[0].0 < pair[1].0), "oldest first");
    assert_eq!(ledger.observations(1).await.unwrap().len(), 1, "the newest interval only");

    // Decisions: idle intervals keep the two workers (the minimum); a busy
    // one asks for more, with a pending action.
    // (A decision follows its interval's observations.)
    wait_until("a decision that scales", Duration::from_secs(30), async || {
        ledger.history(None, 1000).await.unwrap().iter().any(|decision| decision.pools[0].action.is_some())
    })
    .await;
    let decisions = ledger.history(None, 1000).await.unwrap();
    assert!(decisions.len() >= history.len() - 1, "a decision per observed interval: {} for {}", decisions.len(), history.len());
    let scaled = decisions.iter().find(|decision| decision.pools[0].action.is_some()).unwrap_or_else(|| panic!("no action in {decisions:#?}"));
    let pool = &scaled.pools[0];
    assert!(pool.current_replicas == 2 && pool.desired_replicas > 2 && pool.desired_replicas <= 4, "{pool:?}");
    let action = pool.action.as_ref().unwrap();
    assert_eq!((action.id.clone(), action.replicas, action.state), (format!("test/{}/workers", scaled.id), pool.desired_replicas, ActionState::Pending));
    assert!(scaled.predicted.as_ref().unwrap().load.request_rate > 0.0 && scaled.reason.contains("req/s"), "{scaled:?}");

    // The metrics say what was asked for and how each interval went.
    let metrics = turbine_runtime::metrics::render();
    let value = |series: &str| metrics.lines().find_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok());
    assert!(value(r#"turbine_planner_desired_replicas{pool="workers"}"#).is_some_and(|replicas| (2.0..=4.0).contains(&replicas)), "{metrics}");
    assert_eq!(value(r#"turbine_planner_observed_replicas{pool="workers"}"#), Some(2.0), "{metrics}");
    assert!(value(r#"turbine_planner_intervals_total{pool="workers",sla="idle"}"#).is_some_and(|idle| idle >= 1.0), "{metrics}");
    let busy_intervals =
        ["met", "missed"].iter().filter_map(|sla| value(&format!(r#"turbine_planner_intervals_total{{pool="workers",sla="{sla}"}}"#))).sum::<f64>();
    assert!(busy_intervals >= 1.0, "{metrics}");
    // The connector's outcome is counted once it answers, after the
    // decision (with its pending action) is recorded.
    let awaiting = || {
        let metrics = turbine_runtime::metrics::render();
        metrics.lines().find_map(|line| line.strip_prefix(r#"turbine_planner_actions_total{outcome="awaiting"}"#)?.trim().parse::<f64>().ok())
    };
    wait_until("the virtual connector's answer counted", Duration::from_secs(10), async || awaiting().is_some_and(|actions| actions >= 1.0)).await;

    // Paused: decisions go on, asking for nothing.
    ledger.set_paused(true, "test", 0).await.unwrap();
    let newest = decisions[0].id;
    wait_until("a paused decision", Duration::from_secs(30), async || ledger.latest().await.unwrap().is_some_and(|d| d.id > newest + 1 && d.paused)).await;
    let paused = ledger.latest().await.unwrap().unwrap();
    assert!(paused.pools.iter().all(|pool| pool.action.is_none()), "{paused:?}");
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), cycle).await.expect("the cycle ends at shutdown").unwrap();
    sandbox.stop().await;
}

/// Sequences in flight when an interval ends: the registry's count of
/// what the pool's workers run, and the KV cache each holds in tokens
/// (what a planner that knows no request's length yet sizes decode on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_reads_the_sequences_in_flight_and_their_context() {
    let _turn = TURN.lock().await;
    let _telemetry = turbine_runtime::telemetry::init("observe-test");
    // Real-time mocker: three requests of 2,000 tokens run for many
    // heartbeats.
    let mut config = Sandbox::mock(1.0);
    config.workers = 1;
    let sandbox = std::sync::Arc::new(Sandbox::start(config).await);
    let mut observer = Observer::new(vec![format!("{}/metrics", sandbox.base())], sandbox.cluster().registry().clone());
    let targets = targets(Duration::from_secs(1));
    assert_eq!(observer.observe(&targets).await.unwrap(), None, "the baseline");
    let idle = observer.observe(&targets).await.unwrap().expect("an interval");
    assert_eq!((idle[0].running, idle[0].context_tokens), (0, 0.0), "nothing runs: {idle:?}");

    let requests: Vec<_> = (0..3u32)
        .map(|i| {
            let sandbox = sandbox.clone();
            tokio::spawn(async move {
                let prompt: Vec<u32> = (0..320).map(|t| 5000 + i * 320 + t).collect();
                sandbox.post("/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2000, "ignore_eos": true})).await
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let running = loop {
        let seen = observer.observe(&targets).await.unwrap().expect("an interval");
        if seen[0].running == 3 && seen[0].token_gap_ms.is_some() {
            break seen[0].clone();
        }
        assert!(std::time::Instant::now() < deadline, "the registry never showed the three sequences running with their tokens streaming: {seen:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Each holds its 320-token prompt and what it has generated, within a
    // block of rounding (the mocker's 64-token blocks); no request has
    // finished.
    assert!((320.0..=2_368.0).contains(&running.context_tokens), "{running:?}");
    assert!(requests.iter().all(|request| !request.is_finished()), "a request finished early");
    assert_eq!(running.finish_rate, 0.0, "{running:?}");
    // No request finished, so no ITL percentile: the time between the
    // tokens streamed is read instead.
    assert!(running.itl_ms.is_none() && running.token_gap_ms.is_some_and(|gap| gap > 0.0 && gap.is_finite()), "{running:?}");
    // The streams stop with their clients, and the cluster drains before
    // the next test's turn.
    for request in requests {
        request.abort();
        let _ = request.await;
    }
    std::sync::Arc::into_inner(sandbox).expect("no request holds the sandbox").stop().await;
}
