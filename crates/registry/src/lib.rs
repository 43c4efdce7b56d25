//! Where workers announce themselves and routers find them.
//!
//! A worker registers a [`WorkerRecord`] under a lease with a TTL and keeps
//! it alive with heartbeats (which also carry its latest load). A worker
//! that stops heartbeating disappears when its lease expires; one that
//! shuts down gracefully deregisters at once. Routers [`Registry::list`]
//! the live workers together with each lease's remaining time, so they can
//! drop a worker exactly when its lease runs out, between polls too.
//!
//! Two backends behind one type: [`MemoryRegistry`] for a single process
//! (`turbine run`) and [`RedisRegistry`] for distributed deployments (keys
//! namespaced as `turbine:<namespace>:workers:*`).

mod lease;
mod memory;
mod redis_backend;
mod restart;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use lease::Lease;
pub use memory::MemoryRegistry;
pub use redis_backend::{RedisRegistry, SignedRecord, signed_bytes};
pub use restart::RestartGrace;
use serde::{Deserialize, Serialize};
pub use turbine_kv::{CacheSalt, KvTenant, WorkerId};

/// A worker as registered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Unique, stable id.
    pub worker_id: WorkerId,
    /// gRPC endpoint (`http://host:port`).
    pub endpoint: String,
    /// Model served.
    pub model: String,
    /// Latest load reported with the heartbeat.
    #[serde(default)]
    pub load: WorkerLoad,
    /// Tokens per KV block of the worker's engine (0: unknown), the block
    /// size routers hash prompts in.
    #[serde(default)]
    pub kv_block_size: u32,
    /// Random per process start: a new value means the worker restarted
    /// (its KV cache and event numbering started over).
    #[serde(default)]
    pub instance: u64,
    /// The worker's part in disaggregated serving.
    #[serde(default)]
    pub role: WorkerRole,
    /// What reading a prefix from its lower tiers costs, as the worker
    /// measured it (routers credit a hit there by what reading it saves).
    #[serde(default, skip_serializing_if = "ReadCosts::is_unmeasured")]
    pub read_costs: ReadCosts,
    /// The shared kv-store the worker reads prefixes from, when that store
    /// announces its blocks: routers credit them to this worker as tier
    /// remote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_store: Option<KvStoreRef>,
    /// Its engine keeps one cache for every request and cannot keep a
    /// namespace's cached prompts apart (an engine behind the plain OpenAI
    /// API): routers send it only requests of the shared namespace, never
    /// a tenant's or a client's `cache_salt`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_cache_only: bool,
    /// The output formats its engine holds output to: routers send it
    /// only requests it keeps to. A record without it (written before
    /// workers announced them) holds text only.
    #[serde(default, skip_serializing_if = "OutputFormats::is_text_only")]
    pub output_formats: OutputFormats,
}

/// A kv-store as a worker reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvStoreRef {
    /// The store's blocks of the worker's layout, as the KV index names
    /// them ([`WorkerId::of_store`]).
    pub name: WorkerId,
    /// Where the store answers (`http://host:port`), e.g. for a dump of
    /// what it holds.
    pub endpoint: String,
}

/// Reading KV blocks from one tier, in blocks of compute: reading `n`
/// blocks takes as long as computing `fixed_blocks + per_block · n` blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ReadCost {
    /// The read's round trip.
    pub fixed_blocks: f32,
    /// Each block's transfer (below 1: reading beats computing).
    pub per_block: f32,
}

impl ReadCost {
    /// Blocks of compute by which a read of `blocks` lengthens a request's
    /// wait when `ahead` blocks of prefill are queued before it on the
    /// worker: the read runs beside that queue, so only what it takes
    /// beyond it counts.
    pub fn added_wait(&self, blocks: f64, ahead: f64) -> f64 {
        (f64::from(self.fixed_blocks) + f64::from(self.per_block) * blocks - ahead).max(0.0)
    }
}

/// A worker's measured read costs per lower tier (None: not measured).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ReadCosts {
    /// Its host memory (G2): the copy into the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<ReadCost>,
    /// Its local disk (G3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<ReadCost>,
    /// The shared store (G4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<ReadCost>,
}

