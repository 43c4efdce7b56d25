//! OpenAI response bodies and streaming chunks, serialized with borrowed
//! strings (one allocation per chunk: the JSON text).

use serde::Serialize;
use serde_json::{Map, Value, json};
use turbine_api::{FinishReason, Usage};
use turbine_tokens::TokenBytes;

use crate::pipeline::GeneratedLogprob;

/// Which endpoint's shapes to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `chat.completion` / `chat.completion.chunk`.
    Chat,
    /// `text_completion`.
    Completion,
}

/// OpenAI's finish reason string.
pub fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct UsageBody {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Both.
    pub total_tokens: u32,
    /// Prompt details.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

impl From<Usage> for UsageBody {
    fn from(usage: Usage) -> Self {
        UsageBody {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: usage.cached_prompt_tokens },
        }
    }
}

/// Identity fields shared by every body of one response.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name as requested.
    pub model: String,
    /// Shapes to produce.
    pub endpoint: Endpoint,
}

/// The `logprobs` object of a choice (or chunk) in the endpoint's shape:
/// chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completions
/// `{tokens, token_logprobs, top_logprobs, text_offset}`. `offset` is the
/// completion text's length in characters before these tokens; it advances.
pub fn logprobs_body(endpoint: Endpoint, entries: &[GeneratedLogprob], vocabulary: &TokenBytes, offset: &mut usize) -> Value {
    let spell = |token: u32| String::from_utf8_lossy(vocabulary.get(token)).into_owned();
    match endpoint {
        Endpoint::Chat => {
            let content: Vec<Value> = entries
                .iter()
                .map(|entry| {
                    let top: Vec<Value> = entry
                        .logprobs
                        .top
                        .iter()
                        .map(|&(token, logprob)| json!({"token": spell(token), "logprob": logprob, "bytes": vocabulary.get(token)}))
                        .collect();
                    json!({"token": spell(entry.token), "logprob": entry.logprobs.logprob, "bytes": vocabulary.get(entry.token), "top_logprobs": top})
                })
                .collect();
            json!({ "content": content })
        }
        Endpoint::Completion => {
            let mut tokens = Vec::with_capacity(entries.len());
            let mut token_logprobs = Vec::with_capacity(entries.len());
            let mut top_logprobs = Vec::with_capacity(entries.len());
            let mut text_offset = Vec::with_capacity(entries.len());
            for entry in entries {
                let token = spell(entry.token);
                text_offset.push(*offset);
                *offset += token.chars().count();
                tokens.push(token);
                token_logprobs.push(entry.logprobs.logprob);
                let top: Map<String, Value> = entry.logprobs.top.iter().map(|&(token, logprob)| (spell(token), json!(logprob))).collect();
                top_logprobs.push(top);
            }
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset})
        }
    }
}

#[derive(Serialize)]
struct ChatMessageBody<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageBody<'a>,
    logprobs: Option<&'a Value>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    text: &'a str,
    index: u32,
    logprobs: Option<&'a Value>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct Whole<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    usage: UsageBody,
    system_fingerprint: Option<()>,
}

/// One choice of a non-streaming response.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The text generated.
    pub text: String,
    /// Why it ended.
    pub reason: FinishReason,
    /// From [`logprobs_body`], when the request asked.
    pub logprobs: Option<Value>,
}

/// The usage of a request whose choices used these: the prompt once (each
/// choice's is the same), the completions' tokens added up, and the prompt
/// tokens every choice found cached.
pub fn combined_usage(usages: impl IntoIterator<Item = Usage>) -> Usage {
    usages
        .into_iter()
        .reduce(|total, usage| Usage {
            prompt_tokens: total.prompt_tokens,
            completion_tokens: total.completion_tokens + usage.completion_tokens,
            cached_prompt_tokens: total.cached_prompt_tokens.min(usage.cached_prompt_tokens),
        })
        .unwrap_or_default()
}

