//! A loaded worker: the served model's card and a running engine.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use turbine_engine::mocker::{MOCK_TEXT, MockExecutor, MockTiming};
use turbine_engine::{DiskTier, EngineHandle, Executor, HostTier, KvMemory, KvTiers, Load, ModelledTransfer, RemoteTier, SchedulerConfig};
use turbine_kv::{UcxKeys, UcxNetwork, WorkerId};
use turbine_native::sampling::OutputVocabulary;
use turbine_native::{Backend, NativeExecutor, NativeOptions};
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Preprocessor, TokenBytes};

use crate::config::{EngineKind, WorkerConfig, WorkerRole};
use crate::store_tier::KvStoreTier;
use turbine_api::kv_store::{Fingerprint, KvStoreClient};

use crate::disagg::{Disagg, DisaggOptions, PinBudget, SharedKvPool, SimulatedTransfer};

/// The mocker's pool unless configured (DESIGN §5: 16,384 blocks of 64 tokens).
const MOCK_NUM_BLOCKS: usize = 16_384;

/// A worker with its model loaded and its engine running.
#[derive(Debug)]
pub struct Worker {
    id: WorkerId,
    card: ModelCard,
    engine: EngineHandle,
    /// Random per start: KV event consumers detect a restart by it.
    instance: u64,
    /// Prefill handles and KV transfers.
    disagg: Arc<Disagg>,
    /// The shared kv-store, when the worker reads one.
    kv_store: Option<SharedStore>,
    /// Whether its engine keeps to an output format asked for (JSON).
    constrains_output: bool,
}

/// The shared kv-store a worker reads, and the name its blocks of this
/// worker's layout have in the KV index once the store says it announces
/// them.
#[derive(Debug)]
struct SharedStore {
    client: KvStoreClient,
    endpoint: String,
    fingerprint: Fingerprint,
    name: std::sync::OnceLock<WorkerId>,
}

