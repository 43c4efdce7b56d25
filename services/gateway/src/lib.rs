//! The gateway: OpenAI-compatible REST and `turbine.gateway.v1` gRPC in
//! front of the router and the workers.
//!
//! - [`pipeline`]: one request from text to a text stream (template,
//!   tokenize, limits, route, call the worker with retry and mid-stream
//!   migration, incremental detokenization, stop strings, usage).
//! - [`openai`]: REST handlers, request validation, response shapes, SSE.
//! - [`grpc`]: the Inference gRPC service over the same pipeline.
//! - [`catalog`]: served models learned from live workers' cards.
//! - [`error`]: client-facing errors with one mapping to HTTP and gRPC.
//! - [`serve()`]: the gateway on the service host.
//!
//! It reaches the router and the workers through their clients in
//! `turbine-api` (`router::RouterClient`, `worker::WorkerClients`): it
//! links no engine and no other service.

pub mod admission;
pub mod catalog;
pub mod config;
pub mod error;
pub mod grpc;
pub mod keys;
pub mod metrics;
pub mod openai;
pub mod pipeline;
pub mod serve;
pub mod stop;

pub use config::{AdmissionConfig, ContentControlTokens, GatewayConfig};
pub use error::{ErrorKind, GatewayError};
pub use keys::{Access, ApiKey, ApiKeys};
pub use pipeline::{Namespace, Pipeline, Prompt, TextEvent, TextRequest, TextStream};
pub use serve::{GatewayDeps, main, serve};
