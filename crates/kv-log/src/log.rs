//! The Redis stream that carries the event batches.
//!
//! With an identity (the process's certificates) each entry is sealed by
//! its writer: besides the batch (`b`) it carries the SHA-256 of the
//! writer's certificate (`w`) and the signature scheme and signature over
//! the batch (`s`), and the writer stores its certificate once under that
//! fingerprint in `turbine:<namespace>:kv:writers`. Followers check each
//! entry ([`crate::follow`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prost::Message;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, RedisResult, Value};
use turbine_kv::EventBatch;
use turbine_proto::kvindex::v1 as pb;
use turbine_runtime::trust::{Trust, dialing_as};

use crate::LogPosition;

/// What an entry's seal signs begins with this (a seal made for anything
/// else never verifies as an event batch).
const SEALED_AS: &[u8] = b"turbine.kvlog.v1 event batch\n";

/// What the seal of an entry carrying `payload` signs.
pub fn sealed_bytes(payload: &[u8]) -> Vec<u8> {
    [SEALED_AS, payload].concat()
}

/// One entry of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Where it is.
    pub position: LogPosition,
    /// The batch (`turbine.kvindex.v1.EventBatch` protobuf; empty when the
    /// entry has none).
    pub payload: Vec<u8>,
    /// The SHA-256 of the writer's certificate (empty: not sealed).
    pub writer: Vec<u8>,
    /// The signature scheme (two bytes, big-endian) and the signature over
    /// [`sealed_bytes`] (empty: not sealed).
    pub signature: Vec<u8>,
}

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
    writers_key: String,
    max_len: usize,
    /// Seals entries written; followers require seals.
    trust: Option<Trust>,
    /// Whether this writer's certificate is stored (again after a failed
    /// publish: Redis may have restarted empty).
    announced: Arc<AtomicBool>,
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLog").field("key", &self.key).field("max_len", &self.max_len).finish()
    }
}

impl EventLog {
    /// The stream of `namespace` on the Redis at `url`; connects lazily, so
    /// it can be created while Redis is down. Entries are sealed and
    /// checked with the process's identity, if it has one (establish it
    /// first).
    pub fn new(url: &str, namespace: &str) -> RedisResult<Self> {
        let client = turbine_runtime::redis::client(url)?;
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
            writers_key: format!("turbine:{namespace}:kv:writers"),
            max_len: DEFAULT_MAX_LEN,
            trust: dialing_as(),
            announced: Arc::default(),
        })
    }

    /// The same log sealing and checking entries with `trust` (`None`:
    /// unsealed, none checked) instead of the process's identity.
    pub fn with_trust(mut self, trust: Option<Trust>) -> Self {
        self.trust = trust;
        self.announced = Arc::default();
        self
    }

    /// The identity entries are sealed and checked with.
    pub fn trust(&self) -> Option<&Trust> {
        self.trust.as_ref()
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

    /// Appends one batch (sealed, with an identity); returns its position.
    pub async fn publish(&self, batch: &EventBatch) -> RedisResult<LogPosition> {
        let mut connection = self.publisher.clone();
        let payload = pb::EventBatch::from(batch).encode_to_vec();
        let mut append = redis::cmd("XADD");
        append.arg(&self.key).arg("MAXLEN").arg("~").arg(self.max_len).arg("*").arg("b").arg(&payload);
        let id: String = match &self.trust {
            None => append.query_async(&mut connection).await?,
            Some(trust) => {
                let signer = trust.signer();
                let seal = signer
                    .seal(&sealed_bytes(&payload))
                    .map_err(|error| redis::RedisError::from((redis::ErrorKind::Client, "cannot seal the batch", format!("{error:#}"))))?;
                let signature = [&seal.scheme.to_be_bytes()[..], &seal.signature].concat();
                append.arg("w").arg(&signer.fingerprint()[..]).arg("s").arg(signature);
                let mut pipe = redis::pipe();
                if !self.announced.load(Ordering::Relaxed) {
                    pipe.cmd("HSET").arg(&self.writers_key).arg(&signer.fingerprint()[..]).arg(signer.certificate()).ignore();
                }
                pipe.add_command(append);
                match pipe.query_async::<(String,)>(&mut connection).await {
                    Ok((id,)) => {
                        self.announced.store(true, Ordering::Relaxed);
                        id
                    }
                    Err(error) => {
                        self.announced.store(false, Ordering::Relaxed);
                        return Err(error);
                    }
                }
            }
        };
        id.parse().map_err(|error: crate::BadPosition| redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "XADD answered", error.to_string())))
    }

    /// A reader with its own connection (blocking reads would hold up
    /// everything else on a shared one).
    pub fn reader(&self) -> EventReader {
        EventReader { client: self.client.clone(), key: self.key.clone(), writers_key: self.writers_key.clone(), connection: None }
    }
}

/// Reads the stream in order.
pub struct EventReader {
    client: redis::Client,
    key: String,
    writers_key: String,
    connection: Option<MultiplexedConnection>,
}

impl EventReader {
    /// The certificate (DER) a writer stored under `fingerprint`, if any.
    pub async fn writer_certificate(&mut self, fingerprint: &[u8]) -> RedisResult<Option<Vec<u8>>> {
        let mut connection =
            self.client.get_multiplexed_async_connection_with_config(&AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(2)))).await?;
        redis::cmd("HGET").arg(&self.writers_key).arg(fingerprint).query_async(&mut connection).await
    }

    /// Entries after `after` ([`LogPosition::START`] for all), waiting up to
    /// `block` for one to arrive; at most `count`.
    pub async fn read(&mut self, after: LogPosition, block: Duration, count: usize) -> RedisResult<Vec<LogEntry>> {
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
fn entries(reply: Value) -> Vec<LogEntry> {
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
            let field = |wanted: &str| {
                fields
                    .chunks(2)
                    .find_map(|field| match field {
                        [name, Value::BulkString(bytes)] if text(name.clone()).as_deref() == Some(wanted) => Some(bytes.clone()),
                        _ => None,
                    })
                    .unwrap_or_default()
            };
            // An entry without a payload still advances the reader.
            out.push(LogEntry { position: id, payload: field("b"), writer: field("w"), signature: field("s") });
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
