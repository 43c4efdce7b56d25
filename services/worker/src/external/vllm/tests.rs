use turbine_api::{SamplingParams, StopConditions};
use turbine_kv::CacheSalt;

use super::*;

fn request() -> GenerateRequest {
    GenerateRequest {
        request_id: "r-1".into(),
        prompt: vec![1, 9690, 198],
        sampling: SamplingParams { logprobs: Some(1), top_k: Some(0), ..SamplingParams::default() },
        stop: StopConditions { max_tokens: 8, stop_token_ids: vec![7], ignore_eos: false },
        cache_salt: CacheSalt::of(&["tenant-a"]),
        ..GenerateRequest::default()
    }
}

#[test]
fn the_body_asks_for_token_ids_greedy_and_the_models_stop_ids() {
    let body = serde_json::to_value(completion_body("m", &request(), &[2, 7])).unwrap();
    assert_eq!(body["prompt"], serde_json::json!([1, 9690, 198]));
    assert_eq!((body["return_token_ids"].as_bool(), body["stream"].as_bool()), (Some(true), Some(true)));
    assert_eq!(body["temperature"], 0.0, "unset is greedy");
    assert_eq!(body["stop_token_ids"], serde_json::json!([7, 2]));
    assert!(body.get("top_k").is_none(), "0 disables top-k: not sent");
    assert_eq!(body["return_tokens_as_token_ids"], true);
    assert!(body["cache_salt"].as_str().unwrap().starts_with("turbine-"));
    assert_eq!(body["request_id"], "r-1");
    let shared = GenerateRequest { cache_salt: CacheSalt::SHARED, stop: StopConditions { ignore_eos: true, ..request().stop }, ..request() };
    let body = serde_json::to_value(completion_body("m", &shared, &[2])).unwrap();
    assert!(body.get("cache_salt").is_none());
    assert_eq!(body["stop_token_ids"], serde_json::json!([7]), "ignore_eos: only the request's own stop ids");
}

#[test]
fn a_json_object_is_asked_of_the_engines_grammar_and_text_is_not() {
    assert!(serde_json::to_value(completion_body("m", &request(), &[2])).unwrap().get("structured_outputs").is_none());
    let json =
        GenerateRequest { sampling: SamplingParams { output: turbine_api::OutputFormat::JsonObject { continued: 0 }, ..request().sampling }, ..request() };
    let body = serde_json::to_value(completion_body("m", &json, &[2])).unwrap();
    assert_eq!(body["structured_outputs"], serde_json::json!({"json": {"type": "object"}, "disable_any_whitespace": true}));
    let schema = serde_json::json!({"type": "array", "items": {"enum": [1, 2]}});
    let json =
        GenerateRequest { sampling: SamplingParams { output: turbine_api::OutputFormat::json_schema(&schema).unwrap(), ..request().sampling }, ..request() };
    assert_eq!(serde_json::to_value(completion_body("m", &json, &[2])).unwrap()["structured_outputs"]["json"], schema);
}

// Events as vLLM 0.32 streams them (trimmed).
const FIRST: &str = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"\n","logprobs":{"text_offset":[0],"token_logprobs":[-0.0013],"tokens":["token_id:198"],"top_logprobs":[{"token_id:198":-0.0013,"token_id:1":-7.54}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,9690,198],"token_ids":[198]}]}"#;
const LAST: &str = r#"{"id":"c","choices":[{"index":0,"text":"","logprobs":{"tokens":["token_id:57","token_id:2"],"token_logprobs":[-1.5,-0.1],"top_logprobs":[{"token_id:57":-1.5},{"token_id:2":-0.1}]},"finish_reason":"stop","stop_reason":null,"token_ids":[57,2]}]}"#;
const USAGE: &str = r#"{"id":"c","choices":[],"usage":{"prompt_tokens":3,"total_tokens":6,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":2}}}"#;

#[test]
fn a_stream_becomes_chunks_without_the_stop_token() {
    let body = completion_body("m", &request(), &[2]);
    let mut completion = Completion::new(3, &body);
    let first = completion.event(FIRST).unwrap().unwrap();
    assert_eq!(first.tokens, vec![198]);
    assert_eq!(first.logprobs[0].top, vec![(198, -0.0013), (1, -7.54)], "most likely first");
    let last = completion.event(LAST).unwrap().unwrap();
    assert_eq!(last.tokens, vec![57], "the stop token vLLM includes is not passed on");
    assert_eq!(last.logprobs.len(), 1);
    assert!(last.finished.is_none(), "the usage comes after");
    assert_eq!(completion.event(USAGE).unwrap(), None);
    let done = completion.event("[DONE]").unwrap().unwrap();
    assert_eq!(done.finished, Some((FinishReason::Stop, Usage { prompt_tokens: 3, completion_tokens: 2, cached_prompt_tokens: 2 })));
    assert!(completion.is_done());
}

