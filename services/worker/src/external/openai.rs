//! Any server of the OpenAI completions API as the adapter speaks to it
//! (`--upstream-kind openai`): token ids in (the API's `prompt` takes a
//! list of ids), text out, streamed as server-sent events; `GET
//! /v1/models` for the served model and the engine's health. The API
//! returns no token ids, so the adapter re-tokenizes the text each event
//! carries with the card's tokenizer (the card says so: `retokenized`):
//! the text the client reads is the engine's (a byte-level BPE tokenizer
//! decodes what it encodes to the same text), the ids may not be the ones
//! the engine generated. Transport-free: bodies in, words out.
//!
//! What the API cannot carry is refused when a request arrives, never
//! answered wrong: log-probabilities (they would name re-tokenized
//! tokens) and a tenant's request (the API has no way to keep a tenant's
//! cache apart from the others').

use std::sync::Arc;

use serde::Serialize;
use turbine_api::worker::{TokenChunk, WorkerError};
use turbine_api::{FinishReason, GenerateRequest, Usage};
use turbine_tokens::Tokenizer;

use super::vllm::{Sampling, StreamOptions, read_event};

/// The most stop sequences the OpenAI API takes.
const MAX_STOP: usize = 4;

/// The body of one `POST /v1/completions` for `request` on `model`, or
/// why the API cannot carry it. `eog_ids`: the model's end-of-generation
/// ids (the engine stops on its own end of sequence; any other stop id
/// the request names goes as its text).
pub fn completion_body(model: &str, request: &GenerateRequest, eog_ids: &[u32], tokenizer: &Tokenizer) -> Result<CompletionBody, WorkerError> {
    let sampling = &request.sampling;
    if sampling.logprobs.is_some() {
        return Err(WorkerError::InvalidArgument(
            "this worker's engine speaks the OpenAI API, which streams text: it cannot give log-probabilities of Turbine's token ids".into(),
        ));
    }
    if !request.cache_salt.is_shared() {
        return Err(WorkerError::InvalidArgument(
            "this worker's engine speaks the plain OpenAI API, which cannot keep a tenant's cached prompts apart: a tenant's requests are not served here"
                .into(),
        ));
    }
    let stop: Vec<String> =
        request.stop.stop_token_ids.iter().filter(|id| !eog_ids.contains(id)).map(|&id| tokenizer.decode(&[id])).filter(|text| !text.is_empty()).collect();
    if stop.len() > MAX_STOP {
        return Err(WorkerError::InvalidArgument(format!("the OpenAI API takes at most {MAX_STOP} stop sequences; the request names {}", stop.len())));
    }
    Ok(CompletionBody {
        model: model.to_owned(),
        prompt: request.prompt.clone(),
        max_tokens: request.stop.max_tokens,
        stream: true,
        stream_options: StreamOptions { include_usage: true },
        sampling: Sampling::of(sampling),
        ignore_eos: request.stop.ignore_eos.then_some(true),
        stop,
    })
}

/// `POST /v1/completions`, the fields Turbine sets.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionBody {
    model: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
    #[serde(flatten)]
    sampling: Sampling,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignore_eos: Option<bool>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    stop: Vec<String>,
}

/// Follows one completion stream: turns the text its events carry into
/// token chunks.
pub struct Completion {
    tokenizer: Arc<Tokenizer>,
    prompt_tokens: u32,
    /// Ids re-tokenized from the text so far.
    generated: u32,
    /// What the engine counts it generated, when it says (usage).
    engine_generated: Option<u32>,
    cached: u32,
    finished: Option<FinishReason>,
    done: bool,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion").field("generated", &self.generated).field("finished", &self.finished).field("done", &self.done).finish_non_exhaustive()
    }
}

impl Completion {
    /// A stream for a prompt of `prompt_tokens`, its text re-tokenized
    /// with `tokenizer`.
    pub fn new(prompt_tokens: usize, tokenizer: Arc<Tokenizer>) -> Self {
        Self { tokenizer, prompt_tokens: prompt_tokens as u32, generated: 0, engine_generated: None, cached: 0, finished: None, done: false }
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
        let Some(event) = read_event(data)? else {
            return Ok(self.finish());
        };
        if let Some(usage) = event.usage {
            self.engine_generated = usage.completion_tokens;
            self.cached = usage.prompt_tokens_details.and_then(|details| details.cached_tokens).unwrap_or(0);
        }
        let mut chunk = TokenChunk::default();
        for choice in event.choices {
            if !choice.text.is_empty() {
                // As text, not control tokens: a `<|im_end|>` the model
                // wrote as text stays text.
                let ids =
                    self.tokenizer.encode_plain(&choice.text).map_err(|error| WorkerError::Internal(format!("re-tokenizing the engine's text: {error}")))?;
                self.generated += ids.len() as u32;
                chunk.tokens.extend(ids);
            }
            if let Some(reason) = choice.finish_reason.as_deref() {
                self.finished = Some(match reason {
                    "stop" => FinishReason::Stop,
                    "length" => FinishReason::Length,
                    other => return Err(WorkerError::Unavailable(format!("the engine ended the request: {other}"))),
                });
            }
        }
        Ok((!chunk.tokens.is_empty()).then_some(chunk))
    }

    /// The stream ended (`[DONE]`): the finishing chunk, once; none when
    /// the engine never said why it finished (the stream is then
    /// unfinished, an error for the caller).
    fn finish(&mut self) -> Option<TokenChunk> {
        let reason = self.finished?;
        self.done = true;
        // The engine's own count when it gives one: what it generated, the
        // length the request was bounded by.
        let completion_tokens = self.engine_generated.unwrap_or(self.generated);
        let usage = Usage { prompt_tokens: self.prompt_tokens, completion_tokens, cached_prompt_tokens: self.cached.min(self.prompt_tokens) };
        Some(TokenChunk { tokens: Vec::new(), logprobs: Vec::new(), finished: Some((reason, usage)) })
    }
}

#[cfg(test)]
mod tests;
