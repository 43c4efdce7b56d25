//! Keeping an index replica in step with the event log.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prost::Message;
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use turbine_api::worker::WorkerClients;
use turbine_kv::index::Applied;
use turbine_kv::{EventBatch, KvIndex, WorkerDump, WorkerId};
use turbine_proto::kvindex::v1 as pb;

use crate::log::{EventLog, EventReader, LogEntry, sealed_bytes};
use crate::{LogPosition, may_publish_for};
use turbine_runtime::host::Role;
use turbine_runtime::signed::{Seal, SealError, fingerprint};
use turbine_runtime::trust::Trust;

/// Writers' certificates a follower remembers at most (unknown
/// fingerprints included); past it the memory starts over.
const CERTIFICATES_REMEMBERED: usize = 1024;

static REFUSED: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_kv_log_refused_entries_total",
        "KV event log entries a follower skipped, by reason: unsigned (no seal, where followers require one), unknown_writer (no certificate stored under the entry's fingerprint), untrusted (a certificate the CA did not sign, or not valid now), bad_signature (the batch was altered, or sealed by another key), wrong_writer (sealed by a certificate that may not write that worker's events), malformed (does not decode)",
        &["reason"],
    )
});

/// Fetches a worker's cache dump, or `None` when the worker cannot be
/// reached (it is asked again a second later).
pub type DumpFetcher = Arc<dyn Fn(WorkerId) -> Pin<Box<dyn Future<Output = Option<WorkerDump>> + Send>> + Send + Sync>;

/// Longest wait for new entries per read.
const READ_BLOCK: Duration = Duration::from_millis(500);
/// Entries per read.
const READ_COUNT: usize = 1024;
/// Abandoned incarnations remembered per worker.
const RETIRED_PER_WORKER: usize = 8;
/// Wait before asking an unreachable worker for its dump again.
const RESYNC_RETRY: Duration = Duration::from_secs(1);
/// Batches held per worker while its dump is awaited.
const HELD_BATCHES: usize = 1024;
/// A worker without a dump for this long is dropped from the index.
const STALE_GIVE_UP: Duration = Duration::from_secs(300);

/// What a follower has done; shared with whoever reports on it.
#[derive(Debug, Default)]
pub struct FollowerStatus {
    reachable: AtomicBool,
    pub(crate) batches: AtomicU64,
    pub(crate) events: AtomicU64,
    pub(crate) resyncs: AtomicU64,
    /// The last entry applied.
    position: Mutex<LogPosition>,
    /// Workers whose view waits for a dump.
    stale: Mutex<Vec<WorkerId>>,
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

