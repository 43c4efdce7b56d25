//! Connectors: who carries out a decision's actions.
//!
//! - `virtual`: the planner carries out nothing itself. Each decision is
//!   published (`WatchPlan`, `History`); an external system sets the
//!   pool's replicas and reports the outcome by the action's id
//!   (`CompleteAction`).
//! - `local`: the pools' workers are processes on this machine, started and
//!   drained by the planner ([`crate::act::local`]).
//! - `kubernetes`: each pool is a Deployment whose replicas the planner
//!   sets through its scale subresource ([`crate::act::kubernetes`]).
//! - `hosted`: the pools' workers run in the planner's own process
//!   (`turbine run --planner`), which starts and drains them; both this
//!   and `local` scale through one loop ([`crate::act::scale`]).
//!
//! Every action has an id derived from its decision and pool, kept in the
//! ledger. A connector is handed an id again only after a restart (the
//! action was pending when the planner stopped), and does it once. A newer
//! action on a pool supersedes the older ones still pending: they end as
//! failed, saying so, and are never carried out.

#[cfg(feature = "kubernetes")]
use crate::act::kubernetes::KubernetesConnector;
use crate::act::local::LocalConnector;
use crate::act::scale::Scaler;
use crate::ledger::{Ledger, LedgerError};
use crate::plan::PoolKind;
use crate::plan::{Action, ActionState};

/// Workers draining, per pool, as a connector that drains them counts
/// them (and the planner's metrics show them). Cloning shares the counts.
#[derive(Debug, Clone, Default)]
pub struct DrainingCounts(std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, u32>>>);

impl DrainingCounts {
    /// Workers of `pool` draining now.
    pub fn of(&self, pool: &str) -> u32 {
        self.0.lock().expect("draining counts").get(pool).copied().unwrap_or(0)
    }

    /// Workers draining now, over all pools.
    pub fn total(&self) -> u32 {
        self.0.lock().expect("draining counts").values().sum()
    }

    /// A worker of `pool` started draining.
    pub fn started(&self, pool: &str) {
        self.change(pool, 1);
    }

    /// A worker of `pool` is done draining (exited or was killed).
    pub fn ended(&self, pool: &str) {
        self.change(pool, -1);
    }

    fn change(&self, pool: &str, change: i64) {
        let mut draining = self.0.lock().expect("draining counts");
        let count = draining.entry(pool.to_owned()).or_default();
        *count = (i64::from(*count) + change).max(0) as u32;
        crate::metrics::set_draining(pool, *count);
    }
}

/// Which connector a planner uses (`--connector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConnectorKind {
    /// Publish decisions; an external system carries out each action and
    /// reports it with `CompleteAction`.
    #[default]
    Virtual,
    /// Start and drain `turbine-worker` processes on this machine.
    Local,
    /// Set the replicas of each pool's Deployment (its scale subresource);
    /// builds with the `kubernetes` feature.
    Kubernetes,
    /// Start and drain workers inside this process (`turbine run`; not a
    /// choice for `turbine planner serve`).
    #[value(skip)]
    Hosted,
}

/// A connector, ready to carry out actions. (A planner holds one: boxing
/// the large clients would buy nothing.)
#[derive(Debug, Clone, Default)]
#[allow(clippy::large_enum_variant)]
pub enum Connector {
    /// See [`ConnectorKind::Virtual`].
    #[default]
    Virtual,
    /// See [`ConnectorKind::Local`].
    Local(LocalConnector),
    /// See [`ConnectorKind::Hosted`].
    Hosted(Scaler),
    /// See [`ConnectorKind::Kubernetes`].
    #[cfg(feature = "kubernetes")]
    Kubernetes(KubernetesConnector),
}

/// How handing an action to a connector ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Carried out, with what the connector says of it.
    Done(String),
    /// Handed over; its outcome is reported later (`CompleteAction`).
    Awaiting(String),
    /// Not carried out, and why.
    Failed(String),
}

impl Outcome {
    /// How scaling `pool` up from `serving` to `wanted` workers ended:
    /// `started` are the names started, `failure` why the next could not.
    pub(crate) fn scaled_up(pool: &str, serving: usize, wanted: usize, started: &[String], failure: Option<String>) -> Self {
        match failure {
            None => Outcome::Done(format!("started {}: {pool} now serves {wanted}", started.join(", "))),
            Some(problem) if started.is_empty() => Outcome::Failed(problem),
            Some(problem) => Outcome::Failed(format!("started {} of {}, then {problem}", started.join(", "), wanted - serving)),
        }
    }

    /// Scaling `pool` down to `wanted` by draining `leaving`.
    pub(crate) fn draining(pool: &str, wanted: usize, leaving: &[String]) -> Self {
        Outcome::Done(format!("draining {}: {pool} serves {wanted} once they finish their streams", leaving.join(", ")))
    }

    /// `pool` already at `wanted`.
    pub(crate) fn unchanged(pool: &str, wanted: usize) -> Self {
        Outcome::Done(format!("{pool} already serves {wanted}"))
    }
}

impl Connector {
    /// Its kind.
    pub fn kind(&self) -> ConnectorKind {
        match self {
            Connector::Virtual => ConnectorKind::Virtual,
            Connector::Local(_) => ConnectorKind::Local,
            Connector::Hosted(_) => ConnectorKind::Hosted,
            #[cfg(feature = "kubernetes")]
            Connector::Kubernetes(_) => ConnectorKind::Kubernetes,
        }
    }

    /// Whether outcomes are reported from outside (`CompleteAction`).
    pub fn awaits_reports(&self) -> bool {
        match self.kind() {
            ConnectorKind::Virtual => true,
            ConnectorKind::Local | ConnectorKind::Hosted | ConnectorKind::Kubernetes => false,
        }
    }

