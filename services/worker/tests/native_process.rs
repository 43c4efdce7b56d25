//! `turbine-worker --engine native` as a real process: the real model under
//! a burst larger than its KV pool, resident memory within budget, the
//! host KV tier serving prompts the pool evicted, and devices this build
//! cannot use refused at startup.

use std::process::Command;
use std::time::Duration;

use turbine_proto::MessageLimits;
use turbine_proto::worker::v1 as pb;
use turbine_proto::worker::v1::kv_transfer_client::KvTransferClient;
use turbine_proto::worker::v1::worker_client::WorkerClient;
use turbine_runtime::host::Role;
use turbine_testkit::tls::TestCa;
use turbine_testkit::{ChildProcess, STARTUP_TIMEOUT, ServiceProcess, listening_sockets, metric, metric_where};
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Preprocessor};

const MODEL: &str = "smollm2-135m";

async fn native_worker(extra: &[&str]) -> ServiceProcess {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
    command.args(["--engine", "native", "--model", MODEL, "--threads", "2"]).args(extra);
    let mut process = ServiceProcess::spawn("turbine-worker", command, false).await.unwrap();
    process.until_serving(turbine_runtime::host::Role::Worker, "turbine.worker.v1.Worker", STARTUP_TIMEOUT).await.unwrap();
    process
}

/// Peak resident memory of a process (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|line| line.starts_with("VmHWM:")).expect("VmHWM in /proc status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn greedy(prompt: &[u32], max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: String::new(),
        prompt_token_ids: prompt.to_vec(),
        sampling: Some(pb::SamplingParams { temperature: Some(0.0), ..Default::default() }),
        stop: Some(pb::StopConditions { max_tokens, stop_token_ids: vec![], ignore_eos: true }),
        remote_prefill: None,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    }
}

async fn generate(client: WorkerClient<tonic::transport::Channel>, request: pb::GenerateRequest) -> Result<(Vec<u32>, pb::FinishReason), tonic::Status> {
    tokio::time::timeout(Duration::from_secs(240), generate_unbounded(client, request)).await.expect("a request finishes within 240 s")
}

async fn generate_unbounded(
    mut client: WorkerClient<tonic::transport::Channel>,
    request: pb::GenerateRequest,
) -> Result<(Vec<u32>, pb::FinishReason), tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(message) = stream.message().await? {
        tokens.extend(&message.token_ids);
        if message.finish_reason() != pb::FinishReason::Unspecified {
            return Ok((tokens, message.finish_reason()));
        }
    }
    Err(tonic::Status::internal("stream ended without finish_reason"))
}

#[tokio::test]
async fn a_64_request_burst_beyond_the_kv_pool_completes_within_the_memory_budget() {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    let model_bytes = std::fs::metadata(&model.path).unwrap().len();
    let kv_cache_mib = 24u64;
    let worker = native_worker(&["--kv-cache-mib", &kv_cache_mib.to_string(), "--max-seqs", "64"]).await;
    let client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();

    // Eight prompts (block-boundary lengths among them), eight copies of
    // each: 64 sequences of up to 144 tokens need about 400 blocks, and a
    // 24 MiB pool holds 68.
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap()).unwrap();
    let passage =
        tokens.encode_text(&"Rivers carry water from the mountains to the sea, shaping valleys and feeding the towns along their banks. ".repeat(12)).unwrap();
    let lengths = [16, 31, 32, 33, 47, 64, 90, 120];
    let max_tokens = 24;
    let requests: Vec<_> = (0..8).flat_map(|_| lengths.iter().map(|&n| greedy(&passage[..n], max_tokens))).collect();
    let tasks: Vec<_> = requests.into_iter().map(|request| tokio::spawn(generate(client.clone(), request))).collect();
    let mut outputs = Vec::new();
    for task in tasks {
        let (tokens, finish) = task.await.unwrap().expect("a request of the burst failed");
        assert_eq!((tokens.len(), finish), (max_tokens as usize, pb::FinishReason::Length));
        outputs.push(tokens);
    }
    // Every copy of a prompt decoded the same greedy tokens, whether it ran
    // first, shared cached blocks, or was preempted and recomputed.
    for (index, &length) in lengths.iter().enumerate() {
        let copies: Vec<_> = outputs.iter().skip(index).step_by(lengths.len()).collect();
        assert!(copies.iter().all(|copy| *copy == copies[0]), "copies of the {length}-token prompt differ");
    }
    let preemptions = metric(&worker.admin_url(), "turbine_worker_preemptions_total").await;
    let cached = metric(&worker.admin_url(), "turbine_worker_cached_prompt_tokens_total").await;
    assert!(cached > 0.0, "copies of a prompt shared no cached blocks");
    assert!(preemptions > 0.0, "the pool was never short: the burst did not exercise preemption");

    let peak = peak_rss(worker.pid());
    let budget = model_bytes + (kv_cache_mib << 20) + (300 << 20);
    eprintln!("peak RSS {} MiB, budget {} MiB (model {} MiB); {preemptions} preemptions", peak >> 20, budget >> 20, model_bytes >> 20);
    assert!(peak <= budget, "peak RSS {} MiB exceeds model + KV pool + 300 MiB = {} MiB", peak >> 20, budget >> 20);
}

