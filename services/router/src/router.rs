//! The router's state: the live workers (mirrored from the registry), the
//! requests booked against each, and the decision itself. No transport.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use turbine_kv::{BlockHasher, SequenceHash, WorkerMatch};
use turbine_registry::{LiveWorker, WorkerLoad, WorkerRole};

use crate::kv::{KvCandidate, KvOverrides, KvState};
use crate::policy::{Candidate, Policy, choose};

/// A request to route.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RouteRequest {
    /// Caller's id, unique per request; `finished` refers to it.
    pub request_id: String,
    /// Requested model.
    pub model: String,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Overrides the configured policy.
    pub policy: Option<Policy>,
    /// Workers not to choose.
    pub exclude_worker_ids: Vec<String>,
    /// The prompt's token ids (the `kv` policy matches them against the
    /// index; other policies ignore them).
    pub token_ids: Arc<[u32]>,
    /// Per-request overrides of the `kv` cost function.
    pub kv: Option<KvOverrides>,
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// The chosen worker.
    pub worker: RoutedWorker,
    /// Requests booked against it, this one included.
    pub in_flight: u32,
    /// Prompt blocks (complete and partial) in the chosen worker's block size.
    pub prompt_blocks: u32,
    /// Leading prompt blocks the chosen worker caches, per the index
    /// (0 unless the `kv` policy routed).
    pub overlap_blocks: u32,
    /// Disaggregated serving: compute the prompt on this prefill worker,
    /// then decode on `worker`. `None`: `worker` does everything.
    pub prefill: Option<RoutedWorker>,
}

/// When a prompt is computed on a prefill worker instead of its decode
/// worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisaggPolicy {
    /// Prompts with more uncached tokens than this (on the chosen decode
    /// worker) go to a prefill worker; shorter ones are computed locally.
    pub threshold_tokens: u32,
    /// The prefill pool is saturated (prompts are computed locally) when
    /// every prefill worker has this many prefills booked or queued.
    pub max_prefill_queue: u32,
}

impl Default for DisaggPolicy {
    fn default() -> Self {
        Self { threshold_tokens: 256, max_prefill_queue: 8 }
    }
}

/// Suffix of the booking key of a request's prefill on a prefill worker.
const PREFILL_BOOKING: &str = "\u{0}prefill";

/// A live worker as the router reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedWorker {
    /// Worker id.
    pub worker_id: String,
    /// Where to reach it (`http://...`, or `local://<id>` in one process).
    pub endpoint: String,
    /// Model served.
    pub model: String,
    /// Last reported load.
    pub load: WorkerLoad,
    /// Requests booked against it.
    pub in_flight: u32,
    /// Its part in disaggregated serving.
    pub role: WorkerRole,
}

/// Why no worker was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No live worker serves the model (or all that do were excluded).
    #[error("no live worker serves model {0:?}")]
    NoWorkers(String),
    /// The request is malformed.
    #[error("{0}")]
    InvalidRequest(String),
}

#[derive(Debug)]
struct Booking {
    worker_id: String,
    booked_at: Instant,
    /// Blocks still to prefill (0 once the first token came).
    prefill_blocks: u64,
    /// Blocks of the sequence.
    decode_blocks: u64,
}

/// What is booked against one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerBook {
    /// Requests booked.
    pub in_flight: u32,
    /// Their blocks still to prefill.
    pub prefill_blocks: u64,
    /// Their blocks in all.
    pub decode_blocks: u64,
}

impl std::ops::Add for WorkerBook {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            in_flight: self.in_flight + other.in_flight,
            prefill_blocks: self.prefill_blocks + other.prefill_blocks,
            decode_blocks: self.decode_blocks + other.decode_blocks,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Live workers by id (ordered, for stable round-robin).
    workers: BTreeMap<String, LiveWorker>,
    /// Bookings by request id.
    bookings: FxHashMap<String, Booking>,
    /// Booked work per worker.
    books: FxHashMap<String, WorkerBook>,
    /// Work other router replicas booked per worker (as they last
    /// published it): counted in decisions, never released here.
    peers: FxHashMap<String, WorkerBook>,
}

impl State {
    /// Releases a request's bookings (its prefill's too).
    fn release(&mut self, request_id: &str) -> bool {
        self.release_one(&format!("{request_id}{PREFILL_BOOKING}"));
        self.release_one(request_id)
    }

