//! Observing the deployment, one interval at a time, from the services' own
//! interfaces:
//!
//! - the gateways' `/metrics` (every request passes a gateway): requests
//!   finished, prompt and completion tokens, and the TTFT and inter-token
//!   latency histograms, read as the change since the last interval and
//!   summed over gateways and models; the percentiles are read from the
//!   summed buckets (`turbine_runtime::metrics::slo_latency_buckets`, each
//!   15% above the last). The request rate is the demand: requests as they
//!   arrived, those refused for capacity included (gateways before
//!   `turbine_gateway_arrivals_total`: of requests that got their first
//!   token, which is the fleet's capacity, not the demand, once requests
//!   queue). The rate of first tokens is kept beside it (served), and the
//!   requests awaiting a first token when the interval ended (the
//!   backlog); requests finishing trail arrivals by a whole request,
//!   longer than an interval on a ramp. The lengths are the means of the latest requests
//!   finished, at least ten (the intervals before are added while fewer
//!   finished in this one, up to twenty intervals; none when fewer than
//!   ten finished in all: the first to finish are the short ones). A
//!   percentile needs ten requests in the interval. Beside them, read
//!   while requests run (before any finishes, at a start): the mean time
//!   between the tokens streamed in the interval (at least ten) and the
//!   mean prompt of the requests that got their first token (at least
//!   ten);
//! - the worker registry: each pool's workers (by role), the sequences
//!   they run and queue, and their KV usage (a fraction, and tokens per
//!   running sequence) as their last heartbeat reported them.
//!
//! Every pool gets the deployment's load and latencies (a request crosses
//! every pool); replicas, queue and KV usage are the pool's own.

use std::time::{Duration, Instant};

use turbine_registry::{Registry, WorkerRole};

use crate::plan::Observation;
use crate::plan::predict::Load;
pub mod prom;

use self::prom::{Histogram, Sample};
use crate::plan::{PoolKind, Targets};

/// The gateway histograms and counters read.
const TTFT: &str = "turbine_gateway_time_to_first_token_seconds";
const ITL: &str = "turbine_gateway_inter_token_latency_seconds";
const ITL_SUM: &str = "turbine_gateway_inter_token_latency_seconds_sum";
const FINISHED: &str = "turbine_gateway_request_duration_seconds_count";
const TOKENS: &str = "turbine_gateway_tokens_total";
const STARTED_PROMPT: &str = "turbine_gateway_started_prompt_tokens_total";
const GAP_SUM: &str = "turbine_gateway_token_gap_seconds_sum";
const GAP_COUNT: &str = "turbine_gateway_token_gap_seconds_count";
const ARRIVALS: &str = "turbine_gateway_arrivals_total";
const REFUSED: &str = "turbine_gateway_refused_total";
const AWAITING: &str = "turbine_gateway_awaiting_first_token";

/// Fewest requests a percentile or a mean length is read from: the p90
/// of fewer than ten is their slowest, and the first requests to finish
/// after a start are the short ones.
const MIN_SAMPLES: f64 = 10.0;

/// Most intervals the lengths are read over.
const LENGTH_WINDOW: usize = 20;

/// Finished requests the mean lengths are read from once that many
/// finished in the window: one interval's few dozen requests give means
/// that swing by half (a heavy-tailed input length), and the decode pool
/// is sized on them.
const LENGTH_SAMPLES: f64 = 100.0;

/// How long one scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why an interval could not be observed (the planner then decides
/// nothing for it: it never sizes on missing data).
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// A gateway's metrics could not be read.
    #[error("gateway metrics at {url}: {problem}")]
    Gateway {
        /// The URL scraped.
        url: String,
        /// What went wrong.
        problem: String,
    },
    /// The worker registry could not be read.
    #[error("worker registry: {0}")]
    Registry(String),
}

/// The gateways' totals at one moment, summed over gateways and models.
#[derive(Debug, Clone, Default, PartialEq)]
struct Totals {
    finished: f64,
    prompt_tokens: f64,
    completion_tokens: f64,
    /// The ITL histogram's sum, seconds.
    itl_sum: f64,
    /// Prompt tokens of the requests that got their first token.
    started_prompt_tokens: f64,
    /// The time between streamed tokens: its sum (seconds) and count.
    gap_sum: f64,
    gap_count: f64,
    ttft: Histogram,
    itl: Histogram,
    /// Requests as they arrived, with those the gateways refused before
    /// reading them (at their limit of concurrent requests): the demand.
    arrivals: f64,
    /// Whether a gateway counts arrivals (one that counts none yet, or an
    /// older one, does not show the counter).
    counts_arrivals: bool,
    /// Requests awaiting their first token, now (a gauge: not a change).
    awaiting: f64,
}

