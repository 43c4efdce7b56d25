//! The `turbine-worker` binary as a real process on free ports: gRPC
//! generation, health, bad input, and a graceful drain on SIGTERM.

use std::process::Command;
use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use turbine_proto::MessageLimits;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::kv_transfer_client::KvTransferClient;
use turbine_proto::worker::v1::worker_client::WorkerClient;
use turbine_runtime::grpc::tls_channel;
use turbine_runtime::host::Role;
use turbine_runtime::trust::TlsConfig;
use turbine_testkit::tls::TestCa;
use turbine_testkit::{ChildProcess, STARTUP_TIMEOUT, ServiceProcess, metric_where};

struct RunningWorker {
    process: ServiceProcess,
    endpoint: String,
}

async fn start_worker(speedup: &str) -> RunningWorker {
    start_worker_with(speedup, &[]).await
}

async fn start_worker_with(speedup: &str, extra: &[&str]) -> RunningWorker {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
    command.args(["--engine", "mock", "--speedup", speedup, "--worker-id", "w-test"]).args(extra);
    let mut process = ServiceProcess::spawn("turbine-worker", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::Worker, "turbine.worker.v1.Worker", STARTUP_TIMEOUT).await.unwrap();
    let endpoint = process.grpc_endpoint();
    RunningWorker { process, endpoint }
}

fn request(prompt_len: u32, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: "test".into(),
        prompt_token_ids: (0..prompt_len).map(|i| 100 + i % 1000).collect(),
        sampling: None,
        stop: Some(pb::StopConditions { max_tokens, stop_token_ids: vec![], ignore_eos: true }),
        remote_prefill: None,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    }
}

async fn collect(mut stream: tonic::Streaming<pb::GenerateResponse>) -> Result<(Vec<u32>, pb::GenerateResponse), tonic::Status> {
    let mut tokens = Vec::new();
    while let Some(message) = stream.message().await? {
        tokens.extend(&message.token_ids);
        if message.finish_reason() != pb::FinishReason::Unspecified {
            return Ok((tokens, message));
        }
    }
    Err(tonic::Status::internal("stream ended without finish_reason"))
}

#[tokio::test]
async fn generates_reports_health_and_refuses_bad_input() {
    let worker = start_worker("1000").await;
    let channel = tonic::transport::Channel::from_shared(worker.endpoint.clone()).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", "turbine.worker.v1.Worker"] {
        let status = health.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner().status();
        assert_eq!(status, ServingStatus::Serving, "service {service:?}");
    }

    let mut client = WorkerClient::connect(worker.endpoint.clone()).await.unwrap().with_message_limits();
    let stream = client.generate(request(1000, 100)).await.unwrap().into_inner();
    let (tokens, last) = collect(stream).await.unwrap();
    assert_eq!(tokens.len(), 100);
    assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    let usage = last.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (1000, 100));

    // The same prompt again is served from the prefix cache (64-token blocks).
    let (_, last) = collect(client.generate(request(1000, 5)).await.unwrap().into_inner()).await.unwrap();
    assert_eq!(last.usage.unwrap().cached_prompt_tokens, 960);

    let card = client.get_model_card(pb::GetModelCardRequest {}).await.unwrap().into_inner().card.unwrap();
    assert_eq!(card.name, "smollm2-135m");
    assert_eq!(card.context_length, 8192);
    assert_eq!(card.kv_block_size, 64);

    let bad = [
        request(0, 10),
        request(10, 0),
        request(8000, 500),
        pb::GenerateRequest { prompt_token_ids: vec![u32::MAX], ..request(1, 1) },
        pb::GenerateRequest { sampling: Some(pb::SamplingParams { top_p: Some(1.5), ..Default::default() }), ..request(5, 5) },
    ];
    for request in bad {
        let status = client.generate(request.clone()).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{request:?}: {status:?}");
    }
    // Called directly, past the router: the mocker holds no output to a
    // format, and says so for either.
    for (output_format, output_schema) in [(pb::OutputFormat::JsonObject, ""), (pb::OutputFormat::JsonSchema, r#"{"type":"object"}"#)] {
        let sampling = pb::SamplingParams { output_format: output_format as i32, output_schema: output_schema.into(), ..Default::default() };
        let status = client.generate(pb::GenerateRequest { sampling: Some(sampling), ..request(5, 5) }).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{output_format:?}: {status:?}");
        assert!(status.message().contains("does not constrain its output"), "{output_format:?}: {status:?}");
    }
    // Still serving after all that.
    let (tokens, _) = collect(client.generate(request(10, 3)).await.unwrap().into_inner()).await.unwrap();
    assert_eq!(tokens.len(), 3);
    let load = client.load(pb::LoadRequest {}).await.unwrap().into_inner().load.unwrap();
    assert_eq!(load.blocks_total, 16_384);
}