impl ReadCosts {
    /// Nothing measured.
    pub fn is_unmeasured(&self) -> bool {
        self.host.is_none() && self.disk.is_none() && self.remote.is_none()
    }
}

pub use turbine_api::Load as WorkerLoad;
pub use turbine_api::WorkerRole;
pub use turbine_api::{FormatKind, OutputFormats};

/// A registered worker and when its lease runs out.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveWorker {
    /// The record.
    pub record: WorkerRecord,
    /// The instant (local clock) its lease expires unless renewed.
    pub expires_at: Instant,
    /// The KV tenants the certificate that sealed the record limits the
    /// worker to (`turbine certs --worker-tenant`); `None`: any tenant
    /// (an unlimited certificate, or records read without an identity).
    /// Read from the seal, never from the record: a worker cannot widen
    /// its own.
    pub kv_tenants: Option<Arc<[KvTenant]>>,
}

impl LiveWorker {
    /// A worker of `record` whose lease ends at `expires_at`, for any
    /// tenant.
    pub fn new(record: WorkerRecord, expires_at: Instant) -> Self {
        Self { record, expires_at, kv_tenants: None }
    }

    /// Whether the worker may hold `tenant`'s blocks (and so serve its
    /// requests).
    pub fn serves_tenant(&self, tenant: KvTenant) -> bool {
        self.kv_tenants.as_deref().is_none_or(|tenants| tenants.contains(&tenant))
    }

    /// Whether the worker keeps requests of `salt` apart in its cache:
    /// any namespace, unless its engine shares one cache among all
    /// ([`WorkerRecord::shared_cache_only`]), which keeps only the shared
    /// namespace's.
    pub fn keeps_apart(&self, salt: CacheSalt) -> bool {
        salt.is_shared() || !self.record.shared_cache_only
    }

    /// Whether the worker's engine keeps output to `kind` (from output
    /// begun on another worker, when `continued`).
    pub fn holds(&self, kind: FormatKind, continued: bool) -> bool {
        self.record.output_formats.holds(kind, continued)
    }
}

/// Registry failures.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Redis refused or could not be reached.
    #[error("registry backend unavailable: {0}")]
    Unavailable(String),
}

impl From<redis::RedisError> for RegistryError {
    fn from(error: redis::RedisError) -> Self {
        RegistryError::Unavailable(error.to_string())
    }
}

/// Result alias of this crate.
pub type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// A worker registry: in memory or in Redis.
#[derive(Debug, Clone)]
pub enum Registry {
    /// One process.
    Memory(MemoryRegistry),
    /// Shared through Redis.
    Redis(RedisRegistry),
}

impl Registry {
    /// Registers or refreshes a worker for `ttl`.
    pub async fn put(&self, record: &WorkerRecord, ttl: Duration) -> Result<()> {
        match self {
            Registry::Memory(registry) => {
                registry.put(record, ttl);
                Ok(())
            }
            Registry::Redis(registry) => registry.put(record, ttl).await,
        }
    }

    /// Removes a worker at once.
    pub async fn remove(&self, worker_id: &str) -> Result<()> {
        match self {
            Registry::Memory(registry) => {
                registry.remove(worker_id);
                Ok(())
            }
            Registry::Redis(registry) => registry.remove(worker_id).await,
        }
    }

    /// Every worker whose lease has not expired, ordered by id.
    pub async fn list(&self) -> Result<Vec<LiveWorker>> {
        match self {
            Registry::Memory(registry) => Ok(registry.list()),
            Registry::Redis(registry) => registry.list().await,
        }
    }

    /// Identifies the backend's current incarnation: it changes when the
    /// Redis server restarts (and may have lost every record, so workers
    /// missing from the next listings may only be about to re-register).
    /// `None` for the in-memory registry.
    pub async fn generation(&self) -> Result<Option<String>> {
        match self {
            Registry::Memory(_) => Ok(None),
            Registry::Redis(registry) => registry.generation().await,
        }
    }

    /// Checks that the backend answers.
    pub async fn ping(&self) -> Result<()> {
        match self {
            Registry::Memory(_) => Ok(()),
            Registry::Redis(registry) => registry.ping().await,
        }
    }