impl Totals {
    fn add(&mut self, samples: &[Sample]) {
        self.finished += prom::sum(samples, FINISHED, &[]);
        self.prompt_tokens += prom::sum(samples, TOKENS, &[("kind", "prompt")]);
        self.completion_tokens += prom::sum(samples, TOKENS, &[("kind", "completion")]);
        self.itl_sum += prom::sum(samples, ITL_SUM, &[]);
        self.started_prompt_tokens += prom::sum(samples, STARTED_PROMPT, &[]);
        self.gap_sum += prom::sum(samples, GAP_SUM, &[]);
        self.gap_count += prom::sum(samples, GAP_COUNT, &[]);
        self.arrivals += prom::sum(samples, ARRIVALS, &[])
            + prom::sum(samples, REFUSED, &[("reason", "gateway_full")])
            + prom::sum(samples, REFUSED, &[("reason", "client_share")]);
        self.counts_arrivals |= samples.iter().any(|sample| sample.name == ARRIVALS);
        self.awaiting += prom::sum(samples, AWAITING, &[]);
        for (total, name) in [(&mut self.ttft, TTFT), (&mut self.itl, ITL)] {
            let more = Histogram::sum_of(samples, name);
            for (bound, count) in more.buckets {
                match total.buckets.iter_mut().find(|(le, _)| *le == bound) {
                    Some((_, sum)) => *sum += count,
                    None => total.buckets.push((bound, count)),
                }
            }
            total.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }

    /// What happened since `earlier`; `None` when a count went down (a
    /// gateway restarted or left: the interval is not comparable).
    fn since(&self, earlier: &Totals) -> Option<Totals> {
        let delta = |now: f64, before: f64| (now >= before).then_some(now - before);
        Some(Totals {
            finished: delta(self.finished, earlier.finished)?,
            prompt_tokens: delta(self.prompt_tokens, earlier.prompt_tokens)?,
            completion_tokens: delta(self.completion_tokens, earlier.completion_tokens)?,
            itl_sum: delta(self.itl_sum, earlier.itl_sum)?,
            started_prompt_tokens: delta(self.started_prompt_tokens, earlier.started_prompt_tokens)?,
            gap_sum: delta(self.gap_sum, earlier.gap_sum)?,
            gap_count: delta(self.gap_count, earlier.gap_count)?,
            ttft: self.ttft.since(&earlier.ttft)?,
            itl: self.itl.since(&earlier.itl)?,
            arrivals: delta(self.arrivals, earlier.arrivals)?,
            counts_arrivals: self.counts_arrivals,
            awaiting: self.awaiting,
        })
    }
}

/// Mean input and output lengths over the newest intervals (`finished`,
/// prompt and completion tokens per interval, oldest first) that hold
/// `LENGTH_SAMPLES` finished requests, or the whole window when it holds
/// fewer but at least `MIN_SAMPLES` (a start); zeros below that.
fn mean_lengths(window: &std::collections::VecDeque<(f64, f64, f64)>) -> (f64, f64) {
    let mut sum = (0.0, 0.0, 0.0);
    for (finished, prompt, completion) in window.iter().rev() {
        sum = (sum.0 + finished, sum.1 + prompt, sum.2 + completion);
        if sum.0 >= LENGTH_SAMPLES {
            break;
        }
    }
    if sum.0 >= MIN_SAMPLES { (sum.1 / sum.0, sum.2 / sum.0) } else { (0.0, 0.0) }
}

/// Reads the deployment every interval.
#[derive(Debug)]
pub struct Observer {
    http: reqwest::Client,
    gateways: Vec<String>,
    registry: Registry,
    last: Option<(Instant, Totals)>,
    /// The latest intervals' requests finished and their prompt and
    /// completion tokens, oldest first.
    finished: std::collections::VecDeque<(f64, f64, f64)>,
}

/// The registry role of a pool's workers.
fn role(kind: PoolKind) -> WorkerRole {
    match kind {
        PoolKind::Aggregated => WorkerRole::Aggregated,
        PoolKind::Prefill => WorkerRole::Prefill,
        PoolKind::Decode => WorkerRole::Decode,
    }
}

impl Observer {
    /// Observes through the gateways' metrics pages at `gateways` (full
    /// URLs, `http://gateway:8000/metrics`) and the workers in `registry`.
    pub fn new(gateways: Vec<String>, registry: Registry) -> Self {
        let http = reqwest::Client::builder().timeout(SCRAPE_TIMEOUT).build().expect("an HTTP client");
        Self { http, gateways, registry, last: None, finished: std::collections::VecDeque::new() }
    }

    async fn totals(&self) -> Result<Totals, ObserveError> {
        let mut totals = Totals::default();
        for url in &self.gateways {
            let failed = |problem: String| ObserveError::Gateway { url: url.clone(), problem };
            let response = self.http.get(url).send().await.map_err(|error| failed(error.to_string()))?;
            if !response.status().is_success() {
                return Err(failed(format!("HTTP {}", response.status())));
            }
            let text = response.text().await.map_err(|error| failed(error.to_string()))?;
            totals.add(&prom::parse(&text).map_err(|unreadable| failed(unreadable.to_string()))?);
        }
        Ok(totals)
    }

