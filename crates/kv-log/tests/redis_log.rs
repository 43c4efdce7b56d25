//! The event log on a real Redis: two followers (one started late) reach
//! the same index, a gap in a worker's numbering loads its dump, a restarted
//! worker replaces its old view, and a Redis restart is survived; a hung
//! dump holds up only its own worker; snapshots only move forward.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turbine_kv::{EventBatch, KvEvent, KvIndex, LocalBlockHash, NumberedEvent, SequenceHash, StoredBlock, Tier, WorkerDump, WorkerId};
use turbine_kv_log::{DumpFetcher, EventLog, FollowerStatus, LogPosition, follow};
use turbine_testkit::RedisServer;

fn stored(id: u64, hashes: &[u64]) -> NumberedEvent {
    NumberedEvent {
        event_id: id,
        event: KvEvent::Stored {
            parent: None,
            blocks: hashes.iter().map(|&h| StoredBlock { sequence_hash: SequenceHash(h), local_hash: LocalBlockHash(h) }).collect(),
            tier: Tier::Device,
        },
    }
}

fn removed(id: u64, hashes: &[u64]) -> NumberedEvent {
    NumberedEvent { event_id: id, event: KvEvent::Removed { sequence_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(), tier: Tier::Device } }
}

fn batch(worker: &str, instance: u64, events: &[NumberedEvent]) -> EventBatch {
    EventBatch { worker_id: worker.into(), instance, events: events.to_vec() }
}

fn position(text: &str) -> LogPosition {
    text.parse().unwrap()
}

/// The dump of `worker` held by `index`, as a worker would answer it.
fn dump_of(index: &KvIndex, worker: &WorkerId) -> Option<WorkerDump> {
    index.dump(worker).map(|(instance, dump)| WorkerDump { worker_id: worker.clone(), instance, dump })
}

fn seq(hashes: &[u64]) -> Vec<SequenceHash> {
    hashes.iter().map(|&h| SequenceHash(h)).collect()
}

/// What a worker's own cache holds, kept by applying its events: the
/// source of truth that dumps are made from.
struct Truth {
    index: KvIndex,
}

impl Truth {
    fn new() -> Arc<Self> {
        Arc::new(Self { index: KvIndex::new() })
    }

    fn fetcher(self: &Arc<Self>) -> DumpFetcher {
        let truth = self.clone();
        Arc::new(move |worker: WorkerId| {
            let truth = truth.clone();
            Box::pin(async move { dump_of(&truth.index, &worker) })
        })
    }
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    turbine_testkit::wait_until(what, Duration::from_secs(10), async || done()).await;
}

