//! The router: the live workers (mirrored from the registry), the requests
//! booked against each, and the decision. No transport: callers reach it
//! through a `RouterClient`, in this process or over gRPC.
//!
//! - [`Router::route`]: the one entry point; asks the KV index (through
//!   its client, for `kv` decisions) and then decides.
//! - [`decide`]: the decision itself, synchronous, from what the index said.
//! - [`book`]: bookings per worker and per request.
//! - [`types`]: requests, decisions, errors.

mod book;
mod decide;
mod types;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use turbine_kv::WorkerId;
use turbine_registry::LiveWorker;

use book::State;
pub use book::WorkerBook;
use decide::routed_of;
pub use types::{DisaggPolicy, RouteError, RouteRequest, Routed, RoutedWorker};

use crate::kv::{KvState, KvView};
use crate::policy::Policy;

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

    /// Chooses a worker and books the request against it. A `kv` request
    /// asks the KV index first; when it cannot answer (down, slow, or its
    /// event log unreachable), the request is routed by load.
    pub async fn route(&self, request: &RouteRequest) -> Result<Routed, RouteError> {
        let view = match &self.kv {
            Some(kv) if request.policy.unwrap_or(self.policy) == Policy::Kv && !request.request_id.is_empty() => {
                let (candidates, sizes) = self.kv_candidates(request);
                kv.look_up(&request.token_ids, request.cache_salt, candidates, &sizes).await
            }
            _ => KvView::NotAsked,
        };
        self.decide(request, view)
    }

    /// The live workers of the request's model allowed its tenant (their
    /// tree sizes break ties) and the block sizes they hash in.
    fn kv_candidates(&self, request: &RouteRequest) -> (Vec<WorkerId>, Vec<u32>) {
        let state = self.state.lock();
        let now = Instant::now();
        let workers: Vec<&LiveWorker> = state
            .workers
            .values()
            .filter(|w| {
                w.record.model == request.model
                    && w.expires_at > now
                    && w.serves_tenant(request.kv_tenant)
                    && w.keeps_apart(request.cache_salt)
                    && w.holds(request.output, request.output_continued)
            })
            .collect();
        // Few sizes among many workers: dedup as they come.
        let mut sizes: Vec<u32> = Vec::new();
        for size in workers.iter().map(|w| w.record.kv_block_size).filter(|&size| size > 0) {
            if !sizes.contains(&size) {
                sizes.push(size);
            }
        }
        sizes.sort_unstable();
        (workers.iter().map(|w| w.record.worker_id.clone()).collect(), sizes)
    }

    /// Replaces the live worker set with a fresh registry listing. Bookings
    /// against workers that left are dropped.
    pub fn update_workers(&self, workers: Vec<LiveWorker>) {
        let mut state = self.state.lock();
        let joined: Vec<&WorkerId> = workers.iter().map(|w| &w.record.worker_id).filter(|id| !state.workers.contains_key(*id)).collect();
        if !joined.is_empty() {
            tracing::info!(workers = ?joined, "workers joined");
        }
        let fresh: BTreeMap<WorkerId, LiveWorker> = workers.into_iter().map(|w| (w.record.worker_id.clone(), w)).collect();
        let left: Vec<WorkerId> = state.workers.keys().filter(|id| !fresh.contains_key(*id)).cloned().collect();
        if !left.is_empty() {
            tracing::info!(workers = ?left, "workers left");
        }
        state.workers = fresh;
        state.forget_bookings_of(&left);
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
                tracing::info!(worker = %worker.record.worker_id, "worker joined");
            }
            state.workers.insert(worker.record.worker_id.clone(), worker);
        }
    }

    /// A worker that left (or whose lease ran out) loses its blocks in the
    /// index: its cache is gone or unreachable.
    fn forget_cache_of(&self, workers: &[WorkerId]) {
        if let Some(replica) = self.kv.as_ref().and_then(|kv| kv.replica()) {
            for id in workers {
                replica.remove_worker(id);
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
        let expired: Vec<WorkerId> = state.workers.iter().filter(|(_, w)| w.expires_at <= now).map(|(id, _)| id.clone()).collect();
        if !expired.is_empty() {
            tracing::info!(workers = ?expired, "worker leases expired");
            for id in &expired {
                state.workers.remove(id);
            }
            state.forget_bookings_of(&expired);
            self.forget_cache_of(&expired);
        }
        if let Some(kv) = &self.kv {
            kv.expire(now);
        }
        let stale: Vec<String> =
            state.bookings.iter().filter(|(_, booking)| now.duration_since(booking.booked_at) > self.booking_ttl).map(|(id, _)| id.clone()).collect();
        for request_id in stale {
            tracing::warn!(request_id, "booking never released; dropping it");
            state.release(&request_id);
        }
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
            .map(|w| routed_of(w, state.book_of(&w.record.worker_id).in_flight))
            .collect()
    }

    /// The endpoint of the kv-store whose blocks the index names `name`, as
    /// a worker that reads it says.
    pub fn store_endpoint(&self, name: &str) -> Option<String> {
        let state = self.state.lock();
        state.workers.values().find_map(|w| w.record.kv_store.as_ref().filter(|store| store.name == name).map(|store| store.endpoint.clone()))
    }

    /// This router's booked work per worker (what it shares with the
    /// other replicas).
    pub fn own_books(&self) -> FxHashMap<WorkerId, WorkerBook> {
        self.state.lock().books.clone()
    }

    /// Replaces the work the other router replicas booked per worker.
    pub fn set_peer_books(&self, peers: FxHashMap<WorkerId, WorkerBook>) {
        self.state.lock().peers = peers;
    }

    /// Requests booked and not released.
    pub fn total_in_flight(&self) -> usize {
        self.state.lock().bookings.len()
    }
}

#[cfg(test)]
mod tests;
