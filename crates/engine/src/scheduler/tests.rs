use proptest::prelude::*;

use super::*;

fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        num_blocks,
        max_num_seqs: 8,
        max_batched_tokens: 64,
        max_model_len: 1024,
        max_waiting: 100,
        prefix_caching: true,
        chunked_prefill: true,
        hash_seed: turbine_kv::DEFAULT_SEED,
    }
}

fn request(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: String::new(),
        prompt,
        sampling: SamplingParams::default(),
        stop: StopConditions { max_tokens, stop_token_ids: vec![], ignore_eos: false },
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    }
}

/// Runs steps with a fake model that always samples `next`, until every
/// sequence finished; returns each sequence's (tokens, finish, usage).
fn run_to_completion(scheduler: &mut Scheduler, next: u32) -> HashMap<SeqId, (Vec<u32>, FinishReason, Usage)> {
    let mut streams: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut done = HashMap::new();
    for _ in 0..10_000 {
        if !scheduler.has_work() {
            return done;
        }
        let plan = scheduler.schedule();
        assert!(!plan.is_empty(), "work exists but nothing was scheduled");
        let batch = scheduler.batch(&plan);
        for item in &batch.items {
            assert!(item.block_table.len() * batch.block_size >= item.start + item.len, "block table too short");
        }
        let sampled: Vec<Option<u32>> = plan.iter().map(|chunk| chunk.sample.then_some(next)).collect();
        for update in scheduler.complete(&plan, &sampled) {
            let stream = streams.entry(update.seq_id).or_default();
            stream.extend(update.token);
            if let Some((reason, usage)) = update.finished {
                done.insert(update.seq_id, (streams.remove(&update.seq_id).unwrap(), reason, usage));
            }
        }
        scheduler.check_invariants();
    }
    panic!("did not finish");
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_then_decoded() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let id = scheduler.add(request((0..150).collect(), 3)).unwrap();
    let first = scheduler.schedule();
    assert_eq!(first, vec![ScheduledChunk { seq_id: id, start: 0, len: 64, sample: false }]);
    scheduler.complete(&first, &[None]);
    let second = scheduler.schedule();
    assert_eq!(second, vec![ScheduledChunk { seq_id: id, start: 64, len: 64, sample: false }]);
    scheduler.complete(&second, &[None]);
    let third = scheduler.schedule();
    assert_eq!(third, vec![ScheduledChunk { seq_id: id, start: 128, len: 22, sample: true }]);
    let updates = scheduler.complete(&third, &[Some(7)]);
    assert_eq!(updates[0].token, Some(7));
    let decode = scheduler.schedule();
    assert_eq!(decode, vec![ScheduledChunk { seq_id: id, start: 150, len: 1, sample: true }]);
}

#[test]
fn max_tokens_and_usage_are_exact() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let id = scheduler.add(request((0..10).collect(), 5)).unwrap();
    let done = run_to_completion(&mut scheduler, 3);
    let (tokens, reason, usage) = &done[&id];
    assert_eq!(tokens, &vec![3; 5]);
    assert_eq!(*reason, FinishReason::Length);
    assert_eq!(*usage, Usage { prompt_tokens: 10, completion_tokens: 5, cached_prompt_tokens: 0 });
    assert_eq!(scheduler.load().blocks_used, 0, "finished sequences free their blocks");
}

#[test]
fn eos_stops_without_being_emitted_unless_ignored() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![2]);
    let stops = scheduler.add(request(vec![1, 2, 3], 5)).unwrap();
    let mut ignoring = request(vec![1, 2, 3], 4);
    ignoring.stop.ignore_eos = true;
    let ignores = scheduler.add(ignoring).unwrap();
    let done = run_to_completion(&mut scheduler, 2);
    assert_eq!(done[&stops].0, Vec::<u32>::new());
    assert_eq!(done[&stops].1, FinishReason::Stop);
    assert_eq!(done[&stops].2.completion_tokens, 0);
    assert_eq!(done[&ignores].0, vec![2; 4]);
    assert_eq!(done[&ignores].1, FinishReason::Length);
}

