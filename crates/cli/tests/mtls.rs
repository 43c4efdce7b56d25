//! The distributed stack over mutual TLS: `turbine-worker`,
//! `turbine-router` and `turbine-gateway` as separate processes, each with
//! a certificate of its role from `turbine certs`, sharing a real Redis registry.
//! Every gRPC hop (gateway → router, gateway → worker, router → worker,
//! this test → each) is TLS with the caller's certificate checked against
//! the callee's role table, and the caller checking the callee's role.
//! Requests flow end to end; a caller of the wrong role is refused with
//! PERMISSION_DENIED naming the rpc; a plaintext caller and one expecting
//! another role get nothing. And every service of a deployment at once
//! (kv-index, kv-store, planner, two routers, two gateways, two workers).

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
use turbine_testkit::tls::TestCa;
use turbine_testkit::{RedisServer, RedisTls, workspace_binary};

/// The certificates `turbine certs` wrote under `dir` for `stem`
/// (`router`, `workers/worker-0`).
fn tls(dir: &Path, stem: &str) -> TlsConfig {
    let (cert, key) = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
    TlsConfig { tls_cert: Some(cert), tls_key: Some(key), tls_ca: Some(dir.join("ca.crt")) }
}

/// The `--tls-*` flags of `config`.
fn flags(config: &TlsConfig) -> Vec<String> {
    let path = |path: &Option<std::path::PathBuf>| path.as_deref().map(Path::display).expect("written").to_string();
    vec!["--tls-cert".into(), path(&config.tls_cert), "--tls-key".into(), path(&config.tls_key), "--tls-ca".into(), path(&config.tls_ca)]
}

/// `turbine certs --out dir --redis localhost`, a certificate for each
/// of `workers`.
fn make_certs(dir: &Path, workers: &[&str]) {
    let mut command = std::process::Command::new(workspace_binary("turbine"));
    command.arg("certs");
    for worker in workers {
        command.args(["--worker", worker]);
    }
    let output = command.args(["--redis", "localhost", "--out"]).arg(dir).output().expect("turbine certs runs");
    assert!(output.status.success(), "turbine certs: {}", String::from_utf8_lossy(&output.stderr));
}

