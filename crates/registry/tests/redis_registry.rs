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
        shared_cache_only: false,
        output_formats: Default::default(),
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

/// How many records readers in this process skipped for `reason`.
fn refused(reason: &str) -> f64 {
    let page = turbine_runtime::metrics::render();
    let prefix = format!("turbine_registry_refused_records_total{{reason=\"{reason}\"}} ");
    page.lines().find_map(|line| line.strip_prefix(&prefix)?.parse().ok()).unwrap_or(0.0)
}

/// With certificates, a worker's record is sealed by its key, and readers
/// list only records sealed by a worker certificate of their CA naming the
/// record's worker, before their expiry. A client that can write to Redis
/// adds no worker, moves none, and replays none; what it writes is
/// skipped and counted, and the genuine records stay listed.
#[tokio::test]
async fn with_certificates_only_a_workers_own_sealed_record_is_listed() {
    use turbine_registry::{SignedRecord, signed_bytes};
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let redis = RedisServer::start();
    let url = redis.url();
    let ca = TestCa::new("deployment");
    let as_worker = |name: &str| Registry::Redis(RedisRegistry::new(&url, "sealed").unwrap().with_trust(Some(ca.trust(Role::Worker, name))));
    let reader = Registry::Redis(RedisRegistry::new(&url, "sealed").unwrap().with_trust(Some(ca.trust(Role::Router, "router-0"))));
    let listed = async || reader.list().await.unwrap().into_iter().map(|w| (w.record.worker_id.to_string(), w.record.endpoint)).collect::<Vec<_>>();
    as_worker("w0").put(&record("w0"), Duration::from_secs(30)).await.unwrap();
    assert_eq!(listed().await, [("w0".to_owned(), record("w0").endpoint)]);

    let client = redis::Client::open(url.as_str()).unwrap();
    let mut redis_cli = client.get_multiplexed_async_connection().await.unwrap();
    let mut write = async |id: &str, value: String| {
        redis::pipe()
            .cmd("SET")
            .arg(format!("turbine:sealed:workers:{id}"))
            .arg(value)
            .arg("EX")
            .arg(60)
            .ignore()
            .sadd("turbine:sealed:workers", id)
            .ignore()
            .query_async::<()>(&mut redis_cli)
            .await
            .unwrap();
    };
    let genuine: String =
        redis::cmd("GET").arg("turbine:sealed:workers:w0").query_async(&mut client.get_multiplexed_async_connection().await.unwrap()).await.unwrap();
    let genuine: SignedRecord = serde_json::from_str(&genuine).unwrap();

    // A bare record, as every reader took before.
    let rogue = WorkerRecord { endpoint: "http://10.6.6.6:50052".into(), ..record("rogue") };
    write("rogue", serde_json::to_string(&rogue).unwrap()).await;
    // w0's record moved to another endpoint, its seal kept.
    let moved = WorkerRecord { endpoint: "http://10.6.6.6:50052".into(), ..record("w1") };
    let mut altered = genuine.clone();
    altered.record = altered.record.replace(&record("w0").endpoint, "http://10.6.6.6:50052").replace("\"w0\"", "\"w1\"");
    write("w1", serde_json::to_string(&altered).unwrap()).await;
    // w3's certificate seals a record naming w2.
    as_worker("w3").put(&record("w2"), Duration::from_secs(30)).await.unwrap();
    // Another CA's worker.
    let theirs = TestCa::new("attacker");
    Registry::Redis(RedisRegistry::new(&url, "sealed").unwrap().with_trust(Some(theirs.trust(Role::Worker, "w4"))))
        .put(&record("w4"), Duration::from_secs(30))
        .await
        .unwrap();
    // w5's genuine seal over a lease that ended a minute ago, replayed.
    let w5 = ca.trust(Role::Worker, "w5");
    let json = serde_json::to_string(&record("w5")).unwrap();
    let expires_unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 - 60_000;
    let seal = w5.signer().seal(&signed_bytes(&json, expires_unix_ms)).unwrap();
    write("w5", serde_json::to_string(&SignedRecord { record: json, expires_unix_ms, seal }).unwrap()).await;
    // Garbage, and w0's genuine record copied under another key.
    write("w6", "{not json".into()).await;
    write("w7", serde_json::to_string(&genuine).unwrap()).await;

    let before: Vec<f64> = ["unsigned", "bad_signature", "wrong_writer", "untrusted", "expired", "corrupt"].iter().map(|reason| refused(reason)).collect();
    assert_eq!(listed().await, [("w0".to_owned(), record("w0").endpoint)], "only w0's own record; {moved:?} is not among them");
    let after: Vec<f64> = ["unsigned", "bad_signature", "wrong_writer", "untrusted", "expired", "corrupt"].iter().map(|reason| refused(reason)).collect();
    let counted: Vec<f64> = after.iter().zip(&before).map(|(after, before)| after - before).collect();
    assert_eq!(counted, [1.0, 1.0, 1.0, 1.0, 1.0, 2.0], "one of each, two corrupt (garbage, a record under another's key)");

    // A plaintext reader (development) lists every record that parses,
    // sealed or not.
    let plaintext = Registry::Redis(RedisRegistry::new(&url, "sealed").unwrap().with_trust(None));
    let mut ids: Vec<String> = plaintext.list().await.unwrap().into_iter().map(|w| w.record.worker_id.to_string()).collect();
    ids.sort();
    assert_eq!(ids, ["rogue", "w0", "w1", "w2", "w4", "w5"]);

    // w0's record, already read and taken once, overwritten in place with
    // another endpoint: read again, and refused.
    let mut moved_in_place = genuine.clone();
    moved_in_place.record = moved_in_place.record.replace(&record("w0").endpoint, "http://10.6.6.6:50052");
    write("w0", serde_json::to_string(&moved_in_place).unwrap()).await;
    let before = refused("bad_signature");
    assert_eq!(listed().await, [], "w0 moved is no longer w0's record");
    assert_eq!(refused("bad_signature") - before, 2.0, "w0 now, and w1 as before");
}

