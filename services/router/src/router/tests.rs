use proptest::prelude::*;
use turbine_registry::{WorkerLoad, WorkerRecord, WorkerRole};

use super::*;

/// One decision: the router's one entry point, driven to completion (no
/// index lookup here waits on anything).
fn route(router: &Router, request: &RouteRequest) -> Result<Routed, RouteError> {
    futures::executor::block_on(router.route(request))
}

fn live(id: &str, model: &str, ttl: Duration) -> LiveWorker {
    LiveWorker {
        record: WorkerRecord {
            worker_id: id.into(),
            endpoint: format!("http://{id}"),
            model: model.into(),
            load: WorkerLoad::default(),
            kv_block_size: 16,
            instance: 1,
            role: Default::default(),
            read_costs: Default::default(),
            kv_store: None,
            shared_cache_only: false,
            output_formats: Default::default(),
        },
        expires_at: Instant::now() + ttl,
        kv_tenants: None,
    }
}

fn request(id: &str, model: &str) -> RouteRequest {
    RouteRequest { request_id: id.into(), model: model.into(), ..Default::default() }
}

#[test]
fn bookings_are_made_at_route_and_released_at_finish() {
    let router = Router::new(Policy::LeastLoaded, Duration::from_secs(600));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60)), live("b", "m", Duration::from_secs(60))]);
    let first = route(&router, &request("r1", "m")).unwrap().worker;
    let Routed { worker: second, in_flight, .. } = route(&router, &request("r2", "m")).unwrap();
    assert_ne!(first.worker_id, second.worker_id, "least-loaded spreads two requests");
    assert_eq!(in_flight, 1);
    assert_eq!(router.total_in_flight(), 2);
    assert!(router.finished("r1"));
    assert!(!router.finished("r1"), "finishing twice is harmless");
    assert_eq!(router.total_in_flight(), 1);
}

#[test]
fn only_workers_of_the_model_and_not_excluded_are_chosen() {
    let router = Router::new(Policy::RoundRobin, Duration::from_secs(600));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60)), live("b", "other", Duration::from_secs(60))]);
    for i in 0..5 {
        assert_eq!(route(&router, &request(&format!("r{i}"), "m")).unwrap().worker.worker_id, "a");
    }
    let excluded = RouteRequest { exclude_worker_ids: vec!["a".into()], ..request("x", "m") };
    assert_eq!(route(&router, &excluded), Err(RouteError::NoWorkers("m".into())));
    assert_eq!(route(&router, &request("y", "nope")), Err(RouteError::NoWorkers("nope".into())));
}

#[test]
fn an_expired_lease_stops_traffic_and_drops_its_bookings() {
    let router = Router::new(Policy::RoundRobin, Duration::from_secs(600));
    router.update_workers(vec![live("a", "m", Duration::from_millis(1)), live("b", "m", Duration::from_secs(60))]);
    std::thread::sleep(Duration::from_millis(5));
    // Even before the next expire() sweep, an expired worker is not chosen.
    for i in 0..4 {
        assert_eq!(route(&router, &request(&format!("r{i}"), "m")).unwrap().worker.worker_id, "b");
    }
    router.expire(Instant::now());
    assert_eq!(router.workers(None).len(), 1);
}

#[test]
fn a_registry_outage_keeps_live_workers_but_not_expired_ones() {
    let router = Router::new(Policy::RoundRobin, Duration::from_secs(600));
    router.update_workers(vec![live("a", "m", Duration::from_millis(1)), live("b", "m", Duration::from_secs(60))]);
    std::thread::sleep(Duration::from_millis(5));
    router.extend_leases(Duration::from_secs(60));
    let ids: Vec<String> = router.workers(None).into_iter().map(|w| w.worker_id.to_string()).collect();
    assert_eq!(ids, ["b"], "a crashed worker is not resurrected by an outage");
}

#[test]
fn a_worker_leaving_the_registry_drops_its_bookings() {
    let router = Router::new(Policy::RoundRobin, Duration::from_secs(600));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60))]);
    route(&router, &request("r", "m")).unwrap();
    router.update_workers(vec![]);
    assert_eq!(router.total_in_flight(), 0);
}