    /// A short description for logs.
    pub fn describe(&self) -> String {
        match self {
            Registry::Memory(_) => "in-memory".to_owned(),
            Registry::Redis(registry) => format!("redis namespace {}", registry.namespace()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_costs_are_optional_in_a_record() {
        // A record from a worker that measured nothing (or predates them).
        let old = r#"{"worker_id":"w","endpoint":"http://w","model":"m"}"#;
        let record: WorkerRecord = serde_json::from_str(old).unwrap();
        assert!(record.read_costs.is_unmeasured());
        assert!(!serde_json::to_string(&record).unwrap().contains("read_costs"), "nothing measured, nothing written");
        let measured = WorkerRecord { read_costs: ReadCosts { disk: Some(ReadCost { fixed_blocks: 0.5, per_block: 0.25 }), ..ReadCosts::default() }, ..record };
        let again: WorkerRecord = serde_json::from_str(&serde_json::to_string(&measured).unwrap()).unwrap();
        assert_eq!(again, measured);
        assert_eq!(ReadCost { fixed_blocks: 0.5, per_block: 0.25 }.added_wait(10.0, 0.0), 3.0);
        assert_eq!(ReadCost { fixed_blocks: 0.5, per_block: 0.25 }.added_wait(10.0, 2.0), 1.0);
        assert_eq!(ReadCost { fixed_blocks: 0.0, per_block: 2.0 }.added_wait(10.0, 30.0), 0.0, "hidden by the queue ahead");
    }

    #[test]
    fn a_record_without_the_flag_keeps_namespaces_apart() {
        let old: WorkerRecord = serde_json::from_str(r#"{"worker_id":"w","endpoint":"http://w","model":"m"}"#).unwrap();
        let tenant = CacheSalt::of(&["tenant", "acme"]);
        let live = LiveWorker::new(old.clone(), Instant::now());
        assert!(live.keeps_apart(tenant) && live.keeps_apart(CacheSalt::SHARED));
        assert!(!serde_json::to_string(&old).unwrap().contains("shared_cache_only"), "the default is not written");
        let sharing = WorkerRecord { shared_cache_only: true, ..old };
        let again: WorkerRecord = serde_json::from_str(&serde_json::to_string(&sharing).unwrap()).unwrap();
        assert_eq!(again, sharing);
        let live = LiveWorker::new(again, Instant::now());
        assert!(!live.keeps_apart(tenant) && live.keeps_apart(CacheSalt::SHARED));
    }

    #[test]
    fn a_record_without_formats_holds_text_only() {
        let old: WorkerRecord = serde_json::from_str(r#"{"worker_id":"w","endpoint":"http://w","model":"m"}"#).unwrap();
        let live = LiveWorker::new(old.clone(), Instant::now());
        assert!(live.holds(FormatKind::Text, false) && live.holds(FormatKind::Text, true));
        assert!(!live.holds(FormatKind::JsonObject, false) && !live.holds(FormatKind::JsonSchema, false));
        assert!(!serde_json::to_string(&old).unwrap().contains("output_formats"), "the default is not written");
        // An engine behind an adapter: both formats, from the first token only.
        let external =
            WorkerRecord { output_formats: OutputFormats { json_object: true, json_schema: true, json_schema_core: false, resumes: false }, ..old.clone() };
        let again: WorkerRecord = serde_json::from_str(&serde_json::to_string(&external).unwrap()).unwrap();
        assert_eq!(again, external);
        let live = LiveWorker::new(again, Instant::now());
        assert!(live.holds(FormatKind::JsonSchema, false) && live.holds(FormatKind::JsonObject, false));
        assert!(!live.holds(FormatKind::JsonObject, true), "it cannot go on from an object begun elsewhere");
        // The native engine: objects and core schemas, resumed too.
        let native = WorkerRecord { output_formats: OutputFormats { json_object: true, json_schema: false, json_schema_core: true, resumes: true }, ..old };
        let live = LiveWorker::new(native, Instant::now());
        assert!(live.holds(FormatKind::JsonObject, true) && live.holds(FormatKind::JsonSchema, true));
        // A field a newer worker writes is no reason to drop its record.
        let newer: WorkerRecord =
            serde_json::from_str(r#"{"worker_id":"w","endpoint":"http://w","model":"m","output_formats":{"json_object":true,"regex":true}}"#).unwrap();
        assert!(newer.output_formats.json_object && !newer.output_formats.json_schema);
    }
}
