//! `turbine planner backtest`: each predictor's one-step-ahead error on a
//! recorded trace, the way the planner would have used it. The trace is cut
//! into intervals (request rate, mean input and output length per
//! interval); at every interval after the first each predictor forecasts it
//! from the ones before, and the error is the mean absolute percentage
//! error (MAPE) over the intervals that saw requests.

use std::path::Path;
use std::time::Duration;

use crate::plan::Predictor;
use crate::plan::predict::{Forecaster, Load};

/// One request of a trace: when it arrived (seconds from an arbitrary
/// origin), its input and output lengths.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival, seconds.
    pub at_secs: f64,
    /// Input tokens.
    pub input_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
}

/// Reads an Azure LLM inference trace (CSV `TIMESTAMP,ContextTokens,
/// GeneratedTokens`, timestamps `YYYY-MM-DD HH:MM:SS.fffffff`).
pub fn read_azure_csv(path: &Path) -> anyhow::Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path).map_err(|error| anyhow::anyhow!("reading {}: {error}", path.display()))?;
    parse_azure_csv(&text).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))
}

/// [`read_azure_csv`] on the file's text.
pub fn parse_azure_csv(text: &str) -> anyhow::Result<Vec<TraceRequest>> {
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, header)) if header.trim().eq_ignore_ascii_case("TIMESTAMP,ContextTokens,GeneratedTokens") => {}
        _ => anyhow::bail!("line 1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens"),
    }
    let mut requests = Vec::new();
    for (index, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let number = index + 1;
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [timestamp, input, output] = fields[..] else { anyhow::bail!("line {number}: expected 3 fields, got {}", fields.len()) };
        let at_secs = parse_timestamp(timestamp).ok_or_else(|| anyhow::anyhow!("line {number}: {timestamp:?} is not YYYY-MM-DD HH:MM:SS[.fraction]"))?;
        let input_tokens = input.parse().map_err(|_| anyhow::anyhow!("line {number}: ContextTokens {input:?} is not a count"))?;
        let output_tokens = output.parse().map_err(|_| anyhow::anyhow!("line {number}: GeneratedTokens {output:?} is not a count"))?;
        requests.push(TraceRequest { at_secs, input_tokens, output_tokens });
    }
    anyhow::ensure!(!requests.is_empty(), "the trace has no requests");
    Ok(requests)
}

/// Seconds since 1970-01-01 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC).
fn parse_timestamp(text: &str) -> Option<f64> {
    let (date, time) = text.split_once(' ')?;
    let mut date = date.split('-').map(str::parse::<i64>);
    let (year, month, day) = (date.next()?.ok()?, date.next()?.ok()?, date.next()?.ok()?);
    let mut time = time.split(':');
    let (hour, minute, second) = (time.next()?.parse::<i64>().ok()?, time.next()?.parse::<i64>().ok()?, time.next()?.parse::<f64>().ok()?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || !(0..24).contains(&hour) || !(0..60).contains(&minute) || !(0.0..61.0).contains(&second) {
        return None;
    }
    // Days from the civil date (proleptic Gregorian).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some((days * 86_400 + hour * 3600 + minute * 60) as f64 + second)
}

/// Most intervals a backtest cuts a trace into (a year of minutes): a
/// trace whose timestamps span more is refused rather than allocated.
pub const MAX_INTERVALS: usize = 525_600;

/// The trace cut into intervals of `interval` from its first request: each
/// interval's request rate and mean lengths (0 where it saw no request).
pub fn intervals(requests: &[TraceRequest], interval: Duration) -> anyhow::Result<Vec<Load>> {
    let width = interval.as_secs_f64();
    anyhow::ensure!(width > 0.0, "the interval must be positive");
    let Some(start) = requests.iter().map(|request| request.at_secs).min_by(f64::total_cmp) else { return Ok(Vec::new()) };
    let end = requests.iter().map(|request| request.at_secs).max_by(f64::total_cmp).unwrap_or(start);
    let span = (end - start) / width;
    anyhow::ensure!(
        span < MAX_INTERVALS as f64,
        "the trace spans {:.0} intervals of {} s, at most {MAX_INTERVALS}: use a longer interval",
        span.ceil(),
        interval.as_secs()
    );
    let count = span.floor() as usize + 1;
    let mut sums = vec![(0u64, 0u64, 0u64); count];
    for request in requests {
        let slot = &mut sums[(((request.at_secs - start) / width).floor() as usize).min(count - 1)];
        slot.0 += 1;
        slot.1 += u64::from(request.input_tokens);
        slot.2 += u64::from(request.output_tokens);
    }
    Ok(sums
        .into_iter()
        .map(|(requests, input, output)| {
            let mean = |total: u64| if requests == 0 { 0.0 } else { total as f64 / requests as f64 };
            Load { request_rate: requests as f64 / width, isl_mean: mean(input), osl_mean: mean(output) }
        })
        .collect())
}

/// One predictor's errors.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PredictorError {
    /// The predictor.
    pub predictor: &'static str,
    /// MAPE of the request rate, percent.
    pub rate_mape: f64,
    /// MAPE of the mean input length, percent.
    pub isl_mape: f64,
    /// MAPE of the mean output length, percent.
    pub osl_mape: f64,
    /// Intervals scored.
    pub scored: usize,
}

