//! The layout the API crate exists for, read from `cargo metadata`: no
//! service crate depends on another service crate, the crates every
//! service shares (the API, the contracts, the runtime, the KV log, the
//! UCX agent) link neither an engine nor a service, and no service but the
//! worker (which hosts one) links an engine.
//!
//! Services meet through `turbine-api` (their words and clients) and the
//! shared crates; a service that needs another's types or client takes
//! them from there. (Dev-dependencies are free: a test may start another
//! service.)

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Crates that every service may link: none of them links an engine.
const SHARED: &[&str] =
    &["turbine-api", "turbine-proto", "turbine-runtime", "turbine-kv", "turbine-kv-log", "turbine-tokens", "turbine-registry", "turbine-ucx-agent"];

/// The one service that links an engine: it hosts it.
const HOSTS_AN_ENGINE: &str = "turbine-worker";

/// Engines: what the shared crates must not link.
const ENGINES: &[&str] = &["turbine-engine", "turbine-native"];

struct Workspace {
    /// Each workspace package's normal (not dev, not build) dependencies
    /// within the workspace.
    links: BTreeMap<String, BTreeSet<String>>,
    /// The service crates (under `services/`).
    services: BTreeSet<String>,
}

fn workspace() -> Workspace {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.toml");
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline", "--manifest-path", manifest])
        .output()
        .expect("run cargo metadata");
    assert!(output.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&output.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let packages = metadata["packages"].as_array().expect("packages");
    let names: BTreeSet<String> = packages.iter().map(|package| package["name"].as_str().unwrap().to_owned()).collect();
    let mut links = BTreeMap::new();
    let mut services = BTreeSet::new();
    for package in packages {
        let name = package["name"].as_str().unwrap().to_owned();
        if package["manifest_path"].as_str().unwrap().contains("/services/") {
            services.insert(name.clone());
        }
        let normal = package["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|dependency| dependency["kind"].is_null())
            .map(|dependency| dependency["name"].as_str().unwrap().to_owned())
            .filter(|dependency| names.contains(dependency))
            .collect();
        links.insert(name, normal);
    }
    Workspace { links, services }
}

#[test]
fn no_service_crate_depends_on_another() {
    let workspace = workspace();
    assert!(workspace.services.len() >= 6, "the services: {:?}", workspace.services);
    let found: Vec<(&String, &String)> = workspace
        .services
        .iter()
        .flat_map(|service| workspace.links[service].iter().filter(|to| workspace.services.contains(*to)).map(move |to| (service, to)))
        .collect();
    assert!(found.is_empty(), "a service crate links another service crate: {found:?}; share the types through turbine-api instead");
}

impl Workspace {
    /// Everything `crate_name` links, through the workspace.
    fn reached(&self, crate_name: &str) -> BTreeSet<String> {
        let mut reached = BTreeSet::new();
        let mut next = vec![crate_name.to_owned()];
        while let Some(crate_name) = next.pop() {
            for dependency in self.links.get(&crate_name).unwrap_or_else(|| panic!("{crate_name} is not in the workspace")) {
                if reached.insert(dependency.clone()) {
                    next.push(dependency.clone());
                }
            }
        }
        reached
    }
}

#[test]
fn no_service_but_the_worker_links_an_engine() {
    let workspace = workspace();
    assert!(workspace.services.contains(HOSTS_AN_ENGINE));
    for service in workspace.services.iter().filter(|service| *service != HOSTS_AN_ENGINE) {
        let engines: Vec<_> = workspace.reached(service).into_iter().filter(|name| ENGINES.contains(&name.as_str())).collect();
        assert!(engines.is_empty(), "{service} links an engine: {engines:?}");
    }
    assert!(workspace.reached(HOSTS_AN_ENGINE).contains("turbine-engine"), "the scan sees the worker's engine");
}

#[test]
fn the_shared_crates_link_no_engine_and_no_service() {
    let workspace = workspace();
    for shared in SHARED {
        let reached = workspace.reached(shared);
        let engines: Vec<_> = reached.iter().filter(|name| ENGINES.contains(&name.as_str())).collect();
        assert!(engines.is_empty(), "{shared} links an engine: {engines:?}");
        let services: Vec<_> = reached.iter().filter(|name| workspace.services.contains(*name)).collect();
        assert!(services.is_empty(), "{shared} links a service: {services:?}");
    }
}
