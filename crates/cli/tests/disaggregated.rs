//! Disaggregated serving across processes: a prefill `turbine-worker`, a
//! decode `turbine-worker`, `turbine-router` (kv policy, following the
//! workers' KV events in a real Redis) and `turbine-gateway`, on free ports,
//! the real model computing every token.
//!
//! - Greedy outputs of prompts of 100–2,000 tokens (six over UCX when
//!   built with it, four to 1,200 over the TCP stream; prefixes of one another and
//!   unrelated ones) equal those of an aggregated `turbine run`, with the
//!   KV blocks read from the prefill worker; asked again, the prompts hit
//!   the blocks installed on the decode worker and give the same outputs.
//! - The prefill worker killed while a decode worker reads its blocks (a
//!   relay in front of it holds the read mid-stream): every request still
//!   completes with the right text (computed locally).
//! - With certificates on every hop (Redis too), no worker has a UCX
//!   listener and the blocks still move through shared memory, the
//!   handle's token riding the gateway's calls; outputs as aggregated.
//! - A decode worker dead but still listed fails a request only after its
//!   prefill: the gateway continues it on the other decode worker, never
//!   on the dead one again.

mod common;

use std::time::Duration;

use common::{MODEL, metric, post, service, until_listed, until_registered};
use serde_json::json;
use turbine_api::router::{RouteRequest, RouterClient};
use turbine_cluster::sandbox::Sandbox;
use turbine_testkit::{RedisServer, STARTUP_TIMEOUT, ServiceProcess, TcpRelay, metric_where, wait_until};

/// One cluster at a time: each runs two native workers, and on two cores
/// several at once starve each other.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const MAX_TOKENS: u32 = 8;

/// 20 prompts of 100 to 2,000 tokens: the even ones prefixes of one long
/// token sequence (so later ones find part of themselves cached), the odd
/// ones unrelated.
fn prompts() -> Vec<Vec<u32>> {
    let tokens = |seed: u64, len: usize| -> Vec<u32> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                200 + ((state >> 33) % 40_000) as u32
            })
            .collect()
    };
    let base = tokens(7, 2000);
    (0..20)
        .map(|i| {
            let len = 100 + i * 100;
            if i % 2 == 0 { base[..len].to_vec() } else { tokens(100 + i as u64, len) }
        })
        .collect()
}

/// Greedy completion text and cached prompt tokens, or the error body.
async fn try_complete(base: &str, prompt: &[u32]) -> Result<(String, u64), String> {
    let (status, body) =
        post(base, "/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true})).await;
    if status != 200 {
        return Err(format!("{status}: {body}"));
    }
    let text = body["choices"][0]["text"].as_str().unwrap().to_owned();
    Ok((text, body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)))
}

async fn complete(base: &str, prompt: &[u32]) -> (String, u64) {
    try_complete(base, prompt).await.unwrap()
}

/// The outputs of prompts `chosen` from one aggregated worker (the
/// embedded cluster, in this process; each test runs in a process of its
/// own, so each computes only the prompts it uses).
async fn reference(chosen: &[usize]) -> Vec<String> {
    let mut config = Sandbox::native();
    config.worker.engine.threads = Some(2);
    config.worker.engine.kv_cache_mib = 128;
    let sandbox = Sandbox::start(config).await;
    let all = prompts();
    let mut outputs = Vec::new();
    for &i in chosen {
        outputs.push(complete(sandbox.base(), &all[i]).await.0);
    }
    sandbox.stop().await;
    outputs
}

struct Cluster {
    redis: RedisServer,
    prefill: ServiceProcess,
    decode: ServiceProcess,
    _router: ServiceProcess,
    gateway: ServiceProcess,
    base: String,
}

async fn start_worker(redis: &RedisServer, id: &str, role: &str, transport: &str, advertise: Option<&TcpRelay>) -> ServiceProcess {
    start_worker_with(redis, id, role, transport, advertise, &[]).await
}

