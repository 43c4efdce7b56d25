//! API keys: who may call the public API (REST and gRPC `Inference`), and
//! as which tenant.
//!
//! Keys are stored as SHA-256 digests only, in a TOML file the operator
//! writes (`turbine keys new` prints a key and its entry):
//!
//! ```toml
//! [[keys]]
//! name = "acme-prod"      # in logs and metrics (never the key)
//! tenant = "acme"         # whose prompt cache the requests use
//! sha256 = "9f86d0...."   # hex digest of the key
//! # share_prefixes = "public"  # opt in: a named cache shared by every key that names it
//! # requests_per_minute = 600   # limits, each optional: 429 with Retry-After beyond
//! # tokens_per_minute = 200000  #   (prompt and completion tokens)
//! # max_concurrent = 16         #   (requests in flight)
//! # expires_at = 2027-01-01T00:00:00Z  # refused from then on (a date-time with its offset)
//! ```
//!
//! A caller sends `Authorization: Bearer <key>`. With keys configured, a
//! request without one, or with one not in the file, is refused (401,
//! gRPC UNAUTHENTICATED) before anything else is read.
//!
//! The file is read again when it changes ([`KeyRing`]): a key added
//! answers, a key removed is refused from then on (its requests in flight
//! finish), without a restart; a key kept as it was keeps what it used of
//! its limits. A changed file that does not parse changes nothing.
//!
//! Limits hold per gateway process, and with Redis ([`SharedBuckets`],
//! the gateway's `--redis`) across every gateway of the namespace too (the
//! per-minute buckets and the places of the concurrency limit): a key
//! behind three gateways gets its limit, not three times it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use std::time::Instant;

use parking_lot::Mutex;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{ErrorKind, GatewayError};
use crate::pipeline::Namespace;

mod shared;
pub mod table;

use shared::{Admitted, SharedLimits};
pub use shared::{SharedBuckets, SharedPlace};
pub use table::{KeyEntry, KeyTable, StoredKey, TableError};

/// One key's entry in the keys file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeySpec {
    name: String,
    tenant: String,
    sha256: String,
    #[serde(default)]
    share_prefixes: Option<String>,
    #[serde(default)]
    requests_per_minute: Option<u32>,
    #[serde(default)]
    tokens_per_minute: Option<u64>,
    #[serde(default)]
    max_concurrent: Option<u32>,
    /// When it stops authenticating, Unix milliseconds (in a file,
    /// `expires_at`: a TOML date-time with its offset).
    #[serde(default, rename = "expires_at", deserialize_with = "expiry")]
    expires_at_unix_ms: Option<i64>,
}

/// A file's `expires_at` as Unix milliseconds.
fn expiry<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<i64>, D::Error> {
    let at = toml::value::Datetime::deserialize(deserializer)?;
    unix_ms(&at).map(Some).map_err(serde::de::Error::custom)
}

/// `text`, an RFC 3339 date-time with its offset (`2027-01-01T00:00:00Z`,
/// as a keys file's `expires_at` holds it), as Unix milliseconds.
pub fn expiry_of(text: &str) -> Result<i64, String> {
    let at: toml::value::Datetime = text.trim().parse().map_err(|error| format!("{text:?} is no date-time: {error}"))?;
    unix_ms(&at)
}

/// A TOML date-time as Unix milliseconds: it needs a date, a time and
/// an offset (a local time names no instant).
fn unix_ms(at: &toml::value::Datetime) -> Result<i64, String> {
    let (Some(date), Some(time), Some(offset)) = (at.date, at.time, at.offset) else {
        return Err(format!("expires_at {at}: give a date, a time and an offset, as 2027-01-01T00:00:00Z"));
    };
    // Days since 1970-01-01 of a civil date (proleptic Gregorian), the
    // year starting in March so that the leap day ends it.
    let (month, day) = (i64::from(date.month), i64::from(date.day));
    let year = i64::from(date.year) - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    let offset_minutes = match offset {
        toml::value::Offset::Z => 0,
        toml::value::Offset::Custom { minutes } => i64::from(minutes),
    };
    let seconds = days * 86_400 + i64::from(time.hour) * 3_600 + i64::from(time.minute) * 60 + i64::from(time.second) - offset_minutes * 60;
    Ok(seconds * 1_000 + i64::from(time.nanosecond / 1_000_000))
}

/// Now, as Unix milliseconds (what expiries and a table's times are
/// read against).
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_millis() as i64)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<KeySpec>,
}

/// An authenticated caller: the key's entry.
#[derive(Debug)]
pub struct ApiKey {
    /// The key's name (for logs and metrics).
    pub name: String,
    /// Its tenant.
    pub tenant: String,
    /// The prompt-cache namespace its requests use.
    pub namespace: Namespace,
    /// Its limits and what it used of them.
    limits: Limits,
    /// What its entry says beyond its digest: an entry read again alike
    /// keeps this key, and what it used of its limits.
    spec: KeySpec,
    /// Its digest, hex: its buckets' name in Redis.
    digest: String,
    /// The limits every gateway of the namespace shares (per-minute
    /// buckets and concurrency places), if any.
    shared: std::sync::OnceLock<Arc<SharedBuckets>>,
}