/// A worker pool's certificate (`turbine certs --worker-pool NAME`: the
/// pods of one Deployment share it) seals the records of its own members
/// only: `NAME-<pod>` is listed, another pool's id is refused as another
/// worker's would be.
#[tokio::test]
async fn a_pool_certificate_seals_only_its_members_records() {
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let redis = RedisServer::start();
    let url = redis.url();
    let ca = TestCa::new("deployment");
    let pool = Registry::Redis(RedisRegistry::new(&url, "pool").unwrap().with_trust(Some(ca.trust(Role::Worker, "turbine-worker-prefill-*"))));
    let reader = Registry::Redis(RedisRegistry::new(&url, "pool").unwrap().with_trust(Some(ca.trust(Role::Router, "router-0"))));
    pool.put(&record("turbine-worker-prefill-7c9d-x2k4"), Duration::from_secs(30)).await.unwrap();
    pool.put(&record("turbine-worker-decode-7c9d-x2k4"), Duration::from_secs(30)).await.unwrap();
    let before = refused("wrong_writer");
    let listed: Vec<String> = reader.list().await.unwrap().into_iter().map(|w| w.record.worker_id.to_string()).collect();
    assert_eq!(listed, ["turbine-worker-prefill-7c9d-x2k4"]);
    assert_eq!(refused("wrong_writer") - before, 1.0, "the other pool's id is refused");
}

