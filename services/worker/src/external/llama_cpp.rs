//! llama.cpp's server (`llama-server`) as the adapter speaks to it: token
//! ids in (`prompt` as a list of ids on its own `/completion`), token ids
//! out (`return_tokens`), streamed as server-sent events; its `/metrics`
//! (started with `--metrics`) for load, `/v1/models` for the served model
//! and its context, `/health`. Transport-free: bodies in, words out.
//!
//! llama.cpp has no stop-token list: the adapter ends the stream itself on
//! a stop id (closing the response, which cancels the request in the
//! engine), and never passes the id on, as Turbine's own workers do not.

use serde::{Deserialize, Serialize};
use turbine_api::worker::{TokenChunk, WorkerError};
use turbine_api::{FinishReason, GenerateRequest, Load, OutputFormat, TokenLogprobs, Usage};

use super::prom;

/// The body of one `POST /completion` for `request`.
pub fn completion_body(request: &GenerateRequest) -> CompletionBody {
    let sampling = &request.sampling;
    CompletionBody {
        prompt: request.prompt.clone(),
        n_predict: request.stop.max_tokens,
        stream: true,
        return_tokens: true,
        // Each event carries the cached prompt tokens so far (usage's
        // cached count when the adapter ends a stream itself).
        timings_per_token: true,
        // The engine cannot scope its cache by tenant: a tenant's request
        // neither reuses nor is meant to leave a prefix (docs/engines.md).
        cache_prompt: request.cache_salt.is_shared(),
        // Unset is greedy in Turbine; llama.cpp's default would sample.
        temperature: sampling.temperature.unwrap_or(0.0),
        // llama.cpp's defaults would otherwise filter (top-k 40, top-p
        // 0.95, min-p 0.05); Turbine's unset means off.
        top_k: sampling.top_k.unwrap_or(0),
        top_p: sampling.top_p.unwrap_or(1.0),
        min_p: sampling.min_p.unwrap_or(0.0),
        seed: sampling.seed,
        repeat_penalty: sampling.repetition_penalty.unwrap_or(1.0),
        presence_penalty: sampling.presence_penalty.unwrap_or(0.0),
        frequency_penalty: sampling.frequency_penalty.unwrap_or(0.0),
        n_probs: sampling.logprobs,
        ignore_eos: request.stop.ignore_eos,
        // JSON: the server's grammar of the request's schema, or of any
        // object's, which ends the sequence once the value is whole
        // (Dialect::check_output refuses a schema that is not one object).
        json_schema: match &sampling.output {
            OutputFormat::Text => None,
            OutputFormat::JsonObject { .. } => Some(serde_json::json!({"type": "object"})),
            OutputFormat::JsonSchema { schema, .. } => Some(serde_json::from_str(schema).unwrap_or_default()),
        },
    }
}

/// `POST /completion`, the fields Turbine sets.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionBody {
    prompt: Vec<u32>,
    n_predict: u32,
    stream: bool,
    return_tokens: bool,
    timings_per_token: bool,
    cache_prompt: bool,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    repeat_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    n_probs: Option<u32>,
    ignore_eos: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    json_schema: Option<serde_json::Value>,
}

/// One event of the completion stream.
#[derive(Debug, Deserialize)]
struct StreamEvent {
    #[serde(default)]
    tokens: Vec<u32>,
    #[serde(default)]
    stop: bool,
    stop_type: Option<String>,
    timings: Option<Timings>,
    completion_probabilities: Option<Vec<Probability>>,
    error: Option<ErrorIn>,
}

