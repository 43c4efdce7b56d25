//! A public port's TLS over real sockets: a channel pinned to a
//! certificate reaches a server presenting it, and not one presenting
//! another certificate of the same CA.

use std::time::Duration;

use tokio::net::TcpListener;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use turbine_runtime::CancellationToken;
use turbine_runtime::grpc::{Accepting, ServerSecurity, base_routes, serve};
use turbine_runtime::health::{Readiness, until_serving_over};
use turbine_runtime::public_tls::PublicTls;
use turbine_testkit::tls::TestCa;

/// A gRPC server with health only (SERVING), over TLS with `tls`.
async fn serving(tls: PublicTls) -> (String, CancellationToken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (readiness, health) = Readiness::new(&["svc"]).await;
    readiness.set_ready(true).await;
    let stop = CancellationToken::new();
    let server = serve(
        listener,
        base_routes(health, &[]),
        stop.clone(),
        Duration::from_secs(1),
        Duration::from_secs(10),
        16,
        ServerSecurity::Public(tls),
        &[],
        Accepting::default(),
    );
    tokio::spawn(server);
    (endpoint, stop)
}

#[tokio::test]
async fn a_pinned_channel_reaches_its_own_certificate_and_no_other() {
    let ca = TestCa::new("public");
    let issue = |name: &str| {
        let issued = ca.issue_names(&["localhost".to_owned()], name);
        PublicTls::from_pem(issued.cert.as_bytes(), issued.key.as_bytes()).unwrap()
    };
    let (ours, theirs) = (issue("ours"), issue("theirs"));
    let (endpoint, _stop) = serving(ours.clone()).await;
    let reached = until_serving_over(|| ours.pinned_channel(&endpoint).ok(), "svc");
    tokio::time::timeout(Duration::from_secs(20), reached).await.expect("the pinned channel reaches the server presenting its certificate");
    // The same CA signed theirs: a channel pinned to it refuses our server.
    let mut client = HealthClient::new(theirs.pinned_channel(&endpoint).unwrap());
    let refused = client.check(HealthCheckRequest { service: "svc".into() }).await.unwrap_err();
    assert!(matches!(refused.code(), Code::Unavailable | Code::Unknown), "{refused:?}");
}
