//! The planner over mutual TLS, on real sockets, with certificates from a
//! CA made for the test: each rpc answers the roles its row of the
//! planner's role table names and refuses the others with
//! PERMISSION_DENIED naming the caller; health is open to every holder of
//! a certificate from the CA; a caller without a certificate, with another
//! CA's, or with one that names no role is refused; a client that means
//! to reach another role refuses the planner's certificate; and the
//! planner keeps serving through all of it.

use tonic::Code;
use turbine_proto::planner::v1 as pb;
use turbine_runtime::CancellationToken;
use turbine_runtime::grpc::{TracedChannel, tls_channel};
use turbine_runtime::host::Role;
use turbine_runtime::trust::Trust;
use turbine_testkit::STARTUP_TIMEOUT;
use turbine_testkit::tls::TestCa;

type Client = pb::planner_client::PlannerClient<TracedChannel>;

fn client(endpoint: &str, trust: &Trust) -> Client {
    Client::new(tls_channel(endpoint, trust, Role::Planner).unwrap())
}

async fn get_plan(client: &Client) -> Result<(), tonic::Status> {
    client.clone().get_plan(pb::GetPlanRequest {}).await.map(drop)
}

async fn pause(client: &Client) -> Result<(), tonic::Status> {
    client.clone().pause(pb::PauseRequest { reason: "trust test".into() }).await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rpc_answers_the_roles_its_row_names_over_mutual_tls() {
    let _telemetry = turbine_runtime::telemetry::init("trust-test");
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("turbine test CA");
    let database = format!("sqlite:{}", dir.path().join("planner.sqlite").display());
    let state = turbine_planner::PlannerState::new(turbine_planner::Ledger::open(&database, "test").await.unwrap());
    let mut config = turbine_planner::PlannerConfig::default();
    config.planning.database = Some(database);
    config.server.tls = ca.issue(Role::Planner, "planner-0").write(dir.path(), "planner");
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let serving = tokio::spawn(turbine_planner::serve(config, state, None, listeners, shutdown.clone()));

    // Health, for a scraper's certificate.
    let monitoring = ca.trust(Role::Monitoring, "prometheus");
    let connect = || tls_channel(&endpoint, &monitoring, Role::Planner).ok();
    tokio::time::timeout(STARTUP_TIMEOUT, turbine_runtime::health::until_serving_over(connect, "turbine.planner.v1.Planner"))
        .await
        .expect("the planner serves over TLS");

    // Reading the plan: operators and monitoring; changing it: operators.
    let operator = client(&endpoint, &ca.trust(Role::Operator, "alice"));
    let monitoring = client(&endpoint, &monitoring);
    let router = client(&endpoint, &ca.trust(Role::Router, "router-0"));
    get_plan(&operator).await.expect("an operator reads the plan");
    get_plan(&monitoring).await.expect("monitoring reads the plan");
    pause(&operator).await.expect("an operator pauses");
    let denied = pause(&monitoring).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains("monitoring \"prometheus\"") && denied.message().contains("/turbine.planner.v1.Planner/Pause"), "{denied:?}");
    assert!(denied.message().contains("callers: operator"), "the message names who may: {denied:?}");
    let denied = get_plan(&router).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains("router \"router-0\""), "{denied:?}");
    // Health is open to every role the CA vouches for.
    let router_channel = || tls_channel(&endpoint, &ca.trust(Role::Router, "router-0"), Role::Planner).ok();
    tokio::time::timeout(STARTUP_TIMEOUT, turbine_runtime::health::until_serving_over(router_channel, "")).await.expect("a router reads health");

    // A certificate from the CA that names no role: refused per call.
    let nameless = ca.issue_names(&["planner.example".into()], "mallory");
    let tls = tonic::transport::ClientTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(&nameless.cert, &nameless.key))
        .ca_certificate(tonic::transport::Certificate::from_pem(&nameless.ca))
        .domain_name(Role::Planner.dns_name());
    let https = endpoint.replace("http://", "https://");
    let channel = tonic::transport::Endpoint::from_shared(https).unwrap().tls_config(tls).unwrap().connect_lazy();
    let nameless = Client::new(tonic::service::interceptor::InterceptedService::new(channel, turbine_runtime::propagation::TraceContextInterceptor));
    let refused = get_plan(&nameless).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("names no role"), "{refused:?}");

    // Another CA's operator: the handshake fails.
    let stranger = TestCa::new("another CA");
    let refused = get_plan(&client(&endpoint, &stranger.trust(Role::Operator, "eve"))).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    // No certificate at all (plaintext, or TLS without a client
    // certificate): no call gets through.
    let plaintext = Client::new(turbine_runtime::grpc::traced_channel(&endpoint).unwrap());
    assert!(get_plan(&plaintext).await.is_err(), "a plaintext caller reached the planner");
    // A client that means to reach a router refuses the planner's
    // certificate (it names `planner.turbine`).
    let misdirected = Client::new(tls_channel(&endpoint, &ca.trust(Role::Operator, "alice"), Role::Router).unwrap());
    let refused = get_plan(&misdirected).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");

    // The planner serves on.
    get_plan(&operator).await.expect("the planner serves after the refusals");
    shutdown.cancel();
    tokio::time::timeout(STARTUP_TIMEOUT, serving).await.expect("the planner drains").unwrap().unwrap();
}
