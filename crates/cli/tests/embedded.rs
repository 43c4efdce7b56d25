//! `turbine run` as a real process on free ports: the OpenAI REST API with a
//! real HTTP client, errors, stop strings, cancellation, the gRPC API, and
//! a graceful drain on SIGTERM.

mod common;

use std::time::Duration;

use common::{metric, post, read_events, sse, start_turbine, streamed_text};
use serde_json::json;
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ChatMessage, ModelCard, Preprocessor};

const MODEL: &str = "smollm2-135m";

fn preprocessor() -> Preprocessor {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 64).unwrap()).unwrap()
}

#[tokio::test]
async fn rest_api_serves_openai_shapes_with_exact_usage() {
    let turbine = start_turbine(&["--engine", "mock", "--speedup", "1000"]).await;
    let base = &turbine.base;
    let tokens = preprocessor();

    let (status, models) = post(base, "/v1/models", &json!({})).await;
    assert_eq!(status, 405, "POST on a GET route: {models}");
    let models: serde_json::Value = reqwest::get(format!("{base}/v1/models")).await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);

    // Chat, not streamed: prompt tokens are the rendered template's.
    let messages = [ChatMessage::new("user", "What is the capital of France?")];
    let expected_prompt = tokens.encode_chat(&messages).unwrap().len() as u64;
    let (status, body) = post(
        base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens"], expected_prompt);
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert_eq!(body["usage"]["total_tokens"], expected_prompt + 12);
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(tokens.encode_text(content).unwrap().len(), 12, "12 tokens of clean text: {content:?}");

    // Without max_tokens the mocker answers once through its text and stops.
    let (status, body) = post(base, "/v1/chat/completions", &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})).await;
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    // Chat, streamed with usage: role chunk, content chunks, finish chunk, usage chunk, [DONE].
    let events = sse(
        base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Stream please"}], "max_completion_tokens": 9,
                "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c.get("usage").is_some()));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 9);
    let text = streamed_text(&events);
    assert_eq!(tokens.encode_text(&text).unwrap().len(), 9);

    // Completions: token-id prompt, default max_tokens of 16, stream without usage.
    let (status, body) = post(base, "/v1/completions", &json!({"model": MODEL, "prompt": [1, 2, 3, 4], "ignore_eos": true})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["prompt_tokens"], 4);
    assert_eq!(body["usage"]["completion_tokens"], 16);
    let events = sse(base, "/v1/completions", &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": true, "ignore_eos": true})).await;
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "usage only with include_usage");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");

    // The same prompt again is a prefix-cache hit.
    let long_prompt = "The history of distributed systems is long. ".repeat(40);
    let request = json!({"model": MODEL, "prompt": long_prompt, "max_tokens": 2});
    post(base, "/v1/completions", &request).await;
    let (_, body) = post(base, "/v1/completions", &request).await;
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{body}");

    let openapi: serde_json::Value = reqwest::get(format!("{base}/openapi.json")).await.unwrap().json().await.unwrap();
    assert_eq!(openapi["openapi"], "3.1.0");
    assert_eq!(reqwest::get(format!("{base}/health")).await.unwrap().status(), 200);
    assert_eq!(metric(base, "turbine_gateway_requests_total").await, 7.0);
}

