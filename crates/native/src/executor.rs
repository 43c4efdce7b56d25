//! The native model as an engine executor: turns a scheduler batch into a
//! forward pass over the paged cache, then samples.

use std::path::Path;
use std::sync::Arc;

use turbine_engine::{Batch, Executor, ExecutorError, KvAllocator, KvMemory, OutputFormat, Sampled, SeqId};
use turbine_tokens::Gguf;

use crate::candle_backend::{CandleCache, CandleModel};
use crate::config::LlamaConfig;
use crate::model::{KvCache, LlamaModel, SequenceRows};
use crate::pool::ThreadPool;
use crate::sampling::{OutputTrack, OutputVocabulary, sample_tracked};
use crate::{Error, Result};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// This machine's CPU cores.
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

/// A device name that is neither `cpu`, `cuda` nor `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?} (cpu, cuda, cuda:N)")]
pub struct UnknownDevice(pub String);

impl std::str::FromStr for Device {
    type Err = UnknownDevice;

    fn from_str(text: &str) -> std::result::Result<Self, UnknownDevice> {
        match text {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(ordinal)) => Ok(Device::Cuda(ordinal)),
                _ => Err(UnknownDevice(other.to_owned())),
            },
        }
    }
}

/// Which implementation computes the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// The device's natural choice: this crate's kernels on the CPU, candle
    /// on CUDA.
    #[default]
    Auto,
    /// This crate's CPU kernels (fastest on CPU).
    Kernels,
    /// Candle tensor operations on the device (the CUDA path; on the CPU it
    /// checks that path against the kernels).
    Candle,
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
    /// Which implementation runs the forward pass.
    pub backend: Backend,
    /// Where the CPU KV pool's memory comes from (the heap when unset).
    pub kv_allocator: Option<KvAllocator>,
}

impl Default for NativeOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_mib: 512,
            kv_blocks: None,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            device: Device::Cpu,
            backend: Backend::Auto,
            kv_allocator: None,
        }
    }
}

/// The native engine's executor.
#[derive(Debug)]
pub struct NativeExecutor {
    config: LlamaConfig,
    compute: Compute,
    /// What constrained output reads of the vocabulary; without it, no
    /// output is constrained.
    vocabulary: Option<OutputVocabulary>,
    /// Each sequence's constrained output as read so far (kept while it is
    /// in the batch; one that leaves it is read again if it comes back).
    tracks: std::collections::HashMap<SeqId, OutputTrack>,
}

#[derive(Debug)]
enum Compute {
    Kernels { model: Arc<LlamaModel>, cache: KvCache, pool: ThreadPool },
    Candle { model: Box<CandleModel>, cache: CandleCache },
}

impl NativeExecutor {
    /// Loads the model and allocates the KV pool on the chosen device.
    pub fn load(path: &Path, options: &NativeOptions) -> Result<Self> {
        let device = open_device(options.device)?;
        if options.block_size == 0 {
            return Err(Error::Config("block_size must be positive".into()));
        }
        let config = LlamaConfig::from_gguf(&Gguf::open(path)?)?;
        let bytes_per_block = config.kv_bytes_per_token() * options.block_size;
        let num_blocks = options.kv_blocks.unwrap_or(options.kv_cache_mib * (1 << 20) / bytes_per_block);
        if num_blocks == 0 {
            return Err(Error::Config(format!(
                "a {} MiB KV cache holds no block of {} tokens ({} KiB each); raise --kv-cache-mib",
                options.kv_cache_mib,
                options.block_size,
                bytes_per_block / 1024
            )));
        }
        let backend = match (options.backend, options.device) {
            (Backend::Auto, Device::Cpu) => Backend::Kernels,
            (Backend::Auto, Device::Cuda(_)) => Backend::Candle,
            (Backend::Kernels, Device::Cuda(_)) => return Err(Error::Config("the CPU kernels cannot run on a CUDA device".into())),
            (backend, _) => backend,
        };
        let compute = match backend {
            Backend::Candle => {
                let model = CandleModel::load(path, config.clone(), device)?;
                let cache = model.new_cache(num_blocks, options.block_size)?;
                Compute::Candle { model: Box::new(model), cache }
            }
            Backend::Kernels | Backend::Auto => {
                let model = LlamaModel::load(path)?;
                let cache = KvCache::new(model.config(), num_blocks, options.block_size, options.kv_allocator.as_ref());
                tracing::info!(weights_mib = model.weight_bytes() >> 20, threads = options.threads, "native model mapped");
                Compute::Kernels { model: Arc::new(model), cache, pool: ThreadPool::new(options.threads) }
            }
        };
        tracing::info!(
            device = ?options.device,
            ?backend,
            kv_blocks = num_blocks,
            kv_mib = (num_blocks * bytes_per_block) >> 20,
            "native engine loaded"
        );
        Ok(Self { config, compute, vocabulary: None, tracks: Default::default() })
    }

