//! Quantized blocks and dot-product kernels for the formats the default
//! model uses: Q4_1 weights × Q8_1 activations, Q8_0 × Q8_0, exactly as
//! ggml defines them (so results match llama.cpp's arithmetic), with AVX2
//! kernels on x86-64 and portable scalar versions elsewhere (the scalar
//! versions are also the test oracle for the SIMD ones).
//!
//! Candle has no SIMD kernel for Q4_1; this is the one that makes decoding
//! the default model fast. Other ggml formats go through candle's kernels
//! (see `weights.rs`).

#![allow(unsafe_code)]

use half::f16;

/// Elements per Q4_1 / Q8_0 / Q8_1 block.
pub const QK: usize = 32;

/// 32 weights as 4-bit offsets from a minimum: `w = d * q + m`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Minimum (f16 bits).
    pub m: u16,
    /// Nibbles: low nibble of byte j is element j, high nibble element j + 16.
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

/// 32 values as signed bytes with one scale: `x = d * q`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Quantized values.
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

/// Activations quantized for Q4_1 dots: like Q8_0 plus `s = d * Σq`, which
/// carries the weights' minimum through the dot product. `d` and `s` are
/// kept as f32 but rounded through f16, as ggml stores them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: f32,
    /// `d * Σ qs`.
    pub s: f32,
    /// Quantized values.
    pub qs: [i8; QK],
}

/// Activations quantized for Q8_0 dots (scale rounded through f16).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[repr(C)]
pub struct BlockQ8_0Act {
    /// Scale.
    pub d: f32,
    /// Quantized values.
    pub qs: [i8; QK],
}

fn f16_round(value: f32) -> f32 {
    f16::from_f32(value).to_f32()
}

fn f16_bits(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Quantizes one row (a multiple of 32 values) to Q8_1, as ggml's
/// `quantize_row_q8_1`.
pub fn quantize_q8_1(values: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(values.len(), out.len() * QK);
    for (chunk, block) in values.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in block.qs.iter_mut().zip(chunk) {
            let scaled = (v * id).round() as i32;
            *q = scaled as i8;
            sum += scaled;
        }
        block.d = f16_round(d);
        block.s = f16_round(sum as f32 * d);
    }
}

/// Quantizes one row (a multiple of 32 values) to Q8_0, as ggml's
/// `quantize_row_q8_0`.
pub fn quantize_q8_0(values: &[f32], out: &mut [BlockQ8_0Act]) {
    debug_assert_eq!(values.len(), out.len() * QK);
    for (chunk, block) in values.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in block.qs.iter_mut().zip(chunk) {
            *q = (v * id).round() as i8;
        }
        block.d = f16_round(d);
    }
}

/// Dequantizes Q4_1 blocks.
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (block, chunk) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (f16_bits(block.d), f16_bits(block.m));
        for (j, &q) in block.qs.iter().enumerate() {
            chunk[j] = (q & 0x0F) as f32 * d + m;
            chunk[j + QK / 2] = (q >> 4) as f32 * d + m;
        }
    }
}

/// Dequantizes Q8_0 blocks.
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (block, chunk) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = f16_bits(block.d);
        for (value, &q) in chunk.iter_mut().zip(&block.qs) {
            *value = q as f32 * d;
        }
    }
}

// Every kernel computes, per block, the exact integer dot of the quants and
// then accumulates in one fixed order of fused multiply-adds:
//     acc = fma(m, s, acc)                  (Q4_1 only: the minimum)
//     acc = fma(isum, d_w * d_a, acc)
// so the SIMD kernels, for any number of rows at once, give bit-identical
// results to these portable versions.

/// Σ over blocks of Q4_1 · Q8_1, portable version.
pub fn dot_q4_1_q8_1_scalar(weights: &[BlockQ4_1], activations: &[BlockQ8_1]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in weights.iter().zip(activations) {
        let mut isum = 0i32;
        for j in 0..QK / 2 {
            isum += (w.qs[j] & 0x0F) as i32 * a.qs[j] as i32 + (w.qs[j] >> 4) as i32 * a.qs[j + QK / 2] as i32;
        }
        acc = f16_bits(w.m).mul_add(a.s, acc);
        acc = (isum as f32).mul_add(f16_bits(w.d) * a.d, acc);
    }
    acc
}

/// Σ over blocks of Q8_0 · Q8_0, portable version.
pub fn dot_q8_0_q8_0_scalar(weights: &[BlockQ8_0], activations: &[BlockQ8_0Act]) -> f32 {
    let mut acc = 0f32;
    for (w, a) in weights.iter().zip(activations) {
        let isum: i32 = w.qs.iter().zip(&a.qs).map(|(&x, &y)| x as i32 * y as i32).sum();
        acc = (isum as f32).mul_add(f16_bits(w.d) * a.d, acc);
    }
    acc
}

