//! The native model as an engine executor: turns a scheduler batch into a
//! forward pass over the paged cache, then samples.

use std::path::Path;
use std::sync::Arc;

use turbine_engine::{Batch, Executor, Sampled};

use crate::model::{KvCache, LlamaModel, SequenceRows};
use crate::pool::ThreadPool;
use crate::sampling::sample;
use crate::{Error, Result};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// This machine's CPU cores.
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(ordinal)) => Ok(Device::Cuda(ordinal)),
                _ => Err(format!("unknown device {other:?} (cpu, cuda, cuda:N)")),
            },
        }
    }
}

/// How to size and run the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct NativeOptions {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size in MiB (used when `kv_blocks` is unset).
    pub kv_cache_mib: usize,
    /// KV pool size in blocks (overrides `kv_cache_mib`).
    pub kv_blocks: Option<usize>,
    /// Threads for the kernels.
    pub threads: usize,
    /// Where to run.
    pub device: Device,
}

impl Default for NativeOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_mib: 512,
            kv_blocks: None,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            device: Device::Cpu,
        }
    }
}

/// The native engine's executor.
#[derive(Debug)]
pub struct NativeExecutor {
    model: Arc<LlamaModel>,
    cache: KvCache,
    pool: ThreadPool,
}

impl NativeExecutor {
    /// Loads the model and allocates the KV pool.
    pub fn load(path: &Path, options: &NativeOptions) -> Result<Self> {
        check_device(options.device)?;
        if options.block_size == 0 {
            return Err(Error::Config("block_size must be positive".into()));
        }
        let model = LlamaModel::load(path)?;
        let bytes_per_block = model.config().kv_bytes_per_token() * options.block_size;
        let num_blocks = options.kv_blocks.unwrap_or(options.kv_cache_mib * (1 << 20) / bytes_per_block);
        if num_blocks == 0 {
            return Err(Error::Config(format!(
                "a {} MiB KV cache holds no block of {} tokens ({} KiB each); raise --kv-cache-mib",
                options.kv_cache_mib,
                options.block_size,
                bytes_per_block / 1024
            )));
        }
        let cache = KvCache::new(model.config(), num_blocks, options.block_size);
        tracing::info!(
            weights_mib = model.weight_bytes() >> 20,
            kv_blocks = num_blocks,
            kv_mib = (num_blocks * bytes_per_block) >> 20,
            threads = options.threads,
            "native model loaded"
        );
        Ok(Self { model: Arc::new(model), cache, pool: ThreadPool::new(options.threads) })
    }

    /// The model.
    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    /// Blocks in the KV pool.
    pub fn num_blocks(&self) -> usize {
        self.cache.num_blocks()
    }
}

/// Refuses devices this build or machine cannot use, with a clear error
/// (never a panic: without a driver, CUDA initialisation would abort).
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => cuda_available(ordinal),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_available(_ordinal: usize) -> Result<()> {
    Err(Error::Config("this build has no CUDA support; rebuild with `--features cuda` or use --device cpu".into()))
}

#[cfg(feature = "cuda")]
fn cuda_available(_ordinal: usize) -> Result<()> {
    if !candle_core::utils::cuda_is_available() {
        return Err(Error::Config("CUDA requested but candle was built without CUDA".into()));
    }
    Err(Error::Config(
        "the native engine runs on CPU in this version; --device cuda is not wired to the paged engine yet".into(),
    ))
}

impl Executor for NativeExecutor {
    fn execute(&mut self, batch: &Batch<'_>) -> std::result::Result<Vec<Option<Sampled>>, String> {
        let sequences: Vec<SequenceRows<'_>> = batch
            .items
            .iter()
            .map(|item| SequenceRows {
                tokens: &item.tokens[item.start..item.start + item.len],
                first_position: item.start,
                block_table: item.block_table,
                needs_logits: item.sample,
            })
            .collect();
        let mut logits = self.model.forward(&sequences, &mut self.cache, &self.pool).map_err(|error| error.to_string())?;
        let vocab = self.model.config().vocab;
        let mut rows = logits.chunks_exact_mut(vocab);
        Ok(batch
            .items
            .iter()
            .map(|item| {
                if !item.sample {
                    return None;
                }
                let row = rows.next().expect("one logits row per sampling item");
                let choice = sample(row, item.sampling, item.tokens, item.generated);
                Some(Sampled { token: choice.token, logprobs: choice.logprobs })
            })
            .collect())
    }
}
