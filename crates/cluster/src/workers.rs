//! The cluster's workers, each served by its own `turbine_worker::serve` in
//! this process: the ones the cluster starts with, and those its planner
//! adds and drains ([`WorkerHost`]). Each has a stop token of its own
//! under the cluster's, so one can drain while the others serve.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;
use turbine_kv::WorkerId;
use turbine_planner::PoolKind;
use turbine_planner::act::scale::{HostError, HostFuture, WorkerHost};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{BoundAddrs, Listeners};
use turbine_worker::{WorkerConfig, WorkerDeps, WorkerRole};

use crate::EmbeddedWorker;

/// How long a worker may take to load its model.
pub(crate) const LOAD_TIMEOUT: Duration = Duration::from_secs(600);

/// What every worker of the cluster is started with.
#[derive(Debug, Clone)]
pub(crate) struct WorkerTemplate {
    /// The configuration, less the worker id and role.
    pub config: WorkerConfig,
    pub deps: WorkerDeps,
    /// Prefixed to every worker id.
    pub prefix: String,
}

#[derive(Debug)]
struct Running {
    id: WorkerId,
    role: WorkerRole,
    /// Loaded and registered (a worker still loading is not counted).
    serving: bool,
    stop: CancellationToken,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

#[derive(Debug, Default)]
struct Fleet {
    /// In start order.
    running: Vec<Running>,
    /// The next number of each role's worker names (never reused).
    next: [usize; 3],
}

/// The cluster's workers. Cloning shares them.
#[derive(Debug, Clone)]
pub struct HostedWorkers {
    template: Arc<WorkerTemplate>,
    /// Stops every worker (the cluster's services token).
    shutdown: CancellationToken,
    fleet: Arc<Mutex<Fleet>>,
}

fn slot(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Aggregated => 0,
        WorkerRole::Prefill => 1,
        WorkerRole::Decode => 2,
    }
}

fn role_of(kind: PoolKind) -> WorkerRole {
    match kind {
        PoolKind::Aggregated => WorkerRole::Aggregated,
        PoolKind::Prefill => WorkerRole::Prefill,
        PoolKind::Decode => WorkerRole::Decode,
    }
}

impl HostedWorkers {
    pub(crate) fn new(template: WorkerTemplate, shutdown: CancellationToken) -> Self {
        Self { template: Arc::new(template), shutdown, fleet: Arc::default() }
    }

    /// Starts a worker of `role` (`worker-N`, `prefill-N` or `decode-N`);
    /// it loads its model in the background ([`until_serving`](Self::until_serving)).
    pub(crate) async fn spawn(&self, role: WorkerRole) -> anyhow::Result<(WorkerId, BoundAddrs)> {
        let name = {
            let mut fleet = self.fleet.lock().expect("fleet");
            let number = fleet.next[slot(role)];
            fleet.next[slot(role)] += 1;
            match role {
                WorkerRole::Aggregated => format!("worker-{number}"),
                WorkerRole::Prefill => format!("prefill-{number}"),
                WorkerRole::Decode => format!("decode-{number}"),
            }
        };
        let id = WorkerId::from(format!("{}{name}", self.template.prefix));
        let config = WorkerConfig { worker_id: Some(id.to_string()), role, ..self.template.config.clone() };
        let listeners = Listeners::loopback().await?;
        let addresses = BoundAddrs { grpc: listeners.grpc.local_addr()?, admin: listeners.admin.as_ref().map(|l| l.local_addr()).transpose()?, http: None };
        let stop = self.shutdown.child_token();
        let task = tokio::spawn(turbine_worker::serve(config, self.template.deps.clone(), listeners, stop.clone()));
        self.fleet.lock().expect("fleet").running.push(Running { id: id.clone(), role, serving: false, stop, task: Some(task) });
        Ok((id, addresses))
    }

