//! What the planner sizes the pools for: latency targets at a percentile,
//! bounds per pool, a budget, the interval and the cool-down. Checked once,
//! here, whether they come from `SetTargets` or from the configuration; an
//! error names the field (`targets.pools[1].min_replicas`).

use std::time::Duration;

/// What a pool's workers do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolKind {
    /// Prefill and decode (an aggregated deployment).
    Aggregated,
    /// Prefill workers of a disaggregated deployment.
    Prefill,
    /// Decode workers of a disaggregated deployment.
    Decode,
}

/// Which model forecasts the next interval's load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Predictor {
    /// The last interval again.
    Constant,
    /// The mean of recent intervals.
    #[default]
    MovingAverage,
    /// A seasonal model (daily and weekly cycles).
    Seasonal,
}

impl Predictor {
    /// Its name on the wire and in flags.
    pub fn name(self) -> &'static str {
        match self {
            Predictor::Constant => "constant",
            Predictor::MovingAverage => "moving-average",
            Predictor::Seasonal => "seasonal",
        }
    }
}

/// A predictor's name that names none.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown predictor {0:?}: one of constant, moving-average, seasonal")]
pub struct UnknownPredictor(pub String);

impl std::str::FromStr for Predictor {
    type Err = UnknownPredictor;

    fn from_str(text: &str) -> Result<Self, UnknownPredictor> {
        match text {
            "constant" => Ok(Predictor::Constant),
            "moving-average" => Ok(Predictor::MovingAverage),
            "seasonal" => Ok(Predictor::Seasonal),
            other => Err(UnknownPredictor(other.to_owned())),
        }
    }
}

/// The bounds of one pool.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolLimits {
    /// The pool's name, as the connector knows it.
    pub pool: String,
    /// What its workers do.
    pub kind: PoolKind,
    /// Fewest replicas kept.
    pub min_replicas: u32,
    /// Most replicas asked for.
    pub max_replicas: u32,
}

/// What the planner sizes for. Only [`Targets::new`] and the conversion
/// from the wire build one, so a `Targets` is always valid.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Targets {
    ttft_ms: f64,
    itl_ms: f64,
    percentile: f64,
    pools: Vec<PoolLimits>,
    budget_workers: u32,
    interval: Duration,
    cooldown: Duration,
    predictor: Predictor,
}

/// Why targets were refused: the field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct TargetsError {
    /// The field's path, from `targets` (`targets.pools[1].min_replicas`).
    pub field: String,
    /// What is wrong, in words.
    pub problem: String,
}

pub(crate) fn refuse(field: impl Into<String>, problem: impl Into<String>) -> TargetsError {
    TargetsError { field: field.into(), problem: problem.into() }
}

/// Most pools one deployment lists (aggregated, or prefill and decode, per
/// model: generous).
pub const MAX_POOLS: usize = 64;

/// Longest pool name, bytes.
pub const MAX_POOL_NAME: usize = 253;

/// Longest interval or cool-down: a day.
pub const MAX_PERIOD: Duration = Duration::from_secs(86_400);

impl Targets {
    /// Checked targets.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ttft_ms: f64,
        itl_ms: f64,
        percentile: f64,
        pools: Vec<PoolLimits>,
        budget_workers: u32,
        interval: Duration,
        cooldown: Duration,
        predictor: Predictor,
    ) -> Result<Self, TargetsError> {
        let positive = |field: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(refuse(format!("targets.{field}"), format!("must be a positive number of milliseconds, got {value}")))
            }
        };
        positive("ttft_ms", ttft_ms)?;
        positive("itl_ms", itl_ms)?;
        if !(percentile.is_finite() && percentile > 0.0 && percentile < 100.0) {
            return Err(refuse("targets.percentile", format!("must lie in (0, 100), got {percentile}")));
        }
        if pools.is_empty() {
            return Err(refuse("targets.pools", "must list at least one pool"));
        }
        if pools.len() > MAX_POOLS {
            return Err(refuse("targets.pools", format!("{} pools, at most {MAX_POOLS}", pools.len())));
        }
        for (index, pool) in pools.iter().enumerate() {
            let field = |name: &str| format!("targets.pools[{index}].{name}");
            if pool.pool.is_empty() || pool.pool.len() > MAX_POOL_NAME || pool.pool.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(refuse(field("pool"), format!("must be a name of 1 to {MAX_POOL_NAME} bytes without spaces, got {:?}", pool.pool)));
            }
            if pools[..index].iter().any(|earlier| earlier.pool == pool.pool) {
                return Err(refuse(field("pool"), format!("{:?} is listed twice", pool.pool)));
            }
            if pool.min_replicas > pool.max_replicas {
                return Err(refuse(field("min_replicas"), format!("{} is above max_replicas {}", pool.min_replicas, pool.max_replicas)));
            }
            if pool.max_replicas == 0 {
                return Err(refuse(field("max_replicas"), "must be at least 1"));
            }
        }
        let kinds: Vec<PoolKind> = pools.iter().map(|pool| pool.kind).collect();
        if kinds.contains(&PoolKind::Aggregated) && kinds.iter().any(|kind| *kind != PoolKind::Aggregated) {
            return Err(refuse("targets.pools", "mixes aggregated pools with prefill or decode pools"));
        }
        if kinds.contains(&PoolKind::Prefill) != kinds.contains(&PoolKind::Decode) {
            return Err(refuse("targets.pools", "a disaggregated deployment needs both a prefill and a decode pool"));
        }
        let minimums: u64 = pools.iter().map(|pool| u64::from(pool.min_replicas)).sum();
        if u64::from(budget_workers) < minimums.max(1) {
            return Err(refuse("targets.budget_workers", format!("{budget_workers} is below the pools' minimums, {minimums} in all (and at least 1)")));
        }
        for (name, period) in [("interval_secs", interval), ("cooldown_secs", cooldown)] {
            if period.is_zero() || period > MAX_PERIOD {
                return Err(refuse(format!("targets.{name}"), format!("must be 1 to {} seconds, got {}", MAX_PERIOD.as_secs(), period.as_secs())));
            }
        }
        Ok(Self { ttft_ms, itl_ms, percentile, pools, budget_workers, interval, cooldown, predictor })
    }

    /// The same targets, checked again (for targets read back from the
    /// ledger, which deserializes without [`Targets::new`]).
    pub fn checked(self) -> Result<Self, TargetsError> {
        let Targets { ttft_ms, itl_ms, percentile, pools, budget_workers, interval, cooldown, predictor } = self;
        Targets::new(ttft_ms, itl_ms, percentile, pools, budget_workers, interval, cooldown, predictor)
    }

    /// TTFT target at [`percentile`](Self::percentile), milliseconds.
    pub fn ttft_ms(&self) -> f64 {
        self.ttft_ms
    }

    /// ITL target at [`percentile`](Self::percentile), milliseconds.
    pub fn itl_ms(&self) -> f64 {
        self.itl_ms
    }

    /// The percentile both targets are read at, in (0, 100).
    pub fn percentile(&self) -> f64 {
        self.percentile
    }

    /// The pools, each listed once.
    pub fn pools(&self) -> &[PoolLimits] {
        &self.pools
    }

    /// Most workers across all pools.
    pub fn budget_workers(&self) -> u32 {
        self.budget_workers
    }

    /// Time between decisions.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Time after a pool was scaled during which it is not scaled down.
    pub fn cooldown(&self) -> Duration {
        self.cooldown
    }

    /// The forecasting model.
    pub fn predictor(&self) -> Predictor {
        self.predictor
    }
}
