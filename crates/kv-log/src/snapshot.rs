//! Index snapshots in Redis: the whole index at one position of the event
//! log, so a starting replica loads it and reads only the entries after
//! that position (instead of the whole stream, or a dump from every worker).

use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;
use redis::RedisResult;
use turbine_kv::KvIndex;
use turbine_proto::kvindex::v1 as pb;

use crate::convert::{dump_from_proto, dump_to_proto};
use crate::log::EventLog;

/// What [`EventLog::load_snapshot`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedSnapshot {
    /// Continue reading the log after this entry.
    pub log_position: String,
    /// Workers loaded.
    pub workers: usize,
    /// When the snapshot was taken, Unix milliseconds.
    pub taken_unix_ms: i64,
}

impl EventLog {
    /// Writes `index` as the namespace's snapshot. `position` must be an
    /// entry the index already reflected when this call began (a follower's
    /// [`position`](crate::FollowerStatus::position) read first): later
    /// events in the dumps are skipped by number on replay. Returns the
    /// snapshot's size in bytes.
    pub async fn save_snapshot(&self, index: &KvIndex, position: &str) -> RedisResult<usize> {
        let workers = index
            .worker_ids()
            .into_iter()
            .filter_map(|worker_id| index.dump(&worker_id).map(|(instance, dump)| dump_to_proto(&worker_id, instance, &dump)))
            .collect();
        let taken_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let bytes = pb::IndexSnapshot { log_position: position.to_owned(), workers, taken_unix_ms }.encode_to_vec();
        let size = bytes.len();
        let mut connection = self.publisher();
        redis::cmd("SET").arg(self.snapshot_key()).arg(bytes).query_async::<()>(&mut connection).await?;
        Ok(size)
    }

    /// Loads the namespace's snapshot into `index` (each worker's view is
    /// replaced); `None` when there is none. A snapshot that does not decode
    /// is ignored with a warning (the log is replayed instead).
    pub async fn load_snapshot(&self, index: &KvIndex) -> RedisResult<Option<LoadedSnapshot>> {
        let mut connection = self.publisher();
        let bytes: Option<Vec<u8>> = redis::cmd("GET").arg(self.snapshot_key()).query_async(&mut connection).await?;
        let Some(bytes) = bytes else { return Ok(None) };
        let snapshot = match pb::IndexSnapshot::decode(bytes.as_slice()) {
            Ok(snapshot) => snapshot,
            Err(error) => {
                tracing::warn!(key = self.snapshot_key(), %error, "ignoring an index snapshot that does not decode");
                return Ok(None);
            }
        };
        let mut workers = 0;
        for dump in snapshot.workers {
            let worker_id = dump.worker_id.clone();
            match dump_from_proto(dump) {
                Ok((instance, dump)) => {
                    index.load_dump(&worker_id, instance, &dump);
                    workers += 1;
                }
                Err(error) => tracing::warn!(worker = worker_id, error, "skipping a malformed worker in the index snapshot"),
            }
        }
        Ok(Some(LoadedSnapshot { log_position: snapshot.log_position, workers, taken_unix_ms: snapshot.taken_unix_ms }))
    }
}

/// Loads the namespace's snapshot into `index` if there is one and returns
/// the log position to follow from (`"0-0"`: the whole log). Redis being
/// unreachable is not an error: the follower replays the log once it is
/// back.
pub async fn start_from_snapshot(log: &EventLog, index: &KvIndex) -> String {
    match log.load_snapshot(index).await {
        Ok(Some(loaded)) => {
            tracing::info!(workers = loaded.workers, position = loaded.log_position, "KV index loaded from the snapshot");
            loaded.log_position
        }
        Ok(None) => "0-0".to_owned(),
        Err(error) => {
            tracing::warn!(%error, "could not read the KV index snapshot; replaying the event log instead");
            "0-0".to_owned()
        }
    }
}
