//! A worker in front of a real external engine: vLLM's CPU build
//! (installed by the test command, serving the default model converted
//! from its GGUF) behind `turbine-worker --engine external`, with a real
//! Redis, router and gateway as processes. The OpenAI SDK streams through
//! gateway → router → adapter → engine; prompts reach the engine as
//! Turbine's token ids; a client that goes away aborts its request in the
//! engine; an engine killed mid-stream leaves the registry and its request
//! continues on another worker.

mod common;

use std::time::Duration;

use common::{MODEL, metric, post, service, until_listed, until_registered, wait_until};
use futures::StreamExt;
use serde_json::json;
use turbine_api::router::RouterClient;
use turbine_testkit::{LlamaCppInstall, LlamaCppServer, RedisServer, ServiceProcess, VllmInstall, VllmServer};

/// A sample of vLLM's own metrics, summed over its label sets that carry
/// every label of `labels`.
async fn engine_metric(vllm: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = reqwest::get(format!("{vllm}/metrics")).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter(|line| labels.iter().all(|(key, value)| line.contains(&format!("{key}=\"{value}\""))))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Reads SSE `data:` payloads from `stream` until `count` more arrived.
async fn read_more<B: AsRef<[u8]>>(stream: &mut (impl futures::Stream<Item = reqwest::Result<B>> + Unpin), buffer: &mut String, count: usize) -> Vec<String> {
    let mut events = Vec::new();
    while events.len() < count {
        let bytes = tokio::time::timeout(Duration::from_secs(60), stream.next()).await.expect("the stream stalled").expect("the stream ended").unwrap();
        buffer.push_str(std::str::from_utf8(bytes.as_ref()).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            events.extend(event.lines().filter_map(|line| line.strip_prefix("data: ")).map(str::to_owned));
        }
    }
    for event in &events {
        assert!(!event.contains("\"error\""), "the stream failed: {event}");
    }
    events
}

/// After an engine was killed under `stream` (a completion through the
/// gateway at `base`): reads on until the gateway has moved the request
/// and `continued` says another worker computes it (events already on
/// their way when the engine died come first), asserting the stream never
/// ended in between.
async fn read_past_the_migration<B: AsRef<[u8]>>(
    stream: &mut (impl futures::Stream<Item = reqwest::Result<B>> + Unpin),
    buffer: &mut String,
    base: &str,
    mut continued: impl AsyncFnMut() -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let events = read_more(stream, buffer, 1).await;
        assert!(events.iter().all(|event| event != "[DONE]"), "the stream ended after the engine died, before the request moved");
        if metric(base, "turbine_gateway_migrations_total").await == 1.0 && continued().await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the request did not move to another worker within 60 s");
    }
}

/// A completion of 1,500 tokens streaming through the gateway at `base`,
/// its first three events read: (the rest of its stream, the bytes read
/// past them).
async fn long_stream(base: &str) -> (impl futures::Stream<Item = reqwest::Result<impl AsRef<[u8]>>> + Unpin, String) {
    let long = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true, "stream": true});
    let response = reqwest::Client::new().post(format!("{base}/v1/completions")).json(&long).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let (mut stream, mut buffer) = (Box::pin(response.bytes_stream()), String::new());
    read_more(&mut stream, &mut buffer, 3).await;
    (stream, buffer)
}

/// The OpenAI SDK streams a chat through the gateway at `base`; a chat
/// asked for a JSON object gets one where the engine's grammar holds its
/// output to it (`json`: vLLM, llama.cpp), a clear refusal where it cannot
/// (the plain OpenAI API), never prose.
async fn sdk_streams_a_chat(base: &str, json: bool) {
    let sdk = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
stream = client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, stream=True)
text, reasons = "", []
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
assert text and reasons in (["stop"], ["length"]), (text, reasons)
# JSON output: an object asked for is one that closes; the question the
# model answers as a list is held to an object too (it may run to its
# length: the text so far opens one).
ask = lambda content: client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": content}], response_format={"type": "json_object"}, temperature=0, max_tokens=120)
if sys.argv[3] == "served":
    reply = ask("Reply with a JSON object with the keys name, born and known_for, describing Ada Lovelace.")
    assert reply.choices[0].finish_reason == "stop", reply
    assert isinstance(json.loads(reply.choices[0].message.content), dict), reply
    reply = ask("Name three colours.")
    assert reply.choices[0].message.content.lstrip().startswith("{"), reply
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict), reply
    # A schema: the reply is an object of exactly its one key, a list of
    # at most three strings from its enum (never the model's own keys).
    schema = {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
              "required": ["colours"], "additionalProperties": False}
    reply = client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "Name three colours."}], temperature=0, max_tokens=120,
                                           response_format={"type": "json_schema", "json_schema": {"name": "colours", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop", reply
    value = json.loads(reply.choices[0].message.content)
    assert list(value) == ["colours"] and 1 <= len(value["colours"]) <= 3 and set(value["colours"]) <= {"red", "green", "blue"}, reply
    # A schema the engine cannot compile is a clear error, not prose.
    try:
        client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
        raise AssertionError("an uncompilable schema was accepted")
    except openai.BadRequestError as error:
        print("refused:", error.body["message"])
    # Streamed too: the refusal is the response's status, not a 200 and
    # then an error event.
    try:
        for _ in client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True,
                                                response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}):
            pass
        raise AssertionError("an uncompilable schema was streamed")
    except openai.BadRequestError as error:
        print("refused streamed:", error.body["message"])
else:
    for format in [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]:
        try:
            client.chat.completions.create(model=sys.argv[2], messages=[{"role": "user", "content": "Name three colours."}], response_format=format, max_tokens=8)
            raise AssertionError("JSON output accepted unconstrained")
        except openai.BadRequestError as error:
            assert "holds its output to json_" in error.body["message"], error.body
print(reasons[0], repr(text))
"#;
    let run = tokio::process::Command::new("python3").args(["-c", sdk, base, MODEL, if json { "served" } else { "refused" }]).kill_on_drop(true).output();
    let output = tokio::time::timeout(Duration::from_secs(120), run).await.expect("the SDK's stream took over 2 minutes").unwrap();
    assert!(output.status.success(), "the OpenAI SDK's stream: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
}