#[test]
fn a_repeated_prompt_reuses_cached_blocks() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let prompt: Vec<u32> = (100..118).collect(); // 4 full blocks + 2 tokens
    let first = scheduler.add(request(prompt.clone(), 2)).unwrap();
    let done = run_to_completion(&mut scheduler, 1);
    assert_eq!(done[&first].2.cached_prompt_tokens, 0);
    let second = scheduler.add(request(prompt.clone(), 2)).unwrap();
    let plan = scheduler.schedule();
    assert_eq!(plan, vec![ScheduledChunk { seq_id: second, start: 16, len: 2, sample: true }]);
    scheduler.complete(&plan, &[Some(1)]);
    let done = run_to_completion(&mut scheduler, 1);
    assert_eq!(done[&second].2.cached_prompt_tokens, 16);
}

#[test]
fn a_prompt_on_a_block_boundary_recomputes_its_last_block() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let prompt: Vec<u32> = (0..16).collect();
    scheduler.add(request(prompt.clone(), 1)).unwrap();
    run_to_completion(&mut scheduler, 1);
    let id = scheduler.add(request(prompt, 1)).unwrap();
    let plan = scheduler.schedule();
    // Three cached blocks are reused; the fourth is recomputed to sample from.
    assert_eq!(plan, vec![ScheduledChunk { seq_id: id, start: 12, len: 4, sample: true }]);
}

#[test]
fn out_of_blocks_preempts_the_youngest_and_everything_completes() {
    // 6 blocks of 4 tokens; three sequences of 8-token prompts that grow to 16.
    let mut cfg = config(6, 4);
    cfg.max_batched_tokens = 256;
    let mut scheduler = Scheduler::new(cfg, vec![]);
    let ids: Vec<SeqId> = (0..3).map(|i| scheduler.add(request(vec![i; 8], 8)).unwrap()).collect();
    let done = run_to_completion(&mut scheduler, 9);
    assert!(scheduler.total_preemptions() > 0, "the pool is too small to run all three at once");
    for id in ids {
        assert_eq!(done[&id].0, vec![9; 8], "a preempted sequence resumes where it was");
        assert_eq!(done[&id].1, FinishReason::Length);
    }
}

#[test]
fn requests_that_cannot_fit_are_refused_and_queue_overflow_is_reported() {
    let mut cfg = config(4, 4);
    cfg.max_model_len = 100;
    cfg.max_waiting = 1;
    let mut scheduler = Scheduler::new(cfg, vec![]);
    assert!(matches!(scheduler.add(request(vec![], 1)), Err(AdmissionError::Invalid(_))));
    assert!(matches!(scheduler.add(request(vec![1], 0)), Err(AdmissionError::Invalid(_))));
    assert!(matches!(scheduler.add(request(vec![1; 90], 20)), Err(AdmissionError::Invalid(_))));
    assert!(matches!(scheduler.add(request(vec![1; 10], 10)), Err(AdmissionError::Invalid(_))), "needs 5 blocks of 4");
    scheduler.add(request(vec![1; 4], 1)).unwrap();
    assert_eq!(scheduler.add(request(vec![1; 4], 1)), Err(AdmissionError::QueueFull(1)));
}

#[test]
fn abort_frees_blocks_wherever_the_sequence_is() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let running = scheduler.add(request(vec![1; 30], 4)).unwrap();
    let plan = scheduler.schedule();
    scheduler.complete(&plan, &vec![Some(1); plan.len()]);
    let waiting = scheduler.add(request(vec![2; 4], 4)).unwrap();
    assert!(scheduler.abort(running));
    assert!(scheduler.abort(waiting));
    assert!(!scheduler.abort(waiting));
    assert_eq!(scheduler.load(), Load { running: 0, waiting: 0, blocks_used: 0, blocks_total: 64 });
    scheduler.check_invariants();
}

#[test]
fn the_sequence_limit_holds_back_admission() {
    let mut cfg = config(64, 4);
    cfg.max_num_seqs = 2;
    let mut scheduler = Scheduler::new(cfg, vec![]);
    for _ in 0..3 {
        scheduler.add(request(vec![5; 4], 3)).unwrap();
    }
    let plan = scheduler.schedule();
    assert_eq!(plan.len(), 2);
    assert_eq!(scheduler.load().waiting, 1);
}

