//! A performance profile of one worker configuration, as `turbine profile`
//! measures it and the planner sizes pools from it:
//!
//! - prefill: time to first token of one request alone, by input length;
//! - decode: inter-token latency by context (tokens in the sequence) and
//!   concurrency (sequences decoding together on the worker).
//!
//! Between measured points the profile interpolates linearly (bilinearly
//! for decode); below the first point it keeps the first value, beyond the
//! last it extends the last segment's slope (never below the last value, so
//! a longer input is never predicted faster).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The profile file format's version.
pub const PROFILE_VERSION: u32 = 1;

/// Time to first token at one input length.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    /// Input tokens.
    pub isl: u32,
    /// Median time to first token of a request alone, milliseconds.
    pub ttft_ms: f64,
}

/// Inter-token latency at one context and concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    /// Tokens in each sequence (its prompt) when decoding starts.
    pub context: u32,
    /// Sequences decoding together.
    pub concurrency: u32,
    /// Mean time between tokens after the first, milliseconds.
    pub itl_ms: f64,
}

/// A worker configuration's profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// [`PROFILE_VERSION`].
    pub version: u32,
    /// What was measured, in words (engine, model, flags).
    pub worker: String,
    /// By input length, ascending.
    pub prefill: Vec<PrefillPoint>,
    /// By context, then concurrency, ascending; every context has the same
    /// concurrencies.
    pub decode: Vec<DecodePoint>,
}

/// Why a profile cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file could not be read.
    #[error("profile {path}: {error}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        error: std::io::Error,
    },
    /// The file is not a profile of this version, or its numbers are not
    /// usable.
    #[error("profile {path}: {problem}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        problem: String,
    },
}

/// Linear interpolation of `points` (x ascending) at `x`: below the first
/// point its value, beyond the last the last segment's slope (never below
/// the last value).
fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    let (Some(&(x_first, y_first)), Some(&(_, y_last))) = (points.first(), points.last()) else { return f64::NAN };
    if points.len() == 1 || x <= x_first {
        return y_first;
    }
    let segment = points.windows(2).position(|pair| x <= pair[1].0).unwrap_or(points.len() - 2);
    let ((x0, y0), (x1, y1)) = (points[segment], points[segment + 1]);
    let y = y0 + (y1 - y0) * (x - x0) / (x1 - x0);
    if x > x1 { y.max(y_last) } else { y }
}

impl Profile {
    /// Checks the profile: points present, ascending, positive.
    pub fn check(self, path: &str) -> Result<Self, ProfileError> {
        let invalid = |problem: String| ProfileError::Invalid { path: path.to_owned(), problem };
        if self.version != PROFILE_VERSION {
            return Err(invalid(format!("version {}, this planner reads version {PROFILE_VERSION}", self.version)));
        }
        if self.prefill.is_empty() || self.decode.is_empty() {
            return Err(invalid("needs prefill and decode points (run turbine profile)".into()));
        }
        if !self.prefill.windows(2).all(|pair| pair[0].isl < pair[1].isl) {
            return Err(invalid("prefill points must ascend by isl".into()));
        }
        if let Some(bad) = self.prefill.iter().find(|point| point.isl == 0 || !(point.ttft_ms.is_finite() && point.ttft_ms > 0.0)) {
            return Err(invalid(format!("prefill point {bad:?}: isl and ttft_ms must be positive")));
        }
        if let Some(bad) = self.decode.iter().find(|point| point.concurrency == 0 || !(point.itl_ms.is_finite() && point.itl_ms > 0.0)) {
            return Err(invalid(format!("decode point {bad:?}: concurrency and itl_ms must be positive")));
        }
        let contexts = self.contexts();
        let concurrencies: Vec<u32> = self.decode.iter().filter(|point| point.context == contexts[0]).map(|point| point.concurrency).collect();
        let grid: Vec<(u32, u32)> = contexts.iter().flat_map(|&context| concurrencies.iter().map(move |&concurrency| (context, concurrency))).collect();
        if self.decode.iter().map(|point| (point.context, point.concurrency)).collect::<Vec<_>>() != grid
            || !concurrencies.windows(2).all(|pair| pair[0] < pair[1])
        {
            return Err(invalid("decode points must form a grid: by context, then concurrency, both ascending".into()));
        }
        Ok(self)
    }

