//! The Llama forward pass over a batch of sequences with a paged KV cache.
//!
//! A batch is a flat list of token rows (decode tokens and prefill chunks
//! of several sequences together). Matrix products run on all rows at once;
//! attention reads each sequence's keys and values through its block table.
//! Logits are computed only for the rows that sample.

use std::path::Path;
use std::sync::Arc;

use half::f16;
use memmap2::Mmap;
use turbine_engine::{KvAllocator, KvBuffer, KvLayout, KvMemory};
use turbine_tokens::Gguf;

use crate::config::LlamaConfig;
use crate::ops::{self, AttentionShape, Rope, SeqSpan};
use crate::pool::ThreadPool;
use crate::weights::{Matrix, WeightType};
use crate::{Error, Result};

/// The weights of one transformer block.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection.
    pub wq: Matrix,
    /// Key projection.
    pub wk: Matrix,
    /// Value projection.
    pub wv: Matrix,
    /// Attention output projection.
    pub wo: Matrix,
    /// RMSNorm before the feed-forward.
    pub ffn_norm: Vec<f32>,
    /// SwiGLU gate projection.
    pub gate: Matrix,
    /// SwiGLU up projection.
    pub up: Matrix,
    /// Feed-forward down projection.
    pub down: Matrix,
}

/// A loaded Llama-family model (weights memory-mapped from the GGUF file).
pub struct LlamaModel {
    config: LlamaConfig,
    embeddings: Matrix,
    layers: Vec<LayerWeights>,
    norm: Vec<f32>,
    lm_head: Matrix,
    rope: Rope,
    weight_bytes: usize,
}

impl std::fmt::Debug for LlamaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModel").field("config", &self.config).field("weight_bytes", &self.weight_bytes).finish()
    }
}

/// The KV cache of every layer in one page-aligned buffer, block-major so
/// that a block is one contiguous span (one read when it moves to another
/// worker): block `b` holds, for each layer in order, the keys then the
/// values of its `block_size` tokens, each token `kv_heads × head_dim` f16
/// values.
#[derive(Debug)]
pub struct KvCache {
    buffer: Arc<KvBuffer>,
    block_size: usize,
    num_blocks: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// The layout of one block of a pool both backends keep (the kernels'
/// `KvCache`, candle's `CandleCache`): for each layer, the keys then the
/// values of its `block_size` tokens, `kv_heads × head_dim` f16 each.
pub(crate) fn block_layout(block_size: usize, layers: usize, kv_heads: usize, head_dim: usize) -> KvLayout {
    KvLayout {
        block_bytes: layers * 2 * block_size * kv_heads * head_dim * std::mem::size_of::<f16>(),
        block_size,
        layers,
        kv_heads,
        head_dim,
        dtype: "f16".into(),
        order: "layer,kv,token,head,dim".into(),
    }
}

#[allow(unsafe_code)]
impl KvCache {
    /// A zeroed cache of `num_blocks` blocks of `block_size` tokens, its
    /// memory from `allocator` (the heap without one).
    pub fn new(config: &LlamaConfig, num_blocks: usize, block_size: usize, allocator: Option<&KvAllocator>) -> Self {
        let block_values = config.layers * 2 * block_size * config.kv_heads * config.head_dim;
        let bytes = num_blocks * block_values * std::mem::size_of::<f16>();
        let buffer = allocator.map_or_else(|| KvBuffer::zeroed(bytes), |allocator| allocator.allocate(bytes));
        assert!(buffer.len() >= bytes, "the KV allocator returned {} bytes for a pool of {bytes}", buffer.len());
        let buffer = Arc::new(buffer);
        Self { buffer, block_size, num_blocks, layers: config.layers, kv_heads: config.kv_heads, head_dim: config.head_dim }
    }

    /// f16 values of one layer's keys (or values) in one block.
    fn half(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim
    }

    /// f16 values from one block to the next.
    fn block_stride(&self) -> usize {
        self.layers * 2 * self.half()
    }