proptest! {
    /// Any mix of prompts (sharing prefixes), budgets and pool sizes runs to
    /// completion with every invariant intact and exact token counts.
    #[test]
    fn every_request_completes_with_exact_counts(
        prompts in prop::collection::vec((prop::collection::vec(0u32..4, 1..40), 1u32..12), 1..12),
        num_blocks in 12usize..40,
        budget in 1usize..48,
        max_seqs in 1usize..6,
    ) {
        let mut cfg = config(num_blocks, 4);
        cfg.max_batched_tokens = budget;
        cfg.max_num_seqs = max_seqs;
        let mut scheduler = Scheduler::new(cfg, vec![]);
        let mut expected = HashMap::new();
        for (prompt, max_tokens) in prompts {
            let len = prompt.len();
            if let Ok(id) = scheduler.add(request(prompt, max_tokens)) {
                expected.insert(id, (len as u32, max_tokens));
            }
        }
        let done = run_to_completion(&mut scheduler, 1);
        prop_assert_eq!(done.len(), expected.len());
        for (id, (prompt_tokens, max_tokens)) in expected {
            let (tokens, reason, usage) = &done[&id];
            prop_assert_eq!(tokens.len() as u32, max_tokens);
            prop_assert_eq!(*reason, FinishReason::Length);
            prop_assert_eq!(usage.prompt_tokens, prompt_tokens);
            prop_assert_eq!(usage.completion_tokens, max_tokens);
            prop_assert!(usage.cached_prompt_tokens < prompt_tokens);
        }
        prop_assert_eq!(scheduler.load().blocks_used, 0);
    }
}

#[test]
fn only_sequences_the_next_step_could_admit_are_due_for_onboarding_once() {
    // 10 blocks of 4 tokens: each 17-token prompt needs 5.
    let mut scheduler = Scheduler::new(config(10, 4), vec![]);
    let ids: Vec<SeqId> = (0..3).map(|n| scheduler.add(request((n * 100..n * 100 + 17).collect(), 2)).unwrap()).collect();
    let due = scheduler.due_for_onboard();
    assert_eq!(due.iter().map(|(id, _)| *id).collect::<Vec<_>>(), ids[..2], "the third does not fit the free blocks");
    assert_eq!(due[0].1.len(), 4, "the blocks admission could reuse (the last token is always computed)");
    assert!(scheduler.due_for_onboard().is_empty(), "each is looked up once");
}

#[test]
fn with_a_lower_tier_a_sequence_admission_would_take_is_looked_up_first() {
    // 10 blocks of 4 tokens.
    let mut scheduler = Scheduler::new(config(10, 4), vec![]);
    scheduler.look_up_before_admission();
    let ids = |plan: &[ScheduledChunk]| plan.iter().map(|c| c.seq_id).collect::<Vec<_>>();
    let due = |scheduler: &mut Scheduler| scheduler.due_for_onboard().into_iter().map(|(id, _)| id).collect::<Vec<_>>();
    let first = scheduler.add(request((0..17).collect(), 4)).unwrap();
    assert_eq!(due(&mut scheduler), vec![first]);
    let plan = scheduler.schedule();
    assert_eq!(ids(&plan), vec![first]);
    scheduler.complete(&plan, &[Some(7)]);
    // The running sequence holds 5 blocks. A 33-token prompt sharing its
    // first 4 needs 9 blocks in one chunk, more than the 5 free, so the
    // look-up passes it over; but with its 4 blocks a hit in the pool,
    // admission needs only 5 new ones and would take it.
    let head = scheduler.add(request((0..33).collect(), 2)).unwrap();
    assert!(due(&mut scheduler).is_empty(), "it does not fit the look-up's reckoning");
    assert_eq!(ids(&scheduler.schedule()), vec![first], "admission would take it: it waits for its look-up");
    assert!(scheduler.awaits_look_up());
    assert_eq!(due(&mut scheduler), vec![head], "due at the head of the queue");
    assert!(!scheduler.awaits_look_up());
    let plan = scheduler.schedule();
    let admitted = plan.iter().find(|c| c.seq_id == head).expect("admitted once looked up");
    assert_eq!(admitted.start, 16, "with its hit in the pool");
    scheduler.check_invariants();

    // Without a lower tier nothing waits for a look-up.
    let mut plain = Scheduler::new(config(10, 4), vec![]);
    let id = plain.add(request((0..17).collect(), 4)).unwrap();
    assert_eq!(ids(&plain.schedule()), vec![id]);
}

