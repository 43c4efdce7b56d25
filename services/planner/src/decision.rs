//! A decision, one interval's pass of the planner, and the plan in force:
//! the words live in `turbine_api::planner`, beside their client.

pub use turbine_api::planner::{Action, ActionState, Decision, Malformed, Observation, Plan, PoolDecision, PoolState, Prediction};
