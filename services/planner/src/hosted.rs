//! The `hosted` connector: the pools' workers run inside the planner's own
//! process, as `turbine run --planner` has them, and the process
//! hosting them ([`WorkerHost`]) starts and drains them on the planner's
//! word. A pool is the host's workers of the pool's role.
//!
//! - Scaling up starts workers one at a time and waits until each serves.
//! - Scaling down drains the newest: each leaves the registry (routers stop
//!   sending it work), finishes its streams and stops, in the background.
//! - An action's id is carried out once; handed over again it answers what
//!   it answered the first time. The workers live and die with the
//!   process, so after a restart a pending action is carried out anew,
//!   which sets the pool to the size it asks for (nothing, if it already
//!   has it).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::Mutex as AsyncMutex;

use crate::connector::{DrainingCounts, Outcome};
use crate::decision::Action;
use crate::targets::PoolKind;

/// A future a [`WorkerHost`] answers with.
pub type HostFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a worker could not be started or drained.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The worker could not be launched (its files, its process, its task).
    #[error("cannot start a worker: {0}")]
    Launch(String),
    /// It was launched and did not come to serve (it exited, or the wait
    /// ran out); it has been stopped.
    #[error("worker {name} {why}")]
    NotServing {
        /// The worker.
        name: String,
        /// What happened instead.
        why: String,
    },
    /// No worker of that name runs here.
    #[error("no worker {0} runs here")]
    Unknown(String),
    /// It stopped with an error, or its task panicked.
    #[error("it stopped badly: {0}")]
    Stopped(String),
}

/// Where the hosted connector's workers run.
pub trait WorkerHost: Send + Sync + std::fmt::Debug {
    /// The serving workers of `kind`, oldest first.
    fn workers(&self, kind: PoolKind) -> Vec<String>;
    /// Starts a worker of `kind` and resolves once it serves, with its
    /// name (or why it could not).
    fn start(&self, kind: PoolKind) -> HostFuture<'_, Result<String, HostError>>;
    /// Drains worker `name`: it leaves the registry, finishes its streams
    /// and stops. Resolves once it has stopped.
    fn drain(&self, name: &str) -> HostFuture<'_, Result<(), HostError>>;
}

/// The hosted connector. Cloning shares its state.
#[derive(Debug, Clone)]
pub struct HostedConnector {
    host: Arc<dyn WorkerHost>,
    /// What each action carried out answered.
    done: Arc<AsyncMutex<HashMap<String, Outcome>>>,
    draining: DrainingCounts,
}

impl HostedConnector {
    /// The connector over `host`.
    pub fn new(host: Arc<dyn WorkerHost>) -> Self {
        Self { host, done: Arc::default(), draining: DrainingCounts::default() }
    }

    /// Workers of `pool` draining now.
    pub fn draining_in(&self, pool: &str) -> u32 {
        self.draining.of(pool)
    }

    /// Workers of `kind` serving now.
    pub fn serving(&self, kind: PoolKind) -> u32 {
        self.host.workers(kind).len() as u32
    }

    /// Sets `action.pool` (of `kind`) to `action.replicas` workers.
    pub async fn execute(&self, action: &Action, kind: PoolKind) -> Outcome {
        // One action at a time: two would count the same workers.
        let mut done = self.done.lock().await;
        if let Some(outcome) = done.get(&action.id) {
            return outcome.clone();
        }
        let workers = self.host.workers(kind);
        let (serving, wanted) = (workers.len(), action.replicas as usize);
        let outcome = if wanted > serving {
            let mut started = Vec::new();
            let mut failure = None;
            for _ in serving..wanted {
                match self.host.start(kind).await {
                    Ok(name) => started.push(name),
                    Err(problem) => {
                        failure = Some(problem.to_string());
                        break;
                    }
                }
            }
            Outcome::scaled_up(&action.pool, serving, wanted, &started, failure)
        } else if wanted < serving {
            let leaving = &workers[wanted..];
            for name in leaving {
                self.drain(&action.pool, name.clone());
            }
            Outcome::draining(&action.pool, wanted, leaving)
        } else {
            Outcome::unchanged(&action.pool, wanted)
        };
        done.insert(action.id.clone(), outcome.clone());
        outcome
    }

    /// Drains `name` of `pool` in the background, counted as draining
    /// until it has stopped.
    fn drain(&self, pool: &str, name: String) {
        self.draining.started(pool);
        tracing::info!(worker = name, pool, "draining a worker");
        let (connector, pool) = (self.clone(), pool.to_owned());
        tokio::spawn(async move {
            match connector.host.drain(&name).await {
                Ok(()) => tracing::info!(worker = name, "worker drained"),
                Err(problem) => tracing::warn!(worker = name, %problem, "a worker did not drain cleanly"),
            }
            connector.draining.ended(&pool);
        });
    }
}