    /// Offset of a layer's keys (`kv` 0) or values (`kv` 1) in block 0.
    fn layer_offset(&self, layer: usize, kv: usize) -> usize {
        (layer * 2 + kv) * self.half()
    }

    /// The whole cache as values.
    fn values(&self) -> &[f16] {
        // SAFETY: the buffer holds `num_blocks × block_stride` f16 values
        // (page-aligned, so aligned for f16). Other threads only read
        // pinned blocks, which the engine does not write (see
        // turbine_engine::kv_memory), and this thread writes only through
        // `slot_mut`, never while this borrow lives (it borrows `self`).
        unsafe { std::slice::from_raw_parts(self.buffer.as_ptr() as *const f16, self.num_blocks * self.block_stride()) }
    }

    /// The `kv_heads × head_dim` values of one token's keys (`kv` 0) or
    /// values (`kv` 1) in a layer; `slot` is `block × block_size + offset`.
    fn slot_mut(&mut self, layer: usize, kv: usize, slot: usize) -> &mut [f16] {
        let width = self.kv_heads * self.head_dim;
        let (block, offset) = (slot / self.block_size, slot % self.block_size);
        assert!(block < self.num_blocks, "slot outside the cache");
        let at = block * self.block_stride() + self.layer_offset(layer, kv) + offset * width;
        // SAFETY: in bounds (the block is checked); the slot belongs to a
        // sequence being computed, so no pinned block and no other borrow
        // covers it (`&mut self`).
        unsafe { std::slice::from_raw_parts_mut((self.buffer.as_ptr() as *mut f16).add(at), width) }
    }

    /// The cache as transfers see it.
    pub fn memory(&self) -> KvMemory {
        KvMemory::new(self.buffer.clone(), block_layout(self.block_size, self.layers, self.kv_heads, self.head_dim), self.num_blocks)
    }

