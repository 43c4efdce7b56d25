//! The process's channel cache across runtimes: a channel is driven by a
//! task on the runtime that made it, so one made in a runtime that has
//! stopped must never be handed to a caller on another (a test harness runs
//! a runtime per test in one process; a dead channel fails every call).

use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A health server on a runtime of its own, serving until the process ends.
fn health_server() -> String {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let (_reporter, health) = tonic_health::server::health_reporter();
            tonic::transport::Server::builder().add_service(health).serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)).await.unwrap();
        })
    });
    endpoint
}

/// One health check through the process's channel to `endpoint`, bounded.
async fn check(endpoint: &str) -> Result<ServingStatus, String> {
    let channel = turbine_runtime::grpc::channel(endpoint, turbine_runtime::host::Role::Worker).map_err(|error| error.to_string())?;
    let mut client = HealthClient::new(channel);
    let call = client.check(HealthCheckRequest { service: String::new() });
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Ok(response)) => Ok(response.into_inner().status()),
        Ok(Err(status)) => Err(status.to_string()),
        Err(_) => Err("no answer in 10 s".to_owned()),
    }
}

#[test]
fn a_channel_outlives_no_runtime_it_was_made_on() {
    let endpoint = health_server();

    let first = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(first.block_on(check(&endpoint)), Ok(ServingStatus::Serving));
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(second.block_on(check(&endpoint)), Ok(ServingStatus::Serving), "the channel made on the first runtime was handed to the second");
}

#[test]
fn runtimes_running_at_once_each_get_a_channel_they_can_use() {
    let endpoint = health_server();
    let outer = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(outer.block_on(check(&endpoint)), Ok(ServingStatus::Serving));

    // A second runtime uses the endpoint while the first lives, then the
    // first stops: the second's calls go on.
    let inner = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(inner.block_on(check(&endpoint)), Ok(ServingStatus::Serving));
    drop(outer);
    assert_eq!(inner.block_on(check(&endpoint)), Ok(ServingStatus::Serving));
}
