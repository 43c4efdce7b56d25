//! The scale loop, written once for every connector whose workers the
//! planner starts and drains itself: [`Scaler`] sets a pool to an action's
//! replicas over a [`WorkerHost`], where the workers run — worker processes
//! on this machine (the `local` connector, [`crate::act::local`]) or workers in
//! the planner's own process (the `hosted` connector, as `turbine run
//! --planner` has them).
//!
//! - Scaling up starts workers one at a time and waits until each serves;
//!   the first that cannot ends the action as failed, naming those started.
//! - Scaling down drains the newest: each leaves the host's list at once
//!   (and the registry, so routers stop sending it work), finishes its
//!   streams and stops, in the background, counted as draining until then.
//! - An action's id is carried out once; handed over again it answers what
//!   it answered the first time. Hosted workers live and die with the
//!   process, so after a restart a pending action is carried out anew,
//!   which sets the pool to the size it asks for (nothing, if it already
//!   has it).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::Mutex as AsyncMutex;

use crate::act::connector::{DrainingCounts, Outcome};
use crate::plan::Action;
use crate::plan::PoolKind;

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

/// Where a [`Scaler`]'s workers run.
pub trait WorkerHost: Send + Sync + std::fmt::Debug {
    /// The serving workers of `pool` (whose workers are of `kind`), oldest
    /// first.
    fn workers(&self, pool: &str, kind: PoolKind) -> Vec<String>;
    /// Starts a worker for `pool` (of `kind`) and resolves once it serves,
    /// with its name (or why it could not).
    fn start<'a>(&'a self, pool: &'a str, kind: PoolKind) -> HostFuture<'a, Result<String, HostError>>;
    /// Drains worker `name`: before this returns it leaves
    /// [`workers`](Self::workers); the future it answers (run in the
    /// background) has it leave the registry, finish its streams and stop,
    /// and resolves once it has stopped.
    fn drain(&self, name: &str) -> HostFuture<'static, Result<(), HostError>>;
}

/// Actions whose outcomes a [`Scaler`] remembers (the newest): an id is
/// handed over again only soon after it was first (a restart, a database
/// outage), and the memory stays bounded over months of decisions.
pub const REMEMBERED_ACTIONS: usize = 1024;

/// What the newest actions carried out answered.
#[derive(Debug, Default)]
struct Done {
    outcomes: HashMap<String, Outcome>,
    /// Their ids, oldest first.
    order: VecDeque<String>,
}

impl Done {
    fn remember(&mut self, id: &str, outcome: Outcome) {
        if self.outcomes.insert(id.to_owned(), outcome).is_none() {
            self.order.push_back(id.to_owned());
        }
        while self.order.len() > REMEMBERED_ACTIONS {
            if let Some(oldest) = self.order.pop_front() {
                self.outcomes.remove(&oldest);
            }
        }
    }
}

/// The scale loop over one [`WorkerHost`]. Cloning shares its state.
#[derive(Debug, Clone)]
pub struct Scaler {
    host: Arc<dyn WorkerHost>,
    /// What the newest actions carried out answered.
    done: Arc<AsyncMutex<Done>>,
    draining: DrainingCounts,
}

impl Scaler {
    /// The loop over `host`.
    pub fn new(host: Arc<dyn WorkerHost>) -> Self {
        Self { host, done: Arc::default(), draining: DrainingCounts::default() }
    }

    /// Workers of `pool` draining now.
    pub fn draining_in(&self, pool: &str) -> u32 {
        self.draining.of(pool)
    }

    /// Workers draining now, over all pools.
    pub fn draining(&self) -> u32 {
        self.draining.total()
    }

    /// Workers of `pool` (of `kind`) serving now.
    pub fn serving(&self, pool: &str, kind: PoolKind) -> u32 {
        self.host.workers(pool, kind).len() as u32
    }