impl Worker {
    /// Resolves (fetching if needed) and loads the model, then starts the
    /// engine. Blocking: call from a blocking context.
    /// `kv_store`: the process's own kv-store, called directly instead of
    /// over gRPC to `--kv-store`.
    pub fn start(config: &WorkerConfig, kv_store: Option<KvStoreClient>, ucx: &UcxNetwork, keys: UcxKeys) -> anyhow::Result<Arc<Self>> {
        let id = WorkerId::from(config.worker_id.clone().unwrap_or_else(|| format!("worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])));
        let (engine_config, transfer) = (&config.engine, &config.transfer);
        let cache_dir = engine_config.cache_dir.clone().unwrap_or_else(default_cache_dir);
        let model = resolve_model(&engine_config.model, engine_config.served_model_name.as_deref(), &cache_dir, Progress::Quiet)?;
        let block_size = engine_config.block_size();
        if turbine_tokens::hf::is_model_dir(&model.path) {
            anyhow::bail!(
                "{} is a Hugging Face model directory: Turbine's own engine and the mocker read GGUF files; serve the directory with an engine that loads it behind --engine external",
                model.path.display()
            );
        }
        let mut card = ModelCard::from_gguf_path(&model.name, &model.path, block_size as u32)?;
        if let Some(context_length) = engine_config.context_length {
            card.context_length = context_length;
        }
        let pool = SharedKvPool::for_role(config.role, transfer.kv_transport);
        let mut constrains_output = false;
        let (executor, num_blocks, memory): (Box<dyn Executor>, usize, Option<KvMemory>) = match engine_config.engine {
            EngineKind::Native => {
                let options = NativeOptions {
                    block_size,
                    kv_cache_mib: engine_config.kv_cache_mib,
                    kv_blocks: engine_config.num_blocks,
                    threads: engine_config.threads(),
                    device: engine_config.device.parse()?,
                    backend: Backend::Auto,
                    kv_allocator: pool.allocator(),
                };
                let executor = NativeExecutor::load(&model.path, &options)?;
                let eos = if card.tokenizer.eog_token_ids.is_empty() {
                    card.tokenizer.eos_token_id.into_iter().collect()
                } else {
                    card.tokenizer.eog_token_ids.clone()
                };
                // JSON output needs the vocabulary's bytes and an end to its objects.
                let executor = match eos.is_empty() {
                    true => executor,
                    false => executor.with_output_vocabulary(OutputVocabulary::new(Arc::new(TokenBytes::new(&card.tokenizer)), eos)),
                };
                constrains_output = executor.constrains_output();
                let num_blocks = executor.num_blocks();
                let memory = executor.kv_memory();
                (Box::new(executor), num_blocks, memory)
            }
            EngineKind::Mock => {
                // The mocker speaks the served model's vocabulary: tokenize its text once.
                let preprocessor = Preprocessor::new(card.clone())?;
                let corpus = preprocessor.encode_text(MOCK_TEXT)?;
                let executor = MockExecutor::new(MockTiming { speedup: engine_config.speedup }, corpus, card.tokenizer.eos_token_id);
                (Box::new(executor), engine_config.num_blocks.unwrap_or(MOCK_NUM_BLOCKS), None)
            }
            EngineKind::External => anyhow::bail!("an external engine runs outside the worker (crate::external serves it)"),
        };
        let scheduler = SchedulerConfig {
            block_size,
            num_blocks,
            max_num_seqs: engine_config.max_num_seqs,
            max_batched_tokens: engine_config.max_batched_tokens,
            max_model_len: card.context_length as usize,
            max_waiting: engine_config.max_waiting,
            ..SchedulerConfig::default()
        };
        // The mocker models its tiers: stamps for bytes, modelled transfer times.
        let modelled = (memory.is_none() && engine_config.engine == EngineKind::Mock).then(|| ModelledTransfer {
            block_bytes: (transfer.mock_kv_bytes_per_token * block_size) as u64,
            host_bytes_per_sec: engine_config.mock_host_gbps * 1e9 * engine_config.speedup,
            disk_bytes_per_sec: engine_config.mock_disk_gbps * 1e9 * engine_config.speedup,
            remote_bytes_per_sec: engine_config.mock_remote_gbps * 1e9 * engine_config.speedup,
        });
        // The layout's description, and the bytes of each of its blocks
        // as tiers hold them (the mocker's: stamps for the modelled bytes).
        let layout = match (&memory, &modelled) {
            (Some(memory), _) => Some((format!("{:?}", memory.layout()), memory.layout().block_bytes as u64)),
            (None, Some(modelled)) => Some((format!("mock, {} bytes per block", modelled.block_bytes), turbine_engine::tiers::STAMP_BYTES as u64)),
            (None, None) => None,
        };
        let host = match (engine_config.host_cache_mib, layout.clone()) {
            (0, _) => None,
            (mib, Some((layout, _))) => {
                let disk = match &engine_config.disk_cache_dir {
                    Some(dir) => {
                        let dir = dir.join(id.to_string());
                        let capacity = (engine_config.disk_cache_gib * (1u64 << 30) as f64) as u64;
                        let fingerprint = layout_fingerprint(&model.path, &layout, &scheduler);
                        let disk = match modelled {
                            Some(modelled) => DiskTier::open_modelled(&dir, capacity, fingerprint, modelled.block_bytes),
                            None => DiskTier::open(&dir, capacity, fingerprint),
                        };
                        Some(disk.with_context(|| format!("cannot open the disk KV tier in {}", dir.display()))?)
                    }
                    None => None,
                };
                Some(match (modelled, disk) {
                    (Some(modelled), disk) => HostTier::modelled(mib << 20, modelled.block_bytes, disk),
                    (None, Some(disk)) => HostTier::with_disk(mib << 20, disk),
                    (None, None) => HostTier::new(mib << 20),
                })
            }
            (_, None) => {
                tracing::warn!("this engine exposes no KV memory: the host and disk KV tiers (--host-cache-mib, --disk-cache-dir) are off");
                None
            }
        };
        let in_process = kv_store;
        let mut kv_store = None;
        let remote = match (&engine_config.kv_store, &host, layout) {
            (Some(endpoint), Some(_), Some((layout, block_bytes))) => {
                let client = match in_process {
                    Some(client) => client,
                    None => KvStoreClient::connect(endpoint)?,
                };
                let block_bytes = u32::try_from(block_bytes)
                    .ok()
                    .filter(|&bytes| bytes > 0)
                    .with_context(|| format!("a KV block of {block_bytes} bytes cannot be shared"))?;
                // The fingerprint declares the blocks' size: the store
                // checks every block against it, whoever stores first.
                let fingerprint = Fingerprint::declaring(shared_fingerprint(&model.path, &layout, &scheduler), block_bytes);
                kv_store = Some(SharedStore { client: client.clone(), endpoint: endpoint.clone(), fingerprint, name: std::sync::OnceLock::new() });
                let tier = KvStoreTier::new(client, fingerprint, Duration::from_millis(engine_config.kv_store_timeout_ms), ucx.clone());
                tracing::info!(kv_store = %endpoint, fingerprint = format!("{:016x}", fingerprint.get()), offload = ?engine_config.kv_store_offload, "shared KV tier on");
                Some(RemoteTier::new(Arc::new(tier), engine_config.kv_store_min_blocks).with_offload(engine_config.kv_store_offload.into()))
            }
            (Some(_), _, _) => {
                tracing::warn!("the shared KV tier (--kv-store) needs the host tier (--host-cache-mib); it is off");
                None
            }
            (None, _, _) => None,
        };
        let tiers = KvTiers { host, memory: memory.clone(), modelled, remote, fetch: engine_config.kv_fetch.into() };
        let engine = EngineHandle::spawn_with_tiers(scheduler, card.tokenizer.eog_token_ids.clone(), executor, tiers);
        // The mocker models hand-offs: no bytes, their transfer time.
        let simulated = (engine_config.engine == EngineKind::Mock && config.role != WorkerRole::Aggregated).then(|| SimulatedTransfer {
            block_bytes: transfer.mock_kv_bytes_per_token * block_size,
            bytes_per_sec: transfer.mock_transfer_gbps * 1e9 * engine_config.speedup,
        });
        if config.role != WorkerRole::Aggregated && memory.is_none() && simulated.is_none() {
            anyhow::bail!(
                "a {} worker needs an engine that can hand over its KV cache (the native engine; on a GPU, a build with the cuda feature)",
                config.role
            );
        }
        let options = DisaggOptions {
            role: config.role,
            lease: Duration::from_millis(transfer.kv_lease_ms),
            transport: transfer.kv_transport,
            transfer_mib: transfer.kv_transfer_mib,
            network: ucx.clone(),
            keys,
            pinned: PinBudget { pool_share: transfer.kv_pinned_share, requester_share: transfer.kv_pinned_share_per_requester },
            simulated,
            pool,
        };
        let disagg = Arc::new(Disagg::new(&id, engine.clone(), memory, &options));
        tracing::info!(
            worker = %id,
            model = %card.name,
            path = %model.path.display(),
            engine = ?engine_config.engine,
            context_length = card.context_length,
            block_size,
            num_blocks,
            role = %config.role,
            ucx = disagg.has_ucx(),
            "worker loaded"
        );
        let instance = uuid::Uuid::new_v4().as_u64_pair().0;
        Ok(Arc::new(Self { id, card, engine, instance, disagg, kv_store, constrains_output }))
    }

    /// The worker id.
    pub fn id(&self) -> &WorkerId {
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

    /// Whether its engine keeps to an output format asked for (JSON).
    pub fn constrains_output(&self) -> bool {
        self.constrains_output
    }

    /// The output formats its engine holds output to, as its record
    /// announces them: the native engine's sampler keeps to one JSON
    /// object and to a schema of the core subset
    /// ([`turbine_native::schema`]), going on from output begun elsewhere
    /// too; the mocker to none.
    pub fn output_formats(&self) -> turbine_api::OutputFormats {
        if self.constrains_output {
            turbine_api::OutputFormats { json_object: true, json_schema: false, json_schema_core: true, resumes: true }
        } else {
            turbine_api::OutputFormats::TEXT
        }
    }

    /// The served model's card.
    pub fn card(&self) -> &ModelCard {
        &self.card
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

    /// The shared kv-store as the registry record names it: known once
    /// the store said it announces its blocks.
    pub fn kv_store_ref(&self) -> Option<turbine_registry::KvStoreRef> {
        let store = self.kv_store.as_ref()?;
        Some(turbine_registry::KvStoreRef { name: store.name.get()?.clone(), endpoint: store.endpoint.clone() })
    }

    /// Asks the shared kv-store (if any) under which id it announces its
    /// blocks, until it answers with one or `shutdown`: every second while
    /// it cannot be reached, every 10 s while it announces nothing.
    pub async fn learn_kv_store_name(self: Arc<Self>, shutdown: turbine_runtime::CancellationToken) {
        let Some(store) = &self.kv_store else { return };
        loop {
            let wait = match store.client.announced_as().await {
                Ok(Some(store_id)) => {
                    let name = WorkerId::of_store(&store_id, store.fingerprint.get());
                    tracing::info!(kv_store = %store.endpoint, %name, "the kv-store announces its blocks: routers credit them to this worker");
                    let _ = store.name.set(name);
                    return;
                }
                Ok(None) => Duration::from_secs(10),
                Err(_) => Duration::from_secs(1),
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Stops the engine; sequences still running fail.
    pub fn shutdown(&self) {
        self.engine.shutdown();
    }
}

/// What must match for blocks on disk to be this worker's: the model file
/// (path, size, modification time), the pool's layout, the block size and
/// the hash seed.
/// The identity of blocks shared between workers, wherever their model file
/// lives: the file's length and the XXH3 of its first 4 MiB (a GGUF's
/// header: metadata and tensor table) and last MiB, the pool layout, the
/// block size and the hash seed.
fn shared_fingerprint(model: &std::path::Path, layout: &str, scheduler: &SchedulerConfig) -> u64 {
    use std::io::{Read, Seek, SeekFrom};
    let content = std::fs::File::open(model).and_then(|mut file| {
        let len = file.metadata()?.len();
        let mut head = vec![0u8; (4u64 << 20).min(len) as usize];
        file.read_exact(&mut head)?;
        let tail_len = (1u64 << 20).min(len);
        file.seek(SeekFrom::Start(len - tail_len))?;
        let mut tail = vec![0u8; tail_len as usize];
        file.read_exact(&mut tail)?;
        Ok((len, turbine_engine::block_checksum(&head), turbine_engine::block_checksum(&tail)))
    });
    let identity = format!("{content:?}|{layout}|{}|{}", scheduler.block_size, scheduler.hash_seed);
    turbine_engine::block_checksum(identity.as_bytes()).max(1)
}

fn layout_fingerprint(model: &std::path::Path, layout: &str, scheduler: &SchedulerConfig) -> u64 {
    let file = std::fs::metadata(model).ok();
    let modified = file.as_ref().and_then(|m| m.modified().ok()).and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos());
    let identity = format!(
        "{}|{:?}|{:?}|{layout}|{}|{}",
        std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf()).display(),
        file.map(|m| m.len()),
        modified,
        scheduler.block_size,
        scheduler.hash_seed
    );
    turbine_engine::block_checksum(identity.as_bytes())
}
