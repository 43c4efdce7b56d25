//! vLLM's OpenAI-compatible server as the adapter speaks to it: token ids
//! in (`prompt` as a list of ids), token ids out (`return_token_ids`),
//! streamed as server-sent events; its `/metrics` for load and its block
//! size, `/v1/models` for the served model and its context, `/health`.
//! Transport-free: bodies in, words out.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use turbine_api::worker::{TokenChunk, WorkerError};
use turbine_api::{FinishReason, GenerateRequest, Load, OutputFormat, SamplingParams, TokenLogprobs, Usage};

use super::prom;

/// The body of one `POST /v1/completions` for `request` on `model`.
/// `stop_ids`: the model's end-of-generation ids; vLLM is told them too,
/// so the engine stops where Turbine's own would whatever its generation
/// config says.
pub fn completion_body(model: &str, request: &GenerateRequest, stop_ids: &[u32]) -> CompletionBody {
    let sampling = &request.sampling;
    let mut stop_token_ids = request.stop.stop_token_ids.clone();
    if !request.stop.ignore_eos {
        stop_token_ids.extend(stop_ids.iter().filter(|id| !request.stop.stop_token_ids.contains(id)));
    }
    CompletionBody {
        model: model.to_owned(),
        prompt: request.prompt.clone(),
        max_tokens: request.stop.max_tokens,
        stream: true,
        stream_options: StreamOptions { include_usage: true },
        return_token_ids: true,
        sampling: Sampling::of(sampling),
        stop_token_ids,
        ignore_eos: request.stop.ignore_eos,
        logprobs: sampling.logprobs,
        return_tokens_as_token_ids: sampling.logprobs.map(|_| true),
        // A tenant's prefixes hit only its own cached blocks in the engine
        // too (vLLM salts its block hashes with it).
        cache_salt: super::events::salt_text(request.cache_salt),
        request_id: (!request.request_id.is_empty()).then(|| request.request_id.clone()),
        structured_outputs: StructuredOutputs::of(&sampling.output),
    }
}

/// vLLM's `structured_outputs`: the grammar its sampler holds the output
/// to: a request's schema, or for a JSON object the schema of any object,
/// named as a schema so that whichever grammar backend the server runs
/// takes it as an object and not any JSON value. No free whitespace is
/// asked for (a grammar allowing any lets a model spend its length on
/// blank lines, as the native sampler's bound on whitespace runs guards
/// against); vLLM's xgrammar backend takes that per request, its guidance
/// backend only from the server's own `--structured-outputs-config`.
#[derive(Debug, Clone, Serialize)]
pub struct StructuredOutputs {
    json: serde_json::Value,
    disable_any_whitespace: bool,
}

impl StructuredOutputs {
    fn of(output: &OutputFormat) -> Option<Self> {
        let json = match output {
            OutputFormat::Text => return None,
            OutputFormat::JsonObject { .. } => serde_json::json!({"type": "object"}),
            // Dialect::check_output refuses a schema that is not one object.
            OutputFormat::JsonSchema { schema, .. } => serde_json::from_str(schema).unwrap_or_default(),
        };
        Some(Self { json, disable_any_whitespace: true })
    }
}

/// `POST /v1/completions`, the fields Turbine sets.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionBody {
    model: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
    return_token_ids: bool,
    #[serde(flatten)]
    sampling: Sampling,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    return_tokens_as_token_ids: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    structured_outputs: Option<StructuredOutputs>,
}

/// A request's sampling as the OpenAI API's fields, with the extensions
/// vLLM, SGLang and llama.cpp read (`top_k`, `min_p`,
/// `repetition_penalty`; a server that does not ignores them), each sent
/// only when asked for (shared with [`super::openai`]).
#[derive(Debug, Clone, Serialize)]
pub(super) struct Sampling {
    temperature: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repetition_penalty: Option<f32>,
}

impl Sampling {
    pub(super) fn of(sampling: &SamplingParams) -> Self {
        Self {
            // Unset is greedy in Turbine; the API's default would sample.
            temperature: sampling.temperature.unwrap_or(0.0),
            top_p: sampling.top_p,
            top_k: sampling.top_k.filter(|&k| k > 0),
            seed: sampling.seed,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            min_p: sampling.min_p,
            repetition_penalty: sampling.repetition_penalty,
        }
    }
}