#[test]
fn stale_bookings_expire() {
    let router = Router::new(Policy::RoundRobin, Duration::from_millis(1));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60))]);
    route(&router, &request("r", "m")).unwrap();
    router.expire(Instant::now() + Duration::from_millis(10));
    assert_eq!(router.total_in_flight(), 0);
}

#[test]
fn a_retried_request_id_moves_its_booking() {
    let router = Router::new(Policy::RoundRobin, Duration::from_secs(600));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60)), live("b", "m", Duration::from_secs(60))]);
    let first = route(&router, &request("r", "m")).unwrap().worker;
    let retry = RouteRequest { exclude_worker_ids: vec![first.worker_id.clone()], ..request("r", "m") };
    let second = route(&router, &retry).unwrap().worker;
    assert_ne!(first.worker_id, second.worker_id);
    assert_eq!(router.total_in_flight(), 1);
    let counts: Vec<u32> = router.workers(None).iter().map(|w| w.in_flight).collect();
    assert_eq!(counts.iter().sum::<u32>(), 1);
}

proptest! {
    /// Per-worker in-flight counts always equal the bookings, whatever the
    /// interleaving of routes, finishes and membership changes.
    #[test]
    fn in_flight_counts_match_bookings(ops in prop::collection::vec((0u8..4, 0usize..6), 1..80)) {
        let router = Router::new(Policy::LeastLoaded, Duration::from_secs(600));
        let all = ["a", "b", "c"];
        router.update_workers(all.iter().map(|id| live(id, "m", Duration::from_secs(60))).collect());
        let mut open = std::collections::HashSet::new();
        for (kind, n) in ops {
            match kind {
                0 | 1 => {
                    let id = format!("r{n}");
                    if route(&router, &request(&id, "m")).is_ok() { open.insert(id); }
                }
                2 => {
                    let id = format!("r{n}");
                    prop_assert_eq!(router.finished(&id), open.remove(&id));
                }
                _ => {
                    // Membership change: keep a prefix of the workers.
                    let keep = n % (all.len() + 1);
                    router.update_workers(all[..keep].iter().map(|id| live(id, "m", Duration::from_secs(60))).collect());
                    let state = router.state.lock();
                    open.retain(|id| state.bookings.contains_key(id));
                }
            }
            let total: u32 = router.workers(None).iter().map(|w| w.in_flight).sum();
            prop_assert_eq!(total as usize, open.len());
            prop_assert_eq!(router.total_in_flight(), open.len());
        }
    }
}

fn with_role(id: &str, role: WorkerRole) -> LiveWorker {
    let mut worker = live(id, "m", Duration::from_secs(60));
    worker.record.role = role;
    worker
}

fn prompt(id: &str, tokens: u32) -> RouteRequest {
    RouteRequest { prompt_tokens: tokens, ..request(id, "m") }
}

#[test]
fn long_prompts_go_to_a_prefill_worker_and_short_ones_stay_on_the_decode_worker() {
    let router = Router::new(Policy::LeastLoaded, Duration::from_secs(600)).with_disagg(DisaggPolicy { threshold_tokens: 100, max_prefill_queue: 2 });
    router.update_workers(vec![with_role("p", WorkerRole::Prefill), with_role("d", WorkerRole::Decode)]);
    // Prefill workers never decode.
    let short = route(&router, &prompt("short", 100)).unwrap();
    assert_eq!(short.worker.worker_id, "d");
    assert_eq!(short.prefill, None, "at the threshold the decode worker computes the prompt");
    let long = route(&router, &prompt("long", 101)).unwrap();
    assert_eq!(long.worker.worker_id, "d");
    assert_eq!(long.prefill.as_ref().map(|w| w.worker_id.as_str()), Some("p"));
    assert_eq!(long.prefill.as_ref().map(|w| w.role), Some(WorkerRole::Prefill));
    // The prefill booking ends with the prefill; the decode booking stays.
    assert_eq!(router.own_books()["p"].in_flight, 1);
    assert!(router.prefill_done("long"));
    assert!(!router.own_books().contains_key("p"));
    assert_eq!(router.own_books()["d"].in_flight, 2);
    assert!(router.finished("long") && router.finished("short"));
    assert_eq!(router.total_in_flight(), 0);
}