    /// Sets `action.pool` (of `kind`) to `action.replicas` workers.
    pub async fn execute(&self, action: &Action, kind: PoolKind) -> Outcome {
        // One action at a time: two would count the same workers.
        let mut done = self.done.lock().await;
        if let Some(outcome) = done.outcomes.get(&action.id) {
            return outcome.clone();
        }
        let workers = self.host.workers(&action.pool, kind);
        let (serving, wanted) = (workers.len(), action.replicas as usize);
        let outcome = if wanted > serving {
            let mut started = Vec::new();
            let mut failure = None;
            for _ in serving..wanted {
                match self.host.start(&action.pool, kind).await {
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
        done.remember(&action.id, outcome.clone());
        outcome
    }

    /// Drains `name` of `pool` in the background, counted as draining
    /// until it has stopped.
    fn drain(&self, pool: &str, name: String) {
        self.draining.started(pool);
        tracing::info!(worker = name, pool, "draining a worker");
        let (scaler, pool) = (self.clone(), pool.to_owned());
        let draining = self.host.drain(&name);
        tokio::spawn(async move {
            match draining.await {
                Ok(()) => tracing::info!(worker = name, "worker drained"),
                Err(problem) => tracing::warn!(worker = name, %problem, "a worker did not drain cleanly"),
            }
            scaler.draining.ended(&pool);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::plan::ActionState;

    /// Workers that are names in a list; the `fail_at`th start fails.
    #[derive(Debug, Default)]
    struct Names {
        serving: Mutex<Vec<String>>,
        started: Mutex<u32>,
        fail_at: Option<u32>,
    }

    impl WorkerHost for Names {
        fn workers(&self, _pool: &str, _kind: PoolKind) -> Vec<String> {
            self.serving.lock().unwrap().clone()
        }

        fn start<'a>(&'a self, _pool: &'a str, _kind: PoolKind) -> HostFuture<'a, Result<String, HostError>> {
            Box::pin(async move {
                let mut started = self.started.lock().unwrap();
                *started += 1;
                if Some(*started) == self.fail_at {
                    return Err(HostError::Launch("no more processes".into()));
                }
                let name = format!("w-{started}");
                self.serving.lock().unwrap().push(name.clone());
                Ok(name)
            })
        }

        fn drain(&self, name: &str) -> HostFuture<'static, Result<(), HostError>> {
            self.serving.lock().unwrap().retain(|serving| serving != name);
            Box::pin(async { Ok(()) })
        }
    }

    fn action(id: u64, replicas: u32) -> Action {
        Action { id: Action::id_for("ns", id, "decode"), pool: "decode".into(), replicas, state: ActionState::Pending, message: String::new() }
    }

    #[tokio::test]
    async fn a_pool_grows_and_shrinks_from_the_newest_and_an_action_is_done_once() {
        let host = Arc::new(Names::default());
        let scaler = Scaler::new(host.clone());
        let up = scaler.execute(&action(1, 3), PoolKind::Decode).await;
        assert_eq!(up, Outcome::Done("started w-1, w-2, w-3: decode now serves 3".into()));
        assert_eq!(scaler.execute(&action(1, 3), PoolKind::Decode).await, up, "the same id answers the same");
        assert_eq!(*host.started.lock().unwrap(), 3, "and starts nothing");

        let down = scaler.execute(&action(2, 1), PoolKind::Decode).await;
        assert_eq!(down, Outcome::Done("draining w-2, w-3: decode serves 1 once they finish their streams".into()));
        assert_eq!(scaler.serving("decode", PoolKind::Decode), 1, "the leaving workers left the list at once");
        assert_eq!(scaler.execute(&action(3, 1), PoolKind::Decode).await, Outcome::Done("decode already serves 1".into()));
    }

    #[tokio::test]
    async fn a_start_that_fails_ends_the_action_naming_those_started() {
        let host = Arc::new(Names { fail_at: Some(2), ..Names::default() });
        let scaler = Scaler::new(host.clone());
        let outcome = scaler.execute(&action(1, 3), PoolKind::Decode).await;
        assert_eq!(outcome, Outcome::Failed("started w-1 of 3, then cannot start a worker: no more processes".into()));
        assert_eq!(scaler.serving("decode", PoolKind::Decode), 1);
    }

    #[tokio::test]
    async fn only_the_newest_outcomes_are_remembered() {
        let scaler = Scaler::new(Arc::new(Names::default()));
        for id in 0..=REMEMBERED_ACTIONS as u64 {
            scaler.execute(&action(id, 0), PoolKind::Decode).await;
        }
        let done = scaler.done.lock().await;
        assert_eq!((done.outcomes.len(), done.order.len()), (REMEMBERED_ACTIONS, REMEMBERED_ACTIONS));
        assert!(!done.outcomes.contains_key(&action(0, 0).id) && done.outcomes.contains_key(&action(REMEMBERED_ACTIONS as u64, 0).id));
    }
}