#[test]
fn a_suspended_sequence_waits_outside_the_queue_and_resumes_at_its_front() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let first = scheduler.add(request((0..8).collect(), 2)).unwrap();
    let second = scheduler.add(request((100..108).collect(), 2)).unwrap();
    scheduler.suspend(first);
    assert_eq!(scheduler.load().waiting, 2, "a suspended sequence counts as waiting");
    let plan = scheduler.schedule();
    assert_eq!(plan.iter().map(|c| c.seq_id).collect::<Vec<_>>(), vec![second]);
    scheduler.check_invariants();
    assert!(scheduler.resume(first));
    let plan = scheduler.schedule();
    assert!(plan.iter().any(|c| c.seq_id == first), "resumed and admitted");
    scheduler.check_invariants();

    let third = scheduler.add(request((200..208).collect(), 2)).unwrap();
    scheduler.suspend(third);
    assert!(scheduler.abort(third));
    assert!(!scheduler.resume(third), "an aborted sequence does not come back");
    scheduler.check_invariants();
}

#[test]
fn a_suspended_sequence_keeps_its_room_while_its_prefix_is_fetched() {
    // 10 blocks of 4 tokens: each 17-token prompt needs 5.
    let mut scheduler = Scheduler::new(config(10, 4), vec![]);
    let ids: Vec<SeqId> = (0..3).map(|n| scheduler.add(request((n * 100..n * 100 + 17).collect(), 2)).unwrap()).collect();
    let due: Vec<SeqId> = scheduler.due_for_onboard().into_iter().map(|(id, _)| id).collect();
    assert_eq!(due, ids[..2]);
    scheduler.suspend(ids[0]);
    assert!(scheduler.due_for_onboard().is_empty(), "the third does not fit beside the suspended one");
    let plan = scheduler.schedule();
    assert_eq!(plan.iter().map(|c| c.seq_id).collect::<Vec<_>>(), ids[1..2], "only the second is admitted: the first's 5 blocks stay free");
    scheduler.check_invariants();
    // Its read done: the prefix is installed into the kept room, and it is
    // admitted with it.
    let hashes: Vec<turbine_kv::BlockHashes> = BlockHasher::with_seed(turbine_kv::DEFAULT_SEED).hash_blocks(&(0..17).collect::<Vec<u32>>(), 4);
    assert_eq!(scheduler.install_prefix(None, KvTenant::SHARED, &hashes, |_, _| true), 4, "room for the whole prefix");
    assert!(scheduler.resume(ids[0]));
    let plan = scheduler.schedule();
    let first = plan.iter().find(|c| c.seq_id == ids[0]).expect("admitted");
    assert_eq!(first.start, 16, "its installed prefix is a hit");
    scheduler.check_invariants();
}

