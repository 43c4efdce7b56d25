//! The float operations of a Llama block, on plain slices: RMSNorm, rotary
//! embeddings, SwiGLU, and attention that reads keys and values through a
//! sequence's block table. Loops are written so the compiler vectorizes
//! them (independent accumulators, no reduction order dependence).

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::pool::ThreadPool;
use crate::weights::SharedMut;

/// `a · b` with eight independent accumulators (vectorizes).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0f32; 8];
    let (a_chunks, a_rest) = a.split_at(a.len() - a.len() % 8);
    let (b_chunks, b_rest) = b.split_at(a_chunks.len());
    for (x, y) in a_chunks.chunks_exact(8).zip(b_chunks.chunks_exact(8)) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// Stores `values` as f16 (the KV cache's format) into `out`.
pub fn to_f16(values: &[f32], out: &mut [f16]) {
    out.convert_from_f32_slice(values);
}

/// `out[j] = (query · key_j) * scale`, key `j` being the f16 values at
/// `cache[offsets[j]..]` (`query.len()` of them). Each score depends only on
/// its own key (keys are processed eight at a time with one fixed
/// reduction), so any caller gets bit-identical scores for the same inputs.
pub fn qk_scores(query: &[f32], cache: &[f16], offsets: &[usize], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(offsets.len(), out.len());
    let dim = query.len();
    for (offsets, out) in offsets.chunks(8).zip(out.chunks_mut(8)) {
        let mut keys: [&[f16]; 8] = [&cache[offsets[0]..offsets[0] + dim]; 8];
        for (key, &at) in keys.iter_mut().zip(offsets) {
            *key = &cache[at..at + dim];
        }
        let scores = dot8(query, keys);
        for (o, s) in out.iter_mut().zip(scores) {
            *o = s * scale;
        }
    }
}

/// Dot products of `query` with eight f16 keys.
#[inline]
fn dot8(query: &[f32], keys: [&[f16]; 8]) -> [f32; 8] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if query.len().is_multiple_of(8) {
        // SAFETY: AVX2/FMA/F16C are compiled in (cfg above); every slice is
        // read through bounds-checked chunks of 8.
        return unsafe { avx2::dot8(query, keys) };
    }
    keys.map(|key| {
        let mut lanes = [0f32; 8];
        for (i, (q, k)) in query.iter().zip(key).enumerate() {
            lanes[i % 8] = q.mul_add(k.to_f32(), lanes[i % 8]);
        }
        lanes.iter().sum()
    })
}

/// `out = Σ_j weights[j] · value_j`, value `j` being the f16 values at
/// `cache[offsets[j]..]` (`out.len()` of them), each element accumulated
/// with fused multiply-adds in order of `j`.
pub fn weighted_sum(weights: &[f32], cache: &[f16], offsets: &[usize], out: &mut [f32]) {
    match out.len() {
        64 => weighted_sum_fixed::<64>(weights, cache, offsets, out),
        128 => weighted_sum_fixed::<128>(weights, cache, offsets, out),
        dim => {
            out.fill(0.0);
            for (&weight, &at) in weights.iter().zip(offsets) {
                for (o, v) in out.iter_mut().zip(&cache[at..at + dim]) {
                    *o = weight.mul_add(v.to_f32(), *o);
                }
            }
        }
    }
}