/// Keys are told apart by name (unique in a keys file) and tenant.
impl PartialEq for ApiKey {
    fn eq(&self, other: &Self) -> bool {
        (&self.name, &self.tenant) == (&other.name, &other.tenant)
    }
}

impl Eq for ApiKey {}

/// A key's limits: requests and tokens (prompt and completion) per
/// minute as token buckets holding a minute's worth, and requests at once.
#[derive(Debug, Default)]
struct Limits {
    requests: Option<Mutex<Bucket>>,
    tokens: Option<Mutex<Bucket>>,
    concurrent: Option<Arc<Semaphore>>,
    max_concurrent: u32,
}

/// A bucket of `per_minute` refilled continuously, at most a minute's
/// worth held; it may run into debt (tokens are charged after the fact).
#[derive(Debug)]
struct Bucket {
    per_minute: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: f64) -> Self {
        Self { per_minute, level: per_minute, at: Instant::now() }
    }

    fn refill(&mut self, now: Instant) {
        let rate = self.per_minute / 60.0;
        self.level = (self.level + now.saturating_duration_since(self.at).as_secs_f64() * rate).min(self.per_minute);
        self.at = now;
    }

    /// Takes `amount` if the bucket holds it; else the seconds until it
    /// would (at least 1).
    fn take(&mut self, amount: f64, now: Instant) -> Result<(), u64> {
        self.refill(now);
        if self.level >= amount {
            self.level -= amount;
            return Ok(());
        }
        Err(((amount - self.level) / (self.per_minute / 60.0)).ceil().max(1.0) as u64)
    }

    /// Seconds until the bucket is out of debt (0: it is).
    fn wait(&mut self, now: Instant) -> u64 {
        self.refill(now);
        if self.level > 0.0 { 0 } else { ((0.0 - self.level + 1.0) / (self.per_minute / 60.0)).ceil().max(1.0) as u64 }
    }

    fn charge(&mut self, amount: f64, now: Instant) {
        self.refill(now);
        self.level -= amount;
    }
}

/// A request's place in its key's concurrency limit, held until it ends:
/// in this gateway, and across the namespace's gateways when they share
/// limits.
#[derive(Debug)]
pub struct KeyPermit {
    _permit: Option<OwnedSemaphorePermit>,
    _shared: Option<SharedPlace>,
}

/// The 429 message of a key at its concurrency limit.
fn concurrency_message(name: &str, limit: u32) -> String {
    format!("Key {name:?} has {limit} requests in flight, its limit; try again when one ends.")
}

impl ApiKey {
    /// Admits one more request of this key, or 429 naming the limit it
    /// reached, with when to retry: its concurrency limit, its requests
    /// per minute, or its tokens per minute (spent: prompts and
    /// completions are charged as they are known, see [`charge`]).
    ///
    /// [`charge`]: Self::charge
    pub async fn admit(&self) -> Result<KeyPermit, GatewayError> {
        let mut permit = self.admit_here()?;
        let Some(shared) = self.shared.get() else { return Ok(permit) };
        // Then the limits every gateway shares, in one call (this
        // process's allowed it, so only another gateway's use can refuse
        // it here).
        let limits = SharedLimits {
            tokens_per_minute: self.spec.tokens_per_minute,
            requests_per_minute: self.spec.requests_per_minute,
            max_concurrent: self.spec.max_concurrent,
        };
        if limits.tokens_per_minute.is_none() && limits.requests_per_minute.is_none() && limits.max_concurrent.is_none() {
            return Ok(permit);
        }
        match shared.admit(&self.digest, limits).await {
            Admitted::Yes(place) => permit._shared = place,
            Admitted::Refused { limit: "concurrency", .. } => {
                return self.refuse("concurrency", 1, concurrency_message(&self.name, self.spec.max_concurrent.unwrap_or(0)));
            }
            Admitted::Refused { limit, wait } => {
                let per = if limit == "tokens" { "tokens" } else { "requests" };
                return self.refuse(limit, wait, format!("Rate limit reached for key {:?} on {per} per minute; try again in {wait}s.", self.name));
            }
            Admitted::Unanswered => {}
        }
        Ok(permit)
    }

    fn refuse<T>(&self, limit: &'static str, retry_after: u64, message: String) -> Result<T, GatewayError> {
        crate::metrics::rate_limited(limit);
        tracing::info!(key = %self.name, tenant = %self.tenant, limit, retry_after, "a key over its limit");
        Err(GatewayError::rate_limited(message, retry_after))
    }