#[test]
fn an_onboarded_prefix_evicted_before_admission_is_looked_up_again_a_bounded_number_of_times() {
    // 10 blocks of 4 tokens; the 17-token prompt reuses 4 blocks.
    let mut scheduler = Scheduler::new(config(10, 4), vec![]);
    let prompt: Vec<u32> = (0..17).collect();
    let id = scheduler.add(request(prompt.clone(), 2)).unwrap();
    let hasher = BlockHasher::with_seed(turbine_kv::DEFAULT_SEED);
    let hashes = hasher.hash_blocks(&prompt, 4);
    let other = hasher.hash_blocks(&(1_000..1_040).collect::<Vec<u32>>(), 4);
    let onboard_then_evict = |scheduler: &mut Scheduler| {
        assert_eq!(scheduler.due_for_onboard().iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), vec![id], "looked up");
        assert_eq!(scheduler.install_prefix(None, KvTenant::SHARED, &hashes, |_, _| true), 4);
        scheduler.onboarded(id, 4);
        // Another prefix installed meanwhile takes every block: the
        // onboarded one is evicted before the sequence is admitted.
        assert_eq!(scheduler.install_prefix(None, KvTenant::SHARED, &other, |_, _| true), 10);
        assert_eq!(scheduler.cached_prefix(&hashes.iter().map(|h| h.sequence).collect::<Vec<_>>()), 0);
    };
    for _ in 0..MAX_ONBOARD_RETRIES {
        onboard_then_evict(&mut scheduler);
        assert!(scheduler.schedule().is_empty(), "not admitted without its prefix: looked up again first");
        scheduler.check_invariants();
    }
    // Retries spent: lost once more, it computes its prompt.
    onboard_then_evict(&mut scheduler);
    let plan = scheduler.schedule();
    assert_eq!((plan[0].seq_id, plan[0].start), (id, 0));
    scheduler.check_invariants();

    // A prefix that stays is a hit.
    let second = scheduler.add(request(prompt, 2)).unwrap();
    run_to_completion(&mut scheduler, 7);
    let third = scheduler.add(request((0..17).collect(), 2)).unwrap();
    assert!(second < third);
    assert!(scheduler.due_for_onboard().iter().any(|(seq, _)| *seq == third));
    scheduler.onboarded(third, 4);
    let plan = scheduler.schedule();
    assert_eq!((plan[0].seq_id, plan[0].start), (third, 16), "its prefix is in the pool: admitted with it");
}

#[test]
fn a_prefix_installed_only_in_part_is_looked_up_again() {
    // 10 blocks of 4 tokens; the 17-token prompt reuses 4 blocks, which the
    // tier held, but only 2 were installed (no room for more, or a write
    // failed).
    let mut scheduler = Scheduler::new(config(10, 4), vec![]);
    let prompt: Vec<u32> = (0..17).collect();
    let hashes = BlockHasher::with_seed(turbine_kv::DEFAULT_SEED).hash_blocks(&prompt, 4);
    let id = scheduler.add(request(prompt, 2)).unwrap();
    assert_eq!(scheduler.due_for_onboard().iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), vec![id]);
    assert_eq!(scheduler.install_prefix(None, KvTenant::SHARED, &hashes, |_, index| index < 2), 2);
    scheduler.onboarded(id, 4);
    assert!(scheduler.schedule().is_empty(), "not admitted with half its prefix: looked up again first");
    assert_eq!(scheduler.due_for_onboard().iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), vec![id], "due again");
    assert_eq!(scheduler.install_prefix(Some(hashes[1].sequence), KvTenant::SHARED, &hashes[2..4], |_, _| true), 2);
    scheduler.onboarded(id, 4);
    let plan = scheduler.schedule();
    assert_eq!((plan[0].seq_id, plan[0].start), (id, 16), "admitted with the whole prefix");
    scheduler.check_invariants();
}

#[test]
fn an_onboarded_prefix_is_admitted_past_the_room_kept_for_reads_behind_it() {
    // 14 blocks of 4 tokens. A running sequence takes 5; the head's
    // 17-token prompt has 4 blocks installed from a tier and needs 1 more;
    // 5 are kept for a read behind it.
    let mut scheduler = Scheduler::new(config(14, 4), vec![]);
    let filler = scheduler.add(request((1_000..1_016).collect(), 8)).unwrap();
    let plan = scheduler.schedule();
    scheduler.complete(&plan, &[Some(7)]);
    let prompt: Vec<u32> = (0..17).collect();
    let head = scheduler.add(request(prompt.clone(), 2)).unwrap();
    let behind = scheduler.add(request((100..117).collect(), 2)).unwrap();
    assert_eq!(scheduler.due_for_onboard().iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), vec![head, behind]);
    scheduler.suspend(behind);
    let hashes = BlockHasher::with_seed(turbine_kv::DEFAULT_SEED).hash_blocks(&prompt, 4);
    assert_eq!(scheduler.install_prefix(None, KvTenant::SHARED, &hashes, |_, _| true), 4);
    scheduler.onboarded(head, 4);
    let plan = scheduler.schedule();
    assert_eq!(plan.iter().map(|c| (c.seq_id, c.start)).collect::<Vec<_>>(), vec![(filler, 16), (head, 16)], "admitted with its prefix");
    scheduler.check_invariants();

    scheduler.complete(&plan, &[Some(8), Some(9)]);

    // A sequence with nothing onboarded still leaves the kept room alone.
    let cold = scheduler.add(request((200..204).collect(), 2)).unwrap();
    let plan = scheduler.schedule();
    assert!(plan.iter().all(|c| c.seq_id != cold), "4 blocks free, 5 kept for the read: it waits ({plan:?})");
    scheduler.check_invariants();
}

