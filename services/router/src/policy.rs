//! Worker selection policies: pure functions over candidates.

use rand::Rng;
pub use turbine_api::router::Policy;

/// What a policy sees of one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Requests booked against the worker and not yet finished.
    pub in_flight: u32,
    /// Sequences the worker reported running plus waiting.
    pub reported_queue: u32,
    /// KV blocks in use, as reported.
    pub blocks_used: u32,
    /// KV blocks in the pool, as reported.
    pub blocks_total: u32,
}

/// Picks the index of a candidate. `turn` is a counter advanced by the
/// caller on every decision (round-robin uses it). `candidates` must not be
/// empty and must be in a stable order (by worker id).
pub fn choose(policy: Policy, candidates: &[Candidate], turn: usize, rng: &mut impl Rng) -> usize {
    debug_assert!(!candidates.is_empty());
    match policy {
        Policy::RoundRobin => turn % candidates.len(),
        Policy::Random => rng.random_range(0..candidates.len()),
        // Without cache overlap to weigh, kv routing is load balancing.
        Policy::LeastLoaded | Policy::Kv => {
            let key = |c: &Candidate| {
                let kv_permille = if c.blocks_total == 0 { 0 } else { (c.blocks_used as u64 * 1000 / c.blocks_total as u64) as u32 };
                (c.in_flight, c.reported_queue, kv_permille)
            };
            let best = candidates.iter().map(key).min().expect("candidates not empty");
            let ties: Vec<usize> = (0..candidates.len()).filter(|&i| key(&candidates[i]) == best).collect();
            ties[rng.random_range(0..ties.len())]
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn candidate(in_flight: u32, reported_queue: u32, blocks_used: u32) -> Candidate {
        Candidate { in_flight, reported_queue, blocks_used, blocks_total: 100 }
    }

    #[test]
    fn round_robin_cycles() {
        let candidates = [candidate(9, 9, 9), candidate(0, 0, 0), candidate(5, 5, 5)];
        let mut rng = StdRng::seed_from_u64(1);
        let picks: Vec<usize> = (0..6).map(|turn| choose(Policy::RoundRobin, &candidates, turn, &mut rng)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_loaded_prefers_fewer_bookings_then_queue_then_kv() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(choose(Policy::LeastLoaded, &[candidate(2, 0, 0), candidate(1, 9, 90)], 0, &mut rng), 1);
        assert_eq!(choose(Policy::LeastLoaded, &[candidate(1, 3, 0), candidate(1, 2, 90)], 0, &mut rng), 1);
        assert_eq!(choose(Policy::LeastLoaded, &[candidate(1, 2, 50), candidate(1, 2, 40)], 0, &mut rng), 1);
    }

    #[test]
    fn least_loaded_breaks_ties_at_random() {
        let mut rng = StdRng::seed_from_u64(7);
        let candidates = [candidate(0, 0, 0); 4];
        let mut seen = [false; 4];
        for _ in 0..200 {
            seen[choose(Policy::LeastLoaded, &candidates, 0, &mut rng)] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn random_covers_every_candidate() {
        let mut rng = StdRng::seed_from_u64(3);
        let candidates = [candidate(0, 0, 0); 3];
        let mut counts = [0; 3];
        for _ in 0..3000 {
            counts[choose(Policy::Random, &candidates, 0, &mut rng)] += 1;
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }
}