    /// Constrains the output of requests that ask for a format
    /// ([`turbine_engine::OutputFormat`]) by this vocabulary (the model's).
    pub fn with_output_vocabulary(mut self, vocabulary: OutputVocabulary) -> Self {
        self.vocabulary = Some(vocabulary);
        self
    }

    /// Whether output may be constrained.
    pub fn constrains_output(&self) -> bool {
        self.vocabulary.is_some()
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The KV pool as transfers see it: host memory (the CPU kernels,
    /// candle on the CPU) or device memory (candle on a GPU).
    pub fn kv_memory(&self) -> Option<KvMemory> {
        match &self.compute {
            Compute::Kernels { cache, .. } => Some(cache.memory()),
            Compute::Candle { cache, .. } => cache.memory(&self.config),
        }
    }

    /// Blocks in the KV pool.
    pub fn num_blocks(&self) -> usize {
        match &self.compute {
            Compute::Kernels { cache, .. } => cache.num_blocks(),
            Compute::Candle { cache, .. } => cache.num_blocks(),
        }
    }
}

/// Refuses devices this build or machine cannot use, with a clear error
/// (never a panic: without a driver, CUDA initialisation would abort).
pub fn check_device(device: Device) -> Result<()> {
    open_device(device).map(drop)
}

/// The candle device for `device`, or a clear error.
fn open_device(device: Device) -> Result<candle_core::Device> {
    match device {
        Device::Cpu => Ok(candle_core::Device::Cpu),
        Device::Cuda(ordinal) => open_cuda(ordinal),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<candle_core::Device> {
    Err(Error::Device("this build has no CUDA support; rebuild with `--features cuda` or use --device cpu".into()))
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<candle_core::Device> {
    // The driver may be missing or have no such GPU; cudarc reports some of
    // these by panicking, so contain any panic and report it as an error.
    match std::panic::catch_unwind(|| candle_core::Device::new_cuda(ordinal)) {
        Ok(Ok(device)) => Ok(device),
        Ok(Err(error)) => Err(Error::Device(format!("cannot open CUDA device {ordinal}: {error}"))),
        Err(_) => Err(Error::Device(format!("cannot open CUDA device {ordinal}: no usable CUDA driver or GPU on this machine"))),
    }
}

impl Executor for NativeExecutor {
    fn execute(&mut self, batch: &Batch<'_>) -> std::result::Result<Vec<Option<Sampled>>, ExecutorError> {
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
        let logits = match &mut self.compute {
            Compute::Kernels { model, cache, pool } => model.forward(&sequences, cache, pool),
            Compute::Candle { model, cache } => model.forward(&sequences, cache),
        };
        let mut logits = logits.map_err(|error| ExecutorError::Compute(error.to_string()))?;
        let vocab = self.config.vocab;
        let mut rows = logits.chunks_exact_mut(vocab);
        let (vocabulary, tracks) = (self.vocabulary.as_ref(), &mut self.tracks);
        tracks.retain(|id, _| batch.items.iter().any(|item| item.seq_id == *id));
        Ok(batch
            .items
            .iter()
            .map(|item| {
                if !item.sample {
                    return None;
                }
                let row = rows.next().expect("one logits row per sampling item");
                let choice = match item.sampling.output {
                    OutputFormat::Text => sample_tracked(row, item.sampling, item.tokens, item.generated, vocabulary, &mut OutputTrack::default()),
                    _ => sample_tracked(row, item.sampling, item.tokens, item.generated, vocabulary, tracks.entry(item.seq_id).or_default()),
                };
                Some(Sampled { token: choice.token, logprobs: choice.logprobs })
            })
            .collect())
    }

    fn write_block(&mut self, block: u32, bytes: &[u8]) -> std::result::Result<(), ExecutorError> {
        match &mut self.compute {
            Compute::Kernels { cache, .. } => cache.write_block(block, bytes).map_err(|error| ExecutorError::Install(error.to_string())),
            Compute::Candle { cache, .. } => cache.write_block(block, bytes).map_err(|error| ExecutorError::Install(error.to_string())),
        }
    }
}