    /// [`admit`](Self::admit) by this process's own buckets and places.
    fn admit_here(&self) -> Result<KeyPermit, GatewayError> {
        let now = Instant::now();
        let refuse = |limit: &'static str, retry_after: u64, message: String| self.refuse(limit, retry_after, message);
        if let Some(tokens) = &self.limits.tokens {
            let wait = tokens.lock().wait(now);
            if wait > 0 {
                return refuse("tokens", wait, format!("Rate limit reached for key {:?} on tokens per minute; try again in {wait}s.", self.name));
            }
        }
        let permit = match &self.limits.concurrent {
            Some(semaphore) => match semaphore.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => return refuse("concurrency", 1, concurrency_message(&self.name, self.limits.max_concurrent)),
            },
            None => None,
        };
        if let Some(requests) = &self.limits.requests
            && let Err(wait) = requests.lock().take(1.0, now)
        {
            return refuse("requests", wait, format!("Rate limit reached for key {:?} on requests per minute; try again in {wait}s.", self.name));
        }
        Ok(KeyPermit { _permit: permit, _shared: None })
    }

    /// Charges `tokens` (prompt or completion) to its tokens per minute
    /// (the shared bucket's charge is sent, not awaited).
    pub fn charge(&self, tokens: u32) {
        if let Some(bucket) = &self.limits.tokens {
            bucket.lock().charge(f64::from(tokens), Instant::now());
        }
        if let (Some(shared), Some(per_minute), Ok(runtime)) = (self.shared.get(), self.spec.tokens_per_minute, tokio::runtime::Handle::try_current()) {
            let (shared, digest) = (shared.clone(), self.digest.clone());
            runtime.spawn(async move { shared.charge(&digest, per_minute, tokens).await });
        }
    }
}

/// The keys a gateway accepts, by digest.
#[derive(Debug, Default)]
pub struct ApiKeys {
    by_digest: HashMap<[u8; 32], Arc<ApiKey>>,
}

/// Why a call was not authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header (or metadata).
    Missing,
    /// A key not in the file.
    Unknown,
    /// A key past its `expires_at`.
    Expired,
}

impl AuthError {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::Unknown => "unknown",
            AuthError::Expired => "expired",
        }
    }
}

impl From<AuthError> for GatewayError {
    fn from(error: AuthError) -> Self {
        crate::metrics::unauthenticated(error.label());
        let message = match error {
            AuthError::Missing => "You didn't provide an API key. Send it in an Authorization header: `Authorization: Bearer YOUR_KEY`.",
            AuthError::Unknown => "Incorrect API key provided.",
            AuthError::Expired => "The API key provided has expired: ask for a new one.",
        };
        GatewayError::new(ErrorKind::Unauthenticated, message)
    }
}

/// A new key: `tk_` and 64 hex digits of a CSPRNG (256 bits).
pub fn new_key() -> String {
    format!("tk_{}", hex::encode(rand::random::<[u8; 32]>()))
}

/// The keys-file entry of `key` (its digest, never the key).
pub fn entry(name: &str, tenant: &str, share_prefixes: Option<&str>, key: &str) -> String {
    let quote = |text: &str| toml::Value::String(text.to_owned()).to_string();
    let mut entry = format!("[[keys]]\nname = {}\ntenant = {}\nsha256 = {}\n", quote(name), quote(tenant), quote(&digest_hex(key)));
    if let Some(shared) = share_prefixes {
        entry.push_str(&format!("share_prefixes = {}\n", quote(shared)));
    }
    entry
}

/// The hex SHA-256 digest of `key`, as the keys file stores it.
pub fn digest_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