/// `rediss://` with an ACL user: the registry connects over TLS with the
/// process's certificate and the user's password, and its records are
/// sealed as over plaintext. Without the password, without TLS, or with
/// another CA's certificate, Redis answers nothing useful.
#[tokio::test]
async fn over_tls_with_an_acl_user() {
    use turbine_runtime::host::Role;
    use turbine_testkit::tls::TestCa;

    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("deployment");
    ca.issue(Role::Worker, "w0").write(dir.path(), "w0").establish().unwrap().expect("an identity");
    let acl = ["--user", "default", "off", "--user", "turbine", "on", ">s3cret", "~turbine:*", "+@all"];
    let redis = RedisServer::start_tls(&ca.redis_tls(dir.path()), &acl);
    let port = redis.port();
    assert_eq!(redis.url(), format!("rediss://localhost:{port}/"));

    let registry = Registry::Redis(RedisRegistry::new(&format!("rediss://turbine:s3cret@localhost:{port}/"), "acl").unwrap());
    registry.put(&record("w0"), Duration::from_secs(30)).await.unwrap();
    let listed: Vec<String> = registry.list().await.unwrap().into_iter().map(|w| w.record.worker_id.to_string()).collect();
    assert_eq!(listed, ["w0"], "sealed by w0's certificate, read back over TLS");

    let no_password = Registry::Redis(RedisRegistry::new(&format!("rediss://localhost:{port}/"), "acl").unwrap());
    let refused = no_password.list().await.unwrap_err().to_string();
    assert!(refused.contains("NOAUTH") || refused.contains("uthentication"), "{refused}");
    let plaintext = Registry::Redis(RedisRegistry::new(&format!("redis://turbine:s3cret@localhost:{port}/"), "acl").unwrap());
    assert!(plaintext.list().await.is_err(), "a plaintext client gets nothing from a TLS port");
    let stranger = TestCa::new("attacker").issue(Role::Worker, "w0");
    let client = redis::Client::build_with_tls(
        format!("rediss://turbine:s3cret@localhost:{port}/"),
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig { client_cert: stranger.cert.into_bytes(), client_key: stranger.key.into_bytes() }),
            root_cert: Some(std::fs::read(dir.path().join("redis-ca.crt")).unwrap()),
        },
    )
    .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        let mut connection = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut connection).await
    })
    .await
    .expect("bounded");
    assert!(answer.is_err(), "another CA's certificate is refused: {answer:?}");
}

/// A worker's KV tenants come from the certificate that sealed its record
/// (`turbine certs --worker-tenant`), read on every listing: a limited
/// worker is listed limited, an unlimited one for any tenant, and a reader
/// without an identity takes no tenants from anywhere.
#[tokio::test]
async fn a_records_kv_tenants_are_those_of_the_certificate_that_sealed_it() {
    use turbine_kv::KvTenant;
    use turbine_runtime::host::Role;
    use turbine_runtime::trust::kv_tenant_uri;
    use turbine_testkit::tls::TestCa;

    let redis = RedisServer::start();
    let url = redis.url();
    let ca = TestCa::new("deployment");
    let (acme, system) = (KvTenant::of_tenant("acme"), KvTenant::of_shared("system"));
    let uris = [kv_tenant_uri(acme.get()), kv_tenant_uri(system.get())];
    let limited = ca.issue_with_uris(Role::Worker, "acme-0", &uris.iter().map(String::as_str).collect::<Vec<_>>()).trust();
    let as_writer = |trust| Registry::Redis(RedisRegistry::new(&url, "tenants").unwrap().with_trust(Some(trust)));
    as_writer(limited).put(&record("acme-0"), Duration::from_secs(30)).await.unwrap();
    as_writer(ca.trust(Role::Worker, "any-0")).put(&record("any-0"), Duration::from_secs(30)).await.unwrap();
    let reader = Registry::Redis(RedisRegistry::new(&url, "tenants").unwrap().with_trust(Some(ca.trust(Role::Router, "router-0"))));
    for _ in 0..2 {
        // The second listing takes the records unchanged since the first.
        let live = reader.list().await.unwrap();
        let (acme_0, any_0) = (&live[0], &live[1]);
        assert_eq!(acme_0.kv_tenants.as_deref(), Some(&[acme, system][..]));
        assert!(acme_0.serves_tenant(acme) && acme_0.serves_tenant(system));
        assert!(!acme_0.serves_tenant(KvTenant::of_tenant("bravo")) && !acme_0.serves_tenant(KvTenant::SHARED));
        assert_eq!(any_0.kv_tenants, None);
        assert!(any_0.serves_tenant(KvTenant::of_tenant("bravo")));
    }
    let bare = Registry::Redis(RedisRegistry::new(&url, "tenants").unwrap().with_trust(None));
    assert!(bare.list().await.unwrap().iter().all(|worker| worker.kv_tenants.is_none()), "a reader without an identity checks no seal");
}