/// The non-streaming response body: the choices in order of their index.
pub fn whole(meta: &ResponseMeta, choices: &[Choice], usage: Usage) -> Vec<u8> {
    let result = match meta.endpoint {
        Endpoint::Chat => serde_json::to_vec(&Whole {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: choices
                .iter()
                .zip(0..)
                .map(|(choice, index)| ChatChoice {
                    index,
                    message: ChatMessageBody { role: "assistant", content: &choice.text },
                    logprobs: choice.logprobs.as_ref(),
                    finish_reason: finish_reason(choice.reason),
                })
                .collect(),
            usage: usage.into(),
            system_fingerprint: None,
        }),
        Endpoint::Completion => serde_json::to_vec(&Whole {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: choices
                .iter()
                .zip(0..)
                .map(|(choice, index)| TextChoice {
                    text: &choice.text,
                    index,
                    logprobs: choice.logprobs.as_ref(),
                    finish_reason: Some(finish_reason(choice.reason)),
                })
                .collect(),
            usage: usage.into(),
            system_fingerprint: None,
        }),
    };
    result.expect("response bodies serialize")
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<&'a Value>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct Chunk<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    usage: UsageField,
}

/// `usage` on a chunk: absent (no include_usage), null, or the totals.
#[derive(Debug, Clone, Copy)]
pub enum UsageField {
    /// Field omitted.
    Absent,
    /// `"usage": null`.
    Null,
    /// The totals.
    Totals(UsageBody),
}

impl UsageField {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Absent | UsageField::Null => serializer.serialize_none(),
            UsageField::Totals(usage) => usage.serialize(serializer),
        }
    }
}

/// What one streamed chunk carries.
#[derive(Debug, Clone, Copy)]
pub enum ChunkContent<'a> {
    /// The chat stream's opening chunk (`role: assistant`).
    Role,
    /// Generated text, with its tokens' log-probabilities if asked.
    Text(&'a str, Option<&'a Value>),
    /// The end of the choice.
    Finish(FinishReason),
    /// The usage chunk (no choices).
    Usage(Usage),
}

/// One streamed chunk's JSON, of choice `index`; `include_usage` adds
/// `"usage": null` to chunks other than the usage chunk.
pub fn chunk(meta: &ResponseMeta, index: u32, content: ChunkContent<'_>, include_usage: bool) -> String {
    let usage = match content {
        ChunkContent::Usage(usage) => UsageField::Totals(usage.into()),
        _ if include_usage => UsageField::Null,
        _ => UsageField::Absent,
    };
    let result = match (meta.endpoint, content) {
        (_, ChunkContent::Usage(_)) => serde_json::to_string(&Chunk {
            id: &meta.id,
            object: chunk_object(meta.endpoint),
            created: meta.created,
            model: &meta.model,
            choices: [(); 0],
            usage,
        }),
        (Endpoint::Chat, content) => {
            let (delta, logprobs, finish_reason) = match content {
                ChunkContent::Role => (Delta { role: Some("assistant"), content: Some("") }, None, None),
                ChunkContent::Text(text, logprobs) => (Delta { role: None, content: Some(text) }, logprobs, None),
                ChunkContent::Finish(reason) => (Delta { role: None, content: None }, None, Some(finish_reason(reason))),
                ChunkContent::Usage(_) => unreachable!("handled above"),
            };
            serde_json::to_string(&Chunk {
                id: &meta.id,
                object: "chat.completion.chunk",
                created: meta.created,
                model: &meta.model,
                choices: [ChatChunkChoice { index, delta, logprobs, finish_reason }],
                usage,
            })
        }
        (Endpoint::Completion, content) => {
            let (text, logprobs, finish_reason) = match content {
                ChunkContent::Role => ("", None, None),
                ChunkContent::Text(text, logprobs) => (text, logprobs, None),
                ChunkContent::Finish(reason) => ("", None, Some(finish_reason(reason))),
                ChunkContent::Usage(_) => unreachable!("handled above"),
            };
            serde_json::to_string(&Chunk {
                id: &meta.id,
                object: "text_completion",
                created: meta.created,
                model: &meta.model,
                choices: [TextChoice { text, index, logprobs, finish_reason }],
                usage,
            })
        }
    };
    result.expect("chunks serialize")
}

