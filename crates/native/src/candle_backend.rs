//! The same Llama forward pass over the same paged KV cache layout, written
//! in candle tensor operations so that it runs on any candle device: CUDA
//! GPUs (the `cuda` feature) and, to check it against the CPU kernels, the
//! CPU.
//!
//! Layout and semantics mirror [`crate::model`]: a batch is a flat list of
//! token rows from several sequences; keys and values live in one
//! block-major pool, byte for byte the CPU kernels' layout (block `b` holds,
//! for each layer, the keys then the values of its `block_size` tokens,
//! `kv_heads × head_dim` f16 values each), so a block moves between workers
//! as one span whichever backend computed it. A slot is `block *
//! block_size + offset`; a step writes every row's key and value into its
//! slot, then each sequence attends over its positions gathered through
//! its block table. Logits come back to the host only for the rows that
//! sample.

use std::path::Path;

use std::sync::Arc;

use candle_core::quantized::{QMatMul, gguf_file};
use candle_core::{CpuStorage, D, DType, Device, Module, Storage, Tensor};
use turbine_engine::{KvBuffer, KvMemory};

use crate::config::LlamaConfig;
use crate::model::{SequenceRows, block_layout};
use crate::ops::Rope;
use crate::{Error, Result};

impl From<candle_core::Error> for Error {
    fn from(error: candle_core::Error) -> Self {
        Error::Device(error.to_string())
    }
}

struct CandleLayer {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// A Llama-family model held as candle tensors on a device.
pub struct CandleModel {
    config: LlamaConfig,
    device: Device,
    embeddings: Tensor,
    layers: Vec<CandleLayer>,
    norm: Tensor,
    lm_head: QMatMul,
    /// RoPE tables, `max_positions × rope_dims / 2`.
    cos: Tensor,
    sin: Tensor,
}

impl std::fmt::Debug for CandleModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleModel").field("config", &self.config).field("device", &self.device).finish_non_exhaustive()
    }
}

/// The paged KV cache on the model's device: one tensor of rows of
/// `kv_heads · head_dim` f16 values, block-major (see the module docs): the
/// key (`kv` 0) or value (`kv` 1) of slot `block · block_size + offset` in
/// `layer` is row `((block · layers + layer) · 2 + kv) · block_size +
/// offset`.
#[derive(Debug)]
pub struct CandleCache {
    pool: Tensor,
    block_size: usize,
    num_blocks: usize,
    layers: usize,
}

impl CandleCache {
    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Rows from one block to the next.
    fn block_rows(&self) -> usize {
        self.layers * 2 * self.block_size
    }

    /// The row of a slot's layer-0 key; layer `l`'s key (value) is
    /// `(2l) · block_size` (`(2l + 1) · block_size`) rows further.
    fn base_row(&self, slot: u32) -> u32 {
        let block_size = self.block_size as u32;
        (slot / block_size) * self.block_rows() as u32 + slot % block_size
    }

    /// Rows of `layer`'s keys (`kv` 0) or values (`kv` 1) for slots whose
    /// base rows are `base`.
    fn rows(&self, base: &Tensor, layer: usize, kv: usize) -> candle_core::Result<Tensor> {
        base.affine(1.0, ((layer * 2 + kv) * self.block_size) as f64)
    }

    /// The pool as transfers see it: its host memory on the CPU device,
    /// its device memory on a GPU (`cuda` feature); `None` elsewhere.
    pub fn memory(&self, config: &LlamaConfig) -> Option<KvMemory> {
        let layout = block_layout(self.block_size, self.layers, config.kv_heads, config.head_dim);
        let block_bytes = layout.block_bytes;
        #[cfg(feature = "cuda")]
        if let Some(device) = cuda_pool::CudaPool::new(&self.pool, config.kv_heads * config.head_dim) {
            return Some(KvMemory::on_device(Arc::new(device), layout, self.num_blocks));
        }
        let pointer = {
            let (storage, storage_layout) = self.pool.storage_and_layout();
            match &*storage {
                Storage::Cpu(CpuStorage::F16(values)) if storage_layout.start_offset() == 0 && storage_layout.is_contiguous() => values.as_ptr() as *mut u8,
                _ => return None,
            }
        };
        let pointer = std::ptr::NonNull::new(pointer)?;
        // SAFETY: the tensor's storage holds `num_blocks · block_bytes`
        // bytes that stay where they are (candle writes the pool in place:
        // `scatter_set`, `slice_set`) while the clone given as owner keeps
        // the storage alive. Only the engine writes the pool, under the
        // pinning rule of turbine_engine::kv_memory. A Vec's data is not
        // page-aligned, which KvBuffer asks of memory it registers; it is
        // aligned for f16, and the transfers only need that.
        #[allow(unsafe_code)]
        let buffer = unsafe { KvBuffer::provided(pointer, self.num_blocks * block_bytes, Box::new(self.pool.clone())) };
        Some(KvMemory::new(Arc::new(buffer), layout, self.num_blocks))
    }

