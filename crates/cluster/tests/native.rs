//! The embedded cluster in this process on the native engine (the real
//! model), and the contracts between its services.

use serde_json::json;
use turbine_cluster::sandbox::{Sandbox, streamed_text};
use turbine_engine::{MAX_LOGPROBS, SamplingParams};
use turbine_gateway::openai::types::parse_chat;
use turbine_gateway::{GatewayError, TextRequest};

const MODEL: &str = "smollm2-135m";

fn chat(json: &str) -> Result<TextRequest, GatewayError> {
    parse_chat(json.as_bytes()).map(|(request, _)| request)
}

#[tokio::test]
async fn the_native_engine_answers_through_the_gateway() {
    // The default engine: the real model.
    let mut config = Sandbox::native();
    config.worker.engine.kv_cache_mib = 64;
    let sandbox = Sandbox::start(config).await;
    let question = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "temperature": 0,
        "max_tokens": 32,
    });
    let (status, first) = sandbox.post("/v1/chat/completions", &question).await;
    assert_eq!(status, 200, "{first}");
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "greedy answer {answer:?}");
    assert_eq!(first["choices"][0]["finish_reason"], "stop", "the model ends its answer on its own");

    // Again: the prompt's full blocks come from the prefix cache, and the
    // greedy answer is the same.
    let (_, second) = sandbox.post("/v1/chat/completions", &question).await;
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
    let (_, a) = sandbox.post("/v1/chat/completions", &seeded).await;
    let (_, b) = sandbox.post("/v1/chat/completions", &seeded).await;
    assert_eq!(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
    assert_eq!(a["usage"]["completion_tokens"], 20);

    // Chat log-probabilities: one entry per token, spelling out the text,
    // the greedy token first among its alternatives.
    let (status, body) = sandbox
        .post(
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
    let events = sandbox.sse(
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
    sandbox.stop().await;
}

/// `response_format: json_schema` on the native engine: the real model's
/// output, greedy and sampled, is a value of the schema (its keys only,
/// each of its type, within its bounds and pattern, an enum's strings only,
/// definitions named by $ref and anyOf a value or null as libraries write
/// them); a schema beyond the core subset is a 400 naming its keyword,
/// streamed or not.
#[tokio::test]
async fn schema_output_from_the_real_model_is_the_schemas_value() {
    let mut config = Sandbox::native();
    config.worker.engine.kv_cache_mib = 64;
    let sandbox = Sandbox::start(config).await;
    let ask = |question: &str, schema: serde_json::Value, extra: serde_json::Value| {
        let mut body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": true}},
        });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let colours = json!({"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
                         "required": ["colours"], "additionalProperties": false});
    // Bounds the model would not keep by itself (Ada Lovelace was born in
    // 1815): only the mask holds "born" to them.
    let person = json!({"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                                                         "born": {"type": "integer", "minimum": 1900, "maximum": 1999}, "alive": {"type": "boolean"}},
                        "required": ["name", "born", "alive"], "additionalProperties": false});
    let library = json!({
        "$defs": {"Colour": {"enum": ["red", "green", "blue"], "title": "Colour", "type": "string"}},
        "properties": {"first": {"$ref": "#/$defs/Colour"}, "second": {"anyOf": [{"$ref": "#/$defs/Colour"}, {"type": "null"}], "default": null}},
        "required": ["first", "second"], "title": "Favourites", "type": "object", "additionalProperties": false
    });
    let code = json!({"type": "object", "properties": {"flight": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["flight"], "additionalProperties": false});
    for extra in [json!({"temperature": 0}), json!({"temperature": 0.8, "seed": 3}), json!({"temperature": 1.0, "top_p": 0.9, "seed": 11})] {
        let (status, body) = sandbox.post("/v1/chat/completions", &ask("Name three colours.", colours.clone(), extra.clone())).await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{extra}: {content:?}");
        let value: serde_json::Value = serde_json::from_str(content).unwrap_or_else(|error| panic!("{extra}: {content:?} is no JSON: {error}"));
        let listed = value["colours"].as_array().unwrap_or_else(|| panic!("{extra}: {content:?}"));
        assert!(value.as_object().unwrap().len() == 1 && (1..=3).contains(&listed.len()), "{extra}: {content:?}");
        assert!(listed.iter().all(|colour| ["red", "green", "blue"].contains(&colour.as_str().unwrap_or(""))), "{extra}: {content:?}");

        // As a typed model's library writes a schema: a definition named
        // twice by $ref, an optional field as anyOf it or null.
        let (status, body) = sandbox.post("/v1/chat/completions", &ask("Name your two favourite colours.", library.clone(), extra.clone())).await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{extra}: {content:?}");
        let value: serde_json::Value = serde_json::from_str(content).unwrap_or_else(|error| panic!("{extra}: {content:?} is no JSON: {error}"));
        let colour = |value: &serde_json::Value| ["red", "green", "blue"].contains(&value.as_str().unwrap_or(""));
        assert!(value.as_object().unwrap().len() == 2 && colour(&value["first"]), "{extra}: {content:?}");
        assert!(value["second"].is_null() || colour(&value["second"]), "{extra}: {content:?}");

        // A pattern: three capitals, a dash, two digits.
        let (status, body) = sandbox.post("/v1/chat/completions", &ask("Give a flight number.", code.clone(), extra.clone())).await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        let value: serde_json::Value = serde_json::from_str(content).unwrap_or_else(|error| panic!("{extra}: {content:?} is no JSON: {error}"));
        let flight = value["flight"].as_str().unwrap_or_else(|| panic!("{extra}: {content:?}")).as_bytes();
        let shaped = flight.len() == 6 && flight[..3].iter().all(u8::is_ascii_uppercase) && flight[3] == b'-' && flight[4..].iter().all(u8::is_ascii_digit);
        assert!(shaped, "{extra}: {content:?}");

        let (status, body) = sandbox.post("/v1/chat/completions", &ask("Describe Ada Lovelace.", person.clone(), extra.clone())).await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        if body["choices"][0]["finish_reason"] == "stop" {
            let value: serde_json::Value = serde_json::from_str(content).unwrap_or_else(|error| panic!("{extra}: {content:?} is no JSON: {error}"));
            let object = value.as_object().unwrap();
            assert!(object.len() == 3 && value["name"].is_string() && value["born"].is_i64() && value["alive"].is_boolean(), "{extra}: {content:?}");
            assert!((1..=40).contains(&value["name"].as_str().unwrap().chars().count()), "{extra}: {content:?}");
            assert!((1900..=1999).contains(&value["born"].as_i64().unwrap()), "{extra}: {content:?}");
        } else {
            // Cut at max_tokens (a long name): a prefix of one, never prose.
            assert!(content.starts_with("{\""), "{extra}: {content:?}");
        }
    }

    // Beyond the subset: refused by name, as the response's status.
    let beyond = json!({"type": "object", "properties": {"code": {"allOf": [{"type": "string"}]}}});
    let (status, body) = sandbox.post("/v1/chat/completions", &ask("Hi", beyond.clone(), json!({}))).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("\"allOf\""), "{body}");
    let response =
        reqwest::Client::new().post(format!("{}/v1/chat/completions", sandbox.base())).json(&ask("Hi", beyond, json!({"stream": true}))).send().await.unwrap();
    assert_eq!(response.status(), 400, "streamed, the refusal is the status");
    // Still serving.
    let (status, _) = sandbox.post("/v1/chat/completions", &ask("Name three colours.", colours, json!({"temperature": 0}))).await;
    assert_eq!(status, 200);
    sandbox.stop().await;
}

/// `response_format: json_object`: the real model's output, greedy and
/// sampled, streamed or not, is one JSON object that ends where it closes.
/// Asked a question it answers in prose, the format still holds it to a
/// prefix of an object.
#[tokio::test]
async fn json_output_from_the_real_model_is_one_object() {
    let mut config = Sandbox::native();
    config.worker.engine.kv_cache_mib = 64;
    let sandbox = Sandbox::start(config).await;
    let ask = |question: &str, extra: serde_json::Value| {
        let mut body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 120,
            "response_format": {"type": "json_object"},
        });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let json_question = "Reply with a JSON object with the keys name, born and known_for, describing Ada Lovelace.";
    for extra in [json!({"temperature": 0}), json!({"temperature": 0.8, "seed": 3}), json!({"temperature": 1.0, "top_p": 0.9, "seed": 11})] {
        let (status, body) = sandbox.post("/v1/chat/completions", &ask(json_question, extra.clone())).await;
        assert_eq!(status, 200, "{body}");
        let content = body["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "stop", "{extra}: the object closes within 120 tokens: {content:?}");
        let value: serde_json::Value = serde_json::from_str(content).unwrap_or_else(|error| panic!("{extra}: {content:?} is no JSON: {error}"));
        assert!(value.as_object().is_some_and(|object| !object.is_empty()), "{extra}: {content:?}");
    }
    let greedy = ask(json_question, json!({"temperature": 0}));
    let (_, whole) = sandbox.post("/v1/chat/completions", &greedy).await;
    let mut streamed = greedy.clone();
    streamed["stream"] = json!(true);
    let events = sandbox.sse("/v1/chat/completions", &streamed).await;
    assert_eq!(streamed_text(&events), whole["choices"][0]["message"]["content"].as_str().unwrap(), "streamed as whole");

    // A question the model answers in prose: held to an object by the
    // format (cut at max_tokens or closed, never prose).
    let prose_question = "Describe Ada Lovelace: her name, her year of birth and what she is known for.";
    let mut unformatted = ask(prose_question, json!({"temperature": 0}));
    unformatted.as_object_mut().unwrap().remove("response_format");
    let (_, prose) = sandbox.post("/v1/chat/completions", &unformatted).await;
    let prose = prose["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    assert!(!prose.trim_start().starts_with('{'), "the model answers in prose unasked: {prose:?}");
    let (_, held) = sandbox.post("/v1/chat/completions", &ask(prose_question, json!({"temperature": 0}))).await;
    let content = held["choices"][0]["message"]["content"].as_str().unwrap();
    match serde_json::from_str::<serde_json::Value>(content) {
        Ok(value) => assert!(value.is_object() && held["choices"][0]["finish_reason"] == "stop", "{held}"),
        Err(error) => assert!(error.is_eof() && held["choices"][0]["finish_reason"] == "length", "a prefix of an object, cut: {content:?}: {error}"),
    }
    assert!(content.trim_start().starts_with('{'), "{content:?}");

    // The gRPC API asks the same of its raw prompts: the prose question,
    // as text, held to an object.
    use turbine_proto::gateway::v1 as pb;
    let mut inference = pb::inference_client::InferenceClient::connect(sandbox.cluster().grpc_endpoint()).await.unwrap();
    let request = |output_format: pb::OutputFormat| pb::GenerateRequest {
        model: MODEL.into(),
        input: Some(pb::generate_request::Input::Prompt(format!("{prose_question}\n"))),
        max_tokens: Some(120),
        output_format: output_format as i32,
        ..Default::default()
    };
    let mut texts = Vec::new();
    for output_format in [pb::OutputFormat::Unspecified, pb::OutputFormat::JsonObject] {
        let mut stream = inference.generate(request(output_format)).await.unwrap().into_inner();
        let (mut text, mut finish) = (String::new(), pb::FinishReason::Unspecified);
        while let Some(message) = stream.message().await.unwrap() {
            text.push_str(&message.text);
            finish = message.finish_reason();
        }
        texts.push((text, finish));
    }
    assert!(!texts[0].0.trim_start().starts_with('{'), "unasked, the raw prompt's answer is no object: {texts:?}");
    match serde_json::from_str::<serde_json::Value>(&texts[1].0) {
        Ok(value) => assert!(value.is_object() && texts[1].1 == pb::FinishReason::Stop, "{texts:?}"),
        Err(error) => assert!(error.is_eof() && texts[1].1 == pb::FinishReason::Length, "a prefix of an object, cut: {texts:?}: {error}"),
    }
    assert!(texts[1].0.trim_start().starts_with('{'), "{texts:?}");
    sandbox.stop().await;
}

/// The gateway and the workers apply one definition of the sampling
/// ranges: every value one refuses, the other refuses too, naming the
/// same parameter.
#[test]
fn the_gateway_and_the_worker_refuse_the_same_sampling_values() {
    use turbine_proto::worker::v1 as pb;
    let out_of_range: [(&str, f32); 10] = [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.5),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 10.5),
        ("min_p", -0.5),
    ];
    for (param, value) in out_of_range {
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"{param}":{value}}}"#);
        let gateway = chat(&body).unwrap_err();
        assert_eq!(gateway.param.as_deref(), Some(param), "the gateway names {param}={value}: {gateway:?}");
        let mut wire = pb::SamplingParams::default();
        let field = match param {
            "temperature" => &mut wire.temperature,
            "top_p" => &mut wire.top_p,
            "presence_penalty" => &mut wire.presence_penalty,
            "frequency_penalty" => &mut wire.frequency_penalty,
            "min_p" => &mut wire.min_p,
            _ => &mut wire.repetition_penalty,
        };
        *field = Some(value);
        let worker = SamplingParams::try_from(wire).unwrap_err();
        assert!(worker.to_string().starts_with(param), "the worker refuses {param}={value} naming it: {worker}");
    }
    // And the edges both accept.
    for (param, value) in [("temperature", 2.0), ("top_p", 1.0), ("repetition_penalty", 10.0), ("min_p", 0.0)] {
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"{param}":{value}}}"#);
        assert!(chat(&body).is_ok(), "the gateway accepts {param}={value}");
    }
    let logprobs = pb::SamplingParams { logprobs: Some(MAX_LOGPROBS + 1), ..Default::default() };
    assert!(SamplingParams::try_from(logprobs).is_err());
    assert!(chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"logprobs":true,"top_logprobs":{}}}"#, MAX_LOGPROBS + 1)).is_err());
}

