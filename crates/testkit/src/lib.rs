//! Test harness for integration tests: real servers and real Turbine
//! processes (`turbine-harness`), and the waits and metric readers tests
//! share. Readiness comes from the services themselves (addresses files,
//! gRPC health); nothing here reads log lines or sleeps to synchronise.
//!
//! - [`RedisServer`], [`ServiceProcess`], [`ChildProcess`]: see
//!   `turbine-harness`.
//! - [`wait_until`], [`poll_until`]: a condition polled until it holds,
//!   within a deadline.
//! - [`metric`], [`metric_where`], [`metric_lines`]: Prometheus values from
//!   a `/metrics` page.
//! - [`workspace_binary`]: a binary built from this workspace.
//! - [`TcpRelay`]: a relay in front of a server that can hold a transfer
//!   mid-stream, for tests that act at that moment.

pub mod relay;
pub mod tls;

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use relay::TcpRelay;
pub use turbine_harness::{
    ChildProcess, LlamaCppInstall, LlamaCppServer, PostgresServer, PostgresTls, RedisServer, RedisTls, STARTUP_TIMEOUT, ServiceProcess, VLLM_STARTUP_TIMEOUT,
    VllmInstall, VllmServer, addresses_file, free_port, listening_sockets,
};

/// Path of a binary built from this workspace (`turbine`, `turbine-worker`,
/// ...), next to the running test's target directory.
pub fn workspace_binary(name: &str) -> PathBuf {
    let test_exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let profile_dir = test_exe.parent().and_then(|deps| deps.parent()).expect("target layout");
    let path = profile_dir.join(name);
    assert!(path.is_file(), "{} is not built; run the tests with `cargo test --workspace` (which builds every binary)", path.display());
    path
}

/// Polls `condition` every 20 ms until it holds and returns how long that
/// took; panics naming `what` if it does not hold within `deadline`.
pub async fn wait_until(what: &str, deadline: Duration, condition: impl AsyncFnMut() -> bool) -> Duration {
    poll_until(what, deadline, Duration::from_millis(20), condition).await
}

/// [`wait_until`], looking every `every` (for conditions that hold only
/// briefly).
pub async fn poll_until(what: &str, deadline: Duration, every: Duration, mut condition: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !condition().await {
        assert!(started.elapsed() < deadline, "{what}: not within {deadline:?}");
        tokio::time::sleep(every).await;
    }
    started.elapsed()
}

/// Reads one metric's value (summing its series) from the `/metrics` page
/// at `base` (e.g. `http://127.0.0.1:9092`).
pub async fn metric(base: &str, name: &str) -> f64 {
    metric_where(base, name, &[]).await
}

/// Every series of one metric on the `/metrics` page at `base`, as
/// exposition lines (for diagnostics).
pub async fn metric_lines(base: &str, name: &str) -> Vec<String> {
    let text = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    text.lines().filter(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{'])).map(str::to_owned).collect()
}

/// Like [`metric`], summing only the series that carry every given
/// `label="value"` pair.
pub async fn metric_where(base: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_lines(base, name)
        .await
        .iter()
        .filter(|line| labels.iter().all(|(label, value)| line.contains(&format!("{label}=\"{value}\""))))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
