//! The planner: sizes the worker pools of a deployment to meet TTFT and ITL
//! targets at the least cost (observe, predict, propose, constrain,
//! execute; DESIGN §5, issue #18).
//!
//! It is being built in steps. Here so far: [`targets`], what the planner
//! sizes for, checked as `SetTargets` and the configuration take it;
//! [`predict`], the next interval's load from the ones before (constant,
//! moving average, seasonal); and
//! [`backtest`], each predictor's error on a recorded trace.

pub mod backtest;
pub mod predict;
pub mod targets;

pub use targets::{PoolKind, PoolLimits, Predictor, Targets, TargetsError};
