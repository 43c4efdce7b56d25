//! Weight matrices straight from the memory-mapped GGUF file, and the
//! matrix products the model needs from them.
//!
//! Q4_1 and Q8_0 use this crate's kernels (`quant.rs`); every other ggml
//! format supported here (Q4_0, Q5_0, Q5_1, Q2_K..Q6_K, F16, F32) uses
//! candle's block types and dot products, with activations quantized to the
//! format's companion type as ggml does. Products are split across the
//! thread pool by output column and computed row by row, so a row's result
//! never depends on which other rows share the batch.

#![allow(unsafe_code)]

use std::sync::Arc;

use candle_core::quantized::GgmlType;
use candle_core::quantized::k_quants::{BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K};
use half::f16;
use memmap2::Mmap;

use crate::pool::ThreadPool;
use crate::quant::{self, BlockQ4_1, BlockQ8_0, BlockQ8_0Act, BlockQ8_1, QK};
use crate::{Error, Result};

/// ggml tensor types this engine loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl WeightType {
    /// From a GGUF tensor type id; unknown or unsupported ids are refused.
    pub fn from_ggml(id: u32, tensor: &str) -> Result<Self> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor {tensor} has ggml type {other}, which this engine does not support \
                     (supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)"
                )));
            }
        })
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q2K => (256, 84),
            Self::Q3K => (256, 110),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
        }
    }
}

/// A weight matrix of `rows` × `cols` (`cols` = input features), row-major
/// as ggml stores it, viewing bytes of the mapped file.
#[derive(Clone)]
pub struct Matrix {
    mmap: Arc<Mmap>,
    offset: usize,
    bytes: usize,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Storage format.
    pub kind: WeightType,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({}x{} {:?})", self.rows, self.cols, self.kind)
    }
}

/// Reinterprets plain-data bytes as blocks.
///
/// # Safety-relevant checks
/// Panics unless the bytes are aligned for `T` and a whole number of `T`s;
/// `T` must be a `repr(C)` type made only of integers and f16 (every bit
/// pattern valid), which holds for every block type used here.
fn cast<T>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert_eq!(bytes.as_ptr() as usize % std::mem::align_of::<T>(), 0, "misaligned tensor data");
    assert_eq!(bytes.len() % size, 0, "tensor data is not a whole number of blocks");
    // SAFETY: alignment and length are checked above; T is plain data for
    // which every bit pattern is valid; the lifetime is tied to `bytes`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) }
}

impl Matrix {
    /// A view of `rows` × `cols` values of type `kind` at `offset` in `mmap`.
    pub fn new(mmap: Arc<Mmap>, offset: usize, rows: usize, cols: usize, kind: WeightType, name: &str) -> Result<Self> {
        let (block_elems, block_bytes) = kind.block();
        if !cols.is_multiple_of(block_elems) {
            return Err(Error::Unsupported(format!("tensor {name}: {cols} columns is not a multiple of the {block_elems}-element block")));
        }
        let bytes = rows * cols / block_elems * block_bytes;
        if offset + bytes > mmap.len() {
            return Err(Error::Model(format!("tensor {name} extends past the end of the file")));
        }
        Ok(Self { mmap, offset, bytes, rows, cols, kind })
    }

    fn data(&self) -> &[u8] {
        &self.mmap[self.offset..self.offset + self.bytes]
    }

    /// Bytes of weights.
    pub fn size_bytes(&self) -> usize {
        self.bytes
    }

    /// Dequantizes row `row` into `out` (`cols` values).
    pub fn row_into(&self, row: usize, out: &mut [f32]) {
        let (block_elems, block_bytes) = self.kind.block();
        let row_bytes = self.cols / block_elems * block_bytes;
        let bytes = &self.data()[row * row_bytes..(row + 1) * row_bytes];
        match self.kind {
            WeightType::Q4_1 => quant::dequantize_q4_1(cast(bytes), out),
            WeightType::Q8_0 => quant::dequantize_q8_0(cast(bytes), out),
            WeightType::F32 => out.copy_from_slice(cast::<f32>(bytes)),
            WeightType::F16 => {
                for (value, half) in out.iter_mut().zip(cast::<u16>(bytes)) {
                    *value = f16::from_bits(*half).to_f32();
                }
            }
            WeightType::Q4_0 => BlockQ4_0::to_float(cast(bytes), out),
            WeightType::Q5_0 => BlockQ5_0::to_float(cast(bytes), out),
            WeightType::Q5_1 => BlockQ5_1::to_float(cast(bytes), out),
            WeightType::Q2K => BlockQ2K::to_float(cast(bytes), out),
            WeightType::Q3K => BlockQ3K::to_float(cast(bytes), out),
            WeightType::Q4K => BlockQ4K::to_float(cast(bytes), out),
            WeightType::Q5K => BlockQ5K::to_float(cast(bytes), out),
            WeightType::Q6K => BlockQ6K::to_float(cast(bytes), out),
        }
    }

