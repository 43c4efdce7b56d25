//! What the planner sizes the pools for: latency targets at a percentile,
//! bounds per pool, a budget, the interval and the cool-down. Checked once,
//! here, whether they come from `SetTargets` or from the configuration; an
//! error names the field (`targets.pools[1].min_replicas`).

use std::time::Duration;

use turbine_proto::planner::v1 as pb;

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

impl std::str::FromStr for Predictor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "constant" => Ok(Predictor::Constant),
            "moving-average" => Ok(Predictor::MovingAverage),
            "seasonal" => Ok(Predictor::Seasonal),
            other => Err(format!("unknown predictor {other:?}: one of constant, moving-average, seasonal")),
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

fn refuse(field: impl Into<String>, problem: impl Into<String>) -> TargetsError {
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

impl TryFrom<pb::Targets> for Targets {
    type Error = TargetsError;

    fn try_from(targets: pb::Targets) -> Result<Self, TargetsError> {
        let pb::Targets { ttft_ms, itl_ms, percentile, pools, budget_workers, interval_secs, cooldown_secs, predictor } = targets;
        let pools = pools
            .into_iter()
            .enumerate()
            .map(|(index, limits)| {
                let pb::PoolLimits { pool, kind, min_replicas, max_replicas } = limits;
                let kind = match pb::PoolKind::try_from(kind) {
                    Ok(pb::PoolKind::Aggregated) => PoolKind::Aggregated,
                    Ok(pb::PoolKind::Prefill) => PoolKind::Prefill,
                    Ok(pb::PoolKind::Decode) => PoolKind::Decode,
                    Ok(pb::PoolKind::Unspecified) => return Err(refuse(format!("targets.pools[{index}].kind"), "must be set (AGGREGATED, PREFILL or DECODE)")),
                    Err(_) => return Err(refuse(format!("targets.pools[{index}].kind"), format!("unknown value {kind}"))),
                };
                Ok(PoolLimits { pool, kind, min_replicas, max_replicas })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let predictor =
            if predictor.is_empty() { Predictor::default() } else { predictor.parse().map_err(|problem: String| refuse("targets.predictor", problem))? };
        Targets::new(
            ttft_ms,
            itl_ms,
            percentile,
            pools,
            budget_workers,
            Duration::from_secs(u64::from(interval_secs)),
            Duration::from_secs(u64::from(cooldown_secs)),
            predictor,
        )
    }
}

impl From<&Targets> for pb::Targets {
    fn from(targets: &Targets) -> Self {
        let Targets { ttft_ms, itl_ms, percentile, pools, budget_workers, interval, cooldown, predictor } = targets;
        pb::Targets {
            ttft_ms: *ttft_ms,
            itl_ms: *itl_ms,
            percentile: *percentile,
            pools: pools
                .iter()
                .map(|PoolLimits { pool, kind, min_replicas, max_replicas }| pb::PoolLimits {
                    pool: pool.clone(),
                    kind: match kind {
                        PoolKind::Aggregated => pb::PoolKind::Aggregated,
                        PoolKind::Prefill => pb::PoolKind::Prefill,
                        PoolKind::Decode => pb::PoolKind::Decode,
                    } as i32,
                    min_replicas: *min_replicas,
                    max_replicas: *max_replicas,
                })
                .collect(),
            budget_workers: *budget_workers,
            // Whole seconds: both were built from seconds.
            interval_secs: interval.as_secs() as u32,
            cooldown_secs: cooldown.as_secs() as u32,
            predictor: predictor.name().to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str, kind: pb::PoolKind, min: u32, max: u32) -> pb::PoolLimits {
        pb::PoolLimits { pool: name.into(), kind: kind as i32, min_replicas: min, max_replicas: max }
    }

    fn valid() -> pb::Targets {
        pb::Targets {
            ttft_ms: 500.0,
            itl_ms: 30.0,
            percentile: 90.0,
            pools: vec![pool("prefill", pb::PoolKind::Prefill, 1, 4), pool("decode", pb::PoolKind::Decode, 1, 8)],
            budget_workers: 10,
            interval_secs: 60,
            cooldown_secs: 120,
            predictor: String::new(),
        }
    }

    fn field_refused(change: impl FnOnce(&mut pb::Targets)) -> String {
        let mut targets = valid();
        change(&mut targets);
        Targets::try_from(targets).expect_err("refused").field
    }

    #[test]
    fn valid_targets_round_trip_with_the_default_predictor_filled_in() {
        let targets = Targets::try_from(valid()).unwrap();
        assert_eq!(targets.predictor(), Predictor::MovingAverage);
        assert_eq!(targets.interval(), Duration::from_secs(60));
        let wire = pb::Targets::from(&targets);
        assert_eq!(wire, pb::Targets { predictor: "moving-average".into(), ..valid() });
        assert_eq!(Targets::try_from(wire).unwrap(), targets);
    }

    #[test]
    fn every_bad_field_is_named() {
        assert_eq!(field_refused(|t| t.ttft_ms = -1.0), "targets.ttft_ms");
        assert_eq!(field_refused(|t| t.ttft_ms = 0.0), "targets.ttft_ms");
        assert_eq!(field_refused(|t| t.itl_ms = f64::NAN), "targets.itl_ms");
        assert_eq!(field_refused(|t| t.percentile = 0.0), "targets.percentile");
        assert_eq!(field_refused(|t| t.percentile = 100.0), "targets.percentile");
        assert_eq!(field_refused(|t| t.percentile = 150.0), "targets.percentile");
        assert_eq!(field_refused(|t| t.pools.clear()), "targets.pools");
        assert_eq!(field_refused(|t| t.pools[1].min_replicas = 9), "targets.pools[1].min_replicas");
        assert_eq!(field_refused(|t| t.pools[0].max_replicas = 0), "targets.pools[0].min_replicas");
        assert_eq!(
            field_refused(|t| {
                t.pools[0].min_replicas = 0;
                t.pools[0].max_replicas = 0;
            }),
            "targets.pools[0].max_replicas"
        );
        assert_eq!(field_refused(|t| t.pools[1].pool = String::new()), "targets.pools[1].pool");
        assert_eq!(field_refused(|t| t.pools[1].pool = "pre fill".into()), "targets.pools[1].pool");
        assert_eq!(field_refused(|t| t.pools[1].pool = "prefill".into()), "targets.pools[1].pool");
        assert_eq!(field_refused(|t| t.pools[0].kind = 0), "targets.pools[0].kind");
        assert_eq!(field_refused(|t| t.pools[0].kind = 42), "targets.pools[0].kind");
        assert_eq!(field_refused(|t| t.pools[1].kind = pb::PoolKind::Aggregated as i32), "targets.pools");
        assert_eq!(field_refused(|t| t.pools.truncate(1)), "targets.pools");
        assert_eq!(field_refused(|t| t.budget_workers = 1), "targets.budget_workers");
        assert_eq!(field_refused(|t| t.interval_secs = 0), "targets.interval_secs");
        assert_eq!(field_refused(|t| t.cooldown_secs = 100_000), "targets.cooldown_secs");
        assert_eq!(field_refused(|t| t.predictor = "crystal-ball".into()), "targets.predictor");
    }

    #[test]
    fn an_aggregated_deployment_has_one_kind_of_pool() {
        let mut targets = valid();
        targets.pools = vec![pool("workers", pb::PoolKind::Aggregated, 0, 6)];
        targets.budget_workers = 6;
        assert_eq!(Targets::try_from(targets).unwrap().pools().len(), 1);
    }

    #[test]
    fn errors_read_as_field_and_problem() {
        let mut targets = valid();
        targets.percentile = 100.0;
        assert_eq!(Targets::try_from(targets).unwrap_err().to_string(), "targets.percentile: must lie in (0, 100), got 100");
    }
}