#[tokio::test]
async fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let turbine = start_turbine(&["--engine", "mock", "--speedup", "1000"]).await;
    let base = &turbine.base;
    let client = reqwest::Client::new();
    let chat = format!("{base}/v1/chat/completions");
    let message = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("malformed json", r#"{"model": "smollm2-135m", "messages": ["#.to_owned(), 400, None),
        ("empty body", String::new(), 400, None),
        ("not an object", "[1, 2]".to_owned(), 400, None),
        ("missing model", json!({"messages": message}).to_string(), 400, Some("model")),
        ("missing messages", json!({"model": MODEL}).to_string(), 400, Some("messages")),
        ("wrong type", json!({"model": MODEL, "messages": message, "max_tokens": "ten"}).to_string(), 400, Some("max_tokens")),
        ("messages not a list", json!({"model": MODEL, "messages": "hi"}).to_string(), 400, Some("messages")),
        ("negative max_tokens", json!({"model": MODEL, "messages": message, "max_tokens": -1}).to_string(), 400, Some("max_tokens")),
        ("huge max_tokens", json!({"model": MODEL, "messages": message, "max_tokens": 1_000_000_000_000u64}).to_string(), 400, Some("max_tokens")),
        ("beyond context", json!({"model": MODEL, "messages": message, "max_tokens": 9000}).to_string(), 400, Some("max_tokens")),
        ("temperature out of range", json!({"model": MODEL, "messages": message, "temperature": 5}).to_string(), 400, Some("temperature")),
        ("unknown model", json!({"model": "gpt-9", "messages": message}).to_string(), 404, Some("model")),
        ("oversized body", json!({"model": MODEL, "messages": [{"role": "user", "content": "x".repeat(5 << 20)}]}).to_string(), 413, None),
    ];
    for (name, body, status, param) in cases {
        let response = client.post(&chat).header("content-type", "application/json").body(body).send().await.unwrap();
        assert_eq!(response.status().as_u16(), status, "{name}");
        let error: serde_json::Value = response.json().await.unwrap();
        let error = &error["error"];
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{name}: {error}");
        assert!(error["type"].is_string(), "{name}: {error}");
        assert!(error.get("param").is_some() && error.get("code").is_some(), "{name}: {error}");
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{name}: {error}");
        }
    }
    let (status, body) = post(base, "/v1/completions", &json!({"model": MODEL, "prompt": [999_999]})).await;
    assert_eq!((status, &body["error"]["param"]), (400, &json!("prompt")), "{body}");
    let response = client.get(format!("{base}/v1/nothing-here")).send().await.unwrap();
    assert_eq!(response.status(), 404);
    assert!(response.json::<serde_json::Value>().await.unwrap()["error"]["message"].is_string());

    // Still serving.
    let (status, body) = post(base, "/v1/chat/completions", &json!({"model": MODEL, "messages": message, "max_tokens": 3})).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn stop_strings_match_across_token_boundaries() {
    // Real-time mocker: one token per chunk, so chunk boundaries are token boundaries.
    let turbine = start_turbine(&["--engine", "mock", "--speedup", "1"]).await;
    let base = &turbine.base;
    let request = |stop: Option<&str>| {
        let mut body = json!({"model": MODEL, "prompt": "Tell me about turbines", "max_tokens": 40, "seed": 7, "stream": true, "ignore_eos": true});
        if let Some(stop) = stop {
            body["stop"] = json!([stop]);
        }
        body
    };
    let events = sse(base, "/v1/completions", &request(None)).await;
    let pieces: Vec<String> = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).unwrap()["choices"][0]["text"].as_str().map(str::to_owned))
        .filter(|t| t.len() >= 3)
        .collect();
    let full = streamed_text(&events);
    // A stop string made of the end of one token and the start of the next.
    let (a, b) = (&pieces[4], &pieces[5]);
    let stop = format!("{}{}", &a[a.len() - 2..], &b[..2]);
    let cut = full.find(&stop).unwrap();
    let events = sse(base, "/v1/completions", &request(Some(&stop))).await;
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(streamed_text(&events), full[..cut], "stop {stop:?}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn a_client_disconnect_cancels_the_worker_sequence() {
    // Real-time mocker: the request would run for tens of seconds.
    let turbine = start_turbine(&["--engine", "mock", "--speedup", "1"]).await;
    let base = &turbine.base;
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "Go on forever", "max_tokens": 5000, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let mut stream = futures::StreamExt::boxed(response.bytes_stream());
    for _ in 0..3 {
        futures::StreamExt::next(&mut stream).await.unwrap().unwrap();
    }
    assert_eq!(metric(base, "turbine_worker_running_sequences").await, 1.0);
    drop(stream);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while metric(base, "turbine_worker_running_sequences").await > 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "the worker kept generating after the client left");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(metric(base, "turbine_worker_kv_blocks_used").await, 0.0);
    assert_eq!(metric(base, "turbine_router_in_flight_requests").await, 0.0, "the booking was released");
}