    /// The last stream entry applied ([`LogPosition::START`] before the
    /// first). Everything up to it is reflected in the index.
    pub fn position(&self) -> LogPosition {
        *self.position.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Workers whose view in the index is stale (waiting for a dump):
    /// a snapshot leaves them out, so whoever loads it resynchronises them.
    pub fn stale_workers(&self) -> Vec<WorkerId> {
        self.stale.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    fn set_position(&self, position: LogPosition) {
        *self.position.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = position;
    }
}

/// Applies the log to `index` from its oldest retained entry, then as
/// entries arrive, until `shutdown`. While Redis is unreachable the task
/// retries with backoff and `status` says so; it continues where it left.
pub fn follow(index: Arc<KvIndex>, log: &EventLog, fetch: DumpFetcher, status: Arc<FollowerStatus>, shutdown: CancellationToken) -> JoinHandle<()> {
    follow_from(index, log, LogPosition::START, fetch, status, shutdown)
}

/// [`follow`], reading the entries after `after` (a snapshot's position:
/// the index already reflects everything up to it).
pub fn follow_from(
    index: Arc<KvIndex>,
    log: &EventLog,
    after: LogPosition,
    fetch: DumpFetcher,
    status: Arc<FollowerStatus>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let mut reader = log.reader();
    let key = log.key().to_owned();
    let trust = log.trust().cloned();
    status.set_position(after);
    tokio::spawn(async move {
        let mut follower = Follower {
            index,
            fetch,
            status,
            retired: FxHashMap::default(),
            stale: FxHashMap::default(),
            fetches: JoinSet::new(),
            trust,
            certificates: FxHashMap::default(),
            warned: FxHashSet::default(),
        };
        let mut after = after;
        let mut failures = 0u32;
        loop {
            let read = tokio::select! {
                () = shutdown.cancelled() => break,
                read = reader.read(after, READ_BLOCK, READ_COUNT) => read,
            };
            match read {
                Ok(entries) => {
                    if !follower.status.reachable.swap(true, Ordering::Relaxed) {
                        tracing::info!(stream = key, "following the KV event log");
                    }
                    failures = 0;
                    for entry in entries {
                        after = entry.position;
                        match follower.accept(&mut reader, &entry).await {
                            Ok(batch) => follower.apply(batch),
                            Err((reason, why)) => {
                                REFUSED.with_label_values(&[reason]).inc();
                                if follower.warned.insert(reason) {
                                    tracing::warn!(entry = %after, reason, why, "skipping a KV event batch (logged once per reason; counted in turbine_kv_log_refused_entries_total)");
                                }
                            }
                        }
                        follower.status.set_position(after);
                    }
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
            follower.finish_fetches();
            follower.retry_due();
        }
        follower.fetches.abort_all();
    })
}

/// A worker whose view waits for a dump.
struct Stale {
    /// The incarnation whose events showed the gap.
    instance: u64,
    /// Its batches read meanwhile, applied after the dump (what the dump
    /// already reflects is skipped by number).
    held: VecDeque<EventBatch>,
    /// When to ask again; `None` while a fetch runs.
    retry_at: Option<Instant>,
    /// When its view went stale.
    since: Instant,
    /// Whether a failed fetch was reported.
    warned: bool,
}

struct Follower {
    index: Arc<KvIndex>,
    fetch: DumpFetcher,
    status: Arc<FollowerStatus>,
    /// Incarnations replaced by a newer one's dump: their remaining
    /// entries in the log are stale.
    retired: FxHashMap<WorkerId, FxHashSet<u64>>,
    /// Workers waiting for a dump.
    stale: FxHashMap<WorkerId, Stale>,
    /// Dump fetches in flight, off the follower's path: one slow worker
    /// never holds up the others' events.
    fetches: JoinSet<(WorkerId, Option<WorkerDump>)>,
    /// Checks entries' seals (with certificates).
    trust: Option<Trust>,
    /// Writers' certificates by fingerprint (`None`: none stored).
    certificates: FxHashMap<Vec<u8>, Option<Vec<u8>>>,
    /// Reasons already logged (each is logged once, counted always).
    warned: FxHashSet<&'static str>,
}

impl Follower {
    /// The batch of `entry`, if this follower takes it: it decodes and,
    /// with certificates, is sealed by a writer of the CA that may write
    /// that worker's events (the worker itself, its kv-store for a store's
    /// names, or a kv-index relaying what it checked).
    async fn accept(&mut self, reader: &mut EventReader, entry: &LogEntry) -> Result<EventBatch, (&'static str, String)> {
        let batch = pb::EventBatch::decode(entry.payload.as_slice()).map_err(|error| error.to_string());
        let batch = batch.and_then(|batch| EventBatch::try_from(batch).map_err(|error| error.to_string())).map_err(|why| ("malformed", why))?;
        let Some(trust) = &self.trust else { return Ok(batch) };
        if entry.writer.is_empty() || entry.signature.len() < 2 {
            return Err(("unsigned", format!("the batch of {:?} is not sealed", batch.worker_id.as_str())));
        }
        let certificate = match self.certificates.get(&entry.writer) {
            Some(known) => known.clone(),
            None => {
                let stored = reader
                    .writer_certificate(&entry.writer)
                    .await
                    .map_err(|error| ("unknown_writer", format!("cannot read the writer's certificate: {error}")))?;
                let stored = stored.filter(|der| fingerprint(der)[..] == entry.writer[..]);
                if self.certificates.len() >= CERTIFICATES_REMEMBERED {
                    self.certificates.clear();
                }
                self.certificates.insert(entry.writer.clone(), stored.clone());
                stored
            }
        };
        let certificate =
            certificate.ok_or_else(|| ("unknown_writer", format!("no certificate is stored for the writer of {:?}'s batch", batch.worker_id.as_str())))?;
        let seal = Seal { certificate, scheme: u16::from_be_bytes([entry.signature[0], entry.signature[1]]), signature: entry.signature[2..].to_vec() };
        let writer = trust.verifier().verify(&sealed_bytes(&entry.payload), &seal).map_err(|error| match error {
            SealError::BadSignature => ("bad_signature", error.to_string()),
            _ => ("untrusted", error.to_string()),
        })?;
        if writer.role != Role::Index && !may_publish_for(&writer, &batch.worker_id) {
            return Err(("wrong_writer", format!("{writer} sealed the events of {:?}", batch.worker_id.as_str())));
        }
        Ok(batch)
    }

    fn apply(&mut self, batch: EventBatch) {
        self.status.batches.fetch_add(1, Ordering::Relaxed);
        self.apply_batch(batch);
    }

    fn apply_batch(&mut self, batch: EventBatch) {
        if self.retired.get(&batch.worker_id).is_some_and(|retired| retired.contains(&batch.instance)) {
            return;
        }
        if let Some(stale) = self.stale.get_mut(&batch.worker_id) {
            if stale.held.len() >= HELD_BATCHES {
                // The dump will not cover what is dropped: the next batch
                // after it shows a gap again.
                stale.held.pop_front();
            }
            stale.held.push_back(batch);
            return;
        }
        for (at, event) in batch.events.iter().enumerate() {
            match self.index.apply(&batch.worker_id, batch.instance, event) {
                Applied::Applied => {
                    self.status.events.fetch_add(1, Ordering::Relaxed);
                }
                Applied::Duplicate => {}
                Applied::Gap { expected } => {
                    tracing::debug!(worker = %batch.worker_id, expected, got = event.event_id, "gap in a worker's KV events; loading a dump");
                    let rest = EventBatch { worker_id: batch.worker_id.clone(), instance: batch.instance, events: batch.events[at..].to_vec() };
                    let stale = Stale { instance: batch.instance, held: VecDeque::from([rest]), retry_at: None, since: Instant::now(), warned: false };
                    self.stale.insert(batch.worker_id.clone(), stale);
                    self.start_fetch(batch.worker_id);
                    self.publish_stale();
                    return;
                }
            }
        }
    }

    fn start_fetch(&mut self, worker_id: WorkerId) {
        if let Some(stale) = self.stale.get_mut(&worker_id) {
            stale.retry_at = None;
        }
        let fetch = (self.fetch)(worker_id.clone());
        self.fetches.spawn(async move { (worker_id, fetch.await) });
    }

    /// Loads the dumps that arrived and replays what was held meanwhile.
    fn finish_fetches(&mut self) {
        while let Some(done) = self.fetches.try_join_next() {
            let Ok((worker_id, fetched)) = done else {
                continue;
            };
            let Some(WorkerDump { instance: current, dump, .. }) = fetched else {
                if let Some(stale) = self.stale.get_mut(&worker_id) {
                    if !std::mem::replace(&mut stale.warned, true) {
                        tracing::warn!(worker = %worker_id, "could not fetch a KV cache dump; retrying every {RESYNC_RETRY:?}");
                    }
                    stale.retry_at = Some(Instant::now() + RESYNC_RETRY);
                }
                continue;
            };
            let Some(stale) = self.stale.remove(&worker_id) else { continue };
            self.status.resyncs.fetch_add(1, Ordering::Relaxed);
            self.index.load_dump(&worker_id, current, &dump);
            if stale.instance != current {
                // The worker restarted since the gap: what is left of that
                // incarnation in the log is stale.
                let retired = self.retired.entry(worker_id.clone()).or_default();
                if retired.len() >= RETIRED_PER_WORKER {
                    retired.clear();
                }
                retired.insert(stale.instance);
            }
            // What was held, as if just read: events the dump reflects are
            // duplicates; a later incarnation's replace the view.
            for batch in stale.held {
                self.apply_batch(batch);
            }
            self.publish_stale();
        }
    }

    /// Asks again where a fetch failed a while ago; gives up on workers
    /// unreachable for long (they are gone: their view leaves the index).
    fn retry_due(&mut self) {
        let now = Instant::now();
        let gone: Vec<WorkerId> =
            self.stale.iter().filter(|(_, s)| now.duration_since(s.since) > STALE_GIVE_UP && s.retry_at.is_some()).map(|(id, _)| id.clone()).collect();
        for worker_id in gone {
            tracing::warn!(worker = %worker_id, "no KV cache dump for {STALE_GIVE_UP:?}; dropping the worker from the index");
            self.stale.remove(&worker_id);
            self.index.remove_worker(&worker_id);
        }
        let due: Vec<WorkerId> = self.stale.iter().filter(|(_, s)| s.retry_at.is_some_and(|at| at <= now)).map(|(id, _)| id.clone()).collect();
        for worker_id in due {
            self.start_fetch(worker_id);
        }
        self.publish_stale();
    }

    fn publish_stale(&self) {
        let mut published = self.status.stale.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if published.len() != self.stale.len() || published.iter().any(|id| !self.stale.contains_key(id)) {
            *published = self.stale.keys().cloned().collect();
        }
    }
}

/// A [`DumpFetcher`] that asks the worker (`Worker/DumpKvCache`, or
/// directly when it lives in this process) at the endpoint `endpoint_of`
/// gives for it (the registry's), within 10 s.
pub fn dump_fetcher(clients: WorkerClients, endpoint_of: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> DumpFetcher {
    Arc::new(move |worker_id: WorkerId| {
        let client = endpoint_of(&worker_id).and_then(|endpoint| clients.client(&worker_id, &endpoint).ok());
        Box::pin(async move {
            let dump = tokio::time::timeout(Duration::from_secs(10), client?.dump_kv_cache()).await.ok()?.ok()?;
            // A dump of another worker (a reused endpoint) is no dump.
            (dump.worker_id == worker_id).then_some(dump)
        })
    })
}

/// Dumps for an index's followers: a kv-store's name
/// ([`WorkerId::of_store`]) is answered by that store's `Dump`, at the
/// endpoint `store_endpoint` gives for the name, within 10 s; every other
/// name by `workers`.
pub fn with_store_dumps(workers: DumpFetcher, store_endpoint: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> DumpFetcher {
    Arc::new(move |worker_id: WorkerId| {
        let Some((_, fingerprint)) = worker_id.store_part() else {
            return workers(worker_id);
        };
        let client = store_endpoint(&worker_id).and_then(|endpoint| turbine_api::kv_store::KvStoreClient::connect(&endpoint).ok());
        let fingerprint = turbine_api::kv_store::Fingerprint::new(fingerprint);
        Box::pin(async move {
            let (instance, dump) = tokio::time::timeout(Duration::from_secs(10), client?.dump(fingerprint?)).await.ok()?.ok()?;
            Some(WorkerDump { worker_id, instance, dump })
        })
    })
}
