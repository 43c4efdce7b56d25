//! OpenAI request bodies and their validation into a [`TextRequest`].
//!
//! Unknown fields are ignored (SDKs add fields over time); known fields
//! whose features Turbine does not implement are refused with a 400 rather
//! than silently ignored.

use serde::Deserialize;
use serde_json::Value;
use turbine_api::{MAX_LOGPROBS, OutputFormat, SamplingError, SamplingParams};
use turbine_tokens::ChatMessage;

use crate::error::GatewayError;
use crate::openai::body::parse_json;
use crate::pipeline::{DEFAULT_COMPLETION_MAX_TOKENS, Namespace, Prompt, TextRequest};

/// OpenAI allows at most four stop sequences.
const MAX_STOP_SEQUENCES: usize = 4;

/// The longest stop sequence, in bytes: the gateway holds back up to this
/// much of a stream's text while it might still begin one.
const MAX_STOP_BYTES: usize = 1024;

/// Most choices (`n`) one request may ask for: each is a sequence of its
/// own on the workers and a place of the gateway's concurrency limit.
pub const MAX_CHOICES: u32 = 16;

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with the usage of the whole request.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Parameters shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    /// Model name.
    pub model: String,
    /// Maximum tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Temperature (0..2).
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling (0, 1].
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Number of choices (1 to [`MAX_CHOICES`]).
    #[serde(default)]
    pub n: Option<i64>,
    /// Stream with server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopField>,
    /// Sampler seed.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Presence penalty (-2..2).
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// Frequency penalty (-2..2).
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// Not supported beyond `{}`.
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Extension (as in vLLM): keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Extension: sample among the k most likely tokens (0 or -1: all).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Extension: drop tokens less likely than `min_p` times the most likely.
    #[serde(default)]
    pub min_p: Option<f64>,
    /// Extension: divide (multiply, if negative) the logits of tokens already
    /// in the prompt or output by this factor (1: off).
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// Extension (as in vLLM): a namespace for this request's prompt
    /// cache: it hits only blocks cached by requests of the same caller
    /// with the same salt (within the caller's tenant; never another's).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// The longest `cache_salt` accepted, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// How the response is delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Stream chunks over SSE.
    pub stream: bool,
    /// Add a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Choices to generate (`n`), each a sequence of its own.
    pub choices: u32,
}

/// `POST /v1/chat/completions` (besides [`CommonParams`], which are
/// parsed from the same body separately: `serde(flatten)` would lose the
/// path of a mistyped field).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The conversation.
    pub messages: Vec<RequestMessage>,
    /// Newer name of `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Return the log-probability of each generated token.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// With `logprobs`: also the most likely alternatives at each step (0..=20).
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Function calling (not supported).
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Output format; only `{"type": "text"}`.
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
}

/// `response_format`.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponseFormat {
    /// `text`, `json_object`, `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    /// With `json_schema`: the schema and its name.
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    /// The schema's name (OpenAI requires one; it names nothing here).
    pub name: Option<String>,
    /// The JSON Schema the output is held to.
    pub schema: Option<serde_json::Value>,
    /// OpenAI's strict mode: the output is always held to the schema here.
    pub strict: Option<bool>,
    /// What the schema is for (the model is not shown it).
    pub description: Option<String>,
}

