//! A loaded worker: the served model's card and a running engine.

use std::sync::Arc;
use std::time::Duration;

use turbine_engine::mocker::{MOCK_TEXT, MockExecutor, MockTiming};
use turbine_engine::{EngineHandle, Executor, KvMemory, Load, SchedulerConfig};
use turbine_native::{Backend, NativeExecutor, NativeOptions};
use turbine_proto::worker::v1 as pb;
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Preprocessor};

use crate::config::{EngineKind, WorkerConfig, WorkerRole};
use crate::disagg::{Disagg, DisaggOptions, SharedKvPool, SimulatedTransfer};
use crate::convert::card_to_proto;

/// The mocker's pool unless configured (DESIGN §5: 16,384 blocks of 64 tokens).
const MOCK_NUM_BLOCKS: usize = 16_384;

/// A worker with its model loaded and its engine running.
#[derive(Debug)]
pub struct Worker {
    id: String,
    card: ModelCard,
    card_proto: pb::ModelCard,
    engine: EngineHandle,
    /// Random per start: KV event consumers detect a restart by it.
    instance: u64,
    /// Prefill handles and KV transfers.
    disagg: Arc<Disagg>,
}

impl Worker {
    /// Resolves (fetching if needed) and loads the model, then starts the
    /// engine. Blocking: call from a blocking context.
    pub fn start(config: &WorkerConfig) -> anyhow::Result<Arc<Self>> {
        let id = config.worker_id.clone().unwrap_or_else(|| format!("worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        let cache_dir = config.cache_dir.clone().unwrap_or_else(default_cache_dir);
        let model = resolve_model(&config.model, config.served_model_name.as_deref(), &cache_dir, Progress::Quiet)?;
        let block_size = config.block_size();
        let mut card = ModelCard::from_gguf_path(&model.name, &model.path, block_size as u32)?;
        if let Some(context_length) = config.context_length {
            card.context_length = context_length;
        }
        let pool = SharedKvPool::for_role(config.role, config.kv_transport);
        let (executor, num_blocks, memory): (Box<dyn Executor>, usize, Option<KvMemory>) = match config.engine {
            EngineKind::Native => {
                let options = NativeOptions {
                    block_size,
                    kv_cache_mib: config.kv_cache_mib,
                    kv_blocks: config.num_blocks,
                    threads: config.threads(),
                    device: config.device.parse().map_err(anyhow::Error::msg)?,
                    backend: Backend::Auto,
                    kv_allocator: pool.allocator(),
                };
                let executor = NativeExecutor::load(&model.path, &options)?;
                let num_blocks = executor.num_blocks();
                let memory = executor.kv_memory();
                (Box::new(executor), num_blocks, memory)
            }
            EngineKind::Mock => {
                // The mocker speaks the served model's vocabulary: tokenize its text once.
                let preprocessor = Preprocessor::new(card.clone())?;
                let corpus = preprocessor.encode_text(MOCK_TEXT)?;
                let executor = MockExecutor::new(MockTiming { speedup: config.speedup }, corpus, card.tokenizer.eos_token_id);
                (Box::new(executor), config.num_blocks.unwrap_or(MOCK_NUM_BLOCKS), None)
            }
        };
        let scheduler = SchedulerConfig {
            block_size,
            num_blocks,
            max_num_seqs: config.max_num_seqs,
            max_batched_tokens: config.max_batched_tokens,
            max_model_len: card.context_length as usize,
            max_waiting: config.max_waiting,
            ..SchedulerConfig::default()
        };
        let engine = EngineHandle::spawn(scheduler, card.tokenizer.eog_token_ids.clone(), executor);
        // The mocker models hand-offs: no bytes, their transfer time.
        let simulated = (config.engine == EngineKind::Mock && config.role != WorkerRole::Aggregated).then(|| SimulatedTransfer {
            block_bytes: config.mock_kv_bytes_per_token * block_size,
            bytes_per_sec: config.mock_transfer_gbps * 1e9 * config.speedup,
        });
        if config.role != WorkerRole::Aggregated && memory.is_none() && simulated.is_none() {
            anyhow::bail!("a {} worker needs an engine that can hand over its KV cache (the native engine; on a GPU, a build with the cuda feature)", config.role);
        }
        let options = DisaggOptions {
            role: config.role,
            lease: Duration::from_millis(config.kv_lease_ms),
            transport: config.kv_transport,
            transfer_mib: config.kv_transfer_mib,
            simulated,
            pool,
        };
        let disagg = Arc::new(Disagg::new(&id, engine.clone(), memory, &options));
        tracing::info!(
            worker = %id,
            model = %card.name,
            path = %model.path.display(),
            engine = ?config.engine,
            context_length = card.context_length,
            block_size,
            num_blocks,
            role = %config.role,
            ucx = disagg.has_ucx(),
            "worker loaded"
        );
        let card_proto = card_to_proto(&card);
        let instance = uuid::Uuid::new_v4().as_u64_pair().0;
        Ok(Arc::new(Self { id, card, card_proto, engine, instance, disagg }))
    }

    /// The worker id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// This start's random incarnation number (KV events carry it).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Tokens per KV block of the engine.
    pub fn block_size(&self) -> usize {
        self.engine.config().block_size
    }

    /// The served model's card.
    pub fn card(&self) -> &ModelCard {
        &self.card
    }

    /// The card as sent on the wire (converted once).
    pub fn card_proto(&self) -> &pb::ModelCard {
        &self.card_proto
    }

    /// Disaggregated serving: prefill handles, KV transfers.
    pub fn disagg(&self) -> &Arc<Disagg> {
        &self.disagg
    }

    /// The worker's part in disaggregated serving.
    pub fn role(&self) -> WorkerRole {
        self.disagg.role()
    }

    /// The engine.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    /// Current load.
    pub fn load(&self) -> Load {
        self.engine.load()
    }

    /// Stops the engine; sequences still running fail.
    pub fn shutdown(&self) {
        self.engine.shutdown();
    }
}
