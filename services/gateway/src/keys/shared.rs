//! The keys' limits kept in Redis, shared by every gateway of a
//! namespace: the per-minute buckets, refilled and changed in one script
//! call at Redis's clock, and the places of each key's concurrency limit
//! (a sorted set of the requests in flight, each under a lease its gateway
//! renews while it runs). When Redis does not answer in time a call is
//! decided by the gateway's own limits alone, never by none.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

/// Charges tokens to a key's bucket in Redis, into debt if need be, at
/// Redis's clock: KEYS[1] the bucket; ARGV per minute, amount. An idle
/// bucket expires once it would be full again.
const CHARGE_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local per_minute = tonumber(ARGV[1])
local rate = per_minute / 60
local held = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = per_minute
if held[1] then
  level = math.min(per_minute, tonumber(held[1]) + math.max(0, now - tonumber(held[2])) * rate)
end
level = level - tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil((per_minute - level) / rate) + 1)
return 0
"#;

/// Admits one request of a key against every limit it has, in one step
/// at Redis's clock: its tokens per minute (refused while that bucket is
/// in debt), its places in flight (places past their lease dropped
/// first), then its requests per minute (one taken). Nothing is taken
/// unless all allow it. KEYS: the tokens bucket, the requests bucket, the
/// places' set; ARGV: tokens per minute, requests per minute, places (0:
/// no such limit), the new place's name, its lease in seconds. Answers
/// {0, 0} (admitted) or {limit refused: 1 tokens, 2 concurrency, 3
/// requests; seconds to wait}.
const ADMIT_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function level_of(key, per_minute)
  local held = redis.call('HMGET', key, 'level', 'at')
  if not held[1] then return per_minute end
  return math.min(per_minute, tonumber(held[1]) + math.max(0, now - tonumber(held[2])) * per_minute / 60)
end
local tokens, requests, places = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease = tonumber(ARGV[5])
if tokens > 0 then
  local level = level_of(KEYS[1], tokens)
  if level <= 0 then return {1, math.max(1, math.ceil((1 - level) / (tokens / 60)))} end
end
if places > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= places then return {2, 1} end
end
if requests > 0 then
  local level = level_of(KEYS[2], requests)
  if level < 1 then return {3, math.max(1, math.ceil((1 - level) / (requests / 60)))} end
  level = level - 1
  redis.call('HSET', KEYS[2], 'level', tostring(level), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[2], math.ceil((requests - level) / (requests / 60)) + 1)
end
if places > 0 then
  redis.call('ZADD', KEYS[3], now + lease, ARGV[4])
  redis.call('EXPIRE', KEYS[3], math.ceil(lease) + 1)
end
return {0, 0}
"#;

/// The per-minute limits' buckets in Redis, shared by every gateway of a
/// namespace. When Redis does not answer in time a call is decided by the
/// process's own buckets alone (counted in
/// `turbine_gateway_shared_limit_failures_total`): the limits then hold
/// per gateway, never none.
#[derive(Clone)]
pub struct SharedBuckets {
    connection: redis::aio::ConnectionManager,
    prefix: String,
    places: Arc<Places>,
}

/// The concurrency places this gateway holds in Redis, by set, and how
/// it names them.
#[derive(Debug, Default)]
struct Places {
    /// Random per process: its places' names start with it.
    instance: u64,
    next: AtomicU64,
    held: Mutex<HashMap<String, HashSet<String>>>,
    renewing: AtomicBool,
}

/// How long a place is held without its gateway renewing it: a gateway
/// that dies frees its places within this.
pub(super) const PLACE_LEASE: Duration = Duration::from_secs(30);

/// How often a gateway renews the places of its requests in flight.
const PLACE_RENEWAL: Duration = Duration::from_secs(10);

/// Renews places: KEYS[1] the set; ARGV the lease in seconds, then the
/// places (each added again if its lease ran out meanwhile: its request
/// is still in flight).
const RENEW_PLACES_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + lease, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 1)
return #ARGV - 1
"#;