fn depths(index: &KvIndex, query: &[u64]) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = index.find_matches(&seq(query)).iter().map(|m| (m.worker_id.to_string(), m.blocks)).collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_agree_resync_from_dumps_and_survive_a_redis_restart() {
    let mut redis = RedisServer::start();
    let log = EventLog::new(&redis.url(), "t").unwrap();
    let truth = Truth::new();
    let shutdown = CancellationToken::new();
    let publish = |worker: &'static str, instance: u64, events: Vec<NumberedEvent>| {
        for event in &events {
            truth.index.apply(worker, instance, event);
        }
        let log = log.clone();
        async move { log.publish(&batch(worker, instance, &events)).await.unwrap() }
    };

    // The first follower runs from the start; the second joins later and
    // reads the retained history.
    let (early, early_status) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()));
    follow(early.clone(), &log, truth.fetcher(), early_status.clone(), shutdown.clone());
    publish("a", 1, vec![stored(0, &[1, 2, 3]), stored(1, &[4])]).await;
    publish("b", 7, vec![stored(0, &[1, 2])]).await;
    let (late, late_status) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()));
    follow(late.clone(), &log, truth.fetcher(), late_status.clone(), shutdown.clone());
    let expected = vec![("a".to_string(), 4), ("b".to_string(), 2)];
    for (name, index) in [("early", &early), ("late", &late)] {
        wait_until(name, || depths(index, &[1, 2, 3, 4, 5]) == expected).await;
    }
    assert!(early_status.reachable() && late_status.reachable());

    // A gap: event 2 of worker a never reaches the log (a failed publish).
    // The followers load a's dump, which reflects it, and go on.
    truth.index.apply("a", 1, &removed(2, &[4]));
    publish("a", 1, vec![stored(3, &[9])]).await;
    let expected_a = vec![("a".to_string(), 3), ("b".to_string(), 2)];
    for (name, index) in [("early", &early), ("late", &late)] {
        wait_until(name, || depths(index, &[1, 2, 3, 4]) == expected_a && depths(index, &[9]) == vec![("a".to_string(), 1)]).await;
    }
    assert!(early_status.resyncs() >= 1 && late_status.resyncs() >= 1);

    // Worker b restarts (new instance, empty cache, numbering from 0).
    publish("b", 8, vec![stored(0, &[5])]).await;
    for (name, index) in [("early", &early), ("late", &late)] {
        wait_until(name, || depths(index, &[1, 2]) == vec![("a".to_string(), 2)] && depths(index, &[5]) == vec![("b".to_string(), 1)]).await;
    }

    // Redis dies: the followers notice and keep their index; a new Redis on
    // the same port (empty: no persistence) carries the next events.
    let port = redis.port();
    redis.kill();
    wait_until("the followers to notice", || !early_status.reachable() && !late_status.reachable()).await;
    assert_eq!(depths(&early, &[1, 2, 3]), vec![("a".to_string(), 3)]);
    let _redis = RedisServer::start_on(port);
    let event = stored(1, &[6]);
    turbine_testkit::wait_until("a publish to the restarted Redis", Duration::from_secs(10), async || {
        log.publish(&batch("b", 8, std::slice::from_ref(&event))).await.is_ok()
    })
    .await;
    truth.index.apply("b", 8, &event);
    for (name, index) in [("early", &early), ("late", &late)] {
        wait_until(name, || depths(index, &[6]) == vec![("b".to_string(), 1)]).await;
    }
    assert!(early_status.reachable() && late_status.reachable());
    assert_eq!(early.find_matches(&seq(&[1, 2, 3, 4])), late.find_matches(&seq(&[1, 2, 3, 4])));
    shutdown.cancel();
}

#[tokio::test]
async fn malformed_entries_are_skipped() {
    let redis = RedisServer::start();
    let log = EventLog::new(&redis.url(), "m").unwrap();
    let mut connection = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: String = redis::cmd("XADD").arg(log.key()).arg("*").arg("b").arg(&b"\xff\xfe not protobuf"[..]).query_async(&mut connection).await.unwrap();
    log.publish(&batch("w", 1, &[stored(0, &[1])])).await.unwrap();
    let (index, status) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()));
    let shutdown = CancellationToken::new();
    let no_dumps: DumpFetcher = Arc::new(|_| Box::pin(async { None }));
    follow(index.clone(), &log, no_dumps, status.clone(), shutdown.clone());
    wait_until("the valid batch", || depths(&index, &[1]) == vec![("w".to_string(), 1)]).await;
    assert_eq!(status.batches(), 1, "the malformed entry is not a batch");
    shutdown.cancel();
}

