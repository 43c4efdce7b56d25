//! What callers ask of an engine and what they get back.

/// Token sampling parameters; `None` everywhere means greedy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `None` or 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling threshold in (0, 1].
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; `None` or 0 disables.
    pub top_k: Option<u32>,
    /// Sampler seed; the same seed and prompt give the same output.
    pub seed: Option<u64>,
    /// Penalty for tokens already present (-2..2).
    pub presence_penalty: Option<f32>,
    /// Penalty proportional to a token's count so far (-2..2).
    pub frequency_penalty: Option<f32>,
    /// Keep tokens whose probability is at least this fraction of the most
    /// likely one's (0..1).
    pub min_p: Option<f32>,
    /// Divides positive logits (multiplies negative ones) of every token
    /// already in the prompt or output; 1 disables.
    pub repetition_penalty: Option<f32>,
    /// Return this many most likely alternatives (with log-probabilities)
    /// for each generated token.
    pub logprobs: Option<u32>,
}

/// Most alternatives a request may ask log-probabilities for.
pub const MAX_LOGPROBS: u32 = 20;

/// A sampling parameter out of its range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{param} {message}")]
pub struct SamplingError {
    /// The parameter at fault, as named in every API (`temperature`, ...).
    pub param: &'static str,
    /// What its value must be, and what it was.
    pub message: String,
}

impl SamplingParams {
    /// Checks every parameter against its range. One definition of the
    /// ranges for every door into the engine: the gateway validates client
    /// requests with it, the worker validates `Generate` and `Prefill` calls
    /// with it, so the two can never disagree.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let Self { temperature, top_p, top_k: _, seed: _, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs } = self;
        let out_of = |param: &'static str, range: &str, value: f32| SamplingError { param, message: format!("must be {range}, got {value}") };
        let check = |param: &'static str, value: Option<f32>, range: &str, within: fn(f32) -> bool| match value {
            Some(value) if !(value.is_finite() && within(value)) => Err(out_of(param, range, value)),
            _ => Ok(()),
        };
        check("temperature", *temperature, "between 0 and 2", |t| (0.0..=2.0).contains(&t))?;
        check("top_p", *top_p, "in (0, 1]", |p| p > 0.0 && p <= 1.0)?;
        check("presence_penalty", *presence_penalty, "between -2 and 2", |p| (-2.0..=2.0).contains(&p))?;
        check("frequency_penalty", *frequency_penalty, "between -2 and 2", |p| (-2.0..=2.0).contains(&p))?;
        check("min_p", *min_p, "between 0 and 1", |p| (0.0..=1.0).contains(&p))?;
        check("repetition_penalty", *repetition_penalty, "in (0, 10]", |p| p > 0.0 && p <= 10.0)?;
        if let Some(n) = logprobs
            && *n > MAX_LOGPROBS
        {
            return Err(SamplingError { param: "logprobs", message: format!("must be at most {MAX_LOGPROBS}, got {n}") });
        }
        Ok(())
    }
}

/// Log-probabilities of one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// Log-probability of the generated token.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, descending.
    pub top: Vec<(u32, f32)>,
}

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

/// When a sequence ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// Tokens to generate at most (at least 1).
    pub max_tokens: u32,
    /// Extra tokens that end generation (not included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-generation tokens.
    pub ignore_eos: bool,
}

/// One generation request over a tokenized prompt.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerateRequest {
    /// Caller's id, for logs and traces.
    pub request_id: String,
    /// Prompt token ids; never empty.
    pub prompt: Vec<u32>,
    /// How tokens are chosen.
    pub sampling: SamplingParams,
    /// When to stop.
    pub stop: StopConditions,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation or stop token was sampled.
    Stop,
    /// `max_tokens` or the context window was reached.
    Length,
}

/// Token accounting of a finished sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated (a stop token excluded).
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u32,
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

/// A snapshot of an engine's occupancy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Sequences scheduled (prefilling or decoding).
    pub running: u32,
    /// Sequences queued.
    pub waiting: u32,
    /// KV blocks referenced.
    pub blocks_used: u32,
    /// KV blocks in the pool.
    pub blocks_total: u32,
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