impl ApiKeys {
    /// The keys in the TOML file at `path`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|error| anyhow::anyhow!("cannot read the API keys file {}: {error}", path.display()))?;
        Self::parse(&text).map_err(|error| anyhow::anyhow!("the API keys file {}: {error}", path.display()))
    }

    /// The keys in TOML `text`: every entry named, with a tenant and a
    /// 64-hex-digit digest; no digest or name twice.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: KeysFile = toml::from_str(text).map_err(|error| error.to_string())?;
        let keys = Self::from_specs(file.keys)?;
        if keys.by_digest.is_empty() {
            return Err("no keys: with an API keys file every call needs one of its keys".into());
        }
        Ok(keys)
    }

    /// The keys of `specs` (a file's entries or a table's rows), checked
    /// alike; none is no error here.
    fn from_specs(specs: Vec<KeySpec>) -> Result<Self, String> {
        let mut keys = Self::default();
        let mut names = std::collections::HashSet::new();
        for (number, spec) in specs.into_iter().enumerate() {
            let label = spec.name.clone();
            let at = |message: String| format!("keys[{number}] ({label:?}): {message}");
            if spec.name.trim().is_empty() || spec.tenant.trim().is_empty() {
                return Err(at("name and tenant must not be empty".into()));
            }
            let digest: [u8; 32] = hex::decode(spec.sha256.trim())
                .ok()
                .and_then(|bytes| bytes.try_into().ok())
                .ok_or_else(|| at("sha256 must be 64 hex digits (the key's SHA-256; `turbine keys new` prints it)".into()))?;
            if !names.insert(spec.name.clone()) {
                return Err(at("another key has this name".into()));
            }
            let namespace = match &spec.share_prefixes {
                Some(shared) if shared.trim().is_empty() => return Err(at("share_prefixes must not be empty".into())),
                Some(shared) => Namespace::Shared(shared.clone()),
                None => Namespace::Tenant(spec.tenant.clone()),
            };
            let positive = |value: Option<u64>, field: &str| match value {
                Some(0) => Err(at(format!("{field} must be positive (leave it out for no limit)"))),
                other => Ok(other),
            };
            let requests = positive(spec.requests_per_minute.map(u64::from), "requests_per_minute")?;
            let tokens = positive(spec.tokens_per_minute, "tokens_per_minute")?;
            let concurrent = positive(spec.max_concurrent.map(u64::from), "max_concurrent")?;
            let limits = Limits {
                requests: requests.map(|per_minute| Mutex::new(Bucket::new(per_minute as f64))),
                tokens: tokens.map(|per_minute| Mutex::new(Bucket::new(per_minute as f64))),
                concurrent: concurrent.map(|limit| Arc::new(Semaphore::new(limit as usize))),
                max_concurrent: concurrent.unwrap_or(0) as u32,
            };
            let key = ApiKey {
                name: spec.name.clone(),
                tenant: spec.tenant.clone(),
                namespace,
                limits,
                digest: hex::encode(digest),
                spec,
                shared: std::sync::OnceLock::new(),
            };
            if keys.by_digest.insert(digest, Arc::new(key)).is_some() {
                return Err(at("another key has this digest".into()));
            }
        }
        Ok(keys)
    }

    /// Accepts `key` too, as the running process's own (name and tenant
    /// `turbine-internal`: a cache of its own).
    pub fn add_own(&mut self, key: &str) {
        let own = ApiKey {
            name: "turbine-internal".into(),
            tenant: "turbine-internal".into(),
            namespace: Namespace::Tenant("turbine-internal".into()),
            limits: Limits::default(),
            spec: KeySpec {
                name: "turbine-internal".into(),
                tenant: "turbine-internal".into(),
                sha256: String::new(),
                share_prefixes: None,
                requests_per_minute: None,
                tokens_per_minute: None,
                max_concurrent: None,
                expires_at_unix_ms: None,
            },
            digest: String::new(),
            shared: std::sync::OnceLock::new(),
        };
        self.by_digest.insert(Sha256::digest(key.as_bytes()).into(), Arc::new(own));
    }

    /// Has every key's per-minute limits shared through `buckets`.
    pub fn share_through(&self, buckets: &Arc<SharedBuckets>) {
        for key in self.by_digest.values() {
            let _ = key.shared.set(buckets.clone());
        }
    }

    /// Keeps the keys of `before` whose entries are unchanged (the same
    /// digest, name, tenant, sharing and limits): what they used of their
    /// limits carries over.
    fn keep_from(&mut self, before: &ApiKeys) {
        for (digest, key) in self.by_digest.iter_mut() {
            if let Some(old) = before.by_digest.get(digest)
                && old.spec == key.spec
            {
                *key = old.clone();
            }
        }
    }

    /// Counts these as the keys in force, with their expiries.
    fn count(&self) {
        crate::metrics::keys_in_force(self.len());
        crate::metrics::key_expiries(self.by_digest.values().filter_map(|key| Some((key.name.clone(), key.spec.expires_at_unix_ms?))));
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether there are none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The caller presenting `authorization` (an `Authorization` header's
    /// value: `Bearer KEY`).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Arc<ApiKey>, AuthError> {
        self.authenticate_at(authorization, now_unix_ms())
    }

    /// [`authenticate`](Self::authenticate) at `now` (Unix milliseconds).
    fn authenticate_at(&self, authorization: Option<&str>, now: i64) -> Result<Arc<ApiKey>, AuthError> {
        let key = authorization
            .and_then(|value| value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|key| !key.is_empty())
            .ok_or(AuthError::Missing)?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let key = self.by_digest.get(&digest).ok_or(AuthError::Unknown)?;
        match key.spec.expires_at_unix_ms {
            Some(at) if now >= at => Err(AuthError::Expired),
            _ => Ok(key.clone()),
        }
    }
}

/// Where the keys come from.
#[derive(Debug)]
enum Source {
    /// A TOML file.
    File(PathBuf),
    /// A database table ([`KeyTable`]).
    Table(KeyTable),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::File(path) => format!("file {}", path.display()),
            Source::Table(table) => format!("database {} (namespace {:?})", table.url(), table.namespace()),
        }
    }
}

/// The keys of a keys file or table as they are now: read again when
/// they change (a file's bytes, not its time: a Kubernetes Secret's files
/// are swapped under a link; a table's rows in force), so keys are added
/// and revoked without a restart.
#[derive(Debug)]
pub struct KeyRing {
    source: Source,
    own: Option<String>,
    shared: Option<Arc<SharedBuckets>>,
    /// The keys in force, and the digest of what they were read from.
    state: Mutex<(Arc<ApiKeys>, [u8; 32])>,
    /// One reload at a time: two reading at once could apply the older
    /// read after the newer.
    reloading: tokio::sync::Mutex<()>,
}