// One vLLM for the tokenizer's parity and the serving path: each start
// costs half a minute of two cores.
#[tokio::test]
async fn vllm_tokenizes_as_the_gateway_and_streams_through_an_adapter_to_the_openai_sdk_aborting_and_failing_over() {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let install = VllmInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
    let model_dir = install.model.clone();
    let mut vllm = tokio::task::spawn_blocking(move || VllmServer::start(&install, MODEL, &[])).await.unwrap();
    let engine = vllm.url();
    the_gateways_token_ids_and_chat_prompts_are_the_engines(&engine, &model_dir).await;
    let redis = RedisServer::start();
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "ext"];
    let external = ["--engine", "external", "--upstream", &engine, "--worker-id", "vllm-0", "--lease-ttl-secs", "2"];
    let adapter = service("turbine-worker", &[&cluster[..], &external[..]].concat(), &[], false).await;
    let router = service("turbine-router", &cluster, &[], false).await;
    until_registered(&router, 1).await;
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;

    // The prompt reaches the engine as the gateway's token ids: vLLM
    // counts exactly the prompt tokens the gateway reports.
    let before = engine_metric(&engine, "vllm:prompt_tokens_total", &[]).await;
    let (status, body) = post(
        &base,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let prompt_tokens = body["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(engine_metric(&engine, "vllm:prompt_tokens_total", &[]).await - before, prompt_tokens, "{body}");
    assert!(!body["choices"][0]["message"]["content"].as_str().unwrap().is_empty(), "{body}");

    // The OpenAI SDK streams a chat through the adapter.
    sdk_streams_a_chat(&base, true).await;
    assert_eq!(metric(&adapter.admin_url(), "turbine_worker_upstream_healthy").await, 1.0);

    // A client that goes away mid-stream aborts its request in the engine.
    let (stream, _) = long_stream(&base).await;
    assert_eq!(engine_metric(&engine, "vllm:num_requests_running", &[]).await, 1.0, "the engine runs the stream");
    let finished = engine_metric(&engine, "vllm:request_success_total", &[]).await;
    let generated = engine_metric(&engine, "vllm:generation_tokens_total", &[]).await;
    drop(stream);
    wait_until("the engine aborts the abandoned request", Duration::from_secs(20), async || {
        engine_metric(&engine, "vllm:num_requests_running", &[]).await == 0.0
    })
    .await;
    // Stopped, not finished: no request ended as finished, and far fewer
    // than its 1,500 tokens were generated.
    assert_eq!(engine_metric(&engine, "vllm:request_success_total", &[]).await, finished, "the abandoned request did not run to its end");
    let generated = engine_metric(&engine, "vllm:generation_tokens_total", &[]).await - generated;
    assert!(generated < 1000.0, "the engine generated {generated} more tokens for an abandoned request");

    // An engine killed mid-stream: the request continues on another worker
    // (a native one, the same model), and the adapter leaves the registry.
    let (mut stream, mut buffer) = long_stream(&base).await;
    let native_args = [&cluster[..], &["--engine", "native", "--worker-id", "native-0", "--lease-ttl-secs", "2", "--kv-cache-mib", "128"][..]].concat();
    let native: ServiceProcess = service("turbine-worker", &native_args, &[], false).await;
    until_registered(&router, 2).await;
    vllm.kill();
    // The native worker continues the request.
    read_past_the_migration(&mut stream, &mut buffer, &base, async || metric(&native.admin_url(), "turbine_worker_generated_tokens_total").await >= 1.0).await;
    drop(stream);
    let listed = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    wait_until("the adapter of the dead engine leaves the registry", Duration::from_secs(20), async || {
        listed.workers(None).await.is_ok_and(|workers| workers.iter().map(|worker| worker.worker_id.to_string()).collect::<Vec<_>>() == ["native-0"])
    })
    .await;
    assert_eq!(metric(&adapter.admin_url(), "turbine_worker_upstream_healthy").await, 0.0);
}

/// Texts whose ids must be the engine's: digits, whitespace, special
/// tokens, emoji and other scripts, code.
const PARITY_TEXTS: &[&str] = &[
    "Hello",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "tabs\tand\ttabs",
    "new\nlines\n\nand blank ones\n",
    "\r\nwindows line\r\n",
    "    indented code",
    "0",
    "12345",
    "3.14159265358979",
    "1,000,000 and 1_000_000",
    "phone 555-0123, year 2026",
    "x = 42 * (7 + 3) / 2.5",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start|>user\nHi<|im_end|>",
    "text <|im_end|> text",
    "<|endoftext|>",
    "<|im_start|>assistant\n",
    "almost <|im_start special",
    "😀",
    "emoji 😀🎉👍🏽 in text",
    "flags 🇫🇷🇯🇵",
    "family 👨‍👩‍👧‍👦 joiners",
    "café naïve résumé",
    "Straße und Übermut",
    "Привет, мир",
    "こんにちは世界",
    "你好，世界",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "Ελληνικά γράμματα",
    "fn main() { println!(\"hi\"); }",
    "def f(x):\n    return x ** 2\n",
    "<html><body class=\"x\">hi</body></html>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "SELECT * FROM t WHERE id = 7;",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.com",
    "ALL CAPS SHOUTING",
    "MiXeD cAsE wOrDs",
    "don't won't it's y'all",
    "quotes \"double\" and 'single' and `back`",
    "punctuation!?.,;:—–-…",
    "math ∑ ∫ √ ∞ ≠ ≤",
    "a",
    " ",
    "\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
];

/// Tokenizer parity: the gateway's ids and chat prompts are those of the
/// vLLM at `engine`, serving the Hugging Face directory `model_dir`.
async fn the_gateways_token_ids_and_chat_prompts_are_the_engines(engine: &str, model_dir: &std::path::Path) {
    // The gateway's tokenizer and template: the card of the default model,
    // read from its GGUF, and read from the Hugging Face directory vLLM
    // serves (`--model DIR`): both give the engine's ids.
    let model = turbine_tokens::pull::resolve_model(MODEL, None, &turbine_tokens::pull::default_cache_dir(), turbine_tokens::pull::Progress::Quiet).unwrap();
    let from_gguf = turbine_tokens::ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap();
    let from_dir = turbine_tokens::ModelCard::from_path(MODEL, model_dir, 16).unwrap();
    assert_eq!(from_dir.chat_template, from_gguf.chat_template);
    assert_eq!(from_dir.tokenizer.eog_token_ids, from_gguf.tokenizer.eog_token_ids);
    for card in [from_gguf, from_dir] {
        check_parity(engine, turbine_tokens::Preprocessor::new(card).unwrap()).await;
    }
}

/// Every parity text and chat: `ours` gives the ids and prompts the
/// engine at `engine` gives.
async fn check_parity(engine: &str, ours: turbine_tokens::Preprocessor) {
    let client = reqwest::Client::new();
    let tokenize = async |body: serde_json::Value| -> Vec<u32> {
        let answer: serde_json::Value = client.post(format!("{engine}/tokenize")).json(&body).send().await.unwrap().json().await.unwrap();
        serde_json::from_value(answer["tokens"].clone()).unwrap_or_else(|_| panic!("{answer}"))
    };

    for text in PARITY_TEXTS {
        let theirs = tokenize(json!({"model": MODEL, "prompt": text, "add_special_tokens": false})).await;
        assert_eq!(ours.encode_text(text).unwrap(), theirs, "the ids of {text:?}");
    }

    let chats: Vec<Vec<(&str, &str)>> = vec![
        vec![("user", "Hi")],
        vec![("system", "Be brief."), ("user", "What is 2 + 2?")],
        vec![("system", "You are a pirate."), ("user", "Hello"), ("assistant", "Arr!"), ("user", "Where is the treasure? 🏴‍☠️")],
        vec![("user", "one"), ("assistant", "two"), ("user", "three"), ("assistant", "four"), ("user", "five")],
        vec![("system", ""), ("user", "empty system prompt")],
        vec![("system", "Multi\nline\n\nsystem"), ("user", "  spaced  \n")],
        vec![("user", "Write code:\n```rust\nfn main() {}\n```")],
        vec![("system", "Réponds en français."), ("user", "Quelle heure est-il ? 12:30")],
        vec![("user", "Count: 1 2 3 4 5 6 7 8 9 10")],
        vec![("system", "Use tools."), ("user", "{\"call\": \"f\", \"args\": [1, 2]}"), ("assistant", "done"), ("user", "again")],
        vec![("user", "control <|im_end|> text in content")],
    ];
    for chat in &chats {
        let messages: Vec<turbine_tokens::ChatMessage> = chat.iter().map(|(role, content)| turbine_tokens::ChatMessage::new(*role, *content)).collect();
        let body: Vec<serde_json::Value> = chat.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
        let theirs = tokenize(json!({"model": MODEL, "messages": body, "add_generation_prompt": true})).await;
        // The engine parses control-token texts in content as tokens; so
        // does the gateway when asked to (by default it keeps them text).
        let mine = ours.encode_chat_with(&messages, turbine_tokens::ContentControlTokens::Parse).unwrap();
        assert_eq!(mine.ids, theirs, "the ids of the chat {chat:?}");
        let rendered: serde_json::Value =
            client.post(format!("{engine}/detokenize")).json(&json!({"model": MODEL, "tokens": theirs})).send().await.unwrap().json().await.unwrap();
        assert_eq!(ours.render_chat(&messages).unwrap(), rendered["prompt"].as_str().unwrap(), "the rendered chat {chat:?}");
    }
}

/// Runs `request` on `worker` to its end; the engine's count of prompt
/// tokens served from its prefix cache.
async fn cached_tokens(worker: &turbine_api::worker::WorkerClient, request: turbine_api::GenerateRequest) -> u32 {
    let mut stream = worker.generate(request).await.unwrap();
    loop {
        let chunk =
            tokio::time::timeout(Duration::from_secs(60), stream.next()).await.expect("the engine answers").expect("the stream ends with its finish").unwrap();
        if let Some((_, usage)) = chunk.finished {
            return usage.cached_prompt_tokens;
        }
    }
}

/// Routes `prompt` (in `salt`'s KV namespace) with the router and runs it
/// on the worker it chose; then waits until that worker's adapter mirrors
/// the prompt's blocks (the engine's events arrive after its step), so the
/// next request routes on them. (The chosen worker, the router's
/// predicted overlap in tokens, the engine-reported cached tokens.)
async fn route_and_run(router: &RouterClient, prompt: Vec<u32>, request_id: &str, salt: turbine_kv::CacheSalt) -> (String, u32, u32) {
    let (worker, routed, cached) = route_and_run_once(router, prompt.clone(), request_id, salt).await;
    let last_block = *turbine_kv::BlockHasher::salted(turbine_kv::DEFAULT_SEED, salt).sequence_hashes(&prompt, 32).last().unwrap();
    wait_until("the adapter mirrors the prompt's blocks", Duration::from_secs(20), async || {
        worker.dump_kv_cache().await.is_ok_and(|dump| dump.dump.blocks.iter().any(|block| block.sequence_hash == last_block))
    })
    .await;
    (routed.worker.worker_id.to_string(), routed.overlap_blocks * 32, cached)
}

/// Routes `prompt` with the router and runs it on the worker it chose, to
/// its first token: (that worker, the router's answer, the engine-reported
/// cached prompt tokens).
async fn route_and_run_once(
    router: &RouterClient,
    prompt: Vec<u32>,
    request_id: &str,
    salt: turbine_kv::CacheSalt,
) -> (turbine_api::worker::WorkerClient, turbine_api::router::Routed, u32) {
    let route = turbine_api::router::RouteRequest {
        request_id: request_id.to_owned(),
        model: MODEL.into(),
        prompt_tokens: prompt.len() as u32,
        token_ids: prompt.clone().into(),
        cache_salt: salt,
        ..Default::default()
    };
    let routed = router.route(&route).await.unwrap();
    let worker = turbine_api::worker::WorkerClient::connect(&routed.worker.endpoint).unwrap();
    let request = turbine_api::GenerateRequest {
        request_id: request_id.to_owned(),
        prompt: prompt.clone(),
        stop: turbine_api::StopConditions { max_tokens: 1, ..Default::default() },
        cache_salt: salt,
        ..Default::default()
    };
    let cached = cached_tokens(&worker, request).await;
    router.finished(request_id).await.unwrap();
    (worker, routed, cached)
}

/// A TCP relay to a port on loopback that the test can cut: while cut,
/// it closes every connection through it, open and new, at once.
struct Relay {
    port: u16,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cuts: tokio::sync::watch::Sender<u64>,
}

impl Relay {
    async fn start(target: u16) -> Self {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (cuts, _) = tokio::sync::watch::channel(0u64);
        let (accepting, mut cut) = (open.clone(), cuts.subscribe());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !accepting.load(Ordering::SeqCst) {
                    continue;
                }
                cut.mark_unchanged();
                let mut cut = cut.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else { return };
                    tokio::select! {
                        _ = cut.changed() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        Self { port, open, cuts }
    }

    fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        self.cuts.send_modify(|cuts| *cuts += 1);
    }

    fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test]
async fn the_router_predicts_what_two_engines_cache_from_their_own_kv_events() {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let install = VllmInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
    // Two engines, each publishing its KV events to the port its adapter
    // listens on (a concrete host: vLLM connects to it); engine 0's
    // through a relay the test cuts, with its replay socket on.
    let ports = [turbine_testkit::free_port(), turbine_testkit::free_port()];
    let relay = Relay::start(ports[0]).await;
    let replay = turbine_testkit::free_port();
    let published = [(relay.port, Some(replay)), (ports[1], None)];
    let engines = futures::future::join_all(published.map(|(port, replay)| {
        let install = install.clone();
        tokio::task::spawn_blocking(move || {
            let replay = replay.map_or_else(String::new, |replay| format!(r#", "replay_endpoint": "tcp://127.0.0.1:{replay}""#));
            let events =
                format!(r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", "topic": "kv-events"{replay}}}"#);
            VllmServer::start(&install, MODEL, &["--kv-events-config", &events])
        })
    }))
    .await;
    let engines: Vec<VllmServer> = engines.into_iter().map(Result::unwrap).collect();
    let redis = RedisServer::start();
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "exact"];
    let model_dir = install.model.to_str().unwrap();
    let mut adapters = Vec::new();
    for (index, (engine, port)) in engines.iter().zip(ports).enumerate() {
        let (id, upstream, events) = (format!("vllm-{index}"), engine.url(), format!("tcp://127.0.0.1:{port}"));
        // The card from the directory the engine serves (`--model DIR`).
        let card = ["--model", model_dir, "--served-model-name", MODEL];
        let replayed = format!("tcp://127.0.0.1:{replay}");
        let replaying: &[&str] = if index == 0 { &["--upstream-kv-replay", &replayed] } else { &[] };
        let args =
            [&cluster[..], &card[..], &["--engine", "external", "--upstream", &upstream, "--upstream-kv-events", &events, "--worker-id", &id][..], replaying]
                .concat();
        adapters.push(service("turbine-worker", &args, &[], false).await);
    }
    let router = service("turbine-router", &[&cluster[..], &["--policy", "kv"][..]].concat(), &[], false).await;
    until_registered(&router, 2).await;
    let router = RouterClient::connect(&router.grpc_endpoint()).unwrap();

    let ours = turbine_tokens::Preprocessor::new(turbine_tokens::ModelCard::from_path(MODEL, &install.model, 32).unwrap()).unwrap();
    let subjects = ["astronomy", "cooking", "law", "music"];
    let mut outcomes = Vec::new();
    for round in 0..10 {
        for (index, subject) in subjects.iter().enumerate() {
            let system =
                format!("You are an expert in {subject}. {}", "Answer carefully, cite sources, and keep every answer short and precise. ".repeat(4 + index));
            let prompt = ours.encode_text(&format!("{system}\nQuestion {round} about {subject}: what matters most?")).unwrap();
            let (worker, predicted, cached) = route_and_run(&router, prompt, &format!("r-{round}-{index}"), turbine_kv::CacheSalt::SHARED).await;
            outcomes.push((worker, predicted, cached));
        }
    }
    // A tenant's requests: its KV namespace is the engine's cache_salt, and
    // the mirror hashes the blocks vLLM stores for it in that namespace:
    // the shared prefix is not credited to it, its own repeat is.
    let salt = turbine_kv::CacheSalt::of(&["tenant-a"]);
    let system = format!("You are an expert in astronomy. {}", "Answer carefully, cite sources, and keep every answer short and precise. ".repeat(4));
    let mut tenant = Vec::new();
    for round in 0..2 {
        let prompt = ours.encode_text(&format!("{system}\nQuestion {round} about astronomy: what matters most?")).unwrap();
        if round == 1 {
            // The adapter has mirrored the first request's blocks; the
            // router learns of them a moment later, over Redis (a CI run
            // routed the second request before it had: predicted 0, hit 64).
            let probe = turbine_api::router::RouteRequest {
                request_id: "tenant-probe".into(),
                model: MODEL.into(),
                prompt_tokens: prompt.len() as u32,
                token_ids: prompt.clone().into(),
                cache_salt: salt,
                ..Default::default()
            };
            wait_until("the router credits the tenant's own prefix", Duration::from_secs(30), async || {
                let routed = router.route(&probe).await.unwrap();
                router.finished("tenant-probe").await.unwrap();
                routed.overlap_blocks > 0
            })
            .await;
        }
        let (_, predicted, cached) = route_and_run(&router, prompt, &format!("tenant-{round}"), salt).await;
        tenant.push((predicted, cached));
    }
    assert_eq!(tenant[0], (0, 0), "the shared prefix is neither credited to nor hit by a tenant");
    assert!(tenant[1].1 > 0 && tenant[1].0 == tenant[1].1, "the tenant's own prefix is predicted and hit: {tenant:?}");

    let within_a_block = outcomes.iter().filter(|(_, predicted, cached)| predicted.abs_diff(*cached) <= 32).count();
    let hits = outcomes.iter().filter(|(_, _, cached)| *cached > 0).count();
    eprintln!(
        "predicted vs engine-reported cached tokens: {within_a_block}/{} within one block; {hits} requests hit the engine's cache; {outcomes:?}",
        outcomes.len()
    );
    assert!(hits >= 30, "the shared prefixes were cached and hit: {outcomes:?}");
    assert!(within_a_block * 100 >= outcomes.len() * 95, "the router's predicted overlap is the engine's cache for at least 95% of requests: {outcomes:?}");
    let used: std::collections::HashSet<&str> = outcomes.iter().map(|(worker, _, _)| worker.as_str()).collect();
    assert_eq!(used.len(), 2, "both engines served: {outcomes:?}");

    // Engine 0's events cut off while it caches a new prefix: once its
    // connection is back, its adapter asks its replay socket for what
    // followed the last batch it applied and continues from there, so
    // what the engine cached before the cut stays credited and the new
    // prefix is mirrored and routed on (without the replay, the new
    // connection cleared the mirror: everything cached before was
    // forgotten).
    let worker = turbine_api::worker::WorkerClient::connect(&adapters[0].grpc_endpoint()).unwrap();
    let blocks = async || -> std::collections::HashSet<turbine_kv::SequenceHash> {
        worker.dump_kv_cache().await.unwrap().dump.blocks.iter().map(|block| block.sequence_hash).collect()
    };
    let before = blocks().await;
    assert!(!before.is_empty(), "engine 0 served some of the prefixes above");
    let system = format!("You are an expert in geology. {}", "Name every rock, its age and where it is found, in one line. ".repeat(6));
    let prompt = ours.encode_text(&format!("{system}\nQuestion 0 about geology: what matters most?")).unwrap();
    let last_block = *turbine_kv::BlockHasher::salted(turbine_kv::DEFAULT_SEED, turbine_kv::CacheSalt::SHARED).sequence_hashes(&prompt, 32).last().unwrap();
    let mirrored = async || worker.dump_kv_cache().await.is_ok_and(|dump| dump.dump.blocks.iter().any(|block| block.sequence_hash == last_block));
    relay.cut();
    let request = turbine_api::GenerateRequest {
        request_id: "cut-0".into(),
        prompt: prompt.clone(),
        stop: turbine_api::StopConditions { max_tokens: 1, ..Default::default() },
        ..Default::default()
    };
    assert_eq!(cached_tokens(&worker, request).await, 0, "a prefix engine 0 had not cached");
    assert!(!mirrored().await, "no event crossed the cut");
    relay.restore();
    wait_until("the adapter mirrors what engine 0 cached while its events were cut off", Duration::from_secs(60), mirrored).await;
    let after = blocks().await;
    assert!(
        before.is_subset(&after),
        "what engine 0 cached before the cut is still credited: {} of {} blocks",
        before.intersection(&after).count(),
        before.len()
    );
    let admin = adapters[0].admin_url();
    assert!(turbine_testkit::metric_where(&admin, "turbine_worker_upstream_kv_event_replays_total", &[("outcome", "filled")]).await >= 1.0);
    assert_eq!(metric(&admin, "turbine_worker_upstream_kv_event_gaps_total").await, 0.0, "nothing was cleared");
    let ask = |id: &str| turbine_api::router::RouteRequest {
        request_id: id.to_owned(),
        model: MODEL.into(),
        prompt_tokens: prompt.len() as u32,
        token_ids: prompt.clone().into(),
        ..Default::default()
    };
    wait_until("the router credits engine 0 with the replayed prefix", Duration::from_secs(30), async || {
        let routed = router.route(&ask("probe")).await.unwrap();
        router.finished("probe").await.unwrap();
        routed.worker.worker_id.as_str() == "vllm-0" && routed.overlap_blocks > 0
    })
    .await;
    let (worker_id, predicted, cached) = route_and_run(&router, prompt.clone(), "after-cut", turbine_kv::CacheSalt::SHARED).await;
    assert_eq!(worker_id, "vllm-0");
    assert!(cached > 0 && predicted.abs_diff(cached) <= 32, "predicted {predicted} tokens, the engine hit {cached}");
}

/// The sum of a metric over `engines`.
async fn engines_metric(engines: &[String], name: &str) -> f64 {
    let mut sum = 0.0;
    for engine in engines {
        sum += engine_metric(engine, name, &[]).await;
    }
    sum
}

/// A stream through the gateway at `base` to one of the llama-servers at
/// `urls`, abandoned: the engine stops decoding it long before its 1,500
/// tokens.
async fn an_abandoned_stream_stops_in_llama_cpp(base: &str, urls: &[String]) {
    let (stream, _) = long_stream(base).await;
    assert_eq!(engines_metric(urls, "llamacpp:requests_processing").await, 1.0, "an engine runs the stream");
    let decodes = engines_metric(urls, "llamacpp:n_decode_total").await;
    drop(stream);
    wait_until("the engine cancels the abandoned request", Duration::from_secs(20), async || engines_metric(urls, "llamacpp:requests_processing").await == 0.0)
        .await;
    let decoded = engines_metric(urls, "llamacpp:n_decode_total").await - decodes;
    assert!(decoded < 1000.0, "the engines decoded {decoded} more steps for an abandoned request");
}

/// Kills the one of two llama-servers (`engines`, behind adapters named
/// `{prefix}-0` and `{prefix}-1`) that runs a stream through the gateway
/// at `base`: the stream continues on the other engine, and the dead
/// one's adapter leaves the registry. The index of the engine killed.
async fn a_killed_llama_cpp_moves_its_stream_to_the_other(base: &str, engines: &mut [LlamaCppServer], router: &RouterClient, prefix: &str) -> usize {
    let urls: Vec<String> = engines.iter().map(LlamaCppServer::url).collect();
    let (mut stream, mut buffer) = long_stream(base).await;
    let mut running = None;
    for (index, engine) in urls.iter().enumerate() {
        if engine_metric(engine, "llamacpp:requests_processing", &[]).await == 1.0 {
            running = Some(index);
        }
    }
    let running = running.expect("one engine runs the stream");
    let before = engine_metric(&urls[1 - running], "llamacpp:n_decode_total", &[]).await;
    engines[running].kill();
    // The other engine continues the request.
    read_past_the_migration(&mut stream, &mut buffer, base, async || engine_metric(&urls[1 - running], "llamacpp:n_decode_total", &[]).await > before).await;
    drop(stream);
    let survivor = format!("{prefix}-{}", 1 - running);
    wait_until("the adapter of the dead engine leaves the registry", Duration::from_secs(20), async || {
        router.workers(None).await.is_ok_and(|workers| workers.iter().map(|worker| worker.worker_id.to_string()).collect::<Vec<_>>() == [survivor.as_str()])
    })
    .await;
    running
}

/// Two llama-servers on the default model's GGUF (the adapters' cards
/// come from the same file), each behind an adapter of `kind` named
/// `{prefix}-0` and `{prefix}-1`, a router with `--policy kv
/// --kv-approximate` over them (no KV events: it credits its own
/// decisions) and a gateway, as processes over a real Redis.
struct LlamaCppStack {
    engines: Vec<LlamaCppServer>,
    urls: Vec<String>,
    adapters: Vec<ServiceProcess>,
    router: ServiceProcess,
    gateway: ServiceProcess,
    /// The gateway's REST base.
    base: String,
    gguf: std::path::PathBuf,
    redis: RedisServer,
}

impl LlamaCppStack {
    async fn start(kind: &str, prefix: &str) -> Self {
        let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let install = LlamaCppInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
        let cache = turbine_tokens::pull::default_cache_dir();
        let gguf = turbine_tokens::pull::resolve_model(MODEL, None, &cache, turbine_tokens::pull::Progress::Quiet).unwrap().path;
        let mut engines = Vec::new();
        for _ in 0..2 {
            let (install, gguf) = (install.clone(), gguf.clone());
            engines.push(tokio::task::spawn_blocking(move || LlamaCppServer::start(&install, &gguf, MODEL, &[])).await.unwrap());
        }
        let urls: Vec<String> = engines.iter().map(LlamaCppServer::url).collect();
        let redis = RedisServer::start();
        let url = redis.url();
        let cluster = ["--redis", url.as_str(), "--namespace", prefix];
        let mut adapters = Vec::new();
        for (index, upstream) in urls.iter().enumerate() {
            let id = format!("{prefix}-{index}");
            let external = ["--engine", "external", "--upstream-kind", kind, "--upstream", upstream, "--worker-id", &id, "--lease-ttl-secs", "2"];
            adapters.push(service("turbine-worker", &[&cluster[..], &external[..]].concat(), &[], false).await);
        }
        let router = service("turbine-router", &[&cluster[..], &["--policy", "kv", "--kv-approximate"][..]].concat(), &[], false).await;
        until_registered(&router, 2).await;
        let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
        let base = gateway.http_url();
        until_listed(&base).await;
        Self { engines, urls, adapters, router, gateway, base, gguf, redis }
    }
}

#[tokio::test]
async fn llama_cpp_serves_behind_adapters_routed_on_the_routers_own_decisions() {
    // No KV events from llama.cpp: the router credits its own decisions.
    let LlamaCppStack { mut engines, urls, adapters, router, gateway: _gateway, base, gguf, redis: _redis } = LlamaCppStack::start("llama-cpp", "llama").await;

    // The engine computes exactly the gateway's prompt tokens, and the
    // greedy text that comes back is the engine's own for that prompt.
    let before = engines_metric(&urls, "llamacpp:prompt_tokens_total").await;
    let (status, body) = post(&base, "/v1/completions", &json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12})).await;
    assert_eq!(status, 200, "{body}");
    let prompt_tokens = body["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(engines_metric(&urls, "llamacpp:prompt_tokens_total").await - before, prompt_tokens, "{body}");
    let direct = reqwest::Client::new()
        .post(format!("{}/completion", urls[0]))
        .json(&json!({"prompt": "The capital of France is", "n_predict": 12, "temperature": 0.0, "cache_prompt": false}))
        .send()
        .await
        .unwrap();
    let direct: serde_json::Value = direct.json().await.unwrap();
    assert_eq!(direct["tokens_evaluated"].as_f64(), Some(prompt_tokens), "the engine tokenizes the text as the gateway does: {direct}");
    assert_eq!(body["choices"][0]["text"], direct["content"], "the gateway's text is the engine's own greedy text: {body} {direct}");

    sdk_streams_a_chat(&base, true).await;

    // Routed on the router's own decisions: a prefix goes back to the
    // worker that computed it, which finds it in the engine's cache (the
    // router's predicted overlap is within a block of the engine's hit).
    let router_client = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    let ours = turbine_tokens::Preprocessor::new(turbine_tokens::ModelCard::from_path(MODEL, &gguf, 16).unwrap()).unwrap();
    let mut outcomes = Vec::new();
    for round in 0..4 {
        for subject in ["astronomy", "cooking"] {
            let system = format!("You are an expert in {subject}. {}", "Answer carefully, cite sources, and keep every answer short and precise. ".repeat(4));
            let prompt = ours.encode_text(&format!("{system}\nQuestion {round} about {subject}: what matters most?")).unwrap();
            let (_, routed, cached) = route_and_run_once(&router_client, prompt, &format!("r-{round}-{subject}"), turbine_kv::CacheSalt::SHARED).await;
            outcomes.push((subject, routed.worker.worker_id.to_string(), routed.overlap_blocks * 16, cached));
        }
    }
    eprintln!("(subject, worker, predicted tokens, engine-cached tokens): {outcomes:?}");
    for (subject, worker, predicted, cached) in &outcomes[2..] {
        let first = outcomes.iter().find(|outcome| outcome.0 == *subject).unwrap();
        assert_eq!(worker, &first.1, "{subject} went back to the worker that computed it: {outcomes:?}");
        assert!(*predicted > 0 && *cached > 0 && predicted.abs_diff(*cached) <= 16, "predicted and hit within a block: {outcomes:?}");
    }
    // A tenant's request shares no cache in an engine that cannot scope it.
    let system = format!("You are an expert in astronomy. {}", "Answer carefully, cite sources, and keep every answer short and precise. ".repeat(4));
    let prompt = ours.encode_text(&format!("{system}\nQuestion 9 about astronomy: what matters most?")).unwrap();
    let (_, _, cached) = route_and_run_once(&router_client, prompt, "tenant-0", turbine_kv::CacheSalt::of(&["tenant-a"])).await;
    assert_eq!(cached, 0, "a tenant's request reads no other request's cache");

    // A client that goes away mid-stream cancels its request in the engine.
    an_abandoned_stream_stops_in_llama_cpp(&base, &urls).await;

    // An engine killed mid-stream: the request continues on the other
    // engine's worker, and the dead one's adapter leaves the registry.
    let running = a_killed_llama_cpp_moves_its_stream_to_the_other(&base, &mut engines, &router_client, "llama").await;
    assert_eq!(metric(&adapters[running].admin_url(), "turbine_worker_upstream_healthy").await, 0.0);
}

// A fleet that mixes engines, routed round-robin: a request held to a
// format goes only to the worker whose engine keeps to it (llama.cpp
// behind an adapter), a text one to either, and where none does (a JSON
// request continued from another worker's output, which llama.cpp's
// grammar cannot resume) the router says so.
#[tokio::test]
async fn a_mixed_fleet_sends_json_only_to_the_worker_whose_engine_keeps_to_it() {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let install = LlamaCppInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
    let cache = turbine_tokens::pull::default_cache_dir();
    let gguf = turbine_tokens::pull::resolve_model(MODEL, None, &cache, turbine_tokens::pull::Progress::Quiet).unwrap().path;
    let engine = tokio::task::spawn_blocking(move || LlamaCppServer::start(&install, &gguf, MODEL, &[])).await.unwrap();
    let redis = RedisServer::start();
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "mixed", "--lease-ttl-secs", "2"];
    let upstream = engine.url();
    let external = ["--engine", "external", "--upstream-kind", "llama-cpp", "--upstream", upstream.as_str(), "--worker-id", "llama-0"];
    let adapter = service("turbine-worker", &[&cluster[..], &external[..]].concat(), &[], false).await;
    let mocker = service("turbine-worker", &[&cluster[..], &["--engine", "mock", "--speedup", "1000", "--worker-id", "mock-0"][..]].concat(), &[], false).await;
    let router = service("turbine-router", &["--redis", url.as_str(), "--namespace", "mixed", "--policy", "round-robin"], &[], false).await;
    until_registered(&router, 2).await;
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;

    let finished =
        async |worker: &ServiceProcess| turbine_testkit::metric_where(&worker.admin_url(), "turbine_worker_requests_total", &[("outcome", "finished")]).await;
    let schema = json!({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"], "additionalProperties": false});
    let formats = [json!({"type": "json_object"}), json!({"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}})];
    for round in 0..3 {
        for format in &formats {
            let ask = json!({"model": MODEL, "messages": [{"role": "user", "content": "Reply with a JSON object naming one colour."}], "response_format": format, "temperature": 0, "max_tokens": 40});
            let (status, body) = post(&base, "/v1/chat/completions", &ask).await;
            assert_eq!(status, 200, "round {round}, {format}: {body}");
            let content = body["choices"][0]["message"]["content"].as_str().unwrap();
            assert!(content.trim_start().starts_with('{'), "round {round}, {format}: {body}");
        }
    }
    assert_eq!(finished(&adapter).await, 6.0, "every JSON request went to the engine that keeps to it");
    assert_eq!(finished(&mocker).await, 0.0, "none went to the mocker");
    for i in 0..4 {
        let (status, body) =
            post(&base, "/v1/chat/completions", &json!({"model": MODEL, "messages": [{"role": "user", "content": format!("Hi {i}")}], "max_tokens": 4})).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!((finished(&adapter).await, finished(&mocker).await), (8.0, 2.0), "text goes round both");

    // No worker resumes an object begun elsewhere: the router says so
    // (FAILED_PRECONDITION), where a retry would not help.
    let client = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    let continued = turbine_api::router::RouteRequest {
        request_id: "continued".into(),
        model: MODEL.into(),
        output: turbine_api::FormatKind::JsonObject,
        output_continued: true,
        ..Default::default()
    };
    match client.route(&continued).await {
        Err(turbine_api::router::RouterCallError::Unserved(message)) => assert!(message.contains("from output begun on another worker"), "{message}"),
        other => panic!("a continued object was routed or refused for another reason: {other:?}"),
    }
    // What each engine keeps to is listed for operators (ListWorkers).
    let listed: std::collections::BTreeMap<String, turbine_api::OutputFormats> =
        client.workers(None).await.unwrap().into_iter().map(|worker| (worker.worker_id.to_string(), worker.output_formats)).collect();
    let llama = turbine_api::OutputFormats { json_object: true, json_schema: true, ..turbine_api::OutputFormats::TEXT };
    assert_eq!(listed, [("llama-0".to_owned(), llama), ("mock-0".to_owned(), turbine_api::OutputFormats::TEXT)].into());
}

// The plain OpenAI API, against llama.cpp's own OpenAI endpoint (one of
// many servers of it): text comes back and is re-tokenized.
#[tokio::test]
async fn an_openai_api_engine_serves_behind_adapters_its_text_retokenized() {
    let LlamaCppStack { mut engines, urls, adapters, router, gateway: _gateway, base, redis: _redis, .. } = LlamaCppStack::start("openai", "openai").await;

    // The card says the ids are re-tokenized.
    let worker = turbine_api::worker::WorkerClient::connect(&adapters[0].grpc_endpoint()).unwrap();
    assert!(worker.model_card().await.unwrap().retokenized, "the card says its ids are re-tokenized");

    // The gateway's greedy text is the engine's own for the same prompt,
    // and the usage is the engine's.
    let (status, body) = post(&base, "/v1/completions", &json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12})).await;
    assert_eq!(status, 200, "{body}");
    let direct = reqwest::Client::new()
        .post(format!("{}/v1/completions", urls[0]))
        .json(&json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0}))
        .send()
        .await
        .unwrap();
    let direct: serde_json::Value = direct.json().await.unwrap();
    assert_eq!(body["choices"][0]["text"], direct["choices"][0]["text"], "the gateway's text is the engine's own greedy text: {body} {direct}");
    assert_eq!(body["usage"]["prompt_tokens"], direct["usage"]["prompt_tokens"], "the engine tokenizes the text as the gateway does: {body} {direct}");
    assert_eq!(body["usage"]["completion_tokens"], direct["usage"]["completion_tokens"], "the engine's count: {body} {direct}");

    sdk_streams_a_chat(&base, false).await;

    // What the API cannot carry is refused, clearly, and the worker serves
    // on: log-probabilities of re-tokenized ids, a tenant's request.
    let (status, body) = post(&base, "/v1/completions", &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "logprobs": 2})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("log-probabilities"), "{body}");
    let tenant = turbine_api::GenerateRequest {
        request_id: "tenant-0".into(),
        prompt: vec![1, 2, 3],
        stop: turbine_api::StopConditions { max_tokens: 4, ..turbine_api::StopConditions::default() },
        cache_salt: turbine_kv::CacheSalt::of(&["tenant-a"]),
        ..turbine_api::GenerateRequest::default()
    };
    match worker.generate(tenant).await {
        Err(turbine_api::worker::WorkerError::InvalidArgument(message)) => assert!(message.contains("tenant"), "{message}"),
        Err(other) => panic!("a tenant's request refused for another reason: {other}"),
        Ok(_) => panic!("a tenant's request was served by an engine that cannot keep its cache apart"),
    }
    // The workers' records say their engines share one cache: the router
    // sends them no request of a namespace of its own, and says why.
    let (status, body) = post(&base, "/v1/completions", &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "cache_salt": "mine"})).await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("apart"), "{body}");
    let (status, body) = post(&base, "/v1/completions", &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4})).await;
    assert_eq!(status, 200, "{body}");

    // A client that goes away mid-stream cancels its request in the engine.
    an_abandoned_stream_stops_in_llama_cpp(&base, &urls).await;

    // An engine killed mid-stream: the request continues on the other, and
    // the dead one's adapter leaves the registry (its health is the
    // engine's model list answering).
    let router_client = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    a_killed_llama_cpp_moves_its_stream_to_the_other(&base, &mut engines, &router_client, "openai").await;
}

