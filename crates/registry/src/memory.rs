//! The in-process registry of `turbine run`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{LiveWorker, WorkerId, WorkerRecord};

/// Workers in a map guarded by a mutex; expired leases vanish on read.
#[derive(Debug, Clone, Default)]
pub struct MemoryRegistry {
    workers: Arc<Mutex<BTreeMap<WorkerId, LiveWorker>>>,
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn put(&self, record: &WorkerRecord, ttl: Duration) {
        let live = LiveWorker::new(record.clone(), Instant::now() + ttl);
        self.workers.lock().insert(record.worker_id.clone(), live);
    }

    pub(crate) fn remove(&self, worker_id: &str) {
        self.workers.lock().remove(worker_id);
    }

    pub(crate) fn list(&self) -> Vec<LiveWorker> {
        let now = Instant::now();
        let mut workers = self.workers.lock();
        workers.retain(|_, worker| worker.expires_at > now);
        workers.values().cloned().collect()
    }
}
