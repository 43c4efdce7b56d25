//! The router service: chooses the worker for each request.
//!
//! - [`Router`]: live workers mirrored from the registry, bookings
//!   (booked at route, released at finish, dropped when stale), and the
//!   decision; transport-free.
//! - [`policy`]: round-robin, random, least-loaded.
//! - [`kv`]: KV-aware routing: the cost function over the KV index, and
//!   approximate mode.
//! - [`RouterService`]: the `turbine.router.v1.Router` gRPC shell.
//! - [`RouterClient`]: in-process or gRPC, one type.
//! - [`peers`]: load booked by the other router replicas, through Redis.
//! - [`serve`]: the process and the registry watch.

pub mod client;
pub mod config;
pub mod kv;
pub mod metrics;
pub mod peers;
pub mod policy;
pub mod router;
pub mod serve;
pub mod service;

pub use client::{RouterCallError, RouterClient};
pub use config::{RouterArgs, RouterConfig};
pub use policy::Policy;
pub use kv::{KvConfig, KvOverrides, KvState, KvWeights};
pub use router::{DisaggPolicy, RouteError, RouteRequest, Routed, RoutedWorker, Router, WorkerBook};
pub use service::RouterService;
