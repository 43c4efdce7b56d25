//! The distributed stack: `turbine-worker` ×2, `turbine-router` and
//! `turbine-gateway` as separate processes sharing a real Redis registry,
//! on free ports. Requests flow end to end, a worker killed mid-stream is
//! replaced without the client noticing, SIGTERM drains the gateway, and
//! one request is one trace across the three services.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::{EXIT_TIMEOUT, MODEL, metric, post, read_events, service, sse, streamed_text, until_listed, until_registered, wait_until};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use serde_json::json;
use turbine_kv_log::LogPosition;
use turbine_testkit::{RedisServer, ServiceProcess};

struct Cluster {
    redis: RedisServer,
    workers: Vec<ServiceProcess>,
    router: ServiceProcess,
    gateway: ServiceProcess,
    base: String,
}

async fn start_cluster(workers: usize, speedup: &str, env: &[(&str, String)]) -> Cluster {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut started = Vec::new();
    for index in 0..workers {
        let id = format!("worker-{index}");
        let args = ["--engine", "mock", "--speedup", speedup, "--redis", &url, "--namespace", "e2e", "--worker-id", &id, "--lease-ttl-secs", "2"];
        started.push(service("turbine-worker", &args, env, false).await);
    }
    let router = service("turbine-router", &["--redis", &url, "--namespace", "e2e", "--policy", "round-robin"], env, false).await;
    // Every worker registered before traffic starts.
    until_registered(&router, workers).await;
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], env, true).await;
    let base = gateway.http_url();
    until_listed(&base).await;
    Cluster { redis, workers: started, router, gateway, base }
}

#[tokio::test]
async fn requests_flow_through_separate_processes_and_spread_over_workers() {
    let cluster = start_cluster(2, "1000", &[]).await;
    for i in 0..8 {
        let (status, body) = post(
            &cluster.base,
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": format!("question {i}")}], "max_tokens": 8, "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 8);
    }
    for worker in &cluster.workers {
        let finished = metric(&worker.admin_url(), "turbine_worker_requests_total").await;
        assert_eq!(finished, 4.0, "round-robin spreads 8 requests over 2 workers");
    }
    let events = sse(&cluster.base, "/v1/completions", &json!({"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": true, "ignore_eos": true})).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(reqwest::get(format!("{}/readyz", cluster.router.admin_url())).await.unwrap().status(), 200);
    assert_eq!(reqwest::get(format!("{}/health", cluster.base)).await.unwrap().status(), 200);

    // Both workers published their KV events (numbered from 0) to the
    // namespace's event log: round-robin sends one long prompt (complete
    // KV blocks) to each.
    for i in 0..2 {
        let prompt = format!("{i} {}", "many words fill whole blocks ".repeat(60));
        let (status, body) = post(&cluster.base, "/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1})).await;
        assert_eq!(status, 200, "{body}");
    }
    let log = turbine_kv_log::EventLog::new(&cluster.redis.url(), "e2e").unwrap();
    let expected: std::collections::BTreeMap<String, u64> = [("worker-0".to_string(), 0), ("worker-1".to_string(), 0)].into();
    let first_ids = async || {
        let mut first_ids = std::collections::BTreeMap::new();
        for entry in log.reader().read(LogPosition::START, std::time::Duration::from_millis(100), 10_000).await.unwrap() {
            let wire: turbine_proto::kvindex::v1::EventBatch = prost::Message::decode(entry.payload.as_slice()).unwrap();
            let batch = turbine_kv::EventBatch::try_from(wire).unwrap();
            first_ids.entry(batch.worker_id.to_string()).or_insert(batch.events[0].event_id);
        }
        first_ids
    };
    // Published asynchronously: wait for both.
    wait_until("both workers' events are in the log", std::time::Duration::from_secs(5), async || first_ids().await.len() == 2).await;
    assert_eq!(first_ids().await, expected, "each worker's events start at 0");
}

#[tokio::test]
async fn a_worker_killed_mid_stream_is_replaced_and_the_client_sees_one_stream() {
    let mut cluster = start_cluster(2, "1", &[]).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", cluster.base))
        .json(&json!({"model": MODEL, "prompt": "A long story", "max_tokens": 300, "stream": true, "ignore_eos": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let reading = tokio::spawn(read_events(response));
    // Find the worker holding the request (its engine runs one sequence) and kill it.
    let mut victim = None;
    wait_until("a worker generates the request", std::time::Duration::from_secs(10), async || {
        for (index, worker) in cluster.workers.iter().enumerate() {
            if metric(&worker.admin_url(), "turbine_worker_generated_tokens_total").await >= 20.0 {
                victim = Some(index);
            }
        }
        victim.is_some()
    })
    .await;
    cluster.workers[victim.unwrap()].kill();
    let events = reading.await.unwrap();
    let usage: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 300, "the stream continued on the other worker to the full length");
    assert!(!streamed_text(&events).is_empty());
    assert_eq!(metric(&cluster.base, "turbine_gateway_migrations_total").await, 1.0);
}

#[tokio::test]
async fn sigterm_drains_the_gateway_with_32_streams_in_flight() {
    let mut cluster = start_cluster(1, "1", &[]).await;
    let client = reqwest::Client::new();
    let mut responses = Vec::new();
    for i in 0..32 {
        let body = json!({"model": MODEL, "prompt": format!("stream {i}"), "max_tokens": 120, "stream": true, "ignore_eos": true,
                          "stream_options": {"include_usage": true}});
        responses.push(client.post(format!("{}/v1/completions", cluster.base)).json(&body).send().await.unwrap());
    }
    cluster.gateway.terminate();
    for events in futures::future::join_all(responses.into_iter().map(read_events)).await {
        let usage: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 120);
    }
    let status = cluster.gateway.wait(EXIT_TIMEOUT).expect("gateway did not exit");
    assert!(status.success(), "gateway exit status {status}");
}

/// An OTLP collector that records (service, trace id, span name).
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<parking_lot::Mutex<Vec<(String, String, String)>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(&self, request: tonic::Request<ExportTraceServiceRequest>) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .map(|v| format!("{:?}", v.value))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push((service.clone(), hex::encode(&span.trace_id), span.name));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

// Multi-threaded: the collector must keep answering while the test thread
// blocks waiting for the services to exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_gateway_router_and_worker() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder().add_service(TraceServiceServer::new(collector.clone())).serve_with_incoming(tokio_stream_listener(listener)),
    );
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint), ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned())];
    let mut cluster = start_cluster(1, "1000", &env).await;

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", cluster.base))
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    // A graceful exit flushes every pending span.
    cluster.gateway.terminate();
    cluster.router.terminate();
    cluster.workers[0].terminate();
    for process in [&mut cluster.gateway, &mut cluster.router, &mut cluster.workers[0]] {
        assert!(process.wait(EXIT_TIMEOUT).expect("exit").success());
    }
    let spans = collector.spans.lock().clone();
    let services: HashSet<&str> = spans.iter().filter(|(_, id, _)| id == trace_id).map(|(service, _, _)| service.as_str()).collect();
    for service in ["turbine-gateway", "turbine-router", "turbine-worker"] {
        assert!(services.iter().any(|s| s.contains(service)), "no {service} span in trace {trace_id}: {spans:#?}");
    }
}