#[tokio::test]
async fn sigterm_during_32_streams_completes_them_all_then_exits_zero() {
    let mut turbine = start_turbine(&["--engine", "mock", "--speedup", "1"]).await;
    let url = format!("{}/v1/chat/completions", turbine.base);
    let client = reqwest::Client::new();
    let mut responses = Vec::new();
    for i in 0..32 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("request {i}")}], "max_tokens": 150,
                          "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
        responses.push(client.post(&url).json(&body).send().await.unwrap());
    }
    // Every stream is open (headers received); generation is under way.
    turbine.process.terminate();
    let results = futures::future::join_all(responses.into_iter().map(read_events)).await;
    for events in &results {
        let usage: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 150, "a stream was cut short");
    }
    assert_eq!(results.len(), 32);
    let status = turbine.process.wait(Duration::from_secs(30)).expect("turbine did not exit after draining");
    assert!(status.success(), "exit status {status}");
    // New connections are refused once it has exited.
    assert!(reqwest::get(format!("{}/health", turbine.base)).await.is_err());
}

#[tokio::test]
async fn grpc_inference_health_and_reflection() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use turbine_proto::gateway::v1 as pb;

    let turbine = start_turbine(&["--engine", "mock", "--speedup", "1000"]).await;
    let channel = tonic::transport::Channel::from_shared(turbine.grpc.clone()).unwrap().connect().await.unwrap();

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let status = health.check(HealthCheckRequest { service: "turbine.gateway.v1.Inference".into() }).await.unwrap();
    assert_eq!(status.into_inner().status(), ServingStatus::Serving);

    let mut inference = pb::inference_client::InferenceClient::new(channel.clone());
    let models = inference.list_models(pb::ListModelsRequest {}).await.unwrap().into_inner().models;
    assert_eq!(models[0].name, MODEL);
    let request = pb::GenerateRequest {
        model: MODEL.into(),
        input: Some(pb::generate_request::Input::Chat(pb::Chat { messages: vec![pb::ChatMessage { role: "user".into(), content: "Hello".into() }] })),
        max_tokens: Some(10),
        ignore_eos: true,
        ..Default::default()
    };
    let mut stream = inference.generate(request).await.unwrap().into_inner();
    let mut text = String::new();
    let mut last = None;
    while let Some(message) = stream.message().await.unwrap() {
        text.push_str(&message.text);
        last = Some(message);
    }
    let last = last.unwrap();
    assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    assert_eq!(last.usage.unwrap().completion_tokens, 10);
    assert!(!text.is_empty());

    let unknown = pb::GenerateRequest { model: "nope".into(), input: Some(pb::generate_request::Input::Prompt("x".into())), ..Default::default() };
    assert_eq!(inference.generate(unknown).await.unwrap_err().code(), tonic::Code::NotFound);
    let invalid = pb::GenerateRequest { model: MODEL.into(), input: None, ..Default::default() };
    assert_eq!(inference.generate(invalid).await.unwrap_err().code(), tonic::Code::InvalidArgument);

    let mut reflection = tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection.server_reflection_info(futures::stream::iter([request])).await.unwrap().into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(tonic_reflection::pb::v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"turbine.gateway.v1.Inference".to_owned()), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health".to_owned()), "{names:?}");
}

