//! The `turbine-router` binary against a real Redis registry: workers that
//! join take traffic within 2 s, a worker whose heartbeats stop loses
//! traffic within its lease TTL, a deregistered one at the next poll, and a
//! Redis outage keeps routing to the last known workers.

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use turbine_proto::router::v1 as pb;
use turbine_proto::router::v1::router_client::RouterClient;
use turbine_registry::{Lease, RedisRegistry, Registry, WorkerRecord};
use turbine_testkit::{ChildProcess, RedisServer, STARTUP_TIMEOUT, ServiceProcess, metric, wait_until};

fn record(id: &str) -> WorkerRecord {
    WorkerRecord {
        worker_id: id.into(),
        endpoint: format!("http://127.0.0.1:1/{id}"),
        model: "m".into(),
        load: Default::default(),
        kv_block_size: 16,
        instance: 1,
        role: Default::default(),
        read_costs: Default::default(),
        kv_store: None,
        shared_cache_only: false,
        output_formats: Default::default(),
    }
}

async fn start_router(redis: &RedisServer) -> (ServiceProcess, String) {
    let (process, endpoint, _) = start_router_with_admin(redis).await;
    (process, endpoint)
}

/// Also returns the admin base URL (for /metrics).
async fn start_router_with_admin(redis: &RedisServer) -> (ServiceProcess, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-router"));
    command.args(["--redis", &redis.url(), "--namespace", "t"]);
    let mut process = ServiceProcess::spawn("turbine-router", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::Router, "turbine.router.v1.Router", STARTUP_TIMEOUT).await.unwrap();
    let (endpoint, admin) = (process.grpc_endpoint(), process.admin_url());
    (process, endpoint, admin)
}

/// Routes `n` requests round-robin and returns the chosen worker ids.
async fn chosen(client: &mut RouterClient<tonic::transport::Channel>, n: usize) -> HashSet<String> {
    let mut ids = HashSet::new();
    for i in 0..n {
        let request = pb::RouteRequest { request_id: format!("r{i}"), model: "m".into(), policy: pb::Policy::RoundRobin as i32, ..Default::default() };
        if let Ok(response) = client.route(request).await {
            ids.insert(response.into_inner().worker.unwrap().worker_id);
        }
    }
    ids
}

#[tokio::test]
async fn membership_follows_the_registry() {
    let redis = RedisServer::start();
    let (_router, endpoint) = start_router(&redis).await;
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "t").unwrap());
    let mut client = RouterClient::connect(endpoint.clone()).await.unwrap();

    let channel = tonic::transport::Channel::from_shared(endpoint.clone()).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(channel);
    wait_until("router serving", Duration::from_secs(5), async || {
        health.check(HealthCheckRequest { service: "turbine.router.v1.Router".into() }).await.unwrap().into_inner().status() == ServingStatus::Serving
    })
    .await;

    // No workers yet: UNAVAILABLE, marked as "no workers".
    let status = client.route(pb::RouteRequest { request_id: "x".into(), model: "m".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);

    let ttl = Duration::from_millis(1500);
    let lease_a = Lease::start(registry.clone(), ttl, || record("a"));
    let joined = wait_until("worker a takes traffic", Duration::from_secs(2), async || chosen(&mut client, 1).await.contains("a")).await;
    println!("worker a took traffic {joined:?} after registering");
    let lease_b = Lease::start(registry.clone(), ttl, || record("b"));
    let joined = wait_until("worker b takes traffic", Duration::from_secs(2), async || chosen(&mut client, 4).await.contains("b")).await;
    println!("worker b took traffic {joined:?} after registering");

    let workers = client.list_workers(pb::ListWorkersRequest::default()).await.unwrap().into_inner().workers;
    assert_eq!(workers.iter().map(|w| w.worker_id.as_str()).collect::<Vec<_>>(), ["a", "b"]);

    // b crashes: heartbeats stop (no deregistration). Traffic stops within the TTL.
    drop(lease_b);
    // The router drops it at its lease deadline (at most one TTL after the
    // crash); the slack covers this test's own polling on a loaded machine.
    let vanished = wait_until("worker b loses traffic", ttl + Duration::from_millis(500), async || !chosen(&mut client, 4).await.contains("b")).await;
    println!("crashed worker b lost traffic {vanished:?} after its last heartbeat (ttl {ttl:?})");
    assert_eq!(chosen(&mut client, 8).await, HashSet::from(["a".to_owned()]));

    // Redis goes away: routing continues with the last known workers, health says NOT_SERVING.
    let mut redis = redis;
    redis.kill();
    wait_until("routing outcome", Duration::from_secs(10), async || {
        health.check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner().status() == ServingStatus::NotServing
    })
    .await;
    // Routing goes on for two lease TTLs without the registry: the router
    // extends the leases it knows while it cannot renew them.
    let outage = tokio::time::Instant::now() + ttl * 2;
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    while tokio::time::Instant::now() < outage {
        pace.tick().await;
        assert_eq!(chosen(&mut client, 4).await, HashSet::from(["a".to_owned()]), "routing survives a registry outage");
    }
    drop(lease_a);
}

