//! Publishing event batches through Redis outages, with bounded memory.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio_util::sync::CancellationToken;
use turbine_kv::EventBatch;

use crate::log::EventLog;

/// Wait after a failed publish before the next try.
const RETRY: Duration = Duration::from_millis(200);

/// Items taken into one round of batches at most.
const BATCH_ITEMS: usize = 256;

/// Batches waiting for Redis at most; beyond that the oldest are dropped
/// and the followers resynchronise from a dump (they see the gap).
const PENDING_BATCHES: usize = 64;

/// Publishes what `items` carries to `log` until `shutdown` (or the
/// sender closes): each round waits for an item (unless batches still wait
/// for Redis), takes every item available at once (up to 256), makes them
/// into batches with `batch`, and flushes. While Redis is unreachable at
/// most 64 batches wait, the oldest dropped beyond that; items the
/// receiver missed (it lagged) leave the same gap in the numbering, which
/// followers repair with a dump. `what` names the items in the log.
pub async fn publish_all<T: Clone>(
    mut items: broadcast::Receiver<T>,
    log: EventLog,
    shutdown: CancellationToken,
    what: &'static str,
    mut batch: impl FnMut(Vec<T>) -> Vec<EventBatch>,
) {
    let mut publisher = Publisher::new(log, PENDING_BATCHES);
    loop {
        let mut received = Vec::new();
        if publisher.is_idle() {
            let next = tokio::select! {
                () = shutdown.cancelled() => return,
                next = items.recv() => next,
            };
            match next {
                Ok(item) => received.push(item),
                Err(RecvError::Lagged(missed)) => tracing::warn!(missed, "{what} dropped before publishing"),
                Err(RecvError::Closed) => return,
            }
        }
        while received.len() < BATCH_ITEMS {
            match items.try_recv() {
                Ok(item) => received.push(item),
                Err(TryRecvError::Lagged(missed)) => tracing::warn!(missed, "{what} dropped before publishing"),
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            }
        }
        for next in batch(received) {
            publisher.push(next);
        }
        if !publisher.flush(&shutdown).await {
            return;
        }
    }
}

/// One publisher's batches on their way to the log: while Redis is
/// unreachable at most `limit` wait, the oldest dropped beyond that (the
/// followers see the gap in the numbering and load a dump instead).
#[derive(Debug)]
pub struct Publisher {
    log: EventLog,
    pending: VecDeque<EventBatch>,
    limit: usize,
    failing: bool,
}

impl Publisher {
    /// Publishes to `log`, holding at most `limit` batches (at least one).
    pub fn new(log: EventLog, limit: usize) -> Self {
        Self { log, pending: VecDeque::new(), limit: limit.max(1), failing: false }
    }

    /// Whether nothing waits.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Queues a batch (an empty one is ignored).
    pub fn push(&mut self, batch: EventBatch) {
        if batch.events.is_empty() {
            return;
        }
        if self.pending.len() >= self.limit {
            self.pending.pop_front();
        }
        self.pending.push_back(batch);
    }

    /// Publishes the waiting batches in order. When Redis fails it waits a
    /// moment and returns with the rest still waiting. False once
    /// `shutdown` fired during the wait.
    pub async fn flush(&mut self, shutdown: &CancellationToken) -> bool {
        while let Some(next) = self.pending.front() {
            match self.log.publish(next).await {
                Ok(_) => {
                    self.pending.pop_front();
                    if std::mem::replace(&mut self.failing, false) {
                        tracing::info!("publishing KV events again");
                    }
                }
                Err(error) => {
                    if !std::mem::replace(&mut self.failing, true) {
                        tracing::warn!(%error, "cannot publish KV events; keeping the last {} batches", self.limit);
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return false,
                        () = tokio::time::sleep(RETRY) => return true,
                    }
                }
            }
        }
        true
    }
}
