//! The Redis registry.
//!
//! Layout, under `turbine:<namespace>:`:
//! - `workers:<id>`: the record as JSON, with a TTL equal to the lease;
//! - `workers`: a set of registered ids, so listing needs no `SCAN`.
//!
//! Listing reads the set, then each record and its remaining TTL in one
//! pipeline; ids whose record expired are removed from the set.

use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::{LiveWorker, RegistryError, Result, WorkerRecord};

/// A registry shared through Redis.
#[derive(Clone)]
pub struct RedisRegistry {
    connection: ConnectionManager,
    namespace: String,
    prefix: String,
}

impl std::fmt::Debug for RedisRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisRegistry").field("namespace", &self.namespace).finish()
    }
}

impl RedisRegistry {
    /// Connects lazily to `url` (`redis://host:port/db`): the registry can be
    /// created while Redis is down and starts working when it answers.
    pub fn new(url: &str, namespace: &str) -> Result<Self> {
        let client = redis::Client::open(url).map_err(|error| RegistryError::Unavailable(format!("bad Redis URL {url:?}: {error}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let connection = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Self { connection, namespace: namespace.to_owned(), prefix: format!("turbine:{namespace}:workers") })
    }

    /// The key namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn record_key(&self, worker_id: &str) -> String {
        format!("{}:{worker_id}", self.prefix)
    }

    pub(crate) async fn put(&self, record: &WorkerRecord, ttl: Duration) -> Result<()> {
        let json = serde_json::to_string(record).expect("records serialize");
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let mut connection = self.connection.clone();
        redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(self.record_key(&record.worker_id))
            .arg(json)
            .arg("PX")
            .arg(ttl_ms)
            .ignore()
            .sadd(&self.prefix, record.worker_id.as_str())
            .ignore()
            .query_async::<()>(&mut connection)
            .await?;
        Ok(())
    }

    pub(crate) async fn remove(&self, worker_id: &str) -> Result<()> {
        let mut connection = self.connection.clone();
        redis::pipe().atomic().del(self.record_key(worker_id)).ignore().srem(&self.prefix, worker_id).ignore().query_async::<()>(&mut connection).await?;
        Ok(())
    }

    pub(crate) async fn list(&self) -> Result<Vec<LiveWorker>> {
        let mut connection = self.connection.clone();
        let mut ids: Vec<String> = connection.smembers(&self.prefix).await?;
        ids.sort();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            let key = self.record_key(id);
            pipe.get(&key).pttl(&key);
        }
        let asked_at = Instant::now();
        let replies: Vec<(Option<String>, i64)> = pipe.query_async(&mut connection).await?;
        let mut live = Vec::with_capacity(ids.len());
        let mut expired = Vec::new();
        for (id, (json, ttl_ms)) in ids.into_iter().zip(replies) {
            match json {
                Some(json) if ttl_ms > 0 => {
                    let record: WorkerRecord =
                        serde_json::from_str(&json).map_err(|error| RegistryError::Corrupt { key: self.record_key(&id), message: error.to_string() })?;
                    live.push(LiveWorker { record, expires_at: asked_at + Duration::from_millis(ttl_ms as u64) });
                }
                _ => expired.push(id),
            }
        }
        if !expired.is_empty() {
            let _: redis::RedisResult<()> = connection.srem(&self.prefix, &expired).await;
        }
        Ok(live)
    }

    /// The Redis server's run id, new at every server start.
    pub(crate) async fn generation(&self) -> Result<Option<String>> {
        let mut connection = self.connection.clone();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut connection).await?;
        Ok(info.lines().find_map(|line| line.strip_prefix("run_id:")).map(|id| id.trim().to_owned()))
    }

    pub(crate) async fn ping(&self) -> Result<()> {
        let mut connection = self.connection.clone();
        let _: String = redis::cmd("PING").query_async(&mut connection).await?;
        Ok(())
    }
}