#[tokio::test]
async fn a_graceful_deregistration_stops_traffic_at_the_next_poll() {
    let redis = RedisServer::start();
    let (_router, endpoint) = start_router(&redis).await;
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "t").unwrap());
    let mut client = RouterClient::connect(endpoint).await.unwrap();
    let _a = Lease::start(registry.clone(), Duration::from_secs(30), || record("a"));
    let b = Lease::start(registry.clone(), Duration::from_secs(30), || record("b"));
    wait_until("both workers take traffic", Duration::from_secs(2), async || chosen(&mut client, 4).await.len() == 2).await;
    b.revoke().await;
    let gone = wait_until("deregistered worker b loses traffic", Duration::from_secs(1), async || !chosen(&mut client, 4).await.contains("b")).await;
    println!("deregistered worker lost traffic after {gone:?}");
}

#[tokio::test]
async fn the_binary_refuses_to_start_without_a_registry() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-router"));
    command.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"]);
    let mut process = ChildProcess::spawn("turbine-router", command);
    let status = process.wait(Duration::from_secs(30)).expect("router should exit");
    assert!(!status.success());
    assert!(process.output().iter().any(|line| line.contains("--redis")), "{:?}", process.output());
}

/// Two router processes follow one KV event log through Redis: a worker's
/// published blocks steer both to it, with the same overlap. With Redis
/// killed, kv routing falls back to load and no request fails.
#[tokio::test]
async fn router_replicas_share_the_kv_index_through_redis() {
    use turbine_kv::{BlockHasher, EventBatch, KvEvent, NumberedEvent, StoredBlock, Tier};
    use turbine_kv_log::EventLog;

    let mut redis = RedisServer::start();
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "t").unwrap());
    let ttl = Duration::from_secs(30);
    let _leases = [Lease::start(registry.clone(), ttl, || record("a")), Lease::start(registry.clone(), ttl, || record("b"))];
    let routers = [start_router_with_admin(&redis).await, start_router_with_admin(&redis).await];

    let prompt: Vec<u32> = (1000..1128).collect();
    let blocks = BlockHasher::default().hash_blocks(&prompt, 16);
    let stored = NumberedEvent {
        event_id: 0,
        event: KvEvent::Stored {
            parent: None,
            blocks: blocks.iter().map(|b| StoredBlock { sequence_hash: b.sequence, local_hash: b.local }).collect(),
            tier: Tier::Device,
        },
    };
    EventLog::new(&redis.url(), "t").unwrap().publish(&EventBatch { worker_id: "a".into(), instance: 1, events: vec![stored] }).await.unwrap();

    let route = |client: &mut RouterClient<tonic::transport::Channel>, id: String| {
        let request = pb::RouteRequest {
            request_id: id,
            model: "m".into(),
            prompt_tokens: prompt.len() as u32,
            policy: pb::Policy::Kv as i32,
            token_ids: prompt.clone(),
            ..Default::default()
        };
        let mut client = client.clone();
        async move {
            let response = client.route(request.clone()).await?.into_inner();
            client.request_finished(pb::RequestFinishedRequest { request_id: request.request_id }).await?;
            Ok::<_, tonic::Status>(response)
        }
    };
    let mut clients = Vec::new();
    for (_, endpoint, _) in &routers {
        clients.push(RouterClient::connect(endpoint.clone()).await.unwrap());
    }
    for (replica, client) in clients.iter_mut().enumerate() {
        let mut turn = 0;
        wait_until("routing outcome", Duration::from_secs(10), async || {
            turn += 1;
            // Errors until the replica has seen the workers register.
            route(client, format!("r{replica}-{turn}"))
                .await
                .is_ok_and(|response| response.worker.unwrap().worker_id == "a" && response.overlap_blocks == blocks.len() as u32)
        })
        .await;
    }

    // Each replica reports the event it applied and the index it holds.
    for (_, _, admin) in &routers {
        let mut applied = 0.0;
        wait_until("replica metrics", Duration::from_secs(3), async || {
            applied = metric(admin, "turbine_kv_events_applied_total").await;
            applied >= 1.0
        })
        .await;
        assert_eq!(applied, 1.0);
        assert_eq!(metric(admin, "turbine_kv_index_blocks").await, blocks.len() as f64);
        assert_eq!(metric(admin, "turbine_kv_event_log_reachable").await, 1.0);
    }

    // Redis down: once a replica notices, it routes by load (no overlap
    // credited) and no request fails before or after.
    redis.kill();
    for (replica, client) in clients.iter_mut().enumerate() {
        let mut turn = 0;
        wait_until("routing outcome", Duration::from_secs(10), async || {
            turn += 1;
            let response = route(client, format!("down{replica}-{turn}")).await;
            let response = response.unwrap_or_else(|error| panic!("replica {replica}: a request failed with Redis down: {error}"));
            response.overlap_blocks == 0
        })
        .await;
        for turn in 0..20 {
            let response = route(client, format!("load{replica}-{turn}")).await;
            assert!(response.is_ok_and(|r| r.overlap_blocks == 0), "replica {replica}: load-only routing with Redis down");
        }
    }
}

