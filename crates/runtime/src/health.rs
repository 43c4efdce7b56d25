//! Readiness: one switch that drives gRPC health (`grpc.health.v1`, the
//! overall "" service and each named service) and the `/readyz` endpoint.
//!
//! A service starts NOT_SERVING, turns SERVING once its dependencies answer
//! (see [`Readiness::watch_dependencies`]), and goes back to NOT_SERVING
//! when one stops answering or the process starts draining.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;

/// The readiness of one service process.
#[derive(Debug, Clone)]
pub struct Readiness {
    reporter: HealthReporter,
    services: Arc<Vec<String>>,
    ready: Arc<AtomicBool>,
    draining: Arc<AtomicBool>,
    /// Whether it was ever SERVING (in a balancer's rotation).
    served: Arc<AtomicBool>,
}

impl Readiness {
    /// Creates the readiness of a process serving `services` (fully
    /// qualified gRPC names), NOT_SERVING, and the health service to mount.
    pub async fn new(services: &[&str]) -> (Self, HealthServer<impl Health>) {
        let (reporter, server) = tonic_health::server::health_reporter();
        let readiness = Self {
            reporter,
            services: Arc::new(services.iter().map(|s| s.to_string()).collect()),
            ready: Arc::new(AtomicBool::new(false)),
            draining: Arc::new(AtomicBool::new(false)),
            served: Arc::new(AtomicBool::new(false)),
        };
        readiness.publish(false).await;
        (readiness, server)
    }

    /// Whether the process is ready for traffic.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Marks the process ready or not. Ignored once draining began.
    pub async fn set_ready(&self, ready: bool) {
        if self.draining.load(Ordering::Acquire) {
            return;
        }
        if self.ready.swap(ready, Ordering::AcqRel) != ready {
            tracing::info!(ready, "readiness changed");
        }
        if ready {
            self.served.store(true, Ordering::Release);
        }
        self.publish(ready).await;
    }

    /// Whether the process was ever ready: only then may a balancer or an
    /// orchestrator have sent it traffic, so only then does its drain
    /// delay wait for them to see it leave.
    pub fn has_served(&self) -> bool {
        self.served.load(Ordering::Acquire)
    }

    /// Marks the process as draining: NOT_SERVING for good.
    pub async fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.ready.store(false, Ordering::Release);
        self.publish(false).await;
    }

    async fn publish(&self, ready: bool) {
        let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
        self.reporter.set_service_status("", status).await;
        for service in self.services.iter() {
            self.reporter.set_service_status(service, status).await;
        }
    }

    /// Runs `probe` once and sets readiness to its answer before returning
    /// (so a caller that then announces itself ready is), then spawns a task
    /// that probes again every `interval` until `shutdown` fires.
    pub async fn watch_dependencies<P, F>(&self, interval: Duration, shutdown: CancellationToken, probe: P) -> tokio::task::JoinHandle<()>
    where
        P: Fn() -> F + Send + 'static,
        F: Future<Output = bool> + Send,
    {
        tokio::select! {
            ready = probe() => self.set_ready(ready).await,
            () = shutdown.cancelled() => {}
        }
        let readiness = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = shutdown.cancelled() => return,
                }
                let ready = tokio::select! {
                    ready = probe() => ready,
                    () = shutdown.cancelled() => return,
                };
                readiness.set_ready(ready).await;
            }
        })
    }
}

/// Waits until `service` (`""`: the whole server) at `endpoint` reports
/// SERVING, following the server's own health stream (`Health/Watch`):
/// no polling while it answers. While it cannot be reached the watch is
/// retried every 50 ms, so the caller bounds the wait (a timeout, or the
/// server's task ending).
/// `role` is the server's: over mutual TLS (the process's identity set,
/// [`crate::trust::TlsConfig::establish`]) its certificate must name it.
pub async fn until_serving(endpoint: &str, role: crate::host::Role, service: &str) {
    until_serving_over(|| crate::grpc::channel(endpoint, role).ok(), service).await
}

/// [`until_serving`] over the channels `connect` makes (a mutual TLS one:
/// [`crate::grpc::tls_channel`]).
pub async fn until_serving_over(connect: impl Fn() -> Option<crate::grpc::TracedChannel>, service: &str) {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus as Status;
    use tonic_health::pb::health_client::HealthClient;

    loop {
        if let Some(channel) = connect() {
            let mut client = HealthClient::new(channel);
            if let Ok(response) = client.watch(HealthCheckRequest { service: service.to_owned() }).await {
                let mut statuses = response.into_inner();
                while let Ok(Some(update)) = statuses.message().await {
                    if update.status() == Status::Serving {
                        return;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
