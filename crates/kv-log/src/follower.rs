//! Keeping an index replica in step with the event log.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prost::Message;
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turbine_kv::index::Applied;
use turbine_kv::{Dump, KvIndex};
use turbine_proto::kvindex::v1 as pb;
use turbine_proto::worker::v1::DumpKvCacheRequest;
use turbine_proto::worker::v1::worker_client::WorkerClient;
use turbine_runtime::grpc::MAX_MESSAGE_BYTES;

use crate::convert::{Batch, batch_from_proto};
use crate::log::EventLog;

/// Fetches a worker's cache dump, `(instance, dump)`, or `None` when the
/// worker cannot be reached (it is retried at the worker's next gap).
pub type DumpFetcher = Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = Option<(u64, Dump)>> + Send>> + Send + Sync>;

/// Longest wait for new entries per read.
const READ_BLOCK: Duration = Duration::from_millis(500);
/// Entries per read.
const READ_COUNT: usize = 1024;
/// Abandoned incarnations remembered per worker.
const RETIRED_PER_WORKER: usize = 8;
/// Wait before asking an unreachable worker for its dump again.
const RESYNC_RETRY: Duration = Duration::from_secs(1);

/// What a follower has done; shared with whoever reports on it.
#[derive(Debug, Default)]
pub struct FollowerStatus {
    reachable: AtomicBool,
    pub(crate) batches: AtomicU64,
    pub(crate) events: AtomicU64,
    pub(crate) resyncs: AtomicU64,
    /// The last entry applied.
    position: Mutex<String>,
}