    /// `out[t][j] = Σ_k x[t][k] · W[j][k]` for `t < m`: `x` is `m × cols`,
    /// `out` is `m × rows`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32], pool: &ThreadPool) {
        debug_assert_eq!(x.len(), m * self.cols);
        debug_assert!(out.len() >= m * self.rows);
        match self.kind {
            WeightType::Q4_1 | WeightType::Q8_0 => Self::matmul_fused(&mut [(self, out)], x, m, pool),
            WeightType::F32 => self.matmul_ggml::<f32>(x, m, out, pool),
            WeightType::F16 => self.matmul_ggml::<f16>(x, m, out, pool),
            WeightType::Q4_0 => self.matmul_ggml::<BlockQ4_0>(x, m, out, pool),
            WeightType::Q5_0 => self.matmul_ggml::<BlockQ5_0>(x, m, out, pool),
            WeightType::Q5_1 => self.matmul_ggml::<BlockQ5_1>(x, m, out, pool),
            WeightType::Q2K => self.matmul_ggml::<BlockQ2K>(x, m, out, pool),
            WeightType::Q3K => self.matmul_ggml::<BlockQ3K>(x, m, out, pool),
            WeightType::Q4K => self.matmul_ggml::<BlockQ4K>(x, m, out, pool),
            WeightType::Q5K => self.matmul_ggml::<BlockQ5K>(x, m, out, pool),
            WeightType::Q6K => self.matmul_ggml::<BlockQ6K>(x, m, out, pool),
        }
    }

    /// Products of several matrices with the same input `x` (`m × cols`),
    /// e.g. the query, key and value projections: when they share a format
    /// with this crate's kernels, the activations are quantized once and all
    /// columns run in one pass of the pool. Results are exactly those of
    /// [`matmul`](Self::matmul) on each.
    pub fn matmul_fused(parts: &mut [(&Matrix, &mut [f32])], x: &[f32], m: usize, pool: &ThreadPool) {
        let kind = parts[0].0.kind;
        let cols = parts[0].0.cols;
        let fusable = matches!(kind, WeightType::Q4_1 | WeightType::Q8_0) && parts.iter().all(|(w, _)| w.kind == kind && w.cols == cols);
        if !fusable {
            for (matrix, out) in parts.iter_mut() {
                matrix.matmul(x, m, out, pool);
            }
            return;
        }
        let blocks_per_row = cols / QK;
        match kind {
            WeightType::Q4_1 => {
                let activations = quantize_rows(x, m, cols, pool, quant::quantize_q8_1);
                let targets: Vec<Target<'_, BlockQ4_1>> =
                    parts.iter_mut().map(|(w, out)| Target { weights: cast(w.data()), rows: w.rows, out: SharedMut::new(out) }).collect();
                product_grouped(
                    &targets,
                    &activations,
                    m,
                    blocks_per_row,
                    pool,
                    |w, a: [&[BlockQ8_1]; 4]| quant::dot_q4_1_q8_1_rows(w, a),
                    quant::dot_q4_1_q8_1,
                );
            }
            _ => {
                let activations = quantize_rows(x, m, cols, pool, quant::quantize_q8_0);
                let targets: Vec<Target<'_, BlockQ8_0>> =
                    parts.iter_mut().map(|(w, out)| Target { weights: cast(w.data()), rows: w.rows, out: SharedMut::new(out) }).collect();
                product_grouped(
                    &targets,
                    &activations,
                    m,
                    blocks_per_row,
                    pool,
                    |w, a: [&[BlockQ8_0Act]; 4]| quant::dot_q8_0_q8_0_rows(w, a),
                    quant::dot_q8_0_q8_0,
                );
            }
        }
    }

    /// Any candle block type: activations quantized to its companion type.
    fn matmul_ggml<T: GgmlType + Sync>(&self, x: &[f32], m: usize, out: &mut [f32], pool: &ThreadPool)
    where
        T::VecDotType: Clone + Send + Sync,
    {
        let blocks_per_row = self.cols / T::BLCK_SIZE;
        let activations = quantize_rows(x, m, self.cols, pool, |row, blocks: &mut [T::VecDotType]| T::VecDotType::from_float(row, blocks));
        let cols = self.cols;
        product(cast::<T>(self.data()), &activations, m, self.rows, blocks_per_row, out, pool, move |w, a| T::vec_dot(cols, w, a));
    }
}

/// Quantizes the `m` rows of `x` into activation blocks.
fn quantize_rows<B: ZeroBlock + Clone + Send + Sync>(
    x: &[f32],
    m: usize,
    cols: usize,
    pool: &ThreadPool,
    quantize: impl Fn(&[f32], &mut [B]) + Sync,
) -> Vec<B> {
    let blocks_per_row = cols / B::ELEMENTS;
    let mut blocks = vec![B::zero(); m * blocks_per_row];
    let out = SharedMut::new(&mut blocks);
    // Rows in chunks of 16 per task: small batches stay on one thread.
    let chunk = 16;
    pool.run(m.div_ceil(chunk), |task| {
        for row in task * chunk..m.min((task + 1) * chunk) {
            // SAFETY: each task writes only its own rows' blocks.
            let row_blocks = unsafe { out.slice(row * blocks_per_row, blocks_per_row) };
            quantize(&x[row * cols..(row + 1) * cols], row_blocks);
        }
    });
    blocks
}

