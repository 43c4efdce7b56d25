//! The planner's state as its parts share it: the ledger (with its clock),
//! the decisions as they are recorded (for watchers), and the connector
//! that carries out their actions. The cycle decides through it and the
//! gRPC shell serves it; neither owns it.

use std::sync::Arc;

use tokio::sync::broadcast;

use crate::act::connector::Connector;
use crate::ledger::{Ledger, LedgerError};
use crate::plan::Decision;

/// Decisions a watcher may fall behind by before its stream is ended.
pub const WATCH_BUFFER: usize = 64;

/// The planner's state: the ledger, the decisions as they are recorded,
/// for watchers, and the connector that carries out their actions.
#[derive(Debug, Clone)]
pub struct PlannerState {
    ledger: Ledger,
    decisions: broadcast::Sender<Arc<Decision>>,
    connector: Connector,
}

impl PlannerState {
    /// The state kept in `ledger`, its actions carried out by the
    /// `virtual` connector.
    pub fn new(ledger: Ledger) -> Self {
        Self::with_connector(ledger, Connector::Virtual)
    }

    /// The state kept in `ledger`, its actions carried out by `connector`.
    pub fn with_connector(ledger: Ledger, connector: Connector) -> Self {
        Self { ledger, decisions: broadcast::channel(WATCH_BUFFER).0, connector }
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The connector.
    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    /// The decisions recorded from now on, as they are recorded.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Decision>> {
        self.decisions.subscribe()
    }

    /// Records `decision` and hands it to every watcher.
    pub async fn record(&self, decision: Decision) -> Result<(), LedgerError> {
        self.ledger.record(&decision).await?;
        // No watcher is not an error.
        let _ = self.decisions.send(Arc::new(decision));
        Ok(())
    }

    /// Records a decision made while the database was unreachable
    /// ([`Ledger::record_late`]) and publishes it to the watchers.
    pub async fn record_late(&self, decision: Decision) -> Result<(), LedgerError> {
        self.ledger.record_late(&decision).await?;
        let _ = self.decisions.send(Arc::new(decision));
        Ok(())
    }
}
