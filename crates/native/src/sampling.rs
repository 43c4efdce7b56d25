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
//!
//! A request for a JSON object ([`OutputFormat::JsonObject`]) samples only
//! tokens that keep its output a prefix of a valid object ([`crate::json`]):
//! a token drawn that would not is masked and the draw repeated (from the
//! same distribution with that token removed, so temperature, top-k, top-p
//! and min-p apply to the allowed tokens), and after a few such misses
//! every token is checked at once. No special token is allowed, nor an
//! end-of-sequence token until the object closes; then only one is. The
//! log-probabilities reported are those before the mask.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use turbine_engine::{OutputFormat, SamplingParams, TokenLogprobs};
use turbine_tokens::TokenBytes;

use crate::json::JsonState;
use crate::schema::{Schema, SchemaState};

/// Draws masked one at a time before every token is checked.
const MISSES_BEFORE_MASKING_ALL: usize = 16;

/// What constrained output reads of the vocabulary: every token's bytes,
/// which are special, and the end-of-sequence tokens.
#[derive(Debug, Clone)]
pub struct OutputVocabulary {
    bytes: Arc<TokenBytes>,
    eos: Vec<u32>,
}

impl OutputVocabulary {
    /// The vocabulary of `bytes`, ended by `eos` (at least one).
    pub fn new(bytes: Arc<TokenBytes>, eos: Vec<u32>) -> Self {
        assert!(!eos.is_empty(), "constrained output needs an end-of-sequence token");
        Self { bytes, eos }
    }

    /// The compiled schema of `text`, or `None` if it is outside the
    /// subset (the worker refused such a request before it ran).
    fn schema(&self, text: &Arc<str>) -> Option<Arc<Schema>> {
        Schema::cached(text).ok()
    }

    /// Whether `token` is an ordinary one (not special, not an end).
    fn ordinary(&self, token: u32) -> bool {
        !self.bytes.is_special(token) && !self.eos.contains(&token)
    }
}

/// The sampled token and, if asked, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The token.
    pub token: u32,
    /// Log-probabilities, when requested.
    pub logprobs: Option<TokenLogprobs>,
}

/// A sequence's constrained output as read so far, carried from step to
/// step so each step reads only the tokens since the last (linear in the
/// output, not quadratic). Starting over is always right: a track that
/// does not fit the output it is given (another format, fewer tokens, a
/// different last token) is rebuilt from the output.
#[derive(Debug, Clone, Default)]
pub struct OutputTrack {
    /// Output tokens read, and the last of them.
    read: usize,
    last: Option<u32>,
    state: Tracked,
}

#[derive(Debug, Clone, Default)]
enum Tracked {
    /// Nothing read yet.
    #[default]
    Fresh,
    Object(JsonState),
    Schema(SchemaState),
    /// The output is no prefix of a valid value: only the end follows.
    Broken,
}

impl OutputTrack {
    /// Brings the track up to `output` under `format`; `false` if the
    /// output is no prefix of a valid value (or the schema compiles not).
    fn advance(&mut self, format: &OutputFormat, output: &[u32], vocabulary: &OutputVocabulary) -> bool {
        let fits = match (&self.state, format) {
            (Tracked::Fresh, _) => false,
            (Tracked::Object(_), OutputFormat::JsonObject { .. }) => true,
            (Tracked::Schema(state), OutputFormat::JsonSchema { schema, .. }) => vocabulary.schema(schema).is_some_and(|compiled| state.is_of(&compiled)),
            (Tracked::Broken, _) => true,
            _ => false,
        };
        if !(fits && self.read <= output.len() && (self.read == 0 || output.get(self.read - 1) == self.last.as_ref())) {
            self.read = 0;
            self.state = match format {
                OutputFormat::JsonObject { .. } => Tracked::Object(JsonState::object()),
                OutputFormat::JsonSchema { schema, .. } => match vocabulary.schema(schema) {
                    Some(schema) => Tracked::Schema(SchemaState::new(schema)),
                    None => Tracked::Broken,
                },
                OutputFormat::Text => Tracked::Broken,
            };
        }
        for &token in &output[self.read..] {
            let bytes = vocabulary.bytes.get(token);
            let kept = !vocabulary.bytes.is_special(token)
                && match &mut self.state {
                    Tracked::Object(state) => state.feed(bytes),
                    Tracked::Schema(state) => state.feed(bytes),
                    Tracked::Fresh | Tracked::Broken => false,
                };
            if !kept {
                self.state = Tracked::Broken;
                break;
            }
        }
        self.read = output.len();
        self.last = output.last().copied();
        !matches!(self.state, Tracked::Broken)
    }