    /// Mean input and output lengths of the latest requests finished,
    /// `interval` the newest ([`mean_lengths`]).
    fn lengths(&mut self, interval: &Totals) -> (f64, f64) {
        self.finished.push_back((interval.finished, interval.prompt_tokens, interval.completion_tokens));
        if self.finished.len() > LENGTH_WINDOW {
            self.finished.pop_front();
        }
        mean_lengths(&self.finished)
    }

    /// The interval since the last call, one observation per pool of
    /// `targets`. `Ok(None)` the first time (it only takes the baseline)
    /// and after a gateway restarted or left (a new baseline).
    pub async fn observe(&mut self, targets: &Targets) -> Result<Option<Vec<Observation>>, ObserveError> {
        let totals = self.totals().await?;
        let workers = self.registry.list().await.map_err(|error| ObserveError::Registry(error.to_string()))?;
        let now = Instant::now();
        let Some((then, earlier)) = self.last.replace((now, totals.clone())) else { return Ok(None) };
        let Some(interval) = totals.since(&earlier) else {
            tracing::warn!("a gateway's counts went down (it restarted or left): this interval starts a new baseline");
            return Ok(None);
        };
        let seconds = now.duration_since(then).as_secs_f64().max(1e-3);
        let (isl_mean, osl_mean) = self.lengths(&interval);
        let served_rate = interval.ttft.count() / seconds;
        // The demand: requests as they arrive. The rate of first tokens is
        // what the fleet served, its capacity once requests queue.
        let request_rate = if interval.counts_arrivals { interval.arrivals / seconds } else { served_rate };
        let load = Load { request_rate, isl_mean, osl_mean };
        let quantile = targets.percentile() / 100.0;
        let milliseconds =
            |histogram: &Histogram| (histogram.count() >= MIN_SAMPLES).then(|| histogram.quantile(quantile)).flatten().map(|seconds| seconds * 1000.0);
        let (ttft_ms, itl_ms) = (milliseconds(&interval.ttft), milliseconds(&interval.itl));
        let itl_mean_ms = itl_ms.map(|_| interval.itl_sum / interval.itl.count() * 1000.0);
        let token_gap_ms = (interval.gap_count >= MIN_SAMPLES).then(|| interval.gap_sum / interval.gap_count * 1000.0);
        let started_isl_mean = if interval.ttft.count() >= MIN_SAMPLES { interval.started_prompt_tokens / interval.ttft.count() } else { 0.0 };
        Ok(Some(
            targets
                .pools()
                .iter()
                .map(|pool| {
                    let members: Vec<_> = workers.iter().map(|live| &live.record).filter(|record| record.role == role(pool.kind)).collect();
                    let (used, total) = members
                        .iter()
                        .fold((0u64, 0u64), |(used, total), record| (used + u64::from(record.load.blocks_used), total + u64::from(record.load.blocks_total)));
                    let running: u32 = members.iter().map(|record| record.load.running).sum();
                    let cached_tokens: f64 = members.iter().map(|record| f64::from(record.load.blocks_used) * f64::from(record.kv_block_size)).sum();
                    Observation {
                        pool: pool.pool.clone(),
                        load,
                        ttft_ms,
                        itl_ms,
                        queue_depth: members.iter().map(|record| f64::from(record.load.waiting)).sum(),
                        kv_usage: if total > 0 { used as f64 / total as f64 } else { 0.0 },
                        replicas: members.len() as u32,
                        running,
                        context_tokens: if running > 0 { cached_tokens / f64::from(running) } else { 0.0 },
                        finish_rate: interval.finished / seconds,
                        itl_mean_ms,
                        token_gap_ms,
                        started_isl_mean,
                        served_rate,
                        awaiting_first_token: interval.awaiting,
                    }
                })
                .collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    #[test]
    fn lengths_are_read_over_enough_finished_requests() {
        // Intervals of 30 finished requests: the newest says 600 tokens in,
        // the three before it 1,200.
        let mut window: VecDeque<(f64, f64, f64)> = [1_200.0, 1_200.0, 1_200.0, 600.0].iter().map(|isl| (30.0, 30.0 * isl, 30.0 * 100.0)).collect();
        let (isl, osl) = mean_lengths(&window);
        assert_eq!((isl, osl), (1_050.0, 100.0), "the newest four intervals (120 requests), not the newest one");
        // A start: fewer than 100 finished in all, at least 10.
        window = [(4.0, 4_000.0, 400.0), (8.0, 8_000.0, 800.0)].into_iter().collect();
        assert_eq!(mean_lengths(&window), (1_000.0, 100.0));
        window = [(9.0, 9_000.0, 900.0)].into_iter().collect();
        assert_eq!(mean_lengths(&window), (0.0, 0.0), "too few finished to know");
    }
}
