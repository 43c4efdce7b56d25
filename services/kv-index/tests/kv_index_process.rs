//! The `turbine-kv-index` binary against a real Redis: events published
//! through it are answered by FindMatches, Dump and Stats; a second replica
//! started later, and a replica killed with SIGKILL and restarted, start
//! from the snapshot and reach the same answers; a worker whose registry
//! lease expires loses its blocks; bad requests get INVALID_ARGUMENT and
//! the service keeps serving.

use std::process::Command;
use std::time::Duration;

use tonic::transport::Channel;
use turbine_kv::{BlockHasher, EventBatch, KvEvent, NumberedEvent, SequenceHash, StoredBlock, Tier};
use turbine_proto::kvindex::v1 as pb;
use turbine_proto::kvindex::v1::kv_index_client::KvIndexClient;
use turbine_registry::{Lease, RedisRegistry, Registry, WorkerRecord};
use turbine_testkit::{RedisServer, STARTUP_TIMEOUT, ServiceProcess, wait_until};

const BLOCK: usize = 16;

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

struct Replica {
    process: ServiceProcess,
    client: KvIndexClient<Channel>,
}

/// A replica listening at `grpc` (`127.0.0.1:0`: a free port).
async fn start_replica(redis: &RedisServer, grpc: &str, extra: &[&str]) -> Replica {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-kv-index"));
    command.args(["--grpc-addr", grpc, "--redis", &redis.url(), "--namespace", "t"]);
    command.args(["--registry-poll-ms", "100"]).args(extra);
    let mut process = ServiceProcess::spawn("turbine-kv-index", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::Index, "turbine.kvindex.v1.KvIndex", STARTUP_TIMEOUT).await.unwrap();
    let client = KvIndexClient::connect(process.grpc_endpoint()).await.unwrap();
    Replica { process, client }
}

/// One worker's events as published.
fn batch(worker: &str, instance: u64, events: Vec<NumberedEvent>) -> pb::EventBatch {
    pb::EventBatch::from(&EventBatch { worker_id: worker.into(), instance, events })
}

/// The prompt of conversation `n`: `blocks` blocks of its own tokens.
fn prompt(n: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32).map(|i| 1000 + n * 100_000 + i).collect()
}

fn stored(event_id: u64, tokens: &[u32]) -> NumberedEvent {
    let blocks =
        BlockHasher::default().hash_blocks(tokens, BLOCK).into_iter().map(|b| StoredBlock { sequence_hash: b.sequence, local_hash: b.local }).collect();
    NumberedEvent { event_id, event: KvEvent::Stored { parent: None, blocks, tier: Tier::Device } }
}

fn query(tokens: &[u32]) -> pb::FindMatchesRequest {
    pb::FindMatchesRequest { token_ids: tokens.to_vec(), block_size: BLOCK as u32, ..Default::default() }
}

/// (worker, matched blocks) pairs.
async fn matches(client: &mut KvIndexClient<Channel>, tokens: &[u32]) -> Vec<(String, u32)> {
    let response = client.find_matches(query(tokens)).await.unwrap().into_inner();
    response.matches.into_iter().map(|m| (m.worker_id, m.matched_blocks)).collect()
}

async fn stats(client: &mut KvIndexClient<Channel>) -> pb::StatsResponse {
    client.stats(pb::StatsRequest {}).await.unwrap().into_inner()
}

