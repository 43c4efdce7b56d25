//! The Redis registry.
//!
//! Layout, under `turbine:<namespace>:`:
//! - `workers:<id>`: the record as JSON, with a TTL equal to the lease;
//! - `workers`: a set of registered ids, so listing needs no `SCAN`.
//!
//! Listing reads the set, then each record and its remaining TTL in one
//! pipeline; ids whose record expired are removed from the set.
//!
//! With an identity (the process's certificates, [`dialing_as`]) a record
//! is written sealed by the worker's certificate key, with the time it
//! expires ([`SignedRecord`]), and a reader keeps only records sealed by a
//! worker certificate of the deployment's CA naming the record's worker id,
//! not past their expiry: a client that can write to Redis but holds no
//! worker's key can add no worker, move none to another endpoint, and
//! replay none past its lease. Records a reader refuses are skipped and
//! counted (`turbine_registry_refused_records_total{reason}`), as are
//! records that do not parse; the others are listed.
//!
//! Without an identity (plaintext, for development) records are written
//! bare and every record that parses is listed.

use std::time::{Duration, Instant};

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::IntCounterVec;
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use turbine_runtime::signed::Seal;
use turbine_runtime::trust::{Trust, dialing_as};

use crate::{KvTenant, LiveWorker, RegistryError, Result, WorkerRecord};

/// What a sealed record's signature covers begins with this (a seal made
/// for anything else never verifies as a registry record).
const SEALED_AS: &str = "turbine.registry.v1 worker record";

/// How far a reader's clock may run ahead of a writer's before a record
/// reads as expired.
const CLOCK_SKEW_MS: u64 = 10_000;

static REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    turbine_runtime::metrics::counter(
        "turbine_registry_refused_records_total",
        "Worker records in the registry a reader skipped, by reason: unsigned (no seal, where readers require one), untrusted (a certificate the CA did not sign, or not valid now), bad_signature (the record was altered, or sealed by another key), wrong_writer (sealed by a certificate that is not this worker's), expired (replayed past its lease), corrupt (does not parse, or stored under another worker's key)",
        &["reason"],
    )
});

/// A record as stored when the writer has an identity.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SignedRecord {
    /// The [`WorkerRecord`] as JSON.
    pub record: String,
    /// When the record stops being valid (milliseconds since the Unix
    /// epoch): the end of the lease it was written with.
    pub expires_unix_ms: u64,
    /// The writer's seal over [`signed_bytes`].
    pub seal: Seal,
}

/// What a record's seal signs: the domain, the expiry and the record.
pub fn signed_bytes(record: &str, expires_unix_ms: u64) -> Vec<u8> {
    format!("{SEALED_AS}\n{expires_unix_ms}\n{record}").into_bytes()
}

/// Whether a record sealed to expire at `expires_unix_ms` still stands.
fn fresh(expires_unix_ms: u64) -> std::result::Result<(), (Refusal, String)> {
    let now = unix_ms();
    if now > expires_unix_ms + CLOCK_SKEW_MS {
        return Err((Refusal::Expired, format!("expired {} ms ago", now - expires_unix_ms)));
    }
    Ok(())
}

/// `record` if it is stored under its own worker's key.
fn filed_under(record: WorkerRecord, id: &str) -> std::result::Result<WorkerRecord, (Refusal, String)> {
    if record.worker_id.as_str() == id {
        Ok(record)
    } else {
        Err((Refusal::Corrupt, format!("the record of worker {:?} is stored under another worker's key", record.worker_id.as_str())))
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis() as u64)
}

/// Why a reader skipped a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Unsigned,
    Untrusted,
    BadSignature,
    WrongWriter,
    Expired,
    Corrupt,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Self::Unsigned => "unsigned",
            Self::Untrusted => "untrusted",
            Self::BadSignature => "bad_signature",
            Self::WrongWriter => "wrong_writer",
            Self::Expired => "expired",
            Self::Corrupt => "corrupt",
        }
    }
}

/// A registry shared through Redis.
#[derive(Clone)]
pub struct RedisRegistry {
    connection: ConnectionManager,
    namespace: String,
    prefix: String,
    /// Seals records written, and requires seals on records read.
    trust: Option<Trust>,
    /// The sealed records last read and taken, by worker id: a record
    /// unchanged since the last poll is not verified again (its expiry is).
    verified: Arc<Mutex<HashMap<String, Verified>>>,
}

/// A sealed record read and taken: the stored value, its expiry, it and
/// the tenants its sealing certificate allows.
type Verified = (String, u64, Taken);

/// A record a reader takes, and the KV tenants the certificate that sealed
/// it limits its worker to (`None`: any).
type Taken = (WorkerRecord, Option<Arc<[KvTenant]>>);

impl std::fmt::Debug for RedisRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisRegistry").field("namespace", &self.namespace).finish()
    }
}

