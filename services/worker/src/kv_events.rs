//! A worker's KV events: fed to an index in the same process, or published
//! to the KV event log (a Redis stream) for every router and kv-index.
//!
//! The in-process feed subscribes to the engine's events first, then loads a dump, so
//! nothing falls between the two: events the dump already reflects are
//! duplicates and skipped. A lagging feed (the engine's event buffer
//! overflowed) or a numbering gap resynchronises from a fresh dump.

use std::sync::Arc;

use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use turbine_kv::index::Applied;
use turbine_kv::{EventBatch, KvIndex};
use turbine_runtime::CancellationToken;

use crate::worker::Worker;

/// Events per published batch at most.
const BATCH_EVENTS: usize = 256;
/// Batches waiting for Redis at most; beyond that they are dropped and the
/// followers resynchronise from a dump (they see the numbering gap).
const PENDING_BATCHES: usize = 64;

/// Keeps `index` in step with `worker`'s prefix cache until `shutdown`
/// (or the engine stops); the worker is removed from the index then.
pub fn feed_index(worker: Arc<Worker>, index: Arc<KvIndex>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let id = worker.id().to_owned();
        let instance = worker.instance();
        let mut events = worker.engine().subscribe_events();
        let resync = |reason: String| {
            let worker = worker.clone();
            let index = index.clone();
            async move {
                tracing::debug!(worker = %worker.id(), reason, "resynchronising the KV index from a dump");
                match worker.engine().dump().await {
                    Ok(dump) => {
                        index.load_dump(worker.id(), worker.instance(), &dump);
                        true
                    }
                    Err(_) => false,
                }
            }
        };
        if !resync("start".into()).await {
            return;
        }
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => break,
                event = events.recv() => event,
            };
            let synced = match event {
                Ok(event) => match index.apply(&id, instance, &event) {
                    Applied::Applied | Applied::Duplicate => true,
                    Applied::Gap { expected } => resync(format!("event {} after {}", event.event_id, expected)).await,
                },
                Err(RecvError::Lagged(missed)) => resync(format!("missed {missed} events")).await,
                Err(RecvError::Closed) => false,
            };
            if !synced {
                break;
            }
        }
        index.remove_worker(&id);
    })
}

/// Publishes `worker`'s KV events to `log` until `shutdown` (or the engine
/// stops): every event available at once goes into one batch. While Redis
/// is unreachable a bounded number of batches wait; beyond that the oldest
/// are dropped, which followers see as a gap and repair with a dump.
pub fn publish_events(worker: Arc<Worker>, log: turbine_kv_log::EventLog, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut events = worker.engine().subscribe_events();
        let mut publisher = turbine_kv_log::Publisher::new(log, PENDING_BATCHES);
        loop {
            let mut batch = Vec::new();
            // Wait for an event unless batches are already waiting for Redis.
            if publisher.is_idle() {
                let event = tokio::select! {
                    () = shutdown.cancelled() => break,
                    event = events.recv() => event,
                };
                match event {
                    Ok(event) => batch.push(event),
                    // Missed events leave a gap in the numbering: followers
                    // load a dump.
                    Err(RecvError::Lagged(missed)) => tracing::warn!(missed, "KV events dropped before publishing"),
                    Err(RecvError::Closed) => break,
                }
            }
            while batch.len() < BATCH_EVENTS {
                match events.try_recv() {
                    Ok(event) => batch.push(event),
                    Err(TryRecvError::Lagged(missed)) => tracing::warn!(missed, "KV events dropped before publishing"),
                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                }
            }
            publisher.push(EventBatch { worker_id: worker.id().clone(), instance: worker.instance(), events: batch });
            if !publisher.flush(&shutdown).await {
                return;
            }
        }
    })
}