#[tokio::test]
async fn sigterm_lets_32_in_flight_streams_finish_then_exits_zero() {
    // Real-time mocker: each request takes about a second of decode steps.
    let mut worker = start_worker("1").await;
    let client = WorkerClient::connect(worker.endpoint.clone()).await.unwrap();
    let mut streams = Vec::new();
    for _ in 0..32 {
        let mut client = client.clone();
        let mut stream = client.generate(request(200, 150)).await.unwrap().into_inner();
        // Wait for the first tokens so the request is surely in flight.
        let first = stream.message().await.unwrap().unwrap();
        streams.push((first.token_ids.len(), stream));
    }
    worker.process.terminate();
    let mut finished = 0;
    for (already, stream) in streams {
        let (tokens, last) = collect(stream).await.expect("an in-flight stream was cut by SIGTERM");
        assert_eq!(already + tokens.len(), 150);
        assert_eq!(last.finish_reason(), pb::FinishReason::Length);
        finished += 1;
    }
    assert_eq!(finished, 32);
    let status = worker.process.wait(Duration::from_secs(30)).expect("worker did not exit after draining");
    assert!(status.success(), "exit status {status}");
}

#[tokio::test]
async fn any_gguf_path_is_served_under_the_given_name() {
    let model =
        turbine_tokens::pull::resolve_model("smollm2-135m", None, &turbine_tokens::pull::default_cache_dir(), turbine_tokens::pull::Progress::Quiet).unwrap();
    let path = model.path.to_str().unwrap();
    let worker = start_worker_with("1000", &["--model", path, "--served-model-name", "my-model", "--block-size", "16", "--context-length", "2048"]).await;
    let mut client = WorkerClient::connect(worker.endpoint.clone()).await.unwrap().with_message_limits();
    let card = client.get_model_card(pb::GetModelCardRequest {}).await.unwrap().into_inner().card.unwrap();
    assert_eq!((card.name.as_str(), card.kv_block_size, card.context_length), ("my-model", 16, 2048));
    let status = client.generate(request(2000, 100)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "the overridden context length applies");
}

#[test]
fn a_missing_model_file_is_a_clear_startup_error() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
    command.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--model", "/nonexistent/model.gguf"]);
    let mut worker = ChildProcess::spawn("turbine-worker", command);
    let status = worker.wait(Duration::from_secs(60)).expect("exits");
    assert!(!status.success());
    assert!(
        worker.output().iter().any(|line| line.contains("is neither a GGUF file, nor a model directory with a tokenizer.json, nor a known model")),
        "{:?}",
        worker.output()
    );
}

#[tokio::test]
async fn a_prefill_cannot_pin_blocks_longer_than_the_workers_lease() {
    // The attack: lease_ms 4294967295 pinned a prompt's blocks for 49.7 days.
    let worker = start_worker_with("1000", &["--role", "prefill", "--kv-lease-ms", "2000"]).await;
    let mut client = WorkerClient::connect(worker.endpoint.clone()).await.unwrap().with_message_limits();
    let generate = request(64, 8);
    let prefill = |lease_ms: u32| pb::PrefillRequest {
        request_id: format!("lease-{lease_ms}"),
        prompt_token_ids: generate.prompt_token_ids.clone(),
        sampling: None,
        stop: generate.stop.clone(),
        lease_ms,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    };
    let now_ms = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let asked = now_ms();
    let handle = client.prefill(prefill(u32::MAX)).await.unwrap().into_inner().handle.expect("a handle");
    let lease = handle.lease_expires_unix_ms - asked;
    assert!((0..=2_000 + 1_000).contains(&lease), "the lease is cut to the worker's 2 s, got {lease} ms");
    // A shorter one is the caller's to ask for.
    let asked = now_ms();
    let handle = client.prefill(prefill(500)).await.unwrap().into_inner().handle.expect("a handle");
    assert!(handle.lease_expires_unix_ms - asked <= 500 + 1_000, "{} ms", handle.lease_expires_unix_ms - asked);
    drop(worker);
}

