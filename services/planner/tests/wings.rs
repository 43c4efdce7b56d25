//! The planner's layout holds, read from its sources: the plan wing is
//! pure (no database, network, runtime, clock or process, and nothing of
//! the other wings or the state), observe and act do not reach into each
//! other, and only `serve.rs` reaches into the gRPC shell.

use std::path::{Path, PathBuf};

fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(sources(&path));
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// Lines of the files under `wing` (relative to `src`) that name any of
/// `forbidden`, as `file:line: text`.
fn naming(wing: &str, forbidden: &[&str]) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let root = src.join(wing);
    let files = if root.is_dir() { sources(&root) } else { vec![root] };
    let mut found = Vec::new();
    for file in files {
        for (number, line) in std::fs::read_to_string(&file).unwrap().lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            if forbidden.iter().any(|word| code.contains(word)) {
                found.push(format!("{}:{}: {}", file.strip_prefix(&src).unwrap().display(), number + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn the_plan_wing_is_pure() {
    let impure = [
        "sqlx",
        "reqwest",
        "tokio",
        "tonic",
        "turbine_proto",
        "turbine_registry",
        "Instant",
        "SystemTime",
        "std::process",
        "crate::act",
        "crate::observe",
        "crate::ledger",
        "crate::cycle",
        "crate::state",
        "crate::service",
        "crate::clock",
    ];
    let found = naming("plan", &impure);
    assert!(found.is_empty(), "the plan wing reaches out:\n{}", found.join("\n"));
}

#[test]
fn observe_and_act_do_not_reach_into_each_other() {
    let found: Vec<String> = naming("observe", &["crate::act"]).into_iter().chain(naming("act", &["crate::observe"])).collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn only_serve_reaches_into_the_grpc_shell() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found: Vec<String> = sources(&src)
        .iter()
        .map(|file| file.strip_prefix(&src).unwrap().to_string_lossy().into_owned())
        .filter(|relative| !matches!(relative.as_str(), "serve.rs" | "service.rs" | "lib.rs"))
        .flat_map(|relative| naming(&relative, &["crate::service", "planner_server"]))
        .collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_scan_sees_what_it_forbids() {
    assert!(!naming("plan", &["pub fn"]).is_empty(), "the plan wing is read");
    assert!(!naming("cycle.rs", &["crate::act"]).is_empty(), "a single file is read");
}
