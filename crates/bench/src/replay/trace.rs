//! A Mooncake-format trace: its requests, their synthetic prompts, and the
//! hit rate of an infinite cache (the oracle).

use std::collections::HashMap;

use anyhow::{Context, bail};
use serde::Deserialize;

/// Tokens per `hash_ids` entry in Mooncake traces.
const TRACE_BLOCK_TOKENS: usize = 512;

/// One trace line.
#[derive(Debug, Clone, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Generated tokens.
    pub output_length: u32,
    /// Prefix block ids (512 tokens each; the last may be partial).
    pub hash_ids: Vec<u64>,
    /// Tokens per `hash_ids` entry: 512, less in a [`shrink`]ed trace.
    #[serde(skip, default = "trace_block_tokens")]
    pub block_tokens: usize,
}

fn trace_block_tokens() -> usize {
    TRACE_BLOCK_TOKENS
}

/// The trace with every length divided by `factor` (rounded up): prompts,
/// outputs and the tokens of each trace block, so the prefixes requests
/// share keep their shape at a size a small engine computes in time.
pub fn shrink(requests: Vec<TraceRequest>, factor: usize) -> anyhow::Result<Vec<TraceRequest>> {
    anyhow::ensure!(factor >= 1 && TRACE_BLOCK_TOKENS.is_multiple_of(factor), "--shrink {factor}: must divide the trace's {TRACE_BLOCK_TOKENS}-token blocks");
    Ok(requests
        .into_iter()
        .map(|request| TraceRequest {
            input_length: request.input_length.div_ceil(factor),
            output_length: request.output_length.div_ceil(factor as u32),
            block_tokens: request.block_tokens / factor,
            ..request
        })
        .collect())
}

/// One conversation in `every` of the trace, each whole: a request's
/// conversation is the first of its trace blocks past the prefix every
/// request of the trace shares (a conversation trace's system prompt).
/// Reuse within conversations and the trace's time span stay; the load is
/// about 1/`every`.
pub fn conversations(requests: Vec<TraceRequest>, every: u64) -> anyhow::Result<Vec<TraceRequest>> {
    anyhow::ensure!(every >= 1, "--conversations-every must be at least 1");
    let first = &requests[0].hash_ids;
    let shared = requests.iter().fold(first.len(), |shared, request| first.iter().zip(&request.hash_ids).take(shared).take_while(|(a, b)| a == b).count());
    let kept: Vec<TraceRequest> = requests
        .into_iter()
        .filter(|request| {
            let conversation = request.hash_ids.get(shared).or(request.hash_ids.last()).copied().unwrap_or(0);
            conversation.is_multiple_of(every)
        })
        .collect();
    anyhow::ensure!(!kept.is_empty(), "--conversations-every {every}: no conversation of the trace is kept");
    Ok(kept)
}

/// Reads a Mooncake-format trace.
pub fn read_trace(path: &std::path::Path, limit: Option<usize>) -> anyhow::Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading trace {}", path.display()))?;
    let mut requests = Vec::new();
    for (number, line) in text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()) {
        if limit.is_some_and(|limit| requests.len() >= limit) {
            break;
        }
        let request: TraceRequest = serde_json::from_str(line).with_context(|| format!("{}:{}: not a Mooncake trace line", path.display(), number + 1))?;
        if request.input_length == 0 || request.hash_ids.is_empty() {
            bail!("{}:{}: a request needs input_length > 0 and hash_ids", path.display(), number + 1);
        }
        if request.hash_ids.len() < request.input_length.div_ceil(TRACE_BLOCK_TOKENS) {
            bail!("{}:{}: {} hash_ids cannot cover {} tokens", path.display(), number + 1, request.hash_ids.len(), request.input_length);
        }
        requests.push(request);
    }
    if requests.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok(requests)
}

/// A token id for position `position` of trace block `hash_id`: fixed per
/// (id, position), spread over `range` so blocks differ.
fn synthetic_token(hash_id: u64, position: usize, range: std::ops::Range<u32>) -> u32 {
    let mut x = hash_id.wrapping_mul(TRACE_BLOCK_TOKENS as u64).wrapping_add(position as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    // splitmix64
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    range.start + (x % u64::from(range.end - range.start)) as u32
}

/// The prompt of one trace request.
pub fn prompt_tokens(request: &TraceRequest, range: std::ops::Range<u32>) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(request.input_length);
    'ids: for &id in &request.hash_ids {
        for position in 0..request.block_tokens {
            if tokens.len() == request.input_length {
                break 'ids;
            }
            tokens.push(synthetic_token(id, position, range.clone()));
        }
    }
    tokens
}