/// The OpenAI API's streaming options (shared with [`super::openai`]:
/// vLLM's server is one of the API's, with extensions).
#[derive(Debug, Clone, Serialize)]
pub(super) struct StreamOptions {
    pub(super) include_usage: bool,
}

/// One event of an OpenAI completion stream, vLLM's fields included.
#[derive(Debug, Deserialize)]
pub(super) struct StreamEvent {
    #[serde(default)]
    pub(super) choices: Vec<Choice>,
    pub(super) usage: Option<UsageIn>,
    pub(super) error: Option<ErrorIn>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Choice {
    /// The text (what the plain API streams).
    #[serde(default)]
    pub(super) text: String,
    /// vLLM's `return_token_ids`.
    token_ids: Option<Vec<u32>>,
    pub(super) finish_reason: Option<String>,
    logprobs: Option<LogprobsIn>,
}

#[derive(Debug, Deserialize)]
struct LogprobsIn {
    #[serde(default)]
    tokens: Vec<String>,
    #[serde(default)]
    token_logprobs: Vec<Option<f32>>,
    #[serde(default)]
    top_logprobs: Vec<Option<HashMap<String, f32>>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct UsageIn {
    pub(super) completion_tokens: Option<u32>,
    pub(super) prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Deserialize)]
pub(super) struct PromptDetails {
    pub(super) cached_tokens: Option<u32>,
}

/// An error body: `{"error": {"message": ...}}` (vLLM's and OpenAI's), or
/// a bare `{"message": ...}`.
#[derive(Debug, Deserialize)]
pub(super) struct ErrorIn {
    pub(super) message: Option<String>,
    /// vLLM's HTTP status for the error (the OpenAI API's own `code` is
    /// a string, or null, and reads as none).
    #[serde(default)]
    pub(super) code: serde_json::Value,
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: Option<ErrorIn>,
    message: Option<String>,
    detail: Option<serde_json::Value>,
}

/// What an engine's refusal (`status`, `body`) means to a worker's caller.
pub fn refusal(status: u16, body: &str) -> WorkerError {
    let said = serde_json::from_str::<ErrorBody>(body)
        .ok()
        .and_then(|body| body.error.and_then(|error| error.message).or(body.message).or(body.detail.map(|detail| detail.to_string())))
        .unwrap_or_else(|| body.chars().take(300).collect());
    let message = format!("the engine refused the request ({status}): {said}");
    match status {
        400 | 413 | 422 => WorkerError::InvalidArgument(message),
        429 => WorkerError::Overloaded(message),
        502..=504 => WorkerError::Unavailable(message),
        _ => WorkerError::Internal(message),
    }
}

/// Follows one completion stream: turns its events into token chunks.
#[derive(Debug)]
pub struct Completion {
    prompt_tokens: u32,
    stop_ids: Vec<u32>,
    generated: u32,
    cached: u32,
    finished: Option<FinishReason>,
    done: bool,
}

impl Completion {
    /// A stream for a prompt of `prompt_tokens` whose stop ids are
    /// `stop_ids` (the body's `stop_token_ids`: vLLM includes the one it
    /// stopped on in its ids; Turbine's workers do not).
    pub fn new(prompt_tokens: usize, body: &CompletionBody) -> Self {
        Self { prompt_tokens: prompt_tokens as u32, stop_ids: body.stop_token_ids.clone(), generated: 0, cached: 0, finished: None, done: false }
    }