impl RedisRegistry {
    /// Connects lazily to `url` (`redis://host:port/db`): the registry can be
    /// created while Redis is down and starts working when it answers.
    /// Records are sealed and checked with the process's identity, if it
    /// has one ([`dialing_as`]; establish it first).
    pub fn new(url: &str, namespace: &str) -> Result<Self> {
        let client = turbine_runtime::redis::client(url).map_err(|error| RegistryError::Unavailable(format!("bad Redis URL {url:?}: {error}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let connection = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Self { connection, namespace: namespace.to_owned(), prefix: format!("turbine:{namespace}:workers"), trust: dialing_as(), verified: Arc::default() })
    }

    /// The same registry sealing and checking records with `trust` (`None`:
    /// bare records, none checked) instead of the process's identity.
    pub fn with_trust(mut self, trust: Option<Trust>) -> Self {
        self.trust = trust;
        self
    }

    /// The key namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn record_key(&self, worker_id: &str) -> String {
        format!("{}:{worker_id}", self.prefix)
    }

    pub(crate) async fn put(&self, record: &WorkerRecord, ttl: Duration) -> Result<()> {
        let mut json = serde_json::to_string(record).expect("records serialize");
        let ttl_ms = ttl.as_millis().max(1) as u64;
        if let Some(trust) = &self.trust {
            let expires_unix_ms = unix_ms() + ttl_ms;
            let seal = trust
                .signer()
                .seal(&signed_bytes(&json, expires_unix_ms))
                .map_err(|error| RegistryError::Unavailable(format!("cannot seal the record: {error:#}")))?;
            json = serde_json::to_string(&SignedRecord { record: json, expires_unix_ms, seal }).expect("records serialize");
        }
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
                Some(json) if ttl_ms > 0 => match self.read(&id, json).and_then(|(record, kv_tenants)| Ok((filed_under(record, &id)?, kv_tenants))) {
                    Ok((record, kv_tenants)) => live.push(LiveWorker { record, expires_at: asked_at + Duration::from_millis(ttl_ms as u64), kv_tenants }),
                    Err((refusal, why)) => {
                        REFUSED.with_label_values(&[refusal.as_str()]).inc();
                        tracing::warn!(key = self.record_key(&id), reason = refusal.as_str(), why, "worker record skipped");
                    }
                },
                _ => expired.push(id),
            }
        }
        if !expired.is_empty() {
            let _: redis::RedisResult<()> = connection.srem(&self.prefix, &expired).await;
        }
        self.verified.lock().retain(|id, _| live.iter().any(|worker| worker.record.worker_id.as_str() == id));
        Ok(live)
    }

    /// The record stored as `json` under `id`, if this reader takes it.
    fn read(&self, id: &str, json: String) -> std::result::Result<Taken, (Refusal, String)> {
        if self.trust.is_none() {
            return self.check(&json);
        }
        if let Some((value, expires_unix_ms, taken)) = self.verified.lock().get(id)
            && *value == json
        {
            return fresh(*expires_unix_ms).map(|()| taken.clone());
        }
        let taken = self.check(&json)?;
        let expires_unix_ms = serde_json::from_str::<SignedRecord>(&json).map_or(0, |signed| signed.expires_unix_ms);
        self.verified.lock().insert(id.to_owned(), (json, expires_unix_ms, taken.clone()));
        Ok(taken)
    }

    /// The record stored as `json`, if this reader takes it, and the
    /// tenants its seal allows.
    fn check(&self, json: &str) -> std::result::Result<Taken, (Refusal, String)> {
        let corrupt = |error: serde_json::Error| (Refusal::Corrupt, error.to_string());
        let signed = serde_json::from_str::<SignedRecord>(json).ok();
        let Some(trust) = &self.trust else {
            let json = signed.as_ref().map_or(json, |signed| signed.record.as_str());
            return Ok((serde_json::from_str(json).map_err(corrupt)?, None));
        };
        let Some(signed) = signed else {
            let unsigned = serde_json::from_str::<WorkerRecord>(json).map_err(corrupt)?;
            return Err((Refusal::Unsigned, format!("{:?} is not sealed by a worker's certificate", unsigned.worker_id.as_str())));
        };
        let writer = trust.verifier().verify(&signed_bytes(&signed.record, signed.expires_unix_ms), &signed.seal).map_err(|error| {
            let refusal = match error {
                turbine_runtime::signed::SealError::BadSignature => Refusal::BadSignature,
                _ => Refusal::Untrusted,
            };
            (refusal, error.to_string())
        })?;
        let record: WorkerRecord = serde_json::from_str(&signed.record).map_err(corrupt)?;
        if !writer.is_worker(record.worker_id.as_str()) {
            return Err((Refusal::WrongWriter, format!("{writer} sealed the record of worker {:?}", record.worker_id.as_str())));
        }
        fresh(signed.expires_unix_ms)?;
        let kv_tenants = writer.kv_tenants.map(|tenants| tenants.iter().copied().map(KvTenant::new).collect());
        Ok((record, kv_tenants))
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
