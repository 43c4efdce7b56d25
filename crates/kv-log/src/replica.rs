//! [`LocalKvIndex`]: an index replica in this process (the index, the
//! follower feeding it, the log publishes go to), behind the same API as
//! the kv-index service (`turbine_api::kv_index`): the kv-index serves one,
//! a router may keep its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use turbine_api::kv_index::{IndexStats, KvIndexApi, KvIndexError, MatchAnswer, MatchQuery};
use turbine_kv::{EventBatch, KvIndex, WorkerDump, WorkerId};

use crate::{EventLog, FollowerStatus, LogPosition};

/// Batches accepted by one publish.
pub const MAX_PUBLISH_BATCHES: usize = 1024;

/// What a replica did besides following the log (reported by `Stats`).
#[derive(Debug, Default)]
pub struct ReplicaCounters {
    /// Workers dropped because their registry lease expired.
    pub workers_expired: AtomicU64,
    /// Snapshots written to Redis.
    pub snapshots_written: AtomicU64,
    /// The position of the snapshot this replica started from.
    pub started_from_snapshot: Mutex<Option<LogPosition>>,
}

/// A replica: the index, how it is fed, where publishes go.
#[derive(Debug, Clone)]
pub struct LocalKvIndex {
    index: Arc<KvIndex>,
    /// The follower keeping `index` in step with the event log; `None`
    /// when the workers of this process feed it directly (always current).
    status: Option<Arc<FollowerStatus>>,
    /// Where `publish_events` appends; `None`: this replica takes none.
    log: Option<EventLog>,
    counters: Arc<ReplicaCounters>,
}

impl LocalKvIndex {
    /// A replica of `index`, fed in this process.
    pub fn new(index: Arc<KvIndex>) -> Self {
        Self { index, status: None, log: None, counters: Arc::default() }
    }

    /// The index follows the event log; `follower` is its follower's
    /// status (`None`: fed in this process, always current).
    pub fn with_follower(mut self, follower: Option<Arc<FollowerStatus>>) -> Self {
        self.status = follower;
        self
    }

    /// Publishes are appended to `log`.
    pub fn with_log(mut self, log: EventLog) -> Self {
        self.log = Some(log);
        self
    }

    /// Reports `counters` in `Stats`.
    pub fn with_counters(mut self, counters: Arc<ReplicaCounters>) -> Self {
        self.counters = counters;
        self
    }

    /// The index.
    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// Whether the index is current: fed in-process, or its follower reads
    /// the log.
    pub fn log_reachable(&self) -> bool {
        self.status.as_ref().is_none_or(|status| status.reachable())
    }

    /// The follower's progress, when it has one.
    pub fn status(&self) -> Option<&Arc<FollowerStatus>> {
        self.status.as_ref()
    }

    /// One worker's view as a dump.
    pub fn dump_of(&self, worker_id: &WorkerId) -> Option<WorkerDump> {
        self.index.dump(worker_id).map(|(instance, dump)| WorkerDump { worker_id: worker_id.clone(), instance, dump })
    }
}

#[tonic::async_trait]
impl KvIndexApi for LocalKvIndex {
    async fn find_matches(&self, query: &MatchQuery) -> Result<MatchAnswer, KvIndexError> {
        let MatchQuery { hashes, cached_blocks_of } = query;
        Ok(MatchAnswer {
            query_blocks: hashes.len() as u32,
            matches: self.index.find_matches(hashes).iter().collect(),
            cached_blocks: self.index.cached_blocks_of(cached_blocks_of.iter().map(WorkerId::as_str)),
            log_reachable: self.log_reachable(),
        })
    }

    async fn publish_events(&self, batches: Vec<EventBatch>) -> Result<Vec<LogPosition>, KvIndexError> {
        let log = self.log.as_ref().ok_or_else(|| KvIndexError::Unavailable("this index follows no event log".into()))?;
        if batches.len() > MAX_PUBLISH_BATCHES {
            return Err(KvIndexError::InvalidArgument(format!("at most {MAX_PUBLISH_BATCHES} batches per call, got {}", batches.len())));
        }
        let mut positions = Vec::with_capacity(batches.len());
        for batch in &batches {
            let position = log.publish(batch).await.map_err(|error| KvIndexError::Unavailable(format!("the KV event log (Redis) is unreachable: {error}")))?;
            positions.push(position);
        }
        Ok(positions)
    }

    async fn dump(&self, worker_id: Option<WorkerId>) -> Result<Vec<WorkerDump>, KvIndexError> {
        match worker_id {
            None => Ok(self.index.worker_ids().iter().filter_map(|id| self.dump_of(id)).collect()),
            Some(id) => Ok(vec![self.dump_of(&id).ok_or_else(|| KvIndexError::NotFound(format!("worker {id:?} has no view in this index")))?]),
        }
    }

    async fn remove_worker(&self, worker_id: WorkerId) -> Result<Option<u64>, KvIndexError> {
        if worker_id.is_empty() {
            return Err(KvIndexError::InvalidArgument("worker_id is required".into()));
        }
        let blocks = self.index.cached_blocks(&worker_id) as u64;
        if !self.index.remove_worker(&worker_id) {
            return Ok(None);
        }
        tracing::info!(worker = %worker_id, blocks, "worker removed from the KV index on request");
        Ok(Some(blocks))
    }

    async fn stats(&self) -> Result<IndexStats, KvIndexError> {
        let stats = self.index.stats();
        let status = self.status.as_deref();
        Ok(IndexStats {
            workers: stats.workers as u64,
            blocks: stats.nodes as u64,
            entries: stats.entries as u64,
            events_applied: status.map_or(stats.events_applied, FollowerStatus::events_applied),
            batches_read: status.map_or(0, FollowerStatus::batches),
            resyncs: status.map_or(0, FollowerStatus::resyncs),
            log_reachable: self.log_reachable(),
            log_position: status.map_or(LogPosition::START, FollowerStatus::position),
            workers_expired: self.counters.workers_expired.load(Ordering::Relaxed),
            snapshots_written: self.counters.snapshots_written.load(Ordering::Relaxed),
            started_from_snapshot: *self.counters.started_from_snapshot.lock(),
        })
    }
}
