//! Running a worker process: servers up first (NOT_SERVING), model loaded,
//! registered under a lease, SERVING; on shutdown: NOT_SERVING,
//! deregistered, in-flight streams drained, engine stopped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use turbine_proto::service_names;
use turbine_proto::worker::v1::{FILE_DESCRIPTOR_SET, kv_transfer_server::KvTransferServer, worker_server::WorkerServer};
use turbine_registry::{Lease, RedisRegistry, Registry, WorkerLoad, WorkerRecord};
use turbine_runtime::grpc::{MAX_MESSAGE_BYTES, base_routes, serve as serve_grpc};
use turbine_runtime::health::Readiness;
use turbine_runtime::{CancellationToken, admin};

use crate::config::WorkerConfig;
use crate::disagg::service::KvTransferService;
use crate::metrics::register_engine;
use crate::service::WorkerService;
use crate::worker::Worker;

/// Binds `addr`, naming what it is for in the error.
pub async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("cannot bind the {what} listener on {addr}"))
}

/// The registry record of a worker with its current load.
pub fn worker_record(worker: &Worker, endpoint: &str) -> WorkerRecord {
    let load = worker.load();
    WorkerRecord {
        worker_id: worker.id().to_owned(),
        endpoint: endpoint.to_owned(),
        model: worker.card().name.clone(),
        load: WorkerLoad { running: load.running, waiting: load.waiting, blocks_used: load.blocks_used, blocks_total: load.blocks_total },
        kv_block_size: worker.block_size() as u32,
        instance: worker.instance(),
        role: worker.role(),
    }
}

/// The endpoint other services should use to reach a server bound at `bound`.
pub fn advertised_endpoint(configured: Option<&str>, bound: SocketAddr) -> String {
    if let Some(endpoint) = configured {
        return turbine_runtime::grpc::endpoint_uri(endpoint);
    }
    if bound.ip().is_unspecified() {
        format!("http://{}:{}", hostname(), bound.port())
    } else {
        format!("http://{bound}")
    }
}

fn hostname() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own
    // and NUL-terminates on success; we read only up to the first NUL.
    #[allow(unsafe_code)]
    let result = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) };
    if result != 0 {
        return "localhost".to_owned();
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

/// Runs a worker process until `shutdown` fires, then drains and returns.
pub async fn run(config: WorkerConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let grpc_listener = bind(config.grpc_addr, "gRPC").await?;
    let admin_listener = bind(config.admin_addr, "admin").await?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    let endpoint = advertised_endpoint(config.advertise.as_deref(), grpc_addr);
    let registry = match &config.redis {
        Some(url) => Some(Registry::Redis(RedisRegistry::new(url, &config.namespace)?)),
        None => None,
    };

    let (readiness, health) = Readiness::new(&[service_names::WORKER]).await;
    let service = WorkerService::new();
    let transfer = KvTransferService::new();
    let routes = base_routes(health, &[FILE_DESCRIPTOR_SET])
        .add_service(WorkerServer::new(service.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES))
        .add_service(
            KvTransferServer::new(transfer.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        );
    let grace = Duration::from_secs_f64(config.shutdown_grace_secs);
    let grpc_task = tokio::spawn(serve_grpc(grpc_listener, routes, shutdown.clone(), grace));
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(admin_listener, readiness.clone(), admin_stop.clone()));
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, %endpoint, "worker listening; loading model");

    let loading = tokio::task::spawn_blocking({
        let config = config.clone();
        move || Worker::start(&config)
    });
    let worker = tokio::select! {
        loaded = loading => loaded.context("model loading panicked")??,
        () = shutdown.cancelled() => {
            admin_stop.cancel();
            return Ok(());
        }
    };
    worker.disagg().set_endpoint(endpoint.clone());
    transfer.set(worker.disagg().clone());
    service.set_worker(worker.clone());
    let _metrics = register_engine(worker.id(), worker.engine().clone());

    let lease = registry.clone().map(|registry| {
        let worker = worker.clone();
        let endpoint = endpoint.clone();
        Lease::start(registry, Duration::from_secs_f64(config.lease_ttl_secs), move || worker_record(&worker, &endpoint))
    });
    let publisher = match &config.redis {
        Some(url) => Some(crate::kv_events::publish_events(worker.clone(), turbine_kv_log::EventLog::new(url, &config.namespace)?, shutdown.clone())),
        None => None,
    };
    let probe_registry = registry.clone();
    readiness.watch_dependencies(Duration::from_secs(1), shutdown.clone(), move || {
        let registry = probe_registry.clone();
        async move {
            match &registry {
                Some(registry) => registry.ping().await.is_ok(),
                None => true,
            }
        }
    })
    .await;
    tracing::info!(worker = %worker.id(), model = %worker.card().name, %endpoint, "worker ready");

    shutdown.cancelled().await;
    readiness.drain().await;
    if let Some(lease) = lease {
        lease.revoke().await;
    }
    let served = grpc_task.await.context("gRPC server panicked")?;
    worker.shutdown();
    if let Some(publisher) = publisher {
        let _ = publisher.await;
    }
    admin_stop.cancel();
    let _ = admin_task.await;
    served.context("gRPC server failed")?;
    tracing::info!(worker = %worker.id(), "worker stopped");
    Ok(())
}

/// Entry point shared by `turbine-worker` and `turbine worker`.
pub fn main(args: crate::WorkerArgs) -> std::process::ExitCode {
    turbine_runtime::run_service("turbine-worker", move |shutdown| async move {
        let config = args.load()?;
        run(config, shutdown).await
    })
}

/// For embedded use: keeps a local worker registered with a heartbeat.
pub fn register_local(registry: Registry, worker: Arc<Worker>, ttl: Duration) -> Lease {
    let endpoint = format!("local://{}", worker.id());
    Lease::start(registry, ttl, move || worker_record(&worker, &endpoint))
}

/// For embedded use: serves an in-process worker's KvTransfer (and Worker)
/// on a loopback port, so its prefills can be read by other workers over
/// real sockets (UCX, or the gRPC stream). Returns the endpoint and the
/// server task (ends when `shutdown` fires).
pub async fn serve_transfer_loopback(worker: Arc<Worker>, shutdown: CancellationToken) -> anyhow::Result<(String, tokio::task::JoinHandle<anyhow::Result<()>>)> {
    let listener = bind(([127, 0, 0, 1], 0).into(), "KV transfer").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let service = WorkerService::new();
    service.set_worker(worker.clone());
    worker.disagg().set_endpoint(endpoint.clone());
    let transfer = KvTransferService::new();
    transfer.set(worker.disagg().clone());
    let routes = tonic::service::Routes::new(
        KvTransferServer::new(transfer).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES),
    )
    .add_service(WorkerServer::new(service).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES));
    let task = tokio::spawn(async move { serve_grpc(listener, routes, shutdown, Duration::from_secs(1)).await.map_err(anyhow::Error::from) });
    Ok((endpoint, task))
}