    /// Reads and checks the profile at `path`.
    pub fn read(path: &Path) -> Result<Self, ProfileError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| ProfileError::Read { path: name.clone(), error })?;
        let profile: Profile = serde_json::from_str(&text).map_err(|error| ProfileError::Invalid { path: name.clone(), problem: error.to_string() })?;
        profile.check(&name)
    }

    fn contexts(&self) -> Vec<u32> {
        let mut contexts: Vec<u32> = self.decode.iter().map(|point| point.context).collect();
        contexts.dedup();
        contexts
    }

    /// Time to first token of a request of `isl` tokens alone, ms.
    pub fn ttft_ms(&self, isl: f64) -> f64 {
        let points: Vec<(f64, f64)> = self.prefill.iter().map(|point| (f64::from(point.isl), point.ttft_ms)).collect();
        interpolate(&points, isl)
    }

    /// Inter-token latency at `context` tokens and `concurrency` sequences, ms.
    pub fn itl_ms(&self, context: f64, concurrency: f64) -> f64 {
        let at_context: Vec<(f64, f64)> = self
            .contexts()
            .into_iter()
            .map(|ctx| {
                let row: Vec<(f64, f64)> =
                    self.decode.iter().filter(|point| point.context == ctx).map(|point| (f64::from(point.concurrency), point.itl_ms)).collect();
                (f64::from(ctx), interpolate(&row, concurrency))
            })
            .collect();
        interpolate(&at_context, context)
    }

    /// The most sequences decoding together the profile measured.
    pub fn max_concurrency(&self) -> f64 {
        f64::from(self.decode.iter().map(|point| point.concurrency).max().unwrap_or(1))
    }

    /// The most sequences a worker decodes together at `context` with an
    /// inter-token latency of at most `itl_ms` (at least 1, at most the
    /// largest concurrency measured; fractional between measured points).
    pub fn concurrency_within(&self, context: f64, itl_ms: f64) -> f64 {
        let largest = self.decode.iter().map(|point| point.concurrency).max().unwrap_or(1);
        let (mut low, mut high) = (1.0_f64, f64::from(largest));
        if self.itl_ms(context, high) <= itl_ms {
            return high;
        }
        if self.itl_ms(context, low) > itl_ms {
            return low;
        }
        for _ in 0..40 {
            let middle = (low + high) / 2.0;
            if self.itl_ms(context, middle) <= itl_ms { low = middle } else { high = middle }
        }
        low
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        let decode = [(512, 1, 10.0), (512, 8, 20.0), (2048, 1, 14.0), (2048, 8, 30.0)]
            .into_iter()
            .map(|(context, concurrency, itl_ms)| DecodePoint { context, concurrency, itl_ms })
            .collect();
        Profile {
            version: PROFILE_VERSION,
            worker: "mocker".into(),
            prefill: vec![PrefillPoint { isl: 128, ttft_ms: 20.0 }, PrefillPoint { isl: 1024, ttft_ms: 110.0 }],
            decode,
        }
    }

    #[test]
    fn latencies_interpolate_between_and_extend_beyond_the_points() {
        let profile = profile().check("test").unwrap();
        assert!((profile.ttft_ms(576.0) - 65.0).abs() < 1e-9);
        assert!((profile.ttft_ms(2048.0) - (110.0 + 1024.0 * 90.0 / 896.0)).abs() < 1e-9, "the last slope extended: {}", profile.ttft_ms(2048.0));
        assert_eq!(profile.ttft_ms(64.0), 20.0, "below the first point: its value");
        assert!((profile.itl_ms(512.0, 4.5) - 15.0).abs() < 1e-9);
        assert!((profile.itl_ms(1280.0, 1.0) - 12.0).abs() < 1e-9);
        assert!((profile.concurrency_within(512.0, 15.0) - 4.5).abs() < 1e-6);
        assert_eq!(profile.concurrency_within(512.0, 5.0), 1.0, "never below one sequence");
        assert_eq!(profile.concurrency_within(512.0, 50.0), 8.0, "never beyond what was measured");
    }

    #[test]
    fn unusable_profiles_are_refused_with_the_reason() {
        let refused = |change: fn(&mut Profile)| {
            let mut bad = profile();
            change(&mut bad);
            bad.check("p.json").unwrap_err().to_string()
        };
        assert!(refused(|p| p.version = 9).contains("version 9"));
        assert!(refused(|p| p.prefill.clear()).contains("needs prefill and decode"));
        assert!(refused(|p| p.prefill.reverse()).contains("ascend"));
        assert!(refused(|p| p.decode[1].itl_ms = f64::NAN).contains("must be positive"));
        assert!(
            refused(|p| {
                p.decode.pop();
            })
            .contains("grid")
        );
    }
}