impl ResponseFormat {
    /// The output format asked for.
    fn output(self) -> Result<OutputFormat, GatewayError> {
        match (self.kind.as_str(), self.json_schema) {
            ("text", _) => Ok(OutputFormat::Text),
            ("json_object", _) => Ok(OutputFormat::JsonObject { continued: 0 }),
            ("json_schema", None) => Err(GatewayError::invalid("response_format", "'response_format' of type 'json_schema' needs 'json_schema'.")),
            ("json_schema", Some(JsonSchemaFormat { name, schema, .. })) => {
                if name.as_deref().is_none_or(str::is_empty) {
                    return Err(GatewayError::invalid("response_format", "'response_format.json_schema.name' is required."));
                }
                let schema = schema.unwrap_or_else(|| serde_json::json!({}));
                OutputFormat::json_schema(&schema)
                    .map_err(|error| GatewayError::invalid("response_format", format!("'response_format.json_schema.schema' {}.", error.message)))
            }
            (kind, _) => Err(unsupported("response_format", &format!("response_format {kind:?}"))),
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct RequestMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, or a list of content parts; null for assistant tool calls.
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// Message content.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// `text` (others, such as `image_url`, are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// `POST /v1/completions` (besides [`CommonParams`]).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: PromptField,
    /// Echo the prompt (not supported).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Return the log-probability of each generated token and this many
    /// most likely alternatives (0..=20).
    #[serde(default)]
    pub logprobs: Option<i64>,
    /// Insertion suffix (not supported).
    #[serde(default)]
    pub suffix: Option<String>,
    /// Server-side best-of (only 1).
    #[serde(default)]
    pub best_of: Option<i64>,
}

/// `prompt`: text, token ids, or a batch of either (of one).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of texts.
    Texts(Vec<String>),
    /// A batch of token id lists.
    TokenLists(Vec<Vec<u32>>),
}

fn unsupported(param: &str, what: &str) -> GatewayError {
    GatewayError::invalid(param, format!("{what} is not supported by this server."))
}

impl From<SamplingError> for GatewayError {
    /// Out-of-range sampling parameters: the engine's ranges
    /// ([`SamplingParams::validate`]), the ones every worker applies too.
    fn from(error: SamplingError) -> Self {
        GatewayError::invalid(error.param, format!("'{}' {}.", error.param, error.message))
    }
}

/// How many alternatives per token a request may ask for.
fn logprob_count(param: &str, count: i64) -> Result<u32, GatewayError> {
    match u32::try_from(count) {
        Ok(count) if count <= MAX_LOGPROBS => Ok(count),
        _ => Err(GatewayError::invalid(param, format!("'{param}' must be between 0 and {MAX_LOGPROBS}, got {count}."))),
    }
}

/// Shared parameters after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedParams {
    /// Model name.
    pub model: String,
    /// Tokens to generate at most, if given.
    pub max_tokens: Option<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// The client's prompt-cache namespace, if any.
    pub cache_salt: Option<String>,
    /// Response delivery.
    pub delivery: Delivery,
}

impl CommonParams {
    /// Validates the shared parameters; `max_tokens` comes from whichever
    /// field the endpoint uses (named for error messages).
    /// `output` is what the output is held to, with the field that asked
    /// for it (`response_format`, gRPC's `output_format`).
    pub fn validate_shared(self, max_tokens: Option<(&str, i64)>, output: (OutputFormat, &str)) -> Result<ValidatedParams, GatewayError> {
        let CommonParams {
            model,
            max_tokens: _,
            temperature,
            top_p,
            n,
            stream,
            stream_options,
            stop,
            seed,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            ignore_eos,
            top_k,
            min_p,
            repetition_penalty,
            cache_salt,
        } = self;
        if model.trim().is_empty() {
            return Err(GatewayError::invalid("model", "'model' must name a model."));
        }
        let max_tokens = match max_tokens {
            None => None,
            Some((param, value)) if value < 1 => {
                return Err(GatewayError::invalid(param, format!("'{param}' must be at least 1, got {value}.")));
            }
            Some((param, value)) => Some(
                u32::try_from(value)
                    .map_err(|_| GatewayError::invalid(param, format!("'{param}' is too large: {value} exceeds any model's context length.")))?,
            ),
        };
        let choices = match n {
            None => 1,
            Some(n) => u32::try_from(n)
                .ok()
                .filter(|n| (1..=MAX_CHOICES).contains(n))
                .ok_or_else(|| GatewayError::invalid("n", format!("'n' must be between 1 and {MAX_CHOICES}, got {n}.")))?,
        };
        if logit_bias.is_some_and(|bias| !bias.is_empty()) {
            return Err(unsupported("logit_bias", "logit_bias"));
        }
        let sampling = SamplingParams {
            temperature: temperature.map(|value| value as f32),
            top_p: top_p.map(|value| value as f32),
            top_k: match top_k {
                None | Some(-1 | 0) => None,
                Some(k) => Some(u32::try_from(k).map_err(|_| GatewayError::invalid("top_k", format!("'top_k' must be -1, 0 or positive, got {k}.")))?),
            },
            seed: seed.map(|seed| seed as u64),
            presence_penalty: presence_penalty.map(|value| value as f32),
            frequency_penalty: frequency_penalty.map(|value| value as f32),
            min_p: min_p.map(|value| value as f32),
            repetition_penalty: repetition_penalty.map(|value| value as f32),
            logprobs: None,
            output: output.0,
        };
        sampling.validate()?;
        let stop = match stop {
            None => Vec::new(),
            Some(StopField::One(stop)) => vec![stop],
            Some(StopField::Many(stops)) => stops,
        };
        if stop.len() > MAX_STOP_SEQUENCES {
            return Err(GatewayError::invalid("stop", format!("At most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {}.", stop.len())));
        }
        if stop.iter().any(String::is_empty) {
            return Err(GatewayError::invalid("stop", "Stop sequences must not be empty."));
        }
        if let Some(long) = stop.iter().find(|stop| stop.len() > MAX_STOP_BYTES) {
            return Err(GatewayError::invalid("stop", format!("Stop sequences may be at most {MAX_STOP_BYTES} bytes long, got one of {}.", long.len())));
        }
        let stream = stream.unwrap_or(false);
        if stream_options.is_some() && !stream {
            return Err(GatewayError::invalid("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled."));
        }
        let include_usage = stream_options.and_then(|options| options.include_usage).unwrap_or(false);
        let ignore_eos = ignore_eos.unwrap_or(false);
        if ignore_eos && sampling.output != OutputFormat::Text {
            return Err(GatewayError::invalid(
                "ignore_eos",
                format!("'ignore_eos' cannot be used with a JSON '{}': the output ends where its value is whole.", output.1),
            ));
        }
        if let Some(salt) = &cache_salt
            && (salt.is_empty() || salt.len() > MAX_CACHE_SALT_BYTES)
        {
            return Err(GatewayError::invalid("cache_salt", format!("'cache_salt' must be 1 to {MAX_CACHE_SALT_BYTES} bytes, got {}.", salt.len())));
        }
        Ok(ValidatedParams { model, max_tokens, sampling, stop, ignore_eos, cache_salt, delivery: Delivery { stream, include_usage, choices } })
    }
}

