//! The `turbine-kv-store` binary announcing what it holds in a real Redis
//! event log: a follower's index credits the store's blocks (tier remote)
//! under the store's name, loses what the store deletes, and after a
//! SIGKILL and restart loads the new incarnation's dump (the disk tier's
//! blocks) before following its changes.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use turbine_api::kv_store::{Fingerprint, KvStoreClient};
use turbine_kv::{HostBlock, KvIndex, LocalBlockHash, SequenceHash, WorkerId, block_checksum};
use turbine_kv_log::{EventLog, FollowerStatus, follow};
use turbine_runtime::CancellationToken;
use turbine_testkit::{RedisServer, STARTUP_TIMEOUT, ServiceProcess, wait_until};

/// Blocks of 4,096 bytes.
const FINGERPRINT: u64 = Fingerprint::declaring(7, 4096).get();

async fn start(redis: &RedisServer, disk: &std::path::Path) -> (ServiceProcess, KvStoreClient) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-kv-store"));
    command.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--memory-mib", "4", "--disk-gib", "1"]);
    command.args(["--redis", &redis.url(), "--namespace", "t", "--store-id", "shared", "--disk-dir", disk.to_str().unwrap()]);
    let mut process = ServiceProcess::spawn("turbine-kv-store", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::KvStore, "turbine.kvstore.v1.KvStore", STARTUP_TIMEOUT).await.unwrap();
    let client = KvStoreClient::connect(&process.grpc_endpoint()).unwrap();
    (process, client)
}

/// Block `n` of one chain.
fn block(n: u64) -> (SequenceHash, Arc<HostBlock>) {
    let bytes: Box<[u8]> = (0..4096).map(|i| (i as u64 * 13 + n) as u8).collect();
    let parent = n.checked_sub(1).map(|p| SequenceHash(0xb000 + p));
    (
        SequenceHash(0xb000 + n),
        Arc::new(HostBlock { local: LocalBlockHash(n), parent, checksum: block_checksum(&bytes), bytes, tenant: turbine_kv::KvTenant::SHARED }),
    )
}

#[tokio::test]
async fn a_follower_credits_the_stores_blocks_across_a_restart() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let fp = Fingerprint::new(FINGERPRINT).unwrap();
    let (mut process, client) = start(&redis, dir.path()).await;

    // A follower whose dumps of store names come from the store's Dump.
    let endpoint = Arc::new(Mutex::new(process.grpc_endpoint()));
    let no_workers: turbine_kv_log::DumpFetcher = Arc::new(|_| Box::pin(async { None }));
    let fetch = {
        let endpoint = endpoint.clone();
        turbine_kv_log::with_store_dumps(no_workers, move |name| (name == WorkerId::of_store("shared", FINGERPRINT).as_str()).then(|| endpoint.lock().clone()))
    };
    let (index, status, shutdown) = (Arc::new(KvIndex::new()), Arc::new(FollowerStatus::default()), CancellationToken::new());
    let log = EventLog::new(&redis.url(), "t").unwrap();
    let _follower = follow(index.clone(), &log, fetch, status.clone(), shutdown.clone());
    let name = WorkerId::of_store("shared", FINGERPRINT);
    let hashes: Vec<SequenceHash> = (0..20).map(|n| block(n).0).collect();
    let held = |index: &KvIndex| index.find_matches(&hashes).of(&name).map_or([0; 4], |m| m.by_tier);

    let blocks: Vec<_> = (0..10).map(block).collect();
    assert_eq!(client.put(fp, &blocks).await.unwrap().stored, 10);
    wait_until("the follower credits the store's 10 blocks", Duration::from_secs(10), async || held(&index) == [0, 0, 0, 10]).await;
    assert_eq!(client.delete(fp, &hashes[5..6]).await.unwrap(), 1);
    wait_until("a deleted block leaves the index", Duration::from_secs(10), async || held(&index) == [0, 0, 0, 5]).await;

    process.kill();
    let (process, client) = start(&redis, dir.path()).await;
    *endpoint.lock() = process.grpc_endpoint();
    let resyncs = status.resyncs();
    // Block 5 again, and 10..15 after the kept 6..10: the run is whole.
    assert_eq!(client.put(fp, &(5..15).map(block).collect::<Vec<_>>()).await.unwrap().stored, 6, "6..10 were kept on disk");
    wait_until("the follower loads the restarted store's dump and follows it", Duration::from_secs(10), async || held(&index) == [0, 0, 0, 15]).await;
    assert!(status.resyncs() > resyncs, "the new incarnation came from a dump");
    shutdown.cancel();
}