    /// Whether the finishing chunk went out.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// One event's data (`data: ...` of the event stream): the chunk to
    /// pass on, if it carries anything.
    pub fn event(&mut self, data: &str) -> Result<Option<TokenChunk>, WorkerError> {
        let Some(event) = read_event(data)? else {
            return Ok(self.finish());
        };
        if let Some(usage) = event.usage {
            self.cached = usage.prompt_tokens_details.and_then(|details| details.cached_tokens).unwrap_or(0);
        }
        let mut chunk = TokenChunk::default();
        for choice in event.choices {
            let mut tokens = choice.token_ids.ok_or_else(|| WorkerError::Internal("the engine streamed no token ids (a vLLM older than 0.10.2?)".into()))?;
            let mut logprobs = choice.logprobs.map(token_logprobs).transpose()?.unwrap_or_default();
            if let Some(reason) = choice.finish_reason.as_deref() {
                let reason = match reason {
                    "stop" => FinishReason::Stop,
                    "length" => FinishReason::Length,
                    other => return Err(WorkerError::Unavailable(format!("the engine ended the request: {other}"))),
                };
                if reason == FinishReason::Stop && tokens.last().is_some_and(|last| self.stop_ids.contains(last)) {
                    tokens.pop();
                    logprobs.truncate(tokens.len());
                }
                self.finished = Some(reason);
            }
            self.generated += tokens.len() as u32;
            chunk.tokens.extend(tokens);
            chunk.logprobs.extend(logprobs);
        }
        Ok((!chunk.tokens.is_empty()).then_some(chunk))
    }

    /// The stream ended (`[DONE]`): the finishing chunk, once.
    fn finish(&mut self) -> Option<TokenChunk> {
        let reason = self.finished?;
        if std::mem::replace(&mut self.done, true) {
            return None;
        }
        let usage = Usage { prompt_tokens: self.prompt_tokens, completion_tokens: self.generated, cached_prompt_tokens: self.cached.min(self.prompt_tokens) };
        Some(TokenChunk { tokens: Vec::new(), logprobs: Vec::new(), finished: Some((reason, usage)) })
    }
}

/// One event's data of an OpenAI completion stream: the event, or none
/// at its end (`[DONE]`); an error event is the engine's failure.
pub(super) fn read_event(data: &str) -> Result<Option<StreamEvent>, WorkerError> {
    if data.trim() == "[DONE]" {
        return Ok(None);
    }
    let event: StreamEvent =
        serde_json::from_str(data).map_err(|error| WorkerError::Internal(format!("the engine sent an event Turbine cannot read: {error}")))?;
    match event.error {
        // A request refused once its stream had begun (vLLM checks a
        // schema's grammar so, answering 200 then an error event of code
        // 400) keeps its meaning: the client's to mend, not the worker
        // failing (which would move it to another worker to fail again).
        Some(ErrorIn { message, code }) => match code.as_u64().and_then(|code| u16::try_from(code).ok()) {
            Some(status @ 400..=499) => Err(refusal(status, &serde_json::json!({ "message": message }).to_string())),
            _ => Err(WorkerError::Internal(format!("the engine failed the request: {}", message.unwrap_or_default()))),
        },
        None => Ok(Some(event)),
    }
}

/// `token_id:123` (what `return_tokens_as_token_ids` names tokens by).
fn token_id(name: &str) -> Result<u32, WorkerError> {
    name.strip_prefix("token_id:")
        .and_then(|id| id.parse().ok())
        .ok_or_else(|| WorkerError::Internal(format!("the engine named a log-probability's token {name:?}, not by its id")))
}

fn token_logprobs(logprobs: LogprobsIn) -> Result<Vec<TokenLogprobs>, WorkerError> {
    let LogprobsIn { tokens, token_logprobs, top_logprobs } = logprobs;
    let mut out = Vec::with_capacity(tokens.len());
    for (index, _token) in tokens.iter().enumerate() {
        let logprob = token_logprobs.get(index).copied().flatten().unwrap_or(f32::NEG_INFINITY);
        let mut top = match top_logprobs.get(index).cloned().flatten() {
            Some(top) => top.into_iter().map(|(name, logprob)| Ok((token_id(&name)?, logprob))).collect::<Result<Vec<_>, WorkerError>>()?,
            None => Vec::new(),
        };
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        out.push(TokenLogprobs { logprob, top });
    }
    Ok(out)
}

/// What vLLM's `/metrics` says of its occupancy and its cache.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub load: Load,
    /// Tokens per KV block (`cache_config_info`).
    pub block_size: Option<u32>,
}

