//! Forecasting the next interval's load from the intervals seen so far.
//!
//! A predictor is a pure function of the history (one value per interval,
//! oldest first), so the planner's predictor state is the history it keeps
//! in its database: a restarted planner forecasts exactly as before.
//!
//! - constant: the last interval again;
//! - moving average: the mean of the last [`MOVING_AVERAGE_WINDOW`];
//! - seasonal: `augurs`' MSTL (the history decomposed into a trend, one
//!   seasonal component of the configured season length, and a remainder;
//!   the trend forecast by an automatically chosen exponential smoothing
//!   model, the season repeated). Until two whole seasons are seen it
//!   falls back to the moving average. Its forecasts are never negative.

use augurs_core::{Fit, Predict};

use crate::plan::Predictor;

/// Intervals the moving average spans.
pub const MOVING_AVERAGE_WINDOW: usize = 5;

/// A predictor and, for the seasonal one, the season's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forecaster {
    /// The model.
    pub predictor: Predictor,
    /// Intervals per season (the seasonal model's period), at least 2.
    pub season_intervals: usize,
}

pub use turbine_api::planner::Load;

/// Why a predictor gave no forecast.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForecastError {
    /// Nothing observed yet.
    #[error("no interval observed yet")]
    NoHistory,
    /// The seasonal model failed on this history.
    #[error("the seasonal model: {0}")]
    Model(String),
}

fn moving_average(history: &[f64]) -> f64 {
    let window = &history[history.len().saturating_sub(MOVING_AVERAGE_WINDOW)..];
    window.iter().sum::<f64>() / window.len() as f64
}

impl Forecaster {
    /// `predictor`, with seasons of `season_intervals` (at least 2).
    pub fn new(predictor: Predictor, season_intervals: usize) -> Self {
        Self { predictor, season_intervals: season_intervals.max(2) }
    }

    /// The next value of `history` (one value per interval, oldest first).
    pub fn forecast(&self, history: &[f64]) -> Result<f64, ForecastError> {
        let Some(&last) = history.last() else { return Err(ForecastError::NoHistory) };
        match self.predictor {
            Predictor::Constant => Ok(last),
            Predictor::MovingAverage => Ok(moving_average(history)),
            Predictor::Seasonal if history.len() < 2 * self.season_intervals => Ok(moving_average(history)),
            Predictor::Seasonal => {
                let trend = augurs_ets::AutoETS::non_seasonal().into_trend_model();
                let model = augurs_mstl::MSTLModel::new(vec![self.season_intervals], trend);
                let fitted = model.fit(history).map_err(|error| ForecastError::Model(error.to_string()))?;
                let forecast = fitted.predict(1, None).map_err(|error| ForecastError::Model(error.to_string()))?;
                let next = forecast.point.first().copied().ok_or_else(|| ForecastError::Model("no point forecast".into()))?;
                if next.is_finite() { Ok(next.max(0.0)) } else { Err(ForecastError::Model(format!("forecast {next}"))) }
            }
        }
    }

    /// The next interval's load, each quantity forecast from its own
    /// history.
    pub fn forecast_load(&self, history: &[Load]) -> Result<Load, ForecastError> {
        let series = |value: fn(&Load) -> f64| history.iter().map(value).collect::<Vec<f64>>();
        Ok(Load {
            request_rate: self.forecast(&series(|load| load.request_rate))?,
            isl_mean: self.forecast(&series(|load| load.isl_mean))?,
            osl_mean: self.forecast(&series(|load| load.osl_mean))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forecaster(predictor: Predictor) -> Forecaster {
        Forecaster::new(predictor, 4)
    }

    #[test]
    fn constant_repeats_and_the_moving_average_smooths() {
        let history = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        assert_eq!(forecaster(Predictor::Constant).forecast(&history), Ok(60.0));
        assert_eq!(forecaster(Predictor::MovingAverage).forecast(&history), Ok(40.0));
        assert_eq!(forecaster(Predictor::MovingAverage).forecast(&history[..2]), Ok(15.0));
    }

    #[test]
    fn no_history_is_no_forecast() {
        for predictor in [Predictor::Constant, Predictor::MovingAverage, Predictor::Seasonal] {
            assert_eq!(forecaster(predictor).forecast(&[]), Err(ForecastError::NoHistory));
            assert_eq!(forecaster(predictor).forecast_load(&[]), Err(ForecastError::NoHistory));
        }
    }

    #[test]
    fn each_quantity_is_forecast_from_its_own_history() {
        let history = [Load { request_rate: 1.0, isl_mean: 100.0, osl_mean: 10.0 }, Load { request_rate: 3.0, isl_mean: 300.0, osl_mean: 30.0 }];
        assert_eq!(forecaster(Predictor::MovingAverage).forecast_load(&history), Ok(Load { request_rate: 2.0, isl_mean: 200.0, osl_mean: 20.0 }));
    }

    #[test]
    fn the_seasonal_model_follows_a_season_the_others_miss() {
        // A repeating 4-interval pattern over a slow rise.
        let history: Vec<f64> = (0..40).map(|n| [10.0, 30.0, 50.0, 20.0][n % 4] + n as f64 * 0.5).collect();
        let next = 10.0 + 40.0 * 0.5;
        let seasonal = forecaster(Predictor::Seasonal).forecast(&history).unwrap();
        let average = forecaster(Predictor::MovingAverage).forecast(&history).unwrap();
        assert!((seasonal - next).abs() < 3.0, "seasonal {seasonal} vs {next}");
        assert!((seasonal - next).abs() < (average - next).abs(), "seasonal {seasonal}, moving average {average}, actual {next}");
        // Short of two seasons it is the moving average.
        assert_eq!(forecaster(Predictor::Seasonal).forecast(&history[..7]), forecaster(Predictor::MovingAverage).forecast(&history[..7]));
    }
}
