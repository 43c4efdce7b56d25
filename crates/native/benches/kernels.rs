//! Kernel throughput: Q4_1 × Q8_1 and Q8_0 × Q8_0 matrix-vector products at
//! the default model's shapes, the SIMD kernels side by side with their
//! portable scalar versions.
//!
//! Run: `cargo bench -p turbine-native --bench kernels`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use turbine_native::quant::{self, BlockQ4_1, BlockQ8_0, BlockQ8_0Act, BlockQ8_1, QK};

fn bench(c: &mut Criterion) {
    // The feed-forward down projection of SmolLM2-135M: 576 outputs × 1536 inputs.
    let (rows, cols) = (576, 1536);
    let blocks = cols / QK;
    let q4: Vec<BlockQ4_1> =
        (0..rows * blocks).map(|i| BlockQ4_1 { d: f16::from_f32(0.01).to_bits(), m: f16::from_f32(-0.07).to_bits(), qs: [(i % 251) as u8; 16] }).collect();
    let q8: Vec<BlockQ8_0> = (0..rows * blocks).map(|i| BlockQ8_0 { d: f16::from_f32(0.01).to_bits(), qs: [(i % 127) as i8; 32] }).collect();
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut x_q8_1 = vec![BlockQ8_1::default(); blocks];
    quant::quantize_q8_1(&x, &mut x_q8_1);
    let mut x_q8_0 = vec![BlockQ8_0Act::default(); blocks];
    quant::quantize_q8_0(&x, &mut x_q8_0);

    let mut group = c.benchmark_group("gemv_576x1536");
    group.throughput(Throughput::Elements((rows * cols) as u64));
    group.bench_function("q4_1_simd", |b| b.iter(|| (0..rows).map(|r| quant::dot_q4_1_q8_1(&q4[r * blocks..(r + 1) * blocks], &x_q8_1)).sum::<f32>()));
    group.bench_function("q4_1_scalar", |b| b.iter(|| (0..rows).map(|r| quant::dot_q4_1_q8_1_scalar(&q4[r * blocks..(r + 1) * blocks], &x_q8_1)).sum::<f32>()));
    group.bench_function("q8_0_simd", |b| b.iter(|| (0..rows).map(|r| quant::dot_q8_0_q8_0(&q8[r * blocks..(r + 1) * blocks], &x_q8_0)).sum::<f32>()));
    group.bench_function("q8_0_scalar", |b| b.iter(|| (0..rows).map(|r| quant::dot_q8_0_q8_0_scalar(&q8[r * blocks..(r + 1) * blocks], &x_q8_0)).sum::<f32>()));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