fn tokio_stream_listener(listener: tokio::net::TcpListener) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(listener, |listener| async move { Some((listener.accept().await.map(|(stream, _)| stream), listener)) })
}

/// Two gateways in front of one router, with the same API keys and the
/// same Redis: a key's requests per minute hold across both (not twice
/// over), while another key is served; with Redis gone each gateway
/// decides by its own limits (counted), never by none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_sharing_redis_share_a_keys_limits() {
    use turbine_gateway::keys::{entry, new_key};

    let mut redis = RedisServer::start();
    let url = redis.url();
    let worker =
        service("turbine-worker", &["--engine", "mock", "--speedup", "1000", "--redis", &url, "--namespace", "limits", "--worker-id", "w0"], &[], false).await;
    let router = service("turbine-router", &["--redis", &url, "--namespace", "limits"], &[], false).await;
    until_registered(&router, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let (limited, tokens, other) = (new_key(), new_key(), new_key());
    let keys = dir.path().join("keys.toml");
    let text = [
        format!("{}requests_per_minute = 4\n", entry("limited", "a", None, &limited)),
        format!("{}tokens_per_minute = 100\n", entry("tokens", "c", None, &tokens)),
        entry("other", "b", None, &other),
    ];
    std::fs::write(&keys, text.join("\n")).unwrap();
    let mut gateways = Vec::new();
    for _ in 0..2 {
        let args = ["--router", &router.grpc_endpoint(), "--api-keys", keys.to_str().unwrap(), "--redis", &url, "--namespace", "limits"];
        gateways.push(service("turbine-gateway", &args, &[], true).await);
    }
    let http = reqwest::Client::new();
    let status = async |gateway: &ServiceProcess, key: &str| {
        let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1});
        http.post(format!("{}/v1/completions", gateway.http_url())).bearer_auth(key).json(&body).send().await.unwrap().status().as_u16()
    };
    for gateway in &gateways {
        wait_until("the gateway lists the model", turbine_testkit::STARTUP_TIMEOUT, async || status(gateway, &other).await == 200).await;
    }
    // Four a minute in all, alternating gateways; then both refuse it.
    let mut answers = Vec::new();
    for round in 0..6 {
        answers.push(status(&gateways[round % 2], &limited).await);
    }
    assert_eq!(answers, [200, 200, 200, 200, 429, 429], "the key's limit holds across both gateways");
    assert_eq!((status(&gateways[0], &other).await, status(&gateways[1], &other).await), (200, 200), "another key is served");
    // Tokens spent through one gateway count at the other: 150 prompt
    // tokens of 100 a minute through the first, then the second refuses
    // (once the charge, sent after the request, has landed).
    let long = json!({"model": MODEL, "prompt": "word ".repeat(150), "max_tokens": 1});
    let spent = http.post(format!("{}/v1/completions", gateways[0].http_url())).bearer_auth(&tokens).json(&long).send().await.unwrap();
    assert_eq!(spent.status(), 200);
    wait_until("the other gateway refuses the spent key", std::time::Duration::from_secs(10), async || status(&gateways[1], &tokens).await == 429).await;

    // Redis gone: each gateway by its own bucket, which still holds two of
    // the four (each served two), so the key is served again, on its own
    // limits, and the missing answers are counted.
    redis.kill();
    assert_eq!(status(&gateways[0], &limited).await, 200, "decided by the gateway's own limits");
    let failures = metric(&gateways[0].admin_url(), "turbine_gateway_shared_limit_failures_total").await;
    assert!(failures >= 1.0, "{failures}");
    drop((gateways, router, worker));
}

