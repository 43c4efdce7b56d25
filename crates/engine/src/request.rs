//! What callers ask of an engine and what they get back: the request
//! vocabulary is `turbine-api`'s (re-exported here); what only an engine
//! and its executor speak of (sampled tokens, outputs, hand-offs) is here.

pub use turbine_api::{FinishReason, GenerateRequest, Load, MAX_LOGPROBS, OutputFormat, SamplingError, SamplingParams, StopConditions, TokenLogprobs, Usage};

/// What an executor samples for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

impl Sampled {
    /// A token without log-probabilities.
    pub fn token(token: u32) -> Self {
        Self { token, logprobs: None }
    }
}

/// What an engine streams back for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineOutput {
    /// One generated token (with log-probabilities if asked).
    Token(u32, Option<TokenLogprobs>),
    /// The sequence ended; nothing follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token accounting.
        usage: Usage,
    },
    /// The engine failed the sequence; nothing follows.
    Failed(crate::EngineError),
    /// A prefill-only request's blocks are pinned (sent just before
    /// `Finished`).
    Pinned(PinnedPrefix),
}

/// A request's part in disaggregated serving: computed whole here, or only
/// its prompt here (prefill worker), or decoded here after another worker
/// computed its prompt (decode worker).
#[derive(Debug, Default)]
pub enum Handoff {
    /// Prefill and decode here (aggregated serving).
    #[default]
    None,
    /// Compute the prompt and sample the first token (`max_tokens` is 1),
    /// then keep the prompt's full blocks pinned for a decode worker to
    /// read: [`EngineOutput::Pinned`] arrives before `Finished`.
    Prefill,
    /// Continue a sequence prefilled elsewhere: `generated` are the tokens
    /// already produced there (counted as output, not streamed again), and
    /// `import` the prompt blocks read from there, installed into the prefix
    /// cache before the sequence is admitted (whatever is missing is
    /// computed here).
    Decode {
        /// Tokens sampled by the prefill worker.
        generated: Vec<u32>,
        /// Blocks to install.
        import: ImportedPrefix,
    },
}

/// Prompt blocks read from another worker, in chain order.
#[derive(Default)]
pub struct ImportedPrefix {
    /// Sequence hash of the block before the first (None: from the start).
    pub parent: Option<turbine_kv::SequenceHash>,
    /// The blocks' hashes.
    pub hashes: Vec<turbine_kv::BlockHashes>,
    /// Whose blocks they are (the request's that reads them).
    pub tenant: turbine_kv::KvTenant,
    /// Their bytes, back to back (`block_bytes` each, checked).
    pub bytes: Vec<u8>,
    /// Takes `bytes` back once installed (a reader's buffer pool).
    pub recycle: Option<Box<dyn FnOnce(Vec<u8>) + Send>>,
}

impl std::fmt::Debug for ImportedPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedPrefix").field("parent", &self.parent).field("blocks", &self.hashes.len()).field("bytes", &self.bytes.len()).finish()
    }
}

impl ImportedPrefix {
    /// The bytes of block `index`.
    pub fn block(&self, index: usize) -> &[u8] {
        let block_bytes = self.bytes.len() / self.hashes.len().max(1);
        &self.bytes[index * block_bytes..(index + 1) * block_bytes]
    }
}

/// A prefill's full prompt blocks, held until released (or the engine's
/// owner lets the lease lapse).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedPrefix {
    /// Pass to [`EngineHandle::unpin`](crate::EngineHandle::unpin).
    pub pin_id: u64,
    /// The blocks, in prompt order, with their hashes.
    pub blocks: Vec<(crate::block_manager::BlockId, turbine_kv::BlockHashes)>,
}
