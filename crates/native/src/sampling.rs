//! Choosing the next token from logits.
//!
//! Order of operations (as vLLM): repetition penalty (prompt and output
//! tokens), presence and frequency penalties (output tokens), then greedy
//! argmax at temperature 0, otherwise temperature, top-k, top-p and min-p
//! filtering and a draw. Log-probabilities, when asked, are those of the
//! penalized distribution before temperature and filtering.
//!
//! A seeded request draws from a generator derived from the seed and the
//! token's index, so the same seed gives the same output whatever else is
//! in the batch.

use rand::{Rng, SeedableRng};
use turbine_engine::{SamplingParams, TokenLogprobs};

/// The sampled token and, if asked, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The token.
    pub token: u32,
    /// Log-probabilities, when requested.
    pub logprobs: Option<TokenLogprobs>,
}

/// Samples from `logits` (modified in place). `history` is the sequence so
/// far (prompt then output); its last `generated` tokens are the output.
pub fn sample(logits: &mut [f32], params: &SamplingParams, history: &[u32], generated: usize) -> Choice {
    apply_penalties(logits, params, history, generated);
    let logprobs = params.logprobs.map(|top| logprobs_of(logits, top as usize));
    let temperature = params.temperature.unwrap_or(0.0);
    let token = if temperature <= 0.0 { crate::ops::argmax(logits) as u32 } else { draw(logits, params, temperature, generated) };
    let logprobs = logprobs.map(|(all, top)| TokenLogprobs { logprob: all[token as usize], top });
    Choice { token, logprobs }
}

fn apply_penalties(logits: &mut [f32], params: &SamplingParams, history: &[u32], generated: usize) {
    let repetition = params.repetition_penalty.filter(|&p| p != 1.0);
    if let Some(penalty) = repetition {
        let mut seen = vec![false; logits.len()];
        for &token in history {
            if let Some(flag) = seen.get_mut(token as usize) {
                *flag = true;
            }
        }
        for (logit, _) in logits.iter_mut().zip(&seen).filter(|(_, seen)| **seen) {
            *logit = if *logit > 0.0 { *logit / penalty } else { *logit * penalty };
        }
    }
    let presence = params.presence_penalty.unwrap_or(0.0);
    let frequency = params.frequency_penalty.unwrap_or(0.0);
    if presence != 0.0 || frequency != 0.0 {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &token in &history[history.len() - generated.min(history.len())..] {
            *counts.entry(token).or_default() += 1;
        }
        for (token, count) in counts {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit -= presence + frequency * count as f32;
            }
        }
    }
}

/// Log-softmax of every token and the `top` most likely (descending).
fn logprobs_of(logits: &[f32], top: usize) -> (Vec<f32>, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let log_sum = logits.iter().map(|&v| ((v - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    let all: Vec<f32> = logits.iter().map(|&v| v - log_sum).collect();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(order.len());
    if top > 0 {
        order.select_nth_unstable_by(top - 1, |&a, &b| all[b as usize].total_cmp(&all[a as usize]));
    }
    let mut best: Vec<(u32, f32)> = order[..top].iter().map(|&t| (t, all[t as usize])).collect();
    best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    (all, best)
}

fn draw(logits: &[f32], params: &SamplingParams, temperature: f32, generated: usize) -> u32 {
    // Candidates sorted by logit, descending.
    let mut candidates: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / temperature)).collect();
    let top_k = params.top_k.filter(|&k| k > 0).map(|k| k as usize).unwrap_or(candidates.len()).min(candidates.len());
    if top_k < candidates.len() {
        candidates.select_nth_unstable_by(top_k - 1, |a, b| b.1.total_cmp(&a.1));
        candidates.truncate(top_k);
    }
    candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let max = candidates[0].1;
    let mut probabilities: Vec<f64> = candidates.iter().map(|&(_, l)| ((l - max) as f64).exp()).collect();
    let total: f64 = probabilities.iter().sum();
    probabilities.iter_mut().for_each(|p| *p /= total);
    let mut keep = probabilities.len();
    if let Some(top_p) = params.top_p.filter(|&p| p < 1.0) {
        let mut cumulative = 0.0;
        for (i, p) in probabilities.iter().enumerate() {
            cumulative += p;
            if cumulative >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    if let Some(min_p) = params.min_p.filter(|&p| p > 0.0) {
        let threshold = probabilities[0] * min_p as f64;
        keep = keep.min(probabilities.iter().take_while(|&&p| p >= threshold).count().max(1));
    }
    let kept_total: f64 = probabilities[..keep].iter().sum();
    let mut target = match params.seed {
        Some(seed) => rand::rngs::StdRng::seed_from_u64(mix(seed, generated as u64)).random::<f64>(),
        None => rand::rng().random::<f64>(),
    } * kept_total;
    for (i, p) in probabilities[..keep].iter().enumerate() {
        target -= p;
        if target <= 0.0 {
            return candidates[i].0;
        }
    }
    candidates[keep - 1].0
}

/// A per-token generator seed from the request seed and the token index.
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut logits = vec![0.1, 2.0, -1.0, 1.9];
        assert_eq!(sample(&mut logits, &params(), &[], 0).token, 1);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let p = SamplingParams { temperature: Some(1.0), seed: Some(7), ..params() };
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<u32> = (0..20).map(|g| sample(&mut logits.clone(), &p, &[], g).token).collect();
        let b: Vec<u32> = (0..20).map(|g| sample(&mut logits.clone(), &p, &[], g).token).collect();
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "draws vary across positions");
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits: Vec<f32> = vec![0.5, 3.0, 2.9, 0.0];
        for p in [
            SamplingParams { temperature: Some(1.0), top_k: Some(1), ..params() },
            SamplingParams { temperature: Some(1.0), top_p: Some(0.01), ..params() },
            SamplingParams { temperature: Some(1.0), min_p: Some(0.99), ..params() },
        ] {
            for g in 0..20 {
                assert_eq!(sample(&mut logits.clone(), &p, &[], g).token, 1, "{p:?}");
            }
        }
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let base = vec![1.0, 1.1, 0.0];
        let history = [1, 1, 1];
        let presence = SamplingParams { presence_penalty: Some(1.0), ..params() };
        assert_eq!(sample(&mut base.clone(), &presence, &history, 3).token, 0);
        let repetition = SamplingParams { repetition_penalty: Some(2.0), ..params() };
        assert_eq!(sample(&mut base.clone(), &repetition, &history, 0).token, 0, "repetition covers prompt tokens");
        let frequency = SamplingParams { frequency_penalty: Some(0.05), ..params() };
        assert_eq!(sample(&mut base.clone(), &frequency, &history, 3).token, 0, "three repeats × 0.05 outweigh 0.1");
    }

    #[test]
    fn logprobs_are_normalized_and_sorted() {
        let p = SamplingParams { logprobs: Some(2), ..params() };
        let choice = sample(&mut [0.0, 1.0, 2.0], &p, &[], 0);
        let logprobs = choice.logprobs.unwrap();
        assert_eq!(choice.token, 2);
        assert_eq!(logprobs.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 1]);
        let total: f32 = [0.0f32, 1.0, 2.0].iter().map(|l| (l - 2.0 + logprobs.logprob).exp()).sum::<f32>();
        assert!((total - 1.0).abs() < 1e-4);
    }
}