#[test]
fn a_saturated_prefill_pool_leaves_prompts_on_the_decode_worker() {
    let router = Router::new(Policy::LeastLoaded, Duration::from_secs(600)).with_disagg(DisaggPolicy { threshold_tokens: 10, max_prefill_queue: 2 });
    router.update_workers(vec![with_role("p", WorkerRole::Prefill), with_role("d", WorkerRole::Decode)]);
    let routed: Vec<bool> = (0..4).map(|i| route(&router, &prompt(&format!("r{i}"), 500)).unwrap().prefill.is_some()).collect();
    assert_eq!(routed, [true, true, false, false], "two prefills queue, then the pool is saturated");
    // Finishing a request (without its prefill done) frees its prefill slot too.
    assert!(router.finished("r0"));
    assert!(route(&router, &prompt("r4", 500)).unwrap().prefill.is_some());
}

#[test]
fn aggregated_workers_compute_their_own_prompts_and_prefill_only_pools_serve_nothing() {
    let router = Router::new(Policy::LeastLoaded, Duration::from_secs(600));
    router.update_workers(vec![with_role("p", WorkerRole::Prefill), with_role("a", WorkerRole::Aggregated)]);
    let routed = route(&router, &prompt("r", 5000)).unwrap();
    assert_eq!((routed.worker.worker_id.as_str(), routed.prefill), ("a", None));
    router.update_workers(vec![with_role("p", WorkerRole::Prefill)]);
    assert_eq!(route(&router, &prompt("r2", 5000)), Err(RouteError::NoWorkers("m".into())));
}

#[test]
fn a_kv_stores_blocks_count_for_the_workers_that_read_it() {
    use turbine_kv::{BlockHasher, KvEvent, KvIndex, NumberedEvent, StoredBlock, Tier};
    use turbine_registry::KvStoreRef;

    use crate::kv::{KvConfig, KvState};

    let index = Arc::new(KvIndex::new());
    let router = Router::with_kv(Policy::Kv, Duration::from_secs(600), Arc::new(KvState::local(KvConfig::default(), index.clone(), None)));
    let store = WorkerId::of_store("shared", 7);
    let reader = |id: &str| {
        let mut worker = live(id, "m", Duration::from_secs(60));
        worker.record.kv_store = Some(KvStoreRef { name: store.clone(), endpoint: "http://store".into() });
        // Measured: reading from the store costs a tenth of computing.
        worker.record.read_costs.remote = Some(turbine_registry::ReadCost { fixed_blocks: 0.5, per_block: 0.1 });
        worker
    };
    router.update_workers(vec![reader("a"), live("b", "m", Duration::from_secs(60)), reader("c")]);
    let tokens: Vec<u32> = (0..160).collect();
    let stored = |worker: &str, blocks: usize, tier: Tier| {
        let blocks = BlockHasher::default()
            .hash_blocks(&tokens, 16)
            .iter()
            .take(blocks)
            .map(|hashes| StoredBlock { sequence_hash: hashes.sequence, local_hash: hashes.local })
            .collect();
        index.apply(worker, 1, &NumberedEvent { event_id: 0, event: KvEvent::Stored { parent: None, blocks, tier } });
    };
    // The store holds the whole prompt; b caches half of it on device; c
    // a quarter (it would read the rest from the store).
    stored(&store, 10, Tier::Remote);
    stored("b", 5, Tier::Device);
    stored("c", 2, Tier::Device);
    let kv_request = |id: &str| RouteRequest { token_ids: tokens.clone().into(), policy: Some(Policy::Kv), ..request(id, "m") };
    let routed = route(&router, &kv_request("r1")).unwrap();
    assert_eq!((routed.worker.worker_id.as_str(), routed.overlap_blocks), ("c", 10), "its own 2 blocks and the store's 8");
    assert!(router.finished("r1"));

    // Without the store's credit (the request prices remote hits at 0), b's
    // device blocks win.
    let no_remote = RouteRequest { kv: Some(crate::kv::KvOverrides { remote_credit: Some(0.0), ..Default::default() }), ..kv_request("r2") };
    assert_eq!(route(&router, &no_remote).unwrap().worker.worker_id, "b");
}

