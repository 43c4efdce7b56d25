//! A worker's KV events (its engine's, or an external engine's mirrored):
//! fed to an index in the same process, or published to the KV event log
//! (a Redis stream) for every router and kv-index.
//!
//! The in-process feed subscribes to the engine's events first, then loads a dump, so
//! nothing falls between the two: events the dump already reflects are
//! duplicates and skipped. A lagging feed (the engine's event buffer
//! overflowed) or a numbering gap resynchronises from a fresh dump.

use std::sync::Arc;

use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use turbine_kv::index::Applied;
use turbine_kv::{Dump, EventBatch, KvIndex, NumberedEvent, WorkerId};
use turbine_runtime::CancellationToken;

use crate::external::ExternalWorker;
use crate::worker::Worker;

/// A worker whose cache's events are followed: one with its own engine,
/// or one mirroring an external engine's events.
#[tonic::async_trait]
pub trait KvEventSource: Send + Sync + 'static {
    /// The worker id.
    fn id(&self) -> &WorkerId;
    /// This start's incarnation number.
    fn instance(&self) -> u64;
    /// The events from now on.
    fn subscribe_events(&self) -> broadcast::Receiver<NumberedEvent>;
    /// Every cached block as of one event number (`None`: the engine
    /// stopped).
    async fn dump(&self) -> Option<Dump>;
}

#[tonic::async_trait]
impl KvEventSource for Worker {
    fn id(&self) -> &WorkerId {
        Worker::id(self)
    }

    fn instance(&self) -> u64 {
        Worker::instance(self)
    }

    fn subscribe_events(&self) -> broadcast::Receiver<NumberedEvent> {
        self.engine().subscribe_events()
    }

    async fn dump(&self) -> Option<Dump> {
        self.engine().dump().await.ok()
    }
}

#[tonic::async_trait]
impl KvEventSource for ExternalWorker {
    fn id(&self) -> &WorkerId {
        ExternalWorker::id(self)
    }

    fn instance(&self) -> u64 {
        ExternalWorker::instance(self)
    }

    fn subscribe_events(&self) -> broadcast::Receiver<NumberedEvent> {
        ExternalWorker::subscribe_events(self)
    }

    async fn dump(&self) -> Option<Dump> {
        Some(ExternalWorker::dump(self))
    }
}

/// Keeps `index` in step with `worker`'s prefix cache until `shutdown`
/// (or the engine stops); the worker is removed from the index then.
pub fn feed_index<W: KvEventSource>(worker: Arc<W>, index: Arc<KvIndex>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let id = worker.id().to_owned();
        let instance = worker.instance();
        let mut events = worker.subscribe_events();
        let resync = |reason: String| {
            let worker = worker.clone();
            let index = index.clone();
            async move {
                tracing::debug!(worker = %worker.id(), reason, "resynchronising the KV index from a dump");
                match worker.dump().await {
                    Some(dump) => {
                        index.load_dump(worker.id(), worker.instance(), &dump);
                        true
                    }
                    None => false,
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
pub fn publish_events<W: KvEventSource>(worker: Arc<W>, log: turbine_kv_log::EventLog, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let events = worker.subscribe_events();
        let (worker_id, instance) = (worker.id().clone(), worker.instance());
        turbine_kv_log::publish_all(events, log, shutdown, "KV events", |events| vec![EventBatch { worker_id: worker_id.clone(), instance, events }]).await;
    })
}