    fn release_one(&mut self, request_id: &str) -> bool {
        let Some(booking) = self.bookings.remove(request_id) else { return false };
        if let Some(book) = self.books.get_mut(&booking.worker_id) {
            book.in_flight = book.in_flight.saturating_sub(1);
            book.prefill_blocks = book.prefill_blocks.saturating_sub(booking.prefill_blocks);
            book.decode_blocks = book.decode_blocks.saturating_sub(booking.decode_blocks);
            crate::metrics::in_flight(&booking.worker_id, book.in_flight);
            if book.in_flight == 0 {
                self.books.remove(&booking.worker_id);
            }
        }
        true
    }

    fn book(&mut self, request_id: &str, worker_id: &str, now: Instant, prefill_blocks: u64, decode_blocks: u64) {
        let booking = Booking { worker_id: worker_id.to_owned(), booked_at: now, prefill_blocks, decode_blocks };
        self.bookings.insert(request_id.to_owned(), booking);
        let book = self.books.entry(worker_id.to_owned()).or_default();
        book.in_flight += 1;
        book.prefill_blocks += prefill_blocks;
        book.decode_blocks += decode_blocks;
        crate::metrics::in_flight(worker_id, book.in_flight);
    }

    fn prefill_done(&mut self, request_id: &str) -> bool {
        // A prefill worker's part ends with the prefill.
        self.release_one(&format!("{request_id}{PREFILL_BOOKING}"));
        let Some(booking) = self.bookings.get_mut(request_id) else { return false };
        let blocks = std::mem::take(&mut booking.prefill_blocks);
        if let Some(book) = self.books.get_mut(&booking.worker_id) {
            book.prefill_blocks = book.prefill_blocks.saturating_sub(blocks);
        }
        true
    }

    fn book_of(&self, worker_id: &str) -> WorkerBook {
        self.books.get(worker_id).copied().unwrap_or_default()
    }

    /// This router's bookings plus the other replicas': what decisions weigh.
    fn load_of(&self, worker_id: &str) -> WorkerBook {
        self.book_of(worker_id) + self.peers.get(worker_id).copied().unwrap_or_default()
    }
}

/// Index matches keyed by worker id.
type MatchesByWorker = FxHashMap<Arc<str>, WorkerMatch>;

/// Per block size: the prompt's hashes and the index's matches.
type Prefetched = Vec<(u32, Vec<SequenceHash>, MatchesByWorker)>;

/// What a remote kv-index answered before the decision.
#[derive(Debug, Default)]
struct Remote {
    by_size: Prefetched,
    /// Cached tree sizes of the candidates.
    cached_blocks: FxHashMap<String, usize>,
}

/// The prompt's block hashes in each block size the candidates use.
struct PromptHashes<'a> {
    tokens: &'a [u32],
    hasher: BlockHasher,
    by_size: Prefetched,
}

impl PromptHashes<'_> {
    /// Hashes and index matches for `block_size` (computed once per size).
    fn matches(&mut self, block_size: u32, kv: &KvState) -> &MatchesByWorker {
        let at = match self.by_size.iter().position(|(size, _, _)| *size == block_size) {
            Some(at) => at,
            None => {
                let hashes = self.hasher.sequence_hashes(self.tokens, block_size as usize);
                let matches = kv.index().find_matches(&hashes).iter().map(|m| (m.worker_id.clone(), m)).collect();
                self.by_size.push((block_size, hashes, matches));
                self.by_size.len() - 1
            }
        };
        &self.by_size[at].2
    }

    fn hashes(&self, block_size: u32) -> &[SequenceHash] {
        self.by_size.iter().find(|(size, _, _)| *size == block_size).map_or(&[], |(_, hashes, _)| hashes)
    }
}

/// The routing core shared by the gRPC service and in-process callers.
#[derive(Debug)]
pub struct Router {
    policy: Policy,
    disagg: DisaggPolicy,
    kv: Option<Arc<KvState>>,
    /// A booking never released is dropped after this long.
    booking_ttl: Duration,
    state: Mutex<State>,
    turn: AtomicUsize,
}

impl Router {
    /// A router with no workers yet.
    pub fn new(policy: Policy, booking_ttl: Duration) -> Self {
        Self { policy, disagg: DisaggPolicy::default(), kv: None, booking_ttl, state: Mutex::new(State::default()), turn: AtomicUsize::new(0) }
    }

    /// A router that can route on KV cache overlap (the `kv` policy).
    pub fn with_kv(policy: Policy, booking_ttl: Duration, kv: Arc<KvState>) -> Self {
        Self { kv: Some(kv), ..Self::new(policy, booking_ttl) }
    }