/// [`weighted_sum`] for a compile-time width: the accumulator stays in
/// registers across positions.
#[inline]
fn weighted_sum_fixed<const DIM: usize>(weights: &[f32], cache: &[f16], offsets: &[usize], out: &mut [f32]) {
    let mut acc = [0f32; DIM];
    let mut value = [0f32; DIM];
    for (&weight, &at) in weights.iter().zip(offsets) {
        cache[at..at + DIM].convert_to_f32_slice(&mut value);
        for d in 0..DIM {
            acc[d] = weight.mul_add(value[d], acc[d]);
        }
    }
    out.copy_from_slice(&acc);
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    /// Eight dot products: per key, 8-lane FMA accumulation over the
    /// dimensions, then one fixed transposing reduction of the lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot8(query: &[f32], keys: [&[f16]; 8]) -> [f32; 8] {
        let mut acc = [_mm256_setzero_ps(); 8];
        for (chunk, q) in query.chunks_exact(8).enumerate() {
            // SAFETY: `q` is 8 readable floats and every key chunk 8 readable
            // f16 values (16 bytes); unaligned loads.
            let q = unsafe { _mm256_loadu_ps(q.as_ptr()) };
            for (a, key) in acc.iter_mut().zip(&keys) {
                let k = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(key[chunk * 8..chunk * 8 + 8].as_ptr().cast()) });
                *a = _mm256_fmadd_ps(q, k, *a);
            }
        }
        // Transpose-reduce: lane p of the result is the sum of acc[p]'s lanes.
        let h01 = _mm256_hadd_ps(acc[0], acc[1]);
        let h23 = _mm256_hadd_ps(acc[2], acc[3]);
        let h45 = _mm256_hadd_ps(acc[4], acc[5]);
        let h67 = _mm256_hadd_ps(acc[6], acc[7]);
        let h0123 = _mm256_hadd_ps(h01, h23);
        let h4567 = _mm256_hadd_ps(h45, h67);
        let low = _mm256_permute2f128_ps(h0123, h4567, 0x20);
        let high = _mm256_permute2f128_ps(h0123, h4567, 0x31);
        let sums = _mm256_add_ps(low, high);
        let mut out = [0f32; 8];
        // SAFETY: `out` is 8 writable floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sums) };
        out
    }
}

/// Normalizes each `hidden`-sized row of `x` into `out`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = weight.len();
    for (row, out_row) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        let mean_square = dot(row, row) / hidden as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Rotary position embedding tables (GGML's "normal" mode: rotate the
/// interleaved pairs `(x[2i], x[2i+1])` of the first `dims` dimensions).
#[derive(Debug)]
pub struct Rope {
    dims: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Tables for positions `0..max_positions`.
    pub fn new(dims: usize, theta: f32, linear_scale: f32, max_positions: usize) -> Self {
        let half = dims / 2;
        let inv_freq: Vec<f64> = (0..half).map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / dims as f64)).collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for position in 0..max_positions {
            let p = position as f64 / linear_scale as f64;
            for &f in &inv_freq {
                let angle = p * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self { dims, cos, sin }
    }

    /// The cosine and sine tables, `max_positions × dims / 2` each.
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.len() / (self.dims / 2).max(1)
    }

    /// Rotates every head (`head_dim` values each) of `row` for `position`.
    pub fn apply(&self, row: &mut [f32], head_dim: usize, position: usize) {
        let half = self.dims / 2;
        let (cos, sin) = (&self.cos[position * half..(position + 1) * half], &self.sin[position * half..(position + 1) * half]);
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = x0 * cos[i] - x1 * sin[i];
                head[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

/// One sequence's share of a batch, for attention.
#[derive(Debug, Clone)]
pub struct SeqSpan<'a> {
    /// Rows of this sequence in the batch.
    pub rows: Range<usize>,
    /// Position of the first row.
    pub first_position: usize,
    /// The sequence's block table.
    pub block_table: &'a [u32],
}

/// Shape of the attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Values from one block's first slot to the next block's in the cache
    /// slices (`block_size × kv_heads × head_dim` when the slice holds only
    /// this layer's keys or values; more when blocks interleave layers).
    pub block_stride: usize,
}

/// Per-thread buffers of the attention.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    /// Cache offset of each context position's key/value for one KV head.
    offsets: Vec<usize>,
}