/// Parses and validates a chat completion body.
pub fn parse_chat(body: &[u8]) -> Result<(TextRequest, Delivery), GatewayError> {
    let common: CommonParams = parse_json(body)?;
    parse_json::<ChatCompletionRequest>(body)?.into_text_request(common)
}

/// Parses and validates a completion body.
pub fn parse_completion(body: &[u8]) -> Result<(TextRequest, Delivery), GatewayError> {
    let common: CommonParams = parse_json(body)?;
    parse_json::<CompletionRequest>(body)?.into_text_request(common)
}

impl ChatCompletionRequest {
    /// Validates the request.
    pub fn into_text_request(self, common: CommonParams) -> Result<(TextRequest, Delivery), GatewayError> {
        let ChatCompletionRequest { messages, max_completion_tokens, logprobs, top_logprobs, tools, response_format } = self;
        let logprobs = match (logprobs.unwrap_or(false), top_logprobs) {
            (false, None) => None,
            (false, Some(_)) => return Err(GatewayError::invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")),
            (true, top) => Some(logprob_count("top_logprobs", top.unwrap_or(0))?),
        };
        if tools.is_some_and(|tools| !tools.is_empty()) {
            return Err(unsupported("tools", "Tool calling"));
        }
        let output = response_format.map(ResponseFormat::output).transpose()?.unwrap_or_default();
        if messages.is_empty() {
            return Err(GatewayError::invalid("messages", "'messages' must contain at least one message."));
        }
        let messages = messages.into_iter().enumerate().map(|(index, message)| chat_message(index, message)).collect::<Result<Vec<_>, _>>()?;
        let max_tokens = match (max_completion_tokens, common.max_tokens) {
            (Some(value), _) => Some(("max_completion_tokens", value)),
            (None, Some(value)) => Some(("max_tokens", value)),
            (None, None) => None,
        };
        let ValidatedParams { model, max_tokens, mut sampling, stop, ignore_eos, cache_salt, delivery } =
            common.validate_shared(max_tokens, (output, "response_format"))?;
        sampling.logprobs = logprobs;
        Ok((
            TextRequest { model, prompt: Prompt::Chat(messages), max_tokens, sampling, stop, ignore_eos, cache_salt, namespace: Namespace::Open, caller: None },
            delivery,
        ))
    }
}

fn chat_message(index: usize, message: RequestMessage) -> Result<ChatMessage, GatewayError> {
    let RequestMessage { role, content } = message;
    let role = match role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            return Err(GatewayError::invalid(
                format!("messages[{index}].role"),
                format!("Invalid role {other:?}; expected system, developer, user, assistant or tool."),
            ));
        }
    };
    let content = match content {
        None => String::new(),
        Some(MessageContent::Text(text)) => text,
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (part_index, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(part_text)) => text.push_str(&part_text),
                    (kind, _) => {
                        return Err(GatewayError::invalid(
                            format!("messages[{index}].content[{part_index}]"),
                            format!("Content parts of type {kind:?} are not supported; send text."),
                        ));
                    }
                }
            }
            text
        }
    };
    Ok(ChatMessage::new(role, content))
}