    /// Sets when prompts go to prefill workers.
    pub fn with_disagg(mut self, disagg: DisaggPolicy) -> Self {
        self.disagg = disagg;
        self
    }

    /// The KV routing state, if this router has one.
    pub fn kv(&self) -> Option<&Arc<KvState>> {
        self.kv.as_ref()
    }

    /// The configured policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Replaces the live worker set with a fresh registry listing. Bookings
    /// against workers that left are dropped.
    pub fn update_workers(&self, workers: Vec<LiveWorker>) {
        let mut state = self.state.lock();
        let joined: Vec<&str> = workers.iter().map(|w| w.record.worker_id.as_str()).filter(|id| !state.workers.contains_key(*id)).collect();
        if !joined.is_empty() {
            tracing::info!(workers = ?joined, "workers joined");
        }
        let fresh: BTreeMap<String, LiveWorker> = workers.into_iter().map(|w| (w.record.worker_id.clone(), w)).collect();
        let left: Vec<String> = state.workers.keys().filter(|id| !fresh.contains_key(*id)).cloned().collect();
        if !left.is_empty() {
            tracing::info!(workers = ?left, "workers left");
        }
        state.workers = fresh;
        forget_bookings_of(&mut state, &left);
        drop(state);
        self.forget_cache_of(&left);
    }

    /// Adds and refreshes the listed workers but keeps the unlisted ones
    /// until their known lease deadline (used right after the registry's
    /// Redis restarted empty: workers re-register within one renewal).
    pub fn merge_workers(&self, workers: Vec<LiveWorker>) {
        let mut state = self.state.lock();
        for worker in workers {
            if !state.workers.contains_key(&worker.record.worker_id) {
                tracing::info!(worker = worker.record.worker_id, "worker joined");
            }
            state.workers.insert(worker.record.worker_id.clone(), worker);
        }
    }

    /// A worker that left (or whose lease ran out) loses its blocks in the
    /// index: its cache is gone or unreachable.
    fn forget_cache_of(&self, workers: &[String]) {
        if let Some(kv) = &self.kv {
            for id in workers {
                kv.index().remove_worker(id);
            }
        }
    }

    /// Keeps the workers whose lease is still running alive for `extension`
    /// past now (used while the registry is unreachable: leases cannot be
    /// renewed then either). A lease that already ran out stays expired.
    pub fn extend_leases(&self, extension: Duration) {
        let now = Instant::now();
        let mut state = self.state.lock();
        for worker in state.workers.values_mut().filter(|worker| worker.expires_at > now) {
            worker.expires_at = worker.expires_at.max(now + extension);
        }
    }

    /// Drops workers whose lease ran out and bookings older than the TTL.
    pub fn expire(&self, now: Instant) {
        let mut state = self.state.lock();
        let expired: Vec<String> = state.workers.iter().filter(|(_, w)| w.expires_at <= now).map(|(id, _)| id.clone()).collect();
        if !expired.is_empty() {
            tracing::info!(workers = ?expired, "worker leases expired");
            for id in &expired {
                state.workers.remove(id);
            }
            forget_bookings_of(&mut state, &expired);
            self.forget_cache_of(&expired);
        }
        if let Some(kv) = &self.kv {
            kv.expire(now);
        }
        let stale: Vec<String> = state
            .bookings
            .iter()
            .filter(|(_, booking)| now.duration_since(booking.booked_at) > self.booking_ttl)
            .map(|(id, _)| id.clone())
            .collect();
        for request_id in stale {
            tracing::warn!(request_id, "booking never released; dropping it");
            state.release(&request_id);
        }
    }

    /// Chooses a worker and books the request against it. With a remote
    /// kv-index ([`KvState::with_remote`]) only [`route_async`]
    /// (Self::route_async) asks it; this routes `kv` requests by load.
    pub fn route(&self, request: &RouteRequest) -> Result<Routed, RouteError> {
        let remote = if self.kv.as_ref().is_some_and(|kv| kv.remote().is_some()) { Some(None) } else { None };
        self.decide(request, remote)
    }