// llama.cpp's server rather than vLLM: the bench's path is the same for
// both dialects (the adapter's own request and reader), and llama-server
// starts in half a second where vLLM takes half a minute of two cores.
#[test]
fn the_adapter_bench_measures_its_cpu_per_token_beside_the_engine_called_directly() {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let json = tempfile::NamedTempFile::new().unwrap();
    let output = std::process::Command::new(turbine_testkit::workspace_binary("turbine"))
        .args(["bench", "adapter", "--upstream-kind", "llama-cpp", "--rounds", "1", "--requests", "4", "--concurrency", "2", "--output-tokens", "8"])
        .args(["--prompt-tokens", "32", "--workspace"])
        .arg(&workspace)
        .arg("--json")
        .arg(json.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    let phases = report["phases"].as_array().unwrap();
    assert_eq!((phases.len(), report["engine"].as_str()), (2, Some("llama-cpp")), "{report}");
    for phase in phases {
        assert_eq!(phase["tokens"], 32, "every stream carried its 8 tokens on both paths: {report}");
        assert!(phase["engine_cpu_us_per_token"].as_f64().unwrap() > 0.0, "the engine's CPU is read: {report}");
    }
    let adapter = phases.iter().find(|phase| phase["path"] == "adapter").unwrap();
    assert!(adapter["adapter_cpu_us_per_token"].as_f64().unwrap() > 0.0, "the adapter's CPU is read: {report}");
    assert!(stdout.contains("CPU per token") && report["pair_cpu_ratios"].as_array().unwrap().len() == 1, "{stdout}");
}

/// `--tls`: vLLM over HTTPS asking for the deployment's certificate and a
/// key, the worker's gRPC over mutual TLS; both paths carry every token
/// (an engine that took plaintext, or a worker without the certificate
/// or the key, would fail the run).
#[test]
fn the_adapter_bench_runs_with_both_of_the_workers_links_over_tls() {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let json = tempfile::NamedTempFile::new().unwrap();
    let output = std::process::Command::new(turbine_testkit::workspace_binary("turbine"))
        .args(["bench", "adapter", "--tls", "--rounds", "1", "--requests", "2", "--concurrency", "2", "--output-tokens", "4"])
        .args(["--prompt-tokens", "32", "--workspace"])
        .arg(&workspace)
        .arg("--json")
        .arg(json.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    assert_eq!((report["tls"].as_bool(), report["engine"].as_str()), (Some(true), Some("vllm")), "{report}");
    for phase in report["phases"].as_array().unwrap() {
        assert_eq!(phase["tokens"], 8, "every stream carried its 4 tokens on both paths: {report}");
    }
    assert!(stdout.contains("over TLS"), "{stdout}");
    // Only vLLM is run over TLS.
    let refused = std::process::Command::new(turbine_testkit::workspace_binary("turbine"))
        .args(["bench", "adapter", "--tls", "--upstream-kind", "llama-cpp", "--workspace"])
        .arg(&workspace)
        .output()
        .unwrap();
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("--upstream-kind vllm"));
}

/// vLLM over TLS that serves only holders of the deployment's
/// certificates (`--ssl-ca-certs ca.crt --ssl-cert-reqs 2`) and of its API
/// key: a worker given the engine's CA (`--upstream-ca`), its own
/// certificate and the key file serves through it; the engine refuses a
/// caller lacking either, and a worker without the key fails to start,
/// saying why.
#[tokio::test]
async fn vllm_over_tls_serves_a_worker_holding_the_deployments_certificate_and_the_engines_key() {
    use turbine_worker::external::{EngineLink, LinkSettings};
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let install = VllmInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
    let dir = tempfile::tempdir().unwrap();
    let certs = std::process::Command::new(turbine_testkit::workspace_binary("turbine"))
        .args(["certs", "--worker", "vllm-tls", "--engine-host", "127.0.0.1", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(certs.status.success(), "{}", String::from_utf8_lossy(&certs.stderr));
    let path = |name: &str| dir.path().join(name);
    let file = |name: &str| path(name).display().to_string();
    std::fs::write(path("engine-api-key"), "sk-engine-test\n").unwrap();
    let ssl = [
        "--ssl-certfile",
        &file("engine.crt"),
        "--ssl-keyfile",
        &file("engine.key"),
        "--ssl-ca-certs",
        &file("ca.crt"),
        "--ssl-cert-reqs",
        "2",
        "--api-key",
        "sk-engine-test",
    ]
    .map(str::to_owned);
    let mut vllm = tokio::task::spawn_blocking(move || VllmServer::spawn(&install, MODEL, &ssl.each_ref().map(String::as_str))).await.unwrap();
    let engine = vllm.https_url();

    // The operator's link: the CA, the operator's certificate, the key.
    let holder = LinkSettings { ca: Some(path("ca.crt")), identity: Some((path("operator.crt"), path("operator.key"))), api_key: Some(path("engine-api-key")) };
    let operator = EngineLink::new(&holder).unwrap();
    let answers = async |link: &EngineLink, route: &str| match link.send_once(&link.get(&format!("{engine}{route}")).unwrap()).await {
        Ok(response) => Ok(response.status().as_u16()),
        Err(error) => Err(error.to_string()),
    };
    turbine_testkit::poll_until("vLLM answers /health over TLS", turbine_testkit::VLLM_STARTUP_TIMEOUT, Duration::from_millis(500), async || {
        if let Some(status) = vllm.exited() {
            panic!("vLLM exited ({status}) before serving:\n{}", vllm.output().join("\n"));
        }
        answers(&operator, "/health").await == Ok(200)
    })
    .await;
    assert_eq!(answers(&operator, "/v1/models").await, Ok(200));
    // Without the key the engine's API refuses; without a certificate of
    // the deployment's the engine refuses the connection.
    let keyless = EngineLink::new(&LinkSettings { api_key: None, ..holder.clone() }).unwrap();
    assert_eq!(answers(&keyless, "/v1/models").await, Ok(401));
    let anonymous = EngineLink::new(&LinkSettings { identity: None, ..holder.clone() }).unwrap();
    assert!(answers(&anonymous, "/health").await.is_err(), "a caller without the deployment's certificate is refused");

    // The worker serves through it, as the gateway's callee.
    turbine_runtime::trust::TlsConfig { tls_cert: Some(path("gateway.crt")), tls_key: Some(path("gateway.key")), tls_ca: Some(path("ca.crt")) }
        .establish()
        .unwrap()
        .expect("this process dials as a gateway");
    let (ca, key, cert, cert_key) = (file("ca.crt"), file("engine-api-key"), file("workers/vllm-tls.crt"), file("workers/vllm-tls.key"));
    let upstream = ["--engine", "external", "--upstream", &engine, "--upstream-ca", &ca, "--worker-id", "vllm-tls"];
    let identity = ["--tls-cert", &cert, "--tls-key", &cert_key, "--tls-ca", &ca];
    let adapter = service("turbine-worker", &[&upstream[..], &identity[..], &["--upstream-api-key-file", &key]].concat(), &[], false).await;
    let worker = turbine_api::worker::WorkerClient::connect(&adapter.grpc_endpoint()).unwrap();
    let card = worker.model_card().await.unwrap();
    let prompt = turbine_tokens::Preprocessor::new(card).unwrap().encode_text("The capital of France is").unwrap();
    let prompt_metric = async || {
        let response = operator.send_once(&operator.get(&format!("{engine}/metrics")).unwrap()).await.unwrap();
        let text = response.text().await.unwrap();
        text.lines().filter(|line| line.starts_with("vllm:prompt_tokens_total")).filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok()).sum::<f64>()
    };
    let before = prompt_metric().await;
    let request = turbine_api::GenerateRequest {
        request_id: "over-tls".into(),
        prompt: prompt.clone(),
        stop: turbine_api::StopConditions { max_tokens: 8, ..turbine_api::StopConditions::default() },
        ..turbine_api::GenerateRequest::default()
    };
    let mut stream = worker.generate(request).await.unwrap();
    let mut generated = 0;
    let usage = loop {
        let chunk =
            tokio::time::timeout(Duration::from_secs(60), stream.next()).await.expect("the engine answers").expect("the stream ends with its finish").unwrap();
        generated += chunk.tokens.len();
        if let Some((_, usage)) = chunk.finished {
            break usage;
        }
    };
    assert!(generated > 0 && usage.completion_tokens as usize == generated, "{usage:?}");
    assert_eq!(prompt_metric().await - before, prompt.len() as f64, "the engine computed the worker's prompt");

    // A worker without the key waits for the engine, then fails saying why.
    let mut keyless_worker = std::process::Command::new(turbine_testkit::workspace_binary("turbine-worker"));
    keyless_worker.args(upstream).args(["--upstream-wait-secs", "2"]).args(identity);
    keyless_worker.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"]);
    let ran = tokio::time::timeout(Duration::from_secs(60), tokio::task::spawn_blocking(move || keyless_worker.output())).await.unwrap().unwrap().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
    assert!(!ran.status.success() && said.contains("401"), "{said}");
}
