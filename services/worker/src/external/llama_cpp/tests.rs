use turbine_api::{SamplingParams, StopConditions};
use turbine_kv::CacheSalt;

use super::*;

fn request() -> GenerateRequest {
    GenerateRequest {
        request_id: "r-1".into(),
        prompt: vec![1, 9690, 198],
        sampling: SamplingParams { logprobs: Some(1), ..SamplingParams::default() },
        stop: StopConditions { max_tokens: 8, stop_token_ids: vec![7], ignore_eos: false },
        ..GenerateRequest::default()
    }
}

#[test]
fn the_body_asks_for_token_ids_greedy_with_no_filter_turbine_did_not_ask_for() {
    let body = serde_json::to_value(completion_body(&request())).unwrap();
    assert_eq!(body["prompt"], serde_json::json!([1, 9690, 198]));
    assert_eq!((body["return_tokens"].as_bool(), body["stream"].as_bool()), (Some(true), Some(true)));
    assert_eq!((body["n_predict"].as_u64(), body["n_probs"].as_u64()), (Some(8), Some(1)));
    assert_eq!(body["temperature"], 0.0, "unset is greedy");
    assert_eq!((body["top_k"].as_u64(), body["top_p"].as_f64(), body["min_p"].as_f64()), (Some(0), Some(1.0), Some(0.0)), "llama.cpp's own filters off");
    assert_eq!(body["cache_prompt"], true);
    let tenant = GenerateRequest { cache_salt: CacheSalt::of(&["tenant-a"]), ..request() };
    assert_eq!(serde_json::to_value(completion_body(&tenant)).unwrap()["cache_prompt"], false, "a tenant's prompt shares no cache");
}

#[test]
fn a_json_object_is_asked_of_the_servers_grammar_and_text_is_not() {
    assert!(serde_json::to_value(completion_body(&request())).unwrap().get("json_schema").is_none());
    let json =
        GenerateRequest { sampling: SamplingParams { output: turbine_api::OutputFormat::JsonObject { continued: 0 }, ..request().sampling }, ..request() };
    assert_eq!(serde_json::to_value(completion_body(&json)).unwrap()["json_schema"], serde_json::json!({"type": "object"}));
    let schema = serde_json::json!({"type": "array", "items": {"enum": [1, 2]}});
    let json =
        GenerateRequest { sampling: SamplingParams { output: turbine_api::OutputFormat::json_schema(&schema).unwrap(), ..request().sampling }, ..request() };
    assert_eq!(serde_json::to_value(completion_body(&json)).unwrap()["json_schema"], schema);
}

// Events as llama-server streams them (trimmed): one token each, then the
// end with no tokens.
const FIRST: &str = r#"{"index":0,"content":"\n","tokens":[198],"stop":false,"id_slot":0,"tokens_predicted":1,"tokens_evaluated":3,"timings":{"cache_n":2,"prompt_n":1},"completion_probabilities":[{"id":198,"token":"\n","bytes":[10],"logprob":-0.0013,"top_logprobs":[{"id":1,"token":"<s>","bytes":[],"logprob":-7.54},{"id":198,"token":"\n","bytes":[10],"logprob":-0.0013}]}]}"#;
const EOG: &str = r#"{"index":0,"content":"","tokens":[2],"stop":false,"timings":{"cache_n":2}}"#;
const LIMIT: &str = r#"{"index":0,"content":"","tokens":[],"stop":true,"stop_type":"limit","tokens_cached":11,"timings":{"cache_n":2}}"#;

#[test]
fn a_stream_becomes_chunks_and_ends_on_a_stop_id_without_passing_it_on() {
    let mut completion = Completion::new(&request(), &[2]);
    let first = completion.event(FIRST).unwrap().unwrap();
    assert_eq!(first.tokens, vec![198]);
    assert_eq!(first.logprobs[0].top, vec![(198, -0.0013), (1, -7.54)], "most likely first");
    assert!(first.finished.is_none());
    let done = completion.event(EOG).unwrap().unwrap();
    assert!(done.tokens.is_empty(), "the end-of-generation id is not passed on");
    assert_eq!(done.finished, Some((FinishReason::Stop, Usage { prompt_tokens: 3, completion_tokens: 1, cached_prompt_tokens: 2 })));
    assert!(completion.is_done());
    assert_eq!(completion.event(LIMIT).unwrap(), None, "nothing after the end");

    let request = GenerateRequest { stop: StopConditions { ignore_eos: true, ..request().stop }, ..request() };
    let mut completion = Completion::new(&request, &[2]);
    assert_eq!(completion.event(EOG).unwrap().unwrap().tokens, vec![2], "ignore_eos: the id is a token like any other");
    let limit = completion.event(LIMIT).unwrap().unwrap();
    assert_eq!(limit.finished, Some((FinishReason::Length, Usage { prompt_tokens: 3, completion_tokens: 1, cached_prompt_tokens: 2 })));
    let custom = r#"{"tokens":[5,7,9],"stop":false}"#;
    let mut completion = Completion::new(&request, &[2]);
    let stopped = completion.event(custom).unwrap().unwrap();
    assert_eq!((stopped.tokens, stopped.finished.map(|(reason, _)| reason)), (vec![5], Some(FinishReason::Stop)), "the request's own stop id ends it");
}

#[test]
fn a_failed_or_unreadable_stream_is_an_error() {
    let mut completion = Completion::new(&request(), &[2]);
    assert!(
        matches!(completion.event(r#"{"error":{"code":500,"message":"boom","type":"server_error"}}"#), Err(WorkerError::Internal(m)) if m.contains("boom"))
    );
    assert!(matches!(completion.event(r#"{"tokens":[],"stop":true,"stop_type":"none"}"#), Err(WorkerError::Unavailable(_))));
    assert!(completion.event("not json").is_err());
}

#[test]
fn the_metrics_give_its_slots_load() {
    let text = "# HELP llamacpp:requests_processing Number of requests processing\n# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 3\n";
    assert_eq!(engine_stats(text).unwrap(), Load { running: 2, waiting: 3, blocks_used: 0, blocks_total: 0 });
    assert!(engine_stats("vllm:num_requests_running 1\n").unwrap_err().to_string().contains("llama-server"));
}