/// Prompt tokens an ideal cache could serve for each request: the leading
/// trace blocks seen before (as far as earlier requests had them), cut to
/// whole engine blocks and leaving at least one token to compute.
pub fn oracle_hits(requests: &[TraceRequest], block_size: usize) -> Vec<usize> {
    // Longest run of each id's tokens any earlier request carried.
    let mut seen: HashMap<u64, usize> = HashMap::new();
    requests
        .iter()
        .map(|request| {
            let mut hit = 0;
            for (index, &id) in request.hash_ids.iter().enumerate() {
                // Ids past the input length carry no tokens.
                let Some(here) = request.input_length.checked_sub(index * request.block_tokens).filter(|&n| n > 0) else {
                    break;
                };
                let here = here.min(request.block_tokens);
                let before = seen.get(&id).copied().unwrap_or(0);
                hit += before.min(here);
                if before < here {
                    break;
                }
            }
            for (index, &id) in request.hash_ids.iter().enumerate() {
                let Some(here) = request.input_length.checked_sub(index * request.block_tokens).filter(|&n| n > 0) else {
                    break;
                };
                let entry = seen.entry(id).or_default();
                *entry = (*entry).max(here.min(request.block_tokens));
            }
            let usable = hit.min(request.input_length - 1);
            usable / block_size * block_size
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: usize, hash_ids: Vec<u64>) -> TraceRequest {
        TraceRequest { timestamp: 0, input_length, output_length: 1, hash_ids, block_tokens: TRACE_BLOCK_TOKENS }
    }

    #[test]
    fn a_shrunk_trace_keeps_its_shared_prefixes_at_a_fraction_of_the_length() {
        let shrunk = shrink(vec![request(1100, vec![7, 8, 9]), request(600, vec![7, 5])], 16).unwrap();
        let (a, b) = (prompt_tokens(&shrunk[0], 1000..40_000), prompt_tokens(&shrunk[1], 1000..40_000));
        assert_eq!((a.len(), b.len(), shrunk[0].output_length), (69, 38, 1));
        assert_eq!(a[..32], b[..32], "the shared first block, 512 / 16 tokens");
        assert_ne!(a[32..38], b[32..38]);
        assert_eq!(oracle_hits(&shrunk, 16), vec![0, 32]);
        assert!(shrink(vec![request(10, vec![1])], 3).is_err(), "3 does not divide 512");
    }

    #[test]
    fn one_conversation_in_k_is_kept_whole_past_the_shared_prefix() {
        let trace = vec![request(1100, vec![0, 4, 9]), request(600, vec![0, 5]), request(1600, vec![0, 4, 9, 12]), request(300, vec![0, 7])];
        let kept = conversations(trace.clone(), 2).unwrap();
        assert_eq!(kept.iter().map(|r| r.hash_ids.clone()).collect::<Vec<_>>(), vec![vec![0, 4, 9], vec![0, 4, 9, 12]], "conversation 4, both turns");
        assert_eq!(conversations(trace.clone(), 1).unwrap().len(), 4);
        assert!(conversations(trace, 3).is_err(), "none of 4, 5, 7 is a multiple of 3");
        let unshared = conversations(vec![request(10, vec![3]), request(10, vec![6, 1])], 3).unwrap();
        assert_eq!(unshared.len(), 2, "without a shared prefix the first block names the conversation");
    }

    #[test]
    fn shared_ids_give_shared_prefixes() {
        let a = prompt_tokens(&request(1100, vec![7, 8, 9]), 1000..40_000);
        let b = prompt_tokens(&request(600, vec![7, 5]), 1000..40_000);
        assert_eq!((a.len(), b.len()), (1100, 600));
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..600], b[512..600]);
        assert!(a.iter().all(|t| (1000..40_000).contains(t)));
    }

    #[test]
    fn the_oracle_counts_prefix_blocks_seen_before() {
        let requests = vec![request(1100, vec![1, 2, 3]), request(1100, vec![1, 2, 4]), request(700, vec![1, 2]), request(600, vec![9, 2])];
        // 2nd: ids 1 and 2 seen in full (1024). 3rd: id 1 in full, id 2 only
        // its first 188 tokens here (all of them seen) = 700, minus the last
        // token, cut to blocks of 64 = 640. 4th: id 9 unseen.
        assert_eq!(oracle_hits(&requests, 64), vec![0, 1024, 640, 0]);
    }

    #[test]
    fn ids_beyond_the_input_length_carry_no_tokens() {
        let requests = vec![request(600, vec![1, 2, 3]), request(600, vec![1, 2, 3])];
        // Id 3 lies past 600 tokens in both; the repeat hits 599 tokens, cut to 576.
        assert_eq!(oracle_hits(&requests, 64), vec![0, 576]);
    }

    #[test]
    fn a_partial_block_seen_before_only_covers_what_was_seen() {
        let requests = vec![request(600, vec![1, 2]), request(1100, vec![1, 2, 3])];
        // Request 1 carried 88 tokens of id 2: 512 + 88 = 600, cut to 576.
        assert_eq!(oracle_hits(&requests, 64), vec![0, 576]);
    }
}