/// A worker whose dump hangs does not hold up the others: its events wait
/// for the dump (and are applied after it), everyone else's flow on.
#[tokio::test]
async fn a_hung_dump_holds_up_only_its_own_worker() {
    let redis = RedisServer::start();
    let log = EventLog::new(&redis.url(), "hung").unwrap();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let released = Arc::new(tokio::sync::Mutex::new(Some(released)));
    // "slow"'s cache really holds blocks 1 and 2 (event 0 was lost).
    let truth = KvIndex::new();
    truth.apply("slow", 5, &stored(0, &[1]));
    truth.apply("slow", 5, &stored(1, &[2]));
    let truth = Arc::new(truth);
    let fetch: DumpFetcher = Arc::new(move |worker: WorkerId| {
        let (truth, released) = (truth.clone(), released.clone());
        Box::pin(async move {
            if let Some(released) = released.lock().await.take() {
                let _ = released.await; // hangs until the test lets it go
            }
            dump_of(&truth, &worker)
        })
    });
    let index = Arc::new(KvIndex::new());
    let status = Arc::new(FollowerStatus::default());
    let shutdown = CancellationToken::new();
    let task = follow(index.clone(), &log, fetch, status.clone(), shutdown.clone());

    // slow's event 1 shows a gap; its event 2 arrives while the dump hangs.
    log.publish(&batch("slow", 5, &[stored(1, &[2])])).await.unwrap();
    log.publish(&batch("slow", 5, &[stored(2, &[3])])).await.unwrap();
    log.publish(&batch("fast", 1, &[stored(0, &[10])])).await.unwrap();
    wait_until("fast's event applied while slow's dump hangs", || index.find_matches(&seq(&[10])).deepest() == 1).await;
    assert_eq!(status.stale_workers(), [WorkerId::from("slow")]);
    assert_eq!(index.find_matches(&seq(&[1, 2, 3])).deepest(), 0, "slow's view waits for the dump");

    release.send(()).unwrap();
    wait_until("slow's dump and held event applied", || index.find_matches(&seq(&[1, 2, 3])).deepest() == 3).await;
    assert!(status.stale_workers().is_empty());
    assert_eq!(status.resyncs(), 1);
    shutdown.cancel();
    task.await.unwrap();
}

/// Snapshots: only a later position replaces the stored one, excluded
/// (stale) workers are left out, and loading restores the rest.
#[tokio::test]
async fn snapshots_only_move_forward_and_leave_out_stale_workers() {
    let redis = RedisServer::start();
    let log = EventLog::new(&redis.url(), "snap").unwrap();
    let index = Arc::new(KvIndex::new());
    index.apply("a", 1, &stored(0, &[1, 2]));
    index.apply("b", 2, &stored(0, &[1]));
    assert!(log.save_snapshot(index.clone(), position("100-5"), vec!["b".into()]).await.unwrap().is_some());
    index.apply("a", 1, &stored(1, &[3]));
    assert_eq!(log.save_snapshot(index.clone(), position("100-4"), vec![]).await.unwrap(), None, "an older position is refused");
    assert_eq!(log.save_snapshot(index.clone(), position("99-9"), vec![]).await.unwrap(), None);

    let loaded = KvIndex::new();
    let snapshot = log.load_snapshot(&loaded).await.unwrap().unwrap();
    assert_eq!((snapshot.log_position, snapshot.workers), (position("100-5"), 1));
    assert_eq!(loaded.worker_ids(), [WorkerId::from("a")]);
    assert_eq!(loaded.find_matches(&seq(&[1, 2, 3])).deepest(), 2, "the snapshot of 100-5, not the refused later state");

    assert!(log.save_snapshot(index.clone(), position("101-0"), vec![]).await.unwrap().is_some());
    let reloaded = KvIndex::new();
    assert_eq!(log.load_snapshot(&reloaded).await.unwrap().unwrap().workers, 2);
    assert_eq!(reloaded.find_matches(&seq(&[1, 2, 3])).deepest(), 3);
}

/// How many entries followers in this process skipped for `reason`.
fn refused(reason: &str) -> f64 {
    let page = turbine_runtime::metrics::render();
    let prefix = format!("turbine_kv_log_refused_entries_total{{reason=\"{reason}\"}} ");
    page.lines().find_map(|line| line.strip_prefix(&prefix)?.parse().ok()).unwrap_or(0.0)
}

