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

/// What a shared bucket is asked.
#[derive(Debug, Clone, Copy)]
pub(super) enum BucketOp {
    /// Take the amount if held; else the seconds until it would be.
    Take,
    /// Seconds until the bucket is out of debt (0: it is).
    Wait,
    /// Charge the amount, into debt if need be.
    Charge,
}

impl BucketOp {
    fn as_str(self) -> &'static str {
        match self {
            BucketOp::Take => "take",
            BucketOp::Wait => "wait",
            BucketOp::Charge => "charge",
        }
    }
}

/// A bucket in Redis, refilled and changed in one step (Redis's clock):
/// KEYS[1] the bucket; ARGV per minute, amount, op. Answers the seconds to
/// wait (0: done). An idle bucket expires once it would be full again.
const BUCKET_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local per_minute = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local rate = per_minute / 60
local held = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = per_minute
if held[1] then
  level = math.min(per_minute, tonumber(held[1]) + math.max(0, now - tonumber(held[2])) * rate)
end
local wait = 0
if ARGV[3] == 'take' then
  if level >= amount then level = level - amount else wait = math.max(1, math.ceil((amount - level) / rate)) end
elseif ARGV[3] == 'charge' then
  level = level - amount
elseif level <= 0 then
  wait = math.max(1, math.ceil((1 - level) / rate))
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil((per_minute - level) / rate) + 1)
return wait
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

/// Takes a place in a key's set if it holds fewer than its limit: KEYS[1]
/// the set; ARGV the limit, the place, the lease in seconds. Places whose
/// lease ran out are dropped first. Answers 1 (taken) or 0 (full).
const TAKE_PLACE_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 1)
return 1
"#;

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

/// What asking for a shared place gave.
#[derive(Debug)]
pub(super) enum Place {
    /// Held until dropped.
    Taken(SharedPlace),
    /// The key has as many requests in flight as it may, across gateways.
    Full,
    /// Redis did not answer: the gateway's own limit decided.
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

    /// A place among the key `digest`'s `max_concurrent` requests in
    /// flight across every gateway, renewed while it is held.
    pub(super) async fn take_place(&self, digest: &str, max_concurrent: u32) -> Place {
        let set = format!("{}:{digest}:concurrent", self.prefix);
        let name = format!("{:016x}-{}", self.places.instance, self.places.next.fetch_add(1, Ordering::Relaxed));
        let mut connection = self.connection.clone();
        let answer: redis::RedisResult<u32> = redis::cmd("EVAL")
            .arg(TAKE_PLACE_SCRIPT)
            .arg(1)
            .arg(&set)
            .arg(max_concurrent)
            .arg(&name)
            .arg(PLACE_LEASE.as_secs())
            .query_async(&mut connection)
            .await;
        match answer {
            Ok(0) => Place::Full,
            Ok(_) => {
                self.places.held.lock().entry(set.clone()).or_default().insert(name.clone());
                self.renew_while_held();
                Place::Taken(SharedPlace { buckets: self.clone(), set, name })
            }
            Err(error) => {
                crate::metrics::shared_limit_failure();
                tracing::warn!(%error, "the shared limits' Redis did not answer: this request's concurrency is decided by this gateway's own limit");
                Place::Unanswered
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

    /// Runs `op` on the key `digest`'s bucket `limit`: the seconds to wait
    /// (0 when Redis did not answer).
    pub(super) async fn bucket(&self, digest: &str, limit: &str, per_minute: f64, amount: f64, op: BucketOp) -> u64 {
        let mut connection = self.connection.clone();
        let answer: redis::RedisResult<u64> = redis::cmd("EVAL")
            .arg(BUCKET_SCRIPT)
            .arg(1)
            .arg(format!("{}:{digest}:{limit}", self.prefix))
            .arg(per_minute)
            .arg(amount)
            .arg(op.as_str())
            .query_async(&mut connection)
            .await;
        answer.unwrap_or_else(|error| {
            crate::metrics::shared_limit_failure();
            tracing::warn!(%error, limit, "the shared limits' Redis did not answer: this call is decided by this gateway's own limits");
            0
        })
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

        let (Place::Taken(first), Place::Taken(second)) = (buckets.take_place("k", 2).await, buckets.take_place("k", 2).await) else {
            panic!("two places of two")
        };
        assert!(matches!(buckets.take_place("k", 2).await, Place::Full));
        drop(second);
        turbine_testkit::wait_until("the place given back", Duration::from_secs(5), async || count(&mut raw).await == 1).await;
        let Place::Taken(third) = buckets.take_place("k", 2).await else { panic!("the place given back is taken") };

        // Another gateway died holding a place: once its lease ran out the
        // place no longer counts.
        drop(third);
        turbine_testkit::wait_until("the place given back", Duration::from_secs(5), async || count(&mut raw).await == 1).await;
        let _: () = redis::cmd("ZADD").arg(set).arg(1).arg("dead-gateway-0").query_async(&mut raw).await.unwrap();
        let Place::Taken(_fourth) = buckets.take_place("k", 2).await else { panic!("the dead gateway's place is not counted") };
        assert_eq!(count(&mut raw).await, 2, "dropped from the set when it was passed over");

        // Redis lost the first place's lease (it ran out while Redis was
        // unreachable): the renewal takes it again, its request still runs.
        let _: () = redis::cmd("ZREM").arg(set).arg(&first.name).query_async(&mut raw).await.unwrap();
        renew(&buckets.places, &buckets.connection).await;
        let score: Option<f64> = redis::cmd("ZSCORE").arg(set).arg(&first.name).query_async(&mut raw).await.unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(score.is_some_and(|until| until > now + 20.0), "renewed for a lease: {score:?}");
        assert!(matches!(buckets.take_place("k", 2).await, Place::Full), "two in flight again");
    }
}
