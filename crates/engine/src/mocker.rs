//! The mocker: a simulated model behind the real scheduler and block
//! manager. Step times follow Dynamo's default timing polynomials (divided
//! by a speedup factor); sampled tokens come from a fixed text, so streams
//! decode to readable words with exact token counts. Each answer is one
//! pass over the text (starting at a point chosen by the seed or the
//! prompt) followed by the end-of-sequence token, unless the request
//! ignores EOS, in which case the text repeats until `max_tokens`.

use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64;

use crate::ExecutorError;
use crate::core::Executor;
use crate::request::Sampled;
use crate::scheduler::Batch;

/// English text the mocker "generates", tokenized by the served model.
pub const MOCK_TEXT: &str = "Turbine serves language models across many machines. \
A gateway accepts requests, a router picks the worker that already holds the most useful \
cache, and workers stream tokens back as soon as they exist. Every service scales out, \
state lives in shared stores, and nothing that was accepted is ever silently lost. \
When the load grows, the planner adds workers; when it falls, it removes them again. ";

/// Timing model of the mocker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockTiming {
    /// Divides every simulated duration (1 = real time).
    pub speedup: f64,
}

impl MockTiming {
    /// Simulated prefill time in milliseconds for `new_tokens` uncached
    /// tokens in one step.
    pub fn prefill_ms(new_tokens: usize) -> f64 {
        if new_tokens == 0 {
            return 0.0;
        }
        let n = new_tokens as f64;
        4.209989e-7 * n * n + 1.518344e-2 * n + 16.50142
    }

    /// Simulated decode time in milliseconds at KV usage `p` (0..1); never
    /// below 1 ms.
    pub fn decode_ms(kv_usage: f64) -> f64 {
        let p = kv_usage.clamp(0.0, 1.0);
        (-25.74 * p * p + 54.01 * p + 5.74).max(1.0)
    }

    /// Simulated duration of a whole step.
    pub fn step_duration(&self, batch: &Batch<'_>) -> Duration {
        let mut ms = Self::prefill_ms(batch.prefill_tokens());
        if batch.decode_sequences() > 0 {
            ms += Self::decode_ms(batch.kv_usage);
        }
        Duration::from_secs_f64(ms / 1000.0 / self.speedup.max(f64::MIN_POSITIVE))
    }
}

/// The simulated executor.
#[derive(Debug)]
pub struct MockExecutor {
    timing: MockTiming,
    corpus: Vec<u32>,
    eos: Option<u32>,
    /// Time slept beyond what was asked, paid back on later steps so the
    /// simulated rate stays right on average.
    overslept: Duration,
}

impl MockExecutor {
    /// A mocker that emits tokens from `corpus` (the served model's
    /// tokenization of [`MOCK_TEXT`]) and ends answers with `eos` (if the
    /// model has one); `corpus` must not be empty.
    pub fn new(timing: MockTiming, corpus: Vec<u32>, eos: Option<u32>) -> Self {
        assert!(!corpus.is_empty(), "the mocker needs tokens to emit");
        Self { timing, corpus, eos, overslept: Duration::ZERO }
    }

    fn sleep(&mut self, target: Duration) {
        let wanted = target.saturating_sub(self.overslept);
        self.overslept = self.overslept.saturating_sub(target);
        if wanted.is_zero() {
            return;
        }
        let started = Instant::now();
        std::thread::sleep(wanted);
        self.overslept += started.elapsed().saturating_sub(wanted);
    }
}

impl Executor for MockExecutor {
    fn execute(&mut self, batch: &Batch<'_>) -> Result<Vec<Option<Sampled>>, ExecutorError> {
        self.sleep(self.timing.step_duration(batch));
        let sampled = batch
            .items
            .iter()
            .map(|item| {
                item.sample.then(|| {
                    // Where in the text this sequence starts: by seed if given, else by prompt.
                    let prompt = &item.tokens[..item.tokens.len() - item.generated];
                    let start = match item.sampling.seed {
                        Some(seed) => xxh3_64(&seed.to_le_bytes()),
                        None => xxh3_64(&prompt.iter().take(64).flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()),
                    } as usize;
                    Sampled::token(match self.eos {
                        Some(eos) if !item.ignore_eos && item.generated == self.corpus.len() => eos,
                        _ => self.corpus[(start + item.generated) % self.corpus.len()],
                    })
                })
            })
            .collect();
        Ok(sampled)
    }

    /// The mocker holds no KV bytes: an installed block is only its hash
    /// (its transfer time is modelled by the worker).
    fn write_block(&mut self, _block: u32, _bytes: &[u8]) -> Result<(), ExecutorError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_follows_the_polynomials() {
        assert!((MockTiming::prefill_ms(1000) - (0.4209989 + 15.18344 + 16.50142)).abs() < 1e-9);
        assert_eq!(MockTiming::prefill_ms(0), 0.0);
        assert!((MockTiming::decode_ms(0.0) - 5.74).abs() < 1e-9);
        assert_eq!(MockTiming::decode_ms(2.0), MockTiming::decode_ms(1.0));
        // Floor of 1 ms.
        assert!(MockTiming::decode_ms(1.0) >= 1.0);
    }
}