thread_local! {
    static SCORES: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Causal attention for every row of the batch: row `t` of a sequence at
/// position `p` attends to positions `0..=p` of that sequence, whose keys
/// and values are read from the cache through its block table (the rows of
/// this step must already be written there). `q` and `out` are
/// `rows × heads × head_dim`; the caches are `slots × kv_heads × head_dim`.
pub fn paged_attention(q: &[f32], k_cache: &[f16], v_cache: &[f16], spans: &[SeqSpan<'_>], shape: AttentionShape, out: &mut [f32], pool: &ThreadPool) {
    let AttentionShape { heads, kv_heads, head_dim, block_size, block_stride } = shape;
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // One task per (row, head): enough tasks to keep every thread busy on a
    // single decoding sequence.
    let tasks: Vec<(usize, usize, usize)> = spans
        .iter()
        .enumerate()
        .flat_map(|(span_index, span)| span.rows.clone().map(move |row| (span_index, row)))
        .flat_map(|(span_index, row)| (0..heads).map(move |head| (span_index, row, head)))
        .collect();
    let out_shared = SharedMut::new(out);
    pool.run(tasks.len(), |task| {
        let (span_index, row, head) = tasks[task];
        let kv_head = head / group;
        let span = &spans[span_index];
        let position = span.first_position + (row - span.rows.start);
        let context = position + 1;
        SCORES.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let Scratch { scores, offsets } = &mut *scratch;
            scores.clear();
            scores.resize(context, 0.0);
            offsets.clear();
            offsets.extend(positions(span.block_table, block_size, block_stride, context, kv_heads * head_dim, kv_head * head_dim).map(|(_, at)| at));
            let query = &q[(row * heads + head) * head_dim..(row * heads + head + 1) * head_dim];
            qk_scores(query, k_cache, offsets, scale, scores);
            softmax(scores);
            // SAFETY: (row, head) is written by this task only.
            let output = unsafe { out_shared.slice((row * heads + head) * head_dim, head_dim) };
            weighted_sum(scores, v_cache, offsets, output);
        });
    });
}

/// In-place softmax (exponentials by [`exp`], vectorizable).
pub fn softmax(values: &mut [f32]) {
    let max = values.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    for s in values.iter_mut() {
        *s = exp(*s - max);
    }
    let mut lanes = [0f32; 8];
    let (chunks, rest) = values.split_at(values.len() - values.len() % 8);
    for chunk in chunks.chunks_exact(8) {
        for lane in 0..8 {
            lanes[lane] += chunk[lane];
        }
    }
    let sum = lanes.iter().sum::<f32>() + rest.iter().sum::<f32>();
    let inv = 1.0 / sum;
    values.iter_mut().for_each(|s| *s *= inv);
}

/// `e^x` for `x <= 0` (softmax arguments), to about 2 ulp: range reduction
/// by powers of two and a degree-6 polynomial, branch-free so loops over it
/// vectorize. Below -87 it returns 0.
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.max(-87.0);
    // x = n·ln2 + r, |r| <= ln2/2
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = n.mul_add(-0.693_145_75, x);
    let r = n.mul_add(-1.428_606_8e-6, r);
    let p = 1.0 / 720.0f32;
    let p = p.mul_add(r, 1.0 / 120.0);
    let p = p.mul_add(r, 1.0 / 24.0);
    let p = p.mul_add(r, 1.0 / 6.0);
    let p = p.mul_add(r, 0.5);
    let p = p.mul_add(r, 1.0);
    let p = p.mul_add(r, 1.0);
    // 2^n by building the exponent bits (n in -126..=0 here).
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `(position, offset in the cache)` of positions `0..context` of a
/// sequence, walking its block table (slots are contiguous within a block).
fn positions(
    block_table: &[u32],
    block_size: usize,
    block_stride: usize,
    context: usize,
    stride: usize,
    head_offset: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    block_table.iter().enumerate().take(context.div_ceil(block_size)).flat_map(move |(block_index, &block)| {
        let first = block_index * block_size;
        let base = block as usize * block_stride + head_offset;
        (0..block_size.min(context - first)).map(move |offset| (first + offset, base + offset * stride))
    })
}

