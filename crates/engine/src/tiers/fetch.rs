//! Fetch or recompute: whether a waiting request's prefix is read from
//! the tiers the reader thread serves (disk, the shared store) or
//! computed, decided per request from predicted times, not fixed weights.
//!
//! The engine measures what it needs as it runs:
//!
//! - **compute**: every step's duration against the prompt tokens it
//!   computed, fitted as `fixed + per_token · tokens` (the fixed part is a
//!   step's cost whatever it computes). Computing `n` tokens of a prompt
//!   then takes `per_token · n` plus `fixed` for each step the chunked
//!   prefill spreads them over.
//! - **each tier's transfers**: every read's duration against the blocks
//!   it returned, fitted as `fixed + per_block · blocks` (a round trip and a
//!   bandwidth), and for the shared tier the share of asked blocks it held.
//! - **the reader's queue**: reads run one after another, so a new read
//!   waits for the predicted time of those ahead of it.
//! - **the prefill ahead**: the request's own prompt is computed only
//!   after the prompt tokens the engine computes first (the running
//!   sequences' rest, the sequences admitted before it), whichever it
//!   chooses; a read overlaps that wait, so it costs only what it adds
//!   beyond it.
//!
//! Below the host tier a prompt's prefix continues in a run of `d` disk
//! blocks, then `r` blocks the store may hold; the choices are to compute
//! them all, read the disk run, read it and ask the store for the rest, or
//! ask the store for both (it holds what every worker wrote through, and
//! may be faster than a slow disk). The choice with the largest predicted
//! saving (compute time saved less the time spent waiting for the read
//! beyond the prefill ahead) wins; none saving
//! anything means computing. A tier never measured is probed (a few of
//! its blocks are read, the rest computed: that is how it gets measured),
//! and so is a tier passed over, every [`PROBE_INTERVAL`], so that a tier
//! that got faster is noticed. Before any step was measured (a fresh
//! engine) there is nothing to weigh a read against: it reads.

use std::time::{Duration, Instant};

/// How a worker chooses between reading a prefix from a lower tier and
/// computing it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FetchPolicy {
    /// Per request, from predicted transfer and compute times.
    #[default]
    Auto,
    /// Read whatever the tiers hold.
    Always,
    /// Compute everything below the host tier.
    Never,
}

impl FetchPolicy {
    /// Its name (flags, metrics).
    pub fn name(self) -> &'static str {
        match self {
            FetchPolicy::Auto => "auto",
            FetchPolicy::Always => "always",
            FetchPolicy::Never => "never",
        }
    }
}

/// A tier passed over is read again after this long, so that a tier that
/// got faster (or was measured during a hiccup) is noticed.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(10);

/// Blocks a probe reads, in turn: a few (a probe costs the request that
/// carries it little), of varied counts (so that the fit can tell the
/// round trip from the per-block time).
const PROBE_BLOCKS: [usize; 4] = [2, 8, 4, 16];

/// `seconds = fixed + per_unit · units`, fitted by least squares with
/// older observations weighing less (each new one multiplies the past's
/// weight by [`LinearCost::DECAY`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinearCost {
    weight: f64,
    sum_x: f64,
    sum_y: f64,
    sum_xx: f64,
    sum_xy: f64,
}

impl LinearCost {
    /// The past's weight after one more observation (about the last 20
    /// count).
    pub const DECAY: f64 = 0.95;

    /// Records that `units` took `seconds`.
    pub fn observe(&mut self, units: f64, seconds: f64) {
        if !(units.is_finite() && seconds.is_finite()) || units < 0.0 || seconds < 0.0 {
            return;
        }
        let decay = Self::DECAY;
        self.weight = self.weight * decay + 1.0;
        self.sum_x = self.sum_x * decay + units;
        self.sum_y = self.sum_y * decay + seconds;
        self.sum_xx = self.sum_xx * decay + units * units;
        self.sum_xy = self.sum_xy * decay + units * seconds;
    }

