//! Index snapshots in Redis: the whole index at one position of the event
//! log, so a starting replica loads it and reads only the entries after
//! that position (instead of the whole stream, or a dump from every worker).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;
use redis::RedisResult;
use turbine_kv::{KvIndex, WorkerDump, WorkerId};
use turbine_proto::kvindex::v1 as pb;

use crate::LogPosition;
use crate::log::EventLog;

/// What [`EventLog::load_snapshot`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedSnapshot {
    /// Continue reading the log after this entry.
    pub log_position: LogPosition,
    /// Workers loaded.
    pub workers: usize,
    /// When the snapshot was taken, Unix milliseconds.
    pub taken_unix_ms: i64,
}

/// Writes the snapshot unless the stored one is at the same or a later log
/// position (replicas write the same key; a lagging one must not replace a
/// newer snapshot). KEYS[1]: the hash; ARGV: position, snapshot bytes.
const WRITE_IF_NEWER: &str = r"
local old = redis.call('HGET', KEYS[1], 'position')
if old then
  local om, os = string.match(old, '^(%d+)-(%d+)$')
  local nm, ns = string.match(ARGV[1], '^(%d+)-(%d+)$')
  if om and nm then
    om, os, nm, ns = tonumber(om), tonumber(os), tonumber(nm), tonumber(ns)
    if om > nm or (om == nm and os >= ns) then return 0 end
  end
end
redis.call('HSET', KEYS[1], 'position', ARGV[1], 'data', ARGV[2])
return 1
";

/// Longest a snapshot read or write may take (a big index is many MB).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(60);

impl EventLog {
    /// Writes `index` as the namespace's snapshot, leaving out the workers
    /// in `exclude` (views waiting for a dump: whoever loads the snapshot
    /// resynchronises them). `position` must be an entry the index already
    /// reflected when this call began (a follower's
    /// [`position`](crate::FollowerStatus::position) read first): later
    /// events in the dumps are skipped by number on replay. The encoding
    /// runs off the async threads and the write on a connection of its own.
    /// Returns the snapshot's size in bytes, or `None` if the stored
    /// snapshot was already at this position or later.
    pub async fn save_snapshot(&self, index: Arc<KvIndex>, position: LogPosition, exclude: Vec<WorkerId>) -> RedisResult<Option<usize>> {
        let bytes = tokio::task::spawn_blocking(move || {
            let workers = index
                .worker_ids()
                .into_iter()
                .filter(|worker_id| !exclude.contains(worker_id))
                .filter_map(|worker_id| index.dump(&worker_id).map(|(instance, dump)| pb::WorkerDump::from(&WorkerDump { worker_id, instance, dump })))
                .collect();
            let taken_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
            pb::IndexSnapshot { log_position: position.to_string(), workers, taken_unix_ms }.encode_to_vec()
        })
        .await
        .map_err(|error| redis::RedisError::from((redis::ErrorKind::Client, "encoding the snapshot failed", error.to_string())))?;
        let size = bytes.len();
        let mut connection = self.slow_connection(SNAPSHOT_TIMEOUT).await?;
        let written: i64 =
            redis::cmd("EVAL").arg(WRITE_IF_NEWER).arg(1).arg(self.snapshot_key()).arg(position.to_string()).arg(bytes).query_async(&mut connection).await?;
        Ok((written == 1).then_some(size))
    }

    /// Loads the namespace's snapshot into `index` (each worker's view is
    /// replaced); `None` when there is none. A snapshot that does not decode
    /// is ignored with a warning (the log is replayed instead).
    pub async fn load_snapshot(&self, index: &KvIndex) -> RedisResult<Option<LoadedSnapshot>> {
        let mut connection = self.slow_connection(SNAPSHOT_TIMEOUT).await?;
        let bytes: Option<Vec<u8>> = redis::cmd("HGET").arg(self.snapshot_key()).arg("data").query_async(&mut connection).await?;
        let Some(bytes) = bytes else { return Ok(None) };
        let snapshot = match pb::IndexSnapshot::decode(bytes.as_slice()) {
            Ok(snapshot) => snapshot,
            Err(error) => {
                tracing::warn!(key = self.snapshot_key(), %error, "ignoring an index snapshot that does not decode");
                return Ok(None);
            }
        };
        let pb::IndexSnapshot { log_position, workers: dumps, taken_unix_ms } = snapshot;
        let Ok(log_position) = log_position.parse::<LogPosition>() else {
            tracing::warn!(key = self.snapshot_key(), log_position, "ignoring an index snapshot with a malformed position");
            return Ok(None);
        };
        let mut workers = 0;
        for dump in dumps {
            let worker_id = dump.worker_id.clone();
            match WorkerDump::try_from(dump) {
                Ok(WorkerDump { worker_id, instance, dump }) => {
                    index.load_dump(&worker_id, instance, &dump);
                    workers += 1;
                }
                Err(error) => {
                    tracing::warn!(worker = worker_id, %error, "skipping a malformed worker in the index snapshot")
                }
            }
        }
        Ok(Some(LoadedSnapshot { log_position, workers, taken_unix_ms }))
    }
}

/// Loads the namespace's snapshot into `index` if there is one and returns
/// the log position to follow from ([`LogPosition::START`]: the whole log).
/// Redis being unreachable is not an error: the follower replays the log
/// once it is back.
pub async fn start_from_snapshot(log: &EventLog, index: &KvIndex) -> LogPosition {
    match log.load_snapshot(index).await {
        Ok(Some(loaded)) => {
            tracing::info!(workers = loaded.workers, position = %loaded.log_position, "KV index loaded from the snapshot");
            loaded.log_position
        }
        Ok(None) => LogPosition::START,
        Err(error) => {
            tracing::warn!(%error, "could not read the KV index snapshot; replaying the event log instead");
            LogPosition::START
        }
    }
}
