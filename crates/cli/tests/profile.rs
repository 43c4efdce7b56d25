//! `turbine profile` on the mocker: it measures a real worker through a
//! real gateway and writes a profile the planner reads back, in which a
//! longer prompt takes longer to its first token and more sequences
//! decoding together take longer between tokens; bad grids are refused.

use std::process::Command;

use turbine_planner::plan::profile::Profile;

#[test]
fn the_mocker_profile_grows_with_input_length_and_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("profile.json");
    let run = Command::new(env!("CARGO_BIN_EXE_turbine"))
        .args(["profile", "--engine", "mock", "--speedup", "2", "--isl", "128,4096", "--context", "512,2048", "--concurrency", "1,16", "--output"])
        .arg(&output)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let profile = Profile::read(&output).unwrap();
    assert_eq!(profile.prefill.iter().map(|point| point.isl).collect::<Vec<_>>(), [128, 4096]);
    assert_eq!(profile.decode.len(), 4);
    assert!(profile.worker.starts_with("mock engine"), "{}", profile.worker);
    assert!(profile.ttft_ms(2048.0) > profile.ttft_ms(128.0), "{profile:?}");
    assert!(profile.itl_ms(2048.0, 16.0) > profile.itl_ms(2048.0, 1.0), "{profile:?}");

    let refused =
        Command::new(env!("CARGO_BIN_EXE_turbine")).args(["profile", "--engine", "mock", "--isl", "512,128", "--output"]).arg(&output).output().unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--isl: values must ascend"));
}