impl CompletionRequest {
    /// Validates the request.
    pub fn into_text_request(self, common: CommonParams) -> Result<(TextRequest, Delivery), GatewayError> {
        let CompletionRequest { prompt, echo, logprobs, suffix, best_of } = self;
        if echo == Some(true) {
            return Err(unsupported("echo", "echo"));
        }
        let logprobs = logprobs.map(|count| logprob_count("logprobs", count)).transpose()?;
        if suffix.is_some_and(|suffix| !suffix.is_empty()) {
            return Err(unsupported("suffix", "suffix"));
        }
        let batch_error = || GatewayError::invalid("prompt", "Batched prompts are not supported; send one prompt per request.");
        let prompt = match prompt {
            PromptField::Text(text) => Prompt::Text(text),
            PromptField::Tokens(tokens) => Prompt::Tokens(tokens),
            PromptField::Texts(mut texts) if texts.len() == 1 => Prompt::Text(texts.remove(0)),
            PromptField::TokenLists(mut lists) if lists.len() == 1 => Prompt::Tokens(lists.remove(0)),
            PromptField::Texts(_) | PromptField::TokenLists(_) => return Err(batch_error()),
        };
        let max_tokens = common.max_tokens.map(|value| ("max_tokens", value));
        let ValidatedParams { model, max_tokens, mut sampling, stop, ignore_eos, cache_salt, delivery } =
            common.validate_shared(max_tokens, (OutputFormat::Text, "response_format"))?;
        if let Some(best_of) = best_of
            && best_of != i64::from(delivery.choices)
        {
            return Err(GatewayError::invalid(
                "best_of",
                format!(
                    "'best_of' must equal 'n' ({}), got {best_of}: every choice generated is returned; none is chosen by log-probability.",
                    delivery.choices
                ),
            ));
        }
        sampling.logprobs = logprobs;
        let max_tokens = Some(max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS));
        Ok((TextRequest { model, prompt, max_tokens, sampling, stop, ignore_eos, cache_salt, namespace: Namespace::Open, caller: None }, delivery))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(json: &str) -> Result<(TextRequest, Delivery), GatewayError> {
        parse_chat(json.as_bytes())
    }

    fn completion(json: &str) -> Result<(TextRequest, Delivery), GatewayError> {
        parse_completion(json.as_bytes())
    }