/// The predictors the backtest compares.
pub const BACKTESTED: [Predictor; 3] = [Predictor::Constant, Predictor::MovingAverage, Predictor::Seasonal];

/// Each predictor's one-step-ahead MAPE over `loads`, scoring the
/// intervals that saw requests (and have at least one before them); the
/// seasonal model's season is `season_intervals` long.
pub fn backtest(loads: &[Load], predictors: &[Predictor], season_intervals: usize) -> anyhow::Result<Vec<PredictorError>> {
    anyhow::ensure!(loads.len() >= 2, "{} intervals: the backtest needs at least 2 (a shorter interval, or a longer trace)", loads.len());
    predictors
        .iter()
        .map(|&predictor| {
            let forecaster = Forecaster::new(predictor, season_intervals);
            let mut totals = [0.0f64; 3];
            let mut scored = 0;
            for at in 1..loads.len() {
                let actual = loads[at];
                if actual.request_rate == 0.0 {
                    continue;
                }
                let forecast = forecaster.forecast_load(&loads[..at])?;
                totals[0] += (forecast.request_rate - actual.request_rate).abs() / actual.request_rate;
                totals[1] += (forecast.isl_mean - actual.isl_mean).abs() / actual.isl_mean.max(1.0);
                totals[2] += (forecast.osl_mean - actual.osl_mean).abs() / actual.osl_mean.max(1.0);
                scored += 1;
            }
            anyhow::ensure!(scored > 0, "no interval after the first saw a request");
            let percent = |total: f64| 100.0 * total / scored as f64;
            Ok(PredictorError {
                predictor: predictor.name(),
                rate_mape: percent(totals[0]),
                isl_mape: percent(totals[1]),
                osl_mape: percent(totals[2]),
                scored,
            })
        })
        .collect()
}

/// `turbine planner backtest`.
#[derive(Debug, Clone, clap::Args)]
pub struct BacktestArgs {
    /// Azure LLM inference trace (CSV TIMESTAMP,ContextTokens,GeneratedTokens), e.g.
    /// services/planner/tests/fixtures/azure_llm_inference_2023_conv.csv; repeat for more.
    #[arg(long, required = true)]
    pub trace: Vec<std::path::PathBuf>,
    /// Interval length in seconds: the planner decides once per interval.
    #[arg(long, default_value_t = 60)]
    pub interval_secs: u64,
    /// The seasonal model's season, in intervals (at least 2).
    #[arg(long, default_value_t = 5)]
    pub season_intervals: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One trace's backtest.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TraceReport {
    /// The trace file.
    pub trace: String,
    /// Requests in it.
    pub requests: usize,
    /// Intervals it spans.
    pub intervals: usize,
    /// Each predictor's errors.
    pub predictors: Vec<PredictorError>,
}