#[tokio::test]
async fn requests_beyond_the_concurrency_limit_get_429_with_retry_after() {
    let turbine = start_turbine(&["--engine", "mock", "--speedup", "1", "--max-concurrent-requests", "1"]).await;
    let base = &turbine.base;
    let long = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "hold the slot", "max_tokens": 2000, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "one more", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    drop(long);
    // The slot frees when the first client leaves.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (status, _) = post(base, "/v1/completions", &json!({"model": MODEL, "prompt": "now", "max_tokens": 2})).await;
        if status == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the slot was never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_native_engine_answers_through_the_gateway() {
    // The default engine: the real model.
    let turbine = start_turbine(&["--kv-cache-mib", "64"]).await;
    let base = &turbine.base;
    let question = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "temperature": 0,
        "max_tokens": 32,
    });
    let (status, first) = post(base, "/v1/chat/completions", &question).await;
    assert_eq!(status, 200, "{first}");
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "greedy answer {answer:?}");
    assert_eq!(first["choices"][0]["finish_reason"], "stop", "the model ends its answer on its own");

    // Again: the prompt's full blocks come from the prefix cache, and the
    // greedy answer is the same.
    let (_, second) = post(base, "/v1/chat/completions", &question).await;
    assert_eq!(second["choices"][0]["message"]["content"], answer);
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), (prompt_tokens - 1) / 16 * 16);

    // Seeded sampling with every sampler knob repeats itself.
    let seeded = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a sentence about rivers."}],
        "temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.02, "repetition_penalty": 1.1,
        "presence_penalty": 0.2, "frequency_penalty": 0.2, "seed": 7, "max_tokens": 20, "ignore_eos": true,
    });
    let (_, a) = post(base, "/v1/chat/completions", &seeded).await;
    let (_, b) = post(base, "/v1/chat/completions", &seeded).await;
    assert_eq!(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
    assert_eq!(a["usage"]["completion_tokens"], 20);

    // Chat log-probabilities: one entry per token, spelling out the text,
    // the greedy token first among its alternatives.
    let (status, body) = post(
        base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "temperature": 0,
                "max_tokens": 6, "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let entries = body["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), 6);
    let spelled: String = entries.iter().map(|entry| entry["token"].as_str().unwrap()).collect();
    assert_eq!(spelled, body["choices"][0]["message"]["content"].as_str().unwrap());
    for entry in entries {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], entry["token"], "greedy picks the most likely token");
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0 && (logprob - top[0]["logprob"].as_f64().unwrap()).abs() < 1e-6);
        assert!(top.windows(2).all(|pair| pair[0]["logprob"].as_f64() >= pair[1]["logprob"].as_f64()));
    }

    // Streamed completion log-probabilities: chunks carry their tokens' entries.
    let events = sse(
        base,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "ignore_eos": true, "temperature": 0, "logprobs": 2, "stream": true}),
    )
    .await;
    let chunks: Vec<serde_json::Value> = events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let tokens: Vec<String> = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["logprobs"]["tokens"].as_array().cloned())
        .flatten()
        .map(|token| token.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(tokens.len(), 5);
    assert_eq!(tokens.concat(), streamed_text(&events));
    let offsets: Vec<u64> =
        chunks.iter().filter_map(|chunk| chunk["choices"][0]["logprobs"]["text_offset"].as_array().cloned()).flatten().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[4] as usize, tokens[..4].concat().chars().count());
}

/// With the kv policy, a prompt sent again goes to the worker whose cache
/// holds it (the engines report the cached tokens); round-robin, over the
/// same four workers, misses most repeats.
#[tokio::test]
async fn kv_routing_sends_repeated_prefixes_to_the_worker_that_cached_them() {
    async fn cached_share(policy: &str) -> f64 {
        let turbine = start_turbine(&["--engine", "mock", "--speedup", "1000", "--workers", "4", "--policy", policy]).await;
        let mut cached = 0;
        let mut total = 0;
        for round in 0..4u32 {
            // Three distinct 320-token prompts (5 blocks of 64), each sent four
            // times: three prompts over four workers, so round-robin moves
            // each prompt to another worker every round.
            for prompt in 0..3u32 {
                let tokens: Vec<u32> = (0..320).map(|i| 1000 + prompt * 1000 + i).collect();
                let (status, body) = post(&turbine.base, "/v1/completions", &json!({"model": MODEL, "prompt": tokens, "max_tokens": 2, "ignore_eos": true})).await;
                assert_eq!(status, 200, "{body}");
                if round > 0 {
                    cached += body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
                    total += 320;
                }
            }
        }
        cached as f64 / total as f64
    }
    let kv = cached_share("kv").await;
    // The engine always computes the last prompt token: 4 of 5 blocks is all a repeat can reuse.
    assert!((kv - 0.8).abs() < 1e-9, "every repeat should reuse 4 of its 5 blocks: {kv}");
    let round_robin = cached_share("round-robin").await;
    assert!(kv > round_robin, "kv {kv} vs round-robin {round_robin}");
}
