//! Clients for the workers the router hands out: in-process workers by id
//! (`local://<id>` endpoints), remote ones by endpoint, connected lazily
//! and reused (one HTTP/2 connection per worker, multiplexed).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::RwLock;
use turbine_router::RoutedWorker;
use turbine_worker::{Worker, WorkerClient};

use crate::error::{ErrorKind, GatewayError};

/// Endpoint scheme of workers living in this process.
pub const LOCAL_SCHEME: &str = "local://";

/// Worker clients by identity.
#[derive(Debug, Clone, Default)]
pub struct WorkerPool {
    local: Arc<HashMap<String, WorkerClient>>,
    remote: Arc<RwLock<HashMap<String, WorkerClient>>>,
}

impl WorkerPool {
    /// A pool that knows the given in-process workers.
    pub fn new(local: &[Arc<Worker>]) -> Self {
        let local = local.iter().map(|worker| (worker.id().to_owned(), WorkerClient::Local(worker.clone()))).collect();
        Self { local: Arc::new(local), remote: Arc::default() }
    }

    /// The client for a routed worker.
    pub fn client(&self, worker: &RoutedWorker) -> Result<WorkerClient, GatewayError> {
        if worker.endpoint.starts_with(LOCAL_SCHEME) {
            return self
                .local
                .get(&worker.worker_id)
                .cloned()
                .ok_or_else(|| GatewayError::new(ErrorKind::Internal, format!("in-process worker {} is unknown", worker.worker_id)));
        }
        if let Some(client) = self.remote.read().get(&worker.endpoint) {
            return Ok(client.clone());
        }
        let client = WorkerClient::connect(&worker.endpoint)?;
        Ok(self.remote.write().entry(worker.endpoint.clone()).or_insert(client).clone())
    }

    /// Forgets remote clients whose endpoints are no longer live.
    pub fn retain(&self, live_endpoints: &HashSet<&str>) {
        self.remote.write().retain(|endpoint, _| live_endpoints.contains(endpoint.as_str()));
    }
}
