//! The `local` connector: each pool's workers are `turbine-worker`
//! processes on this machine, started and stopped by the planner through
//! the one scale loop ([`Scaler`]).
//!
//! - Scaling up starts workers (the pool's role, the planner's Redis and
//!   namespace, the operator's `--local-worker-args`, loopback ports) and
//!   waits until each serves: registered, and so routable. One that does
//!   not serve in time is stopped and the action fails, naming its log.
//! - Scaling down drains: the newest workers get SIGTERM, on which a worker
//!   leaves the registry first (routers stop sending it work), lets its
//!   in-flight streams finish and exits. One still running after the drain
//!   timeout is killed.
//! - Each worker has a record in the state folder (its pool, pid and
//!   name; its log and bound addresses beside). A planner started again on
//!   the same folder adopts the workers still running, so a planner
//!   restart leaves the fleet serving. The workers outlive the planner.
//! - An action's id is carried out once: handed over again (after a
//!   restart), it answers what it answered the first time, or sets the
//!   pool to the same size, which changes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use turbine_proto::service_names;
use turbine_runtime::host::BoundAddrs;

use crate::act::connector::Outcome;
use crate::act::scale::{HostError, HostFuture, Scaler, WorkerHost};
use crate::plan::Action;
use crate::plan::PoolKind;

/// The state folder's file holding the next worker's number.
const NEXT_FILE: &str = "next-worker";

/// How often a wait looks again (a worker's addresses, its exit).
const POLL: Duration = Duration::from_millis(50);

/// What the local connector needs.
#[derive(Debug, Clone)]
pub struct LocalSettings {
    /// The executable: `turbine-worker`, or `turbine` with the
    /// subcommand `worker`.
    pub worker_binary: PathBuf,
    /// The subcommand before the flags (`worker` for `turbine`).
    pub worker_subcommand: Option<String>,
    /// Flags every worker gets (engine, model, cache sizes), after the
    /// connector's own.
    pub worker_args: Vec<String>,
    /// Where each worker's record, log and addresses live.
    pub state_dir: PathBuf,
    /// The registry the workers join.
    pub redis: String,
    /// The deployment's namespace.
    pub namespace: String,
    /// How long a started worker has to serve.
    pub ready_timeout: Duration,
    /// How long a draining worker has to exit before it is killed.
    pub drain_timeout: Duration,
}

/// A worker's record in the state folder.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    name: String,
    pool: String,
    pid: u32,
}

#[derive(Debug)]
struct LocalWorker {
    record: Record,
    /// Started by this planner (an adopted worker has none).
    child: Option<tokio::process::Child>,
}

#[derive(Debug, Default)]
struct Fleet {
    /// Serving workers per pool, oldest first.
    serving: BTreeMap<String, Vec<LocalWorker>>,
    /// The next worker's number.
    next: u64,
}

/// Worker processes on this machine, as a [`WorkerHost`]: what the local
/// connector's [`Scaler`] starts and drains.
#[derive(Debug)]
struct LocalHost {
    settings: Arc<LocalSettings>,
    fleet: Mutex<Fleet>,
}

/// The local connector. Cloning shares the fleet.
#[derive(Debug, Clone)]
pub struct LocalConnector {
    host: Arc<LocalHost>,
    scaler: Scaler,
}

impl LocalConnector {
    /// The connector over `settings.state_dir` (created if missing),
    /// adopting the workers its records name that still run.
    pub fn open(settings: LocalSettings) -> std::io::Result<Self> {
        std::fs::create_dir_all(&settings.state_dir)?;
        let mut fleet = Fleet::default();
        for entry in std::fs::read_dir(&settings.state_dir)? {
            let path = entry?.path();
            if path.extension().is_none_or(|extension| extension != "worker") {
                continue;
            }
            let record: Option<Record> = std::fs::read(&path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok());
            let Some(record) = record else {
                tracing::warn!(path = %path.display(), "an unreadable worker record; ignored");
                continue;
            };
            if let Some(number) = record.name.rsplit('-').next().and_then(|number| number.parse::<u64>().ok()) {
                fleet.next = fleet.next.max(number + 1);
            }
            if runs(record.pid, &record.name) {
                tracing::info!(worker = record.name, pool = record.pool, pid = record.pid, "adopted a running worker");
                fleet.serving.entry(record.pool.clone()).or_default().push(LocalWorker { record, child: None });
            } else {
                remove_files(&settings.state_dir, &record.name);
            }
        }
        for workers in fleet.serving.values_mut() {
            workers.sort_by_key(|worker| number_of(&worker.record.name));
        }
        // Names are never reused, not even those of workers gone since.
        if let Some(next) = std::fs::read_to_string(settings.state_dir.join(NEXT_FILE)).ok().and_then(|text| text.trim().parse::<u64>().ok()) {
            fleet.next = fleet.next.max(next);
        }
        let host = Arc::new(LocalHost { settings: Arc::new(settings), fleet: Mutex::new(fleet) });
        Ok(Self { scaler: Scaler::new(host.clone()), host })
    }