/// `--host-cache-mib`: prompts pushed out of a small pool come back from
/// host memory, with the tokens they had when computed, and the tier's
/// metrics say so.
#[tokio::test]
async fn prompts_evicted_from_the_pool_come_back_from_the_host_tier() {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    // 4 MiB of pool: 11 blocks of 16 tokens (360 KiB each); 64 MiB of host tier.
    let worker = native_worker(&["--kv-cache-mib", "4", "--host-cache-mib", "64"]).await;
    let client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = ["Bees visit flowers and carry pollen between them. ", "Glaciers move slowly and carve deep valleys. "]
        .iter()
        .map(|text| tokens.encode_text(&text.repeat(20)).unwrap()[..128].to_vec())
        .collect();
    let admin = worker.admin_url();
    let mut computed = Vec::new();
    // Each prompt's 8 blocks are copied before the next comes: one it
    // evicted before its copy would be skipped, not lost from the test.
    for (n, prompt) in prompts.iter().enumerate() {
        computed.push(generate(client.clone(), greedy(prompt, 8)).await.unwrap().0);
        turbine_testkit::wait_until("copies to the host tier", Duration::from_secs(30), async || {
            metric(&admin, "turbine_worker_kv_tier_offloaded_blocks_total").await >= 8.0 * (n + 1) as f64
                && metric(&admin, "turbine_worker_kv_blocks_used").await == 0.0
        })
        .await;
    }
    // The second prompt took most of the pool: the first prompt's tail
    // blocks left it (evicted first) and come back from the host tier.
    let cached_before = metric(&admin, "turbine_worker_cached_prompt_tokens_total").await;
    let (again, _) = generate(client.clone(), greedy(&prompts[0], 8)).await.unwrap();
    assert_eq!(again, computed[0], "onboarded blocks give the computed tokens");
    // Of its 8 full blocks, 7 can be hits (the last token is always
    // computed); those that left the pool (at least 5) are onboarded.
    let onboarded = metric(&admin, "turbine_worker_kv_tier_onboarded_blocks_total").await;
    assert!(onboarded >= 5.0, "the first prompt's evicted blocks were onboarded ({onboarded})");
    assert!(metric(&admin, "turbine_worker_onboarded_prompt_tokens_total").await >= 80.0);
    let cached = metric(&admin, "turbine_worker_cached_prompt_tokens_total").await - cached_before;
    assert!(cached >= 112.0, "the whole prompt was a hit, pool and host tier together ({cached} tokens)");
    assert!(metric(&admin, "turbine_worker_kv_tier_bytes").await <= 64.0 * 1024.0 * 1024.0);
    assert_eq!(metric(&admin, "turbine_worker_kv_tier_corrupt_blocks_total").await, 0.0);
}

/// Tenant b's prompt, `b_len` tokens of the real model, and tenant a's
/// flood: `floods` prompts of `a_len` tokens, each its own text.
fn b_and_as_flood(b_len: usize, a_len: usize, floods: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap()).unwrap();
    let prompt = |text: &str, len: usize| tokens.encode_text(&text.repeat(20)).unwrap()[..len].to_vec();
    let flood = [
        "Wheat grows tall in the summer sun. ",
        "Trains leave the station on the hour. ",
        "Snow falls softly on the quiet hills. ",
        "Kites rise over the beach in the wind. ",
        "Clocks tick in the empty hall. ",
        "Rain drums on the tin roof. ",
    ];
    (prompt("Lighthouses guide ships past the rocks at night. ", b_len), flood[..floods].iter().map(|text| prompt(text, a_len)).collect())
}

/// `prompt`, greedy for 4 tokens, as `tenant` (the shared namespace for
/// none).
fn as_tenant(prompt: &[u32], tenant: Option<&str>) -> pb::GenerateRequest {
    pb::GenerateRequest { kv_tenant: tenant.map_or(0, |tenant| turbine_kv::KvTenant::of(&[tenant]).get()), ..greedy(prompt, 4) }
}