    /// Overwrites a block with bytes laid out as [`memory`](Self::memory)
    /// describes.
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<()> {
        let block_bytes = self.block_stride() * std::mem::size_of::<f16>();
        if bytes.len() != block_bytes {
            return Err(Error::Model(format!("a KV block is {block_bytes} bytes, got {}", bytes.len())));
        }
        if block as usize >= self.num_blocks {
            return Err(Error::Model(format!("block {block} is outside the cache")));
        }
        // SAFETY: in bounds; the block was just allocated for this install,
        // so nothing else reads or writes it (`&mut self`).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.buffer.as_ptr().add(block as usize * block_bytes), block_bytes) };
        Ok(())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

/// One sequence's rows in a forward batch.
#[derive(Debug, Clone)]
pub struct SequenceRows<'a> {
    /// Tokens computed this step.
    pub tokens: &'a [u32],
    /// Position of the first of them.
    pub first_position: usize,
    /// The sequence's block table (covers every position computed).
    pub block_table: &'a [u32],
    /// Whether logits are needed for the last row.
    pub needs_logits: bool,
}

impl LlamaModel {
    /// Maps a GGUF file and checks it is a supported model.
    pub fn load(path: &Path) -> Result<Self> {
        let gguf = Gguf::open(path)?;
        let config = LlamaConfig::from_gguf(&gguf)?;
        let file = std::fs::File::open(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        // SAFETY: the file is opened read-only and mapped privately; the
        // engine never writes to it. Another process truncating it while it
        // is mapped would fault, as with any mmap-based model loader.
        #[allow(unsafe_code)]
        let mmap = Arc::new(unsafe { Mmap::map(&file) }.map_err(|source| Error::Io { path: path.to_owned(), source })?);
        let tensors: std::collections::HashMap<&str, &turbine_tokens::gguf::TensorInfo> = gguf.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut weight_bytes = 0;
        let mut matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
            let info = tensors.get(name).ok_or_else(|| Error::Model(format!("missing tensor {name}")))?;
            let dims: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
            let expected = if rows == 1 { vec![cols] } else { vec![cols, rows] };
            if dims != expected {
                return Err(Error::Model(format!("tensor {name} has shape {dims:?}, expected {expected:?}")));
            }
            let kind = WeightType::from_ggml(info.ggml_type, name)?;
            let offset = (gguf.data_offset + info.offset) as usize;
            let matrix = Matrix::new(mmap.clone(), offset, rows, cols, kind, name)?;
            weight_bytes += matrix.size_bytes();
            Ok(matrix)
        };
        let vector = |matrix: Matrix| {
            let mut values = vec![0f32; matrix.cols];
            matrix.row_into(0, &mut values);
            values
        };
        let c = &config;
        let q_width = c.heads * c.head_dim;
        let kv_width = c.kv_heads * c.head_dim;
        let embeddings = matrix("token_embd.weight", c.vocab, c.hidden)?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let name = |suffix: &str| format!("blk.{i}.{suffix}.weight");
            layers.push(LayerWeights {
                attn_norm: vector(matrix(&name("attn_norm"), 1, c.hidden)?),
                wq: matrix(&name("attn_q"), q_width, c.hidden)?,
                wk: matrix(&name("attn_k"), kv_width, c.hidden)?,
                wv: matrix(&name("attn_v"), kv_width, c.hidden)?,
                wo: matrix(&name("attn_output"), c.hidden, q_width)?,
                ffn_norm: vector(matrix(&name("ffn_norm"), 1, c.hidden)?),
                gate: matrix(&name("ffn_gate"), c.ffn, c.hidden)?,
                up: matrix(&name("ffn_up"), c.ffn, c.hidden)?,
                down: matrix(&name("ffn_down"), c.hidden, c.ffn)?,
            });
        }
        let norm = vector(matrix("output_norm.weight", 1, c.hidden)?);
        // Tied embeddings: no output.weight, the embedding matrix is the head.
        let lm_head = if tensors.contains_key("output.weight") { matrix("output.weight", c.vocab, c.hidden)? } else { embeddings.clone() };
        if tensors.contains_key("rope_freqs.weight") {
            return Err(Error::Unsupported("per-frequency RoPE scaling (rope_freqs.weight, Llama 3.1 style) is not supported yet".into()));
        }
        let rope = Rope::new(c.rope_dims, c.rope_theta, c.rope_linear_scale, c.context_length);
        Ok(Self { config, embeddings, layers, norm, lm_head, rope, weight_bytes })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Bytes of weights (mapped from the file).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Token embeddings (`vocab × hidden`).
    pub fn embeddings(&self) -> &Matrix {
        &self.embeddings
    }

    /// The transformer blocks.
    pub fn layers(&self) -> &[LayerWeights] {
        &self.layers
    }

    /// The final RMSNorm weights.
    pub fn output_norm(&self) -> &[f32] {
        &self.norm
    }

    /// The output head (`vocab × hidden`; the embeddings when tied).
    pub fn lm_head(&self) -> &Matrix {
        &self.lm_head
    }

