//! The planner: sizes the worker pools of a deployment to meet TTFT and ITL
//! targets at the least cost (observe, predict, propose, constrain,
//! execute; DESIGN §5, issue #18). It is laid out in three wings and what
//! joins them:
//!
//! - [`plan`]: pure — the targets and decisions (`turbine_api::planner`'s
//!   words), forecasting ([`plan::predict`], [`plan::backtest`]), the
//!   measured [`plan::profile`], replicas per pool from it
//!   ([`plan::propose`]) and their bounds ([`plan::constrain`]);
//! - [`observe`]: each interval's load, latencies, queues, KV usage and
//!   replicas per pool, from the gateways' metrics ([`observe::prom`]) and
//!   the worker registry;
//! - [`act`]: the connectors that carry out a decision's actions
//!   (`virtual`, `local` worker processes, `kubernetes` Deployments, or
//!   workers hosted in this process; the two that start and drain workers
//!   share one loop, [`act::scale`]);
//! - [`ledger`]: the state in PostgreSQL or SQLite (targets, the pause
//!   switch, decisions, actions), migrated at start, its records stamped by
//!   an injected [`clock`] (the system's, or a test's);
//! - [`cycle`]: once per interval, observe, forecast, propose, constrain,
//!   record the decision and hand its actions to the connector;
//! - [`state`]: what the cycle and the service share (the ledger, the
//!   decisions as recorded, the connector);
//! - [`metrics`]: replicas asked for, observed and draining, SLA outcome
//!   per interval, actions by outcome; [`audit`]: `turbine planner
//!   history`, decisions in words;
//! - [`service`]: `turbine.planner.v1.Planner` over the ledger, and
//!   [`serve()`]: the planner on the service host, who may call what
//!   ([`ROLES`]); [`PlannerConfig`]: configuration and flags;
//! - [`PlannerClient`]: the typed client (in `turbine_api::planner`).

pub mod act;
pub mod audit;
pub mod clock;
pub mod config;
pub mod cycle;
pub mod ledger;
pub mod metrics;
pub mod observe;
pub mod plan;
pub mod serve;
pub mod service;
pub mod state;

pub use clock::Clock;
pub use config::PlannerConfig;
pub use ledger::{Backend, Control, Ledger, LedgerError};
pub use plan::{
    Action, ActionState, Decision, Malformed, Observation, Plan, PoolDecision, PoolKind, PoolLimits, PoolState, Prediction, Predictor, Targets, TargetsError,
};
pub use serve::{ROLES, main, serve};
pub use service::PlannerService;
pub use state::PlannerState;
pub use turbine_api::planner::{HistoryPage, PlannerClient, PlannerClientError};
