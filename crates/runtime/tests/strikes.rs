//! Refusals per connection over real sockets and mutual TLS: a caller
//! refused call after call on one kept connection loses it once its
//! burst is spent (the next call fails in transport, not with an answer),
//! and is answered again only on a new connection; another caller's
//! connection serves throughout.

use std::time::Duration;

use tokio::net::TcpListener;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use turbine_proto::planner::v1 as pb;
use turbine_runtime::CancellationToken;
use turbine_runtime::grpc::{Accepting, ServerSecurity, base_routes, serve, tls_channel};
use turbine_runtime::health::Readiness;
use turbine_runtime::host::{Role, RpcRoles};
use turbine_runtime::strikes::STRIKES_BURST;
use turbine_testkit::tls::TestCa;

/// Only operators may read the plan (no planner is mounted: the refusal
/// comes first).
const ROLES: &[RpcRoles] = &[RpcRoles { method: "/turbine.planner.v1.Planner/GetPlan", roles: &[Role::Operator] }];

#[tokio::test]
async fn a_caller_refused_again_and_again_on_one_connection_loses_it() {
    let ca = TestCa::new("deployment");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (readiness, health) = Readiness::new(&["svc"]).await;
    readiness.set_ready(true).await;
    let stop = CancellationToken::new();
    let security = ServerSecurity::Mutual(ca.trust(Role::Planner, "planner"));
    tokio::spawn(serve(
        listener,
        base_routes(health, &[]),
        stop.clone(),
        Duration::from_secs(1),
        Duration::from_secs(10),
        16,
        security,
        ROLES,
        Accepting::default(),
    ));

    let struck_off = || {
        let text = turbine_runtime::metrics::render();
        let line = text.lines().find(|line| line.starts_with("turbine_grpc_connections_struck_off_total ")).map(str::to_owned);
        line.and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0)
    };
    let before = struck_off();
    let operator = tls_channel(&endpoint, &ca.trust(Role::Operator, "ops"), Role::Planner).unwrap();
    let mut watching = HealthClient::new(operator);
    let mut router = pb::planner_client::PlannerClient::new(tls_channel(&endpoint, &ca.trust(Role::Router, "router"), Role::Planner).unwrap());
    for call in 0..STRIKES_BURST as usize {
        let refused = router.get_plan(pb::GetPlanRequest::default()).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "call {call}: {refused:?}");
    }
    let cut = router.get_plan(pb::GetPlanRequest::default()).await.unwrap_err();
    assert_ne!(cut.code(), Code::PermissionDenied, "the call past the burst loses the connection: {cut:?}");
    assert_eq!(struck_off() - before, 1.0);
    // The other caller's connection was never touched.
    watching.check(HealthCheckRequest { service: "svc".into() }).await.expect("another connection serves");
    // A new connection starts with a full bucket: answered (and refused) again.
    let again = router.get_plan(pb::GetPlanRequest::default()).await.unwrap_err();
    assert_eq!(again.code(), Code::PermissionDenied, "{again:?}");
    stop.cancel();
}
