//! The router's state: the live workers (mirrored from the registry), the
//! requests booked against each, and the decision itself. No transport.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use turbine_registry::{LiveWorker, WorkerLoad};

use crate::policy::{Candidate, Policy, choose};

/// A request to route.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
}

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
}

#[derive(Debug, Default)]
struct State {
    /// Live workers by id (ordered, for stable round-robin).
    workers: BTreeMap<String, LiveWorker>,
    /// Bookings by request id.
    bookings: HashMap<String, Booking>,
    /// Booked requests per worker.
    in_flight: HashMap<String, u32>,
}

impl State {
    fn release(&mut self, request_id: &str) -> bool {
        let Some(booking) = self.bookings.remove(request_id) else { return false };
        if let Some(count) = self.in_flight.get_mut(&booking.worker_id) {
            *count = count.saturating_sub(1);
            crate::metrics::in_flight(&booking.worker_id, *count);
            if *count == 0 {
                self.in_flight.remove(&booking.worker_id);
            }
        }
        true
    }

    fn book(&mut self, request_id: &str, worker_id: &str, now: Instant) {
        self.bookings.insert(request_id.to_owned(), Booking { worker_id: worker_id.to_owned(), booked_at: now });
        let count = self.in_flight.entry(worker_id.to_owned()).or_default();
        *count += 1;
        crate::metrics::in_flight(worker_id, *count);
    }
}

/// The routing core shared by the gRPC service and in-process callers.
#[derive(Debug)]
pub struct Router {
    policy: Policy,
    /// A booking never released is dropped after this long.
    booking_ttl: Duration,
    state: Mutex<State>,
    turn: AtomicUsize,
}

impl Router {
    /// A router with no workers yet.
    pub fn new(policy: Policy, booking_ttl: Duration) -> Self {
        Self { policy, booking_ttl, state: Mutex::new(State::default()), turn: AtomicUsize::new(0) }
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

    /// Chooses a worker and books the request against it.
    pub fn route(&self, request: &RouteRequest) -> Result<(RoutedWorker, u32), RouteError> {
        if request.request_id.is_empty() {
            return Err(RouteError::InvalidRequest("request_id must not be empty".into()));
        }
        let now = Instant::now();
        let mut state = self.state.lock();
        // A retried request id replaces its earlier booking.
        state.release(&request.request_id);
        let eligible: Vec<&LiveWorker> = state
            .workers
            .values()
            .filter(|w| w.record.model == request.model && w.expires_at > now && !request.exclude_worker_ids.contains(&w.record.worker_id))
            .collect();
        if eligible.is_empty() {
            return Err(RouteError::NoWorkers(request.model.clone()));
        }
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|w| Candidate {
                in_flight: state.in_flight.get(&w.record.worker_id).copied().unwrap_or(0),
                reported_queue: w.record.load.running + w.record.load.waiting,
                blocks_used: w.record.load.blocks_used,
                blocks_total: w.record.load.blocks_total,
            })
            .collect();
        let policy = request.policy.unwrap_or(self.policy);
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let index = choose(policy, &candidates, turn, &mut rand::rng());
        let chosen = &eligible[index].record;
        let routed = RoutedWorker {
            worker_id: chosen.worker_id.clone(),
            endpoint: chosen.endpoint.clone(),
            model: chosen.model.clone(),
            load: chosen.load,
            in_flight: candidates[index].in_flight + 1,
        };
        state.book(&request.request_id, &routed.worker_id, now);
        let in_flight = routed.in_flight;
        Ok((routed, in_flight))
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
                in_flight: state.in_flight.get(&w.record.worker_id).copied().unwrap_or(0),
            })
            .collect()
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
        state.in_flight.remove(id);
    }
}

#[cfg(test)]
mod tests;