    /// `(fixed, per_unit)`, once anything was observed with units.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.weight == 0.0 || self.sum_x <= 0.0 {
            return None;
        }
        let (mean_x, mean_y) = (self.sum_x / self.weight, self.sum_y / self.weight);
        let variance = self.sum_xx / self.weight - mean_x * mean_x;
        if variance > 1e-9 * mean_x * mean_x.max(1.0) {
            let slope = (self.sum_xy / self.weight - mean_x * mean_y) / variance;
            let intercept = mean_y - slope * mean_x;
            if slope > 0.0 && intercept >= 0.0 {
                return Some((intercept, slope));
            }
        }
        // Sizes too alike to separate the parts (or noise made one
        // negative): all of it is per unit.
        Some((0.0, self.sum_y / self.sum_x))
    }

    /// Predicted seconds for `units`, once anything was observed.
    pub fn predict(&self, units: f64) -> Option<f64> {
        self.fit().map(|(fixed, per_unit)| fixed + per_unit * units)
    }
}

/// What is known of one tier's reads.
#[derive(Debug, Clone, Copy, Default)]
struct TierCost {
    /// Seconds against blocks returned.
    cost: LinearCost,
    /// Blocks returned over blocks asked for (decaying; 1 until measured).
    held: Option<f64>,
    /// When it was last read.
    last_read: Option<Instant>,
    decisions: Decisions,
    /// Probes so far (picks the next probe's size).
    probes: usize,
}

impl TierCost {
    fn held_share(&self) -> f64 {
        self.held.unwrap_or(1.0)
    }

    fn due_for_probe(&self, now: Instant) -> bool {
        self.last_read.is_none_or(|last| now.duration_since(last) >= PROBE_INTERVAL)
    }
}

/// Decisions about one tier's blocks, counted since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Decisions {
    /// Requests whose blocks in the tier were read (predicted faster).
    pub fetch: u64,
    /// Requests whose blocks in the tier were not read (computed, or read
    /// from the shared tier instead of a slower disk).
    pub skip: u64,
    /// Requests whose blocks were read only to measure the tier again.
    pub probe: u64,
}

/// One tier's predictions and decisions, as the worker's metrics show them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierEstimate {
    /// Seconds a read costs whatever its size (None: not measured yet).
    pub fixed_seconds: Option<f64>,
    /// Seconds per block returned.
    pub block_seconds: Option<f64>,
    /// Share of asked blocks the tier held (the shared tier).
    pub held_share: f64,
    /// Decisions so far.
    pub decisions: Decisions,
}

/// The model's inputs and counts, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FetchEstimates {
    /// The policy.
    pub policy: FetchPolicy,
    /// A step's fixed seconds (None: no step with prompt tokens yet).
    pub step_seconds: Option<f64>,
    /// Seconds per prompt token computed.
    pub token_seconds: Option<f64>,
    /// The host tier: its reads are the copies of its blocks into the
    /// pool (modelled transfers: their modelled time); always read, so it
    /// has no decisions.
    pub host: TierEstimate,
    /// The disk tier.
    pub disk: TierEstimate,
    /// The shared tier.
    pub remote: TierEstimate,
}

/// Where a waiting request's prefix below the host tier comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FetchChoice {
    /// Read the disk run.
    pub disk: bool,
    /// Ask the shared tier (for what follows the disk run, or, without it,
    /// for everything below the host tier).
    pub remote: bool,
    /// Read at most this many blocks (a probe).
    pub limit: Option<usize>,
}

impl FetchChoice {
    const NOTHING: FetchChoice = FetchChoice { disk: false, remote: false, limit: None };

    fn of(disk: bool, remote: bool) -> Self {
        FetchChoice { disk, remote, limit: None }
    }
}

/// The decision's state: measurements, the reader's queue, counts.
#[derive(Debug)]
pub(crate) struct FetchModel {
    policy: FetchPolicy,
    block_size: usize,
    step_tokens: usize,
    compute: LinearCost,
    host: TierCost,
    disk: TierCost,
    remote: TierCost,
    /// When the reader thread is predicted to be done with the reads
    /// queued so far.
    reader_free_at: Option<Instant>,
}

impl FetchModel {
    pub(crate) fn new(policy: FetchPolicy, block_size: usize, step_tokens: usize) -> Self {
        Self {
            policy,
            block_size: block_size.max(1),
            step_tokens: step_tokens.max(1),
            compute: LinearCost::default(),
            host: TierCost::default(),
            disk: TierCost::default(),
            remote: TierCost::default(),
            reader_free_at: None,
        }
    }

