//! Dropping index workers the registry no longer lists.
//!
//! A replica that replays history can hold the view of a worker that is
//! long gone (a ghost: never routed to, but it costs memory and lookups),
//! and a worker whose lease expires must lose its blocks. Whoever reads the
//! registry keeps one [`Unregistered`] and sweeps the index with each
//! listing.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use crate::{KvIndex, WorkerId};

/// When each index worker was first seen missing from the registry.
#[derive(Debug)]
pub struct Unregistered {
    grace: Duration,
    missing_since: FxHashMap<WorkerId, Instant>,
}

impl Unregistered {
    /// Drops a worker once it has been missing for `grace` (a worker that
    /// just started may publish events before it is listed).
    pub fn new(grace: Duration) -> Self {
        Self { grace, missing_since: FxHashMap::default() }
    }

    /// Compares the index with a registry listing (`is_live`) taken at
    /// `now`; drops every worker missing for the grace period and returns
    /// them with the blocks they held.
    pub fn sweep(&mut self, index: &KvIndex, is_live: impl Fn(&str) -> bool, now: Instant) -> Vec<(WorkerId, usize)> {
        let mut dropped = Vec::new();
        let mut still_missing = FxHashMap::default();
        for worker_id in index.worker_ids() {
            if is_live(&worker_id) {
                continue;
            }
            let since = self.missing_since.get(&worker_id).copied().unwrap_or(now);
            if now.duration_since(since) >= self.grace {
                let blocks = index.cached_blocks(&worker_id);
                if index.remove_worker(&worker_id) {
                    dropped.push((worker_id, blocks));
                }
            } else {
                still_missing.insert(worker_id, since);
            }
        }
        self.missing_since = still_missing;
        dropped
    }

    /// Restarts every grace period (e.g. the registry's Redis restarted
    /// empty: workers are listed again at their next lease renewal).
    pub fn reset(&mut self) {
        self.missing_since.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvEvent, LocalBlockHash, NumberedEvent, SequenceHash, StoredBlock, Tier};

    fn store(index: &KvIndex, worker: &str) {
        let blocks = vec![StoredBlock { sequence_hash: SequenceHash(1), local_hash: LocalBlockHash(1) }];
        index.apply(worker, 1, &NumberedEvent { event_id: 0, event: KvEvent::Stored { parent: None, blocks, tier: Tier::Device } });
    }

    #[test]
    fn workers_missing_past_the_grace_are_dropped() {
        let index = KvIndex::new();
        store(&index, "live");
        store(&index, "gone");
        let mut unregistered = Unregistered::new(Duration::from_secs(5));
        let start = Instant::now();
        let live = |id: &str| id == "live";
        assert!(unregistered.sweep(&index, live, start).is_empty(), "first seen missing");
        assert!(unregistered.sweep(&index, live, start + Duration::from_secs(4)).is_empty());
        assert_eq!(unregistered.sweep(&index, live, start + Duration::from_secs(5)), vec![(WorkerId::from("gone"), 1)]);
        assert_eq!(index.worker_ids(), ["live"]);

        // Back in the listing before the grace ran out: kept, timer cleared.
        store(&index, "flaky");
        unregistered.sweep(&index, live, start);
        unregistered.sweep(&index, |_| true, start + Duration::from_secs(3));
        assert!(unregistered.sweep(&index, live, start + Duration::from_secs(6)).is_empty(), "missing again since 6 s");
        unregistered.reset();
        assert!(unregistered.sweep(&index, live, start + Duration::from_secs(20)).is_empty(), "reset restarts the grace");
        assert_eq!(unregistered.sweep(&index, live, start + Duration::from_secs(25)).len(), 1);
    }
}