    /// The rotary embedding tables.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Computes one step: writes the keys and values of every row into the
    /// cache and returns the logits (`vocab` values each) of the sequences
    /// that need them, in order.
    pub fn forward(&self, sequences: &[SequenceRows<'_>], cache: &mut KvCache, pool: &ThreadPool) -> Result<Vec<f32>> {
        let c = &self.config;
        let rows: usize = sequences.iter().map(|s| s.tokens.len()).sum();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let (hidden, q_width, kv_width) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut spans = Vec::with_capacity(sequences.len());
        let mut positions = Vec::with_capacity(rows);
        let mut slots = Vec::with_capacity(rows);
        let mut start = 0;
        for sequence in sequences {
            let len = sequence.tokens.len();
            let last = sequence.first_position + len;
            if last > self.rope.max_positions() {
                return Err(Error::Model(format!("position {last} exceeds the context length {}", self.rope.max_positions())));
            }
            if last.div_ceil(cache.block_size) > sequence.block_table.len() {
                return Err(Error::Model("block table too short for the positions computed".into()));
            }
            for position in sequence.first_position..last {
                positions.push(position);
                let block = sequence.block_table[position / cache.block_size] as usize;
                if block >= cache.num_blocks {
                    return Err(Error::Model(format!("block {block} is outside the cache")));
                }
                slots.push(block * cache.block_size + position % cache.block_size);
            }
            spans.push(SeqSpan { rows: start..start + len, first_position: sequence.first_position, block_table: sequence.block_table });
            start += len;
        }

        let mut x = vec![0f32; rows * hidden];
        for (row, token) in sequences.iter().flat_map(|s| s.tokens).enumerate() {
            if *token as usize >= c.vocab {
                return Err(Error::Model(format!("token {token} is outside the vocabulary")));
            }
            self.embeddings.row_into(*token as usize, &mut x[row * hidden..(row + 1) * hidden]);
        }
        let mut h = vec![0f32; rows * hidden];
        let mut q = vec![0f32; rows * q_width];
        let mut k = vec![0f32; rows * kv_width];
        let mut v = vec![0f32; rows * kv_width];
        let mut attention = vec![0f32; rows * q_width];
        let mut projected = vec![0f32; rows * hidden];
        let mut gate = vec![0f32; rows * c.ffn];
        let mut up = vec![0f32; rows * c.ffn];
        let shape =
            AttentionShape { heads: c.heads, kv_heads: c.kv_heads, head_dim: c.head_dim, block_size: cache.block_size, block_stride: cache.block_stride() };

        for (index, layer) in self.layers.iter().enumerate() {
            ops::rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            Matrix::matmul_fused(&mut [(&layer.wq, &mut q), (&layer.wk, &mut k), (&layer.wv, &mut v)], &h, rows, pool);
            for (row, &position) in positions.iter().enumerate() {
                self.rope.apply(&mut q[row * q_width..(row + 1) * q_width], c.head_dim, position);
                self.rope.apply(&mut k[row * kv_width..(row + 1) * kv_width], c.head_dim, position);
            }
            for (row, &slot) in slots.iter().enumerate() {
                ops::to_f16(&k[row * kv_width..(row + 1) * kv_width], cache.slot_mut(index, 0, slot));
                ops::to_f16(&v[row * kv_width..(row + 1) * kv_width], cache.slot_mut(index, 1, slot));
            }
            let all = cache.values();
            let (keys, values) = (&all[cache.layer_offset(index, 0)..], &all[cache.layer_offset(index, 1)..]);
            ops::paged_attention(&q, keys, values, &spans, shape, &mut attention, pool);
            layer.wo.matmul(&attention, rows, &mut projected, pool);
            x.iter_mut().zip(&projected).for_each(|(x, p)| *x += p);

            ops::rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            Matrix::matmul_fused(&mut [(&layer.gate, &mut gate), (&layer.up, &mut up)], &h, rows, pool);
            ops::silu_mul(&mut gate, &up);
            layer.down.matmul(&gate, rows, &mut projected, pool);
            x.iter_mut().zip(&projected).for_each(|(x, p)| *x += p);
        }

        // Final norm and head, only for the last row of sequences that sample.
        let sampled_rows: Vec<usize> = spans.iter().zip(sequences).filter(|(_, s)| s.needs_logits).map(|(span, _)| span.rows.end - 1).collect();
        let mut last = vec![0f32; sampled_rows.len() * hidden];
        for (i, &row) in sampled_rows.iter().enumerate() {
            last[i * hidden..(i + 1) * hidden].copy_from_slice(&x[row * hidden..(row + 1) * hidden]);
        }
        let mut normed = vec![0f32; last.len()];
        ops::rms_norm(&last, &self.norm, c.rms_eps, &mut normed);
        let mut logits = vec![0f32; sampled_rows.len() * c.vocab];
        self.lm_head.matmul(&normed, sampled_rows.len(), &mut logits, pool);
        Ok(logits)
    }
}