/// How long a gateway waits to listen again for a table's announcements
/// after it could not (its reloads every `--api-keys-reload-secs` go on
/// meanwhile): at first, doubled after each failure in a row up to
/// [`LISTEN_AGAIN_AT_MOST`], and back to this once it listens.
const LISTEN_AGAIN: Duration = Duration::from_secs(5);
/// The longest wait between tries to listen (a database down for hours
/// is tried, and warned of, once a minute).
const LISTEN_AGAIN_AT_MOST: Duration = Duration::from_secs(60);

/// The wait before the next try to listen after `failures` in a row.
fn listen_again_after(failures: u32) -> Duration {
    LISTEN_AGAIN.saturating_mul(1 << failures.saturating_sub(1).min(8)).min(LISTEN_AGAIN_AT_MOST)
}

impl KeyRing {
    /// The keys in the file at `path`, and `own` (the running process's
    /// key, [`ApiKeys::add_own`]) whatever the file says.
    /// With `shared`, the keys' per-minute limits are kept there too.
    pub fn load(path: &Path, own: Option<String>, shared: Option<SharedBuckets>) -> anyhow::Result<Self> {
        let (specs, digest) = Self::read_file(path)?;
        Self::with(Source::File(path.to_owned()), specs, digest, own, shared)
    }

    /// The keys in force in `table`, and `own` whatever it says; an empty
    /// table refuses every other caller. With `shared` as in [`load`].
    ///
    /// [`load`]: Self::load
    pub async fn open(table: KeyTable, own: Option<String>, shared: Option<SharedBuckets>) -> anyhow::Result<Self> {
        let (specs, digest) = Self::read_table(&table).await?;
        if specs.is_empty() {
            tracing::warn!(
                database = table.url(),
                namespace = table.namespace(),
                "the API keys table holds no key in force: every call is refused until `turbine keys new --database` adds one"
            );
        }
        Self::with(Source::Table(table), specs, digest, own, shared)
    }

    fn with(source: Source, specs: Vec<KeySpec>, digest: [u8; 32], own: Option<String>, shared: Option<SharedBuckets>) -> anyhow::Result<Self> {
        let shared = shared.map(Arc::new);
        let keys =
            Self::assemble(specs, own.as_deref(), None, shared.as_ref()).map_err(|error| anyhow::anyhow!("the API keys {}: {error}", source.describe()))?;
        keys.count();
        Ok(Self { source, own, shared, state: Mutex::new((Arc::new(keys), digest)), reloading: tokio::sync::Mutex::new(()) })
    }

    /// A file's entries, and the digest of its bytes.
    fn read_file(path: &Path) -> anyhow::Result<(Vec<KeySpec>, [u8; 32])> {
        let bytes = std::fs::read(path).map_err(|error| anyhow::anyhow!("cannot read the API keys file {}: {error}", path.display()))?;
        Ok((Self::parse_file(path, &bytes)?, Sha256::digest(&bytes).into()))
    }

    /// A file's entries.
    fn parse_file(path: &Path, bytes: &[u8]) -> anyhow::Result<Vec<KeySpec>> {
        let text = std::str::from_utf8(bytes).map_err(|_| anyhow::anyhow!("the API keys file {} is not UTF-8", path.display()))?;
        let file: KeysFile = toml::from_str(text).map_err(|error| anyhow::anyhow!("the API keys file {}: {error}", path.display()))?;
        if file.keys.is_empty() {
            anyhow::bail!("the API keys file {}: no keys: with an API keys file every call needs one of its keys", path.display());
        }
        Ok(file.keys)
    }

    /// A table's keys in force, and the digest of what they say.
    async fn read_table(table: &KeyTable) -> Result<(Vec<KeySpec>, [u8; 32]), TableError> {
        let specs = table.in_force().await?;
        let digest = Sha256::digest(format!("{specs:?}").as_bytes()).into();
        Ok((specs, digest))
    }

    fn assemble(specs: Vec<KeySpec>, own: Option<&str>, before: Option<&ApiKeys>, shared: Option<&Arc<SharedBuckets>>) -> Result<ApiKeys, String> {
        let mut keys = ApiKeys::from_specs(specs)?;
        if let Some(own) = own {
            keys.add_own(own);
        }
        if let Some(shared) = shared {
            keys.share_through(shared);
        }
        if let Some(before) = before {
            keys.keep_from(before);
        }
        Ok(keys)
    }

    /// The keys in force.
    pub fn current(&self) -> Arc<ApiKeys> {
        self.state.lock().0.clone()
    }

