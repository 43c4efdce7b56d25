//! The words Turbine's services speak to each other, apart from any one
//! service: what a generation request asks (prompt, sampling, when to
//! stop), what comes back (finish reason, token accounting,
//! log-probabilities), a worker's load, and how workers lay out and expose
//! their KV blocks; one set of error codes ([`ErrorCode`]) every client's
//! error maps through. Every service speaks these without linking an
//! engine or another service; the engine re-exports them.
//!
//! With the `grpc` feature (the default; an engine goes without it): the
//! services' clients, each beside its own words ([`kv_index`],
//! [`kv_store`], [`kv_transfer`], [`planner`], [`router`], [`worker`]), and [`wire`],
//! the request vocabulary to and from the contracts. With the `mock`
//! feature (for callers' tests): a mockall double of each client's trait
//! beside it (`router::MockRouterApi`, `worker::MockWorkerApi`, ...).

mod error;
pub mod kv_index;
pub mod kv_store;
#[cfg(feature = "grpc")]
pub mod kv_transfer;
pub mod planner;
mod request;
pub mod router;
#[cfg(feature = "grpc")]
pub mod wire;
#[cfg(feature = "grpc")]
pub mod worker;

pub use error::{ApiError, ErrorCode, REASON_KEY};
#[cfg(feature = "grpc")]
pub use error::{from_status, to_status};
pub use request::{
    FinishReason, FormatKind, GenerateRequest, Load, MAX_LOGPROBS, MAX_SCHEMA_BYTES, OutputFormat, OutputFormats, SamplingError, SamplingParams,
    StopConditions, TokenLogprobs, Usage, WorkerRole,
};
pub use turbine_kv::{CacheSalt, KvLayout, KvTenant, UcxRegion};