/// A key's `max_concurrent` holds across gateways sharing Redis: two
/// streams held open through one gateway fill a key allowed two, so the
/// other gateway refuses a third (429, counted as the concurrency limit)
/// until a stream ends, its client gone; another key is served all along.
/// With Redis gone a gateway's own limit decides (counted), never none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_sharing_redis_share_a_keys_concurrency_limit() {
    use turbine_gateway::keys::{entry, new_key};

    let mut redis = RedisServer::start();
    let url = redis.url();
    let cluster = ["--redis", url.as_str(), "--namespace", "places"];
    // Real mocker timing: a 4,000-token stream runs for many seconds.
    let worker = service("turbine-worker", &[&cluster[..], &["--engine", "mock", "--speedup", "1", "--worker-id", "w0"]].concat(), &[], false).await;
    let router = service("turbine-router", &cluster, &[], false).await;
    until_registered(&router, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let (two, other) = (new_key(), new_key());
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, [format!("{}max_concurrent = 2\n", entry("two", "a", None, &two)), entry("other", "b", None, &other)].join("\n")).unwrap();
    let mut gateways = Vec::new();
    let router_endpoint = router.grpc_endpoint();
    for _ in 0..2 {
        let args = [&["--router", router_endpoint.as_str(), "--api-keys", keys.to_str().unwrap()][..], &cluster[..]].concat();
        gateways.push(service("turbine-gateway", &args, &[], true).await);
    }
    let http = reqwest::Client::new();
    let short = async |gateway: &ServiceProcess, key: &str| {
        let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1});
        http.post(format!("{}/v1/completions", gateway.http_url())).bearer_auth(key).json(&body).send().await.unwrap().status().as_u16()
    };
    for gateway in &gateways {
        wait_until("the gateway serves", turbine_testkit::STARTUP_TIMEOUT, async || short(gateway, &other).await == 200).await;
    }
    let long = json!({"model": MODEL, "prompt": "stream on", "max_tokens": 4000, "ignore_eos": true, "stream": true});
    let open = async |gateway: &ServiceProcess| {
        let response = http.post(format!("{}/v1/completions", gateway.http_url())).bearer_auth(&two).json(&long).send().await.unwrap();
        assert_eq!(response.status(), 200);
        response
    };
    let mut streams = vec![open(&gateways[0]).await, open(&gateways[0]).await];
    let refused = async |gateway: &ServiceProcess| {
        turbine_testkit::metric_where(&gateway.admin_url(), "turbine_gateway_rate_limited_total", &[("limit", "concurrency")]).await
    };
    assert_eq!(short(&gateways[1], &two).await, 429, "the other gateway sees the key's two in flight");
    assert_eq!(refused(&gateways[1]).await, 1.0);
    assert_eq!(refused(&gateways[0]).await, 0.0, "the first gateway's own limit was never reached past");
    assert_eq!(short(&gateways[1], &other).await, 200, "another key is served");
    // A stream's client goes: its place is given back across gateways.
    streams.pop();
    wait_until("the other gateway admits the key again", std::time::Duration::from_secs(20), async || short(&gateways[1], &two).await == 200).await;
    // A place is given back in Redis just after its response ends (the
    // short request's too): the stream opens once that one is back.
    let mut reopened = None;
    wait_until("a stream of the key opens through the other gateway", std::time::Duration::from_secs(20), async || {
        let response = http.post(format!("{}/v1/completions", gateways[1].http_url())).bearer_auth(&two).json(&long).send().await.unwrap();
        let admitted = response.status() == 200;
        reopened = admitted.then_some(response);
        admitted
    })
    .await;
    streams.push(reopened.unwrap());
    assert_eq!(short(&gateways[0], &two).await, 429, "two in flight, one through each gateway");

    // Redis gone: each gateway by its own limit (the first holds one of
    // its two places), counted.
    drop(streams);
    redis.kill();
    assert_eq!(short(&gateways[0], &two).await, 200, "decided by the gateway's own limit");
    assert!(metric(&gateways[0].admin_url(), "turbine_gateway_shared_limit_failures_total").await >= 1.0);
    drop((gateways, router, worker));
}