#[tokio::test]
async fn replicas_agree_survive_sigkill_and_forget_expired_workers() {
    let redis = RedisServer::start();
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "t").unwrap());
    let ttl = Duration::from_millis(1500);
    let _lease_a = Lease::start(registry.clone(), ttl, || record("a"));
    let lease_b = Lease::start(registry.clone(), ttl, || record("b"));

    let mut first = start_replica(&redis, "127.0.0.1:0", &["--snapshot-interval-secs", "0.2", "--lease-grace-secs", "1"]).await;
    let first_addr = first.process.addresses().grpc.to_string();

    // Worker a caches conversation 1 (6 blocks); b caches conversation 2 (4
    // blocks) and, later, a longer conversation 1 prefix in host memory.
    let (one, two) = (prompt(1, 6), prompt(2, 4));
    let mut b_host = stored(1, &one[..3 * BLOCK]);
    if let KvEvent::Stored { tier, .. } = &mut b_host.event {
        *tier = Tier::Host;
    }
    let batches = vec![batch("a", 7, vec![stored(0, &one)]), batch("b", 9, vec![stored(0, &two), b_host])];
    let published = first.client.publish_events(pb::PublishEventsRequest { batches }).await.unwrap().into_inner();
    assert_eq!(published.entry_ids.len(), 2);

    let expected = vec![("a".to_owned(), 6), ("b".to_owned(), 3)];
    let client = &mut first.client;
    wait_until("events applied", Duration::from_secs(5), async || matches(client, &one).await == expected).await;
    let full = first.client.find_matches(query(&one)).await.unwrap().into_inner();
    assert_eq!(full.query_blocks, 6);
    assert_eq!((full.matches[1].device_blocks, full.matches[1].host_blocks), (0, 3), "b holds its match in host memory");
    // Sequence hashes give the same answer as tokens.
    let hashes: Vec<u64> = BlockHasher::default().sequence_hashes(&one, BLOCK).into_iter().map(|SequenceHash(h)| h).collect();
    let by_hash = first.client.find_matches(pb::FindMatchesRequest { sequence_hashes: hashes, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(by_hash, full);
    assert_eq!(matches(&mut first.client, &two).await, vec![("b".to_owned(), 4)]);

    // Dump: all workers, one worker, an unknown one.
    let mut all = first.client.dump(pb::DumpRequest::default()).await.unwrap().into_inner();
    let mut dumped = Vec::new();
    while let Some(dump) = all.message().await.unwrap() {
        dumped.push((dump.worker_id, dump.instance, dump.next_event_id, dump.blocks.len()));
    }
    assert_eq!(dumped, vec![("a".to_owned(), 7, 1, 6), ("b".to_owned(), 9, 2, 7)]);
    let missing = first.client.dump(pb::DumpRequest { worker_id: "nobody".into() }).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);

    // Bad input: INVALID_ARGUMENT, nothing appended, still serving.
    let bad = first.client.find_matches(pb::FindMatchesRequest { token_ids: vec![1, 2, 3], ..Default::default() }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    let mut malformed = batch("a", 7, vec![stored(1, &two)]);
    malformed.events[0].kind = None;
    let refused = first.client.publish_events(pb::PublishEventsRequest { batches: vec![batch("a", 7, vec![stored(1, &two)]), malformed] }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("batch 1"), "{}", refused.message());
    // Had the refused call's valid batch (a caching conversation 2) been
    // appended, it would be applied before this one, which is awaited.
    let four = prompt(4, 2);
    first.client.publish_events(pb::PublishEventsRequest { batches: vec![batch("b", 9, vec![stored(2, &four)])] }).await.unwrap();
    let client = &mut first.client;
    wait_until("a later batch applied", Duration::from_secs(5), async || matches(client, &four).await == [("b".to_owned(), 2)]).await;
    assert_eq!(matches(&mut first.client, &two).await, vec![("b".to_owned(), 4)], "the valid batch of a refused call was not appended either");

    // A snapshot is written; a replica started later begins from it.
    let client = &mut first.client;
    wait_until("a snapshot", Duration::from_secs(5), async || stats(client).await.snapshots_written > 0).await;
    let mut second = start_replica(&redis, "127.0.0.1:0", &["--snapshot-interval-secs", "0"]).await;
    let second_stats = stats(&mut second.client).await;
    assert!(!second_stats.started_from_snapshot.is_empty(), "the late replica loaded the snapshot");
    for tokens in [&one, &two] {
        assert_eq!(matches(&mut second.client, tokens).await, matches(&mut first.client, tokens).await);
    }

    // SIGKILL the first replica; more events arrive while it is down
    // (through the second); restarted on its port, it catches up.
    first.process.kill();
    let three = prompt(3, 5);
    second.client.publish_events(pb::PublishEventsRequest { batches: vec![batch("a", 7, vec![stored(1, &three)])] }).await.unwrap();
    let mut restarted = start_replica(&redis, &first_addr, &["--snapshot-interval-secs", "0.2", "--lease-grace-secs", "1"]).await;
    assert!(!stats(&mut restarted.client).await.started_from_snapshot.is_empty());
    let client = &mut restarted.client;
    let caught_up =
        wait_until("the restarted replica catches up", Duration::from_secs(10), async || matches(client, &three).await == [("a".to_owned(), 5)]).await;
    println!("restarted replica answered like the live one {caught_up:?} after starting");
    for tokens in [&one, &two, &three] {
        assert_eq!(matches(&mut restarted.client, tokens).await, matches(&mut second.client, tokens).await);
    }

    // b's lease expires: its blocks leave the restarted replica's index.
    lease_b.revoke().await;
    let client = &mut restarted.client;
    let gone = wait_until("b's blocks dropped", Duration::from_secs(10), async || matches(client, &two).await.is_empty()).await;
    println!("b dropped {gone:?} after its lease was revoked");
    assert_eq!(matches(&mut restarted.client, &one).await, vec![("a".to_owned(), 6)]);
    assert_eq!(stats(&mut restarted.client).await.workers_expired, 1);

    // RemoveWorker drops a worker from one replica on request.
    let removed = second.client.remove_worker(pb::RemoveWorkerRequest { worker_id: "a".into() }).await.unwrap().into_inner();
    assert_eq!((removed.removed, removed.blocks), (true, 11));
    let again = second.client.remove_worker(pb::RemoveWorkerRequest { worker_id: "a".into() }).await.unwrap().into_inner();
    assert!(!again.removed);
    let empty = second.client.remove_worker(pb::RemoveWorkerRequest::default()).await.unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument);
}