/// A TLS-only redis-server with its certificate from `turbine certs` in
/// `dir` (this process, the operator, checks it is up).
fn redis_over_tls(dir: &Path) -> RedisServer {
    let file = |name: &str| dir.join(name);
    let tls =
        RedisTls { cert: file("redis.crt"), key: file("redis.key"), ca: file("ca.crt"), client_cert: file("operator.crt"), client_key: file("operator.key") };
    RedisServer::start_tls(&tls, &[])
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
    make_certs(dir.path(), &["worker-0"]);
    // This process is an operator: it waits on health and lists workers.
    tls(dir.path(), "operator").establish().unwrap().expect("an identity");

    // Redis over TLS too, with its certificate from turbine certs: every
    // service reaches it as rediss:// with its own certificate.
    let redis = redis_over_tls(dir.path());
    let url = redis.url();
    assert!(url.starts_with("rediss://"), "{url}");
    let cluster = ["--redis", url.as_str(), "--namespace", "mtls"];
    let worker_tls = flags(&tls(dir.path(), "workers/worker-0"));
    let router_tls = flags(&tls(dir.path(), "router"));
    let gateway_tls = flags(&tls(dir.path(), "gateway"));
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
    let as_router = tls_channel(&worker.grpc_endpoint(), &tls(dir.path(), "router").load().unwrap().unwrap(), Role::Worker).unwrap();
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
    let gateway_trust = tls(dir.path(), "gateway").load().unwrap().unwrap();
    let card = pb::GetModelCardRequest {};
    let meant = tls_channel(&worker.grpc_endpoint(), &gateway_trust, Role::Worker).unwrap();
    pb::worker_client::WorkerClient::new(meant).get_model_card(card).await.expect("a gateway reads the worker's card");
    let misdirected = tls_channel(&worker.grpc_endpoint(), &gateway_trust, Role::KvStore).unwrap();
    let refused = pb::worker_client::WorkerClient::new(misdirected).get_model_card(card).await.unwrap_err();
    assert_transport_failure(&refused);

    // Anyone who can write to Redis adds a worker record pointing at a
    // listener of theirs: the router skips it (no worker's seal), counts
    // it, and no request reaches the listener.
    let rogue = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    rogue.set_nonblocking(true).unwrap();
    let record =
        json!({"worker_id": "rogue", "endpoint": format!("http://{}", rogue.local_addr().unwrap()), "model": MODEL, "kv_block_size": 16, "instance": 1});
    // (The writer holds some certificate of the deployment, say a leaked
    // gateway's: enough to reach Redis, not to seal a worker's record.)
    let mut redis_cli = turbine_runtime::redis::client(&url).unwrap().get_multiplexed_async_connection().await.unwrap();
    redis::pipe()
        .cmd("SET")
        .arg("turbine:mtls:workers:rogue")
        .arg(record.to_string())
        .arg("EX")
        .arg(60)
        .ignore()
        .sadd("turbine:mtls:workers", "rogue")
        .ignore()
        .query_async::<()>(&mut redis_cli)
        .await
        .unwrap();
    let refused = async || turbine_testkit::metric_where(&router.admin_url(), "turbine_registry_refused_records_total", &[("reason", "unsigned")]).await;
    turbine_testkit::wait_until("the router reads the rogue record", std::time::Duration::from_secs(20), async || refused().await >= 1.0).await;
    for i in 0..6 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("victim {i}")}], "max_tokens": 4, "ignore_eos": true});
        let (status, body) = post(&base, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{body}");
    }
    assert!(rogue.accept().is_err(), "no connection reached the rogue listener");
    until_registered(&router, 1).await;

    // A raw XADD of events in worker-0's name: the router's index skips
    // it (unsealed) and counts it, while worker-0's own sealed events
    // were applied.
    let forged = turbine_kv::EventBatch {
        worker_id: "worker-0".into(),
        instance: 1,
        events: vec![turbine_kv::NumberedEvent { event_id: 1 << 40, event: turbine_kv::KvEvent::Cleared }],
    };
    let payload = prost::Message::encode_to_vec(&turbine_proto::kvindex::v1::EventBatch::from(&forged));
    let _: String = redis::cmd("XADD").arg("turbine:mtls:kv:events").arg("*").arg("b").arg(payload).query_async(&mut redis_cli).await.unwrap();
    let skipped = async || turbine_testkit::metric_where(&router.admin_url(), "turbine_kv_log_refused_entries_total", &[("reason", "unsigned")]).await;
    turbine_testkit::wait_until("the router skips the forged events", std::time::Duration::from_secs(20), async || skipped().await >= 1.0).await;
    assert_eq!(turbine_testkit::metric_where(&router.admin_url(), "turbine_kv_log_refused_entries_total", &[]).await, 1.0, "worker-0's own events all applied");

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

#[test]
fn turbine_certs_names_each_role_and_worker_and_overwrites_nothing() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path(), &["worker-0"]);
    for role in Role::ALL {
        let trust = tls(dir.path(), role.as_str()).load().unwrap().expect("credentials");
        assert_eq!((trust.peer().role, trust.peer().name.as_str()), (role, role.as_str()));
    }
    let worker = tls(dir.path(), "workers/worker-0").load().unwrap().unwrap();
    assert_eq!((worker.peer().role, worker.peer().name.as_str()), (Role::Worker, "worker-0"));
    let mode = |path: &str| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(dir.path().join(path)).unwrap().permissions()) & 0o777;
    assert_eq!(
        (mode("ca.key"), mode("router.key"), mode("workers/worker-0.key"), mode("redis.key")),
        (0o600, 0o600, 0o600, 0o600),
        "keys are the owner's only"
    );
    // (Redis's certificate names the --redis host: the stack test's
    // services verify it, reaching Redis as rediss://localhost.)
    let again = std::process::Command::new(workspace_binary("turbine")).args(["certs", "--out"]).arg(dir.path()).output().unwrap();
    assert!(!again.status.success(), "a second CA over the first is refused");
    assert!(String::from_utf8_lossy(&again.stderr).contains("overwrites nothing"), "{}", String::from_utf8_lossy(&again.stderr));
    let bad =
        std::process::Command::new(workspace_binary("turbine")).args(["certs", "--worker", "../x", "--out"]).arg(dir.path().join("other")).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("worker id"), "{}", String::from_utf8_lossy(&bad.stderr));
}

