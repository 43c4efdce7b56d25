use turbine_api::{SamplingParams, StopConditions};
use turbine_kv::CacheSalt;
use turbine_tokens::TokenizerSpec;

use super::*;

/// A byte-level BPE tokenizer of the 256 bytes (GPT-2's byte-to-character
/// mapping) and one control token, `<|im_end|>` (id 256).
fn tokenizer() -> Arc<Tokenizer> {
    let printable = |byte: u32| (33..=126).contains(&byte) || (161..=172).contains(&byte) || (174..=255).contains(&byte);
    let mut shifted = 0;
    let mut tokens: Vec<String> = (0..256u32)
        .map(|byte| {
            let char = if printable(byte) {
                byte
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(char).unwrap().to_string()
        })
        .collect();
    tokens.push("<|im_end|>".into());
    let mut token_types = vec![1; 256];
    token_types.push(3);
    let spec = TokenizerSpec { model: "gpt2".into(), tokens, token_types, eog_token_ids: vec![256], ..TokenizerSpec::default() };
    Arc::new(Tokenizer::from_spec(spec).unwrap())
}

fn request() -> GenerateRequest {
    GenerateRequest {
        request_id: "r-1".into(),
        prompt: vec![104, 105, 10],
        stop: StopConditions { max_tokens: 8, stop_token_ids: vec![], ignore_eos: false },
        ..GenerateRequest::default()
    }
}

#[test]
fn the_body_sends_the_prompts_ids_greedy_and_nothing_turbine_did_not_ask_for() {
    let body = serde_json::to_value(completion_body("m", &request(), &[256], &tokenizer()).unwrap()).unwrap();
    assert_eq!(body["prompt"], serde_json::json!([104, 105, 10]));
    assert_eq!((body["model"].as_str(), body["max_tokens"].as_u64(), body["stream"].as_bool()), (Some("m"), Some(8), Some(true)));
    assert_eq!(body["stream_options"]["include_usage"], true, "usage comes at the end");
    assert_eq!(body["temperature"], 0.0, "unset is greedy");
    for unset in ["top_p", "top_k", "min_p", "seed", "repetition_penalty", "ignore_eos", "stop", "logprobs"] {
        assert!(body.get(unset).is_none(), "{unset} was not asked for: {body}");
    }
    let asked = GenerateRequest {
        sampling: SamplingParams { temperature: Some(0.7), top_k: Some(5), seed: Some(3), ..SamplingParams::default() },
        // 256 is the model's own end: the engine stops there itself; 33
        // ("!") goes as its text.
        stop: StopConditions { max_tokens: 8, stop_token_ids: vec![256, 33], ignore_eos: true },
        ..request()
    };
    let body = serde_json::to_value(completion_body("m", &asked, &[256], &tokenizer()).unwrap()).unwrap();
    assert_eq!((body["temperature"].as_f64(), body["top_k"].as_u64(), body["seed"].as_u64()), (Some(0.699999988079071), Some(5), Some(3)));
    assert_eq!((body["stop"].clone(), body["ignore_eos"].as_bool()), (serde_json::json!(["!"]), Some(true)));
}

#[test]
fn what_the_api_cannot_carry_is_refused_with_the_reason() {
    let refused = |request: GenerateRequest| match completion_body("m", &request, &[256], &tokenizer()) {
        Err(WorkerError::InvalidArgument(message)) => message,
        other => panic!("not refused: {other:?}"),
    };
    let logprobs = GenerateRequest { sampling: SamplingParams { logprobs: Some(1), ..SamplingParams::default() }, ..request() };
    assert!(refused(logprobs).contains("log-probabilities"));
    let tenant = GenerateRequest { cache_salt: CacheSalt::of(&["tenant-a"]), ..request() };
    assert!(refused(tenant).contains("tenant"));
    let many = GenerateRequest { stop: StopConditions { max_tokens: 8, stop_token_ids: vec![33, 34, 35, 36, 37], ignore_eos: false }, ..request() };
    assert!(refused(many).contains("at most 4"));
}

// Events as vLLM's and llama.cpp's OpenAI endpoints stream them (trimmed):
// text deltas, the finish reason, then usage alone, then [DONE].
const HELLO: &str = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"Hello","finish_reason":null}]}"#;
const WORLD: &str = r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":", <|im_end|> world","finish_reason":"length"}]}"#;
const USAGE: &str = r#"{"id":"cmpl-1","object":"text_completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7,"prompt_tokens_details":{"cached_tokens":2}}}"#;

#[test]
fn streamed_text_becomes_ids_that_decode_to_it_and_the_engines_usage_ends_the_stream() {
    let tokenizer = tokenizer();
    let mut completion = Completion::new(3, tokenizer.clone());
    let mut ids = completion.event(HELLO).unwrap().unwrap().tokens;
    let world = completion.event(WORLD).unwrap().unwrap();
    assert!(world.finished.is_none(), "the end waits for [DONE] and its usage");
    ids.extend(world.tokens);
    assert_eq!(tokenizer.decode(&ids), "Hello, <|im_end|> world", "the client reads the engine's text");
    assert!(!ids.contains(&256), "a control token's text the model wrote stays text");
    assert!(completion.event(USAGE).unwrap().is_none());
    let end = completion.event("[DONE]").unwrap().unwrap();
    assert_eq!(end.finished, Some((FinishReason::Length, Usage { prompt_tokens: 3, completion_tokens: 4, cached_prompt_tokens: 2 })), "the engine's counts");
    assert!(completion.is_done());
    assert!(completion.event("[DONE]").unwrap().is_none(), "one end only");
}

#[test]
fn an_unfinished_or_failed_stream_is_no_success() {
    let mut completion = Completion::new(3, tokenizer());
    completion.event(HELLO).unwrap();
    assert!(completion.event("[DONE]").unwrap().is_none(), "no finish reason: no finishing chunk");
    assert!(!completion.is_done());
    let mut failed = Completion::new(3, tokenizer());
    assert!(matches!(failed.event(r#"{"error":{"message":"out of memory"}}"#), Err(WorkerError::Internal(message)) if message.contains("out of memory")));
    let mut odd = Completion::new(3, tokenizer());
    assert!(matches!(odd.event(r#"{"choices":[{"text":"","finish_reason":"abort"}]}"#), Err(WorkerError::Unavailable(_))));
    assert!(matches!(odd.event("not json"), Err(WorkerError::Internal(_))));
}
