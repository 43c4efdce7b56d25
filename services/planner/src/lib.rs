//! The planner: sizes the worker pools of a deployment to meet TTFT and ITL
//! targets at the least cost (observe, predict, propose, constrain,
//! execute; DESIGN §5, issue #18).
//!
//! It is being built in steps. Here so far:
//! - [`targets`]: what the planner sizes for, checked as `SetTargets` and
//!   the configuration take it;
//! - [`predict`]: the next interval's load from the ones before
//!   (constant, moving average, seasonal), and [`backtest`], each
//!   predictor's error on a recorded trace;
//! - [`decision`]: one interval's pass, as it is kept and shown;
//! - [`observe`]: each interval's load, latencies, queues, KV usage and
//!   replicas per pool, from the gateways' metrics ([`prom`]) and the
//!   worker registry;
//! - [`profile`]: a worker configuration's measured TTFT by input length
//!   and ITL by context and concurrency (`turbine profile` writes it);
//! - [`propose`] and [`constrain`]: replicas per pool from the profile,
//!   corrected by observed over expected latency, then bounded (min/max,
//!   cool-down, budget);
//! - [`cycle`]: once per interval, observe, forecast, propose, constrain,
//!   record the decision and hand its actions to the [`connector`]
//!   (`virtual`, [`local`] worker processes, [`kubernetes`] Deployments,
//!   or workers hosted in this process; the
//!   two that start and drain workers share one loop, [`scale`]);
//! - [`metrics`]: replicas asked for, observed and draining, SLA outcome
//!   per interval, actions by outcome;
//! - [`audit`]: `turbine planner history`, decisions in words;
//! - [`ledger`]: the state in PostgreSQL or SQLite (targets, the pause
//!   switch, decisions, actions), migrated at start;
//! - [`state`]: what the cycle and the service share (the ledger, the
//!   decisions as recorded, the connector); [`clock`]: the time the
//!   ledger stamps records with (the system's, or a test's);
//! - [`service`]: `turbine.planner.v1.Planner` over the ledger, and
//!   [`serve()`]: the planner on the service host, who may call what
//!   ([`ROLES`]); [`PlannerConfig`]: configuration and flags;
//! - [`PlannerClient`]: the typed client (in `turbine_api::planner`).

pub mod audit;
pub mod backtest;
pub mod clock;
pub mod config;
pub mod connector;
pub mod constrain;
pub mod cycle;
pub mod decision;
pub mod kubernetes;
pub mod ledger;
pub mod local;
pub mod metrics;
pub mod observe;
pub mod predict;
pub mod profile;
pub mod prom;
pub mod propose;
pub mod scale;
pub mod serve;
pub mod service;
pub mod state;
pub mod targets;

pub use clock::Clock;
pub use config::PlannerConfig;
pub use decision::{Action, ActionState, Decision, Malformed, Observation, Plan, PoolDecision, PoolState, Prediction};
pub use ledger::{Backend, Control, Ledger, LedgerError};
pub use serve::{ROLES, main, serve};
pub use service::PlannerService;
pub use state::PlannerState;
pub use targets::{PoolKind, PoolLimits, Predictor, Targets, TargetsError};
pub use turbine_api::planner::{HistoryPage, PlannerClient, PlannerClientError};