/// Reads vLLM's `/metrics` text.
pub fn engine_stats(text: &str) -> Result<EngineStats, WorkerError> {
    let running = prom::sum(text, "vllm:num_requests_running");
    let waiting = prom::sum(text, "vllm:num_requests_waiting");
    let (Some(running), Some(waiting)) = (running, waiting) else {
        return Err(WorkerError::Internal("the engine's /metrics has no vllm:num_requests_running or vllm:num_requests_waiting (is it vLLM?)".into()));
    };
    let info = prom::samples(text).find(|sample| sample.name == "vllm:cache_config_info");
    let label = |name: &str| info.as_ref().and_then(|info| info.labels.get(name)).and_then(|value| value.parse::<u32>().ok());
    let blocks_total = label("num_gpu_blocks").unwrap_or(0);
    let usage = prom::value(text, "vllm:kv_cache_usage_perc").unwrap_or(0.0).clamp(0.0, 1.0);
    let load = Load { running: running as u32, waiting: waiting as u32, blocks_used: (usage * f64::from(blocks_total)).round() as u32, blocks_total };
    Ok(EngineStats { load, block_size: label("block_size") })
}

/// `GET /v1/models`.
#[derive(Debug, Deserialize)]
pub struct Models {
    pub data: Vec<ServedModel>,
}

/// One model the engine serves.
#[derive(Debug, Deserialize)]
pub struct ServedModel {
    pub id: String,
    /// vLLM's context window for it.
    pub max_model_len: Option<u32>,
    /// llama.cpp's (`meta.n_ctx`: one slot's).
    pub meta: Option<ModelMeta>,
}

/// What llama.cpp says of a served model.
#[derive(Debug, Deserialize)]
pub struct ModelMeta {
    pub n_ctx: Option<u32>,
}

impl ServedModel {
    /// The context window the engine serves it with, if it says.
    pub fn context_length(&self) -> Option<u32> {
        self.max_model_len.or(self.meta.as_ref().and_then(|meta| meta.n_ctx)).filter(|&n| n > 0)
    }
}

/// Splits an event stream into its events' data, across reads. Each byte is
/// looked at once, however the stream is cut into reads; lines end at LF, CR
/// or CRLF, as the event-stream format allows.
#[derive(Debug, Default)]
pub struct EventStream {
    /// The bytes of a line not yet ended.
    line: Vec<u8>,
    /// The data lines of the event being read.
    data: Vec<String>,
    /// Bytes held for the event being read.
    held: usize,
    /// The last read ended in a CR: an LF opening the next one ends no line.
    after_cr: bool,
}

/// The most bytes one event may take (a chunk of tokens with their
/// log-probabilities is a few KiB): beyond it the engine is not speaking
/// server-sent events.
const MAX_EVENT_BYTES: usize = 4 << 20;

impl EventStream {
    /// Adds bytes read; returns the data of every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, WorkerError> {
        let mut events = Vec::new();
        let mut rest = bytes;
        if std::mem::take(&mut self.after_cr) {
            rest = rest.strip_prefix(b"\n").unwrap_or(rest);
        }
        while let Some(at) = rest.iter().position(|&byte| byte == b'\n' || byte == b'\r') {
            self.line.extend_from_slice(&rest[..at]);
            let cr = rest[at] == b'\r';
            rest = &rest[at + 1..];
            if cr {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            self.end_line(&mut events);
            self.check_size()?;
        }
        self.line.extend_from_slice(rest);
        self.check_size()?;
        Ok(events)
    }

    /// A line has ended: a blank one dispatches the event read so far.
    fn end_line(&mut self, events: &mut Vec<String>) {
        if self.line.is_empty() {
            if !self.data.is_empty() {
                events.push(self.data.join("\n"));
                self.data.clear();
            }
            self.held = 0;
        } else if let Some(value) = field_value(&self.line, b"data") {
            self.held += value.len() + 1;
            self.data.push(String::from_utf8_lossy(value).into_owned());
        }
        self.line.clear();
    }

    fn check_size(&self) -> Result<(), WorkerError> {
        if self.held + self.line.len() > MAX_EVENT_BYTES {
            return Err(WorkerError::Internal(format!("the engine sent an event of over {MAX_EVENT_BYTES} bytes")));
        }
        Ok(())
    }
}

/// The value of a line naming `field` (`field: value`, `field:value` or a
/// bare `field`), if it names that field.
fn field_value<'a>(line: &'a [u8], field: &[u8]) -> Option<&'a [u8]> {
    let rest = line.strip_prefix(field)?;
    if rest.is_empty() {
        return Some(rest);
    }
    let value = rest.strip_prefix(b":")?;
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

#[cfg(test)]
mod tests;