fn tenant_request(tenant: u64) -> GenerateRequest {
    GenerateRequest { kv_tenant: KvTenant::new(tenant), ..request(vec![1, 2, 3, 4, 5], 2) }
}

#[test]
fn tenants_take_turns_in_the_queue() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let first: Vec<SeqId> = (0..6).map(|_| scheduler.add(tenant_request(1)).unwrap()).collect();
    let second: Vec<SeqId> = (0..2).map(|_| scheduler.add(tenant_request(2)).unwrap()).collect();
    let queued: Vec<SeqId> = scheduler.waiting.iter().copied().collect();
    assert_eq!(
        queued,
        vec![first[0], second[0], first[1], second[1], first[2], first[3], first[4], first[5]],
        "the second tenant's requests do not wait behind all of the first's"
    );
    let done = run_to_completion(&mut scheduler, 9);
    assert_eq!(done.len(), 8);
}

#[test]
fn one_tenant_is_served_first_come_first_served() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    let ids: Vec<SeqId> = (0..5).map(|_| scheduler.add(tenant_request(0)).unwrap()).collect();
    assert_eq!(scheduler.waiting.iter().copied().collect::<Vec<_>>(), ids);
}

#[test]
fn a_tenant_new_to_the_queue_takes_its_turn_from_now() {
    let mut scheduler = Scheduler::new(SchedulerConfig { max_num_seqs: 2, ..config(64, 4) }, vec![]);
    let first: Vec<SeqId> = (0..4).map(|_| scheduler.add(tenant_request(1)).unwrap()).collect();
    let plan = scheduler.schedule();
    assert_eq!(plan.iter().map(|chunk| chunk.seq_id).collect::<Vec<_>>(), first[..2]);
    // Two turns were taken: a tenant with nothing queued takes the next
    // one, but saved none up (its second request comes after first[2]).
    let late: Vec<SeqId> = (0..2).map(|_| scheduler.add(tenant_request(2)).unwrap()).collect();
    assert_eq!(scheduler.waiting.iter().copied().collect::<Vec<_>>(), vec![late[0], first[2], late[1], first[3]]);
    scheduler.check_invariants();
}

#[test]
fn a_tenants_long_requests_take_turns_by_their_tokens() {
    let mut scheduler = Scheduler::new(config(64, 4), vec![]);
    // 50 + 2 tokens each, against 5 + 2.
    let long = || GenerateRequest { kv_tenant: KvTenant::new(1), ..request(vec![7; 50], 2) };
    let first: Vec<SeqId> = (0..2).map(|_| scheduler.add(long()).unwrap()).collect();
    let second: Vec<SeqId> = (0..4).map(|_| scheduler.add(tenant_request(2)).unwrap()).collect();
    let queued: Vec<SeqId> = scheduler.waiting.iter().copied().collect();
    assert_eq!(
        queued,
        vec![first[0], second[0], second[1], second[2], second[3], first[1]],
        "the short requests are not held behind the long ones turn for turn"
    );
    assert_eq!(run_to_completion(&mut scheduler, 9).len(), 6);
}

#[test]
fn tenants_with_nothing_queued_are_forgotten() {
    let mut scheduler = Scheduler::new(SchedulerConfig { max_num_seqs: 64, ..config(1024, 4) }, vec![]);
    for tenant in 1..=40 {
        scheduler.add(tenant_request(tenant)).unwrap();
    }
    run_to_completion(&mut scheduler, 9);
    scheduler.add(tenant_request(99)).unwrap();
    assert!(scheduler.turns.latest.len() <= 1, "{} tenants remembered", scheduler.turns.latest.len());
}