#[test]
fn an_aborted_or_failed_stream_is_an_error_and_an_unfinished_one_has_no_end() {
    let body = completion_body("m", &request(), &[2]);
    let mut completion = Completion::new(3, &body);
    let aborted = r#"{"choices":[{"token_ids":[],"finish_reason":"abort"}]}"#;
    assert!(matches!(completion.event(aborted), Err(WorkerError::Unavailable(_))));
    let failed = r#"{"error":{"message":"boom","code":500}}"#;
    assert!(matches!(Completion::new(3, &body).event(failed), Err(WorkerError::Internal(message)) if message.contains("boom")));
    // Refused after the stream began (a schema's grammar): the client's
    // error, not a failing worker.
    let refused = r#"{"error": {"message": "Grammar error: Invalid type: no-such-type", "type": "BadRequestError", "param": null, "code": 400}}"#;
    assert!(matches!(Completion::new(3, &body).event(refused), Err(WorkerError::InvalidArgument(message)) if message.contains("Invalid type")));
    let named = r#"{"error":{"message":"boom","code":"server_error"}}"#;
    assert!(matches!(Completion::new(3, &body).event(named), Err(WorkerError::Internal(_))));
    let mut unfinished = Completion::new(3, &body);
    unfinished.event(FIRST).unwrap();
    assert_eq!(unfinished.event("[DONE]").unwrap(), None, "no finish reason: no finishing chunk");
    assert!(!unfinished.is_done());
    let no_ids = r#"{"choices":[{"text":"hi","finish_reason":null}]}"#;
    assert!(Completion::new(3, &body).event(no_ids).is_err());
}

#[test]
fn refusals_keep_their_meaning() {
    let body = r#"{"error":{"message":"This model's maximum context length is 2048 tokens","type":"BadRequestError","code":400}}"#;
    assert!(matches!(refusal(400, body), WorkerError::InvalidArgument(message) if message.contains("maximum context length")));
    assert!(matches!(refusal(429, "{}"), WorkerError::Overloaded(_)));
    assert!(matches!(refusal(503, "down"), WorkerError::Unavailable(message) if message.contains("down")));
    assert!(matches!(refusal(500, r#"{"detail":"x"}"#), WorkerError::Internal(_)));
}

#[test]
fn events_are_split_across_reads() {
    let mut stream = EventStream::default();
    assert!(stream.push(b"data: {\"a\":").unwrap().is_empty());
    assert_eq!(stream.push(b"1}\n\ndata: [DONE]\r\n\r\n: comment\n\n").unwrap(), vec!["{\"a\":1}".to_owned(), "[DONE]".to_owned()]);
    assert!(stream.push(&vec![b'x'; MAX_EVENT_BYTES + 1]).is_err(), "an endless event is refused");
}

#[test]
fn events_end_at_any_line_ending_even_one_cut_between_reads() {
    let mut stream = EventStream::default();
    assert_eq!(stream.push(b"data: a\rdata:b\r\r").unwrap(), vec!["a\nb".to_owned()], "CR alone ends lines");
    assert!(stream.push(b"data: c\r").unwrap().is_empty());
    assert!(stream.push(b"\ndata: d\n").unwrap().is_empty(), "a CRLF cut between reads is one line ending, not a blank line");
    assert_eq!(stream.push(b"\r\ndata\nevent: x\nid: 1\n\n").unwrap(), vec!["c\nd".to_owned(), String::new()]);
    assert!(stream.push(b"\n\n: keep-alive\n\n").unwrap().is_empty(), "blank lines and comments make no events");
}

#[test]
fn many_events_in_one_read_and_one_event_in_many_reads() {
    let mut stream = EventStream::default();
    let many: Vec<u8> = (0..10_000).flat_map(|i| format!("data: {i}\n\n").into_bytes()).collect();
    let events = stream.push(&many).unwrap();
    assert_eq!(events.len(), 10_000);
    assert_eq!(events[9_999], "9999");
    assert!(stream.push(b"data: ").unwrap().is_empty());
    for _ in 0..100_000 {
        assert!(stream.push(b"yz").unwrap().is_empty());
    }
    assert_eq!(stream.push(b"\n\n").unwrap(), vec!["yz".repeat(100_000)]);
    let mut lines = EventStream::default();
    let err = (0..).find_map(|_| lines.push(&[b"data: ".as_slice(), &[b'q'; 4096], b"\n"].concat()).err()).unwrap();
    assert!(err.to_string().contains("over"), "an event of endless data lines is refused too: {err}");
}

#[test]
fn stats_come_from_vllms_metrics() {
    let text = "vllm:num_requests_running{engine=\"0\"} 2.0\nvllm:num_requests_waiting{engine=\"0\"} 1.0\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"728\"} 1.0\n";
    let stats = engine_stats(text).unwrap();
    assert_eq!(stats.load, Load { running: 2, waiting: 1, blocks_used: 364, blocks_total: 728 });
    assert_eq!(stats.block_size, Some(32));
    assert!(engine_stats("other_metric 1\n").is_err());
}