impl FollowerStatus {
    /// Whether the last read of the log succeeded: while false, the index
    /// may be stale and callers should route by load alone.
    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Batches read.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Events applied (duplicates not counted).
    pub fn events_applied(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Dumps loaded after a gap or an unknown incarnation.
    pub fn resyncs(&self) -> u64 {
        self.resyncs.load(Ordering::Relaxed)
    }

    /// The id of the last stream entry applied (`"0-0"` before the first).
    /// Everything up to it is reflected in the index.
    pub fn position(&self) -> String {
        let position = self.position.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if position.is_empty() { "0-0".to_owned() } else { position.clone() }
    }

    fn set_position(&self, id: &str) {
        let mut position = self.position.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        position.clear();
        position.push_str(id);
    }
}

/// Applies the log to `index` from its oldest retained entry, then as
/// entries arrive, until `shutdown`. While Redis is unreachable the task
/// retries with backoff and `status` says so; it continues where it left.
pub fn follow(index: Arc<KvIndex>, log: &EventLog, fetch: DumpFetcher, status: Arc<FollowerStatus>, shutdown: CancellationToken) -> JoinHandle<()> {
    follow_from(index, log, "0-0".to_owned(), fetch, status, shutdown)
}

/// [`follow`], reading the entries after `after` (a snapshot's position:
/// the index already reflects everything up to it).
pub fn follow_from(
    index: Arc<KvIndex>,
    log: &EventLog,
    after: String,
    fetch: DumpFetcher,
    status: Arc<FollowerStatus>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let mut reader = log.reader();
    let key = log.key().to_owned();
    status.set_position(&after);
    tokio::spawn(async move {
        let mut follower = Follower { index, fetch, status, retired: FxHashMap::default(), stale: FxHashMap::default() };
        let mut after = after;
        let mut failures = 0u32;
        loop {
            let read = tokio::select! {
                () = shutdown.cancelled() => break,
                read = reader.read(&after, READ_BLOCK, READ_COUNT) => read,
            };
            match read {
                Ok(entries) => {
                    if !follower.status.reachable.swap(true, Ordering::Relaxed) {
                        tracing::info!(stream = key, "following the KV event log");
                    }
                    failures = 0;
                    for (id, payload) in entries {
                        after = id;
                        match pb::EventBatch::decode(payload.as_slice()).map_err(|error| error.to_string()).and_then(batch_from_proto) {
                            Ok(batch) => follower.apply(batch).await,
                            Err(error) => tracing::warn!(entry = after, error, "skipping a malformed KV event batch"),
                        }
                        follower.status.set_position(&after);
                    }
                    follower.retry_stale().await;
                }
                Err(error) => {
                    failures += 1;
                    if follower.status.reachable.swap(false, Ordering::Relaxed) || failures == 1 {
                        tracing::warn!(stream = key, %error, "KV event log unreachable; retrying");
                    }
                    let backoff = Duration::from_millis(100 << failures.min(5)).min(Duration::from_secs(2));
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
    })
}

struct Follower {
    index: Arc<KvIndex>,
    fetch: DumpFetcher,
    status: Arc<FollowerStatus>,
    /// Incarnations replaced by a newer one's dump: their remaining
    /// entries in the log are stale.
    retired: FxHashMap<String, FxHashSet<u64>>,
    /// Workers whose view waits for a dump that could not be fetched: the
    /// incarnation last seen and when to try again. Their events are
    /// skipped meanwhile (the dump will cover them).
    stale: FxHashMap<String, (u64, Instant)>,
}

impl Follower {
    async fn apply(&mut self, batch: Batch) {
        self.status.batches.fetch_add(1, Ordering::Relaxed);
        let Batch { worker_id, instance, events } = batch;
        if self.retired.get(&worker_id).is_some_and(|retired| retired.contains(&instance)) {
            return;
        }
        if self.stale.get(&worker_id).is_some_and(|&(_, retry_at)| Instant::now() < retry_at) {
            return;
        }
        for event in &events {
            match self.index.apply(&worker_id, instance, event) {
                Applied::Applied => {
                    self.status.events.fetch_add(1, Ordering::Relaxed);
                }
                Applied::Duplicate => {}
                Applied::Gap { expected } => {
                    tracing::debug!(worker = worker_id, expected, got = event.event_id, "gap in a worker's KV events; loading a dump");
                    // The dump reflects this batch (or a later incarnation).
                    self.resync(&worker_id, instance).await;
                    return;
                }
            }
        }
    }

    /// Replaces the view of `worker_id` (last seen as `instance`) with its
    /// dump; if the worker cannot be reached, tries again later.
    async fn resync(&mut self, worker_id: &str, instance: u64) {
        let Some((current, dump)) = (self.fetch)(worker_id.to_owned()).await else {
            if self.stale.insert(worker_id.to_owned(), (instance, Instant::now() + RESYNC_RETRY)).is_none() {
                tracing::warn!(worker = worker_id, "could not fetch a KV cache dump; retrying every {RESYNC_RETRY:?}");
            }
            return;
        };
        self.stale.remove(worker_id);
        self.status.resyncs.fetch_add(1, Ordering::Relaxed);
        self.index.load_dump(worker_id, current, &dump);
        if current != instance {
            // The worker restarted since: everything left of the old
            // incarnation in the log is stale.
            let retired = self.retired.entry(worker_id.to_owned()).or_default();
            if retired.len() >= RETIRED_PER_WORKER {
                retired.clear();
            }
            retired.insert(instance);
        }
    }

    /// Retries the dumps that are due.
    async fn retry_stale(&mut self) {
        let now = Instant::now();
        let due: Vec<(String, u64)> = self.stale.iter().filter(|(_, (_, at))| *at <= now).map(|(id, (instance, _))| (id.clone(), *instance)).collect();
        for (worker_id, instance) in due {
            self.resync(&worker_id, instance).await;
        }
    }
}

/// A [`DumpFetcher`] that calls `Worker/DumpKvCache` on the endpoint
/// `endpoint_of` gives for the worker (the registry's), within 10 s.
pub fn grpc_dump_fetcher(endpoint_of: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> DumpFetcher {
    Arc::new(move |worker_id: String| {
        let endpoint = endpoint_of(&worker_id);
        Box::pin(async move {
            let endpoint = endpoint?;
            let fetch = async {
                let mut client = WorkerClient::connect(endpoint).await.ok()?.max_decoding_message_size(MAX_MESSAGE_BYTES);
                let dump = client.dump_kv_cache(DumpKvCacheRequest {}).await.ok()?.into_inner().dump?;
                crate::convert::dump_from_proto(dump).ok()
            };
            tokio::time::timeout(Duration::from_secs(10), fetch).await.ok().flatten()
        })
    })
}
