//! A generation request and what comes back for it: the words the gateway,
//! the router, the workers and their engines share.

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
    /// What the output must be.
    pub output: OutputFormat,
}

/// What a request's output must be.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum OutputFormat {
    /// Any text.
    #[default]
    Text,
    /// One JSON object (OpenAI's `response_format: json_object`): every
    /// token sampled keeps the output a prefix of a valid object, and the
    /// sequence ends once the object closes.
    JsonObject {
        /// Output generated before, under this format, that ends the
        /// prompt: a request continued on another worker after its first
        /// failed mid-stream.
        continued: u32,
    },
    /// One JSON value valid against a JSON Schema (OpenAI's
    /// `response_format: json_schema`), held so by the engine's grammar.
    JsonSchema {
        /// The schema, as compact JSON text of one object
        /// ([`OutputFormat::json_schema`] checks it).
        schema: std::sync::Arc<str>,
        /// As [`OutputFormat::JsonObject`]'s.
        continued: u32,
    },
}

/// An output format's kind, without its schema: what the router matches
/// against what workers announce ([`OutputFormats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum FormatKind {
    /// Any text.
    #[default]
    Text,
    /// One JSON object.
    JsonObject,
    /// One JSON value valid against a schema.
    JsonSchema,
}

impl FormatKind {
    /// Its name in the OpenAI API's `response_format.type`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::JsonObject => "json_object",
            Self::JsonSchema => "json_schema",
        }
    }
}

/// The output formats a worker's engine holds its output to, as the
/// worker announces them in its registry record: routers send a request
/// only to a worker that keeps to its format. A record written before
/// workers announced them reads as none (text only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct OutputFormats {
    /// One JSON object ([`OutputFormat::JsonObject`]).
    pub json_object: bool,
    /// A JSON Schema's value ([`OutputFormat::JsonSchema`]), whatever
    /// the schema's keywords.
    pub json_schema: bool,
    /// A JSON Schema's value for a schema of a core subset of keywords
    /// only (the native engine's): routers send a schema here only while
    /// no worker of [`OutputFormats::json_schema`] is live.
    pub json_schema_core: bool,
    /// It goes on from output begun under a format elsewhere (a request
    /// continued after its first worker failed mid-output).
    pub resumes: bool,
}

impl OutputFormats {
    /// Text only.
    pub const TEXT: Self = Self { json_object: false, json_schema: false, json_schema_core: false, resumes: false };

    /// Whether it holds nothing but text (the default, not written).
    pub fn is_text_only(&self) -> bool {
        *self == Self::TEXT
    }

    /// Whether its engine keeps to output of `kind`, from its first token
    /// or, when `continued`, from output begun elsewhere.
    pub fn holds(&self, kind: FormatKind, continued: bool) -> bool {
        let kept = match kind {
            FormatKind::Text => return true,
            FormatKind::JsonObject => self.json_object,
            FormatKind::JsonSchema => self.json_schema || self.json_schema_core,
        };
        kept && (!continued || self.resumes)
    }
}

/// The longest JSON Schema a request may hold its output to, in bytes of
/// compact JSON: an engine compiles it to a grammar before the first
/// token, so its size is bounded like a prompt's.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;

impl OutputFormat {
    /// Output held to the JSON Schema `schema`, or why it cannot be: a
    /// schema is one JSON object of at most [`MAX_SCHEMA_BYTES`].
    pub fn json_schema(schema: &serde_json::Value) -> Result<Self, SamplingError> {
        if !schema.is_object() {
            return Err(SamplingError { param: "json_schema", message: "must be a JSON object (a JSON Schema)".into() });
        }
        let text = serde_json::to_string(schema).map_err(|error| SamplingError { param: "json_schema", message: error.to_string() })?;
        if text.len() > MAX_SCHEMA_BYTES {
            return Err(SamplingError { param: "json_schema", message: format!("must be at most {MAX_SCHEMA_BYTES} bytes as JSON, got {}", text.len()) });
        }
        Ok(Self::JsonSchema { schema: text.into(), continued: 0 })
    }

    /// Its kind, without the schema.
    pub fn kind(&self) -> FormatKind {
        match self {
            Self::Text => FormatKind::Text,
            Self::JsonObject { .. } => FormatKind::JsonObject,
            Self::JsonSchema { .. } => FormatKind::JsonSchema,
        }
    }

    /// How many tokens ending the prompt were generated before under this
    /// format (0 for text).
    pub fn continued(&self) -> u32 {
        match self {
            Self::Text => 0,
            Self::JsonObject { continued } | Self::JsonSchema { continued, .. } => *continued,
        }
    }

    /// This format, `more` generated tokens further on (a request
    /// continued after its first worker failed).
    pub fn continued_by(&self, more: u32) -> Self {
        match self {
            Self::Text => Self::Text,
            Self::JsonObject { continued } => Self::JsonObject { continued: continued + more },
            Self::JsonSchema { schema, continued } => Self::JsonSchema { schema: schema.clone(), continued: continued + more },
        }
    }
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
        let Self { temperature, top_p, top_k: _, seed: _, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs, output } = self;
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
        if let OutputFormat::JsonSchema { schema, .. } = output {
            let value: serde_json::Value =
                serde_json::from_str(schema).map_err(|error| SamplingError { param: "json_schema", message: format!("is not JSON: {error}") })?;
            OutputFormat::json_schema(&value)?;
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
    /// The KV namespace its blocks are cached in (its tenant's): its
    /// prompt hits only blocks of the same salt.
    pub cache_salt: turbine_kv::CacheSalt,
    /// Whose blocks it computes (the kv-store charges them to that
    /// tenant's fair share).
    pub kv_tenant: turbine_kv::KvTenant,
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

/// A snapshot of an engine's occupancy (a worker reports its engine's,
/// with each heartbeat to the registry too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// A worker's part in disaggregated serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    /// Computes whole requests, prompt and decode.
    #[default]
    Aggregated,
    /// Computes prompts and hands their KV cache to decode workers.
    Prefill,
    /// Decodes, reading long prompts' KV from prefill workers (short ones
    /// it computes itself).
    Decode,
}

impl WorkerRole {
    /// The role's name, as in configuration ("aggregated", "prefill", "decode").
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Aggregated => "aggregated",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