fn chunk_object(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completion => "text_completion",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(endpoint: Endpoint) -> ResponseMeta {
        ResponseMeta { id: "id-1".into(), created: 7, model: "m".into(), endpoint }
    }

    #[test]
    fn chat_chunks_have_openai_shapes() {
        let role: serde_json::Value = serde_json::from_str(&chunk(&meta(Endpoint::Chat), 0, ChunkContent::Role, false)).unwrap();
        assert_eq!(role["object"], "chat.completion.chunk");
        assert_eq!(role["choices"][0]["delta"], serde_json::json!({"role": "assistant", "content": ""}));
        assert!(role.get("usage").is_none());
        let text: serde_json::Value = serde_json::from_str(&chunk(&meta(Endpoint::Chat), 0, ChunkContent::Text("hé", None), true)).unwrap();
        assert_eq!(text["choices"][0]["delta"]["content"], "hé");
        assert!(text["usage"].is_null() && text.get("usage").is_some());
        let finish: serde_json::Value = serde_json::from_str(&chunk(&meta(Endpoint::Chat), 0, ChunkContent::Finish(FinishReason::Length), false)).unwrap();
        assert_eq!(finish["choices"][0]["finish_reason"], "length");
        assert_eq!(finish["choices"][0]["delta"], serde_json::json!({}));
        let usage = Usage { prompt_tokens: 3, completion_tokens: 4, cached_prompt_tokens: 1 };
        let totals: serde_json::Value = serde_json::from_str(&chunk(&meta(Endpoint::Chat), 0, ChunkContent::Usage(usage), true)).unwrap();
        assert_eq!(totals["choices"], serde_json::json!([]));
        assert_eq!(totals["usage"]["total_tokens"], 7);
        assert_eq!(totals["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    }

    #[test]
    fn whole_bodies_have_openai_shapes() {
        let usage = Usage { prompt_tokens: 3, completion_tokens: 4, cached_prompt_tokens: 0 };
        let choice = |text: &str, reason| Choice { text: text.into(), reason, logprobs: None };
        let chat: serde_json::Value = serde_json::from_slice(&whole(&meta(Endpoint::Chat), &[choice("hi", FinishReason::Stop)], usage)).unwrap();
        assert_eq!(chat["object"], "chat.completion");
        assert_eq!(chat["choices"][0]["message"], serde_json::json!({"role": "assistant", "content": "hi"}));
        assert_eq!(chat["choices"][0]["finish_reason"], "stop");
        let text: serde_json::Value = serde_json::from_slice(&whole(&meta(Endpoint::Completion), &[choice("hi", FinishReason::Length)], usage)).unwrap();
        assert_eq!(text["object"], "text_completion");
        assert_eq!(text["choices"][0]["text"], "hi");
        assert_eq!(text["usage"]["completion_tokens"], 4);
        let two = [choice("a", FinishReason::Length), choice("b", FinishReason::Stop)];
        let body: serde_json::Value = serde_json::from_slice(&whole(&meta(Endpoint::Chat), &two, usage)).unwrap();
        assert_eq!(body["choices"][1]["index"], 1);
        assert_eq!((&body["choices"][0]["message"]["content"], &body["choices"][1]["finish_reason"]), (&json!("a"), &json!("stop")));
        let second: serde_json::Value = serde_json::from_str(&chunk(&meta(Endpoint::Completion), 1, ChunkContent::Text("b", None), false)).unwrap();
        assert_eq!((&second["choices"][0]["index"], &second["choices"][0]["text"]), (&json!(1), &json!("b")));
    }

    #[test]
    fn choices_share_the_prompt_and_add_up_their_completions() {
        let usage = |completion_tokens, cached_prompt_tokens| Usage { prompt_tokens: 10, completion_tokens, cached_prompt_tokens };
        assert_eq!(combined_usage([usage(4, 8), usage(6, 0), usage(1, 8)]), usage(11, 0));
        assert_eq!(combined_usage([usage(4, 8)]), usage(4, 8));
    }
}