    #[test]
    fn a_typical_chat_request_validates() {
        let (request, delivery) = chat(
            r#"{"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
                "max_completion_tokens":5,"temperature":0.7,"stop":"x","stream":true,"stream_options":{"include_usage":true},"seed":-1}"#,
        )
        .unwrap();
        assert_eq!(request.prompt, Prompt::Chat(vec![ChatMessage::new("system", "be brief"), ChatMessage::new("user", "hi")]));
        assert_eq!(request.max_tokens, Some(5));
        assert_eq!(request.stop, vec!["x".to_owned()]);
        assert_eq!(delivery, Delivery { stream: true, include_usage: true, choices: 1 });
        assert_eq!(request.sampling.seed, Some(u64::MAX));
    }

    #[test]
    fn sampling_extensions_and_logprobs_reach_the_engine() {
        let (request, _) = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":3,"top_k":40,"min_p":0.05,"repetition_penalty":1.1}"#,
        )
        .unwrap();
        let sampling = request.sampling;
        assert_eq!((sampling.logprobs, sampling.top_k, sampling.min_p, sampling.repetition_penalty), (Some(3), Some(40), Some(0.05), Some(1.1)));
        let (request, _) = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":false,"top_k":-1}"#).unwrap();
        assert_eq!((request.sampling.logprobs, request.sampling.top_k), (None, None));
        let (request, _) = completion(r#"{"model":"m","prompt":"a","logprobs":0}"#).unwrap();
        assert_eq!(request.sampling.logprobs, Some(0));
    }

    #[test]
    fn json_output_is_asked_with_response_format() {
        let (request, _) = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}"#).unwrap();
        assert_eq!(request.sampling.output, OutputFormat::JsonObject { continued: 0 });
        let (request, _) = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"text"}}"#).unwrap();
        assert_eq!(request.sampling.output, OutputFormat::Text);
        let (request, _) = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"object","required":["a"]}}}}"#,
        )
        .unwrap();
        assert_eq!(request.sampling.output, OutputFormat::JsonSchema { schema: r#"{"required":["a"],"type":"object"}"#.into(), continued: 0 });
        let (request, _) =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"x"}}}"#).unwrap();
        assert_eq!(request.sampling.output, OutputFormat::JsonSchema { schema: "{}".into(), continued: 0 }, "no schema: any JSON value");
        let long = format!("{{\"description\":\"{}\"}}", "x".repeat(turbine_api::MAX_SCHEMA_BYTES));
        for json in [
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}}"#.to_owned(),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"schema":{}}}}"#.to_owned(),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":[1]}}}"#
                .to_owned(),
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{long}}}}}}}"#
            ),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"grammar"}}"#.to_owned(),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"},"ignore_eos":true}"#.to_owned(),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"x"}},"ignore_eos":true}"#
                .to_owned(),
        ] {
            let json = json.as_str();
            let error = chat(json).unwrap_err();
            assert_eq!(error.status(), 400, "{json}");
            assert!(matches!(error.param.as_deref(), Some("response_format" | "ignore_eos")), "{json}: {error:?}");
        }
    }

    #[test]
    fn several_choices_are_asked_with_n() {
        let (_, delivery) = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":16}"#).unwrap();
        assert_eq!(delivery.choices, MAX_CHOICES);
        let (_, delivery) = completion(r#"{"model":"m","prompt":"a","n":3,"best_of":3}"#).unwrap();
        assert_eq!(delivery.choices, 3);
        let (_, delivery) = completion(r#"{"model":"m","prompt":"a"}"#).unwrap();
        assert_eq!(delivery.choices, 1);
    }

    #[test]
    fn completions_default_to_sixteen_tokens_and_accept_token_prompts() {
        let (request, delivery) = completion(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(request.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(request.max_tokens, Some(16));
        assert!(!delivery.stream);
        let (request, _) = completion(r#"{"model":"m","prompt":["once"]}"#).unwrap();
        assert_eq!(request.prompt, Prompt::Text("once".into()));
    }

    #[test]
    fn bad_parameters_are_named() {
        let cases = [
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#, "messages[0].role"),
            (r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, "messages[0].content[0]"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-5}"#, "max_tokens"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#, "max_tokens"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":99999999999}"#, "max_tokens"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":-1}"#, "max_completion_tokens"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}"#, "temperature"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":0}"#, "top_p"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}"#, "n"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":17}"#, "n"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":-1}"#, "n"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#, "stop"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#, "stream_options"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#, "tools"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#, "top_logprobs"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#, "top_logprobs"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_k":-2}"#, "top_k"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"min_p":1.5}"#, "min_p"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"repetition_penalty":0}"#, "repetition_penalty"),
            (r#"{"model":"","messages":[{"role":"user","content":"x"}]}"#, "model"),
            (r#"{"messages":[{"role":"user","content":"x"}]}"#, "model"),
            (r#"{"model":"m","messages":"hi"}"#, "messages"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#, "temperature"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"repetition_penalty":11}"#, "repetition_penalty"),
        ];
        for (json, param) in cases {
            let error = chat(json).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{json}: {error:?}");
            assert_eq!(error.status(), 400);
        }
        let long_stop = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"stop":["{}"]}}"#, "x".repeat(MAX_STOP_BYTES + 1));
        let error = chat(&long_stop).unwrap_err();
        assert_eq!((error.param.as_deref(), error.status().as_u16()), (Some("stop"), 400), "{error:?}");
        assert!(error.message.contains("at most 1024 bytes"), "{}", error.message);
        let longest = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"stop":["{}"]}}"#, "x".repeat(MAX_STOP_BYTES));
        chat(&longest).expect("a stop of the longest length is taken");
        for (json, param) in [
            (r#"{"model":"m","prompt":["a","b"]}"#, "prompt"),
            (r#"{"model":"m","prompt":"a","echo":true}"#, "echo"),
            (r#"{"model":"m","prompt":"a","best_of":3}"#, "best_of"),
            (r#"{"model":"m","prompt":"a","n":2,"best_of":3}"#, "best_of"),
            (r#"{"model":"m","prompt":"a","logprobs":-1}"#, "logprobs"),
            (r#"{"model":"m","prompt":{"text":"a"}}"#, "prompt"),
        ] {
            let error = completion(json).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{json}: {error:?}");
        }
    }
}
