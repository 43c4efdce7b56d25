//! The planner's cycle: once per interval of the targets in force, observe
//! the deployment and keep what was seen in the ledger. (Predicting,
//! proposing, constraining and acting join this cycle in the next steps of
//! issue #18.)

use std::time::Duration;

use turbine_runtime::CancellationToken;

use crate::observe::Observer;
use crate::service::PlannerState;

/// How often a planner without targets looks for them.
const NO_TARGETS_POLL: Duration = Duration::from_secs(1);

/// How long the planner waits after its database failed before trying
/// again.
const LEDGER_RETRY: Duration = Duration::from_secs(1);

/// Runs the cycle until `shutdown` fires. A failed observation or ledger
/// write is logged and the interval skipped: nothing is recorded from
/// missing data.
pub async fn run(state: PlannerState, mut observer: Observer, shutdown: CancellationToken) {
    loop {
        let targets = match state.ledger().control().await {
            Ok(control) => control.targets,
            Err(error) => {
                tracing::warn!(%error, "cannot read the targets; retrying");
                if sleep_or_shutdown(LEDGER_RETRY, &shutdown).await {
                    return;
                }
                continue;
            }
        };
        let Some(targets) = targets else {
            if sleep_or_shutdown(NO_TARGETS_POLL, &shutdown).await {
                return;
            }
            continue;
        };
        match observer.observe(&targets).await {
            Ok(Some(observed)) => {
                if let Err(error) = state.ledger().record_observations(crate::service::now_unix_ms(), &observed).await {
                    tracing::warn!(%error, "cannot record this interval's observations");
                }
            }
            Ok(None) => tracing::debug!("observation baseline taken"),
            Err(error) => tracing::warn!(%error, "cannot observe this interval"),
        }
        if sleep_or_shutdown(targets.interval(), &shutdown).await {
            return;
        }
    }
}

/// Sleeps `period`; true when `shutdown` fired first.
async fn sleep_or_shutdown(period: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(period) => false,
    }
}