/// With certificates, a worker publishes only its own KV events and a
/// kv-store only its store's: a batch in another's name is refused with
/// PERMISSION_DENIED naming the worker, counted, and never indexed (and
/// forging call after call on one connection loses it); a router may not
/// publish at all.
#[tokio::test]
async fn with_certificates_each_publishes_only_its_own_events() {
    use turbine_runtime::grpc::tls_channel;
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("deployment");
    ca.issue(Role::Operator, "operator").write(dir.path(), "operator").establish().unwrap();
    let index_tls = ca.issue(Role::Index, "kv-index").write(dir.path(), "kv-index");
    let path = |path: &Option<std::path::PathBuf>| path.as_deref().unwrap().display().to_string();
    let tls_flags =
        ["--tls-cert".to_owned(), path(&index_tls.tls_cert), "--tls-key".into(), path(&index_tls.tls_key), "--tls-ca".into(), path(&index_tls.tls_ca)];
    let w0 = ca.trust(Role::Worker, "w0");
    // w0's sealed registry record keeps its blocks indexed.
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "t").unwrap().with_trust(Some(w0.clone())));
    let _lease = Lease::start(registry, Duration::from_secs(30), || record("w0"));
    let replica = start_replica(&redis, "127.0.0.1:0", &tls_flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let endpoint = replica.process.grpc_endpoint();
    let as_peer = |trust: &turbine_runtime::trust::Trust| KvIndexClient::new(tls_channel(&endpoint, trust, Role::Index).unwrap());

    let (own, forged, stores) = (prompt(1, 4), prompt(2, 4), prompt(3, 4));
    let mut worker = as_peer(&w0);
    worker.publish_events(pb::PublishEventsRequest { batches: vec![batch("w0", 1, vec![stored(0, &own)])] }).await.expect("w0 publishes its own events");
    let refused = worker.publish_events(pb::PublishEventsRequest { batches: vec![batch("w1", 1, vec![stored(0, &forged)])] }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("\"w1\""), "{}", refused.message());
    // One forged batch among genuine ones: none is appended.
    let mixed = vec![batch("w0", 1, vec![stored(1, &forged)]), batch("w1", 1, vec![stored(0, &forged)])];
    assert_eq!(worker.publish_events(pb::PublishEventsRequest { batches: mixed }).await.unwrap_err().code(), tonic::Code::PermissionDenied);

    let mut store = as_peer(&ca.trust(Role::KvStore, "kv-store"));
    let store_name = turbine_kv::WorkerId::of_store("kv-store", 7);
    store
        .publish_events(pb::PublishEventsRequest { batches: vec![batch(store_name.as_str(), 1, vec![stored(0, &stores)])] })
        .await
        .expect("a kv-store publishes its own");
    let refused = store.publish_events(pb::PublishEventsRequest { batches: vec![batch("w0", 1, vec![stored(2, &forged)])] }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "a store is no worker");
    let router = as_peer(&ca.trust(Role::Router, "router-0"));
    let refused = router.clone().publish_events(pb::PublishEventsRequest { batches: vec![batch("w0", 1, vec![stored(2, &forged)])] }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");

    let admin = replica.process.admin_url();
    let refusals = async |reason: &str| turbine_testkit::metric_where(&admin, "turbine_rpc_refused_total", &[("reason", reason)]).await;
    assert_eq!(refusals("wrong_writer").await, 3.0);
    assert_eq!(refusals("wrong_role").await, 1.0);
    // The genuine events are indexed; the forged prompt matches nobody.
    let router = &router;
    let matched = async |tokens: &[u32]| -> Vec<(String, u32)> {
        let response = router.clone().find_matches(query(tokens)).await.unwrap().into_inner();
        response.matches.into_iter().map(|m| (m.worker_id, m.matched_blocks)).collect()
    };
    wait_until("w0's events are indexed", STARTUP_TIMEOUT, async || matched(&own).await == [("w0".to_owned(), 4)]).await;
    assert_eq!(matched(&forged).await, [], "nothing forged was indexed");

    // Forging call after call on one connection loses it (the handler's
    // refusals strike it, as the role check's do): a call fails in
    // transport, not with an answer; connecting again, w0 is answered.
    let forge = || pb::PublishEventsRequest { batches: vec![batch("w1", 1, vec![stored(0, &forged)])] };
    let mut cut = None;
    for call in 0..4 * turbine_runtime::strikes::STRIKES_BURST as usize {
        let refused = worker.publish_events(forge()).await.unwrap_err();
        if refused.code() != tonic::Code::PermissionDenied {
            cut = Some(call);
            break;
        }
    }
    assert!(cut.is_some(), "a connection forging call after call is closed");
    assert!(turbine_testkit::metric_where(&admin, "turbine_grpc_connections_struck_off_total", &[]).await >= 1.0);
    let refused = as_peer(&w0).publish_events(forge()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "a new connection is answered: {refused:?}");
}