async fn start_worker_with(redis: &RedisServer, id: &str, role: &str, transport: &str, advertise: Option<&TcpRelay>, extra: &[String]) -> ServiceProcess {
    let url = redis.url();
    let advertised = advertise.map(|relay| format!("http://{}", relay.addr()));
    let mut args = vec![
        // 640 MiB: 1,777 blocks, room for every prompt of the test at once
        // (1,312 blocks), so the second pass can expect hits.
        "--engine",
        "native",
        "--threads",
        "2",
        "--kv-cache-mib",
        "640",
        "--redis",
        &url,
        "--namespace",
        "disagg",
        "--worker-id",
        id,
        "--lease-ttl-secs",
        "2",
        "--role",
        role,
        "--kv-transport",
        transport,
    ];
    if let Some(advertised) = &advertised {
        args.extend(["--advertise", advertised]);
    }
    args.extend(extra.iter().map(String::as_str));
    let worker = service("turbine-worker", &args, &[], false).await;
    if let Some(relay) = advertise {
        relay.set_upstream(worker.addresses().grpc);
    }
    worker
}

async fn start_cluster(transport: &str) -> Cluster {
    start_cluster_with(transport, None).await
}

/// A cluster whose prefill worker, when `relay` is given, is reached
/// through it (it advertises the relay's address).
async fn start_cluster_with(transport: &str, relay: Option<&TcpRelay>) -> Cluster {
    let redis = RedisServer::start();
    let prefill = start_worker(&redis, "prefill-0", "prefill", transport, relay).await;
    let decode = start_worker(&redis, "decode-0", "decode", transport, None).await;
    let url = redis.url();
    let router = service("turbine-router", &["--redis", &url, "--namespace", "disagg", "--policy", "kv", "--disagg-threshold-tokens", "64"], &[], false).await;
    until_registered(&router, 2).await;
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;
    Cluster { redis, prefill, decode, _router: router, gateway, base }
}

/// Free MiB in /dev/shm, where the prefill worker's pool goes.
fn shm_free_mib() -> Option<u64> {
    let output = std::process::Command::new("df").args(["-BM", "--output=avail", "/dev/shm"]).output().ok()?;
    String::from_utf8_lossy(&output.stdout).lines().nth(1)?.trim().trim_end_matches('M').parse().ok()
}

