//! The Redis registry against a real redis-server on a free port.

use std::time::{Duration, Instant};

use turbine_registry::{Lease, RedisRegistry, Registry, WorkerLoad, WorkerRecord};
use turbine_testkit::{RedisServer, wait_until};

fn record(id: &str) -> WorkerRecord {
    WorkerRecord {
        worker_id: id.into(),
        endpoint: format!("http://127.0.0.1:1/{id}"),
        model: "m".into(),
        load: WorkerLoad::default(),
        kv_block_size: 16,
        instance: 1,
        role: Default::default(),
        read_costs: Default::default(),
        kv_store: None,
    }
}

#[tokio::test]
async fn put_list_remove_and_expiry() {
    let redis = RedisServer::start();
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "test").unwrap());
    registry.ping().await.unwrap();
    registry.put(&record("b"), Duration::from_secs(30)).await.unwrap();
    registry.put(&record("a"), Duration::from_millis(300)).await.unwrap();
    let live = registry.list().await.unwrap();
    let ids: Vec<_> = live.iter().map(|w| w.record.worker_id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    let a = &live[0];
    assert!(a.expires_at <= Instant::now() + Duration::from_millis(300), "the lease deadline is reported");

    // a's lease runs out: Redis expires the key on its own clock.
    let ids = async || registry.list().await.unwrap().into_iter().map(|w| w.record.worker_id.to_string()).collect::<Vec<_>>();
    wait_until("a's lease expires", Duration::from_secs(5), async || ids().await == ["b"]).await;

    registry.remove("b").await.unwrap();
    assert!(registry.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn namespaces_do_not_see_each_other() {
    let redis = RedisServer::start();
    let one = Registry::Redis(RedisRegistry::new(&redis.url(), "one").unwrap());
    let two = Registry::Redis(RedisRegistry::new(&redis.url(), "two").unwrap());
    one.put(&record("w"), Duration::from_secs(30)).await.unwrap();
    assert_eq!(one.list().await.unwrap().len(), 1);
    assert!(two.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_lease_renews_carries_load_and_revokes() {
    let redis = RedisServer::start();
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "lease").unwrap());
    let ttl = Duration::from_millis(300);
    let lease = Lease::start(registry.clone(), ttl, || WorkerRecord { load: WorkerLoad { running: 3, ..Default::default() }, ..record("w") });
    wait_until("the lease registers", Duration::from_secs(5), async || registry.list().await.unwrap().len() == 1).await;
    // Through several TTLs the record stays: heartbeats renew it.
    let window = tokio::time::Instant::now() + ttl * 4;
    let mut pace = tokio::time::interval(ttl / 2);
    while tokio::time::Instant::now() < window {
        pace.tick().await;
        let live = registry.list().await.unwrap();
        assert_eq!(live.len(), 1, "lease lapsed despite heartbeats");
        assert_eq!(live[0].record.load.running, 3);
    }
    lease.revoke().await;
    assert!(registry.list().await.unwrap().is_empty(), "revoke removes at once");
}

#[tokio::test]
async fn an_unreachable_redis_is_an_error_not_a_hang() {
    let mut redis = RedisServer::start();
    let registry = Registry::Redis(RedisRegistry::new(&redis.url(), "down").unwrap());
    registry.ping().await.unwrap();
    redis.kill();
    // Errors, within a bound: no call hangs on a dead server.
    let bound = Duration::from_secs(10);
    assert!(tokio::time::timeout(bound, registry.ping()).await.expect("ping returns").is_err());
    assert!(tokio::time::timeout(bound, registry.list()).await.expect("list returns").is_err());
}