    /// Reads the keys again: `Ok(true)` when what they say changed and
    /// its keys are in force from now on, `Ok(false)` when unchanged, and
    /// the reason when they cannot be read or are invalid (the keys
    /// before stay).
    pub async fn reload(self: &Arc<Self>) -> anyhow::Result<bool> {
        let _one = self.reloading.lock().await;
        let read = match &self.source {
            Source::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || {
                    let bytes = std::fs::read(&path).map_err(|error| anyhow::anyhow!("cannot read the API keys file {}: {error}", path.display()))?;
                    let digest: [u8; 32] = Sha256::digest(&bytes).into();
                    Ok::<_, anyhow::Error>((digest, Self::parse_file(&path, &bytes)))
                })
                .await
                .map_err(|_| anyhow::anyhow!("reading the API keys file failed"))?
            }
            Source::Table(table) => match Self::read_table(table).await {
                Ok((specs, digest)) => Ok((digest, Ok(specs))),
                // Read, but a row is no key (edited by hand): refused once
                // per what it says, as a file that does not parse is.
                Err(error @ TableError::Corrupt { .. }) => Ok((Sha256::digest(error.to_string().as_bytes()).into(), Err(error.into()))),
                Err(error) => Err(error.into()),
            },
        };
        let (digest, parsed) = match read {
            Ok(read) => read,
            Err(error) => {
                crate::metrics::key_reload("unreadable");
                return Err(error);
            }
        };
        let before = {
            let state = self.state.lock();
            if state.1 == digest {
                return Ok(false);
            }
            state.0.clone()
        };
        let keys = parsed.and_then(|specs| {
            Self::assemble(specs, self.own.as_deref(), Some(&before), self.shared.as_ref())
                .map_err(|error| anyhow::anyhow!("the API keys {}: {error}", self.source.describe()))
        });
        let keys = match keys {
            Ok(keys) => keys,
            Err(error) => {
                // Counted once per version of what they say.
                self.state.lock().1 = digest;
                crate::metrics::key_reload("refused");
                return Err(error);
            }
        };
        crate::metrics::key_reload("applied");
        keys.count();
        tracing::info!(keys = keys.len(), source = %self.source.describe(), "API keys changed: these are in force");
        *self.state.lock() = (Arc::new(keys), digest);
        Ok(true)
    }

    /// [`reload`](Self::reload), its failure logged.
    async fn reload_logged(self: &Arc<Self>) {
        if let Err(error) = self.reload().await {
            tracing::error!(error = %format!("{error:#}"), "the API keys were not read again; the keys before stay in force");
        }
    }

    /// Reads the keys again every `every` until `shutdown`, and, from a
    /// table that may announce its changes (PostgreSQL's), as each is
    /// announced, once its trigger is there.
    pub fn spawn_watch(self: Arc<Self>, every: Duration, shutdown: turbine_runtime::CancellationToken) {
        if let Source::Table(table) = &self.source
            && table.may_announce_changes()
        {
            tokio::spawn(self.clone().follow_announcements(shutdown.clone()));
        }
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                self.reload_logged().await;
            }
        });
    }

    /// Listens for the table's announcements until `shutdown`, reading
    /// the keys again on each of this namespace (others' are ignored);
    /// whenever it starts listening again (at first, after a lost
    /// connection or a failure) it reads them too, for what changed
    /// unheard. Announcements heard during a read make one more read, not
    /// one each. A table without its trigger cannot be listened to: tried
    /// again as any failure is, so it is followed once the trigger is made.
    async fn follow_announcements(self: Arc<Self>, shutdown: turbine_runtime::CancellationToken) {
        let Source::Table(table) = &self.source else { return };
        // The reader: a read waiting at most (a Notify's one permit).
        let heard = Arc::new(tokio::sync::Notify::new());
        tokio::spawn({
            let (ring, heard, shutdown) = (self.clone(), heard.clone(), shutdown.clone());
            async move {
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = heard.notified() => ring.reload_logged().await,
                    }
                }
            }
        });
        let mine = |payload: &str| payload.is_empty() || payload == table.namespace();
        // Failures to listen in a row: the wait before the next try grows.
        let mut failures = 0;
        crate::metrics::keys_following(false);
        loop {
            let listening = tokio::select! {
                () = shutdown.cancelled() => return,
                listening = table.listen() => listening,
            };
            match listening {
                Ok(mut listener) => {
                    tracing::info!(database = table.url(), namespace = table.namespace(), "following the API keys table: each change is read as it is made");
                    failures = 0;
                    crate::metrics::keys_following(true);
                    heard.notify_one();
                    loop {
                        let change = tokio::select! {
                            () = shutdown.cancelled() => return,
                            change = listener.try_recv() => change,
                        };
                        match change {
                            Ok(Some(change)) if !mine(change.payload()) => {}
                            Ok(Some(_)) => heard.notify_one(),
                            // Lost, and listening again: what changed between is read.
                            Ok(None) => {
                                tracing::warn!(database = table.url(), "the API keys table's announcements were cut off; listening again");
                                heard.notify_one();
                            }
                            Err(error) => {
                                tracing::warn!(database = table.url(), %error, "cannot hear the API keys table's announcements; reading it every --api-keys-reload-secs meanwhile");
                                crate::metrics::keys_following(false);
                                heard.notify_one();
                                break;
                            }
                        }
                    }
                }
                Err(error) => {
                    failures += 1;
                    let again = listen_again_after(failures);
                    tracing::warn!(%error, retry_in_secs = again.as_secs(), "cannot listen for the API keys table's announcements; reading it every --api-keys-reload-secs meanwhile");
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(listen_again_after(failures)) => {}
            }
        }
    }
}