/// Runs the backtest on every trace, prints a table, and writes the JSON
/// report if asked.
pub fn run(args: &BacktestArgs) -> anyhow::Result<Vec<TraceReport>> {
    anyhow::ensure!(args.interval_secs > 0, "--interval-secs must be positive");
    let mut reports = Vec::new();
    for path in &args.trace {
        let requests = read_azure_csv(path)?;
        let loads = intervals(&requests, Duration::from_secs(args.interval_secs)).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
        let predictors = backtest(&loads, &BACKTESTED, args.season_intervals).map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
        reports.push(TraceReport { trace: path.display().to_string(), requests: requests.len(), intervals: loads.len(), predictors });
    }
    println!(
        "one-step-ahead MAPE per {}-second interval (intervals without requests not scored); seasons of {} intervals",
        args.interval_secs, args.season_intervals
    );
    println!("{:<48} {:>8} {:>9} {:<16} {:>9} {:>9} {:>9}", "trace", "requests", "intervals", "predictor", "rate %", "ISL %", "OSL %");
    for report in &reports {
        let name = Path::new(&report.trace).file_name().map_or(report.trace.clone(), |name| name.to_string_lossy().into_owned());
        for error in &report.predictors {
            println!(
                "{:<48} {:>8} {:>9} {:<16} {:>9.1} {:>9.1} {:>9.1}",
                name, report.requests, report.intervals, error.predictor, error.rate_mape, error.isl_mape, error.osl_mape
            );
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?).map_err(|error| anyhow::anyhow!("writing {}: {error}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_to_unix_seconds() {
        assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0.0));
        assert_eq!(parse_timestamp("2023-11-16 18:17:03.5"), Some(1_700_158_623.5));
        assert_eq!(parse_timestamp("2024-02-29 00:00:00"), Some(1_709_164_800.0));
        assert_eq!(parse_timestamp("2023-13-01 00:00:00"), None);
        assert_eq!(parse_timestamp("yesterday"), None);
    }

    #[test]
    fn bad_lines_are_named() {
        let header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
        assert!(parse_azure_csv("a,b,c\n").unwrap_err().to_string().contains("line 1"));
        assert!(parse_azure_csv(&format!("{header}2023-11-16 18:17:03.9,12\n")).unwrap_err().to_string().contains("line 2: expected 3 fields"));
        assert!(parse_azure_csv(&format!("{header}2023-11-16 18:17:03.9,12,x\n")).unwrap_err().to_string().contains("GeneratedTokens"));
        assert!(parse_azure_csv(header).unwrap_err().to_string().contains("no requests"));
    }

    #[test]
    fn intervals_count_requests_and_average_lengths() {
        let request = |at_secs, input_tokens, output_tokens| TraceRequest { at_secs, input_tokens, output_tokens };
        let loads = intervals(&[request(100.0, 10, 1), request(105.0, 30, 3), request(125.0, 50, 5)], Duration::from_secs(10)).unwrap();
        assert_eq!(loads.len(), 3);
        assert_eq!(loads[0], Load { request_rate: 0.2, isl_mean: 20.0, osl_mean: 2.0 });
        assert_eq!(loads[1], Load { request_rate: 0.0, isl_mean: 0.0, osl_mean: 0.0 });
        assert_eq!(loads[2], Load { request_rate: 0.1, isl_mean: 50.0, osl_mean: 5.0 });
        // Timestamps decades apart are refused, not allocated.
        let error = intervals(&[request(0.0, 1, 1), request(1.7e9, 1, 1)], Duration::from_secs(1)).unwrap_err();
        assert!(error.to_string().contains("use a longer interval"), "{error}");
    }

    #[test]
    fn a_steady_load_is_forecast_exactly_and_a_ramp_is_not() {
        let steady = vec![Load { request_rate: 4.0, isl_mean: 100.0, osl_mean: 10.0 }; 10];
        for error in backtest(&steady, &BACKTESTED, 4).unwrap() {
            // (The seasonal model's fit is numerical: within a millionth.)
            assert!(error.rate_mape < 1e-4 && error.isl_mape < 1e-4 && error.osl_mape < 1e-4 && error.scored == 9, "{error:?}");
        }
        let ramp: Vec<Load> = (1..=10).map(|n| Load { request_rate: f64::from(n), isl_mean: 100.0, osl_mean: 10.0 }).collect();
        let errors = backtest(&ramp, &BACKTESTED, 4).unwrap();
        // On a ramp the last value is closer than the mean of the last five.
        assert!(errors[0].rate_mape > 0.0 && errors[0].rate_mape < errors[1].rate_mape, "{errors:?}");
    }

    /// The published Azure traces (copies in `tests/fixtures/`): every
    /// predictor scores, and the seasonal model beats the moving average on
    /// at least one of them.
    #[test]
    fn the_azure_traces_backtest() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut seasonal_wins = 0;
        for name in ["azure_llm_inference_2023_code.csv", "azure_llm_inference_2023_conv.csv"] {
            let requests = read_azure_csv(&dir.join(name)).unwrap();
            assert!(requests.len() > 5000, "{name}: {} requests", requests.len());
            let loads = intervals(&requests, Duration::from_secs(60)).unwrap();
            assert!((55..=65).contains(&loads.len()), "{name}: about an hour, {} intervals of a minute", loads.len());
            let errors = backtest(&loads, &BACKTESTED, 5).unwrap();
            for error in &errors {
                eprintln!("{name}: {error:?}");
                // Real traffic is never forecast exactly.
                assert!(error.rate_mape.is_finite() && error.rate_mape > 0.0 && error.scored > 30, "{name}: {error:?}");
            }
            if errors[2].rate_mape < errors[1].rate_mape {
                seasonal_wins += 1;
            }
        }
        assert!(seasonal_wins >= 1, "the seasonal model beat the moving average on no trace");
    }
}