/// With certificates, each entry is sealed by its writer and a follower
/// applies only what a writer of its CA may write: a worker its own
/// events, a kv-store its store's, a kv-index what it relays. Entries
/// added to the stream by anyone else (unsealed, altered, sealed by
/// another worker or another CA, naming an unknown certificate) are
/// skipped and counted; the genuine ones are applied.
#[tokio::test]
async fn with_certificates_a_follower_applies_only_sealed_entries_of_their_writers() {
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let redis = RedisServer::start();
    let ca = TestCa::new("deployment");
    let log_as = |role: Role, name: &str| EventLog::new(&redis.url(), "sealed").unwrap().with_trust(Some(ca.trust(role, name)));
    let w0 = log_as(Role::Worker, "w0");
    w0.publish(&batch("w0", 1, &[stored(0, &[1, 2])])).await.unwrap();
    let store = WorkerId::of_store("kv-store", 7);
    log_as(Role::KvStore, "kv-store").publish(&batch(store.as_str(), 1, &[stored(0, &[3])])).await.unwrap();
    log_as(Role::Index, "kv-index").publish(&batch("w9", 1, &[stored(0, &[4])])).await.unwrap();

    // The attacks, each claiming w0's next event (id 1).
    let forged = batch("w0", 1, &[stored(1, &[666])]);
    let payload = prost::Message::encode_to_vec(&turbine_proto::kvindex::v1::EventBatch::from(&forged));
    let mut redis_cli = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let mut add = async |fields: &[(&str, &[u8])]| {
        let mut command = redis::cmd("XADD");
        command.arg(w0.key()).arg("*");
        for (name, value) in fields {
            command.arg(*name).arg(*value);
        }
        let _: String = command.query_async(&mut redis_cli).await.unwrap();
    };
    add(&[("b", &payload)]).await;
    log_as(Role::Worker, "w1").publish(&forged).await.unwrap();
    log_as(Role::KvStore, "w0").publish(&forged).await.unwrap();
    EventLog::new(&redis.url(), "sealed").unwrap().with_trust(Some(TestCa::new("attacker").trust(Role::Worker, "w0"))).publish(&forged).await.unwrap();
    // w0's genuine seal over its first batch, on the forged batch.
    let genuine = w0.reader().read(LogPosition::START, Duration::from_millis(10), 1).await.unwrap().remove(0);
    add(&[("b", &payload), ("w", &genuine.writer), ("s", &genuine.signature)]).await;
    add(&[("b", &payload), ("w", &[7; 32]), ("s", &genuine.signature)]).await;
    add(&[("b", b"\xff not protobuf"), ("w", &genuine.writer), ("s", &genuine.signature)]).await;
    // w0's genuine next event, after all of them.
    w0.publish(&batch("w0", 1, &[stored(1, &[5])])).await.unwrap();

    let reasons = ["unsigned", "wrong_writer", "untrusted", "bad_signature", "unknown_writer", "malformed"];
    let before: Vec<f64> = reasons.iter().map(|reason| refused(reason)).collect();
    let follow_as = |trust| {
        let (index, status) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()));
        let shutdown = CancellationToken::new();
        let no_dumps: DumpFetcher = Arc::new(|_| Box::pin(async { None }));
        let log = EventLog::new(&redis.url(), "sealed").unwrap().with_trust(trust);
        follow(index.clone(), &log, no_dumps, status, shutdown.clone());
        (index, shutdown)
    };
    let (index, shutdown) = follow_as(Some(ca.trust(Role::Router, "router-0")));
    wait_until("w0's genuine second batch", || depths(&index, &[5]) == vec![("w0".to_string(), 1)]).await;
    assert_eq!(depths(&index, &[666]), [], "no forged event was applied");
    assert_eq!(depths(&index, &[1, 2]), [("w0".to_string(), 2)]);
    assert_eq!(depths(&index, &[3]), [(store.to_string(), 1)], "a kv-store's own");
    assert_eq!(depths(&index, &[4]), [("w9".to_string(), 1)], "relayed by a kv-index");
    let counted: Vec<f64> = reasons.iter().zip(&before).map(|(reason, before)| refused(reason) - before).collect();
    assert_eq!(counted, [1.0, 2.0, 1.0, 1.0, 1.0, 1.0], "{reasons:?}");
    shutdown.cancel();

    // A plaintext follower (development) applies what decodes: the first
    // forged batch takes w0's event 1.
    let (index, shutdown) = follow_as(None);
    wait_until("the whole log", || depths(&index, &[4]) == vec![("w9".to_string(), 1)]).await;
    wait_until("w0's event 1", || !depths(&index, &[666]).is_empty()).await;
    shutdown.cancel();
}