#[tokio::test]
async fn each_requester_pins_only_its_share_of_the_pool() {
    // The attack: four long pins took 40 of 48 blocks and an ordinary
    // request stalled. Pins are bounded per requester (its certificate)
    // and in all; a prefill past either hands over no blocks (its decode
    // worker computes the prompt) and nothing fails.
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("pins");
    let path = |config: &TlsConfig| -> Vec<String> {
        let show = |path: &Option<std::path::PathBuf>| path.as_deref().unwrap().display().to_string();
        vec!["--tls-cert".into(), show(&config.tls_cert), "--tls-key".into(), show(&config.tls_key), "--tls-ca".into(), show(&config.tls_ca)]
    };
    ca.issue(Role::Operator, "test").write(dir.path(), "operator").establish().unwrap().expect("this process is an operator");
    let worker_tls = path(&ca.issue(Role::Worker, "w-test").write(dir.path(), "worker"));
    // 32 blocks of 16 tokens: handles may pin 16 in all, 12 per requester.
    let mut extra =
        vec!["--role", "prefill", "--num-blocks", "32", "--block-size", "16", "--kv-pinned-share", "0.5", "--kv-pinned-share-per-requester", "0.375"];
    extra.extend(worker_tls.iter().map(String::as_str));
    let worker = start_worker_with("1000", &extra).await;
    let gateway = |name: &str| {
        let channel = tls_channel(&worker.endpoint, &ca.trust(Role::Gateway, name), Role::Worker).unwrap();
        (WorkerClient::new(channel.clone()).with_message_limits(), KvTransferClient::new(channel).with_message_limits())
    };
    let ((mut a, mut a_transfer), (mut b, _)) = (gateway("gateway-a"), gateway("gateway-b"));
    // 65 tokens: 4 full blocks each.
    let generate = request(65, 8);
    let prefill = |id: &str| pb::PrefillRequest {
        request_id: id.into(),
        prompt_token_ids: generate.prompt_token_ids.clone(),
        sampling: None,
        stop: generate.stop.clone(),
        lease_ms: 0,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    };
    let mut a_handles = Vec::new();
    for i in 0..3 {
        let prefilled = a.prefill(prefill(&format!("a-{i}"))).await.unwrap().into_inner();
        a_handles.push(prefilled.handle.expect("within gateway-a's 12 blocks"));
    }
    let refused = a.prefill(prefill("a-3")).await.expect("a prefill past the share still answers").into_inner();
    assert!(refused.handle.is_none(), "gateway-a's fourth handle would pass its 12 blocks");
    let first = refused.first.expect("the first token");
    assert_eq!((first.token_ids.len(), first.finish_reason()), (1, pb::FinishReason::Unspecified), "the request goes on, computed by its decode worker");
    // Another requester has its own share, up to the pool's 16 blocks.
    let b_handle = b.prefill(prefill("b-0")).await.unwrap().into_inner().handle.expect("gateway-b's own share");
    assert!(b.prefill(prefill("b-1")).await.unwrap().into_inner().handle.is_none(), "16 blocks are pinned: the pool's share");
    let counted = |reason: &'static str| {
        let admin = worker.process.admin_url();
        async move { metric_where(&admin, "turbine_worker_kv_pins_refused_total", &[("reason", reason)]).await }
    };
    assert_eq!((counted("requester_share").await, counted("pool_share").await), (1.0, 1.0));
    // A release gives the room back.
    let first = &a_handles[0];
    let released = a_transfer.release(pb::ReleaseRequest { handle_id: first.handle_id, token: first.token.clone() }).await.unwrap().into_inner();
    assert!(released.released);
    assert!(b.prefill(prefill("b-2")).await.unwrap().into_inner().handle.is_some(), "4 blocks were released");
    drop(b_handle);
}

/// A worker never SERVING (its registry never answers) has no drain delay
/// to serve out: no balancer sent it traffic, so one SIGTERM stops it,
/// 300 s of delay asked for notwithstanding.
#[tokio::test]
async fn a_worker_never_serving_stops_at_once_without_its_drain_delay() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
    // Nothing listens on port 1: the registry never answers.
    command.args(["--engine", "mock", "--worker-id", "w-test", "--redis", "redis://127.0.0.1:1", "--drain-delay-secs", "300"]);
    let mut process = ServiceProcess::spawn("turbine-worker", command, false).await.unwrap();
    let channel = tonic::transport::Channel::from_shared(process.grpc_endpoint()).unwrap().connect().await.unwrap();
    let mut health = HealthClient::new(channel);
    let checked = health.check(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
    assert_eq!(checked.status(), ServingStatus::NotServing, "not serving without its registry");
    process.terminate();
    let (status, process) = tokio::task::spawn_blocking(move || (process.wait(Duration::from_secs(30)), process)).await.unwrap();
    let status = status.expect("the worker stops on one SIGTERM");
    assert!(status.success(), "{status}: {}", process.output().join("\n"));
}