    fn is_complete(&self) -> bool {
        match &self.state {
            Tracked::Object(state) => state.is_complete(),
            Tracked::Schema(state) => state.is_complete(),
            Tracked::Fresh | Tracked::Broken => true,
        }
    }

    /// [`accepts`](Self::accepts) by reading a copy of the state, always
    /// (the baseline of the shortcut, measured beside it).
    #[cfg(test)]
    fn accepts_by_copy(&self, bytes: &[u8]) -> bool {
        match &self.state {
            Tracked::Object(state) => !bytes.is_empty() && state.clone().feed(bytes),
            Tracked::Schema(state) => !bytes.is_empty() && state.clone().feed(bytes),
            Tracked::Fresh | Tracked::Broken => false,
        }
    }

    fn accepts(&self, bytes: &[u8]) -> bool {
        match &self.state {
            Tracked::Object(state) => state.accepts(bytes),
            Tracked::Schema(state) => state.accepts(bytes),
            Tracked::Fresh | Tracked::Broken => false,
        }
    }
}

/// Samples from `logits` (modified in place). `history` is the sequence so
/// far (prompt then output); its last `generated` tokens are the output.
/// Constrained output ([`SamplingParams::output`]) needs `vocabulary`;
/// without one the output is not constrained. Each call reads the whole
/// output; [`sample_tracked`] carries what it read from step to step.
pub fn sample(logits: &mut [f32], params: &SamplingParams, history: &[u32], generated: usize, vocabulary: Option<&OutputVocabulary>) -> Choice {
    sample_tracked(logits, params, history, generated, vocabulary, &mut OutputTrack::default())
}

/// [`sample`], reading only the output `track` has not read yet.
pub fn sample_tracked(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &[u32],
    generated: usize,
    vocabulary: Option<&OutputVocabulary>,
    track: &mut OutputTrack,
) -> Choice {
    apply_penalties(logits, params, history, generated);
    let logprobs = params.logprobs.map(|top| logprobs_of(logits, top as usize));
    let temperature = params.temperature.unwrap_or(0.0);
    let pick = |logits: &[f32]| if temperature <= 0.0 { crate::ops::argmax(logits) as u32 } else { draw(logits, params, temperature, generated) };
    let token = match (&params.output, vocabulary) {
        (OutputFormat::Text, _) | (_, None) => pick(logits),
        (format, Some(vocabulary)) => {
            let output = &history[history.len().saturating_sub(generated + format.continued() as usize)..];
            if track.advance(format, output, vocabulary) && !track.is_complete() {
                let track = &*track;
                let allows = |token| vocabulary.ordinary(token) && track.accepts(vocabulary.bytes.get(token));
                pick_allowed(logits, allows, |byte| track.accepts(&[byte]), vocabulary, pick)
            } else {
                vocabulary.eos[0]
            }
        }
    };
    let logprobs = logprobs.map(|(all, top)| TokenLogprobs { logprob: all[token as usize], top });
    Choice { token, logprobs }
}

