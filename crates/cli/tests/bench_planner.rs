//! `turbine bench planner` on a short stretch of the Azure conversation
//! trace, with real mocker worker processes on a real Redis: both fleets
//! serve every request (the planner's scale-ups and the drains lose none),
//! the static fleet holds its size, the planner grows its fleet from the
//! minimum as the load comes, and the report and the plot carry each
//! interval.

use std::process::Command;

use turbine_testkit::RedisServer;

#[test]
fn the_planner_fleet_grows_under_load_and_no_request_is_lost() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    // A profile far slower than the mocker at this speedup (500 ms to a
    // first token alone): even corrected by the observed latency (at
    // least x0.25 of the profile's), one worker cannot hold the load.
    let profile = dir.path().join("profile.json");
    let decode: Vec<_> = [(256, 1, 2.0), (256, 16, 4.0), (4096, 1, 2.0), (4096, 16, 4.0)]
        .into_iter()
        .map(|(context, concurrency, itl_ms)| serde_json::json!({"context": context, "concurrency": concurrency, "itl_ms": itl_ms}))
        .collect();
    let written = serde_json::json!({"version": 1, "worker": "test", "prefill": [{"isl": 128, "ttft_ms": 500.0}, {"isl": 4096, "ttft_ms": 500.0}], "decode": decode});
    std::fs::write(&profile, written.to_string()).unwrap();
    let report = dir.path().join("report.json");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../services/planner/tests/fixtures/azure_llm_inference_2023_conv.csv");
    let run = Command::new(env!("CARGO_BIN_EXE_turbine"))
        .args(["bench", "planner", "--trace", trace, "--redis", &redis.url(), "--speedup", "10", "--limit", "400", "--max-output-tokens", "16"])
        .args(["--ttft-ms", "2000", "--itl-ms", "20", "--interval-secs", "1", "--cooldown-secs", "1", "--min-workers", "1", "--max-workers", "3"])
        // A cold start: the planner's fleet from one worker.
        .args(["--planner-start", "1"])
        .arg("--profile")
        .arg(&profile)
        .arg("--json")
        .arg(&report)
        .arg("--svg")
        .arg(dir.path().join("plot.svg"))
        .output()
        .unwrap();
    assert!(run.status.success(), "{}\n{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let fleets = report["fleets"].as_array().unwrap();
    assert_eq!(fleets.iter().map(|fleet| fleet["fleet"].as_str().unwrap()).collect::<Vec<_>>(), ["static", "planner"]);
    for fleet in fleets {
        assert_eq!((fleet["requests"].as_u64(), fleet["failed"].as_u64()), (Some(400), Some(0)), "{fleet}");
        assert!(fleet["worker_seconds"].as_f64().unwrap() > 0.0 && fleet["intervals"].as_u64().unwrap() >= 3, "{fleet}");
        assert!(!fleet["timeline"].as_array().unwrap().is_empty());
    }
    assert_eq!(fleets[0]["peak_workers"].as_u64(), Some(3), "the peak's proposal, within --max-workers: {}", fleets[0]);
    assert_eq!(report["planner_start_workers"].as_u64(), Some(1));
    assert!(fleets[1]["peak_workers"].as_u64().unwrap() > 1, "the planner scaled up: {}", fleets[1]);
    assert!(report["worker_seconds_ratio"].as_f64().unwrap() > 0.0);
    // The plot: a step per interval of each fleet's workers.
    let plot = std::fs::read_to_string(dir.path().join("plot.svg")).unwrap();
    assert!(plot.starts_with("<svg ") && plot.contains("planner SLA: ") && plot.contains("static SLA: "), "{plot}");
}