#[tokio::test]
async fn plaintext_beyond_loopback_is_refused_unless_insecure() {
    let redis = RedisServer::start();
    // Refused at start, naming the address and the ways out.
    let refused = std::process::Command::new(workspace_binary("turbine-router"))
        .args(["--redis", &redis.url(), "--grpc-addr", "0.0.0.0:0", "--admin-addr", "127.0.0.1:0"])
        .output()
        .expect("turbine-router runs");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains("refusing to serve gRPC in plaintext on 0.0.0.0") && stderr.contains("--insecure"), "{stderr}");
    // With --insecure it serves.
    let router = service("turbine-router", &["--redis", &redis.url(), "--grpc-addr", "0.0.0.0:0", "--insecure"], &[], false).await;
    assert!(router.addresses().grpc.ip().is_unspecified());
    // turbine run listens on loopback unless told otherwise, and exposing
    // it asks for --insecure.
    let refused = std::process::Command::new(workspace_binary("turbine"))
        .args(["run", "--engine", "mock", "--host", "0.0.0.0", "--http-port", "0", "--grpc-port", "0"])
        .output()
        .expect("turbine run runs");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("--insecure"), "{stderr}");
    drop((router, redis));
}

/// Every service of a deployment as its own process over mutual TLS, with
/// Redis over TLS: a kv-index, a kv-store, two mocker workers using the
/// store, two routers following the workers through the kv-index, a
/// planner, and a gateway on each router. Requests through both gateways
/// are routed by KV overlap (the index over TLS), blocks reach the store
/// (workers over TLS), the planner answers its operator; a router's
/// certificate may not delete from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_deployment_serves_with_mutual_tls_on_every_hop() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path(), &["worker-0", "worker-1"]);
    tls(dir.path(), "operator").establish().unwrap().expect("an identity");
    let redis = redis_over_tls(dir.path());
    let url = redis.url();
    let start = async |binary: &str, own: &[&str], stem: &str, http: bool| {
        let args: Vec<String> = own.iter().map(|arg| arg.to_string()).chain(flags(&tls(dir.path(), stem))).collect();
        service(binary, &args.iter().map(String::as_str).collect::<Vec<_>>(), &[], http).await
    };
    let cluster = ["--redis", url.as_str(), "--namespace", "whole"];
    let index = start("turbine-kv-index", &cluster, "kv-index", false).await;
    let store = start("turbine-kv-store", &[&cluster[..], &["--store-id", "store-0", "--memory-mib", "64"]].concat(), "kv-store", false).await;
    let store_endpoint = store.grpc_endpoint();
    let mut workers = Vec::new();
    for id in ["worker-0", "worker-1"] {
        let own =
            [&cluster[..], &["--engine", "mock", "--speedup", "1000", "--worker-id", id, "--host-cache-mib", "64", "--kv-store", &store_endpoint]].concat();
        workers.push(start("turbine-worker", &own, &format!("workers/{id}"), false).await);
    }
    let index_endpoint = index.grpc_endpoint();
    let mut routers = Vec::new();
    for _ in 0..2 {
        // The index's answer is awaited (on two busy cores its default
        // 100 ms may pass, and the request is then routed by load).
        let own = [&cluster[..], &["--policy", "kv", "--kv-index", &index_endpoint, "--kv-index-timeout-ms", "10000"]].concat();
        let router = start("turbine-router", &own, "router", false).await;
        until_registered(&router, 2).await;
        routers.push(router);
    }
    let database = format!("sqlite://{}?mode=rwc", dir.path().join("planner.db").display());
    let planner = start("turbine-planner", &[&cluster[..], &["--database", &database]].concat(), "planner", false).await;
    let mut gateways = Vec::new();
    for router in &routers {
        let gateway = start("turbine-gateway", &["--router", &router.grpc_endpoint()], "gateway", true).await;
        until_listed(&gateway.http_url()).await;
        gateways.push(gateway);
    }

    // The same 5-block prompt (64-token blocks) through either gateway:
    // after the first, the routers send it where its blocks are (or the
    // worker fetches them from the store), so it hits.
    let tokens: Vec<u32> = (0..320).map(|i| 500 + i).collect();
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 2, "ignore_eos": true});
    let mut cached = Vec::new();
    let operator = tls(dir.path(), "operator").load().unwrap().unwrap();
    let mut index_client = turbine_proto::kvindex::v1::kv_index_client::KvIndexClient::new(tls_channel(&index_endpoint, &operator, Role::Index).unwrap());
    for round in 0..4 {
        let (status, answer) = post(&gateways[round % 2].http_url(), "/v1/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
        cached.push(answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0));
        if round == 0 {
            // The first worker's blocks reach the index (over TLS) before
            // the repeats are routed by it.
            let query = turbine_proto::kvindex::v1::FindMatchesRequest { token_ids: tokens.clone(), block_size: 64, ..Default::default() };
            turbine_testkit::wait_until("the index holds the prompt's blocks", std::time::Duration::from_secs(30), async || {
                index_client.find_matches(query.clone()).await.is_ok_and(|found| found.into_inner().matches.iter().any(|worker| worker.device_blocks >= 4))
            })
            .await;
        }
    }
    assert_eq!(cached[0], 0);
    assert!(cached[1..].iter().all(|&hit| hit == 256), "every repeat hits its 4 full blocks: {cached:?}");

    // The workers put their blocks in the store over TLS; an operator
    // reads its stats; a router may not delete from it.
    let mut store_client = turbine_proto::kvstore::v1::kv_store_client::KvStoreClient::new(tls_channel(&store_endpoint, &operator, Role::KvStore).unwrap());
    turbine_testkit::wait_until("blocks in the store", std::time::Duration::from_secs(30), async || {
        store_client.stats(turbine_proto::kvstore::v1::StatsRequest {}).await.is_ok_and(|stats| stats.into_inner().put_blocks >= 4)
    })
    .await;
    let as_router = tls(dir.path(), "router").load().unwrap().unwrap();
    let mut store_as_router = turbine_proto::kvstore::v1::kv_store_client::KvStoreClient::new(tls_channel(&store_endpoint, &as_router, Role::KvStore).unwrap());
    let refused = store_as_router.delete(turbine_proto::kvstore::v1::DeleteRequest::default()).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("/turbine.kvstore.v1.KvStore/Delete"), "{}", refused.message());
    let mut planner_client =
        turbine_proto::planner::v1::planner_client::PlannerClient::new(tls_channel(&planner.grpc_endpoint(), &operator, Role::Planner).unwrap());
    planner_client.get_plan(turbine_proto::planner::v1::GetPlanRequest::default()).await.expect("the operator reads the plan");
    drop((gateways, routers, planner, workers, store, index, redis));
}