/// Tenants' fair shares of the host tier, on the real model: tenant a's
/// flood of prompts, five times the tier, evicts a's own blocks, and
/// tenant b's prompt, under its share, comes back from host memory whole.
/// The same requests in the shared namespace (no tenants) lose b's prompt
/// to least recently used.
#[tokio::test]
async fn a_flooding_tenant_leaves_anothers_prompt_in_the_host_tier() {
    let (b, flood) = b_and_as_flood(128, 128, 5);
    // Per run: b's repeat's blocks onboarded from the host tier, and the
    // blocks it evicted for fairness.
    let run = async |tenants: bool| {
        // A pool of 11 blocks of 16 tokens (360 KiB each), a host tier of 22:
        // b's 8 blocks are under its share (11), a's 40 far over it.
        let worker = native_worker(&["--kv-cache-mib", "4", "--host-cache-mib", "8"]).await;
        let client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();
        let admin = worker.admin_url();
        // Each prompt's 8 blocks are copied before the next prompt comes:
        // a block the next one evicts before its copy is skipped (copies
        // that fall behind are, by design), and a loaded machine could
        // then lose b's blocks or never count 48.
        let copied = async |prompts: usize| {
            turbine_testkit::wait_until("copies to the host tier", Duration::from_secs(30), async || {
                metric(&admin, "turbine_worker_kv_tier_offloaded_blocks_total").await >= 8.0 * prompts as f64
                    && metric(&admin, "turbine_worker_kv_blocks_used").await == 0.0
            })
            .await;
        };
        let computed = generate(client.clone(), as_tenant(&b, tenants.then_some("b"))).await.unwrap().0;
        copied(1).await;
        for (n, prompt) in flood.iter().enumerate() {
            generate(client.clone(), as_tenant(prompt, tenants.then_some("a"))).await.unwrap();
            copied(n + 2).await;
        }
        assert_eq!(metric(&admin, "turbine_worker_kv_tier_offloads_skipped_total").await, 0.0, "every block was copied");
        let (again, _) = generate(client.clone(), as_tenant(&b, tenants.then_some("b"))).await.unwrap();
        assert_eq!(again, computed, "b's repeat gives the computed tokens");
        assert!(metric(&admin, "turbine_worker_kv_tier_bytes").await <= 8.0 * 1024.0 * 1024.0);
        let onboarded = metric_where(&admin, "turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "host")]).await;
        (onboarded, metric_where(&admin, "turbine_worker_kv_tier_fair_share_evictions_total", &[("tier", "host")]).await)
    };
    let (onboarded, fair) = run(true).await;
    // Of b's 8 full blocks, 7 can be hits (its last token is computed).
    assert!(onboarded >= 7.0, "b's prompt came back from the host tier whole ({onboarded} blocks)");
    assert!(fair >= 20.0, "a's flood evicted a's own blocks ({fair})");
    let (onboarded, fair) = run(false).await;
    assert_eq!((onboarded, fair), (0.0, 0.0), "without tenants the flood took b's prompt");
}

/// Tenants' fair shares of the pool itself, on the real model with no tier
/// below it: tenant a's prompts, each finished before the next, evict a's
/// own cached blocks, and tenant b's prompt, under its share, is still a
/// prefix hit after them. In the shared namespace least recently released
/// takes it.
#[tokio::test]
async fn a_flooding_tenant_leaves_anothers_prefix_in_the_pool() {
    let (b, flood) = b_and_as_flood(64, 48, 6);
    // Per run: the tokens of b's repeat served from the pool, and the
    // blocks the pool evicted for fairness.
    let run = async |tenants: bool| {
        // 11 blocks of 16 tokens: b's 4 are under its share, a's six prompts
        // of 4 blocks each far over it.
        let worker = native_worker(&["--kv-cache-mib", "4"]).await;
        let client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();
        let admin = worker.admin_url();
        let computed = generate(client.clone(), as_tenant(&b, tenants.then_some("b"))).await.unwrap().0;
        for prompt in &flood {
            generate(client.clone(), as_tenant(prompt, tenants.then_some("a"))).await.unwrap();
        }
        let before = metric(&admin, "turbine_worker_cached_prompt_tokens_total").await;
        let (again, _) = generate(client.clone(), as_tenant(&b, tenants.then_some("b"))).await.unwrap();
        assert_eq!(again, computed, "b's repeat gives the computed tokens");
        let cached = metric(&admin, "turbine_worker_cached_prompt_tokens_total").await - before;
        (cached, metric(&admin, "turbine_worker_kv_pool_fair_share_evictions_total").await)
    };
    let (cached, fair) = run(true).await;
    // Of b's 4 full blocks, 3 can be hits (its last token is computed).
    assert_eq!(cached, 48.0, "b's prefix was still in the pool");
    assert!(fair >= 8.0, "a's prompts evicted a's own blocks ({fair})");
    let (cached, fair) = run(false).await;
    assert_eq!((cached, fair), (0.0, 0.0), "without tenants a's prompts took b's prefix");
}

/// `--disk-cache-dir`: with a host tier of two blocks, a prompt pushed
/// out of the pool comes back from disk with its computed tokens, and
/// again after the worker restarts (same id, same directory).
#[tokio::test]
async fn prompts_come_back_from_the_disk_tier_and_it_survives_a_restart() {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dir_arg = dir.path().to_str().unwrap().to_owned();
    // Always read: this is about the disk's blocks, not whether reading them pays.
    let flags = ["--kv-cache-mib", "4", "--host-cache-mib", "1", "--disk-cache-dir", &dir_arg, "--worker-id", "disk-test", "--kv-fetch", "always"];
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = ["Owls hunt at night and sleep through the day. ", "Ferries cross the harbour every half hour. "]
        .iter()
        .map(|text| tokens.encode_text(&text.repeat(20)).unwrap()[..128].to_vec())
        .collect();

    let worker = native_worker(&flags).await;
    let client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();
    let mut computed = Vec::new();
    for prompt in &prompts {
        computed.push(generate(client.clone(), greedy(prompt, 8)).await.unwrap().0);
    }
    let admin = worker.admin_url();
    let on_disk = async || metric_where(&admin, "turbine_worker_kv_tier_offloaded_blocks_total", &[("tier", "disk")]).await;
    turbine_testkit::wait_until("writes to the disk tier", Duration::from_secs(30), async || on_disk().await >= 10.0).await;
    let (again, _) = generate(client.clone(), greedy(&prompts[0], 8)).await.unwrap();
    assert_eq!(again, computed[0], "blocks read back from disk give the computed tokens");
    let from_disk = metric_where(&admin, "turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "disk")]).await;
    assert!(from_disk >= 4.0, "the first prompt's evicted blocks came from disk ({from_disk})");
    let read = metric_where(&admin, "turbine_worker_kv_fetch_decisions_total", &[("tier", "disk"), ("decision", "fetch")]).await;
    assert!(read >= 1.0, "the decision to read the disk is counted ({read})");
    worker.terminate();
    let mut worker = worker;
    assert!(worker.wait(Duration::from_secs(60)).is_some_and(|status| status.success()), "the worker stops on SIGTERM");
    drop(worker);

    let worker = native_worker(&flags).await;
    let client = WorkerClient::connect(worker.grpc_endpoint()).await.unwrap();
    let (after_restart, _) = generate(client.clone(), greedy(&prompts[1], 8)).await.unwrap();
    assert_eq!(after_restart, computed[1], "blocks kept on disk across a restart give the computed tokens");
    let admin = worker.admin_url();
    let from_disk = metric_where(&admin, "turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "disk")]).await;
    assert!(from_disk >= 4.0, "the restarted worker read its blocks from disk ({from_disk})");
    assert_eq!(metric_where(&admin, "turbine_worker_kv_tier_corrupt_blocks_total", &[("tier", "disk")]).await, 0.0);
}

/// A kv-store served in this process on a loopback port: its endpoint, its
/// blocks, and the token that stops it.
async fn kv_store() -> (String, turbine_kv_store::Store, turbine_runtime::CancellationToken) {
    let listeners = turbine_runtime::host::Listeners::loopback().await.unwrap();
    let endpoint = format!("http://{}", listeners.grpc.local_addr().unwrap());
    let store = turbine_kv_store::Store::new(256 << 20);
    let shutdown = turbine_runtime::CancellationToken::new();
    tokio::spawn(turbine_kv_store::serve(
        turbine_kv_store::KvStoreConfig::default(),
        store.clone(),
        turbine_kv_store::StoreEventSink::None,
        listeners,
        shutdown.clone(),
    ));
    (endpoint, store, shutdown)
}

/// `--kv-store`: a prompt computed on one worker is onboarded by another
/// from the kv-store with the same greedy tokens; with the store down, a
/// third worker computes it, same tokens, nothing failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_computed_on_one_worker_is_onboarded_by_another_from_the_kv_store() {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    let (endpoint, store, shutdown) = kv_store().await;
    let flags = |id: &'static str| -> Vec<String> {
        ["--kv-cache-mib", "16", "--host-cache-mib", "64", "--kv-store", &endpoint, "--kv-store-timeout-ms", "10000", "--worker-id", id]
            .iter()
            .map(|flag| flag.to_string())
            .collect()
    };
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap()).unwrap();
    // 16 blocks of 16 tokens.
    let prompt = tokens.encode_text(&"Lighthouses guide ships past rocks along the coast at night. ".repeat(30)).unwrap()[..256].to_vec();

    let first = native_worker(&flags("store-a").iter().map(String::as_str).collect::<Vec<_>>()).await;
    let client = WorkerClient::connect(first.grpc_endpoint()).await.unwrap();
    let (computed, _) = generate(client, greedy(&prompt, 8)).await.unwrap();
    turbine_testkit::wait_until("blocks put to the kv-store", Duration::from_secs(30), async || store.stats().put_blocks >= 15).await;
    let put = metric_where(&first.admin_url(), "turbine_worker_kv_tier_offloaded_blocks_total", &[("tier", "remote")]).await;
    assert!(put >= 15.0, "the worker counts its puts ({put})");
    drop(first);

    let second = native_worker(&flags("store-b").iter().map(String::as_str).collect::<Vec<_>>()).await;
    let client = WorkerClient::connect(second.grpc_endpoint()).await.unwrap();
    let (onboarded, _) = generate(client, greedy(&prompt, 8)).await.unwrap();
    assert_eq!(onboarded, computed, "blocks from the kv-store give the computed tokens");
    let admin = second.admin_url();
    let from_store = metric_where(&admin, "turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "remote")]).await;
    assert!(from_store >= 14.0, "the prompt's blocks came from the kv-store ({from_store})");
    assert!(metric(&admin, "turbine_worker_cached_prompt_tokens_total").await >= 224.0);
    let read = metric_where(&admin, "turbine_worker_kv_tier_read_bytes_total", &[("tier", "remote")]).await;
    assert!(read >= 14.0 * 16.0 * 22.5 * 1024.0, "the fetched bytes are counted ({read})");
    assert!(metric_where(&admin, "turbine_worker_kv_tier_read_seconds_total", &[("tier", "remote")]).await > 0.0);
    // The fetch-or-recompute decision read the store (never measured yet)
    // and measured it.
    let fetched = metric_where(&admin, "turbine_worker_kv_fetch_decisions_total", &[("tier", "remote"), ("decision", "fetch")]).await;
    assert!(fetched >= 1.0, "the decision to read the store is counted ({fetched})");
    let per_block = metric_where(&admin, "turbine_worker_kv_fetch_block_seconds", &[("tier", "remote")]).await;
    let fixed = metric_where(&admin, "turbine_worker_kv_fetch_fixed_seconds", &[("tier", "remote")]).await;
    assert!(per_block > 0.0 || fixed > 0.0, "the store's read time is measured ({per_block} s a block, {fixed} s fixed)");
    assert!(metric(&admin, "turbine_worker_prefill_token_seconds").await > 0.0, "compute is measured");
    drop(second);

    shutdown.cancel();
    let third = native_worker(&flags("store-c").iter().map(String::as_str).collect::<Vec<_>>()).await;
    let client = WorkerClient::connect(third.grpc_endpoint()).await.unwrap();
    let (recomputed, _) = generate(client, greedy(&prompt, 8)).await.expect("a store that is down never fails a request");
    assert_eq!(recomputed, computed);
    assert_eq!(metric_where(&third.admin_url(), "turbine_worker_kv_tier_onboarded_blocks_total", &[("tier", "remote")]).await, 0.0);
    assert!(metric_where(&third.admin_url(), "turbine_worker_kv_tier_failures_total", &[("tier", "remote")]).await >= 1.0, "the failed fetch is counted");
}

#[test]
fn a_device_this_build_cannot_use_is_refused_at_startup() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
    command.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--engine", "native", "--device", "cuda"]);
    let mut worker = ChildProcess::spawn("turbine-worker", command);
    let status = worker.wait(Duration::from_secs(60)).expect("exits");
    assert!(!status.success());
    let output = worker.output().join("\n");
    assert!(!output.contains("panicked"), "{output}");
    assert!(output.contains("CUDA"), "the error names the problem: {output}");
}

