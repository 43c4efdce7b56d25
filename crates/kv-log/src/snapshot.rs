//! Index snapshots in Redis: the whole index at one position of the event
//! log, so a starting replica loads it and reads only the entries after
//! that position (instead of the whole stream, or a dump from every worker).
//!
//! With certificates a snapshot is sealed by the replica that wrote it
//! (the `seal` field: its certificate and signature over the snapshot's
//! bytes), and a replica with certificates loads only a snapshot sealed by
//! a router or kv-index certificate of its CA; any other is ignored
//! (counted in `turbine_kv_log_refused_snapshots_total{reason}`) and the
//! log is replayed instead.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;
use redis::RedisResult;
use turbine_kv::{KvIndex, WorkerDump, WorkerId};
use turbine_proto::kvindex::v1 as pb;

use turbine_runtime::host::Role;
use turbine_runtime::signed::{Seal, SealError};

use crate::LogPosition;
use crate::log::EventLog;

/// What a snapshot's seal signs begins with this.
const SEALED_AS: &[u8] = b"turbine.kvlog.v1 index snapshot\n";

static REFUSED: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_kv_log_refused_snapshots_total",
        "Index snapshots a starting replica ignored (replaying the event log instead), by reason: unsigned, untrusted, bad_signature, wrong_writer (sealed by a certificate that is not a router's or a kv-index's)",
        &["reason"],
    )
});

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
/// newer snapshot). KEYS[1]: the hash; ARGV: position, snapshot bytes,
/// seal (JSON; empty without certificates).
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
redis.call('HSET', KEYS[1], 'position', ARGV[1], 'data', ARGV[2], 'seal', ARGV[3])
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
        let seal = match self.trust() {
            None => String::new(),
            Some(trust) => {
                let seal = trust
                    .signer()
                    .seal(&[SEALED_AS, &bytes].concat())
                    .map_err(|error| redis::RedisError::from((redis::ErrorKind::Client, "cannot seal the snapshot", format!("{error:#}"))))?;
                serde_json::to_string(&seal).expect("seals serialize")
            }
        };
        let mut connection = self.slow_connection(SNAPSHOT_TIMEOUT).await?;
        let written: i64 = redis::cmd("EVAL")
            .arg(WRITE_IF_NEWER)
            .arg(1)
            .arg(self.snapshot_key())
            .arg(position.to_string())
            .arg(bytes)
            .arg(seal)
            .query_async(&mut connection)
            .await?;
        Ok((written == 1).then_some(size))
    }

    /// Loads the namespace's snapshot into `index` (each worker's view is
    /// replaced); `None` when there is none. A snapshot that does not decode
    /// is ignored with a warning (the log is replayed instead).
    pub async fn load_snapshot(&self, index: &KvIndex) -> RedisResult<Option<LoadedSnapshot>> {
        let mut connection = self.slow_connection(SNAPSHOT_TIMEOUT).await?;
        let (bytes, seal): (Option<Vec<u8>>, Option<String>) =
            redis::cmd("HMGET").arg(self.snapshot_key()).arg("data").arg("seal").query_async(&mut connection).await?;
        let Some(bytes) = bytes else { return Ok(None) };
        if let Some(trust) = self.trust() {
            let seal = seal.as_deref().and_then(|seal| serde_json::from_str::<Seal>(seal).ok());
            let checked = match seal {
                None => Err(("unsigned", "the snapshot is not sealed".to_owned())),
                Some(seal) => match trust.verifier().verify(&[SEALED_AS, &bytes].concat(), &seal) {
                    Ok(writer) if matches!(writer.role, Role::Router | Role::Index) => Ok(()),
                    Ok(writer) => Err(("wrong_writer", format!("{writer} sealed it: only routers and kv-indexes write snapshots"))),
                    Err(error @ SealError::BadSignature) => Err(("bad_signature", error.to_string())),
                    Err(error) => Err(("untrusted", error.to_string())),
                },
            };
            if let Err((reason, why)) = checked {
                REFUSED.with_label_values(&[reason]).inc();
                tracing::warn!(key = self.snapshot_key(), reason, why, "ignoring the index snapshot; replaying the event log instead");
                return Ok(None);
            }
        }
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