    /// A step computed `prompt_tokens` prompt tokens in `took`.
    pub(crate) fn observe_step(&mut self, prompt_tokens: usize, took: Duration) {
        self.compute.observe(prompt_tokens as f64, took.as_secs_f64());
    }

    /// `blocks` from the host tier were copied into the pool in `took`.
    pub(crate) fn observe_host(&mut self, blocks: usize, took: Duration, now: Instant) {
        observe(&mut self.host, blocks, 0, took, now);
    }

    /// The disk returned `blocks` in `took`.
    pub(crate) fn observe_disk(&mut self, blocks: usize, asked: usize, took: Duration, now: Instant) {
        observe(&mut self.disk, blocks, asked, took, now);
    }

    /// The shared tier returned `blocks` of `asked` in `took`.
    pub(crate) fn observe_remote(&mut self, blocks: usize, asked: usize, took: Duration, now: Instant) {
        observe(&mut self.remote, blocks, asked, took, now);
    }

    /// The reader thread has nothing queued any more.
    pub(crate) fn reader_idle(&mut self) {
        self.reader_free_at = None;
    }

    /// Predicted seconds to compute `blocks` blocks of a prompt (None
    /// until a step with prompt tokens was measured).
    fn compute_seconds(&self, blocks: f64) -> Option<f64> {
        self.compute_tokens_seconds(blocks * self.block_size as f64)
    }

    /// Predicted seconds to compute `tokens` prompt tokens.
    fn compute_tokens_seconds(&self, tokens: f64) -> Option<f64> {
        let (step, per_token) = self.compute.fit()?;
        Some(per_token * tokens + step * (tokens / self.step_tokens as f64).ceil())
    }

    /// Chooses for a prefix that continues below the host tier in
    /// `disk_blocks` disk blocks, then `remote_blocks` blocks the shared
    /// tier may hold (0: it is not asked), and books the reads on the
    /// reader's queue (`fixed_wait`: time the reads take whatever is
    /// chosen, e.g. modelled host transfers). `prefill_ahead` is the prompt
    /// tokens the engine computes before this request's own.
    pub(crate) fn choose(&mut self, now: Instant, disk_blocks: usize, remote_blocks: usize, fixed_wait: Duration, prefill_ahead: usize) -> FetchChoice {
        let has_remote = remote_blocks > 0;
        let choice = match self.policy {
            FetchPolicy::Never => FetchChoice::NOTHING,
            FetchPolicy::Always => FetchChoice::of(disk_blocks > 0, has_remote),
            FetchPolicy::Auto => self.predicted_best(now, disk_blocks, remote_blocks, prefill_ahead),
        };
        // Blocks passed over in a tier not read for a while, or in a tier
        // never measured: read a few.
        let mut probe = FetchChoice::NOTHING;
        let choice = match choice.limit {
            Some(_) => {
                probe = FetchChoice { limit: None, ..choice };
                FetchChoice::NOTHING
            }
            None => choice,
        };
        if self.policy == FetchPolicy::Auto {
            if disk_blocks > 0 && !choice.disk && !choice.remote && self.disk.due_for_probe(now) {
                probe.disk = true;
            }
            if has_remote && !choice.remote && self.remote.due_for_probe(now) {
                probe.remote = true;
            }
        }
        let mut chosen = FetchChoice::of(choice.disk || probe.disk, choice.remote || probe.remote);
        if !choice.disk && !choice.remote && (probe.disk || probe.remote) {
            // Only probing: a few blocks of the probed tier (the disk's
            // first, as the chain goes), the rest computed.
            let tier = if probe.disk { &mut self.disk } else { &mut self.remote };
            chosen.limit = Some(PROBE_BLOCKS[tier.probes % PROBE_BLOCKS.len()]);
            tier.probes += 1;
            chosen.remote &= !probe.disk;
            probe.remote &= !probe.disk;
        }
        let count = |tier: &mut TierCost, had: bool, read: bool, probed: bool| {
            match (had, read, probed) {
                (false, _, _) => {}
                (true, true, true) => tier.decisions.probe += 1,
                (true, true, false) => tier.decisions.fetch += 1,
                (true, false, _) => tier.decisions.skip += 1,
            }
            if read {
                // Not probed again while this read is on its way.
                tier.last_read = Some(now);
            }
        };
        count(&mut self.disk, disk_blocks > 0, chosen.disk, probe.disk);
        // The shared tier has blocks to offer when the disk run is left to it.
        let remote_offered = has_remote || (chosen.remote && !chosen.disk);
        count(&mut self.remote, remote_offered, chosen.remote, probe.remote);
        let (disk_read, remote_read) = match chosen.limit {
            Some(limit) if chosen.disk => (disk_blocks.min(limit), 0),
            Some(limit) => (0, limit.min(disk_blocks + remote_blocks)),
            None => (disk_blocks, remote_blocks),
        };
        let reading = self.read_seconds(chosen, disk_read, remote_read).unwrap_or(0.0);
        if chosen.disk || chosen.remote || !fixed_wait.is_zero() {
            let start = self.reader_free_at.filter(|at| *at > now).unwrap_or(now);
            self.reader_free_at = Some(start + fixed_wait + Duration::from_secs_f64(reading));
        }
        chosen
    }

