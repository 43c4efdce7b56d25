//! The decision: given the request, what the index said and what is
//! booked, choose the worker (and the prefill worker) and book. Pure
//! bookkeeping under the router's lock: no I/O.

use std::sync::atomic::Ordering;
use std::time::Instant;

use turbine_registry::{FormatKind, LiveWorker, WorkerRole};

use super::book::State;
use super::{RouteError, RouteRequest, Routed, RoutedWorker, Router};
use crate::kv::{KvCandidate, KvView};
use crate::policy::{Candidate, Policy, choose};

impl Router {
    /// Chooses a worker for `request` with what the KV index said (`view`)
    /// and books the request against it.
    pub fn decide(&self, request: &RouteRequest, view: KvView) -> Result<Routed, RouteError> {
        if request.request_id.is_empty() {
            return Err(RouteError::InvalidRequest("request_id must not be empty".into()));
        }
        let mut policy = request.policy.unwrap_or(self.policy);
        let kv = match (policy, &self.kv, view) {
            (Policy::Kv, None, _) => {
                return Err(RouteError::InvalidRequest("this router has no KV index; the kv policy is unavailable".into()));
            }
            (Policy::Kv, Some(kv), KvView::Matched(lookup)) => Some((kv, lookup)),
            // The index could not answer (or was not asked): load only.
            (Policy::Kv, Some(_), KvView::Unavailable | KvView::NotAsked) => {
                policy = Policy::LeastLoaded;
                None
            }
            _ => None,
        };
        let weights = match (&kv, &request.kv) {
            (Some((kv, _)), Some(overrides)) => {
                let weights = kv.weights().overridden_by(overrides);
                weights.validate().map_err(|invalid| RouteError::InvalidRequest(invalid.to_string()))?;
                Some(weights)
            }
            (Some((kv, _)), None) => Some(kv.weights()),
            (None, _) => None,
        };
        let now = Instant::now();
        let mut state = self.state.lock();
        // A retried request id replaces its earlier booking.
        state.release(&request.request_id);
        let serving: Vec<&LiveWorker> =
            state.workers.values().filter(|w| w.record.model == request.model && w.expires_at > now && w.serves_tenant(request.kv_tenant)).collect();
        // Engines that share one cache among all requests take only the
        // shared namespace's: a tenant's prompt is never cached beside
        // another's there.
        let (serving, sharing): (Vec<&LiveWorker>, Vec<&LiveWorker>) = serving.into_iter().partition(|w| w.keeps_apart(request.cache_salt));
        // Only engines that keep to the output's format generate it.
        let (serving, unfit): (Vec<&LiveWorker>, Vec<&LiveWorker>) = serving.into_iter().partition(|w| w.holds(request.output, request.output_continued));
        let fit = !serving.is_empty();
        let mut eligible: Vec<&LiveWorker> = serving.into_iter().filter(|w| !request.exclude_worker_ids.contains(&w.record.worker_id)).collect();
        // A schema goes to an engine that holds output to any schema while
        // one is live; one of the core subset only (the native engine's)
        // takes it otherwise, and refuses a schema beyond it.
        if request.output == FormatKind::JsonSchema && eligible.iter().any(|w| w.record.output_formats.json_schema) {
            eligible.retain(|w| w.record.output_formats.json_schema);
        }
        // Prefill workers only compute prompts for the others.
        let (prefill_pool, eligible): (Vec<&LiveWorker>, Vec<&LiveWorker>) = eligible.into_iter().partition(|w| w.record.role == WorkerRole::Prefill);
        let (prefill_pool, eligible) = (own_pool_first(prefill_pool), own_pool_first(eligible));
        if eligible.is_empty() {
            // Only when no worker could ever serve it is the request told
            // why; the fit ones all excluded (failed) is a passing state.
            let model = request.model.clone();
            return Err(match (fit, unfit.is_empty(), sharing.is_empty()) {
                (false, false, _) => RouteError::NoneHoldsFormat { model, format: request.output.name(), continued: request.output_continued },
                (false, true, false) => RouteError::NoneKeepsApart(model),
                _ => RouteError::NoWorkers(model),
            });
        }
        let prompt_tokens = (request.prompt_tokens as usize).max(request.token_ids.len());
        let prompt_blocks = |w: &LiveWorker| prompt_tokens.div_ceil(w.record.kv_block_size.max(1) as usize) as u32;
        let full_blocks = |w: &LiveWorker| (prompt_tokens / w.record.kv_block_size.max(1) as usize) as u32;
        let (index, overlap_blocks) = match (&kv, weights) {
            (Some((_, lookup)), Some(weights)) => {
                let trees = lookup.cached_trees_of(eligible.iter().map(|w| &w.record.worker_id));
                let candidates: Vec<KvCandidate> = eligible
                    .iter()
                    .zip(trees)
                    .map(|(w, cached_tree)| {
                        let id = &w.record.worker_id;
                        let book = state.load_of(id);
                        KvCandidate {
                            prompt_blocks: prompt_blocks(w),
                            active_prefill_blocks: book.prefill_blocks,
                            active_decode_blocks: book.decode_blocks,
                            cached_tree,
                            read_costs: measured_costs(w, request),
                            ..KvCandidate::default()
                        }
                        .with_match(lookup.matched(w.record.kv_block_size, id))
                        .with_store_match(w.record.kv_store.as_ref().and_then(|store| lookup.matched(w.record.kv_block_size, &store.name)))
                        .with_prompt_computed(computing_prompt(w, request).then(|| full_blocks(w)))
                    })
                    .collect();
                let index = crate::kv::choose(&weights, &candidates, &mut rand::rng());
                (index, candidates[index].matched())
            }
            _ => {
                let candidates: Vec<Candidate> = eligible
                    .iter()
                    .map(|w| Candidate {
                        in_flight: state.load_of(&w.record.worker_id).in_flight,
                        reported_queue: w.record.load.running + w.record.load.waiting,
                        blocks_used: w.record.load.blocks_used,
                        blocks_total: w.record.load.blocks_total,
                    })
                    .collect();
                let turn = self.turn.fetch_add(1, Ordering::Relaxed);
                (choose(policy, &candidates, turn, &mut rand::rng()), 0)
            }
        };
        let chosen = eligible[index];
        let chosen_blocks = prompt_blocks(chosen);
        let block_size = chosen.record.kv_block_size;
        let routed = routed_of(chosen, state.book_of(&chosen.record.worker_id).in_flight + 1);
        let uncached = u64::from(chosen_blocks.saturating_sub(overlap_blocks));
        let uncached_tokens = prompt_tokens.saturating_sub(overlap_blocks as usize * block_size.max(1) as usize);
        let prefill = self.choose_prefill(&state, &prefill_pool, chosen.record.role, uncached_tokens).cloned();
        let no_prefill_pool = prefill_pool.is_empty();
        let prefill = prefill.map(|worker| {
            let blocks = prompt_tokens.div_ceil(worker.record.kv_block_size.max(1) as usize) as u64;
            state.book_prefill(&request.request_id, &worker.record.worker_id, now, blocks);
            routed_of(&worker, state.book_of(&worker.record.worker_id).in_flight)
        });
        // A decode worker given a prefill computes only the prompt's tail.
        let own_prefill = if prefill.is_some() { 0 } else { uncached };
        state.book(&request.request_id, &routed.worker_id, now, own_prefill, u64::from(chosen_blocks));
        drop(state);
        if let Some((kv, lookup)) = &kv {
            // Approximate mode learns from its own decision.
            kv.record_decision(&routed.worker_id, lookup.hashes(block_size), now);
            crate::metrics::kv_overlap(overlap_blocks, chosen_blocks);
        }
        let in_flight = routed.in_flight;
        crate::metrics::disagg_decision(match (&prefill, no_prefill_pool) {
            (Some(_), _) => "remote",
            (None, true) => "aggregated",
            (None, false) => "local",
        });
        Ok(Routed { worker: routed, in_flight, prompt_blocks: chosen_blocks, overlap_blocks, prefill })
    }