/// Runs `chosen` prompts through a disaggregated cluster reading blocks
/// over `transport`, twice.
async fn outputs_equal_aggregated(transport: &str, chosen: &[usize]) {
    let _one = ONE_CLUSTER.lock().await;
    let expected = reference(chosen).await;
    let cluster = start_cluster(transport).await;
    let all = prompts();
    let prompts: Vec<&Vec<u32>> = chosen.iter().map(|&i| &all[i]).collect();
    for (prompt, expected) in prompts.iter().zip(&expected) {
        let (text, _) = complete(&cluster.base, prompt).await;
        assert_eq!(&text, expected, "prompt of {} tokens, disaggregated over {transport}", prompt.len());
    }
    let decode = &cluster.decode.admin_url();
    let read = metric_where(decode, "turbine_worker_kv_imports_total", &[("transport", transport), ("outcome", "ok")]).await;
    let cached = metric_where(decode, "turbine_worker_kv_imports_total", &[("transport", "cached"), ("outcome", "ok")]).await;
    let fallbacks = metric(decode, "turbine_worker_kv_imports_total").await - read - cached;
    assert_eq!(fallbacks, 0.0, "no prompt fell back to local prefill");
    assert_eq!(read as usize, chosen.len(), "every prompt was read from the prefill worker over {transport}");
    assert!(metric_where(decode, "turbine_worker_kv_import_bytes_total", &[("transport", transport)]).await > 0.0);
    assert_eq!(metric(decode, "turbine_worker_kv_checksum_mismatches_total").await, 0.0);
    if transport == "ucx" {
        // Same machine: the prefill worker's pool is in UCX shared memory
        // and the decode worker copies blocks straight out of it, unless
        // the shared-memory file system is too small for the pool (then
        // gets, also UCX, and the prefill worker says so in its log).
        let mapped = metric_where(decode, "turbine_worker_kv_ucx_reads_total", &[("path", "mapped")]).await;
        match shm_free_mib() {
            Some(free) if free >= 640 + 128 => assert_eq!(mapped as usize, chosen.len(), "every UCX read copied from the mapped pool"),
            free => eprintln!("/dev/shm has {free:?} MiB free: {mapped} of {} reads mapped", chosen.len()),
        }
    }
    // Every handle was released by its decode worker (none left to expire).
    let prefill = cluster.prefill.admin_url();
    wait_until("handles released", Duration::from_secs(5), async || metric(&prefill, "turbine_worker_kv_pinned_handles").await == 0.0).await;
    assert_eq!(metric(&prefill, "turbine_worker_kv_leases_expired_total").await, 0.0);

    // Asked again, every prompt hits the blocks installed on the decode
    // worker (their Stored events reached the router's index, so it keeps
    // the prompts there) and gives the same text.
    for (prompt, expected) in prompts.iter().zip(&expected) {
        let (text, cached) = complete(&cluster.base, prompt).await;
        assert_eq!(&text, expected, "prompt of {} tokens, from installed blocks", prompt.len());
        let full_blocks = (prompt.len() as u64 - 1) / 16 * 16;
        assert!(cached >= full_blocks, "prompt of {} tokens: {cached} cached tokens, {full_blocks} expected", prompt.len());
    }
    drop(cluster.redis);
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_outputs_equal_aggregated_ones_over_ucx() {
    // Short and long, prefixes of one another (even) and unrelated (odd).
    outputs_equal_aggregated("ucx", &[0, 1, 4, 9, 14, 19]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_outputs_equal_aggregated_ones_over_tcp() {
    // A few, to 1,200 tokens (the UCX test has the longest).
    outputs_equal_aggregated("tcp", &[0, 2, 5, 11]).await;
}

/// The `--tls-*` flags of the certificate `turbine certs` wrote under
/// `dir` for `stem` (`router`, `workers/prefill-0`).
#[cfg(feature = "ucx")]
fn tls_flags(dir: &std::path::Path, stem: &str) -> Vec<String> {
    let file = |name: String| dir.join(name).display().to_string();
    vec!["--tls-cert".into(), file(format!("{stem}.crt")), "--tls-key".into(), file(format!("{stem}.key")), "--tls-ca".into(), file("ca.crt".into())]
}

/// What `process` listens on besides its gRPC and admin ports.
#[cfg(feature = "ucx")]
fn other_listeners(process: &ServiceProcess) -> Vec<std::net::SocketAddr> {
    let own = process.addresses();
    let listening = turbine_testkit::listening_sockets(process.pid()).unwrap();
    listening.into_iter().filter(|address| *address != own.grpc && Some(*address) != own.admin).collect()
}

/// With certificates on every hop (Redis over TLS too) the handle's token
/// rides the gateway's mutual-TLS calls, and UCX, which checks no
/// certificate, listens nowhere: the decode worker copies the blocks out
/// of the prefill worker's pool through shared memory (same machine), the
/// outputs equal the aggregated ones.
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_blocks_move_through_shared_memory_with_no_ucx_listener() {
    let _one = ONE_CLUSTER.lock().await;
    let chosen = [4, 9];
    let expected = reference(&chosen).await;
    let dir = tempfile::tempdir().unwrap();
    let certs = std::process::Command::new(turbine_testkit::workspace_binary("turbine"))
        .args(["certs", "--worker", "prefill-0", "--worker", "decode-0", "--redis", "localhost", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(certs.status.success(), "{}", String::from_utf8_lossy(&certs.stderr));
    let file = |name: &str| dir.path().join(name);
    let operator =
        turbine_runtime::trust::TlsConfig { tls_cert: Some(file("operator.crt")), tls_key: Some(file("operator.key")), tls_ca: Some(file("ca.crt")) };
    operator.establish().unwrap().expect("this process is an operator");
    let redis_tls = turbine_testkit::RedisTls {
        cert: file("redis.crt"),
        key: file("redis.key"),
        ca: file("ca.crt"),
        client_cert: file("operator.crt"),
        client_key: file("operator.key"),
    };
    let redis = RedisServer::start_tls(&redis_tls, &[]);
    let url = redis.url();
    let prefill = start_worker_with(&redis, "prefill-0", "prefill", "auto", None, &tls_flags(dir.path(), "workers/prefill-0")).await;
    let decode = start_worker_with(&redis, "decode-0", "decode", "auto", None, &tls_flags(dir.path(), "workers/decode-0")).await;
    let mut router_args: Vec<String> =
        ["--redis", &url, "--namespace", "disagg", "--policy", "kv", "--disagg-threshold-tokens", "64"].iter().map(|arg| arg.to_string()).collect();
    router_args.extend(tls_flags(dir.path(), "router"));
    let router = service("turbine-router", &router_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], false).await;
    until_registered(&router, 2).await;
    let mut gateway_args = vec!["--router".to_owned(), router.grpc_endpoint()];
    gateway_args.extend(tls_flags(dir.path(), "gateway"));
    let gateway = service("turbine-gateway", &gateway_args.iter().map(String::as_str).collect::<Vec<_>>(), &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;

    for process in [&prefill, &decode] {
        assert_eq!(other_listeners(process), vec![], "a worker under TLS has no UCX listener");
    }
    let all = prompts();
    for (&i, expected) in chosen.iter().zip(&expected) {
        let (text, _) = complete(&base, &all[i]).await;
        assert_eq!(&text, expected, "prompt of {} tokens over mutual TLS", all[i].len());
    }
    let admin = decode.admin_url();
    let read = async |transport: &str| metric_where(&admin, "turbine_worker_kv_imports_total", &[("transport", transport), ("outcome", "ok")]).await as usize;
    match shm_free_mib() {
        Some(free) if free >= 640 + 128 => {
            assert_eq!(read("ucx").await, chosen.len(), "every prompt's blocks were read over UCX");
            let mapped = metric_where(&admin, "turbine_worker_kv_ucx_reads_total", &[("path", "mapped")]).await;
            assert_eq!(mapped as usize, chosen.len(), "copied out of the mapped pool");
        }
        free => {
            // The pool stayed on the heap: with no UCX network device the
            // blocks come over KvTransfer/ReadBlocks (mutual TLS).
            eprintln!("/dev/shm has {free:?} MiB free: the pool is on the heap");
            assert_eq!(read("ucx").await + read("tcp").await, chosen.len(), "every prompt's blocks were read from the prefill worker");
        }
    }
    let prefill_admin = prefill.admin_url();
    wait_until("handles released", Duration::from_secs(5), async || metric(&prefill_admin, "turbine_worker_kv_pinned_handles").await == 0.0).await;
    let refused = metric(&prefill_admin, "turbine_rpc_refused_total").await;
    assert_eq!(refused, 0.0, "no call of the deployment's own was refused");
    drop((gateway, router, decode, prefill, redis));
}

/// The prefill worker is SIGKILLed while the decode worker reads its
/// blocks: a relay in front of the prefill worker holds a read mid-stream,
/// so the moment is certain rather than polled for. Every request (one read
/// whole before, the one being read, one beside it) completes with the
/// right text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_prefill_worker_mid_transfer_loses_no_request() {
    let _one = ONE_CLUSTER.lock().await;
    let prompts = prompts();
    // 600, 800 and 1,000 tokens, unrelated: each read whole from the
    // prefill worker (13-23 MiB of blocks).
    let chosen = [5, 7, 9];
    let expected = reference(&chosen).await;
    let relay = TcpRelay::start().await.unwrap();
    let mut cluster = start_cluster_with("tcp", Some(&relay)).await;
    let decode = cluster.decode.admin_url();

    let (text, _) = complete(&cluster.base, &prompts[chosen[0]]).await;
    assert_eq!(text, expected[0], "prompt of {} tokens, before the kill", prompts[chosen[0]].len());
    // From now on, the first connection to carry 1 MiB more toward its
    // client stops relaying: only a read's replies are that large, so the
    // decode worker is then mid-read.
    relay.freeze_after(1 << 20);
    let requests: Vec<_> = chosen[1..]
        .iter()
        .map(|&i| {
            let (base, prompt) = (cluster.base.clone(), prompts[i].clone());
            tokio::spawn(async move { try_complete(&base, &prompt).await.map(|(text, _)| text) })
        })
        .collect();
    if let Err(error) = relay.frozen(STARTUP_TIMEOUT).await {
        panic!(
            "{error}: no read of the prefill worker's blocks\ngateway: {:#?}\ndecode worker: {:#?}\nprefill worker: {:#?}",
            warnings(&cluster.gateway),
            warnings(&cluster.decode),
            warnings(&cluster.prefill)
        );
    }
    assert!(metric(&decode, "turbine_worker_kv_imports_in_flight").await >= 1.0, "the decode worker is reading the held blocks");
    cluster.prefill.kill();
    relay.sever();

    let mut results = Vec::new();
    for request in requests {
        results.push(request.await.unwrap());
    }
    if results.iter().any(Result::is_err) {
        panic!("requests failed: {results:?}\ngateway: {:#?}\ndecode worker: {:#?}", warnings(&cluster.gateway), warnings(&cluster.decode));
    }
    for ((result, &i), expected) in results.into_iter().zip(&chosen[1..]).zip(&expected[1..]) {
        assert_eq!(&result.unwrap(), expected, "prompt of {} tokens after the prefill worker died", prompts[i].len());
    }
    let failed_reads = metric_where(&decode, "turbine_worker_kv_imports_total", &[("outcome", "transfer")]).await;
    assert!(failed_reads >= 1.0, "the read in flight failed over to local prefill ({failed_reads})");
}

/// A process's warnings and errors so far (for a failure's message).
fn warnings(process: &ServiceProcess) -> Vec<String> {
    process.output().into_iter().filter(|line| line.contains("WARN") || line.contains("ERROR")).collect()
}

/// A decode worker dead but still listed (its lease not yet expired) is
/// asked for a disaggregated request only after the prompt is prefilled, so
/// it fails mid-stream; the cached prefix it advertised draws the router to
/// it again for the continuation. The gateway leaves it out for the rest of
/// the request, and the other decode worker completes it (mock engines:
/// routing, not the model, is under test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_worker_still_listed_is_not_asked_again_for_the_request() {
    let _one = ONE_CLUSTER.lock().await;
    let redis = RedisServer::start();
    let url = redis.url();
    let worker = async |id: &str, role: &str| {
        // A lease far longer than the test: the dead worker stays listed.
        let args =
            ["--engine", "mock", "--redis", &url, "--namespace", "gone", "--worker-id", id, "--lease-ttl-secs", "600", "--role", role, "--kv-transport", "tcp"];
        service("turbine-worker", &args, &[], false).await
    };
    let _prefill = worker("prefill-0", "prefill").await;
    let mut decodes = [worker("decode-0", "decode").await, worker("decode-1", "decode").await];
    let router = service("turbine-router", &["--redis", &url, "--namespace", "gone", "--policy", "kv", "--disagg-threshold-tokens", "64"], &[], false).await;
    until_registered(&router, 3).await;
    let gateway = service("turbine-gateway", &["--router", &router.grpc_endpoint()], &[], true).await;
    let base = gateway.http_url();
    until_listed(&base).await;
    let prompts = prompts();
    let first = &prompts[4];
    complete(&base, first).await;
    // The decode worker that served it, holding its prefix.
    let mut served = Vec::new();
    for decode in &decodes {
        served.push(metric(&decode.admin_url(), "turbine_worker_generated_tokens_total").await > 0.0);
    }
    let holder = served.iter().position(|&served| served).expect("a decode worker generated the first request");
    assert_eq!(served.iter().filter(|&&served| served).count(), 1, "one decode worker served it: {served:?}");
    // The prefix and 300 tokens more: over the threshold, so prefilled
    // remotely, and the holder has the longest cached prefix. Its blocks
    // reach the router's index asynchronously: until the router chooses it
    // for this prompt (each probe released at once), the request could go
    // to the other worker and test nothing.
    let mut longer = first.clone();
    longer.extend(&prompts[5][..300]);
    let routing = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    let holder_id = format!("decode-{holder}");
    let mut probes = 0;
    wait_until("the router chooses the holder for the longer prompt", Duration::from_secs(10), async || {
        probes += 1;
        let probe = RouteRequest {
            request_id: format!("probe-{probes}"),
            model: MODEL.into(),
            prompt_tokens: longer.len() as u32,
            policy: None,
            exclude_worker_ids: Vec::new(),
            token_ids: longer.as_slice().into(),
            kv: None,
            cache_salt: Default::default(),
            kv_tenant: Default::default(),
            prefix_worker: None,
            ..Default::default()
        };
        let Ok(routed) = routing.route(&probe).await else { return false };
        let _ = routing.finished(&probe.request_id).await;
        routed.worker.worker_id.to_string() == holder_id
    })
    .await;
    decodes[holder].kill();
    let outcome = try_complete(&base, &longer).await;
    assert!(outcome.is_ok(), "the request failed: {outcome:?}\ngateway: {:#?}", warnings(&gateway));
    let other = &decodes[1 - holder];
    assert!(metric(&other.admin_url(), "turbine_worker_generated_tokens_total").await > 0.0, "the live decode worker completed it");
    assert!(metric(&base, "turbine_gateway_migrations_total").await >= 1.0, "the dead worker was asked first, after the prefill (mid-stream)");
    drop(redis);
}
