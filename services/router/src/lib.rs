//! The router service: chooses the worker for each request.
//!
//! - [`Router`]: live workers mirrored from the registry, bookings
//!   (booked at route, released at finish, dropped when stale), and the
//!   decision; no transport.
//! - [`policy`]: round-robin, random, least-loaded.
//! - [`kv`]: KV-aware routing: the cost function, the `[kv]` section, and
//!   where matches come from (a `turbine_api::kv_index::KvIndexClient`).
//! - [`local`]: the router as its own client's `RouterApi` (the client
//!   and the router's words are `turbine_api::router`);
//!   [`RouterService`]: the `turbine.router.v1.Router` gRPC shell.
//! - [`peers`]: load booked by the other router replicas, through Redis.
//! - [`serve()`]: the router on the service host, and the registry watch.

pub mod config;
pub mod kv;
pub mod local;
pub mod metrics;
pub mod peers;
pub mod policy;
pub mod router;
pub mod serve;
pub mod service;

pub use config::{RouterConfig, RoutingConfig};
pub use kv::{KvConfig, KvOverrides, KvState, KvTuning, KvWeights};
pub use policy::Policy;
pub use router::{DisaggPolicy, RouteError, RouteRequest, Routed, RoutedWorker, Router, WorkerBook};
pub use serve::{IndexSource, RouterDeps, main, serve, start};
pub use service::RouterService;
