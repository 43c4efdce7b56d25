//! The keys' limits kept in Redis, shared by every gateway of a
//! namespace: the per-minute buckets, refilled and changed in one script
//! call at Redis's clock. When Redis does not answer in time a call is
//! decided by the gateway's own limits alone, never by none.

use std::time::Duration;

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
        Ok(Self { connection, prefix: format!("turbine:{namespace}:limits") })
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