/// Who may call the public API: anyone (no keys file), or the holders of
/// its keys.
#[derive(Debug, Clone, Default)]
pub enum Access {
    /// No keys: every caller is the deployment's one open namespace.
    #[default]
    Open,
    /// Callers must present one of these keys.
    Keys(Arc<KeyRing>),
}

impl Access {
    /// The caller of a request with `authorization`: `None` when access is
    /// open.
    pub fn caller(&self, authorization: Option<&str>) -> Result<Option<Arc<ApiKey>>, GatewayError> {
        match self {
            Access::Open => Ok(None),
            Access::Keys(keys) => Ok(Some(keys.current().authenticate(authorization)?)),
        }
    }

    /// The namespace of a caller (the open one without keys).
    pub fn namespace(caller: Option<&ApiKey>) -> Namespace {
        caller.map_or(Namespace::Open, |key| key.namespace.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(entries: &[(&str, &str, &str)]) -> String {
        entries.iter().map(|(name, tenant, key)| format!("[[keys]]\nname = {name:?}\ntenant = {tenant:?}\nsha256 = {:?}\n", digest_hex(key))).collect()
    }

    #[test]
    fn a_key_names_its_tenant_and_nothing_else_passes() {
        let keys = ApiKeys::parse(&file(&[("a-prod", "acme", "tk_alpha"), ("b-prod", "bravo", "tk_bravo")])).unwrap();
        let caller = keys.authenticate(Some("Bearer tk_alpha")).unwrap();
        assert_eq!((caller.name.as_str(), caller.tenant.as_str(), &caller.namespace), ("a-prod", "acme", &Namespace::Tenant("acme".into())));
        assert_eq!(keys.authenticate(Some("Bearer tk_bravo")).unwrap().tenant, "bravo");
        let refused = |header: Option<&str>| keys.authenticate(header).map(|key| key.name.clone()).unwrap_err();
        assert_eq!(refused(None), AuthError::Missing);
        assert_eq!(refused(Some("Bearer ")), AuthError::Missing);
        assert_eq!(refused(Some("Basic dGtfYWxwaGE=")), AuthError::Missing);
        assert_eq!(refused(Some("Bearer tk_alph")), AuthError::Unknown);
        assert_eq!(refused(Some(&format!("Bearer {}", digest_hex("tk_alpha")))), AuthError::Unknown, "the digest is not the key");
    }

    #[test]
    fn tries_to_listen_slow_down_while_they_fail() {
        let waits: Vec<u64> = (0..=7).chain([40, u32::MAX]).map(|failures| listen_again_after(failures).as_secs()).collect();
        assert_eq!(waits, [5, 5, 10, 20, 40, 60, 60, 60, 60, 60]);
    }

    #[test]
    fn a_key_is_refused_from_its_expiry_on() {
        let text = format!("{}expires_at = 2027-01-01T00:00:00Z\n", file(&[("x", "t", "tk_x")]));
        let keys = ApiKeys::parse(&text).unwrap();
        let at = expiry_of("2027-01-01T00:00:00Z").unwrap();
        assert_eq!(at, 1_798_761_600_000);
        assert_eq!(keys.authenticate_at(Some("Bearer tk_x"), at - 1).unwrap().name, "x");
        assert_eq!(keys.authenticate_at(Some("Bearer tk_x"), at).unwrap_err(), AuthError::Expired);
        assert_eq!(keys.authenticate_at(Some("Bearer tk_y"), at).unwrap_err(), AuthError::Unknown);
        for (text, ms) in [
            ("1970-01-01T00:00:00Z", 0),
            ("1969-12-31T23:59:59.5Z", -500),
            ("2000-03-01T00:00:00+01:00", 951_865_200_000),
            ("2100-02-28T12:30:15-05:30", 4_107_520_815_000),
        ] {
            assert_eq!(expiry_of(text), Ok(ms), "{text}");
        }
        for (entry, says) in
            [("expires_at = 2027-01-01\n", "an offset"), ("expires_at = 2027-01-01T00:00:00\n", "an offset"), ("expires_at = \"soon\"\n", "date")]
        {
            let error = ApiKeys::parse(&format!("{}{entry}", file(&[("x", "t", "k")]))).unwrap_err();
            assert!(error.contains(says), "{entry}: {error}");
        }
    }

    #[test]
    fn a_new_keys_entry_lets_it_in() {
        let key = new_key();
        assert!(key.starts_with("tk_") && key.len() == 67, "{key}");
        assert_ne!(key, new_key());
        let text = entry("ops \"night\"", "acme", Some("public"), &key);
        assert!(!text.contains(&key), "the entry holds the digest only: {text}");
        let caller = ApiKeys::parse(&text).unwrap().authenticate(Some(&format!("Bearer {key}"))).unwrap();
        assert_eq!((caller.name.as_str(), &caller.namespace), ("ops \"night\"", &Namespace::Shared("public".into())));
    }

    #[test]
    fn bad_files_are_refused_with_the_entry_named() {
        let shared = format!("{}share_prefixes = \"public\"\n", file(&[("s", "acme", "tk_s")]));
        assert_eq!(ApiKeys::parse(&shared).unwrap().authenticate(Some("Bearer tk_s")).unwrap().namespace, Namespace::Shared("public".into()));
        for (text, says) in [
            (String::new(), "no keys"),
            ("[[keys]]\nname = \"x\"\ntenant = \"t\"\nsha256 = \"abc\"\n".to_owned(), "64 hex digits"),
            (file(&[("x", "", "k")]), "must not be empty"),
            (file(&[("x", "t", "k"), ("x", "u", "l")]), "another key has this name"),
            (file(&[("x", "t", "k"), ("y", "u", "k")]), "another key has this digest"),
            (format!("{}rpm = 5\n", file(&[("x", "t", "k")])), "unknown field"),
            (format!("{}max_concurrent = 0\n", file(&[("x", "t", "k")])), "must be positive"),
        ] {
            let error = ApiKeys::parse(&text).unwrap_err();
            assert!(error.contains(says), "{error} should say {says}");
        }
    }

    /// A row edited into no key: the reload is refused (once for what it
    /// says, not each time as an unreachable database is) and the keys
    /// read before stay in force; the row mended, its key is read again.
    #[tokio::test]
    async fn a_row_edited_into_no_key_is_refused_once_and_the_keys_before_stay() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("keys.sqlite").display());
        let operator = KeyTable::open(&url, "default").await.unwrap();
        operator.add(&KeyEntry { name: "a".into(), tenant: "t".into(), max_concurrent: Some(2), ..KeyEntry::default() }, "tk_a").await.unwrap();
        let ring = Arc::new(KeyRing::open(KeyTable::open_to_read(&url, "default").await.unwrap(), None, None).await.unwrap());
        let hand = sqlx::AnyPool::connect(&url).await.unwrap();
        let edit = async |sql: &str| sqlx::query(sql).execute(&hand).await.unwrap();
        let reloads = |outcome: &str| crate::metrics::KEY_RELOADS.with_label_values(&[outcome]).get();

        edit("UPDATE gateway_api_keys SET max_concurrent = 0").await;
        let error = ring.reload().await.unwrap_err();
        assert!(format!("{error:#}").contains("max_concurrent 0 is not positive"), "{error:#}");
        assert!(!ring.reload().await.unwrap(), "the same rows are not refused again");
        assert_eq!((reloads("refused"), reloads("unreadable")), (1, 0));
        assert_eq!(ring.current().authenticate(Some("Bearer tk_a")).unwrap().name, "a", "the keys before stay");

        edit("UPDATE gateway_api_keys SET max_concurrent = 3").await;
        assert!(ring.reload().await.unwrap());
        assert_eq!(reloads("applied"), 1);
    }