    /// Serving workers of `pool`, as the connector knows them (exited ones
    /// dropped).
    pub fn serving(&self, pool: &str) -> u32 {
        self.host.workers(pool, PoolKind::Aggregated).len() as u32
    }

    /// Workers with a record in the state folder whose process runs,
    /// serving or draining, whichever process started them (this
    /// connector, a planner started earlier on the folder, or one running
    /// beside): what the fleet costs now.
    pub fn running(&self) -> u32 {
        self.running_by_pool().values().sum()
    }

    /// [`running`](Self::running), per pool (pools with none left out).
    pub fn running_by_pool(&self) -> BTreeMap<String, u32> {
        let mut pools = BTreeMap::new();
        let Ok(entries) = std::fs::read_dir(&self.host.settings.state_dir) else { return pools };
        let records = entries
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| path.extension().is_some_and(|extension| extension == "worker"))
            .filter_map(|path| serde_json::from_slice::<Record>(&std::fs::read(path).ok()?).ok())
            .filter(|record| runs(record.pid, &record.name));
        for record in records {
            *pools.entry(record.pool).or_default() += 1;
        }
        pools
    }

    /// Workers draining now, over all pools.
    pub fn draining(&self) -> u32 {
        self.scaler.draining()
    }

    /// Workers of `pool` draining now.
    pub fn draining_in(&self, pool: &str) -> u32 {
        self.scaler.draining_in(pool)
    }

    /// Sets `action.pool` (of `kind`) to `action.replicas` workers.
    pub async fn execute(&self, action: &Action, kind: PoolKind) -> Outcome {
        self.scaler.execute(action, kind).await
    }
}

impl WorkerHost for LocalHost {
    fn workers(&self, pool: &str, _kind: PoolKind) -> Vec<String> {
        let mut fleet = self.fleet.lock().expect("fleet");
        self.reap(&mut fleet);
        fleet.serving.get(pool).map(|workers| workers.iter().map(|worker| worker.record.name.clone()).collect()).unwrap_or_default()
    }

    fn start<'a>(&'a self, pool: &'a str, kind: PoolKind) -> HostFuture<'a, Result<String, HostError>> {
        Box::pin(self.start_one(pool, kind))
    }

    fn drain(&self, name: &str) -> HostFuture<'static, Result<(), HostError>> {
        let leaving = {
            let mut fleet = self.fleet.lock().expect("fleet");
            fleet.serving.values_mut().find_map(|workers| {
                let at = workers.iter().position(|worker| worker.record.name == name)?;
                Some(workers.remove(at))
            })
        };
        let Some(worker) = leaving else {
            let name = name.to_owned();
            return Box::pin(async move { Err(HostError::Unknown(name)) });
        };
        Box::pin(drain(self.settings.clone(), worker))
    }
}

impl LocalHost {
    /// Starts one worker of `pool` and waits until it serves; its name.
    async fn start_one(&self, pool: &str, kind: PoolKind) -> Result<String, HostError> {
        let settings = &self.settings;
        let name = {
            let mut fleet = self.fleet.lock().expect("fleet");
            let name = format!("{}-{pool}-{}", settings.namespace, fleet.next);
            fleet.next += 1;
            std::fs::write(settings.state_dir.join(NEXT_FILE), fleet.next.to_string())
                .map_err(|error| HostError::Launch(format!("cannot write {}: {error}", settings.state_dir.join(NEXT_FILE).display())))?;
            name
        };
        let files = Files::of(&settings.state_dir, &name);
        let log = std::fs::File::create(&files.log).map_err(|error| HostError::Launch(format!("cannot create {}: {error}", files.log.display())))?;
        let log_too = log.try_clone().map_err(|error| HostError::Launch(format!("{}: {error}", files.log.display())))?;
        let _ = std::fs::remove_file(&files.addresses);
        let role = match kind {
            PoolKind::Aggregated => "aggregated",
            PoolKind::Prefill => "prefill",
            PoolKind::Decode => "decode",
        };
        let mut command = tokio::process::Command::new(&settings.worker_binary);
        command
            .args(&settings.worker_subcommand)
            .args(["--redis", &settings.redis, "--namespace", &settings.namespace, "--role", role, "--worker-id", &name])
            .args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--addresses-file"])
            .arg(&files.addresses)
            .args(&settings.worker_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_too)
            // Its own process group: a signal to the planner's terminal
            // does not reach the fleet.
            .process_group(0);
        let mut child = command.spawn().map_err(|error| HostError::Launch(format!("cannot start {}: {error}", settings.worker_binary.display())))?;
        let pid = child.id().unwrap_or(0);
        let record = Record { name: name.clone(), pool: pool.to_owned(), pid };
        let written = serde_json::to_vec(&record)
            .map_err(|error| error.to_string())
            .and_then(|json| std::fs::write(&files.record, json).map_err(|error| error.to_string()));
        if let Err(problem) = written {
            let _ = child.start_kill();
            return Err(HostError::Launch(format!("cannot write {}: {problem}", files.record.display())));
        }
        tracing::info!(worker = name, pool, pid, "starting a worker");
        match self.until_serving(&mut child, &files).await {
            Ok(()) => {
                tracing::info!(worker = name, pool, "worker serving");
                self.fleet.lock().expect("fleet").serving.entry(pool.to_owned()).or_default().push(LocalWorker { record, child: Some(child) });
                Ok(name)
            }
            Err(problem) => {
                let _ = child.start_kill();
                let _ = tokio::time::timeout(self.settings.drain_timeout, child.wait()).await;
                remove_files(&settings.state_dir, &name);
                Err(HostError::NotServing { name, why: format!("{problem} (its log: {})", files.log.display()) })
            }
        }
    }