/// A worker certificate limited to KV tenants (`turbine certs
/// --worker-tenant`): the kv-store, over mutual TLS, takes from it only
/// its tenants' blocks (anything else is refused whole with
/// PERMISSION_DENIED naming the tenant, and counted) and shows it only
/// theirs (Get, Lookup and Lease end where another tenant's block is),
/// while a worker's certificate that names no tenant writes and reads
/// every tenant's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_limited_to_tenants_can_neither_write_nor_read_another_tenants_blocks() {
    use turbine_kv::KvTenant;
    use turbine_proto::kvstore::v1 as kv;

    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(workspace_binary("turbine"))
        .args(["certs", "--worker", "acme-0", "--worker", "any-0", "--worker-tenant", "acme-0=tenant:acme", "--worker-tenant", "acme-0=shared:system"])
        .arg("--out")
        .arg(dir.path())
        .output()
        .expect("turbine certs runs");
    assert!(output.status.success(), "turbine certs: {}", String::from_utf8_lossy(&output.stderr));
    let refused = std::process::Command::new(workspace_binary("turbine"))
        .args(["certs", "--worker", "acme-0", "--worker-tenant", "bravo-0=tenant:bravo"])
        .arg("--out")
        .arg(dir.path().join("again"))
        .output()
        .unwrap();
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("neither a --worker"), "a tenant for a holder not made");
    tls(dir.path(), "operator").establish().unwrap().expect("an identity");
    let args: Vec<String> = ["--memory-mib", "16"].into_iter().map(String::from).chain(flags(&tls(dir.path(), "kv-store"))).collect();
    let store = service("turbine-kv-store", &args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    let as_worker = |id: &str| {
        let trust = tls(dir.path(), &format!("workers/{id}")).load().unwrap().unwrap();
        kv::kv_store_client::KvStoreClient::new(tls_channel(&store.grpc_endpoint(), &trust, Role::KvStore).unwrap())
    };
    let (mut acme, mut any) = (as_worker("acme-0"), as_worker("any-0"));

    const BLOCK: usize = 256;
    let fingerprint = turbine_api::kv_store::Fingerprint::declaring(11, BLOCK as u32).get();
    let block = |n: u64, tenant: KvTenant| {
        let data: Vec<u8> = (0..BLOCK).map(|i| (i as u64 * 3 + n) as u8).collect();
        kv::Block {
            sequence_hash: 0x100 + n,
            local_hash: n,
            parent_hash: n.checked_sub(1).map(|p| 0x100 + p),
            checksum: turbine_kv::block_checksum(&data),
            tenant: tenant.get(),
            data,
        }
    };
    let put = |blocks: Vec<kv::Block>| tokio_stream::iter([kv::PutRequest { fingerprint, blocks }]);
    let (acme_tenant, system, bravo) = (KvTenant::of_tenant("acme"), KvTenant::of_shared("system"), KvTenant::of_tenant("bravo"));
    let refusals = async || turbine_testkit::metric_where(&store.admin_url(), "turbine_kv_store_tenant_refused_blocks_total", &[("op", "write")]).await;

    // Its tenants' blocks are stored; a call with one block of another
    // tenant is refused whole.
    assert_eq!(acme.put(put(vec![block(0, acme_tenant), block(1, system)])).await.unwrap().into_inner().stored, 2);
    let denied = acme.put(put(vec![block(2, acme_tenant), block(3, bravo)])).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains(&format!("{:016x}", bravo.get())) && denied.message().contains("acme-0"), "{}", denied.message());
    assert_eq!(refusals().await, 1.0, "the refused block counted");
    let open = acme.put(put(vec![block(2, KvTenant::SHARED)])).await.unwrap_err();
    assert_eq!(open.code(), Code::PermissionDenied, "the open namespace is a tenant it was not given");

    // A worker whose certificate names no tenant writes any tenant's: bravo's
    // blocks 2 and 3 follow acme's 0 and 1 in one chain of hashes.
    assert_eq!(any.put(put(vec![block(2, bravo), block(3, bravo)])).await.unwrap().into_inner().stored, 2);
    let hashes: Vec<u64> = (0..4).map(|n| 0x100 + n).collect();
    let run = |client: &mut kv::kv_store_client::KvStoreClient<_>| {
        let mut client = client.clone();
        let request = kv::GetRequest { fingerprint, sequence_hashes: hashes.clone() };
        async move {
            let mut stream = client.get(request).await.unwrap().into_inner();
            let mut got = Vec::new();
            while let Some(message) = stream.message().await.unwrap() {
                got.push(message.block.unwrap().sequence_hash);
            }
            got
        }
    };
    assert_eq!(run(&mut any).await, hashes, "every tenant's blocks for the unlimited worker");
    assert_eq!(run(&mut acme).await, hashes[..2], "the limited worker's run ends at bravo's first block");
    let lookup = |client: &mut kv::kv_store_client::KvStoreClient<_>| {
        let mut client = client.clone();
        let request = kv::LookupRequest { fingerprint, sequence_hashes: hashes.clone() };
        async move { client.lookup(request).await.unwrap().into_inner() }
    };
    let seen = lookup(&mut acme).await;
    assert_eq!((seen.present, seen.leading), (vec![true, true, false, false], 2), "bravo's blocks are not held for acme's worker");
    assert_eq!(lookup(&mut any).await.leading, 4);
    let hidden = turbine_testkit::metric_where(&store.admin_url(), "turbine_kv_store_tenant_refused_blocks_total", &[("op", "read")]).await;
    assert_eq!(hidden, 4.0, "the blocks hidden from it counted: two not served by Get, two hidden from Lookup");

    // Over UCX the same: a lease grants only the blocks it may read.
    match acme.lease(kv::LeaseRequest { fingerprint, sequence_hashes: hashes.clone() }).await {
        Ok(lease) => {
            let lease = lease.into_inner();
            assert_eq!(lease.blocks.iter().map(|block| block.sequence_hash).collect::<Vec<_>>(), hashes[..2]);
            acme.release(kv::ReleaseRequest { lease_id: lease.lease_id }).await.unwrap();
            let staged = kv::StagedBlock { sequence_hash: 0x200, local_hash: 1, length: BLOCK as u64, tenant: bravo.get(), ..Default::default() };
            let region = Some(kv::UcxRegion { length: 1 << 20, ..Default::default() });
            let denied = acme.put_from(kv::PutFromRequest { fingerprint, region, blocks: vec![staged] }).await.unwrap_err();
            assert_eq!(denied.code(), Code::PermissionDenied, "refused before a byte is read: {denied:?}");
        }
        Err(status) => assert_eq!(status.code(), Code::FailedPrecondition, "a store without UCX: {status:?}"),
    }

    // Writing another tenant's blocks call after call on one connection
    // loses it (a call fails in transport, not with an answer); connecting
    // again, the worker is answered.
    let mut cut = None;
    for call in 0..4 * turbine_runtime::strikes::STRIKES_BURST as usize {
        let denied = acme.put(put(vec![block(3, bravo)])).await.unwrap_err();
        if denied.code() != Code::PermissionDenied {
            cut = Some(call);
            break;
        }
    }
    assert!(cut.is_some(), "a worker refused write after write on one connection loses it");
    assert!(turbine_testkit::metric_where(&store.admin_url(), "turbine_grpc_connections_struck_off_total", &[]).await >= 1.0);
    assert_eq!(acme.put(put(vec![block(3, bravo)])).await.unwrap_err().code(), Code::PermissionDenied, "answered on a new connection");
    drop(store);
}