#[test]
fn a_hugging_face_directory_is_refused_by_the_native_engine_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
    for engine in ["native", "mock"] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
        command.args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--engine", engine, "--model"]).arg(dir.path());
        let mut worker = ChildProcess::spawn("turbine-worker", command);
        let status = worker.wait(Duration::from_secs(60)).expect("exits");
        assert!(!status.success());
        let output = worker.output().join("\n");
        assert!(!output.contains("panicked"), "{output}");
        assert!(output.contains("Hugging Face model directory") && output.contains("--engine external"), "{engine}: {output}");
    }
}

#[tokio::test]
async fn a_handles_blocks_are_read_and_released_only_with_its_token() {
    // The attack: with a handle id alone, ReadBlocks returned another
    // request's KV and Describe the pool's UCX key.
    let worker = native_worker(&["--role", "prefill"]).await;
    let endpoint = worker.grpc_endpoint();
    let mut client = WorkerClient::connect(endpoint.clone()).await.unwrap().with_message_limits();
    let generate = greedy(&(0..96).map(|i| 300 + i).collect::<Vec<u32>>(), 8);
    let prefill = pb::PrefillRequest {
        request_id: "victim".into(),
        prompt_token_ids: generate.prompt_token_ids,
        sampling: generate.sampling,
        stop: generate.stop,
        lease_ms: 0,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    };
    let handle = client.prefill(prefill).await.unwrap().into_inner().handle.expect("a handle on the prompt's blocks");
    assert_eq!(handle.token.len(), 16);
    let mut transfer = KvTransferClient::connect(endpoint).await.unwrap().with_message_limits();
    let read = |token: Vec<u8>| pb::ReadBlocksRequest { handle_id: handle.handle_id, indices: vec![], token };
    let read_all = |mut transfer: KvTransferClient<tonic::transport::Channel>, request: pb::ReadBlocksRequest| async move {
        let mut stream = transfer.read_blocks(request).await?.into_inner();
        let mut blocks = Vec::new();
        while let Some(block) = stream.message().await? {
            blocks.push(block.data);
        }
        Ok::<_, tonic::Status>(blocks)
    };

    // No token, a token of the wrong length, another token: refused, and
    // a wrong token reads exactly as a handle that does not exist.
    let missing = read_all(transfer.clone(), read(vec![])).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::InvalidArgument, "{missing:?}");
    let forged = read_all(transfer.clone(), read(vec![0; 16])).await.unwrap_err();
    assert_eq!(forged.code(), tonic::Code::NotFound, "{forged:?}");
    let unknown = read_all(transfer.clone(), pb::ReadBlocksRequest { handle_id: handle.handle_id ^ 1, indices: vec![], token: vec![0; 16] }).await.unwrap_err();
    assert_eq!(forged.message().replace(&handle.handle_id.to_string(), "ID"), unknown.message().replace(&(handle.handle_id ^ 1).to_string(), "ID"));
    let described = transfer.describe(pb::DescribeRequest { handle_id: handle.handle_id, token: vec![7; 16] }).await.unwrap_err();
    assert_eq!(described.code(), tonic::Code::NotFound, "{described:?}");
    let released = transfer.release(pb::ReleaseRequest { handle_id: handle.handle_id, token: vec![7; 16] }).await.unwrap().into_inner();
    assert!(!released.released, "a forged release frees nothing");

    // Naming the handle with another token call after call on one
    // connection loses it (the handler's refusals strike it, as the role
    // check's do): a call fails in transport, not with an answer.
    let mut cut = None;
    for call in 0..4 * turbine_runtime::strikes::STRIKES_BURST as usize {
        let refused = transfer.describe(pb::DescribeRequest { handle_id: handle.handle_id, token: vec![9; 16] }).await.unwrap_err();
        if refused.code() != tonic::Code::NotFound {
            cut = Some(call);
            break;
        }
    }
    let flooded = cut.expect("a connection naming a handle with another token call after call is closed") + 1;
    let admin = worker.admin_url();
    assert!(metric_where(&admin, "turbine_grpc_connections_struck_off_total", &[]).await >= 1.0);

    // The holder of the token (connecting again) reads every block,
    // intact, and releases.
    let blocks = read_all(transfer.clone(), read(handle.token.clone())).await.expect("the handle's own token reads its blocks");
    assert_eq!(blocks.len(), handle.blocks.len());
    for (block, reference) in blocks.iter().zip(&handle.blocks) {
        assert_eq!(turbine_kv::block_checksum(block), reference.checksum);
    }
    transfer.describe(pb::DescribeRequest { handle_id: handle.handle_id, token: handle.token.clone() }).await.expect("described with its token");
    let released = transfer.release(pb::ReleaseRequest { handle_id: handle.handle_id, token: handle.token.clone() }).await.unwrap().into_inner();
    assert!(released.released);
    for (method, forged) in [("ReadBlocks", 1), ("Describe", 1 + flooded), ("Release", 1)] {
        let path = format!("/turbine.worker.v1.KvTransfer/{method}");
        let refused = metric_where(&admin, "turbine_rpc_refused_total", &[("method", &path), ("reason", "bad_capability")]).await;
        assert_eq!(refused, forged as f64, "{method}'s forged calls are counted");
    }
    drop(worker);
}