    #[test]
    fn a_key_is_held_to_its_limits_and_told_when_to_retry() {
        let text = format!("{}requests_per_minute = 2\nmax_concurrent = 1\ntokens_per_minute = 600\n", file(&[("x", "t", "k")]));
        let keys = ApiKeys::parse(&text).unwrap();
        let key = keys.authenticate(Some("Bearer k")).unwrap();
        let first = key.admit_here().expect("within every limit");
        let busy = key.admit_here().unwrap_err();
        assert_eq!((busy.kind, busy.retry_after), (ErrorKind::RateLimited, Some(1)), "one at a time: {busy:?}");
        drop(first);
        let _second = key.admit_here().expect("the first ended");
        drop(_second);
        let spent = key.admit_here().unwrap_err();
        assert!(spent.message.contains("requests per minute") && spent.retry_after.is_some_and(|secs| (1..=30).contains(&secs)), "{spent:?}");

        let text = format!("{}tokens_per_minute = 600\n", file(&[("y", "t", "l")]));
        let keys = ApiKeys::parse(&text).unwrap();
        let key = keys.authenticate(Some("Bearer l")).unwrap();
        drop(key.admit_here().unwrap());
        key.charge(900);
        let spent = key.admit_here().unwrap_err();
        // 300 tokens of debt at 10 per second.
        assert!(spent.message.contains("tokens per minute") && spent.retry_after.is_some_and(|secs| (29..=31).contains(&secs)), "{spent:?}");
    }
}
