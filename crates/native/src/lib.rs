//! Turbine's own inference engine: Llama-family GGUF models computed on the
//! CPU with a paged KV cache, plugged into the shared engine core
//! (`turbine-engine`: scheduler, block manager, continuous batching) as an
//! [`Executor`](turbine_engine::Executor).
//!
//! - [`config`]: hyper-parameters from GGUF metadata (other architectures
//!   refused).
//! - [`weights`]: memory-mapped weight matrices and their products (this
//!   crate's Q4_1/Q8_0 kernels, candle's for other ggml formats).
//! - [`quant`]: quantized blocks and SIMD dot kernels.
//! - [`ops`]: RMSNorm, RoPE, SwiGLU, paged attention.
//! - [`model`]: the forward pass over a batch of sequences.
//! - [`sampling`]: penalties, temperature, top-k/top-p/min-p, seeds,
//!   log-probabilities, JSON output.
//! - [`json`]: the recognizer of JSON objects that JSON output masks by.
//! - [`pool`]: the low-latency thread pool the kernels run on.
//! - [`candle_backend`]: the same forward pass in candle tensor operations,
//!   for candle's devices (CUDA with the `cuda` feature; CPU for checking).
//! - [`executor`]: the engine executor.

pub mod candle_backend;
pub mod config;
pub mod executor;
pub mod json;
pub mod model;
pub mod ops;
pub mod pattern;
pub mod pool;
pub mod quant;
pub mod sampling;
pub mod schema;
pub mod weights;

use std::path::PathBuf;

pub use config::LlamaConfig;
pub use executor::{Backend, Device, NativeExecutor, NativeOptions, UnknownDevice, check_device};
pub use model::{KvCache, LlamaModel, SequenceRows};

/// Errors of the native engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The model uses something this engine does not implement.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// The model file is inconsistent.
    #[error("invalid model: {0}")]
    Model(String),
    /// The engine options are unusable.
    #[error("{0}")]
    Config(String),
    /// The compute device failed or is unavailable.
    #[error("device: {0}")]
    Device(String),
}

impl From<turbine_tokens::Error> for Error {
    fn from(error: turbine_tokens::Error) -> Self {
        Error::Model(error.to_string())
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