/// `turbine run --kv-store-port`: a prompt computed on one worker is
/// reused by the other through the embedded kv-store (round-robin sends
/// the second request elsewhere), with the same greedy text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_computed_on_one_worker_is_reused_by_the_other_through_the_embedded_kv_store() {
    let mut config = Sandbox::native();
    config.workers = 2;
    config.kv_store_port = Some(0);
    config.router.policy = turbine_router::Policy::RoundRobin;
    config.worker.engine.kv_cache_mib = 32;
    let sandbox = Sandbox::start(config).await;
    let store = turbine_api::kv_store::KvStoreClient::connect(&format!("http://{}", sandbox.cluster().kv_store().expect("asked for"))).unwrap();
    let request = json!({
        "model": MODEL,
        "prompt": "Lighthouses guide ships past the rocks along the coast at night. ".repeat(20),
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": true,
    });
    let (status, first) = sandbox.post("/v1/completions", &request).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0), 0);
    let full_blocks = (first["usage"]["prompt_tokens"].as_u64().unwrap() - 1) / 16;
    turbine_testkit::wait_until("blocks put to the kv-store", std::time::Duration::from_secs(30), async || {
        store.stats().await.unwrap().put_blocks >= full_blocks
    })
    .await;

    let (status, second) = sandbox.post("/v1/completions", &request).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["choices"][0]["text"], first["choices"][0]["text"], "blocks from the store give the computed text");
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), full_blocks * 16, "the other worker fetched the prefix");
    assert!(sandbox.metric("turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "remote")]).await >= full_blocks as f64);
    sandbox.stop().await;
}
