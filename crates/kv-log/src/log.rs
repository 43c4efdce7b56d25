//! The Redis stream that carries the event batches.

use std::time::Duration;

use prost::Message;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, RedisResult, Value};
use turbine_kv::EventBatch;
use turbine_proto::kvindex::v1 as pb;

use crate::LogPosition;

/// Entries kept in the stream (approximately: Redis trims whole nodes). A
/// consumer that falls further behind, or starts later, resynchronises
/// affected workers from dumps.
pub const DEFAULT_MAX_LEN: usize = 1_000_000;

/// One namespace's event stream.
#[derive(Clone)]
pub struct EventLog {
    client: redis::Client,
    publisher: ConnectionManager,
    key: String,
    snapshot_key: String,
    max_len: usize,
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLog").field("key", &self.key).field("max_len", &self.max_len).finish()
    }
}

impl EventLog {
    /// The stream of `namespace` on the Redis at `url`; connects lazily, so
    /// it can be created while Redis is down.
    pub fn new(url: &str, namespace: &str) -> RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let publisher = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
        Ok(Self {
            client,
            publisher,
            key: format!("turbine:{namespace}:kv:events"),
            snapshot_key: format!("turbine:{namespace}:kv:snapshot"),
            max_len: DEFAULT_MAX_LEN,
        })
    }

    /// Keeps about `max_len` entries instead of [`DEFAULT_MAX_LEN`].
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len.max(1);
        self
    }

    /// The stream's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key of the namespace's index snapshot.
    pub fn snapshot_key(&self) -> &str {
        &self.snapshot_key
    }

    /// A connection of its own for a slow command (snapshots), so the
    /// shared one is not held up and its short timeout does not apply.
    pub(crate) async fn slow_connection(&self, timeout: Duration) -> RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new().set_connection_timeout(Some(Duration::from_secs(1))).set_response_timeout(Some(timeout));
        self.client.get_multiplexed_async_connection_with_config(&config).await
    }

    /// Appends one batch; returns its position.
    pub async fn publish(&self, batch: &EventBatch) -> RedisResult<LogPosition> {
        let mut connection = self.publisher.clone();
        let id: String = redis::cmd("XADD")
            .arg(&self.key)
            .arg("MAXLEN")
            .arg("~")
            .arg(self.max_len)
            .arg("*")
            .arg("b")
            .arg(pb::EventBatch::from(batch).encode_to_vec())
            .query_async(&mut connection)
            .await?;
        id.parse().map_err(|error: crate::BadPosition| redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "XADD answered", error.to_string())))
    }

    /// A reader with its own connection (blocking reads would hold up
    /// everything else on a shared one).
    pub fn reader(&self) -> EventReader {
        EventReader { client: self.client.clone(), key: self.key.clone(), connection: None }
    }
}

/// Reads the stream in order.
pub struct EventReader {
    client: redis::Client,
    key: String,
    connection: Option<MultiplexedConnection>,
}

impl EventReader {
    /// Entries after `after` ([`LogPosition::START`] for all), waiting up to
    /// `block` for one to arrive; at most `count`. Each is (position,
    /// payload); payloads are the raw protobuf bytes.
    pub async fn read(&mut self, after: LogPosition, block: Duration, count: usize) -> RedisResult<Vec<(LogPosition, Vec<u8>)>> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(1)))
                    .set_response_timeout(Some(block + Duration::from_secs(2)));
                self.connection.insert(self.client.get_multiplexed_async_connection_with_config(&config).await?)
            }
        };
        let reply: RedisResult<Value> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.key)
            .arg(after.to_string())
            .query_async(connection)
            .await;
        match reply {
            Ok(value) => Ok(entries(value)),
            Err(error) => {
                // Reconnect on the next read.
                self.connection = None;
                Err(error)
            }
        }
    }
}

/// The entries of an `XREAD` reply for one stream (nil: none).
fn entries(reply: Value) -> Vec<(LogPosition, Vec<u8>)> {
    let streams = match reply {
        Value::Array(streams) => streams,
        Value::Map(pairs) => pairs.into_iter().map(|(key, entries)| Value::Array(vec![key, entries])).collect(),
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    for stream in streams {
        let Value::Array(mut parts) = stream else { continue };
        let Some(Value::Array(items)) = parts.pop() else { continue };
        for item in items {
            let Value::Array(mut pair) = item else {
                continue;
            };
            let (Some(fields), Some(id)) = (pair.pop(), pair.pop()) else {
                continue;
            };
            let Some(id) = text(id).and_then(|id| id.parse().ok()) else {
                continue;
            };
            let Value::Array(fields) = fields else {
                continue;
            };
            let payload = fields.chunks(2).find_map(|field| match field {
                [name, Value::BulkString(bytes)] if text(name.clone()).as_deref() == Some("b") => Some(bytes.clone()),
                _ => None,
            });
            // An entry without a payload still advances the reader.
            out.push((id, payload.unwrap_or_default()));
        }
    }
    out
}

fn text(value: Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes).ok(),
        Value::SimpleString(text) => Some(text),
        _ => None,
    }
}
