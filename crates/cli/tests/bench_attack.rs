//! `turbine bench attack` on a short run: a mutual-TLS stack (real Redis,
//! mocker worker, router and gateway as processes) serves every legitimate
//! request while attackers call the worker's Generate with the router's
//! certificate, book on the router with a worker's, connect without a
//! certificate, describe a made-up KV handle and write unsealed worker
//! records into Redis pointing at a listener of theirs: every attempt is
//! refused, the services count the wrong-role calls and the unsealed
//! records, and no connection reaches the rogue listener. (Latency is the
//! benchmark's to report, not this test's: docs/benchmarks.md.)

use std::process::Command;

use turbine_testkit::workspace_binary;

/// Runs `turbine bench attack` with `flags`: what it printed, and its
/// JSON report.
fn bench_attack(flags: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("attack.json");
    let output = Command::new(workspace_binary("turbine")).args(["bench", "attack"]).args(flags).arg("--json").arg(&json).output().unwrap();
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{printed}\n{}", String::from_utf8_lossy(&output.stderr));
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (printed, report)
}

#[test]
fn every_attack_is_refused_and_counted_while_legitimate_requests_are_served() {
    let (printed, report) = bench_attack(&["--rounds", "1", "--requests-per-block", "24", "--attack-rate", "100"]);
    assert_eq!(report["failed_requests"], 0, "{printed}");
    assert_eq!(report["rogue_connections"], 0, "{printed}");
    assert_eq!(report["unattacked"]["requests"], 24);
    assert_eq!(report["attacked"]["requests"], 24);
    let attacks = report["attacks"].as_array().unwrap();
    assert_eq!(attacks.len(), 5);
    for attack in attacks {
        assert!(attack["attempts"].as_u64().unwrap() > 0, "{attack}");
        assert_eq!(attack["unexpected"], 0, "{attack}");
        assert_eq!(attack["refused"], attack["attempts"], "{attack}");
    }
    let counted = |series: &str| -> f64 {
        report["counted"].as_array().unwrap().iter().filter(|entry| entry[0].as_str().unwrap().contains(series)).map(|entry| entry[1].as_f64().unwrap()).sum()
    };
    // Each call that reached the service counted one for one (those whose
    // connection its gate closed before TLS never made a call).
    let attempts = |name: &str| {
        let attack = attacks.iter().find(|attack| attack["attack"] == name).unwrap();
        attack["attempts"].as_f64().unwrap() - attack["closed"].as_f64().unwrap()
    };
    assert_eq!(counted("Worker/Generate\",reason=\"wrong_role\""), attempts("wrong_role_generate"), "{printed}");
    assert_eq!(counted("Router/Route\",reason=\"wrong_role\""), attempts("wrong_role_route"), "{printed}");
    assert!(counted("turbine_registry_refused_records_total{reason=\"unsigned\"}") > 0.0, "the router skipped the unsealed records: {printed}");
}

/// The attackers keep their connections, as gRPC clients do: every call is
/// still refused, and each kept connection refused call after call is cut
/// off (the services count it) and must connect again.
#[test]
fn attackers_keeping_their_connections_are_refused_and_cut_off() {
    let (printed, report) = bench_attack(&["--rounds", "1", "--requests-per-block", "200", "--attack-rate", "1000", "--kept-connections"]);
    assert_eq!(report["kept_connections"], true);
    assert_eq!(report["failed_requests"], 0, "{printed}");
    assert_eq!(report["rogue_connections"], 0, "{printed}");
    let attacks = report["attacks"].as_array().unwrap();
    for attack in attacks {
        assert_eq!(attack["unexpected"], 0, "{attack}");
        assert_eq!(attack["refused"], attack["attempts"], "{attack}");
    }
    let attempts = |name: &str| attacks.iter().find(|attack| attack["attack"] == name).unwrap()["attempts"].as_u64().unwrap();
    let struck = |service: &str| -> f64 {
        report["counted"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|entry| entry[0].as_str().unwrap() == format!("{service}: turbine_grpc_connections_struck_off_total"))
            .map(|entry| entry[1].as_f64().unwrap())
            .sum()
    };
    // Far more than a connection's 16 refusals (and its refill of one a
    // second) on each: cut off, and connected again.
    for (attack, service) in [("wrong_role_generate", "worker"), ("wrong_role_route", "router")] {
        assert!(attempts(attack) > 40, "{attack}: too few calls to spend a connection's refusals: {printed}");
        assert!(struck(service) > 0.0, "the {service} cut off the kept connection: {printed}");
    }
}