/// With certificates a replica loads only a snapshot a router or kv-index
/// of its CA sealed: a snapshot written into Redis by anyone else (bare,
/// altered, sealed by a worker) is ignored and counted, and the replica
/// replays the log instead.
#[tokio::test]
async fn with_certificates_only_a_replicas_sealed_snapshot_is_loaded() {
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let redis = RedisServer::start();
    let ca = TestCa::new("deployment");
    let log_as = |role: Role, name: &str| EventLog::new(&redis.url(), "snap").unwrap().with_trust(Some(ca.trust(role, name)));
    let snapshot_refused = |reason: &str| {
        let page = turbine_runtime::metrics::render();
        let prefix = format!("turbine_kv_log_refused_snapshots_total{{reason=\"{reason}\"}} ");
        page.lines().find_map(|line| line.strip_prefix(&prefix)?.parse::<f64>().ok()).unwrap_or(0.0)
    };
    let index = Arc::new(KvIndex::new());
    index.apply("a", 1, &stored(0, &[1, 2]));
    let reader = log_as(Role::Index, "kv-index-1");
    assert!(log_as(Role::Router, "router-0").save_snapshot(index.clone(), position("100-5"), vec![]).await.unwrap().is_some());
    let loaded = KvIndex::new();
    assert_eq!(reader.load_snapshot(&loaded).await.unwrap().unwrap().workers, 1, "a router's sealed snapshot loads");

    let mut redis_cli = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let stored_data: Vec<u8> = redis::cmd("HGET").arg(reader.snapshot_key()).arg("data").query_async(&mut redis_cli).await.unwrap();
    let poisoned = Arc::new(KvIndex::new());
    poisoned.apply("rogue", 1, &stored(0, &[1, 2, 3]));
    let poisoned_data = {
        let other = EventLog::new(&redis.url(), "scratch").unwrap();
        other.save_snapshot(poisoned.clone(), position("200-0"), vec![]).await.unwrap();
        let data: Vec<u8> = redis::cmd("HGET").arg(other.snapshot_key()).arg("data").query_async(&mut redis_cli).await.unwrap();
        data
    };
    assert_ne!(stored_data, poisoned_data);
    let genuine_seal: String = redis::cmd("HGET").arg(reader.snapshot_key()).arg("seal").query_async(&mut redis_cli).await.unwrap();
    for (seal, reason) in [(String::new(), "unsigned"), (genuine_seal, "bad_signature")] {
        let _: () =
            redis::cmd("HSET").arg(reader.snapshot_key()).arg("data").arg(&poisoned_data).arg("seal").arg(seal).query_async(&mut redis_cli).await.unwrap();
        let before = snapshot_refused(reason);
        let loaded = KvIndex::new();
        assert_eq!(reader.load_snapshot(&loaded).await.unwrap(), None, "{reason}");
        assert!(loaded.worker_ids().is_empty());
        assert_eq!(snapshot_refused(reason) - before, 1.0);
    }
    // A worker's certificate does not write snapshots.
    let _: () = redis::cmd("DEL").arg(reader.snapshot_key()).query_async(&mut redis_cli).await.unwrap();
    log_as(Role::Worker, "a").save_snapshot(poisoned, position("300-0"), vec![]).await.unwrap();
    let before = snapshot_refused("wrong_writer");
    assert_eq!(reader.load_snapshot(&KvIndex::new()).await.unwrap(), None);
    assert_eq!(snapshot_refused("wrong_writer") - before, 1.0);
}
