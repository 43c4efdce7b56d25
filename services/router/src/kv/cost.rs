//! DESIGN §5's cost function and the choice among candidates: pure, no
//! index and no transport.

use rand::Rng;
use turbine_kv::Tier;
use turbine_registry::ReadCosts;
use turbine_runtime::config::InvalidSetting;

pub use turbine_api::router::KvOverrides;

/// Weights of the cost function; every field can be overridden per request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvWeights {
    /// Credit for a matched block in engine memory.
    pub device_credit: f64,
    /// Credit for a matched block in host memory, on a worker that has not
    /// measured reading it (a measured tier is credited by the compute a
    /// read spares).
    pub host_credit: f64,
    /// Credit for a matched block on local disk, on a worker that has not
    /// measured reading it (a measured tier is credited by the compute a
    /// read spares).
    pub disk_credit: f64,
    /// Credit for a matched block in a remote KV store, on a worker that has not
    /// measured reading it (a measured tier is credited by the compute a
    /// read spares).
    pub remote_credit: f64,
    /// Weight of prefill work against decode load.
    pub prefill_load_scale: f64,
    /// 0 picks the cheapest worker; above 0 samples, hotter is more random.
    pub temperature: f64,
}

/// Turbine's defaults, tuned on the Mooncake replays (docs/benchmarks.md).
/// Against [`KvWeights::DYNAMO`]: prefill work is weighed 100× the decode
/// load, because in an engine with chunked prefill a request waits for the
/// prefill queued ahead of it, while decoding sequences only stretch each
/// step a little; and a cached block is worth 8 blocks of prefill, not 1,
/// because a hit given up to balance load is computed again and that work
/// delays every later request too. The tiers keep Dynamo's proportions.
impl Default for KvWeights {
    fn default() -> Self {
        Self { device_credit: 8.0, host_credit: 6.0, disk_credit: 2.0, remote_credit: 0.8, prefill_load_scale: 100.0, temperature: 0.0 }
    }
}

impl KvWeights {
    /// These weights with a request's `overrides` applied.
    pub fn overridden_by(self, overrides: &KvOverrides) -> KvWeights {
        let KvOverrides { device_credit, host_credit, disk_credit, remote_credit, prefill_load_scale, temperature } = *overrides;
        KvWeights {
            device_credit: device_credit.unwrap_or(self.device_credit),
            host_credit: host_credit.unwrap_or(self.host_credit),
            disk_credit: disk_credit.unwrap_or(self.disk_credit),
            remote_credit: remote_credit.unwrap_or(self.remote_credit),
            prefill_load_scale: prefill_load_scale.unwrap_or(self.prefill_load_scale),
            temperature: temperature.unwrap_or(self.temperature),
        }
    }

    /// Dynamo's default weights (DESIGN §5's baseline): a cached block
    /// saves one block of prefill, prefill and decode blocks weigh the same.
    pub const DYNAMO: Self = Self { device_credit: 1.0, host_credit: 0.75, disk_credit: 0.25, remote_credit: 0.1, prefill_load_scale: 1.0, temperature: 0.0 };

    /// Checks that every weight is finite and non-negative.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let fields = [
            ("device_credit", self.device_credit),
            ("host_credit", self.host_credit),
            ("disk_credit", self.disk_credit),
            ("remote_credit", self.remote_credit),
            ("prefill_load_scale", self.prefill_load_scale),
            ("temperature", self.temperature),
        ];
        for (name, value) in fields {
            if !(value.is_finite() && value >= 0.0) {
                return Err(InvalidSetting::new(format!("kv.{name}"), format!("a weight must be a finite non-negative number, got {value}")));
            }
        }
        Ok(())
    }

    /// These weights with a device credit of `device` and the other tiers
    /// in Dynamo's proportions to it (host 0.75, disk 0.25, remote 0.1).
    pub fn with_device_credit(self, device: f64) -> Self {
        Self { device_credit: device, host_credit: 0.75 * device, disk_credit: 0.25 * device, remote_credit: 0.1 * device, ..self }
    }

    /// The credit of one matched block in `tier`.
    pub fn credit(&self, tier: Tier) -> f64 {
        match tier {
            Tier::Device => self.device_credit,
            Tier::Host => self.host_credit,
            Tier::Disk => self.disk_credit,
            Tier::Remote => self.remote_credit,
        }
    }
}