/// A tenant given its own pool of workers (certificates limited to it by
/// `turbine certs --worker-tenant`) is served there, and another tenant's
/// requests never reach that pool: the router reads each worker's tenants
/// from the certificate that seals its registry record (its `ListWorkers`
/// shows them), the gateway names each request's tenant from its API key.
/// Round robin alone would spread both tenants over both workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_requests_stay_on_its_own_pool_and_no_other_tenant_reaches_it() {
    use turbine_gateway::keys::{entry, new_key};
    use turbine_kv::KvTenant;

    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(workspace_binary("turbine"))
        .args(["certs", "--worker", "acme-0", "--worker", "any-0", "--worker-tenant", "acme-0=tenant:acme", "--redis", "localhost", "--out"])
        .arg(dir.path())
        .output()
        .expect("turbine certs runs");
    assert!(output.status.success(), "turbine certs: {}", String::from_utf8_lossy(&output.stderr));
    tls(dir.path(), "operator").establish().unwrap().expect("an identity");
    let redis = redis_over_tls(dir.path());
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "pools"];
    let args = |own: &[&str], stem: &str| -> Vec<String> { own.iter().map(|arg| arg.to_string()).chain(flags(&tls(dir.path(), stem))).collect() };
    let mut workers = Vec::new();
    for id in ["acme-0", "any-0"] {
        let worker_args = args(&[&cluster[..], &["--engine", "mock", "--speedup", "1000", "--worker-id", id]].concat(), &format!("workers/{id}"));
        workers.push(service("turbine-worker", &worker_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await);
    }
    let router_args = args(&[&cluster[..], &["--policy", "round-robin"]].concat(), "router");
    let router = service("turbine-router", &router_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    until_registered(&router, 2).await;
    let listed = turbine_api::router::RouterClient::connect(&router.grpc_endpoint()).unwrap().workers(None).await.unwrap();
    let tenants: Vec<(String, Vec<KvTenant>)> = listed.into_iter().map(|worker| (worker.worker_id.to_string(), worker.kv_tenants)).collect();
    assert_eq!(tenants, [("acme-0".to_owned(), vec![KvTenant::of_tenant("acme")]), ("any-0".to_owned(), Vec::new())], "read from the seals");

    let (acme, bravo) = (new_key(), new_key());
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, [entry("acme-app", "acme", None, &acme), entry("bravo-app", "bravo", None, &bravo)].join("\n")).unwrap();
    let gateway_args = args(&["--router", &router.grpc_endpoint(), "--api-keys", keys.to_str().unwrap()], "gateway");
    let gateway = service("turbine-gateway", &gateway_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], true).await;
    let http = reqwest::Client::new();
    let complete = async |key: &str, i: usize| {
        let body = json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 2, "ignore_eos": true});
        http.post(format!("{}/v1/completions", gateway.http_url())).bearer_auth(key).json(&body).send().await.unwrap().status().as_u16()
    };
    turbine_testkit::wait_until("the gateway serves", turbine_testkit::STARTUP_TIMEOUT, async || complete(&bravo, 0).await == 200).await;
    let served = async || {
        let count = async |worker: &turbine_testkit::ServiceProcess| turbine_testkit::metric(&worker.admin_url(), "turbine_worker_requests_total").await;
        (count(&workers[0]).await, count(&workers[1]).await)
    };
    // Each tenant's six in a row: round robin alone would put three on
    // each worker.
    for (key, expected) in [(&acme, (6.0, 0.0)), (&bravo, (0.0, 6.0))] {
        let before = served().await;
        for i in 0..6 {
            assert_eq!(complete(key, i).await, 200);
        }
        let after = served().await;
        assert_eq!((after.0 - before.0, after.1 - before.1), expected, "acme's on its pool, bravo's on the unlimited worker");
    }
    drop((gateway, router, workers, redis));
}