/// A key's limits, as the admission script takes them.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SharedLimits {
    pub tokens_per_minute: Option<u64>,
    pub requests_per_minute: Option<u32>,
    pub max_concurrent: Option<u32>,
}

/// What asking the shared limits gave.
#[derive(Debug)]
pub(super) enum Admitted {
    /// Admitted, holding a place if the key has a concurrency limit.
    Yes(Option<SharedPlace>),
    /// Refused by `limit` (`tokens`, `concurrency`, `requests`): retry in
    /// `wait` seconds.
    Refused { limit: &'static str, wait: u64 },
    /// Redis did not answer: the gateway's own limits decided.
    Unanswered,
}

/// A request's place in its key's shared concurrency limit; dropping it
/// gives the place back (and stops its renewals).
#[derive(Debug)]
pub struct SharedPlace {
    buckets: SharedBuckets,
    set: String,
    name: String,
}

impl Drop for SharedPlace {
    fn drop(&mut self) {
        let mut held = self.buckets.places.held.lock();
        if let Some(names) = held.get_mut(&self.set) {
            names.remove(&self.name);
            if names.is_empty() {
                held.remove(&self.set);
            }
        }
        drop(held);
        // Given back at once where a runtime runs; else its lease ends it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (mut connection, set, name) = (self.buckets.connection.clone(), std::mem::take(&mut self.set), std::mem::take(&mut self.name));
            runtime.spawn(async move {
                let given_back: redis::RedisResult<()> = redis::cmd("ZREM").arg(&set).arg(&name).query_async(&mut connection).await;
                if let Err(error) = given_back {
                    crate::metrics::shared_limit_failure();
                    tracing::warn!(%error, "a concurrency place was not given back in Redis: its lease frees it");
                }
            });
        }
    }
}

impl std::fmt::Debug for SharedBuckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuckets").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl SharedBuckets {
    /// Buckets in the Redis at `url` (connected lazily), under the
    /// namespace `namespace`.
    pub fn new(url: &str, namespace: &str) -> anyhow::Result<Self> {
        let client = turbine_runtime::redis::client(url).map_err(|error| anyhow::anyhow!("bad Redis URL {url:?}: {error}"))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_response_timeout(Some(Duration::from_millis(250)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let connection = redis::aio::ConnectionManager::new_lazy_with_config(client, config)?;
        let places = Places { instance: rand::random(), ..Places::default() };
        Ok(Self { connection, prefix: format!("turbine:{namespace}:limits"), places: Arc::new(places) })
    }

    /// Admits one request of the key `digest` against `limits`, across
    /// every gateway of the namespace, in one call: a place among its
    /// requests in flight, renewed while it is held, if it has a
    /// concurrency limit.
    pub(super) async fn admit(&self, digest: &str, limits: SharedLimits) -> Admitted {
        let set = format!("{}:{digest}:concurrent", self.prefix);
        let name = format!("{:016x}-{}", self.places.instance, self.places.next.fetch_add(1, Ordering::Relaxed));
        let mut connection = self.connection.clone();
        let answer: redis::RedisResult<(u32, u64)> = redis::cmd("EVAL")
            .arg(ADMIT_SCRIPT)
            .arg(3)
            .arg(format!("{}:{digest}:tokens", self.prefix))
            .arg(format!("{}:{digest}:requests", self.prefix))
            .arg(&set)
            .arg(limits.tokens_per_minute.unwrap_or(0))
            .arg(limits.requests_per_minute.unwrap_or(0))
            .arg(limits.max_concurrent.unwrap_or(0))
            .arg(&name)
            .arg(PLACE_LEASE.as_secs())
            .query_async(&mut connection)
            .await;
        match answer {
            Ok((0, _)) if limits.max_concurrent.is_some() => {
                self.places.held.lock().entry(set.clone()).or_default().insert(name.clone());
                self.renew_while_held();
                Admitted::Yes(Some(SharedPlace { buckets: self.clone(), set, name }))
            }
            Ok((0, _)) => Admitted::Yes(None),
            Ok((refused, wait)) => Admitted::Refused {
                limit: match refused {
                    1 => "tokens",
                    2 => "concurrency",
                    _ => "requests",
                },
                wait,
            },
            Err(error) => {
                crate::metrics::shared_limit_failure();
                tracing::warn!(%error, "the shared limits' Redis did not answer: this call is decided by this gateway's own limits");
                Admitted::Unanswered
            }
        }
    }

    /// Starts renewing this gateway's places (once): every
    /// [`PLACE_RENEWAL`], each set's places in one call, until the buckets
    /// are dropped.
    fn renew_while_held(&self) {
        if self.places.renewing.swap(true, Ordering::Relaxed) {
            return;
        }
        let (places, connection): (Weak<Places>, _) = (Arc::downgrade(&self.places), self.connection.clone());
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(PLACE_RENEWAL);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(places) = places.upgrade() else { return };
                renew(&places, &connection).await;
            }
        });
    }

    /// Charges `amount` tokens to the key `digest`'s tokens per minute
    /// (`per_minute`).
    pub(super) async fn charge(&self, digest: &str, per_minute: u64, amount: u32) {
        let mut connection = self.connection.clone();
        let answer: redis::RedisResult<u64> = redis::cmd("EVAL")
            .arg(CHARGE_SCRIPT)
            .arg(1)
            .arg(format!("{}:{digest}:tokens", self.prefix))
            .arg(per_minute)
            .arg(amount)
            .query_async(&mut connection)
            .await;
        if let Err(error) = answer {
            crate::metrics::shared_limit_failure();
            tracing::warn!(%error, "the shared limits' Redis did not answer: these tokens are charged to this gateway's own bucket only");
        }
    }
}