/// What the cost function sees of one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvCandidate {
    /// The prompt's length in the worker's blocks.
    pub prompt_blocks: u32,
    /// Leading prompt blocks the worker caches, by fastest tier.
    pub matched_by_tier: [u32; 4],
    /// Blocks booked on the worker and not yet prefilled.
    pub active_prefill_blocks: u64,
    /// Blocks of the sequences booked on the worker.
    pub active_decode_blocks: u64,
    /// Blocks the worker caches in all (tie-break: smaller first).
    pub cached_tree: usize,
    /// What reading from its disk and shared tiers costs, as the worker
    /// measured it: a measured tier's hits are credited by the compute
    /// reading them saves, not by the tier's fixed weight.
    pub read_costs: ReadCosts,
}

impl KvCandidate {
    /// Leading prompt blocks cached in any tier.
    pub fn matched(&self) -> u32 {
        self.matched_by_tier.iter().sum()
    }

    /// Fills the match (leading blocks by best tier) from an index answer.
    pub fn with_match(mut self, matched: Option<&[u32; 4]>) -> Self {
        if let Some(by_tier) = matched {
            self.matched_by_tier = *by_tier;
        }
        self
    }

    /// Where the worker is computing the prompt now for another choice of
    /// the same request (`Some` of its full blocks): those blocks count as
    /// matched in engine memory, the rest as the index said.
    pub fn with_prompt_computed(mut self, full_blocks: Option<u32>) -> Self {
        if let Some(blocks) = full_blocks
            && blocks > self.matched()
        {
            self.matched_by_tier = [blocks, 0, 0, 0];
        }
        self
    }

    /// Adds what the worker's kv-store holds beyond the worker's own match
    /// (the store's leading blocks, from the index), as tier remote: the
    /// worker reads its own tiers first and asks the store for the rest.
    pub fn with_store_match(mut self, store: Option<&[u32; 4]>) -> Self {
        if let Some(by_tier) = store {
            let beyond = by_tier.iter().sum::<u32>().saturating_sub(self.matched());
            self.matched_by_tier[Tier::Remote as usize] += beyond;
        }
        self
    }
}

/// DESIGN §5's cost of sending the request to `candidate`.
pub fn cost(weights: &KvWeights, candidate: &KvCandidate) -> f64 {
    let prompt_blocks = candidate.prompt_blocks;
    let credits: f64 = Tier::ALL.iter().map(|&tier| credit(weights, candidate, tier)).sum();
    // Not clamped at 0: see the module docs.
    let prefill = candidate.active_prefill_blocks as f64 + f64::from(prompt_blocks) - credits;
    weights.prefill_load_scale * prefill + candidate.active_decode_blocks as f64 + f64::from(prompt_blocks)
}

/// The credit of `candidate`'s matched blocks in `tier`. A tier whose
/// reads the worker measured: the compute the read spares (each block
/// worth a device block's credit) less what the read adds to this
/// request's wait beyond the prefill queued before it on the worker (a
/// read runs beside that queue, off the steps the other requests share).
/// Where that addition is more than computing the blocks would take, a
/// worker that decides (disk, shared tier) computes them: no credit. Any
/// other tier: its weight per block.
fn credit(weights: &KvWeights, candidate: &KvCandidate, tier: Tier) -> f64 {
    let blocks = f64::from(candidate.matched_by_tier[tier as usize]);
    let measured = match tier {
        Tier::Host => candidate.read_costs.host,
        Tier::Disk => candidate.read_costs.disk,
        Tier::Remote => candidate.read_costs.remote,
        Tier::Device => None,
    };
    let Some(read) = measured else { return weights.credit(tier) * blocks };
    let added = read.added_wait(blocks, candidate.active_prefill_blocks as f64);
    // The host tier is always read.
    if tier != Tier::Host && added >= blocks {
        return 0.0;
    }
    (weights.device_credit * blocks - added).max(0.0)
}