    /// [`route`](Self::route), asking the remote kv-index first when there
    /// is one and the request is routed by `kv`. If it cannot answer (down,
    /// slow, or stale), the request is routed by load.
    pub async fn route_async(&self, request: &RouteRequest) -> Result<Routed, RouteError> {
        let remote = match &self.kv {
            Some(kv) if request.policy.unwrap_or(self.policy) == Policy::Kv => kv.remote(),
            _ => None,
        };
        let Some(remote) = remote.filter(|_| !request.request_id.is_empty()) else { return self.decide(request, None) };
        // The model's workers (their tree sizes break ties) and block sizes.
        let (candidates, sizes) = {
            let state = self.state.lock();
            let now = Instant::now();
            let workers: Vec<&LiveWorker> = state.workers.values().filter(|w| w.record.model == request.model && w.expires_at > now).collect();
            let mut sizes: Vec<u32> = workers.iter().map(|w| w.record.kv_block_size).filter(|&size| size > 0).collect();
            sizes.sort_unstable();
            sizes.dedup();
            (workers.iter().map(|w| w.record.worker_id.clone()).collect::<Vec<String>>(), sizes)
        };
        let hasher = BlockHasher::default();
        let mut fetched = Remote::default();
        for size in sizes {
            let hashes = hasher.sequence_hashes(&request.token_ids, size as usize);
            // Tree sizes with the first lookup only.
            let names = if fetched.by_size.is_empty() { candidates.as_slice() } else { &[] };
            match remote.find_matches(&hashes, names).await {
                Ok(answer) => {
                    fetched.by_size.push((size, hashes, answer.matches.into_iter().map(|m| (m.worker_id.clone(), m)).collect()));
                    fetched.cached_blocks.extend(answer.cached_blocks);
                }
                Err(error) => {
                    crate::metrics::kv_index_error(error.name());
                    return self.decide(request, Some(None));
                }
            }
        }
        self.decide(request, Some(Some(fetched)))
    }