/// The token `pick` chooses among those `allows` lets continue the output
/// (`first`: whether a byte may come next, so that checking every token
/// skips at once those beginning with one that may not).
fn pick_allowed(
    logits: &mut [f32],
    allows: impl Fn(u32) -> bool,
    first: impl Fn(u8) -> bool,
    vocabulary: &OutputVocabulary,
    pick: impl Fn(&[f32]) -> u32,
) -> u32 {
    for _ in 0..MISSES_BEFORE_MASKING_ALL {
        let token = pick(logits);
        if allows(token) {
            return token;
        }
        logits[token as usize] = f32::NEG_INFINITY;
    }
    let mut firsts = [false; 256];
    for byte in 0..=u8::MAX {
        firsts[byte as usize] = first(byte);
    }
    let mut any = false;
    for (token, logit) in logits.iter_mut().enumerate() {
        let begins = vocabulary.bytes.get(token as u32).first().is_some_and(|&byte| firsts[byte as usize]);
        if *logit != f32::NEG_INFINITY && !(begins && allows(token as u32)) {
            *logit = f32::NEG_INFINITY;
        }
        any |= *logit != f32::NEG_INFINITY;
    }
    // No token of the vocabulary continues the object (one without
    // single-byte tokens, say): end it as it stands.
    if any { pick(logits) } else { vocabulary.eos[0] }
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
        assert_eq!(sample(&mut logits, &params(), &[], 0, None).token, 1);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let p = SamplingParams { temperature: Some(1.0), seed: Some(7), ..params() };
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<u32> = (0..20).map(|g| sample(&mut logits.clone(), &p, &[], g, None).token).collect();
        let b: Vec<u32> = (0..20).map(|g| sample(&mut logits.clone(), &p, &[], g, None).token).collect();
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
                assert_eq!(sample(&mut logits.clone(), &p, &[], g, None).token, 1, "{p:?}");
            }
        }
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let base = vec![1.0, 1.1, 0.0];
        let history = [1, 1, 1];
        let presence = SamplingParams { presence_penalty: Some(1.0), ..params() };
        assert_eq!(sample(&mut base.clone(), &presence, &history, 3, None).token, 0);
        let repetition = SamplingParams { repetition_penalty: Some(2.0), ..params() };
        assert_eq!(sample(&mut base.clone(), &repetition, &history, 0, None).token, 0, "repetition covers prompt tokens");
        let frequency = SamplingParams { frequency_penalty: Some(0.05), ..params() };
        assert_eq!(sample(&mut base.clone(), &frequency, &history, 3, None).token, 0, "three repeats × 0.05 outweigh 0.1");
    }

    /// A vocabulary of JSON pieces: `<eos>` and `<ctl>` special, the rest
    /// text.
    fn json_vocabulary() -> (OutputVocabulary, Vec<&'static str>) {
        let tokens = vec!["<eos>", "<ctl>", "{", "}", "\"", "key", ":", " ", "1", "hello", "}\n\nMore", "[", "]", ",", "{\"", "\":"];
        let spec = turbine_tokens::TokenizerSpec {
            model: "llama".into(),
            tokens: tokens.iter().map(|t| t.to_string()).collect(),
            token_types: tokens.iter().map(|t| if t.starts_with('<') { 3 } else { 1 }).collect(),
            ..Default::default()
        };
        (OutputVocabulary::new(Arc::new(TokenBytes::new(&spec)), vec![0]), tokens)
    }

    fn json(continued: u32) -> SamplingParams {
        SamplingParams { output: OutputFormat::JsonObject { continued }, ..params() }
    }

    /// Generates with `logits_at` for each step until the end token.
    fn generate(params: &SamplingParams, vocabulary: &OutputVocabulary, prompt: &[u32], logits_at: impl Fn(usize) -> Vec<f32>) -> Vec<u32> {
        let mut history = prompt.to_vec();
        for generated in 0..200 {
            let token = sample(&mut logits_at(generated), params, &history, generated, Some(vocabulary)).token;
            if token == 0 {
                return history[prompt.len()..].to_vec();
            }
            history.push(token);
        }
        panic!("no end: {history:?}");
    }

    #[test]
    fn json_output_keeps_to_an_object_and_ends_when_it_closes() {
        let (vocabulary, tokens) = json_vocabulary();
        let text = |ids: &[u32]| ids.iter().map(|&id| tokens[id as usize]).collect::<String>();
        // A model that would rather end, chat or say hello, and comes round
        // to closing things step by step: greedy and sampled, every output
        // is an object, closed, then the end.
        let prose = |step: usize| {
            let mut logits = vec![9.0, 8.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.0, 6.0, 0.0, 0.0, 0.0, 0.0, 0.0];
            let closing = step as f32 * 0.5;
            for (token, weight) in [(3, 1.2), (4, 1.3), (6, 1.0), (8, 1.0)] {
                logits[token] += weight * closing;
            }
            logits
        };
        for params in [
            json(0),
            SamplingParams { temperature: Some(1.5), seed: Some(3), ..json(0) },
            SamplingParams { temperature: Some(1.0), top_k: Some(2), seed: Some(4), ..json(0) },
            SamplingParams { temperature: Some(0.7), top_p: Some(0.9), seed: Some(5), ..json(0) },
        ] {
            let output = text(&generate(&params, &vocabulary, &[5, 5], prose));
            let value: serde_json::Value = serde_json::from_str(&output).unwrap_or_else(|error| panic!("{output:?}: {error}"));
            assert!(value.is_object(), "{output:?}");
        }
        // The greedy path through the allowed tokens: `{` (the likeliest
        // that opens one), a key of hellos until the quote outweighs them,
        // an empty string (the quote again), `}`, then only the end.
        assert_eq!(text(&generate(&json(0), &vocabulary, &[5], prose)), r#"{"hellohellohellohellohellohellohellohellohello":""}"#);
        // Text output is not constrained.
        assert_eq!(sample(&mut prose(0), &params(), &[5], 0, Some(&vocabulary)).token, 0);
    }

    #[test]
    fn schema_output_keeps_to_the_schemas_values_and_ends_when_whole() {
        let (vocabulary, tokens) = json_vocabulary();
        let text = |ids: &[u32]| ids.iter().map(|&id| tokens[id as usize]).collect::<String>();
        let schema = serde_json::json!({"type": "object", "properties": {"key": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}}, "required": ["key"], "additionalProperties": false});
        let held = SamplingParams { output: OutputFormat::json_schema(&schema).unwrap(), ..params() };
        // The same prose-loving model: a key of hellos is not the schema's,
        // nor blanks; the one key it names, an array of two or three ones.
        let prose = |step: usize| {
            let mut logits = vec![9.0, 8.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.0, 6.0, 0.0, 0.0, 0.0, 0.0, 0.0];
            for (token, weight) in [(3, 1.2), (4, 1.3), (6, 1.0), (8, 1.0), (12, 1.1), (13, 1.05)] {
                logits[token] += weight * step as f32 * 0.5;
            }
            logits
        };
        for params in [
            held.clone(),
            SamplingParams { temperature: Some(1.5), seed: Some(3), ..held.clone() },
            SamplingParams { temperature: Some(0.8), seed: Some(9), ..held.clone() },
        ] {
            let output = text(&generate(&params, &vocabulary, &[5, 5], prose));
            let value: serde_json::Value = serde_json::from_str(&output).unwrap_or_else(|error| panic!("{output:?}: {error}"));
            let items = value["key"].as_array().unwrap_or_else(|| panic!("{output:?}"));
            assert!(value.as_object().unwrap().len() == 1 && (2..=3).contains(&items.len()) && items.iter().all(serde_json::Value::is_u64), "{output:?}");
            assert!(!output.contains(' '), "{output:?}");
        }
        // A continued request goes on from the value so far.
        let so_far: Vec<u32> = vec![14, 5, 15, 11, 8]; // {"key":[1
        let continued = SamplingParams { output: held.output.continued_by(so_far.len() as u32), ..held.clone() };
        let rest = text(&generate(&continued, &vocabulary, &so_far, prose));
        assert!(serde_json::from_str::<serde_json::Value>(&format!("{}{rest}", text(&so_far))).is_ok(), "{rest:?}");
    }

    #[test]
    fn a_tracked_output_samples_as_one_read_whole_each_step() {
        let (vocabulary, _) = json_vocabulary();
        let schema =
            serde_json::json!({"type": "object", "properties": {"key": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}, "required": ["key"]});
        let held = SamplingParams { output: OutputFormat::json_schema(&schema).unwrap(), temperature: Some(1.2), seed: Some(7), ..params() };
        let noisy = |step: usize| (0..16).map(|token| ((token * 7 + step * 13) % 11) as f32 * 0.4).collect::<Vec<f32>>();
        for params in [held, SamplingParams { temperature: Some(1.2), seed: Some(7), ..json(0) }] {
            let fresh = generate(&params, &vocabulary, &[5], noisy);
            let (mut history, mut track) = (vec![5], OutputTrack::default());
            for generated in 0..200 {
                let token = sample_tracked(&mut noisy(generated), &params, &history, generated, Some(&vocabulary), &mut track).token;
                if token == 0 {
                    break;
                }
                history.push(token);
            }
            assert_eq!(history[1..], fresh[..], "{:?}", params.output);
            // A track that does not fit the output (another sequence's) is
            // read again from the output, not trusted.
            let mut stale = track.clone();
            let other = generate(&params, &vocabulary, &[5, 5], noisy);
            let mut history = vec![5, 5];
            for (generated, &token) in other.iter().enumerate() {
                assert_eq!(sample_tracked(&mut noisy(generated), &params, &history, generated, Some(&vocabulary), &mut stale).token, token);
                history.push(token);
            }
        }
    }

    /// What a step of constrained sampling costs as the output grows, each
    /// step reading the whole output against reading only its last token
    /// (`cargo test -p turbine-native --lib constrained_step_cost -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn constrained_step_cost() {
        let (vocabulary, _) = json_vocabulary();
        // A key of hellos: any object's (a schema naming no properties).
        let schema = serde_json::json!({"type": "object"});
        for params in [json(0), SamplingParams { output: OutputFormat::json_schema(&schema).unwrap(), ..params() }] {
            for length in [100, 1000, 4000] {
                // `{"` then hellos: inside a string, the likeliest token
                // (hello) is allowed, so one check per step.
                let history: Vec<u32> = std::iter::once(14).chain(std::iter::repeat_n(9, length)).collect();
                let logits = |_: usize| vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
                let steps = 200;
                let started = std::time::Instant::now();
                for step in 0..steps {
                    std::hint::black_box(sample(&mut logits(step), &params, &history, length + 1, Some(&vocabulary)));
                }
                let fresh = started.elapsed() / steps as u32;
                let mut track = OutputTrack::default();
                sample_tracked(&mut logits(0), &params, &history[..history.len() - 1], length, Some(&vocabulary), &mut track);
                assert_ne!(sample(&mut logits(0), &params, &history, length + 1, Some(&vocabulary)).token, 0, "the output is a prefix still");
                let started = std::time::Instant::now();
                for step in 0..steps {
                    let mut again = track.clone();
                    std::hint::black_box(sample_tracked(&mut logits(step), &params, &history, length + 1, Some(&vocabulary), &mut again));
                }
                let tracked = started.elapsed() / steps as u32;
                eprintln!("{:?} output {length:>5} tokens: read whole {fresh:?}/step, tracked {tracked:?}/step", params.output.kind());
            }
        }
    }

    /// What a step costs where the model's likeliest tokens all break the
    /// format, so every token of the real model's vocabulary (49,152) is
    /// checked, against an unconstrained step on the same logits
    /// (`cargo test -p turbine-native --lib constrained_mask_all_cost -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check; reads the default model"]
    fn constrained_mask_all_cost() {
        use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
        let model = resolve_model("smollm2-135m", None, &default_cache_dir(), Progress::Quiet).unwrap();
        let card = turbine_tokens::ModelCard::from_gguf_path("smollm2-135m", &model.path, 16).unwrap();
        let text = turbine_tokens::Preprocessor::new(card.clone()).unwrap();
        let eos = card.tokenizer.eos_token_id.into_iter().collect();
        let vocabulary = OutputVocabulary::new(Arc::new(TokenBytes::new(&card.tokenizer)), eos);
        let size = card.tokenizer.tokens.len();
        let string = serde_json::json!({"type": "object", "properties": {"flight": {"type": "string"}}});
        let bounded = serde_json::json!({"type": "object", "properties": {"flight": {"type": "string", "maxLength": 40}}});
        let pattern = serde_json::json!({"type": "object", "properties": {"flight": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}});
        let cases = [
            ("text", params()),
            ("json_object", json(0)),
            ("schema, a string", SamplingParams { output: OutputFormat::json_schema(&string).unwrap(), ..params() }),
            ("schema, maxLength", SamplingParams { output: OutputFormat::json_schema(&bounded).unwrap(), ..params() }),
            ("schema, pattern", SamplingParams { output: OutputFormat::json_schema(&pattern).unwrap(), ..params() }),
        ];
        // Inside the string's value; equal logits, so greedy tries the
        // special tokens first (ids 0..16), none allowed: every token is
        // checked.
        let output = text.encode_text(r#"{"flight":"AB"#).unwrap();
        let steps = 50;
        for (name, params) in cases {
            let mut track = OutputTrack::default();
            let first = sample_tracked(&mut vec![0.0; size], &params, &output, output.len(), Some(&vocabulary), &mut track).token;
            let started = std::time::Instant::now();
            for _ in 0..steps {
                let mut again = track.clone();
                std::hint::black_box(sample_tracked(&mut vec![0.0; size], &params, &output, output.len(), Some(&vocabulary), &mut again));
            }
            let step = started.elapsed() / steps;
            // The baseline: every token checked on a copy of the state,
            // none skipped by its first byte.
            let started = std::time::Instant::now();
            for _ in 0..steps {
                let mut again = track.clone();
                again.advance(&params.output, &output, &vocabulary);
                let allowed = (0..size as u32).filter(|&token| vocabulary.ordinary(token) && again.accepts_by_copy(vocabulary.bytes.get(token))).count();
                std::hint::black_box(allowed);
            }
            let copied = started.elapsed() / steps;
            eprintln!("{name:>18}: {step:?}/step, by copy {copied:?}/step (drew {first}: {:?})", String::from_utf8_lossy(vocabulary.bytes.get(first)));
        }
    }

    #[test]
    fn a_continued_json_output_goes_on_from_the_tokens_it_carries() {
        let (vocabulary, _) = json_vocabulary();
        // `{"key":` generated on a worker that failed, now the prompt's
        // tail: a value must follow, not a key or the end.
        let prompt = [5, 14, 5, 15];
        let want_key = |_: usize| vec![5.0, 0.0, 0.0, 1.0, 0.0, 3.0, 4.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0];
        let first = sample(&mut want_key(0), &json(3), &prompt, 0, Some(&vocabulary)).token;
        assert_eq!(first, 8, "a value (1), not a key");
        // Without the continuation the prompt is no output: an object opens.
        let fresh = sample(&mut want_key(0), &json(0), &prompt, 0, Some(&vocabulary)).token;
        assert_eq!(fresh, 14, "{{\" opens one");
        // Complete already: only the end.
        let done = [2, 3];
        assert_eq!(sample(&mut want_key(0), &json(2), &done, 0, Some(&vocabulary)).token, 0);
    }

    #[test]
    fn logprobs_are_normalized_and_sorted() {
        let p = SamplingParams { logprobs: Some(2), ..params() };
        let choice = sample(&mut [0.0, 1.0, 2.0], &p, &[], 0, None);
        let logprobs = choice.logprobs.unwrap();
        assert_eq!(choice.token, 2);
        assert_eq!(logprobs.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 1]);
        let total: f32 = [0.0f32, 1.0, 2.0].iter().map(|l| (l - 2.0 + logprobs.logprob).exp()).sum::<f32>();
        assert!((total - 1.0).abs() < 1e-4);
    }
}
