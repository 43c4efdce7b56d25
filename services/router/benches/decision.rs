//! One kv routing decision for a 32,000-token prompt over 100 workers,
//! hashing included, next to a least-loaded decision.
//!
//! Criterion reports the mean; the issue's goals are percentiles, so after
//! the criterion group each policy is also timed one decision at a time
//! (20,000 decisions after a warm-up) and p50/p99/max are printed.
//!
//! `Router::route` is async (a remote kv-index is asked over the network);
//! with the index in this process it completes on its first poll, so each
//! decision is driven with a minimal executor.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use futures::executor::block_on;
use turbine_kv::{BlockHasher, KvEvent, KvIndex, StoredBlock, Tier};
use turbine_registry::{LiveWorker, WorkerLoad, WorkerRecord};
use turbine_router::{KvConfig, KvState, Policy, RouteRequest, Router};

fn router() -> (Router, Arc<[u32]>) {
    let tokens: Arc<[u32]> = (0..32_000u32).map(|i| i.wrapping_mul(2_654_435_761) % 49_152).collect();
    let hashes = BlockHasher::default().hash_blocks(&tokens, 16);
    let index = Arc::new(KvIndex::new());
    let workers: Vec<LiveWorker> = (0..100)
        .map(|w| {
            // Worker w caches the first 20·w blocks of the prompt (up to all 2,000).
            let blocks = hashes[..(20 * w).min(hashes.len())].iter().map(|h| StoredBlock { sequence_hash: h.sequence, local_hash: h.local }).collect();
            let id = format!("worker-{w:03}");
            index.apply_unnumbered(&id, &KvEvent::Stored { parent: None, blocks, tier: Tier::Device });
            LiveWorker {
                record: WorkerRecord {
                    worker_id: id.as_str().into(),
                    endpoint: format!("http://{id}"),
                    model: "m".into(),
                    load: WorkerLoad::default(),
                    kv_block_size: 16,
                    instance: 1,
                    role: Default::default(),
                    read_costs: Default::default(),
                    kv_store: None,
                    shared_cache_only: false,
                    output_formats: Default::default(),
                },
                expires_at: Instant::now() + Duration::from_secs(3600),
                kv_tenants: None,
            }
        })
        .collect();
    let router = Router::with_kv(Policy::Kv, Duration::from_secs(600), Arc::new(KvState::local(KvConfig::default(), index, None)));
    router.update_workers(workers);
    (router, tokens)
}

fn decision(c: &mut Criterion) {
    let (router, tokens) = router();
    let mut group = c.benchmark_group("route_32k_tokens_100_workers");
    for policy in [Policy::Kv, Policy::LeastLoaded] {
        let request = RouteRequest {
            request_id: "r".into(),
            model: "m".into(),
            prompt_tokens: 32_000,
            policy: Some(policy),
            token_ids: tokens.clone(),
            ..Default::default()
        };
        group.bench_function(policy.name(), |b| {
            b.iter(|| {
                let routed = block_on(router.route(black_box(&request))).unwrap();
                router.finished("r");
                routed
            })
        });
    }
    group.finish();
    for policy in [Policy::Kv, Policy::LeastLoaded] {
        let request = RouteRequest {
            request_id: "r".into(),
            model: "m".into(),
            prompt_tokens: 32_000,
            policy: Some(policy),
            token_ids: tokens.clone(),
            ..Default::default()
        };
        let mut latencies: Vec<Duration> = (0..22_000)
            .map(|_| {
                let started = Instant::now();
                black_box(block_on(router.route(black_box(&request))).unwrap());
                let took = started.elapsed();
                router.finished("r");
                took
            })
            .skip(2_000)
            .collect();
        latencies.sort_unstable();
        let pick = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
        println!("route_32k_tokens_100_workers/{}: p50 {:.2} µs, p99 {:.2} µs, max {:.1} µs", policy.name(), pick(0.5), pick(0.99), pick(1.0));
    }
}

criterion_group!(benches, decision);
criterion_main!(benches);
