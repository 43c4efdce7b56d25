//! Forecasting the next interval's load from the intervals seen so far.
//!
//! A predictor is a pure function of the history (one value per interval,
//! oldest first), so the planner's predictor state is the history it keeps
//! in its database: a restarted planner forecasts exactly as before.

use crate::targets::Predictor;

/// Intervals the moving average spans.
pub const MOVING_AVERAGE_WINDOW: usize = 5;

/// One interval's load, as the planner sizes for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Requests per second.
    pub request_rate: f64,
    /// Mean input length, tokens.
    pub isl_mean: f64,
    /// Mean output length, tokens.
    pub osl_mean: f64,
}

/// Why a predictor gave no forecast.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForecastError {
    /// Nothing observed yet.
    #[error("no interval observed yet")]
    NoHistory,
    /// The model is not available in this build yet.
    #[error("the {0} predictor is not available yet")]
    Unavailable(&'static str),
}

impl Predictor {
    /// The next value of `history` (one value per interval, oldest first).
    pub fn forecast(self, history: &[f64]) -> Result<f64, ForecastError> {
        let Some(&last) = history.last() else { return Err(ForecastError::NoHistory) };
        match self {
            Predictor::Constant => Ok(last),
            Predictor::MovingAverage => {
                let window = &history[history.len().saturating_sub(MOVING_AVERAGE_WINDOW)..];
                Ok(window.iter().sum::<f64>() / window.len() as f64)
            }
            Predictor::Seasonal => Err(ForecastError::Unavailable(self.name())),
        }
    }

    /// The next interval's load, each quantity forecast from its own
    /// history.
    pub fn forecast_load(self, history: &[Load]) -> Result<Load, ForecastError> {
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

    #[test]
    fn constant_repeats_and_the_moving_average_smooths() {
        let history = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        assert_eq!(Predictor::Constant.forecast(&history), Ok(60.0));
        assert_eq!(Predictor::MovingAverage.forecast(&history), Ok(40.0));
        assert_eq!(Predictor::MovingAverage.forecast(&history[..2]), Ok(15.0));
    }

    #[test]
    fn no_history_is_no_forecast() {
        assert_eq!(Predictor::Constant.forecast(&[]), Err(ForecastError::NoHistory));
        assert_eq!(Predictor::MovingAverage.forecast_load(&[]), Err(ForecastError::NoHistory));
    }

    #[test]
    fn each_quantity_is_forecast_from_its_own_history() {
        let history = [Load { request_rate: 1.0, isl_mean: 100.0, osl_mean: 10.0 }, Load { request_rate: 3.0, isl_mean: 300.0, osl_mean: 30.0 }];
        assert_eq!(Predictor::MovingAverage.forecast_load(&history), Ok(Load { request_rate: 2.0, isl_mean: 200.0, osl_mean: 20.0 }));
    }
}