/// Picks a candidate index (`candidates` must not be empty).
pub fn choose(weights: &KvWeights, candidates: &[KvCandidate], rng: &mut impl Rng) -> usize {
    debug_assert!(!candidates.is_empty());
    let costs: Vec<f64> = candidates.iter().map(|c| cost(weights, c)).collect();
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if weights.temperature > 0.0 && max > min {
        let range = max - min;
        let logits: Vec<f64> = costs.iter().map(|c| -((c - min) / range) / weights.temperature).collect();
        let total: f64 = logits.iter().map(|l| l.exp()).sum();
        let mut draw = rng.random::<f64>() * total;
        for (index, logit) in logits.iter().enumerate() {
            draw -= logit.exp();
            if draw <= 0.0 {
                return index;
            }
        }
        return logits.len() - 1;
    }
    let cheapest: Vec<usize> = (0..costs.len()).filter(|&i| costs[i] <= min + 1e-9).collect();
    let smallest_tree = cheapest.iter().map(|&i| candidates[i].cached_tree).min().expect("candidates not empty");
    let ties: Vec<usize> = cheapest.into_iter().filter(|&i| candidates[i].cached_tree == smallest_tree).collect();
    ties[rng.random_range(0..ties.len())]
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn candidate(prompt_blocks: u32, device: u32, prefill: u64, decode: u64) -> KvCandidate {
        KvCandidate {
            prompt_blocks,
            matched_by_tier: [device, 0, 0, 0],
            active_prefill_blocks: prefill,
            active_decode_blocks: decode,
            cached_tree: 0,
            read_costs: ReadCosts::default(),
        }
    }

    #[test]
    fn measured_tiers_are_credited_by_what_reading_saves() {
        use turbine_registry::ReadCost;
        let weights = KvWeights::default();
        let on_disk = KvCandidate { matched_by_tier: [0, 0, 10, 0], ..candidate(10, 0, 0, 0) };
        // Unmeasured: the disk's weight, 2 a block.
        assert_eq!(cost(&weights, &on_disk), 100.0 * (10.0 - 20.0) + 10.0);
        // Reading a block costs a tenth of computing it, plus a round trip
        // of half a block: 10 blocks spare 10 of compute, each worth a
        // device block, and wait 1.5 blocks longer than they would in the
        // pool.
        let fast = KvCandidate { read_costs: ReadCosts { disk: Some(ReadCost { fixed_blocks: 0.5, per_block: 0.1 }), ..ReadCosts::default() }, ..on_disk };
        assert!((cost(&weights, &fast) - (100.0 * (10.0 - (80.0 - 1.5)) + 10.0)).abs() < 1e-4);
        // Slower than computing: the worker computes, no credit at all.
        let slow = KvCandidate { read_costs: ReadCosts { disk: Some(ReadCost { fixed_blocks: 0.0, per_block: 3.0 }), ..ReadCosts::default() }, ..on_disk };
        assert_eq!(cost(&weights, &slow), cost(&weights, &candidate(10, 0, 0, 0)));
        let mut rng = StdRng::seed_from_u64(1);
        let elsewhere = candidate(10, 0, 0, 0);
        assert_eq!(choose(&weights, &[elsewhere, fast], &mut rng), 1, "a fast disk's hit is worth routing to");
    }

    #[test]
    fn a_measured_host_tier_is_credited_by_the_compute_its_copies_spare() {
        use turbine_registry::ReadCost;
        let weights = KvWeights::default();
        let in_host = KvCandidate { matched_by_tier: [0, 10, 0, 0], ..candidate(10, 0, 0, 0) };
        // Unmeasured: the host's weight, 6 a block.
        assert_eq!(cost(&weights, &in_host), 100.0 * (10.0 - 60.0) + 10.0);
        // A copy costs a hundredth of computing the block: 10 blocks spare
        // 10 blocks of compute, each worth a device block's 8, and add 0.1
        // to the wait.
        let measured = KvCandidate { read_costs: ReadCosts { host: Some(ReadCost { fixed_blocks: 0.0, per_block: 0.01 }), ..ReadCosts::default() }, ..in_host };
        assert!((cost(&weights, &measured) - (100.0 * (10.0 - (80.0 - 0.1)) + 10.0)).abs() < 1e-3, "{}", cost(&weights, &measured));
        let on_device = candidate(10, 10, 0, 0);
        assert!(cost(&weights, &measured) > cost(&weights, &on_device), "a host hit never beats the same hit in the pool");
        // Copies slower than computing (2.4 blocks of compute a block):
        // still always read, sparing the compute the other requests
        // share; the request waits 24 blocks longer on an idle worker...
        let slow = KvCandidate { read_costs: ReadCosts { host: Some(ReadCost { fixed_blocks: 0.0, per_block: 2.4 }), ..ReadCosts::default() }, ..in_host };
        assert!((cost(&weights, &slow) - (100.0 * (10.0 - (80.0 - 24.0)) + 10.0)).abs() < 1e-3, "{}", cost(&weights, &slow));
        // ...and not at all behind 30 blocks of queued prefill.
        let busy = KvCandidate { active_prefill_blocks: 30, ..slow };
        assert!((cost(&weights, &busy) - (100.0 * (30.0 + 10.0 - 80.0) + 10.0)).abs() < 1e-3, "{}", cost(&weights, &busy));
    }

    #[test]
    fn cost_follows_the_design_formula() {
        let weights = KvWeights::DYNAMO;
        // 10-block prompt, 4 cached on device, 3 blocks queued for prefill, 20 decoding.
        assert_eq!(cost(&weights, &candidate(10, 4, 3, 20)), (3.0 + 10.0 - 4.0) + 20.0 + 10.0);
        let host = KvCandidate { matched_by_tier: [0, 4, 0, 0], ..candidate(10, 0, 3, 20) };
        assert_eq!(cost(&weights, &host), (3.0 + 10.0 - 3.0) + 20.0 + 10.0);
        // Dynamo's credits never exceed the prompt: prefill stays ≥ 0.
        assert_eq!(cost(&weights, &candidate(2, 2, 0, 0)), 2.0);
    }

    #[test]
    fn a_deeper_match_is_cheaper_even_when_credits_exceed_the_prompt() {
        let mut rng = StdRng::seed_from_u64(1);
        // Turn 7 of a conversation (16 blocks): one idle worker holds turn 6
        // (14 blocks), another an early turn (10 blocks). With a device
        // credit of 8 both "save" more than the prompt.
        let deep = candidate(16, 14, 0, 0);
        let shallow = candidate(16, 10, 0, 0);
        for _ in 0..20 {
            assert_eq!(choose(&KvWeights::default(), &[shallow, deep], &mut rng), 1);
        }
    }

    #[test]
    fn overlap_wins_until_load_outweighs_it() {
        let weights = KvWeights::DYNAMO;
        let mut rng = StdRng::seed_from_u64(3);
        let cached_but_busy = candidate(60, 50, 0, 30);
        let idle = candidate(60, 0, 0, 0);
        assert_eq!(choose(&weights, &[idle, cached_but_busy], &mut rng), 1, "50 saved blocks beat 30 decoding");
        let overloaded = candidate(60, 50, 0, 80);
        assert_eq!(choose(&weights, &[idle, overloaded], &mut rng), 0);
    }

    #[test]
    fn default_weights_keep_a_prefix_on_its_worker_under_load() {
        let mut rng = StdRng::seed_from_u64(5);
        // A 200-block follow-up turn, 180 blocks cached on a worker with 300
        // blocks queued for prefill and 6,000 decoding; another worker idle.
        let holder = candidate(200, 180, 300, 6_000);
        let idle = candidate(200, 0, 0, 0);
        assert_eq!(choose(&KvWeights::default(), &[idle, holder], &mut rng), 1, "the hit is worth more than the queue");
        assert_eq!(choose(&KvWeights::DYNAMO, &[idle, holder], &mut rng), 0, "Dynamo's weights give it up");
        // Queued prefill still counts: far behind, the holder loses.
        let swamped = candidate(200, 180, 2_000, 6_000);
        assert_eq!(choose(&KvWeights::default(), &[idle, swamped], &mut rng), 0);
    }

    #[test]
    fn ties_go_to_the_smaller_cached_tree() {
        let weights = KvWeights::default();
        let mut rng = StdRng::seed_from_u64(3);
        let big = KvCandidate { cached_tree: 500, ..candidate(8, 0, 0, 0) };
        let small = KvCandidate { cached_tree: 5, ..candidate(8, 0, 0, 0) };
        for _ in 0..20 {
            assert_eq!(choose(&weights, &[big, small], &mut rng), 1);
        }
    }

    #[test]
    fn temperature_spreads_choices_by_cost() {
        let weights = KvWeights { temperature: 1.0, ..KvWeights::default() };
        let mut rng = StdRng::seed_from_u64(9);
        let cheap = candidate(10, 10, 0, 0);
        let dear = candidate(10, 0, 0, 10);
        let picks: Vec<usize> = (0..2000).map(|_| choose(&weights, &[cheap, dear], &mut rng)).collect();
        let cheap_share = picks.iter().filter(|&&i| i == 0).count() as f64 / 2000.0;
        // p(cheap) = 1 / (1 + e^-1) ≈ 0.73.
        assert!((0.68..0.78).contains(&cheap_share), "cheap share {cheap_share}");
    }

    #[test]
    fn overrides_replace_only_what_they_set() {
        let overrides = KvOverrides { temperature: Some(0.5), ..KvOverrides::default() };
        let weights = KvWeights::default().overridden_by(&overrides);
        assert_eq!(weights.temperature, 0.5);
        assert_eq!(weights.device_credit, KvWeights::default().device_credit);
        assert!(KvWeights { host_credit: -1.0, ..KvWeights::default() }.validate().is_err());
        // Setting the device credit keeps the tiers' proportions: Dynamo's
        // weights from two numbers.
        let dynamo = KvWeights { prefill_load_scale: 1.0, ..KvWeights::default().with_device_credit(1.0) };
        assert_eq!(dynamo, KvWeights::DYNAMO);
        assert_eq!(KvWeights::default().with_device_credit(8.0), KvWeights::default());
    }
}