    /// Workers of `pool` draining (leaving the fleet, finishing streams).
    pub fn draining(&self, pool: &str) -> u32 {
        match self {
            Connector::Virtual => 0,
            Connector::Local(local) => local.draining_in(pool),
            Connector::Hosted(hosted) => hosted.draining_in(pool),
            // Kubernetes drains the pods it terminates; their count is its own.
            #[cfg(feature = "kubernetes")]
            Connector::Kubernetes(_) => 0,
        }
    }

    /// Workers of `pool` serving now, where the connector knows (the local
    /// connector counts its processes; a virtual connector's external
    /// system keeps its own count); a pool's workers are those of its `kind`
    /// for a hosted connector.
    pub async fn serving(&self, pool: &str, kind: PoolKind) -> Option<u32> {
        match self {
            Connector::Virtual => None,
            Connector::Local(local) => Some(local.serving(pool)),
            Connector::Hosted(hosted) => Some(hosted.serving(pool, kind)),
            #[cfg(feature = "kubernetes")]
            Connector::Kubernetes(kubernetes) => kubernetes.serving(pool).await,
        }
    }

    /// Carries out `action` on a pool of `kind` (idempotent on its id).
    pub async fn execute(&self, action: &Action, kind: PoolKind) -> Outcome {
        match self {
            Connector::Virtual => {
                Outcome::Awaiting(format!("published: set {} to {} replicas, then report it with CompleteAction", action.pool, action.replicas))
            }
            Connector::Local(local) => local.execute(action, kind).await,
            Connector::Hosted(hosted) => hosted.execute(action, kind).await,
            #[cfg(feature = "kubernetes")]
            Connector::Kubernetes(kubernetes) => kubernetes.execute(action).await,
        }
    }
}

/// Hands each of `actions` (just recorded, pending) to `connector`, after
/// superseding older pending actions on the same pools, and records how
/// each ended.
pub async fn execute(ledger: &Ledger, connector: &Connector, actions: &[Action]) -> Result<(), LedgerError> {
    if actions.is_empty() {
        return Ok(());
    }
    let pending = ledger.pending_actions().await?;
    let targets = ledger.control().await?.targets;
    let kind = |pool: &str| {
        targets.as_ref().and_then(|targets| targets.pools().iter().find(|limits| limits.pool == pool)).map_or(PoolKind::Aggregated, |limits| limits.kind)
    };
    for action in actions {
        supersede(ledger, &pending, action).await?;
        carry_out(ledger, connector, action, kind(&action.pool)).await?;
    }
    Ok(())
}

/// Ends the actions of `pending` older than `action` on its pool as
/// failed, superseded by it.
pub async fn supersede(ledger: &Ledger, pending: &[Action], action: &Action) -> Result<(), LedgerError> {
    for older in pending.iter().filter(|older| older.pool == action.pool && older.id != action.id) {
        if ledger
            .end_action(&older.id, ActionState::Failed, &format!("superseded by {} before it was carried out", action.id), ledger.clock().now_unix_ms())
            .await?
        {
            tracing::info!(action = older.id, by = action.id, "action superseded");
        }
    }
    Ok(())
}

/// Hands `action`, on a pool of `kind`, to `connector` while the database
/// is unreachable: its outcome is kept in the action, to be recorded with
/// its decision when the database is back.
pub async fn execute_unrecorded(connector: &Connector, action: &mut Action, kind: PoolKind) {
    let outcome = connector.execute(action, kind).await;
    crate::metrics::record_outcome(&outcome);
    (action.state, action.message) = match outcome {
        Outcome::Done(message) => {
            tracing::info!(action = action.id, message, "action done (recorded once the database is back)");
            (ActionState::Done, message)
        }
        Outcome::Awaiting(message) => (ActionState::Pending, message),
        Outcome::Failed(message) => {
            tracing::warn!(action = action.id, message, "action failed (recorded once the database is back)");
            (ActionState::Failed, message)
        }
    };
}

/// After a restart: the newest pending action of each pool is handed to
/// `connector` again (the same id: a connector does it once); older ones
/// are superseded by it.
pub async fn resume(ledger: &Ledger, connector: &Connector) -> Result<(), LedgerError> {
    let pending = ledger.pending_actions().await?;
    let mut newest: Vec<&Action> = Vec::new();
    // Oldest decision first: a later action on a pool replaces the earlier.
    for action in &pending {
        match newest.iter_mut().find(|kept| kept.pool == action.pool) {
            Some(kept) => *kept = action,
            None => newest.push(action),
        }
    }
    let newest: Vec<Action> = newest.into_iter().cloned().collect();
    if !newest.is_empty() {
        tracing::info!(actions = ?newest.iter().map(|action| &action.id).collect::<Vec<_>>(), "resuming pending actions");
    }
    execute(ledger, connector, &newest).await
}

async fn carry_out(ledger: &Ledger, connector: &Connector, action: &Action, kind: PoolKind) -> Result<(), LedgerError> {
    let outcome = connector.execute(action, kind).await;
    crate::metrics::record_outcome(&outcome);
    match outcome {
        Outcome::Done(message) => {
            tracing::info!(action = action.id, message, "action done");
            ledger.end_action(&action.id, ActionState::Done, &message, ledger.clock().now_unix_ms()).await?;
        }
        Outcome::Awaiting(message) => {
            ledger.note_pending_action(&action.id, &message, ledger.clock().now_unix_ms()).await?;
        }
        Outcome::Failed(message) => {
            tracing::warn!(action = action.id, message, "action failed");
            ledger.end_action(&action.id, ActionState::Failed, &message, ledger.clock().now_unix_ms()).await?;
        }
    }
    Ok(())
}