    /// The choice with the largest predicted saving: the compute it spares
    /// less the wait for the read (the reader's queue and the read) beyond
    /// the wait for the prefill ahead, which the read overlaps.
    fn predicted_best(&self, now: Instant, disk_blocks: usize, remote_blocks: usize, prefill_ahead: usize) -> FetchChoice {
        let mut options = vec![FetchChoice::NOTHING];
        if disk_blocks > 0 {
            options.push(FetchChoice::of(true, false));
        }
        if remote_blocks > 0 {
            options.push(FetchChoice::of(disk_blocks > 0, true));
            if disk_blocks > 0 {
                options.push(FetchChoice::of(false, true));
            }
        }
        let wait = self.reader_free_at.map_or(0.0, |at| at.saturating_duration_since(now).as_secs_f64());
        let ahead = self.compute_tokens_seconds(prefill_ahead as f64).unwrap_or(0.0);
        let mut best = (options[0], 0.0);
        for option in options.into_iter().skip(1) {
            // Compute not measured yet (a fresh engine): nothing to weigh
            // a read against; read.
            let Some(saved) = self.saved_seconds(option, disk_blocks, remote_blocks) else { return option };
            // A tier not measured yet: measured by a probe (a few blocks).
            let Some(reading) = self.read_seconds(option, disk_blocks, remote_blocks) else {
                let disk_unmeasured = option.disk && self.disk.cost.fit().is_none();
                return FetchChoice { disk: disk_unmeasured, remote: !disk_unmeasured, limit: Some(0) };
            };
            let gain = saved - (wait + reading - ahead).max(0.0);
            if gain > best.1 {
                best = (option, gain);
            }
        }
        best.0
    }

    /// Expected blocks an option brings in.
    fn expected_blocks(&self, option: FetchChoice, disk_blocks: usize, remote_blocks: usize) -> (f64, f64) {
        let from_disk = if option.disk { disk_blocks as f64 } else { 0.0 };
        let asked_remote = match (option.disk, option.remote) {
            (_, false) => 0.0,
            (true, true) => remote_blocks as f64,
            (false, true) => (disk_blocks + remote_blocks) as f64,
        };
        (from_disk, asked_remote * self.remote.held_share())
    }

    /// Predicted compute saved by an option (None: compute not measured).
    fn saved_seconds(&self, option: FetchChoice, disk_blocks: usize, remote_blocks: usize) -> Option<f64> {
        let (disk, remote) = self.expected_blocks(option, disk_blocks, remote_blocks);
        self.compute_seconds(disk + remote)
    }

    /// Predicted reading time of an option (None: a tier it reads is not
    /// measured yet).
    fn read_seconds(&self, option: FetchChoice, disk_blocks: usize, remote_blocks: usize) -> Option<f64> {
        let (disk, remote) = self.expected_blocks(option, disk_blocks, remote_blocks);
        let disk = if option.disk { self.disk.cost.predict(disk)? } else { 0.0 };
        let remote = if option.remote { self.remote.cost.predict(remote)? } else { 0.0 };
        Some(disk + remote)
    }