#[test]
fn a_request_matches_only_blocks_of_its_own_cache_salt() {
    use turbine_kv::{BlockHasher, CacheSalt, DEFAULT_SEED, KvEvent, KvIndex, NumberedEvent, StoredBlock, Tier};

    use crate::kv::{KvConfig, KvState};

    let index = Arc::new(KvIndex::new());
    let router = Router::with_kv(Policy::Kv, Duration::from_secs(600), Arc::new(KvState::local(KvConfig::default(), index.clone(), None)));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60)), live("b", "m", Duration::from_secs(60))]);
    let tokens: Vec<u32> = (0..160).collect();
    let tenant = CacheSalt::of(&["tenant-a"]);
    // The same prompt cached on a in tenant-a's namespace, on b in the
    // shared one.
    for (worker, salt) in [("a", tenant), ("b", CacheSalt::SHARED)] {
        let blocks = BlockHasher::salted(DEFAULT_SEED, salt)
            .hash_blocks(&tokens, 16)
            .iter()
            .map(|hashes| StoredBlock { sequence_hash: hashes.sequence, local_hash: hashes.local })
            .collect();
        index.apply(worker, 1, &NumberedEvent { event_id: 0, event: KvEvent::Stored { parent: None, blocks, tier: Tier::Device } });
    }
    let salted = |id: &str, cache_salt| RouteRequest { token_ids: tokens.clone().into(), policy: Some(Policy::Kv), cache_salt, ..request(id, "m") };
    for (id, salt, worker, overlap) in [("r1", tenant, "a", 10), ("r2", CacheSalt::SHARED, "b", 10)] {
        let routed = route(&router, &salted(id, salt)).unwrap();
        assert_eq!((routed.worker.worker_id.as_str(), routed.overlap_blocks), (worker, overlap), "{salt:?}");
        assert!(router.finished(id));
    }
    let other = route(&router, &salted("r3", CacheSalt::of(&["tenant-b"]))).unwrap();
    assert_eq!(other.overlap_blocks, 0, "another tenant matches neither worker's blocks");
}

#[test]
fn a_worker_sharing_one_cache_gets_only_the_shared_namespaces_requests() {
    use turbine_kv::{CacheSalt, KvTenant};

    let sharing = |id: &str| {
        let mut worker = live(id, "m", Duration::from_secs(60));
        worker.record.shared_cache_only = true;
        worker
    };
    for policy in [Policy::RoundRobin, Policy::LeastLoaded, Policy::Kv] {
        let index = Arc::new(turbine_kv::KvIndex::new());
        let router = Router::with_kv(policy, Duration::from_secs(600), Arc::new(crate::kv::KvState::local(crate::kv::KvConfig::default(), index, None)));
        router.update_workers(vec![sharing("openai-0"), live("apart-0", "m", Duration::from_secs(60))]);
        let of =
            |id: String, cache_salt, kv_tenant| RouteRequest { token_ids: (0..64).collect::<Vec<u32>>().into(), cache_salt, kv_tenant, ..request(&id, "m") };
        let served = |cache_salt, kv_tenant| -> std::collections::BTreeSet<String> {
            (0..8)
                .map(|i| {
                    let request = of(format!("r{i}"), cache_salt, kv_tenant);
                    let worker = route(&router, &request).unwrap().worker.worker_id.to_string();
                    router.finished(&request.request_id);
                    worker
                })
                .collect()
        };
        let set = |ids: &[&str]| ids.iter().map(|&id| id.to_owned()).collect::<std::collections::BTreeSet<_>>();
        let acme = (CacheSalt::of(&["tenant", "acme"]), KvTenant::of_tenant("acme"));
        assert_eq!(served(acme.0, acme.1), set(&["apart-0"]), "{policy:?}: a tenant's requests never reach the shared cache");
        assert_eq!(served(CacheSalt::of(&["mine"]), KvTenant::SHARED), set(&["apart-0"]), "{policy:?}: nor a client's cache_salt");
        // (Round robin spreads; least-loaded breaks its ties by chance.)
        if policy == Policy::RoundRobin {
            assert_eq!(served(CacheSalt::SHARED, KvTenant::SHARED), set(&["apart-0", "openai-0"]), "{policy:?}: the shared namespace goes to both");
        }

        // Only workers sharing one cache: the tenant is told why, and the
        // shared namespace is still served.
        router.update_workers(vec![sharing("openai-0")]);
        let refused = route(&router, &of("t".into(), acme.0, acme.1)).unwrap_err();
        assert_eq!(refused, RouteError::NoneKeepsApart("m".into()));
        assert!(refused.to_string().contains("cache_salt"), "{refused}");
        assert_eq!(route(&router, &of("s".into(), CacheSalt::SHARED, KvTenant::SHARED)).unwrap().worker.worker_id, "openai-0");
    }
}