    /// Waits until worker `id` (at `addresses`) serves, up to
    /// [`LOAD_TIMEOUT`]; its client. A worker that fails to start is
    /// stopped and forgotten.
    pub(crate) async fn until_serving(&self, id: &WorkerId, addresses: BoundAddrs) -> anyhow::Result<EmbeddedWorker> {
        let mut task = self.with(id, |running| running.task.take()).flatten().context("an unknown worker")?;
        let endpoint = addresses.grpc_endpoint();
        let failed = tokio::select! {
            () = turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Worker, turbine_proto::service_names::WORKER) => None,
            ended = &mut task => Some(ended.context("a worker panicked")?.err().unwrap_or_else(|| anyhow::anyhow!("worker {id} stopped before it was ready"))),
            () = tokio::time::sleep(LOAD_TIMEOUT) => Some(anyhow::anyhow!("worker {id} did not load its model within {LOAD_TIMEOUT:?}")),
        };
        if let Some(error) = failed {
            if let Some(running) = self.forget(id) {
                running.stop.cancel();
            }
            task.abort();
            return Err(error);
        }
        let client = self.template.deps.local.as_ref().context("the cluster's workers are called directly")?.client(id, &endpoint)?;
        self.with(id, |running| {
            running.serving = true;
            running.task = Some(task);
        });
        Ok(EmbeddedWorker { id: id.clone(), client, addresses })
    }

    /// Runs `change` on worker `id`'s entry, if it runs.
    fn with<T>(&self, id: &WorkerId, change: impl FnOnce(&mut Running) -> T) -> Option<T> {
        self.fleet.lock().expect("fleet").running.iter_mut().find(|running| running.id == *id).map(change)
    }

    fn forget(&self, id: &WorkerId) -> Option<Running> {
        let mut fleet = self.fleet.lock().expect("fleet");
        let at = fleet.running.iter().position(|running| running.id == *id)?;
        Some(fleet.running.remove(at))
    }

    /// Every worker's task, to await once the cluster stops.
    pub(crate) fn take_tasks(&self) -> Vec<(String, JoinHandle<anyhow::Result<()>>)> {
        let mut fleet = self.fleet.lock().expect("fleet");
        fleet.running.iter_mut().filter_map(|running| Some((format!("worker {}", running.id), running.task.take()?))).collect()
    }
}

impl WorkerHost for HostedWorkers {
    /// A pool is the workers of its kind's role.
    fn workers(&self, _pool: &str, kind: PoolKind) -> Vec<String> {
        let role = role_of(kind);
        let fleet = self.fleet.lock().expect("fleet");
        fleet.running.iter().filter(|running| running.role == role && running.serving).map(|running| running.id.to_string()).collect()
    }

    fn start<'a>(&'a self, _pool: &'a str, kind: PoolKind) -> HostFuture<'a, Result<String, HostError>> {
        Box::pin(async move {
            let (id, addresses) = self.spawn(role_of(kind)).await.map_err(|error| HostError::Launch(format!("{error:#}")))?;
            tracing::info!(worker = %id, role = %role_of(kind), "starting a worker");
            match self.until_serving(&id, addresses).await {
                Ok(_) => Ok(id.to_string()),
                Err(error) => Err(HostError::NotServing { name: id.to_string(), why: format!("{error:#}") }),
            }
        })
    }

    fn drain(&self, name: &str) -> HostFuture<'static, Result<(), HostError>> {
        let id = WorkerId::from(name.to_owned());
        // Out of the list before the drain starts.
        let running = self.forget(&id);
        Box::pin(async move {
            let running = running.ok_or_else(|| HostError::Unknown(id.to_string()))?;
            running.stop.cancel();
            let Some(task) = running.task else { return Ok(()) };
            match task.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(error)) => Err(HostError::Stopped(format!("{error:#}"))),
                Err(error) => Err(HostError::Stopped(format!("it panicked: {error}"))),
            }
        })
    }
}