    /// The prefill worker for a prompt with `uncached_tokens` not cached on
    /// its decode worker: none when the decode worker is an aggregated one,
    /// the prompt is short, or every prefill worker is saturated; else the
    /// one with the least prefill work booked and queued.
    fn choose_prefill<'w>(&self, state: &State, pool: &[&'w LiveWorker], decode_role: WorkerRole, uncached_tokens: usize) -> Option<&'w LiveWorker> {
        if pool.is_empty() || decode_role != WorkerRole::Decode || uncached_tokens <= self.disagg.threshold_tokens as usize {
            return None;
        }
        let queue = |w: &LiveWorker| state.load_of(&w.record.worker_id).in_flight + w.record.load.waiting;
        let best = pool.iter().min_by_key(|w| (queue(w), state.load_of(&w.record.worker_id).prefill_blocks))?;
        if queue(best) >= self.disagg.max_prefill_queue {
            return None;
        }
        Some(*best)
    }
}

/// Whether `worker` is computing the request's prompt for another of its
/// choices now: the request names it, and it is an aggregated worker (a
/// decode worker receives prompts from prefill workers, so a choice sent
/// there beside the first would compute the prompt itself, among the
/// decodes).
fn computing_prompt(worker: &LiveWorker, request: &RouteRequest) -> bool {
    request.prefix_worker.as_ref() == Some(&worker.record.worker_id) && worker.record.role == WorkerRole::Aggregated
}

/// `workers` (each allowed the request's tenant) narrowed to the tenant's
/// own pool: the workers whose certificates are limited to it (and the
/// few others it may name), while any is eligible; else the unlimited
/// ones. A tenant given a pool is served there, and no other tenant's
/// request lands on it (it is not allowed theirs).
fn own_pool_first(mut workers: Vec<&LiveWorker>) -> Vec<&LiveWorker> {
    if workers.iter().any(|w| w.kv_tenants.is_some()) {
        workers.retain(|w| w.kv_tenants.is_some());
    }
    workers
}

/// `worker`'s measured read costs, less the tiers whose credit the request
/// set itself (an explicit credit wins over the measurement).
fn measured_costs(worker: &LiveWorker, request: &RouteRequest) -> turbine_registry::ReadCosts {
    let mut costs = worker.record.read_costs;
    if let Some(overrides) = &request.kv {
        if overrides.host_credit.is_some() {
            costs.host = None;
        }
        if overrides.disk_credit.is_some() {
            costs.disk = None;
        }
        if overrides.remote_credit.is_some() {
            costs.remote = None;
        }
    }
    costs
}

/// A live worker as reported, with `in_flight` bookings.
pub(super) fn routed_of(worker: &LiveWorker, in_flight: u32) -> RoutedWorker {
    let record = &worker.record;
    RoutedWorker {
        worker_id: record.worker_id.clone(),
        endpoint: record.endpoint.clone(),
        model: record.model.clone(),
        load: record.load,
        in_flight,
        role: record.role,
        kv_tenants: worker.kv_tenants.as_deref().map_or_else(Vec::new, <[_]>::to_vec),
        output_formats: record.output_formats,
    }
}