    /// Overwrites a block with bytes laid out as [`memory`](Self::memory)
    /// describes (copied to the device).
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<()> {
        let (rows, width) = (self.block_rows(), self.pool.dim(1)?);
        let block_bytes = rows * width * std::mem::size_of::<half::f16>();
        if bytes.len() != block_bytes {
            return Err(Error::Model(format!("a KV block is {block_bytes} bytes, got {}", bytes.len())));
        }
        if block as usize >= self.num_blocks {
            return Err(Error::Model(format!("block {block} is outside the cache")));
        }
        let source = Tensor::from_raw_buffer(bytes, DType::F16, &[rows, width], self.pool.device())?;
        self.pool.slice_set(&source, 0, block as usize * rows)?;
        Ok(())
    }
}

impl CandleModel {
    /// Loads the GGUF file's weights onto `device` (the caller has checked
    /// the file with [`LlamaConfig::from_gguf`]).
    pub fn load(path: &Path, config: LlamaConfig, device: Device) -> Result<Self> {
        let io = |source| Error::Io { path: path.to_owned(), source };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let content = gguf_file::Content::read(&mut file).map_err(|error| Error::Model(error.to_string()))?;
        let mut tensor = |name: &str| content.tensor(&mut file, name, &device).map_err(|error| Error::Model(format!("{name}: {error}")));
        let c = &config;
        let embeddings = tensor("token_embd.weight")?.dequantize(&device)?;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let mut matmul = |suffix: &str| -> Result<QMatMul> { Ok(QMatMul::from_qtensor(tensor(&format!("blk.{i}.{suffix}.weight"))?)?) };
            let layer = CandleLayer {
                wq: matmul("attn_q")?,
                wk: matmul("attn_k")?,
                wv: matmul("attn_v")?,
                wo: matmul("attn_output")?,
                gate: matmul("ffn_gate")?,
                up: matmul("ffn_up")?,
                down: matmul("ffn_down")?,
                attn_norm: tensor(&format!("blk.{i}.attn_norm.weight"))?.dequantize(&device)?,
                ffn_norm: tensor(&format!("blk.{i}.ffn_norm.weight"))?.dequantize(&device)?,
            };
            layers.push(layer);
        }
        let norm = tensor("output_norm.weight")?.dequantize(&device)?;
        // Tied embeddings: no output.weight, the embedding matrix is the head.
        let head_name = if content.tensor_infos.contains_key("output.weight") { "output.weight" } else { "token_embd.weight" };
        let lm_head = QMatMul::from_qtensor(tensor(head_name)?)?;
        let rope = Rope::new(c.rope_dims, c.rope_theta, c.rope_linear_scale, c.context_length);
        let (cos, sin) = rope.tables();
        let half = c.rope_dims / 2;
        let positions = cos.len() / half.max(1);
        let cos = Tensor::from_slice(cos, (positions, half), &device)?;
        let sin = Tensor::from_slice(sin, (positions, half), &device)?;
        Ok(Self { config, device, embeddings, layers, norm, lm_head, cos, sin })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the model lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A zeroed paged cache of `num_blocks` blocks of `block_size` tokens on
    /// the model's device.
    pub fn new_cache(&self, num_blocks: usize, block_size: usize) -> Result<CandleCache> {
        let c = &self.config;
        let shape = (num_blocks * c.layers * 2 * block_size, c.kv_heads * c.head_dim);
        Ok(CandleCache { pool: Tensor::zeros(shape, DType::F16, &self.device)?, block_size, num_blocks, layers: c.layers })
    }