    async fn until_serving(&self, child: &mut tokio::process::Child, files: &Files) -> Result<(), NotServing> {
        let timeout = self.settings.ready_timeout;
        let deadline = Instant::now() + timeout;
        let addresses = loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(NotServing::Exited { before: "listening", status: status.to_string() });
            }
            if let Some(addresses) = std::fs::read(&files.addresses).ok().and_then(|bytes| serde_json::from_slice::<BoundAddrs>(&bytes).ok()) {
                break addresses;
            }
            if Instant::now() >= deadline {
                return Err(NotServing::TooSlow { to: "listen", timeout });
            }
            tokio::time::sleep(POLL).await;
        };
        let endpoint = addresses.grpc_endpoint();
        tokio::select! {
            () = turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Worker, service_names::WORKER) => Ok(()),
            status = child.wait() => Err(NotServing::Exited { before: "serving", status: status.map_or_else(|error| error.to_string(), |status| status.to_string()) }),
            () = tokio::time::sleep_until(deadline.into()) => Err(NotServing::TooSlow { to: "serve", timeout }),
        }
    }

    /// Forgets workers that exited by themselves (a crash), saying so.
    fn reap(&self, fleet: &mut Fleet) {
        for workers in fleet.serving.values_mut() {
            workers.retain_mut(|worker| {
                let exited = match &mut worker.child {
                    Some(child) => !matches!(child.try_wait(), Ok(None)),
                    None => !runs(worker.record.pid, &worker.record.name),
                };
                if exited {
                    tracing::warn!(worker = worker.record.name, pool = worker.record.pool, "a worker exited by itself");
                    remove_files(&self.settings.state_dir, &worker.record.name);
                }
                !exited
            });
        }
    }
}

/// Why a started worker did not come to serve.
#[derive(Debug, thiserror::Error)]
enum NotServing {
    /// Its process ended first.
    #[error("exited ({status}) before {before}")]
    Exited { before: &'static str, status: String },
    /// The wait ran out.
    #[error("did not {to} within {timeout:?}")]
    TooSlow { to: &'static str, timeout: Duration },
}

/// SIGTERMs `worker` and waits for it to exit (killed after the drain
/// timeout), then removes its files.
async fn drain(settings: Arc<LocalSettings>, mut worker: LocalWorker) -> Result<(), HostError> {
    let Record { name, pid, .. } = worker.record.clone();
    tracing::info!(worker = name, pid, "draining a worker");
    signal(pid, libc::SIGTERM);
    let exited = tokio::time::timeout(settings.drain_timeout, async {
        match &mut worker.child {
            Some(child) => drop(child.wait().await),
            None => {
                while runs(pid, &name) {
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    })
    .await;
    if exited.is_err() {
        tracing::warn!(worker = name, pid, timeout = ?settings.drain_timeout, "a draining worker did not exit in time; killing it");
        match &mut worker.child {
            Some(child) => {
                let _ = child.kill().await;
            }
            None => signal(pid, libc::SIGKILL),
        }
    }
    remove_files(&settings.state_dir, &name);
    Ok(())
}

/// A worker's files in the state folder.
struct Files {
    record: PathBuf,
    log: PathBuf,
    addresses: PathBuf,
}

impl Files {
    fn of(dir: &Path, name: &str) -> Self {
        Self { record: dir.join(format!("{name}.worker")), log: dir.join(format!("{name}.log")), addresses: dir.join(format!("{name}.addresses.json")) }
    }
}

/// Removes a worker's record and addresses (its log stays, for the
/// operator).
fn remove_files(dir: &Path, name: &str) {
    let files = Files::of(dir, name);
    let _ = std::fs::remove_file(files.record);
    let _ = std::fs::remove_file(files.addresses);
}

fn number_of(name: &str) -> u64 {
    name.rsplit('-').next().and_then(|number| number.parse().ok()).unwrap_or(0)
}

/// Whether `pid` is a live (not zombie) process started as worker `name`
/// (its command line says `--worker-id name`), so a reused pid is not
/// taken for the worker.
fn runs(pid: u32, name: &str) -> bool {
    let Ok(command_line) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let arguments: Vec<&[u8]> = command_line.split(|byte| *byte == 0).collect();
    let named = arguments.windows(2).any(|pair| pair[0] == b"--worker-id" && pair[1] == name.as_bytes());
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')));
    named && !zombie
}

fn signal(pid: u32, signal: libc::c_int) {
    if pid == 0 {
        return;
    }
    // SAFETY: kill(2) on a pid the connector started or adopted (checked
    // by `runs` against its command line); no memory is involved.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}