/// The gateway's public ports over TLS with a public certificate
/// (`--public-tls-cert`, `--public-tls-key`), its services over mutual
/// TLS behind it: a client holding no certificate, only the public CA and
/// an API key, gets a completion over HTTPS and a stream from gRPC
/// `Inference` over TLS; without a key it is refused by the gateway; a
/// plaintext request gets no answer; and a client that opens a connection
/// and never finishes its handshake holds up no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_public_ports_serve_tls_to_clients_without_certificates() {
    use turbine_gateway::keys::{entry, new_key};
    use turbine_proto::gateway::v1 as api;

    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path(), &["worker-0"]);
    tls(dir.path(), "operator").establish().unwrap().expect("an identity");
    // The public certificate comes from another CA, one the clients trust.
    let public_ca = TestCa::new("public");
    let public = public_ca.issue_names(&["localhost".to_owned()], "api.example").write(dir.path(), "public");
    let redis = redis_over_tls(dir.path());
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "public"];
    let args = |own: &[&str], stem: &str| -> Vec<String> { own.iter().map(|arg| arg.to_string()).chain(flags(&tls(dir.path(), stem))).collect() };
    let worker_args = args(&[&cluster[..], &["--engine", "mock", "--speedup", "1000", "--worker-id", "worker-0"]].concat(), "workers/worker-0");
    let worker = service("turbine-worker", &worker_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    let router_args = args(&cluster, "router");
    let router = service("turbine-router", &router_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    until_registered(&router, 1).await;
    let key = new_key();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, entry("app", "acme", None, &key)).unwrap();
    let (cert, private) = (public.tls_cert.as_deref().unwrap(), public.tls_key.as_deref().unwrap());
    let own = ["--router", &router.grpc_endpoint(), "--api-keys", keys.to_str().unwrap(), "--public-tls-cert", cert.to_str().unwrap(), "--public-tls-key"];
    let gateway_args = args(&[&own[..], &[private.to_str().unwrap()]].concat(), "gateway");
    // Readiness from its admin port (plaintext, kept off the API's).
    let mut command = std::process::Command::new(workspace_binary("turbine-gateway"));
    command.args(&gateway_args);
    let gateway = turbine_testkit::ServiceProcess::spawn("turbine-gateway", command, true).await.unwrap();
    let ready = async || reqwest::get(format!("{}/readyz", gateway.admin_url())).await.is_ok_and(|response| response.status() == 200);
    turbine_testkit::wait_until("the gateway is ready", turbine_testkit::STARTUP_TIMEOUT, ready).await;
    let http = gateway.addresses().http.expect("an HTTP port");

    // HTTPS: the client trusts the public CA only.
    let body = json!({"model": MODEL, "prompt": "over https", "max_tokens": 3, "ignore_eos": true});
    let https = async |key: Option<&str>| common::https_post(http, public_ca.pem(), "/v1/completions", key, &body).await;
    // A client that connects and never says anything.
    let _silent = tokio::net::TcpStream::connect(http).await.unwrap();
    let served = https(Some(&key)).await;
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    assert!(served.contains("\"completion_tokens\":3"), "{served}");
    let refused = https(None).await;
    assert!(refused.starts_with("HTTP/1.1 401") && refused.contains("invalid_api_key"), "{refused}");
    // Plaintext HTTP to the TLS port: no HTTP answer.
    let plaintext =
        reqwest::Client::new().post(format!("http://{http}/v1/completions")).bearer_auth(&key).json(&json!({"model": MODEL, "prompt": "x"})).send().await;
    assert!(plaintext.is_err(), "a plaintext request was answered: {plaintext:?}");
    // Counted as the server drops the connection, which the client may
    // see first.
    let admin = gateway.admin_url();
    turbine_testkit::wait_until("the plaintext request counted as a refused handshake", std::time::Duration::from_secs(10), async || {
        turbine_testkit::metric_where(&admin, "turbine_public_tls_handshakes_failed_total", &[("reason", "refused")]).await >= 1.0
    })
    .await;

    // gRPC Inference over TLS, no client certificate, the key in metadata.
    let tls_config = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(public_ca.pem())).domain_name("localhost");
    let grpc = gateway.addresses().grpc;
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{grpc}")).unwrap().tls_config(tls_config.clone()).unwrap().connect().await.unwrap();
    let mut inference = api::inference_client::InferenceClient::new(channel);
    let generate = api::GenerateRequest {
        model: MODEL.into(),
        input: Some(api::generate_request::Input::Prompt("over grpc".into())),
        max_tokens: Some(4),
        ignore_eos: true,
        ..Default::default()
    };
    let mut request = tonic::Request::new(generate.clone());
    request.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    let mut stream = inference.generate(request).await.expect("served over TLS").into_inner();
    let mut last = None;
    while let Some(message) = stream.message().await.unwrap() {
        last = Some(message);
    }
    assert_eq!(last.and_then(|message| message.usage).map(|usage| usage.completion_tokens), Some(4));
    let refused = inference.generate(tonic::Request::new(generate.clone())).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    // Refused call after call on one connection (keys guessed), the client
    // loses it: a call fails in transport, not with an answer; connecting
    // again with the key, it is served.
    let mut cut = None;
    for call in 0..4 * turbine_runtime::strikes::STRIKES_BURST as usize {
        let mut guess = tonic::Request::new(generate.clone());
        guess.metadata_mut().insert("authorization", format!("Bearer tk-guess-{call}").parse().unwrap());
        let refused = inference.generate(guess).await.unwrap_err();
        if refused.code() != Code::Unauthenticated {
            cut = Some(call);
            break;
        }
    }
    assert!(cut.is_some(), "a client refused its key call after call on one connection loses it");
    assert!(turbine_testkit::metric_where(&gateway.admin_url(), "turbine_grpc_connections_struck_off_total", &[]).await >= 1.0);
    // A connection of its own (the old channel's reconnect may race the
    // closing one's last frames): served with the key.
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{grpc}")).unwrap().tls_config(tls_config).unwrap().connect().await.unwrap();
    let mut request = tonic::Request::new(generate);
    request.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    api::inference_client::InferenceClient::new(channel).generate(request).await.expect("served on a new connection");

    // The same over REST: keys guessed on one kept-alive HTTPS connection
    // are answered 401 until the connection is cut (a request gets no
    // answer); the client connecting again with the key is served.
    let mut kept = common::KeptHttps::connect(http, public_ca.pem()).await;
    let mut cut = None;
    for call in 0..4 * turbine_runtime::strikes::STRIKES_BURST as usize {
        match kept.get("/v1/models", &format!("tk-guess-{call}")).await {
            Some(401) => continue,
            Some(other) => panic!("a guessed key answered {other}"),
            None => {
                cut = Some(call);
                break;
            }
        }
    }
    assert!(cut.is_some_and(|call| call >= turbine_runtime::strikes::STRIKES_BURST as usize), "cut past the burst, not before: {cut:?}");
    assert_eq!(turbine_testkit::metric_where(&admin, "turbine_http_connections_struck_off_total", &[]).await, 1.0);
    let mut again = common::KeptHttps::connect(http, public_ca.pem()).await;
    assert_eq!(again.get("/v1/models", &key).await, Some(200), "served on a new connection");
    drop((gateway, router, worker, redis));
}