/// Σ over blocks of Q4_1 · Q8_1.
#[inline]
pub fn dot_q4_1_q8_1(weights: &[BlockQ4_1], activations: &[BlockQ8_1]) -> f32 {
    dot_q4_1_q8_1_rows::<1>(weights, [activations])[0]
}

/// Σ over blocks of Q8_0 · Q8_0.
#[inline]
pub fn dot_q8_0_q8_0(weights: &[BlockQ8_0], activations: &[BlockQ8_0Act]) -> f32 {
    dot_q8_0_q8_0_rows::<1>(weights, [activations])[0]
}

/// One weight row against `N` activation rows: the weights are unpacked
/// once per block for all rows. Each row's arithmetic is exactly that of
/// [`dot_q4_1_q8_1`], so results never depend on how rows are grouped.
#[inline]
pub fn dot_q4_1_q8_1_rows<const N: usize>(weights: &[BlockQ4_1], activations: [&[BlockQ8_1]; N]) -> [f32; N] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    {
        // SAFETY: the function needs AVX2/FMA/F16C, which this build
        // targets (cfg above); it reads only through safe slices.
        unsafe { avx2::dot_q4_1_q8_1_rows(weights, activations) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
    activations.map(|a| dot_q4_1_q8_1_scalar(weights, a))
}

/// One Q8_0 weight row against `N` activation rows (see
/// [`dot_q4_1_q8_1_rows`]).
#[inline]
pub fn dot_q8_0_q8_0_rows<const N: usize>(weights: &[BlockQ8_0], activations: [&[BlockQ8_0Act]; N]) -> [f32; N] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    {
        // SAFETY: as for `dot_q4_1_q8_1_rows`: the target features are compiled in.
        unsafe { avx2::dot_q8_0_q8_0_rows(weights, activations) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
    activations.map(|a| dot_q8_0_q8_0_scalar(weights, a))
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BlockQ4_1, BlockQ8_0, BlockQ8_0Act, BlockQ8_1};

    /// One f16 (as bits) to f32 with the F16C instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn half(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 32 nibbles as 32 bytes: elements 0..16 from the low nibbles, then
    /// 16..32 from the high ones.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn nibbles(qs: &[u8; 16]) -> __m256i {
        // SAFETY: `qs` is 16 readable bytes; loadu has no alignment needs.
        let packed = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// 32 signed bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn bytes(qs: &[i8; 32]) -> __m256i {
        // SAFETY: `qs` is 32 readable bytes; loadu has no alignment needs.
        unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
    }

    /// Exact integer sums of 4 vectors of 8 i32 lanes, as [s0, s1, s2, s3].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum4_epi32(v: [__m256i; 4]) -> __m128i {
        let t = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1))
    }

    /// Exact integer sum of 8 i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum_epi32(v: __m256i) -> i32 {
        let x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0b01_00_11_10));
        let x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0b10_11_00_01));
        _mm_cvtsi128_si32(x)
    }

    /// u8 × i8 products of 32 lanes, summed to 8 i32 lanes (exact).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot_us8(unsigned: __m256i, signed: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, signed), _mm256_set1_epi16(1))
    }

    /// Σ Q4_1 · Q8_1 of one weight row against `N` activation rows (the
    /// block order and arithmetic of `dot_q4_1_q8_1_scalar`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_q4_1_q8_1_rows<const N: usize>(weights: &[BlockQ4_1], activations: [&[BlockQ8_1]; N]) -> [f32; N] {
        if N == 4 {
            let mut acc = _mm_setzero_ps();
            for (block, w) in weights.iter().enumerate() {
                let qw = nibbles(&w.qs);
                let a: [&BlockQ8_1; 4] = std::array::from_fn(|r| &activations[r][block]);
                let sums = hsum4_epi32(std::array::from_fn(|r| dot_us8(qw, bytes(&a[r].qs))));
                let d_a = _mm_set_ps(a[3].d, a[2].d, a[1].d, a[0].d);
                let s = _mm_set_ps(a[3].s, a[2].s, a[1].s, a[0].s);
                acc = _mm_fmadd_ps(_mm_set1_ps(half(w.m)), s, acc);
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(_mm_set1_ps(half(w.d)), d_a), acc);
            }
            let mut lanes = [0f32; 4];
            // SAFETY: `lanes` is 4 writable floats; storeu has no alignment needs.
            unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), acc) };
            return std::array::from_fn(|r| lanes[r]);
        }
        std::array::from_fn(|r| {
            let activations = activations[r];
            let mut acc = 0f32;
            // Integer sums of four blocks at a time, applied in block order.
            let whole = weights.len() / 4 * 4;
            for base in (0..whole).step_by(4) {
                let sums = hsum4_epi32(std::array::from_fn(|k| dot_us8(nibbles(&weights[base + k].qs), bytes(&activations[base + k].qs))));
                let mut isums = [0i32; 4];
                // SAFETY: `isums` is 16 writable bytes; storeu has no alignment needs.
                unsafe { _mm_storeu_si128(isums.as_mut_ptr().cast(), sums) };
                for k in 0..4 {
                    let (w, a) = (&weights[base + k], &activations[base + k]);
                    acc = half(w.m).mul_add(a.s, acc);
                    acc = (isums[k] as f32).mul_add(half(w.d) * a.d, acc);
                }
            }
            for (w, a) in weights[whole..].iter().zip(&activations[whole..]) {
                let isum = hsum_epi32(dot_us8(nibbles(&w.qs), bytes(&a.qs)));
                acc = half(w.m).mul_add(a.s, acc);
                acc = (isum as f32).mul_add(half(w.d) * a.d, acc);
            }
            acc
        })
    }

    /// Σ Q8_0 · Q8_0 of one weight row against `N` activation rows (the
    /// block order and arithmetic of `dot_q8_0_q8_0_scalar`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_q8_0_q8_0_rows<const N: usize>(weights: &[BlockQ8_0], activations: [&[BlockQ8_0Act]; N]) -> [f32; N] {
        if N == 4 {
            let mut acc = _mm_setzero_ps();
            for (block, w) in weights.iter().enumerate() {
                let qw = bytes(&w.qs);
                // |w| × sign(a, w): unsigned × signed, as maddubs needs.
                let abs_w = _mm256_sign_epi8(qw, qw);
                let a: [&BlockQ8_0Act; 4] = std::array::from_fn(|r| &activations[r][block]);
                let sums = hsum4_epi32(std::array::from_fn(|r| dot_us8(abs_w, _mm256_sign_epi8(bytes(&a[r].qs), qw))));
                let d_a = _mm_set_ps(a[3].d, a[2].d, a[1].d, a[0].d);
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(_mm_set1_ps(half(w.d)), d_a), acc);
            }
            let mut lanes = [0f32; 4];
            // SAFETY: `lanes` is 4 writable floats; storeu has no alignment needs.
            unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), acc) };
            return std::array::from_fn(|r| lanes[r]);
        }
        let signed_dot = |w: &BlockQ8_0, a: &BlockQ8_0Act| {
            let qw = bytes(&w.qs);
            dot_us8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(bytes(&a.qs), qw))
        };
        std::array::from_fn(|r| {
            let activations = activations[r];
            let mut acc = 0f32;
            let whole = weights.len() / 4 * 4;
            for base in (0..whole).step_by(4) {
                let sums = hsum4_epi32(std::array::from_fn(|k| signed_dot(&weights[base + k], &activations[base + k])));
                let mut isums = [0i32; 4];
                // SAFETY: `isums` is 16 writable bytes; storeu has no alignment needs.
                unsafe { _mm_storeu_si128(isums.as_mut_ptr().cast(), sums) };
                for k in 0..4 {
                    acc = (isums[k] as f32).mul_add(half(weights[base + k].d) * activations[base + k].d, acc);
                }
            }
            for (w, a) in weights[whole..].iter().zip(&activations[whole..]) {
                acc = (hsum_epi32(signed_dot(w, a)) as f32).mul_add(half(w.d) * a.d, acc);
            }
            acc
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn q4_1_block(seed: &[u8], d: f32, m: f32) -> BlockQ4_1 {
        let mut qs = [0u8; 16];
        for (q, s) in qs.iter_mut().zip(seed.iter().cycle()) {
            *q = *s;
        }
        BlockQ4_1 { d: f16::from_f32(d).to_bits(), m: f16::from_f32(m).to_bits(), qs }
    }

    proptest! {
        #[test]
        fn simd_q4_1_dot_equals_the_scalar_dot(
            nibbles in prop::collection::vec(any::<u8>(), 16..128),
            values in prop::collection::vec(-8.0f32..8.0, 128),
            d in 0.0001f32..0.5, m in -2.0f32..2.0,
        ) {
            let weights: Vec<BlockQ4_1> = nibbles.chunks(16).map(|c| q4_1_block(c, d, m)).take(4).collect();
            let mut activations = vec![BlockQ8_1::default(); weights.len()];
            quantize_q8_1(&values[..weights.len() * QK], &mut activations);
            let simd = dot_q4_1_q8_1(&weights, &activations);
            let scalar = dot_q4_1_q8_1_scalar(&weights, &activations);
            prop_assert_eq!(simd.to_bits(), scalar.to_bits(), "{} vs {}", simd, scalar);
        }

        #[test]
        fn simd_q8_0_dot_equals_the_scalar_dot(
            weights in prop::collection::vec(any::<i8>(), 96),
            values in prop::collection::vec(-8.0f32..8.0, 96),
            d in 0.0001f32..0.5,
        ) {
            let blocks: Vec<BlockQ8_0> = weights
                .chunks(32)
                .map(|c| BlockQ8_0 { d: f16::from_f32(d).to_bits(), qs: c.try_into().unwrap() })
                .collect();
            let mut activations = vec![BlockQ8_0Act::default(); 3];
            quantize_q8_0(&values, &mut activations);
            let simd = dot_q8_0_q8_0(&blocks, &activations);
            let scalar = dot_q8_0_q8_0_scalar(&blocks, &activations);
            prop_assert_eq!(simd.to_bits(), scalar.to_bits(), "{} vs {}", simd, scalar);
        }
    }

    #[test]
    fn grouped_rows_give_bit_identical_results() {
        let weights: Vec<BlockQ4_1> = (0..6).map(|i| q4_1_block(&[i as u8 * 37, 201, 3], 0.01 + i as f32 * 0.003, -0.05)).collect();
        let q8: Vec<BlockQ8_0> = (0..6).map(|i| BlockQ8_0 { d: f16::from_f32(0.02).to_bits(), qs: [(i * 11) as i8 - 30; 32] }).collect();
        let rows: Vec<Vec<f32>> = (0..4).map(|r| (0..192).map(|i| ((i * (r + 3)) % 17) as f32 * 0.3 - 2.0).collect()).collect();
        let q8_1: Vec<Vec<BlockQ8_1>> = rows
            .iter()
            .map(|x| {
                let mut b = vec![BlockQ8_1::default(); 6];
                quantize_q8_1(x, &mut b);
                b
            })
            .collect();
        let q8_0: Vec<Vec<BlockQ8_0Act>> = rows
            .iter()
            .map(|x| {
                let mut b = vec![BlockQ8_0Act::default(); 6];
                quantize_q8_0(x, &mut b);
                b
            })
            .collect();
        let grouped = dot_q4_1_q8_1_rows::<4>(&weights, [&q8_1[0], &q8_1[1], &q8_1[2], &q8_1[3]]);
        let grouped_q8 = dot_q8_0_q8_0_rows::<4>(&q8, [&q8_0[0], &q8_0[1], &q8_0[2], &q8_0[3]]);
        for row in 0..4 {
            assert_eq!(grouped[row].to_bits(), dot_q4_1_q8_1(&weights, &q8_1[row]).to_bits());
            assert_eq!(grouped_q8[row].to_bits(), dot_q8_0_q8_0(&q8, &q8_0[row]).to_bits());
        }
    }

    #[test]
    fn quantized_dot_approximates_the_float_dot() {
        let weights_f: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
        // Quantize the weights to Q4_1 the simple way: per block min/max.
        let weights: Vec<BlockQ4_1> = weights_f
            .chunks(32)
            .map(|chunk| {
                let (lo, hi) = chunk.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                let d = (hi - lo) / 15.0;
                let mut qs = [0u8; 16];
                for j in 0..16 {
                    let q0 = ((chunk[j] - lo) / d).round() as u8;
                    let q1 = ((chunk[j + 16] - lo) / d).round() as u8;
                    qs[j] = q0 | (q1 << 4);
                }
                BlockQ4_1 { d: f16::from_f32(d).to_bits(), m: f16::from_f32(lo).to_bits(), qs }
            })
            .collect();
        let mut dequantized = vec![0f32; 64];
        dequantize_q4_1(&weights, &mut dequantized);
        let exact: f32 = dequantized.iter().zip(&x).map(|(a, b)| a * b).sum();
        let mut activations = vec![BlockQ8_1::default(); 2];
        quantize_q8_1(&x, &mut activations);
        let quantized = dot_q4_1_q8_1(&weights, &activations);
        assert!((quantized - exact).abs() < 0.05 * exact.abs().max(1.0), "{quantized} vs {exact}");
    }
}