    /// The inputs and counts, for metrics.
    pub(crate) fn estimates(&self) -> FetchEstimates {
        let tier = |tier: &TierCost| {
            let fit = tier.cost.fit();
            TierEstimate {
                fixed_seconds: fit.map(|(fixed, _)| fixed),
                block_seconds: fit.map(|(_, per_block)| per_block),
                held_share: tier.held_share(),
                decisions: tier.decisions,
            }
        };
        let compute = self.compute.fit();
        FetchEstimates {
            policy: self.policy,
            step_seconds: compute.map(|(step, _)| step),
            token_seconds: compute.map(|(_, per_token)| per_token),
            host: tier(&self.host),
            disk: tier(&self.disk),
            remote: tier(&self.remote),
        }
    }
}

fn observe(tier: &mut TierCost, blocks: usize, asked: usize, took: Duration, now: Instant) {
    tier.cost.observe(blocks as f64, took.as_secs_f64());
    if asked > 0 {
        let share = blocks.min(asked) as f64 / asked as f64;
        tier.held = Some(tier.held.map_or(share, |held| held * 0.8 + share * 0.2));
    }
    tier.last_read = Some(now);
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_linear_cost_separates_the_round_trip_from_the_bandwidth() {
        let mut cost = LinearCost::default();
        assert_eq!(cost.fit(), None);
        for blocks in [1.0, 8.0, 4.0, 32.0, 2.0] {
            cost.observe(blocks, 0.005 + 0.001 * blocks);
        }
        let (fixed, per_block) = cost.fit().unwrap();
        assert!((fixed - 0.005).abs() < 1e-9 && (per_block - 0.001).abs() < 1e-9, "{fixed} {per_block}");
        // All reads alike: everything is per block.
        let mut alike = LinearCost::default();
        alike.observe(4.0, 0.008);
        alike.observe(4.0, 0.008);
        assert_eq!(alike.fit(), Some((0.0, 0.002)));
        // Older observations fade.
        for _ in 0..200 {
            cost.observe(10.0, 0.1);
            cost.observe(20.0, 0.2);
        }
        let (fixed, per_block) = cost.fit().unwrap();
        assert!(fixed < 1e-3 && (per_block - 0.01).abs() < 1e-3, "{fixed} {per_block}");
    }

    /// A model with compute measured at 1 ms a token (16-token blocks,
    /// so 16 ms a block) and no fixed step cost.
    fn measured(policy: FetchPolicy) -> FetchModel {
        let mut model = FetchModel::new(policy, 16, 8192);
        model.observe_step(100, 100 * MS);
        model.observe_step(200, 200 * MS);
        model
    }

    #[test]
    fn a_slow_disk_is_computed_and_a_fast_one_read() {
        let now = Instant::now();
        let mut model = measured(FetchPolicy::Auto);
        // 40 ms a block from disk: slower than 16 ms of compute.
        model.observe_disk(10, 10, 400 * MS, now);
        model.reader_idle();
        assert_eq!(model.choose(now, 20, 0, Duration::ZERO, 0), FetchChoice::NOTHING);
        // 1 ms a block: read.
        let mut model = measured(FetchPolicy::Auto);
        model.observe_disk(10, 10, 10 * MS, now);
        assert_eq!(model.choose(now, 20, 0, Duration::ZERO, 0), FetchChoice::of(true, false));
        let estimates = model.estimates();
        assert_eq!((estimates.disk.decisions.fetch, estimates.disk.decisions.skip), (1, 0));
        assert!((estimates.token_seconds.unwrap() - 0.001).abs() < 1e-9);
    }

    #[test]
    fn the_queue_ahead_counts() {
        let now = Instant::now();
        let mut model = measured(FetchPolicy::Auto);
        // 10 ms a block against 16 of compute: worth it alone...
        model.observe_disk(10, 10, 100 * MS, now);
        assert!(model.choose(now, 10, 0, Duration::ZERO, 0).disk);
        // ...but not behind a second of modelled transfers already queued.
        model.choose(now, 0, 0, Duration::from_secs(1), 0);
        assert!(!model.choose(now, 10, 0, Duration::ZERO, 0).disk);
        model.reader_idle();
        assert!(model.choose(now, 10, 0, Duration::ZERO, 0).disk);
    }

    #[test]
    fn a_read_costs_only_what_it_adds_to_the_wait_for_the_prefill_ahead() {
        let now = Instant::now();
        let mut model = measured(FetchPolicy::Auto);
        // 40 ms a block from disk against 16 of compute: 20 blocks take 800
        // ms to read and spare 320 ms of compute.
        model.observe_disk(10, 10, 400 * MS, now);
        model.reader_idle();
        assert!(!model.choose(now, 20, 0, Duration::ZERO, 0).disk, "nothing ahead: the read is all wait");
        model.reader_idle();
        // Behind 400 ms of prefill (400 tokens) the read adds 400 ms to the
        // wait: more than it spares.
        assert!(!model.choose(now, 20, 0, Duration::ZERO, 400).disk);
        model.reader_idle();
        // Behind 640 ms it adds 160 ms and spares 320: read.
        assert!(model.choose(now, 20, 0, Duration::ZERO, 640).disk);
        // The reader's queue still counts: behind that read (800 ms), the
        // same request reads only behind enough prefill to cover both.
        assert!(!model.choose(now, 20, 0, Duration::ZERO, 640).disk);
        assert!(model.choose(now, 20, 0, Duration::ZERO, 1_500).disk);
    }

    #[test]
    fn a_slow_disk_is_skipped_for_a_fast_store() {
        let now = Instant::now();
        let mut model = measured(FetchPolicy::Auto);
        model.observe_disk(10, 10, 400 * MS, now);
        model.observe_remote(10, 10, 20 * MS, now);
        model.reader_idle();
        assert_eq!(model.choose(now, 20, 10, Duration::ZERO, 0), FetchChoice::of(false, true));
        // A store that holds little is not worth a round trip.
        let mut model = measured(FetchPolicy::Auto);
        model.observe_disk(10, 10, 400 * MS, now);
        for _ in 0..20 {
            model.observe_remote(0, 10, 50 * MS, now);
        }
        model.observe_remote(1, 10, 51 * MS, now);
        model.reader_idle();
        assert_eq!(model.choose(now, 20, 10, Duration::ZERO, 0), FetchChoice::NOTHING);
    }

    #[test]
    fn unmeasured_tiers_are_read_and_passed_over_tiers_probed() {
        let now = Instant::now();
        let mut model = measured(FetchPolicy::Auto);
        assert_eq!(model.choose(now, 5, 0, Duration::ZERO, 0), FetchChoice { disk: true, remote: false, limit: Some(2) }, "never measured: probed");
        model.observe_disk(5, 5, 500 * MS, now);
        model.reader_idle();
        assert!(!model.choose(now + MS, 5, 0, Duration::ZERO, 0).disk, "slow: computed");
        model.reader_idle();
        let later = now + PROBE_INTERVAL + MS;
        assert_eq!(model.choose(later, 5, 0, Duration::ZERO, 0), FetchChoice { disk: true, remote: false, limit: Some(8) }, "probed again, a few blocks");
        model.reader_idle();
        let (mut sizes, mut at) = (Vec::new(), later);
        for _ in 0..3 {
            at += PROBE_INTERVAL + MS;
            sizes.push(model.choose(at, 100, 0, Duration::ZERO, 0).limit.unwrap());
            model.reader_idle();
        }
        assert_eq!(sizes, [4, 16, 2], "probes of varied sizes");
        assert_eq!(model.estimates().disk.decisions, Decisions { fetch: 0, skip: 1, probe: 5 });
        // Without compute measured there is nothing to compare: read.
        let mut fresh = FetchModel::new(FetchPolicy::Auto, 16, 8192);
        fresh.observe_disk(5, 5, 500 * MS, now);
        assert!(fresh.choose(now, 5, 0, Duration::ZERO, 0).disk);
    }

    #[test]
    fn fixed_policies_ignore_the_measurements() {
        let now = Instant::now();
        let mut always = measured(FetchPolicy::Always);
        always.observe_disk(10, 10, 10 * MS * 1000, now);
        assert_eq!(always.choose(now, 4, 3, Duration::ZERO, 0), FetchChoice::of(true, true));
        let mut never = measured(FetchPolicy::Never);
        never.observe_disk(10, 10, MS, now);
        assert_eq!(never.choose(now + PROBE_INTERVAL * 2, 4, 3, Duration::ZERO, 0), FetchChoice::NOTHING);
    }
}
