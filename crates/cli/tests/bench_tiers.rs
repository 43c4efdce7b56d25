//! `turbine bench tiers` on the default model, small (three prompts of 320
//! tokens, a pool that holds one and a half): every tier's
//! onboarded pass reads blocks from the tier and decodes exactly the
//! greedy tokens the computed pass decoded.

use std::process::Command;

#[test]
fn every_tier_gives_back_the_computed_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("tiers.json");
    let run = Command::new(env!("CARGO_BIN_EXE_turbine"))
        .args(["bench", "tiers", "--prefix-tokens", "320", "--prompts", "3", "--check-tokens", "6", "--threads", "1", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["check_tokens"], 6);
    let tiers = report["tiers"].as_array().unwrap();
    let names: Vec<&str> = tiers.iter().map(|tier| tier["tier"].as_str().unwrap()).collect();
    assert!(names.starts_with(&["host", "disk", "store"]), "{names:?}");
    for tier in tiers {
        assert_eq!(tier["prompts"], 3, "{tier}");
        assert_eq!(tier["identical_outputs"], 3, "the onboarded pass decoded the computed tokens: {tier}");
        assert!(tier["onboarded_blocks"].as_u64().unwrap() >= 2, "blocks came from the tier: {tier}");
    }
}