/// Renews every place in `places`, each set's in one call.
async fn renew(places: &Places, connection: &redis::aio::ConnectionManager) {
    let held: Vec<(String, Vec<String>)> = places.held.lock().iter().map(|(set, names)| (set.clone(), names.iter().cloned().collect())).collect();
    for (set, names) in held {
        let mut connection = connection.clone();
        let renewed: redis::RedisResult<u32> =
            redis::cmd("EVAL").arg(RENEW_PLACES_SCRIPT).arg(1).arg(&set).arg(PLACE_LEASE.as_secs()).arg(&names).query_async(&mut connection).await;
        if let Err(error) = renewed {
            crate::metrics::shared_limit_failure();
            tracing::warn!(%error, places = names.len(), "concurrency places not renewed in Redis (tried again next round)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The places of one key's limit against a real redis-server: taken up
    /// to the limit, given back when dropped, a dead gateway's place (its
    /// lease run out) no longer counted, and a place whose lease ran out
    /// while its request still runs taken again by the renewal.
    #[tokio::test]
    async fn places_are_taken_to_the_limit_given_back_and_renewed() {
        let redis = turbine_testkit::RedisServer::start();
        let buckets = SharedBuckets::new(&redis.url(), "places").unwrap();
        let set = "turbine:places:limits:k:concurrent";
        let mut raw = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let count = async |raw: &mut redis::aio::MultiplexedConnection| -> u32 { redis::cmd("ZCARD").arg(set).query_async(raw).await.unwrap() };
        let two = SharedLimits { max_concurrent: Some(2), ..SharedLimits::default() };
        let place = async || match buckets.admit("k", two).await {
            Admitted::Yes(Some(place)) => Some(place),
            Admitted::Refused { limit: "concurrency", wait: 1 } => None,
            other => panic!("{other:?}"),
        };

        let (first, second) = (place().await.expect("a place of two"), place().await.expect("two places of two"));
        assert!(place().await.is_none(), "a third of two");
        drop(second);
        turbine_testkit::wait_until("the place given back", Duration::from_secs(5), async || count(&mut raw).await == 1).await;
        let third = place().await.expect("the place given back is taken");

        // Another gateway died holding a place: once its lease ran out the
        // place no longer counts.
        drop(third);
        turbine_testkit::wait_until("the place given back", Duration::from_secs(5), async || count(&mut raw).await == 1).await;
        let _: () = redis::cmd("ZADD").arg(set).arg(1).arg("dead-gateway-0").query_async(&mut raw).await.unwrap();
        let _fourth = place().await.expect("the dead gateway's place is not counted");
        assert_eq!(count(&mut raw).await, 2, "dropped from the set when it was passed over");

        // Redis lost the first place's lease (it ran out while Redis was
        // unreachable): the renewal takes it again, its request still runs.
        let _: () = redis::cmd("ZREM").arg(set).arg(&first.name).query_async(&mut raw).await.unwrap();
        renew(&buckets.places, &buckets.connection).await;
        let score: Option<f64> = redis::cmd("ZSCORE").arg(set).arg(&first.name).query_async(&mut raw).await.unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(score.is_some_and(|until| until > now + 20.0), "renewed for a lease: {score:?}");
        assert!(place().await.is_none(), "two in flight again");
    }

    /// Every limit of a key in one call: nothing is taken unless all
    /// allow it (a refusal by the concurrency limit takes no request from
    /// the minute's, one by the requests per minute holds no place), and
    /// tokens charged after the fact refuse the key until the bucket is
    /// out of debt.
    #[tokio::test]
    async fn one_call_takes_from_every_limit_or_from_none() {
        let redis = turbine_testkit::RedisServer::start();
        let buckets = SharedBuckets::new(&redis.url(), "one").unwrap();
        let mut raw = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let limits = SharedLimits { tokens_per_minute: Some(100), requests_per_minute: Some(3), max_concurrent: Some(1) };
        let Admitted::Yes(Some(held)) = buckets.admit("k", limits).await else { panic!("the first is admitted") };
        for _ in 0..3 {
            assert!(matches!(buckets.admit("k", limits).await, Admitted::Refused { limit: "concurrency", wait: 1 }));
        }
        let level: f64 = redis::cmd("HGET").arg("turbine:one:limits:k:requests").arg("level").query_async(&mut raw).await.unwrap();
        assert!((level - 2.0).abs() < 0.01, "only the admitted request taken: {level}");
        drop(held);
        let places = async |raw: &mut redis::aio::MultiplexedConnection| -> u32 {
            redis::cmd("ZCARD").arg("turbine:one:limits:k:concurrent").query_async(raw).await.unwrap()
        };
        turbine_testkit::wait_until("the place given back", Duration::from_secs(5), async || places(&mut raw).await == 0).await;
        for _ in 0..2 {
            let Admitted::Yes(Some(place)) = buckets.admit("k", limits).await else { panic!("within the minute's three") };
            drop(place);
            turbine_testkit::wait_until("the place given back", Duration::from_secs(5), async || places(&mut raw).await == 0).await;
        }
        let Admitted::Refused { limit: "requests", wait } = buckets.admit("k", limits).await else { panic!("a fourth of three a minute") };
        assert!((1..=20).contains(&wait), "{wait}");
        assert_eq!(places(&mut raw).await, 0, "a refused request holds no place");

        // 150 tokens charged to 100 a minute: in debt, refused by tokens.
        let other = SharedLimits { tokens_per_minute: Some(100), ..SharedLimits::default() };
        assert!(matches!(buckets.admit("t", other).await, Admitted::Yes(None)));
        buckets.charge("t", 100, 150).await;
        let Admitted::Refused { limit: "tokens", wait } = buckets.admit("t", other).await else { panic!("a key in debt") };
        assert!((30..=32).contains(&wait), "{wait}");
    }
}