/// Index of the largest value (the first on ties).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_on_softmax_arguments() {
        for i in 0..1720 {
            let x = -(i as f32) * 0.05;
            let (ours, libm) = (exp(x), x.exp());
            assert!((ours - libm).abs() <= 4.0 * f32::EPSILON * libm, "exp({x}) = {ours}, libm {libm}");
        }
        // Far below the maximum a softmax weight is negligible either way.
        assert!(exp(-200.0) < 1e-37);
    }

    #[test]
    fn dot_matches_the_naive_sum() {
        let a: Vec<f32> = (0..67).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..67).map(|i| 1.0 - i as f32 * 0.01).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3 * naive.abs());
    }

    #[test]
    fn rope_at_position_zero_is_the_identity_and_preserves_norms() {
        let rope = Rope::new(8, 10_000.0, 1.0, 16);
        let original: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let mut row = original.clone();
        rope.apply(&mut row, 8, 0);
        assert_eq!(row, original);
        rope.apply(&mut row, 8, 5);
        assert!((dot(&row, &row) - dot(&original, &original)).abs() < 1e-2);
    }

    #[test]
    fn paged_attention_equals_dense_attention_through_a_shuffled_block_table() {
        let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 8, block_size: 4, block_stride: 4 * 2 * 8 };
        let context = 10;
        let pool = ThreadPool::new(2);
        // Dense keys/values for positions 0..10, stored in blocks 5, 2, 7 of the cache.
        let block_table = [5u32, 2, 7];
        let kv_width = shape.kv_heads * shape.head_dim;
        let mut k_cache = vec![f16::ZERO; 8 * shape.block_size * kv_width];
        let mut v_cache = k_cache.clone();
        // Values exactly representable in f16, so the dense check sees the same numbers.
        let dense_k: Vec<f32> = (0..context * kv_width).map(|i| ((i * 7) % 13) as f32 * 0.125 - 0.75).collect();
        let dense_v: Vec<f32> = (0..context * kv_width).map(|i| ((i * 5) % 11) as f32 * 0.125 - 0.5).collect();
        for j in 0..context {
            let slot = block_table[j / 4] as usize * 4 + j % 4;
            to_f16(&dense_k[j * kv_width..(j + 1) * kv_width], &mut k_cache[slot * kv_width..(slot + 1) * kv_width]);
            to_f16(&dense_v[j * kv_width..(j + 1) * kv_width], &mut v_cache[slot * kv_width..(slot + 1) * kv_width]);
        }
        // The last 3 positions are this step's rows.
        let q: Vec<f32> = (0..3 * shape.heads * shape.head_dim).map(|i| ((i * 3) % 7) as f32 * 0.2 - 0.6).collect();
        let spans = [SeqSpan { rows: 0..3, first_position: 7, block_table: &block_table }];
        let mut out = vec![0f32; q.len()];
        paged_attention(&q, &k_cache, &v_cache, &spans, shape, &mut out, &pool);
        for row in 0..3 {
            let position = 7 + row;
            for head in 0..shape.heads {
                let kv_head = head / 2;
                let query = &q[(row * 4 + head) * 8..(row * 4 + head + 1) * 8];
                let scores: Vec<f32> =
                    (0..=position).map(|j| dot(query, &dense_k[j * kv_width + kv_head * 8..j * kv_width + kv_head * 8 + 8]) / 8f32.sqrt()).collect();
                let max = scores.iter().cloned().fold(f32::MIN, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = weights.iter().sum();
                for d in 0..8 {
                    let expected: f32 = (0..=position).map(|j| weights[j] / total * dense_v[j * kv_width + kv_head * 8 + d]).sum();
                    let got = out[(row * 4 + head) * 8 + d];
                    assert!((expected - got).abs() < 1e-4, "row {row} head {head} dim {d}: {expected} vs {got}");
                }
            }
        }
    }
}
