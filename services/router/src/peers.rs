//! Load booked by the other router replicas, shared through Redis.
//!
//! Each replica books only the requests it routes; alone, it would see a
//! fraction of every worker's load. Every `interval` each replica writes
//! its per-worker totals to `turbine:<namespace>:router-load:<id>` (expiring
//! after 2 s, so a dead replica's load fades) and reads the others'. Decisions weigh its own exact bookings plus the others' last
//! published totals.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{AsyncCommands, RedisResult};
use rustc_hash::FxHashMap;
use tokio::task::JoinHandle;
use turbine_kv::WorkerId;
use turbine_runtime::CancellationToken;

use crate::router::{Router, WorkerBook};

/// How often replicas exchange their load.
pub const SHARE_INTERVAL: Duration = Duration::from_millis(200);
/// A replica's published load expires after this long without renewal.
const EXPIRY: Duration = Duration::from_secs(2);

/// One replica's side of the exchange.
#[derive(Clone)]
pub struct PeerLoad {
    connection: ConnectionManager,
    registry_key: String,
    prefix: String,
    router_id: String,
}

impl std::fmt::Debug for PeerLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLoad").field("router_id", &self.router_id).finish()
    }
}

impl PeerLoad {
    /// The exchange of `namespace` on the Redis at `url`, as replica
    /// `router_id` (unique per process); connects lazily.
    pub fn new(url: &str, namespace: &str, router_id: &str) -> RedisResult<Self> {
        let client = turbine_runtime::redis::client(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(1);
        let connection = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Self {
            connection,
            registry_key: format!("turbine:{namespace}:router-loads"),
            prefix: format!("turbine:{namespace}:router-load:"),
            router_id: router_id.to_owned(),
        })
    }

    /// Publishes `own` and returns the sum of the other live replicas'.
    pub async fn exchange(&self, own: &FxHashMap<WorkerId, WorkerBook>) -> RedisResult<FxHashMap<WorkerId, WorkerBook>> {
        let mut connection = self.connection.clone();
        let ttl_ms = EXPIRY.as_millis() as u64;
        let (ids,): (Vec<String>,) = redis::pipe()
            .cmd("SET")
            .arg(format!("{}{}", self.prefix, self.router_id))
            .arg(encode(own))
            .arg("PX")
            .arg(ttl_ms)
            .ignore()
            .sadd(&self.registry_key, &self.router_id)
            .ignore()
            .smembers(&self.registry_key)
            .query_async(&mut connection)
            .await?;
        let others: Vec<&String> = ids.iter().filter(|id| **id != self.router_id).collect();
        let mut total: FxHashMap<WorkerId, WorkerBook> = FxHashMap::default();
        if others.is_empty() {
            return Ok(total);
        }
        let keys: Vec<String> = others.iter().map(|id| format!("{}{id}", self.prefix)).collect();
        let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(&mut connection).await?;
        for (id, value) in others.into_iter().zip(values) {
            match value {
                Some(text) => {
                    for (worker, book) in decode(&text) {
                        let sum = total.entry(worker).or_default();
                        *sum = *sum + book;
                    }
                }
                // Expired: that replica is gone.
                None => {
                    let _: RedisResult<()> = connection.srem(&self.registry_key, id).await;
                }
            }
        }
        Ok(total)
    }
}

/// `worker in_flight prefill decode` lines.
fn encode(books: &FxHashMap<WorkerId, WorkerBook>) -> String {
    books.iter().map(|(worker, b)| format!("{worker}\t{}\t{}\t{}\n", b.in_flight, b.prefill_blocks, b.decode_blocks)).collect()
}

fn decode(text: &str) -> impl Iterator<Item = (WorkerId, WorkerBook)> + '_ {
    text.lines().filter_map(|line| {
        let mut fields = line.split('\t');
        let worker = WorkerId::from(fields.next()?);
        let book =
            WorkerBook { in_flight: fields.next()?.parse().ok()?, prefill_blocks: fields.next()?.parse().ok()?, decode_blocks: fields.next()?.parse().ok()? };
        Some((worker, book))
    })
}

/// Exchanges `router`'s load with the other replicas every
/// [`SHARE_INTERVAL`] until `shutdown`. While Redis is unreachable the
/// last known peer load is kept for the expiry (2 s), then dropped.
pub fn share_load(router: Arc<Router>, peers: PeerLoad, shutdown: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut last_exchange = std::time::Instant::now();
        let mut failing = false;
        loop {
            match peers.exchange(&router.own_books()).await {
                Ok(others) => {
                    failing = false;
                    last_exchange = std::time::Instant::now();
                    router.set_peer_books(others);
                }
                Err(error) => {
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(%error, "cannot exchange load with the other router replicas; using this router's bookings alone");
                    }
                    if last_exchange.elapsed() >= EXPIRY {
                        router.set_peer_books(FxHashMap::default());
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(SHARE_INTERVAL) => {}
                () = shutdown.cancelled() => return,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_round_trip_through_the_text_form() {
        let mut books = FxHashMap::default();
        books.insert(WorkerId::from("w-1"), WorkerBook { in_flight: 3, prefill_blocks: 40, decode_blocks: 900 });
        books.insert(WorkerId::from("w-2"), WorkerBook { in_flight: 1, prefill_blocks: 0, decode_blocks: 12 });
        let decoded: FxHashMap<WorkerId, WorkerBook> = decode(&encode(&books)).collect();
        assert_eq!(decoded, books);
        assert_eq!(decode("garbage\nw\t1\t2\n").count(), 0, "malformed lines are skipped");
    }
}