#[test]
fn a_request_held_to_a_format_goes_only_to_workers_keeping_to_it() {
    use std::collections::BTreeSet;
    use turbine_api::{FormatKind, OutputFormats};

    let holding = |id: &str, json_object, json_schema, json_schema_core, resumes| {
        let mut worker = live(id, "m", Duration::from_secs(60));
        worker.record.output_formats = OutputFormats { json_object, json_schema, json_schema_core, resumes };
        worker
    };
    let (mocker, native, vllm) =
        (|| holding("mocker-0", false, false, false, false), || holding("native-0", true, false, true, true), || holding("vllm-0", true, true, false, false));
    let fleet = || vec![mocker(), native(), vllm()];
    let of =
        |id: String, output, output_continued| RouteRequest { token_ids: (0..64).collect::<Vec<u32>>().into(), output, output_continued, ..request(&id, "m") };
    let set = |ids: &[&str]| ids.iter().map(|&id| id.to_owned()).collect::<BTreeSet<_>>();
    for policy in [Policy::RoundRobin, Policy::LeastLoaded, Policy::Kv] {
        let index = Arc::new(turbine_kv::KvIndex::new());
        let router = Router::with_kv(policy, Duration::from_secs(600), Arc::new(crate::kv::KvState::local(crate::kv::KvConfig::default(), index, None)));
        router.update_workers(fleet());
        let served = |output, continued| -> BTreeSet<String> {
            (0..9)
                .map(|i| {
                    let request = of(format!("r{i}"), output, continued);
                    let worker = route(&router, &request).unwrap().worker.worker_id.to_string();
                    router.finished(&request.request_id);
                    worker
                })
                .collect()
        };
        for (output, continued, allowed) in [
            (FormatKind::Text, false, set(&["mocker-0", "native-0", "vllm-0"])),
            (FormatKind::Text, true, set(&["mocker-0", "native-0", "vllm-0"])),
            (FormatKind::JsonObject, false, set(&["native-0", "vllm-0"])),
            (FormatKind::JsonObject, true, set(&["native-0"])),
            // Any schema's engine first; the native engine resumes one.
            (FormatKind::JsonSchema, false, set(&["vllm-0"])),
            (FormatKind::JsonSchema, true, set(&["native-0"])),
        ] {
            let got = served(output, continued);
            // Round robin spreads over every worker allowed; the others
            // break ties by chance or send alike requests alike.
            let held = if policy == Policy::RoundRobin { got == allowed } else { got.is_subset(&allowed) };
            assert!(held, "{policy:?}: {output:?} (continued: {continued}) went to {got:?}, allowed {allowed:?}");
        }

        // The one holding any schema excluded (it just failed): the core
        // subset's engine takes it.
        let excluded = RouteRequest { exclude_worker_ids: vec!["vllm-0".into()], ..of("x".into(), FormatKind::JsonSchema, false) };
        assert_eq!(route(&router, &excluded).unwrap().worker.worker_id, "native-0");
        router.finished("x");
        // None of the model's workers keeps to it: the request is told
        // why, and it is not a passing state (FAILED_PRECONDITION, a 400).
        router.update_workers(vec![mocker(), vllm()]);
        let refused = route(&router, &of("s".into(), FormatKind::JsonSchema, true)).unwrap_err();
        assert_eq!(refused, RouteError::NoneHoldsFormat { model: "m".into(), format: "json_schema", continued: true });
        assert!(refused.to_string().contains("json_schema from output begun on another worker"), "{refused}");
        assert!(matches!(turbine_api::router::RouterCallError::from(refused), turbine_api::router::RouterCallError::Unserved(_)));
        // The one that does was excluded: no worker now.
        let excluded = RouteRequest { exclude_worker_ids: vec!["vllm-0".into()], ..of("x".into(), FormatKind::JsonSchema, false) };
        assert_eq!(route(&router, &excluded), Err(RouteError::NoWorkers("m".into())));
        // Without an engine of any schema, the core one takes them all.
        router.update_workers(vec![mocker(), native()]);
        assert_eq!(route(&router, &of("c".into(), FormatKind::JsonSchema, false)).unwrap().worker.worker_id, "native-0");
        router.finished("c");
        // A fleet of text-only engines (and records from before workers
        // announced formats).
        router.update_workers(vec![mocker(), live("old-0", "m", Duration::from_secs(60))]);
        assert_eq!(
            route(&router, &of("o".into(), FormatKind::JsonObject, false)),
            Err(RouteError::NoneHoldsFormat { model: "m".into(), format: "json_object", continued: false })
        );
        assert_eq!(
            route(&router, &RouteRequest { model: "nope".into(), ..of("n".into(), FormatKind::JsonObject, false) }),
            Err(RouteError::NoWorkers("nope".into()))
        );
    }
}