/// Router replicas see each other's bookings: requests booked on worker a
/// through one replica steer the other's least-loaded choices to b.
#[tokio::test]
async fn replicas_weigh_each_others_bookings() {
    let redis = RedisServer::start();
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "t").unwrap());
    let ttl = Duration::from_secs(30);
    let _leases = [Lease::start(registry.clone(), ttl, || record("a")), Lease::start(registry.clone(), ttl, || record("b"))];
    let (_first, first_endpoint) = start_router(&redis).await;
    let (_second, second_endpoint) = start_router(&redis).await;
    let mut first = RouterClient::connect(first_endpoint).await.unwrap();
    let mut second = RouterClient::connect(second_endpoint).await.unwrap();
    let least_loaded = |id: String, exclude: Vec<String>| pb::RouteRequest {
        request_id: id,
        model: "m".into(),
        policy: pb::Policy::LeastLoaded as i32,
        exclude_worker_ids: exclude,
        ..Default::default()
    };
    // One least-loaded request through `client`, finished at once: the worker.
    let mut turn = 0;
    let mut probe = async |client: &mut RouterClient<tonic::transport::Channel>| {
        turn += 1;
        let id = format!("probe-{turn}");
        let routed = client.route(least_loaded(id.clone(), vec![])).await.ok()?.into_inner();
        client.request_finished(pb::RequestFinishedRequest { request_id: id }).await.unwrap();
        Some(routed.worker?.worker_id)
    };
    for client in [&mut first, &mut second] {
        let mut seen = HashSet::new();
        wait_until("the replica sees both workers", Duration::from_secs(5), async || {
            seen.extend(probe(client).await);
            seen.len() == 2
        })
        .await;
    }

    // Three long requests on a, booked by the first replica only.
    for i in 0..3 {
        let routed = first.route(least_loaded(format!("long-{i}"), vec!["b".into()])).await.unwrap().into_inner();
        assert_eq!(routed.worker.unwrap().worker_id, "a");
    }
    // Within an exchange or two the second replica counts them.
    let mut streak = 0;
    wait_until("the second replica weighs the first's bookings", Duration::from_secs(3), async || {
        streak = if probe(&mut second).await.as_deref() == Some("b") { streak + 1 } else { 0 };
        streak == 10
    })
    .await;
    for _ in 0..20 {
        assert_eq!(probe(&mut second).await.as_deref(), Some("b"), "a carries the first replica's three requests");
    }
    // Released there, they stop counting here.
    for i in 0..3 {
        first.request_finished(pb::RequestFinishedRequest { request_id: format!("long-{i}") }).await.unwrap();
    }
    wait_until("the release reaches the second replica", Duration::from_secs(3), async || probe(&mut second).await.as_deref() == Some("a")).await;
}