/// What `worker` listens on besides its gRPC and admin ports.
fn other_listeners(worker: &ServiceProcess) -> Vec<std::net::SocketAddr> {
    let own = worker.addresses();
    let listening = listening_sockets(worker.pid()).unwrap();
    listening.into_iter().filter(|address| Some(*address) != Some(own.grpc) && Some(*address) != own.admin).collect()
}

#[tokio::test]
async fn ucx_listens_no_further_than_the_workers_grpc() {
    // UCX authenticates no one (over TCP a peer may read and write any
    // address of the process), and it listened on every interface even
    // when the worker served gRPC on loopback only.
    let worker = native_worker(&["--role", "prefill"]).await;
    let ucx = other_listeners(&worker);
    assert!(ucx.iter().all(|address| address.ip().is_loopback()), "a plaintext worker on loopback: UCX on loopback only, got {ucx:?}");
    if cfg!(feature = "ucx") {
        assert!(!ucx.is_empty(), "UCX serves the pool to same-machine readers on loopback");
    }
    drop(worker);

    // With certificates UCX uses no network device unless told which:
    // nothing listens but the worker's own ports.
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ucx");
    ca.issue(Role::Operator, "test").write(dir.path(), "operator").establish().unwrap().expect("this process is an operator");
    let tls = ca.issue(Role::Worker, "prefill-0").write(dir.path(), "worker");
    let show = |path: &Option<std::path::PathBuf>| path.as_deref().unwrap().display().to_string();
    let (cert, key, ca_file) = (show(&tls.tls_cert), show(&tls.tls_key), show(&tls.tls_ca));
    let flags = ["--role", "prefill", "--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca_file];
    let worker = native_worker(&flags).await;
    assert_eq!(other_listeners(&worker), vec![], "under TLS UCX listens nowhere");
    drop(worker);

    // The operator names the fabric UCX may use.
    let worker = native_worker(&[&flags[..], &["--kv-ucx-devices", "lo"]].concat()).await;
    let ucx = other_listeners(&worker);
    assert!(ucx.iter().all(|address| address.ip().is_loopback()), "only the named device: {ucx:?}");
    if cfg!(feature = "ucx") {
        assert!(!ucx.is_empty(), "UCX on the named device");
    }
}

/// A worker of `role` under TLS (`stem`'s certificate of `ca`, written to
/// `dir`) whose UCX may use loopback (a fabric the operator names), over
/// UCX's network transports only (no shared memory: `UCX_TLS`).
#[cfg(feature = "ucx")]
async fn fabric_worker(dir: &std::path::Path, ca: &TestCa, role: &str, id: &str) -> ServiceProcess {
    let tls = ca.issue(Role::Worker, id).write(dir, id);
    let show = |path: &Option<std::path::PathBuf>| path.as_deref().unwrap().display().to_string();
    let (cert, key, ca_file) = (show(&tls.tls_cert), show(&tls.tls_key), show(&tls.tls_ca));
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine-worker"));
    command.args(["--engine", "native", "--model", MODEL, "--threads", "2", "--role", role, "--worker-id", id, "--kv-transport", "ucx"]);
    command.args(["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca_file, "--kv-ucx-devices", "lo"]).env("UCX_TLS", "tcp,self");
    let mut process = ServiceProcess::spawn("turbine-worker", command, false).await.unwrap();
    process.until_serving(Role::Worker, "turbine.worker.v1.Worker", STARTUP_TIMEOUT).await.unwrap();
    process
}

/// On a fabric the operator names under TLS (RDMA, where UCX checks remote
/// keys), a handle's holder learned the key of the prefill worker's whole
/// pool from `Describe`: every block of every request, and for as long as
/// the worker ran. Now each handle's blocks are registered for it alone
/// and unregistered at its release: `Describe` gives keys of those runs
/// only, a decode worker reads through them over UCX's network, and the
/// registrations go with the handles. (Over TCP, as here, UCX checks no
/// key: the test proves what is given out and revoked, and that reads
/// work through it.)
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_fabric_named_under_tls_a_handle_is_keyed_for_its_blocks_alone() {
    use turbine_runtime::grpc::tls_channel;
    use turbine_testkit::wait_until;

    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("fabric");
    ca.issue(Role::Operator, "test").write(dir.path(), "operator").establish().unwrap().expect("this process is an operator");
    let prefill = fabric_worker(dir.path(), &ca, "prefill", "prefill-0").await;
    let decode = fabric_worker(dir.path(), &ca, "decode", "decode-0").await;
    let gateway = ca.trust(Role::Gateway, "gateway-0");
    let as_decode = ca.trust(Role::Worker, "decode-1");
    let mut to_prefill = WorkerClient::new(tls_channel(&prefill.grpc_endpoint(), &gateway, Role::Worker).unwrap()).with_message_limits();
    let mut transfer = KvTransferClient::new(tls_channel(&prefill.grpc_endpoint(), &as_decode, Role::Worker).unwrap()).with_message_limits();
    let to_decode = WorkerClient::new(tls_channel(&decode.grpc_endpoint(), &gateway, Role::Worker).unwrap()).with_message_limits();
    let prefill_of = |request: &pb::GenerateRequest| pb::PrefillRequest {
        request_id: request.request_id.clone(),
        prompt_token_ids: request.prompt_token_ids.clone(),
        sampling: request.sampling.clone(),
        stop: request.stop.clone(),
        lease_ms: 0,
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    };
    let first = greedy(&(0..96).map(|i| 300 + i).collect::<Vec<u32>>(), 8);
    let second = greedy(&(0..64).map(|i| 900 + i).collect::<Vec<u32>>(), 8);
    let a = to_prefill.prefill(prefill_of(&first)).await.unwrap().into_inner();
    let b = to_prefill.prefill(prefill_of(&second)).await.unwrap().into_inner();
    let (handle_a, handle_b) = (a.handle.clone().expect("a handle on the first prompt"), b.handle.clone().expect("a handle on the second"));
    let describe = |handle: &pb::KvHandle| pb::DescribeRequest { handle_id: handle.handle_id, token: handle.token.clone() };
    let described = transfer.describe(describe(&handle_a)).await.unwrap().into_inner();
    let block_bytes = described.layout.as_ref().unwrap().block_bytes;
    let region = described.ucx.expect("the prefill worker serves UCX on the named device");
    assert!(region.remote_key.is_empty(), "the whole pool's key is given to no one");
    let covered: u64 = region.range_keys.iter().map(|range| range.length).sum();
    assert_eq!(covered, handle_a.blocks.len() as u64 * block_bytes, "the keys cover the handle's blocks and nothing more");
    let inside = |offset: u64| region.range_keys.iter().any(|range| offset >= range.offset && offset + block_bytes <= range.offset + range.length);
    assert!(handle_a.blocks.iter().all(|block| inside(block.offset)), "every block of the handle is under a key");
    assert!(handle_b.blocks.iter().all(|block| !inside(block.offset)), "no block of another handle is");
    let prefill_admin = prefill.admin_url();
    let keys_b = transfer.describe(describe(&handle_b)).await.unwrap().into_inner().ucx.unwrap().range_keys.len();
    let registered = metric(&prefill_admin, "turbine_worker_kv_ucx_handle_keys").await as usize;
    assert_eq!(registered, region.range_keys.len() + keys_b, "one registration per run of each live handle");

    // The decode worker reads the first handle over UCX's network through
    // its keys and releases it; its text is the text computed locally.
    let remote = pb::GenerateRequest {
        remote_prefill: Some(pb::RemotePrefill { handle: Some(handle_a.clone()), generated_token_ids: a.first.unwrap().token_ids }),
        ..first.clone()
    };
    let stream = async |mut client: WorkerClient<turbine_runtime::grpc::TracedChannel>, request: pb::GenerateRequest| {
        let mut stream = client.generate(request).await.unwrap().into_inner();
        let mut tokens: Vec<u32> = Vec::new();
        let ended = async {
            while let Some(message) = stream.message().await.unwrap() {
                tokens.extend(&message.token_ids);
            }
        };
        tokio::time::timeout(Duration::from_secs(240), ended).await.expect("a request finishes within 240 s");
        tokens
    };
    let handed_over = stream(to_decode.clone(), remote).await;
    assert_eq!(handed_over.len(), 7, "the tokens after the prefill's first");
    let decode_admin = decode.admin_url();
    let imported = metric_where(&decode_admin, "turbine_worker_kv_imports_total", &[("transport", "ucx"), ("outcome", "ok")]).await;
    assert_eq!(imported, 1.0, "the blocks came over UCX");
    let gets = metric_where(&decode_admin, "turbine_worker_kv_ucx_reads_total", &[("path", "get")]).await;
    assert_eq!(gets, 1.0, "read with gets over the network, not mapped");
    let keys = async |wanted: usize| metric(&prefill_admin, "turbine_worker_kv_ucx_handle_keys").await == wanted as f64;
    wait_until("the first handle's keys revoked", Duration::from_secs(10), async || keys(keys_b).await).await;
    let gone = transfer.describe(describe(&handle_a)).await.unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
    let released = transfer.release(pb::ReleaseRequest { handle_id: handle_b.handle_id, token: handle_b.token.clone() }).await.unwrap().into_inner();
    assert!(released.released);
    wait_until("every key revoked", Duration::from_secs(10), async || keys(0).await).await;
    // The first prompt once more, computed by the decode worker itself
    // (another cache salt: none of the blocks it took in): the same tokens.
    let computed = stream(to_decode, pb::GenerateRequest { request_id: "computed".into(), cache_salt: 7, ..first }).await;
    assert_eq!(computed[1..], handed_over[..], "the same tokens after the first");
    drop((decode, prefill));
}

/// The kv-store drops a key two writers disagree on. Two workers computing
/// one prefix, one alone and one in a batch of four, must agree on every
/// block's bytes, or the store would purge prefixes it should share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_computing_one_prefix_alone_and_batched_put_the_same_bytes() {
    let model = resolve_model(MODEL, None, &default_cache_dir(), Progress::Quiet).unwrap();
    let (endpoint, store, shutdown) = kv_store().await;
    let flags = |id: &'static str| -> Vec<String> {
        ["--kv-cache-mib", "32", "--host-cache-mib", "64", "--kv-store", &endpoint, "--kv-fetch", "never", "--worker-id", id]
            .iter()
            .map(|flag| flag.to_string())
            .collect()
    };
    let tokens = Preprocessor::new(ModelCard::from_gguf_path(MODEL, &model.path, 16).unwrap()).unwrap();
    let text = |topic: &str| tokens.encode_text(&format!("{topic} guide ships past rocks along the coast at night. ").repeat(30)).unwrap()[..256].to_vec();
    let prompt = text("Lighthouses");

    let first = native_worker(&flags("alone").iter().map(String::as_str).collect::<Vec<_>>()).await;
    let (alone, _) = generate(WorkerClient::connect(first.grpc_endpoint()).await.unwrap(), greedy(&prompt, 4)).await.unwrap();
    turbine_testkit::wait_until("the first worker's blocks in the store", Duration::from_secs(30), async || store.stats().put_blocks >= 15).await;
    let held = store.stats().memory.blocks;
    drop(first);

    let second = native_worker(&flags("batched").iter().map(String::as_str).collect::<Vec<_>>()).await;
    let client = WorkerClient::connect(second.grpc_endpoint()).await.unwrap();
    let others = ["Harbors", "Beacons", "Tugboats"].map(text);
    let batch = futures::future::join_all(std::iter::once(&prompt).chain(others.iter()).map(|prompt| generate(client.clone(), greedy(prompt, 4)))).await;
    assert_eq!(batch[0].as_ref().unwrap().0, alone, "the same tokens alone and batched");
    let admin = second.admin_url();
    turbine_testkit::wait_until("the batch's blocks offered to the store", Duration::from_secs(30), async || {
        metric_where(&admin, "turbine_worker_kv_tier_offloaded_blocks_total", &[("tier", "remote")]).await >= 60.0
    })
    .await;
    // Counters of this process's store (each appears with its first).
    let counted = |name: &str| {
        turbine_runtime::metrics::render()
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ').map(|value| value.parse::<f64>().unwrap()))
            .unwrap_or(0.0)
    };
    // The shared prefix's 16 blocks put again, each agreeing with the held
    // one or conflicting with it; the others' 48 beside them.
    turbine_testkit::wait_until("the shared prefix put again", Duration::from_secs(30), async || {
        counted("turbine_kv_store_agreeing_blocks_total") + counted("turbine_kv_store_conflicting_blocks_total") >= 16.0
    })
    .await;
    turbine_testkit::wait_until("the batch's blocks in the store", Duration::from_secs(30), async || store.stats().memory.blocks >= held + 3 * 16).await;
    let conflicts = counted("turbine_kv_store_conflicting_blocks_total");
    let after = store.stats().memory.blocks;
    eprintln!("held after the first worker: {held}; after the batch: {after}; conflicting puts: {conflicts}");
    assert_eq!(conflicts, 0.0, "the batched worker's blocks of the shared prefix equal the first worker's");
    assert_eq!(after, held + 3 * 16, "every block of the shared prefix is still held, beside the batch's others");
    drop(second);
    shutdown.cancel();
}