fn limited_to(id: &str, role: WorkerRole, tenants: &[turbine_kv::KvTenant]) -> LiveWorker {
    LiveWorker { kv_tenants: Some(tenants.into()), ..with_role(id, role) }
}

#[test]
fn a_tenant_is_kept_on_its_own_pool_and_no_other_tenant_lands_there() {
    use turbine_kv::KvTenant;
    let (acme, bravo, system) = (KvTenant::of_tenant("acme"), KvTenant::of_tenant("bravo"), KvTenant::of_shared("system"));
    let router = Router::new(Policy::RoundRobin, Duration::from_secs(600));
    router.update_workers(vec![
        limited_to("acme-0", WorkerRole::Aggregated, &[acme]),
        limited_to("acme-1", WorkerRole::Aggregated, &[acme, system]),
        with_role("any-0", WorkerRole::Aggregated),
        with_role("any-1", WorkerRole::Aggregated),
    ]);
    let of = |id: String, kv_tenant| RouteRequest { kv_tenant, ..request(&id, "m") };
    let served = |tenant: KvTenant, exclude: &[&str]| -> std::collections::BTreeSet<String> {
        (0..8)
            .map(|i| {
                let request = RouteRequest { exclude_worker_ids: exclude.iter().map(|&id| id.into()).collect(), ..of(format!("r{i}"), tenant) };
                let worker = route(&router, &request).unwrap().worker.worker_id.to_string();
                router.finished(&request.request_id);
                worker
            })
            .collect()
    };
    let set = |ids: &[&str]| ids.iter().map(|&id| id.to_owned()).collect::<std::collections::BTreeSet<_>>();
    assert_eq!(served(acme, &[]), set(&["acme-0", "acme-1"]), "acme's pool serves acme, all of it");
    assert_eq!(served(system, &[]), set(&["acme-1"]), "the one worker limited to the shared namespace among others");
    assert_eq!(served(bravo, &[]), set(&["any-0", "any-1"]), "a tenant without a pool: the unlimited workers, never acme's");
    assert_eq!(served(KvTenant::SHARED, &[]), set(&["any-0", "any-1"]), "the open namespace likewise");
    assert_eq!(served(acme, &["acme-0"]), set(&["acme-1"]), "what is left of the pool");
    assert_eq!(served(acme, &["acme-0", "acme-1"]), set(&["any-0", "any-1"]), "no pool worker eligible: the unlimited ones");

    // The workers list says which tenants each is limited to.
    let listed: Vec<(String, Vec<KvTenant>)> = router.workers(None).into_iter().map(|w| (w.worker_id.to_string(), w.kv_tenants)).collect();
    assert_eq!(listed[..2], [("acme-0".to_owned(), vec![acme]), ("acme-1".to_owned(), vec![acme, system])]);
    assert!(listed[2..].iter().all(|(_, tenants)| tenants.is_empty()));

    // Only pools: a tenant none of them is limited to is not served.
    router.update_workers(vec![limited_to("acme-0", WorkerRole::Aggregated, &[acme])]);
    assert_eq!(route(&router, &of("b".into(), bravo)), Err(RouteError::NoWorkers("m".into())));
}