/// Activation block types with a zero value and their element count.
pub trait ZeroBlock {
    /// Elements per block.
    const ELEMENTS: usize;
    /// A zeroed block.
    fn zero() -> Self;
}

impl ZeroBlock for BlockQ8_1 {
    const ELEMENTS: usize = QK;
    fn zero() -> Self {
        Self::default()
    }
}

impl ZeroBlock for BlockQ8_0Act {
    const ELEMENTS: usize = QK;
    fn zero() -> Self {
        Self::default()
    }
}

impl<T: GgmlType> ZeroBlock for T {
    const ELEMENTS: usize = T::BLCK_SIZE;
    fn zero() -> Self {
        T::zeros()
    }
}

/// Output columns handed to one task.
const COLUMNS_PER_TASK: usize = 16;

/// `out[t][j] = dot(W row j, A row t)`, parallel over column groups; each
/// task streams its weight rows once and reuses them for every
/// activation row.
#[allow(clippy::too_many_arguments)]
fn product<W: Sync, A: Sync>(
    weights: &[W],
    activations: &[A],
    m: usize,
    rows: usize,
    blocks_per_row: usize,
    out: &mut [f32],
    pool: &ThreadPool,
    dot: impl Fn(&[W], &[A]) -> f32 + Sync,
) {
    let out = SharedMut::new(out);
    pool.run(rows.div_ceil(COLUMNS_PER_TASK), |task| {
        let columns = task * COLUMNS_PER_TASK..rows.min((task + 1) * COLUMNS_PER_TASK);
        for j in columns {
            let w = &weights[j * blocks_per_row..(j + 1) * blocks_per_row];
            for t in 0..m {
                let a = &activations[t * blocks_per_row..(t + 1) * blocks_per_row];
                // SAFETY: element (t, j) belongs to this task's columns only.
                unsafe { out.write(t * rows + j, dot(w, a)) };
            }
        }
    });
}

/// One weight matrix and its output in a fused product.
struct Target<'a, W> {
    weights: &'a [W],
    rows: usize,
    out: SharedMut<f32>,
}

/// Products of several matrices with the same activations in one pass of
/// the pool, with a kernel that takes four activation rows at once
/// (weights unpacked once for the four) and a one-row kernel for the rest;
/// both compute each row identically.
#[allow(clippy::too_many_arguments)]
fn product_grouped<W: Sync, A: Sync>(
    targets: &[Target<'_, W>],
    activations: &[A],
    m: usize,
    blocks_per_row: usize,
    pool: &ThreadPool,
    dot4: impl Fn(&[W], [&[A]; 4]) -> [f32; 4] + Sync,
    dot1: impl Fn(&[W], &[A]) -> f32 + Sync,
) {
    let row_of = |t: usize| &activations[t * blocks_per_row..(t + 1) * blocks_per_row];
    // Task k covers columns of one target: (target, first column).
    let tasks: Vec<(usize, usize)> =
        targets.iter().enumerate().flat_map(|(index, target)| (0..target.rows).step_by(COLUMNS_PER_TASK).map(move |column| (index, column))).collect();
    pool.run(tasks.len(), |task| {
        let (index, first) = tasks[task];
        let Target { weights, rows, out } = &targets[index];
        for j in first..(*rows).min(first + COLUMNS_PER_TASK) {
            let w = &weights[j * blocks_per_row..(j + 1) * blocks_per_row];
            let mut t = 0;
            while t + 4 <= m {
                let results = dot4(w, [row_of(t), row_of(t + 1), row_of(t + 2), row_of(t + 3)]);
                for (k, value) in results.into_iter().enumerate() {
                    // SAFETY: element (t + k, j) of this target belongs to this task only.
                    unsafe { out.write((t + k) * rows + j, value) };
                }
                t += 4;
            }
            for t in t..m {
                // SAFETY: element (t, j) of this target belongs to this task only.
                unsafe { out.write(t * rows + j, dot1(w, row_of(t))) };
            }
        }
    });
}

/// A mutable buffer that parallel tasks write disjoint parts of.
pub(crate) struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: tasks only write disjoint elements (each call site documents its
// partition), so sharing the pointer across threads cannot race.
unsafe impl<T: Send> Sync for SharedMut<T> {}
unsafe impl<T: Send> Send for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(buffer: &mut [T]) -> Self {
        Self { ptr: buffer.as_mut_ptr(), len: buffer.len() }
    }

    /// # Safety
    /// No other task may access `[start, start + len)` concurrently, and the
    /// buffer must outlive the use (the pool's `run` guarantees that).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "slice out of bounds");
        // SAFETY: in bounds (checked) and exclusive (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// # Safety
    /// No other task may access element `index` concurrently.
    pub(crate) unsafe fn write(&self, index: usize, value: T) {
        assert!(index < self.len, "write out of bounds");
        // SAFETY: in bounds (checked) and exclusive (caller's contract).
        unsafe { self.ptr.add(index).write(value) }
    }
}
