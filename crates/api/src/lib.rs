//! The words Turbine's services speak to each other, apart from any one
//! service: what a generation request asks (prompt, sampling, when to
//! stop), what comes back (finish reason, token accounting,
//! log-probabilities), a worker's load, and how workers lay out and expose
//! their KV blocks. The gateway and the worker's clients use these without
//! linking an engine; the engine re-exports them (without the `grpc`
//! feature: [`wire`], the conversions to and from the contracts).

mod kv;
mod request;
#[cfg(feature = "grpc")]
pub mod wire;

pub use kv::{KvLayout, UcxRegion};
pub use request::{FinishReason, GenerateRequest, Load, MAX_LOGPROBS, SamplingError, SamplingParams, StopConditions, TokenLogprobs, Usage};