#[test]
fn a_tenants_prompt_is_prefilled_on_its_own_pool_too() {
    use turbine_kv::KvTenant;
    let (acme, bravo) = (KvTenant::of_tenant("acme"), KvTenant::of_tenant("bravo"));
    let router = Router::new(Policy::LeastLoaded, Duration::from_secs(600)).with_disagg(DisaggPolicy { threshold_tokens: 100, max_prefill_queue: 8 });
    router.update_workers(vec![
        limited_to("acme-prefill", WorkerRole::Prefill, &[acme]),
        limited_to("acme-decode", WorkerRole::Decode, &[acme]),
        with_role("any-prefill", WorkerRole::Prefill),
        with_role("any-decode", WorkerRole::Decode),
    ]);
    for i in 0..4 {
        let routed = route(&router, &RouteRequest { kv_tenant: acme, ..prompt(&format!("a{i}"), 1000) }).unwrap();
        assert_eq!((routed.worker.worker_id.as_str(), routed.prefill.map(|p| p.worker_id.to_string())), ("acme-decode", Some("acme-prefill".into())));
        let routed = route(&router, &RouteRequest { kv_tenant: bravo, ..prompt(&format!("b{i}"), 1000) }).unwrap();
        assert_eq!((routed.worker.worker_id.as_str(), routed.prefill.map(|p| p.worker_id.to_string())), ("any-decode", Some("any-prefill".into())));
    }
}

/// One choice of a request with a 1,600-token prompt (100 full blocks),
/// routed by the kv policy, beside the worker an earlier choice went to.
fn choice(id: &str, beside: Option<&WorkerId>) -> RouteRequest {
    RouteRequest {
        token_ids: (0..1600).collect::<Vec<u32>>().into(),
        prompt_tokens: 1600,
        policy: Some(Policy::Kv),
        prefix_worker: beside.cloned(),
        ..request(id, "m")
    }
}

#[test]
fn the_choices_of_one_request_are_routed_where_the_first_computes_the_prompt() {
    use turbine_kv::KvIndex;

    use crate::kv::{KvConfig, KvState};

    let router = Router::with_kv(Policy::Kv, Duration::from_secs(600), Arc::new(KvState::local(KvConfig::default(), Arc::new(KvIndex::new()), None)));
    router.update_workers(vec![live("a", "m", Duration::from_secs(60)), live("b", "m", Duration::from_secs(60)), live("c", "m", Duration::from_secs(60))]);
    // Nothing is cached anywhere: the first choice goes to any worker, and
    // the next fifteen beside it, their prompt credited and not booked as
    // prefill again.
    let first = route(&router, &choice("r-0", None)).unwrap().worker.worker_id;
    for i in 1..16 {
        let routed = route(&router, &choice(&format!("r-{i}"), Some(&first))).unwrap();
        assert_eq!((&routed.worker.worker_id, routed.overlap_blocks), (&first, 100), "choice {i}");
    }
    assert_eq!(router.own_books()[first.as_str()].prefill_blocks, 100, "one prefill booked for sixteen choices");
    // Without the hint the same prompt goes to an idle worker.
    assert_ne!(route(&router, &choice("alone", None)).unwrap().worker.worker_id, first);
    // Excluded, it is not chosen: the hint only credits.
    let excluded = RouteRequest { exclude_worker_ids: vec![first.clone()], ..choice("x", Some(&first)) };
    assert_ne!(route(&router, &excluded).unwrap().worker.worker_id, first);
    // Other policies ignore it.
    let spread: Vec<WorkerId> = (0..3)
        .map(|i| route(&router, &RouteRequest { policy: Some(Policy::RoundRobin), ..choice(&format!("rr-{i}"), Some(&first)) }).unwrap().worker.worker_id)
        .collect();
    assert!(spread.iter().any(|worker| *worker != first), "{spread:?}");
}

#[test]
fn a_decode_worker_is_not_credited_a_prompt_it_receives_from_a_prefill_worker() {
    use turbine_kv::KvIndex;

    use crate::kv::{KvConfig, KvState};

    let router = Router::with_kv(Policy::Kv, Duration::from_secs(600), Arc::new(KvState::local(KvConfig::default(), Arc::new(KvIndex::new()), None)))
        .with_disagg(DisaggPolicy { threshold_tokens: 100, max_prefill_queue: 8 });
    router.update_workers(vec![with_role("p", WorkerRole::Prefill), with_role("d1", WorkerRole::Decode), with_role("d2", WorkerRole::Decode)]);
    let first = route(&router, &choice("r-0", None)).unwrap();
    assert!(first.prefill.is_some());
    let second = route(&router, &choice("r-1", Some(&first.worker.worker_id))).unwrap();
    assert_eq!(second.overlap_blocks, 0);
    assert!(second.prefill.is_some(), "the second choice's prompt is prefilled on the prefill pool too");
}