    /// Rotates `x` (`rows × heads·head_dim`) by its rows' positions (`cos`
    /// and `sin` already gathered per row).
    fn rope(&self, x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let rows = x.dim(0)?;
        // (rows, heads, head_dim) -> (1, heads, rows, head_dim), as rope_i wants.
        let x = x.reshape((rows, heads, c.head_dim))?.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        let rotated = if c.rope_dims == c.head_dim {
            candle_nn::rotary_emb::rope_i(&x, cos, sin)?
        } else {
            let head = x.narrow(D::Minus1, 0, c.rope_dims)?.contiguous()?;
            let tail = x.narrow(D::Minus1, c.rope_dims, c.head_dim - c.rope_dims)?;
            Tensor::cat(&[candle_nn::rotary_emb::rope_i(&head, cos, sin)?, tail], D::Minus1)?
        };
        Ok(rotated.squeeze(0)?.transpose(0, 1)?.reshape((rows, heads * c.head_dim))?)
    }

    /// Computes one step: writes the keys and values of every row into the
    /// cache and returns the logits (`vocab` values each) of the sequences
    /// that need them, in order. Same contract as [`crate::LlamaModel::forward`].
    pub fn forward(&self, sequences: &[SequenceRows<'_>], cache: &mut CandleCache) -> Result<Vec<f32>> {
        let c = &self.config;
        let block_size = cache.block_size;
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let slot = |table: &[u32], position: usize| -> Result<u32> {
            let block = table.get(position / block_size).ok_or_else(|| Error::Config(format!("position {position} is beyond the block table")))?;
            Ok(block * block_size as u32 + (position % block_size) as u32)
        };
        for sequence in sequences {
            for (i, &token) in sequence.tokens.iter().enumerate() {
                let position = sequence.first_position + i;
                if token as usize >= c.vocab {
                    return Err(Error::Config(format!("token id {token} is outside the vocabulary")));
                }
                tokens.push(token);
                positions.push(position as u32);
                slots.push(slot(sequence.block_table, position)?);
            }
        }
        let rows = tokens.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        if positions.iter().any(|&p| p as usize >= self.cos.dim(0).unwrap_or(0)) {
            return Err(Error::Config("a position is beyond the model's context length".into()));
        }
        let device = &self.device;
        let positions = Tensor::from_vec(positions, rows, device)?;
        let (cos, sin) = (self.cos.index_select(&positions, 0)?.contiguous()?, self.sin.index_select(&positions, 0)?.contiguous()?);
        let kv_width = c.kv_heads * c.head_dim;
        let write_base = Tensor::from_vec(slots.iter().map(|&slot| cache.base_row(slot)).collect::<Vec<u32>>(), rows, device)?;
        // Each sequence's slots for every position it attends to, and its causal mask.
        let mut attention = Vec::with_capacity(sequences.len());
        for sequence in sequences.iter().filter(|s| !s.tokens.is_empty()) {
            let end = sequence.first_position + sequence.tokens.len();
            let slots = (0..end).map(|position| slot(sequence.block_table, position)).collect::<Result<Vec<u32>>>()?;
            let mask: Vec<f32> = (0..sequence.tokens.len())
                .flat_map(|i| (0..end).map(move |j| if j <= sequence.first_position + i { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let base: Vec<u32> = slots.iter().map(|&slot| cache.base_row(slot)).collect();
            attention.push((sequence.tokens.len(), Tensor::from_vec(base, end, device)?, Tensor::from_vec(mask, (sequence.tokens.len(), end), device)?));
        }

        let ids = Tensor::from_vec(tokens, rows, device)?;
        let mut x = self.embeddings.index_select(&ids, 0)?;
        let group = c.heads / c.kv_heads;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let pool = &cache.pool;
        for (index, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
            let q = self.rope(&layer.wq.forward(&h)?, c.heads, &cos, &sin)?;
            let k = self.rope(&layer.wk.forward(&h)?, c.kv_heads, &cos, &sin)?;
            let v = layer.wv.forward(&h)?;
            for (kv, written) in [(0, &k), (1, &v)] {
                let at = cache.rows(&write_base, index, kv)?.reshape((rows, 1))?.broadcast_as((rows, kv_width))?.contiguous()?;
                pool.scatter_set(&at, &written.to_dtype(DType::F16)?.contiguous()?, 0)?;
            }

            let mut outputs = Vec::with_capacity(attention.len());
            let mut offset = 0;
            for (n, base, mask) in &attention {
                let len = base.dim(0)?;
                let gather = |kv: usize| -> candle_core::Result<Tensor> {
                    let rows = cache.rows(base, index, kv)?;
                    pool.index_select(&rows, 0)?.to_dtype(DType::F32)?.reshape((len, c.kv_heads, c.head_dim))?.transpose(0, 1)?.contiguous()
                };
                let (k, v) = (gather(0)?, gather(1)?);
                // Heads sharing a KV head are consecutive: fold them into rows.
                let q =
                    q.narrow(0, offset, *n)?.reshape((*n, c.heads, c.head_dim))?.transpose(0, 1)?.contiguous()?.reshape((c.kv_heads, group * n, c.head_dim))?;
                let scores = (q.matmul(&k.t()?)? * scale)?.reshape((c.kv_heads, group, *n, len))?.broadcast_add(mask)?;
                let probabilities = candle_nn::ops::softmax_last_dim(&scores)?.reshape((c.kv_heads, group * n, len))?;
                let out = probabilities.matmul(&v)?.reshape((c.heads, *n, c.head_dim))?.transpose(0, 1)?.reshape((*n, c.heads * c.head_dim))?;
                outputs.push(out);
                offset += n;
            }
            let attended = Tensor::cat(&outputs, 0)?;
            x = (x + layer.wo.forward(&attended)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
            let mixed = (candle_nn::ops::silu(&layer.gate.forward(&h)?)? * layer.up.forward(&h)?)?;
            x = (x + layer.down.forward(&mixed)?)?;
        }

        let mut last_rows = Vec::new();
        let mut offset = 0u32;
        for sequence in sequences {
            offset += sequence.tokens.len() as u32;
            if sequence.needs_logits && !sequence.tokens.is_empty() {
                last_rows.push(offset - 1);
            }
        }
        if last_rows.is_empty() {
            return Ok(Vec::new());
        }
        let count = last_rows.len();
        let last = x.index_select(&Tensor::from_vec(last_rows, count, device)?, 0)?;
        let logits = self.lm_head.forward(&candle_nn::ops::rms_norm(&last, &self.norm, c.rms_eps)?)?;
        Ok(logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }
}

/// A pool in CUDA device memory, as transfers see it.
#[cfg(feature = "cuda")]
mod cuda_pool {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::{DeviceLocation, Storage, Tensor};
    use turbine_engine::{DeviceKv, DeviceMemory, DeviceReadError};

    /// The pool tensor (kept alive: peers read its memory) and where its
    /// memory is.
    #[derive(Debug)]
    pub struct CudaPool {
        pool: Tensor,
        address: u64,
        len: usize,
        row_bytes: usize,
        ordinal: usize,
    }

    impl CudaPool {
        /// The device memory of `pool` (rows of `width` f16 values), when
        /// it is one CUDA allocation.
        pub fn new(pool: &Tensor, width: usize) -> Option<Self> {
            let DeviceLocation::Cuda { gpu_id } = pool.device().location() else { return None };
            let address = {
                let (storage, layout) = pool.storage_and_layout();
                let Storage::Cuda(storage) = &*storage else { return None };
                if layout.start_offset() != 0 || !layout.is_contiguous() {
                    return None;
                }
                let slice = storage.as_cuda_slice::<half::f16>().ok()?;
                let stream = storage.device.cuda_stream();
                let (pointer, _synced) = slice.device_ptr(&stream);
                pointer
            };
            let row_bytes = width * std::mem::size_of::<half::f16>();
            Some(Self { pool: pool.clone(), address, len: pool.dim(0).ok()? * row_bytes, row_bytes, ordinal: gpu_id })
        }
    }

    impl DeviceKv for CudaPool {
        fn address(&self) -> u64 {
            self.address
        }

        fn len(&self) -> usize {
            self.len
        }

        fn kind(&self) -> DeviceMemory {
            DeviceMemory::Cuda(self.ordinal)
        }

        fn read(&self, offset: usize, into: &mut [u8]) -> Result<(), DeviceReadError> {
            if !offset.is_multiple_of(self.row_bytes) || !into.len().is_multiple_of(self.row_bytes) || offset + into.len() > self.len {
                return Err(DeviceReadError::OutOfRange { offset, end: offset + into.len(), len: self.len });
            }
            let copy = |error: candle_core::Error| DeviceReadError::Copy(error.to_string());
            let rows = self.pool.narrow(0, offset / self.row_bytes, into.len() / self.row_bytes).map_err(copy)?;
            let values: Vec<half::f16> = rows.flatten_all().and_then(|rows| rows.to_vec1()).map_err(copy)?;
            for (bytes, value) in into.chunks_exact_mut(2).zip(values) {
                bytes.copy_from_slice(&value.to_le_bytes());
            }
            Ok(())
        }
    }
}
