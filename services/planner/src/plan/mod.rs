//! The plan wing: pure functions from what was observed to the replicas
//! each pool should have — no database, network, clock or process here.
//!
//! - the words (in `turbine_api::planner`, re-exported): the [`Targets`]
//!   the planner sizes for, a [`Decision`] as it is kept and shown, the
//!   [`Plan`] in force;
//! - [`predict`]: the next interval's load from the ones before
//!   (constant, moving average, seasonal), and [`backtest`], each
//!   predictor's error on a recorded trace;
//! - [`profile`]: a worker configuration's measured TTFT by input length
//!   and ITL by context and concurrency (`turbine profile` writes it);
//! - [`propose`] and [`constrain`]: replicas per pool from the profile,
//!   corrected by observed over expected latency, then bounded (min/max,
//!   cool-down, budget).

pub mod backtest;
pub mod constrain;
pub mod predict;
pub mod profile;
pub mod propose;

pub use turbine_api::planner::{
    Action, ActionState, Decision, MAX_PERIOD, MAX_POOL_NAME, MAX_POOLS, Malformed, Observation, Plan, PoolDecision, PoolKind, PoolLimits, PoolState,
    Prediction, Predictor, Targets, TargetsError, UnknownPredictor,
};
