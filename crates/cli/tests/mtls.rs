//! The distributed stack over mutual TLS: `turbine-worker`,
//! `turbine-router` and `turbine-gateway` as separate processes, each with
//! a certificate of its role from one CA, sharing a real Redis registry.
//! Every gRPC hop (gateway → router, gateway → worker, router → worker,
//! this test → each) is TLS with the caller's certificate checked against
//! the callee's role table, and the caller checking the callee's role.
//! Requests flow end to end; a caller of the wrong role is refused with
//! PERMISSION_DENIED naming the rpc; a plaintext caller and one expecting
//! another role get nothing.

mod common;

use std::error::Error as _;
use std::path::Path;

use common::{MODEL, post, service, until_listed, until_registered};
use serde_json::json;
use tonic::Code;
use turbine_proto::worker::v1 as pb;
use turbine_runtime::grpc::tls_channel;
use turbine_runtime::host::Role;
use turbine_runtime::trust::TlsConfig;
use turbine_testkit::RedisServer;
use turbine_testkit::tls::TestCa;

/// The `--tls-*` flags of `config`.
fn flags(config: &TlsConfig) -> Vec<String> {
    let path = |path: &Option<std::path::PathBuf>| path.as_deref().map(Path::display).expect("written").to_string();
    vec!["--tls-cert".into(), path(&config.tls_cert), "--tls-key".into(), path(&config.tls_key), "--tls-ca".into(), path(&config.tls_ca)]
}

/// A call the connection failed (the handshake refused, or a plaintext
/// HTTP/2 preface read as TLS): how it reads depends on when the
/// connection broke, never as an answer of the service.
fn assert_transport_failure(status: &tonic::Status) {
    let transport = matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Internal);
    assert!(transport && status.source().is_some(), "a transport failure: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_with_every_hop_over_mutual_tls_serves_and_refuses_the_wrong_role() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("turbine test CA");
    // This process is an operator: it waits on health and lists workers.
    ca.issue(Role::Operator, "test").write(dir.path(), "operator").establish().unwrap().expect("an identity");

    let redis = RedisServer::start();
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "mtls"];
    let worker_tls = flags(&ca.issue(Role::Worker, "worker-0").write(dir.path(), "worker"));
    let router_tls = flags(&ca.issue(Role::Router, "router-0").write(dir.path(), "router"));
    let gateway_tls = flags(&ca.issue(Role::Gateway, "gateway-0").write(dir.path(), "gateway"));
    let args = |own: &[&str], tls: &[String]| -> Vec<String> { own.iter().map(|arg| arg.to_string()).chain(tls.iter().cloned()).collect() };

    let worker_args = args(&[&cluster[..], &["--engine", "mock", "--speedup", "1000", "--worker-id", "worker-0"]].concat(), &worker_tls);
    let worker = service("turbine-worker", &worker_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    let router_args = args(&[&cluster[..], &["--policy", "round-robin"]].concat(), &router_tls);
    let router = service("turbine-router", &router_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    until_registered(&router, 1).await;
    let gateway_args = args(&["--router", &router.grpc_endpoint()], &gateway_tls);
    let gateway = service("turbine-gateway", &gateway_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;

    // A request end to end: the gateway routes over TLS and streams from
    // the worker over TLS.
    for i in 0..3 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("question {i}")}], "max_tokens": 8, "ignore_eos": true});
        let (status, body) = post(&base, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 8);
    }

    // A router's certificate may not generate on a worker (only gateways).
    let generate = pb::GenerateRequest { request_id: "not-a-gateway".into(), prompt_token_ids: vec![1, 2, 3], ..Default::default() };
    let as_router = tls_channel(&worker.grpc_endpoint(), &ca.trust(Role::Router, "router-1"), Role::Worker).unwrap();
    let refused = pb::worker_client::WorkerClient::new(as_router).generate(generate.clone()).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("/turbine.worker.v1.Worker/Generate"), "{}", refused.message());

    // A plaintext caller gets no answer from a TLS service.
    let plaintext = turbine_runtime::grpc::traced_channel(&worker.grpc_endpoint()).unwrap();
    let refused = pb::worker_client::WorkerClient::new(plaintext).generate(generate).await.unwrap_err();
    assert_transport_failure(&refused);

    // A caller that means to reach a kv-store refuses the worker's
    // certificate, with a certificate the worker takes from a caller that
    // means to reach a worker.
    let gateway_trust = ca.trust(Role::Gateway, "gateway-1");
    let card = pb::GetModelCardRequest {};
    let meant = tls_channel(&worker.grpc_endpoint(), &gateway_trust, Role::Worker).unwrap();
    pb::worker_client::WorkerClient::new(meant).get_model_card(card).await.expect("a gateway reads the worker's card");
    let misdirected = tls_channel(&worker.grpc_endpoint(), &gateway_trust, Role::KvStore).unwrap();
    let refused = pb::worker_client::WorkerClient::new(misdirected).get_model_card(card).await.unwrap_err();
    assert_transport_failure(&refused);

    // The stack served on through all of it.
    let body = json!({"model": MODEL, "prompt": "still serving", "max_tokens": 4, "ignore_eos": true});
    let (status, body) = post(&base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{body}");
    drop((gateway, router, worker, redis));
}

#[test]
fn a_process_dials_with_one_identity() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("turbine test CA");
    assert!(turbine_runtime::trust::dialing_as().is_none(), "plaintext until certificates are given");
    assert!(TlsConfig::default().establish().unwrap().is_none());
    let router = ca.issue(Role::Router, "router-0").write(dir.path(), "router");
    let first = router.establish().unwrap().expect("an identity");
    assert_eq!(first.peer().role, Role::Router);
    assert_eq!(turbine_runtime::trust::dialing_as().map(|trust| trust.peer().clone()), Some(first.peer().clone()));
    // The same files again (a second service of the process): the same identity.
    assert_eq!(router.establish().unwrap().map(|trust| trust.peer().clone()), Some(first.peer().clone()));
    // Other files: refused, naming the identity the process has.
    let other = ca.issue(Role::Gateway, "gateway-0").write(dir.path(), "gateway");
    let refused = other.establish().unwrap_err().to_string();
    assert!(refused.contains("already has the identity"), "{refused}");
    assert_eq!(turbine_runtime::trust::dialing_as().unwrap().peer().role, Role::Router);
}