#[derive(Debug, Deserialize)]
struct Timings {
    /// Prompt tokens taken from the slot's cache.
    cache_n: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct Probability {
    logprob: Option<f32>,
    #[serde(default)]
    top_logprobs: Vec<TopProbability>,
}

#[derive(Debug, Deserialize)]
struct TopProbability {
    id: u32,
    logprob: f32,
}

#[derive(Debug, Deserialize)]
struct ErrorIn {
    message: Option<String>,
}

/// Follows one completion stream: turns its events into token chunks.
#[derive(Debug)]
pub struct Completion {
    prompt_tokens: u32,
    /// Where the stream ends: the request's stop ids and, unless it ignores
    /// them, the model's end-of-generation ids.
    stop_ids: Vec<u32>,
    generated: u32,
    cached: u32,
    done: bool,
}

impl Completion {
    /// A stream for `request`; `eog_ids`: the model's end-of-generation ids.
    pub fn new(request: &GenerateRequest, eog_ids: &[u32]) -> Self {
        let mut stop_ids = request.stop.stop_token_ids.clone();
        if !request.stop.ignore_eos {
            stop_ids.extend(eog_ids.iter().filter(|id| !request.stop.stop_token_ids.contains(id)));
        }
        Self { prompt_tokens: request.prompt.len() as u32, stop_ids, generated: 0, cached: 0, done: false }
    }

    /// Whether the finishing chunk went out.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// One event's data (`data: ...` of the event stream): the chunk to
    /// pass on, if it carries anything.
    pub fn event(&mut self, data: &str) -> Result<Option<TokenChunk>, WorkerError> {
        if self.done {
            return Ok(None);
        }
        let event: StreamEvent =
            serde_json::from_str(data).map_err(|error| WorkerError::Internal(format!("the engine sent an event Turbine cannot read: {error}")))?;
        if let Some(error) = event.error {
            return Err(WorkerError::Internal(format!("the engine failed the request: {}", error.message.unwrap_or_default())));
        }
        if let Some(cached) = event.timings.and_then(|timings| timings.cache_n) {
            self.cached = cached;
        }
        let probabilities = event.completion_probabilities.unwrap_or_default();
        let mut chunk = TokenChunk::default();
        let mut finished = None;
        for (index, &token) in event.tokens.iter().enumerate() {
            if self.stop_ids.contains(&token) {
                finished = Some(FinishReason::Stop);
                break;
            }
            chunk.tokens.push(token);
            if let Some(probability) = probabilities.get(index) {
                chunk.logprobs.push(token_logprobs(probability));
            }
        }
        if finished.is_none() && event.stop {
            finished = Some(match event.stop_type.as_deref() {
                Some("eos" | "word") => FinishReason::Stop,
                Some("limit") => FinishReason::Length,
                other => return Err(WorkerError::Unavailable(format!("the engine ended the request ({})", other.unwrap_or("no stop type")))),
            });
        }
        self.generated += chunk.tokens.len() as u32;
        if let Some(reason) = finished {
            self.done = true;
            let usage =
                Usage { prompt_tokens: self.prompt_tokens, completion_tokens: self.generated, cached_prompt_tokens: self.cached.min(self.prompt_tokens) };
            chunk.finished = Some((reason, usage));
        }
        Ok((chunk.finished.is_some() || !chunk.tokens.is_empty()).then_some(chunk))
    }
}

fn token_logprobs(probability: &Probability) -> TokenLogprobs {
    let mut top: Vec<(u32, f32)> = probability.top_logprobs.iter().map(|top| (top.id, top.logprob)).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    TokenLogprobs { logprob: probability.logprob.unwrap_or(f32::NEG_INFINITY), top }
}

/// Reads llama.cpp's `/metrics` text: requests in its slots and deferred.
/// It reports no KV occupancy in blocks (its cache is per slot).
pub fn engine_stats(text: &str) -> Result<Load, WorkerError> {
    let running = prom::value(text, "llamacpp:requests_processing");
    let waiting = prom::value(text, "llamacpp:requests_deferred");
    let (Some(running), Some(waiting)) = (running, waiting) else {
        return Err(WorkerError::Internal(
            "the engine's /metrics has no llamacpp:requests_processing or llamacpp:requests_deferred (is it llama-server?)".into(),
        ));
    };
    Ok(Load { running: running as u32, waiting: waiting as u32, blocks_used: 0, blocks_total: 0 })
}

#[cfg(test)]
mod tests;
