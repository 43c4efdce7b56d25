//! A worker's registration kept alive by heartbeats.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{Registry, WorkerId, WorkerRecord};

/// A registration renewed every `ttl / 3` until revoked. The record is
/// re-read from `current` at each heartbeat, so it carries the latest load.
#[derive(Debug)]
pub struct Lease {
    registry: Registry,
    worker_id: WorkerId,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    /// Whether the last put reached the registry.
    registered: watch::Receiver<bool>,
}

impl Lease {
    /// Registers the worker (retrying in the background if the registry is
    /// unreachable) and starts heartbeating.
    pub fn start<F>(registry: Registry, ttl: Duration, current: F) -> Self
    where
        F: Fn() -> WorkerRecord + Send + Sync + 'static,
    {
        let current = Arc::new(current);
        let worker_id = current().worker_id;
        let stop = CancellationToken::new();
        let interval = (ttl / 3).max(Duration::from_millis(50));
        let (registering, registered) = watch::channel(false);
        let task = tokio::spawn({
            let registry = registry.clone();
            let stop = stop.clone();
            async move {
                let mut healthy = true;
                loop {
                    let record = current();
                    let put = registry.put(&record, ttl).await;
                    registering.send_replace(put.is_ok());
                    match put {
                        Ok(()) if !healthy => {
                            tracing::info!(worker = %record.worker_id, "registry reachable again; lease renewed");
                            healthy = true;
                        }
                        Ok(()) => {}
                        Err(error) if healthy => {
                            tracing::warn!(worker = %record.worker_id, %error, "lease renewal failed; retrying");
                            healthy = false;
                        }
                        Err(_) => {}
                    }
                    tokio::select! {
                        () = tokio::time::sleep(interval) => {}
                        () = stop.cancelled() => return,
                    }
                }
            }
        });
        Self { registry, worker_id, stop, task: Some(task), registered }
    }

    /// Whether the worker is listed (the last put, the first right after
    /// start, reached the registry), as it changes. A worker reports
    /// SERVING only once it is, so that whoever waits for it to serve also
    /// finds it listed.
    pub fn registration(&self) -> watch::Receiver<bool> {
        self.registered.clone()
    }

    /// Stops heartbeating and removes the registration at once.
    pub async fn revoke(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        if let Err(error) = self.registry.remove(&self.worker_id).await {
            tracing::warn!(worker = %self.worker_id, %error, "deregistration failed; the lease will expire");
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Not revoked: stop renewing and let the lease expire.
        self.stop.cancel();
    }
}
