//! The `turbine-gateway` binary on its own: it refuses to start without a
//! router, and while its router is unreachable it reports not ready and
//! answers 503 with OpenAI error JSON instead of failing.

use std::process::Command;
use std::time::Duration;

use turbine_testkit::{ChildProcess, ServiceProcess};

#[tokio::test]
async fn without_a_reachable_router_it_is_not_ready_and_answers_503() {
    // A router address nothing listens on: bound, then closed.
    let dead_router = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-gateway"));
    command.args(["--router", &format!("http://{dead_router}")]);
    let mut gateway = ServiceProcess::spawn("turbine-gateway", command, true).await.unwrap();
    let base = gateway.http_url();

    assert_eq!(reqwest::get(format!("{base}/readyz")).await.unwrap().status(), 503);
    assert_eq!(reqwest::get(format!("{base}/health")).await.unwrap().status(), 503);
    assert_eq!(reqwest::get(format!("{base}/livez")).await.unwrap().status(), 200);
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "server_error");

    gateway.terminate();
    let status = gateway.wait(Duration::from_secs(30)).expect("gateway exits on SIGTERM");
    assert!(status.success());
}

#[test]
fn it_refuses_to_start_without_a_router() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-gateway"));
    command.args(["--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0"]);
    let mut gateway = ChildProcess::spawn("turbine-gateway", command);
    let status = gateway.wait(Duration::from_secs(30)).expect("exits");
    assert!(!status.success());
    assert!(gateway.output().iter().any(|line| line.contains("--router")), "{:?}", gateway.output());
}

#[test]
fn with_api_keys_it_refuses_to_serve_metrics_on_the_api_port() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, turbine_gateway::keys::entry("a", "t", None, &turbine_gateway::keys::new_key())).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-gateway"));
    command.args(["--router", "http://127.0.0.1:1", "--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0", "--api-keys"]).arg(&keys);
    let mut gateway = ChildProcess::spawn("turbine-gateway", command);
    let status = gateway.wait(Duration::from_secs(30)).expect("exits");
    assert!(!status.success());
    assert!(gateway.output().iter().any(|line| line.contains("--admin-addr")), "{:?}", gateway.output());
}
