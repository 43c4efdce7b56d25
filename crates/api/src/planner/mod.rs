//! The planner's words: what it sizes the pools for ([`Targets`], checked
//! once, here), one interval's pass as it is kept and shown
//! ([`Decision`], with what each pool did, the forecast and the
//! connector's [`Action`]s), the [`Plan`] in force; and, with the `grpc`
//! feature, its client ([`PlannerClient`]) and the conversions to and from
//! `turbine.planner.v1`.

#[cfg(feature = "grpc")]
mod client;
mod decision;
mod targets;
#[cfg(feature = "grpc")]
mod wire;

#[cfg(feature = "mock")]
pub use client::MockPlannerApi;
#[cfg(feature = "grpc")]
pub use client::{DecisionStream, GrpcPlanner, HistoryPage, PlannerApi, PlannerClient, PlannerClientError, ROLE};
pub use decision::{Action, ActionState, Decision, Load, Malformed, Observation, Plan, PoolDecision, PoolState, Prediction};
pub use targets::{MAX_PERIOD, MAX_POOL_NAME, MAX_POOLS, PoolKind, PoolLimits, Predictor, Targets, TargetsError, UnknownPredictor};