    /// The decision. `remote`: `None` without a remote kv-index, else its
    /// answers per block size (`Some(None)`: it could not answer).
    fn decide(&self, request: &RouteRequest, remote: Option<Option<Remote>>) -> Result<Routed, RouteError> {
        if request.request_id.is_empty() {
            return Err(RouteError::InvalidRequest("request_id must not be empty".into()));
        }
        let mut policy = request.policy.unwrap_or(self.policy);
        let remote_failed = matches!(remote, Some(None));
        let kv = match (policy, &self.kv) {
            // The index is stale while its event log (or the remote
            // kv-index) is unreachable: load only.
            (Policy::Kv, Some(kv)) if !kv.usable() || remote_failed => {
                policy = Policy::LeastLoaded;
                None
            }
            (Policy::Kv, Some(kv)) => Some(kv),
            (Policy::Kv, None) => return Err(RouteError::InvalidRequest("this router has no KV index; the kv policy is unavailable".into())),
            _ => None,
        };
        let weights = match (kv, &request.kv) {
            (Some(kv), Some(overrides)) => {
                let weights = overrides.apply(kv.config().weights);
                weights.validate().map_err(RouteError::InvalidRequest)?;
                Some(weights)
            }
            (Some(kv), None) => Some(kv.config().weights),
            _ => None,
        };
        let now = Instant::now();
        let Remote { by_size, cached_blocks: remote_trees } = remote.flatten().unwrap_or_default();
        let mut prompt = PromptHashes { tokens: &request.token_ids, hasher: BlockHasher::default(), by_size };
        let mut state = self.state.lock();
        // A retried request id replaces its earlier booking.
        state.release(&request.request_id);
        let eligible: Vec<&LiveWorker> = state
            .workers
            .values()
            .filter(|w| w.record.model == request.model && w.expires_at > now && !request.exclude_worker_ids.contains(&w.record.worker_id))
            .collect();
        // Prefill workers only compute prompts for the others.
        let (prefill_pool, eligible): (Vec<&LiveWorker>, Vec<&LiveWorker>) = eligible.into_iter().partition(|w| w.record.role == WorkerRole::Prefill);
        if eligible.is_empty() {
            return Err(RouteError::NoWorkers(request.model.clone()));
        }
        let prompt_tokens = (request.prompt_tokens as usize).max(request.token_ids.len());
        let prompt_blocks = |w: &LiveWorker| prompt_tokens.div_ceil(w.record.kv_block_size.max(1) as usize) as u32;
        let (index, overlap_blocks) = match (kv, weights) {
            (Some(kv), Some(weights)) => {
                let trees = if kv.remote().is_some() {
                    eligible.iter().map(|w| remote_trees.get(&w.record.worker_id).copied().unwrap_or(0)).collect()
                } else {
                    kv.index().cached_blocks_of(eligible.iter().map(|w| w.record.worker_id.as_str()))
                };
                let candidates: Vec<KvCandidate> = eligible
                    .iter()
                    .zip(trees)
                    .map(|(w, cached_tree)| {
                        let id = &w.record.worker_id;
                        let book = state.load_of(id);
                        let matched = if w.record.kv_block_size == 0 { None } else { prompt.matches(w.record.kv_block_size, kv).get(id.as_str()) };
                        KvCandidate {
                            prompt_blocks: prompt_blocks(w),
                            active_prefill_blocks: book.prefill_blocks,
                            active_decode_blocks: book.decode_blocks,
                            cached_tree,
                            ..KvCandidate::default()
                        }
                        .with_match(matched)
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
        let chosen = &eligible[index].record;
        let chosen_blocks = prompt_blocks(eligible[index]);
        let routed = RoutedWorker {
            worker_id: chosen.worker_id.clone(),
            endpoint: chosen.endpoint.clone(),
            model: chosen.model.clone(),
            load: chosen.load,
            in_flight: state.book_of(&chosen.worker_id).in_flight + 1,
            role: chosen.role,
        };
        let block_size = chosen.kv_block_size;
        let uncached = u64::from(chosen_blocks.saturating_sub(overlap_blocks));
        let uncached_tokens = prompt_tokens.saturating_sub(overlap_blocks as usize * block_size.max(1) as usize);
        let prefill = self.choose_prefill(&state, &prefill_pool, chosen.role, uncached_tokens).map(|w| w.record.clone());
        let no_prefill_pool = prefill_pool.is_empty();
        let prefill = prefill.map(|record| {
            let blocks = prompt_tokens.div_ceil(record.kv_block_size.max(1) as usize) as u64;
            state.book(&format!("{}{PREFILL_BOOKING}", request.request_id), &record.worker_id, now, blocks, blocks);
            RoutedWorker {
                worker_id: record.worker_id.clone(),
                endpoint: record.endpoint.clone(),
                model: record.model.clone(),
                load: record.load,
                in_flight: state.book_of(&record.worker_id).in_flight,
                role: record.role,
            }
        });
        // A decode worker given a prefill computes only the prompt's tail.
        let own_prefill = if prefill.is_some() { 0 } else { uncached };
        state.book(&request.request_id, &routed.worker_id, now, own_prefill, u64::from(chosen_blocks));
        drop(state);
        if let Some(kv) = kv {
            if block_size > 0 {
                // Approximate mode learns from its own decision.
                prompt.matches(block_size, kv);
                kv.record_decision(&routed.worker_id, prompt.hashes(block_size), now);
            }
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

    /// Marks a request's prefill done (its first token came): its blocks
    /// stop counting as prefill work. False if there was no booking.
    pub fn prefill_done(&self, request_id: &str) -> bool {
        self.state.lock().prefill_done(request_id)
    }

    /// Releases a booking; false if there was none.
    pub fn finished(&self, request_id: &str) -> bool {
        self.state.lock().release(request_id)
    }

    /// Live workers, by id, optionally only those serving `model`.
    pub fn workers(&self, model: Option<&str>) -> Vec<RoutedWorker> {
        let now = Instant::now();
        let state = self.state.lock();
        state
            .workers
            .values()
            .filter(|w| w.expires_at > now && model.is_none_or(|m| w.record.model == m))
            .map(|w| RoutedWorker {
                worker_id: w.record.worker_id.clone(),
                endpoint: w.record.endpoint.clone(),
                model: w.record.model.clone(),
                load: w.record.load,
                in_flight: state.book_of(&w.record.worker_id).in_flight,
                role: w.record.role,
            })
            .collect()
    }

    /// This router's booked work per worker (what it shares with the
    /// other replicas).
    pub fn own_books(&self) -> FxHashMap<String, WorkerBook> {
        self.state.lock().books.clone()
    }

    /// Replaces the work the other router replicas booked per worker.
    pub fn set_peer_books(&self, peers: FxHashMap<String, WorkerBook>) {
        self.state.lock().peers = peers;
    }

    /// Requests booked and not released.
    pub fn total_in_flight(&self) -> usize {
        self.state.lock().bookings.len()
    }
}

fn forget_bookings_of(state: &mut State, workers: &[String]) {
    if workers.is_empty() {
        return;
    }
    state.bookings.retain(|_, booking| !workers.contains(&booking.worker_id));
    for id in workers {
        state.books.remove(id);
    }
}

#[cfg(test)]
mod tests;
