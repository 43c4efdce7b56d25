//! Models as clients see them.
//!
//! - [`gguf`]: reads a GGUF file's metadata and tensor descriptions.
//! - [`hf`]: reads a Hugging Face model directory's tokenizer and chat
//!   template (the models external engines serve).
//! - [`tokenizer`]: builds a tokenizer from `tokenizer.ggml.*` that
//!   reproduces llama.cpp's token ids.
//! - [`detokenize`]: token ids back to text incrementally, never splitting a
//!   UTF-8 character.
//! - [`chat`]: renders the model's Jinja chat template.
//! - [`control`]: keeps control-token texts in user content as text.
//! - [`card`]: the model card (tokenizer + template + limits) that workers
//!   publish and gateways compile into a [`Preprocessor`].
//! - [`pull`]: the model catalog and cache (`turbine model pull`).

pub mod card;
pub mod chat;
pub mod control;
pub mod detokenize;
mod fast_bpe;
pub mod gguf;
pub mod hf;
pub mod pull;
pub mod tokenizer;

use std::path::PathBuf;

pub use card::{ChatTokens, ContentControlTokens, ModelCard, Preprocessor};
pub use chat::{ChatMessage, ChatTemplate};
pub use control::ControlTexts;
pub use detokenize::{IncrementalDecoder, TokenBytes};
pub use gguf::Gguf;
pub use tokenizer::{Tokenizer, TokenizerSpec};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The GGUF file is malformed.
    #[error("invalid GGUF: {0}")]
    Gguf(String),
    /// A model directory's files are malformed.
    #[error("model directory: {0}")]
    ModelDir(String),
    /// The tokenizer family or definition is not supported.
    #[error("unsupported tokenizer: {0}")]
    UnsupportedTokenizer(String),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Fetching a model failed.
    #[error("model pull: {0}")]
    Pull(String),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
