//! The router's bookkeeping: live workers, and the requests booked against
//! each (booked at route, the prefill part dropped at the first token,
//! released at the end).

use std::collections::BTreeMap;
use std::time::Instant;

use rustc_hash::FxHashMap;
use turbine_kv::WorkerId;
use turbine_registry::LiveWorker;

/// Suffix of the booking key of a request's prefill on a prefill worker.
const PREFILL_BOOKING: &str = "\u{0}prefill";

#[derive(Debug)]
pub(super) struct Booking {
    pub(super) worker_id: WorkerId,
    pub(super) booked_at: Instant,
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

/// Everything behind the router's lock.
#[derive(Debug, Default)]
pub(super) struct State {
    /// Live workers by id (ordered, for stable round-robin).
    pub(super) workers: BTreeMap<WorkerId, LiveWorker>,
    /// Bookings by request id.
    pub(super) bookings: FxHashMap<String, Booking>,
    /// Booked work per worker.
    pub(super) books: FxHashMap<WorkerId, WorkerBook>,
    /// Work other router replicas booked per worker (as they last
    /// published it): counted in decisions, never released here.
    pub(super) peers: FxHashMap<WorkerId, WorkerBook>,
}

impl State {
    /// Releases a request's bookings (its prefill's too).
    pub(super) fn release(&mut self, request_id: &str) -> bool {
        self.release_one(&prefill_key(request_id));
        self.release_one(request_id)
    }

    fn release_one(&mut self, request_id: &str) -> bool {
        let Some(booking) = self.bookings.remove(request_id) else {
            return false;
        };
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

    /// Books `request_id` against `worker_id`.
    pub(super) fn book(&mut self, request_id: &str, worker_id: &WorkerId, now: Instant, prefill_blocks: u64, decode_blocks: u64) {
        let booking = Booking { worker_id: worker_id.clone(), booked_at: now, prefill_blocks, decode_blocks };
        self.bookings.insert(request_id.to_owned(), booking);
        let book = self.books.entry(worker_id.clone()).or_default();
        book.in_flight += 1;
        book.prefill_blocks += prefill_blocks;
        book.decode_blocks += decode_blocks;
        crate::metrics::in_flight(worker_id, book.in_flight);
    }

    /// Books a request's prefill against a prefill worker.
    pub(super) fn book_prefill(&mut self, request_id: &str, worker_id: &WorkerId, now: Instant, blocks: u64) {
        self.book(&prefill_key(request_id), worker_id, now, blocks, blocks);
    }

    pub(super) fn prefill_done(&mut self, request_id: &str) -> bool {
        // A prefill worker's part ends with the prefill.
        self.release_one(&prefill_key(request_id));
        let Some(booking) = self.bookings.get_mut(request_id) else {
            return false;
        };
        let blocks = std::mem::take(&mut booking.prefill_blocks);
        if let Some(book) = self.books.get_mut(&booking.worker_id) {
            book.prefill_blocks = book.prefill_blocks.saturating_sub(blocks);
        }
        true
    }

    pub(super) fn book_of(&self, worker_id: &str) -> WorkerBook {
        self.books.get(worker_id).copied().unwrap_or_default()
    }

    /// This router's bookings plus the other replicas': what decisions weigh.
    pub(super) fn load_of(&self, worker_id: &str) -> WorkerBook {
        self.book_of(worker_id) + self.peers.get(worker_id).copied().unwrap_or_default()
    }

    /// Drops the bookings of workers that left.
    pub(super) fn forget_bookings_of(&mut self, workers: &[WorkerId]) {
        if workers.is_empty() {
            return;
        }
        self.bookings.retain(|_, booking| !workers.contains(&booking.worker_id));
        for id in workers {
            self.books.remove(id);
        }
    }
}

fn prefill_key(request_id: &str) -> String {
    format!("{request_id}{PREFILL_BOOKING}")
}
