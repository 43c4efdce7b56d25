//! What the planner sizes the pools for: the words live in
//! `turbine_api::planner` (a client checks them as the planner does).

pub use turbine_api::planner::{MAX_PERIOD, MAX_POOL_NAME, MAX_POOLS, PoolKind, PoolLimits, Predictor, Targets, TargetsError, UnknownPredictor};
