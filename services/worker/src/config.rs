//! Worker configuration: defaults < `--config` file < `TURBINE_*` env < flags
//! (see `turbine_runtime::config`). The engine and transfer sections are
//! shared with `turbine run`, which starts workers with them.

use std::path::PathBuf;
use turbine_runtime::config::InvalidSetting;

use serde::{Deserialize, Serialize};
pub use turbine_registry::WorkerRole;
use turbine_runtime::config::{ClusterConfig, ServerConfig, ServiceDefaults, Settings, defaults};

/// Which engine runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Turbine's own engine: the model computed on this machine.
    Native,
    /// Simulated timing with the real scheduler and block manager; emits
    /// synthetic tokens.
    Mock,
    /// An engine server running beside the worker (`--upstream`): the
    /// worker speaks `turbine.worker.v1` for it, token ids in and out.
    External,
}

/// What serves at `--upstream`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum UpstreamKind {
    /// vLLM's OpenAI-compatible server (0.10.2 or later: it streams token
    /// ids), started with `vllm serve` or `python -m
    /// vllm.entrypoints.openai.api_server`.
    #[default]
    Vllm,
    /// llama.cpp's own server (`llama-server --metrics`, on the model's
    /// GGUF: the same file can be the card). It takes prompts as token ids
    /// and streams back ids on its `/completion`; it publishes no KV
    /// events, so routers credit it approximately (`--kv-approximate`), and
    /// it cannot scope its cache by tenant (a tenant's request runs with
    /// its prompt cache off).
    LlamaCpp,
    /// Any server of the OpenAI completions API (`POST /v1/completions`,
    /// streamed; `GET /v1/models` for health): prompts go as token ids
    /// (the API takes a list of ids), generated text comes back and the
    /// worker re-tokenizes it with the card's tokenizer, as its card says
    /// (`retokenized`): the text is the engine's, the ids may not be. No
    /// KV events (routers run `--kv-approximate`), no log-probabilities,
    /// and no tenant's request (the API cannot keep a tenant's cache
    /// apart); load is the worker's own count of open streams.
    Openai,
}

/// Which blocks a worker puts to the kv-store (`--kv-store-offload`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum KvStoreOffload {
    /// Every block as the host tier stores it.
    #[default]
    WriteThrough,
    /// Blocks the lowest local tier evicts.
    OnEvict,
    /// None.
    Off,
}

impl From<KvStoreOffload> for turbine_engine::RemoteOffload {
    fn from(offload: KvStoreOffload) -> Self {
        match offload {
            KvStoreOffload::WriteThrough => Self::WriteThrough,
            KvStoreOffload::OnEvict => Self::OnEvict,
            KvStoreOffload::Off => Self::Off,
        }
    }
}

/// Whether prefixes below the host tier are read or computed
/// (`--kv-fetch`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvFetch {
    /// Per request, from measured transfer and compute times.
    #[default]
    Auto,
    /// Read whatever the tiers hold.
    Always,
    /// Compute everything below the host tier.
    Never,
}

impl From<KvFetch> for turbine_engine::FetchPolicy {
    fn from(fetch: KvFetch) -> Self {
        match fetch {
            KvFetch::Auto => Self::Auto,
            KvFetch::Always => Self::Always,
            KvFetch::Never => Self::Never,
        }
    }
}

impl EngineKind {
    /// Tokens per KV block unless configured: 16 for the native engine,
    /// 64 for the mocker (DESIGN §5); an external engine's is its own
    /// (read from it at start; 16 is vLLM's default on GPUs).
    pub fn default_block_size(self) -> usize {
        match self {
            EngineKind::Native | EngineKind::External => 16,
            EngineKind::Mock => 64,
        }
    }
}

/// How a decode worker reads a prefill worker's blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvTransport {
    /// UCX one-sided reads when both workers have UCX, else TCP.
    #[default]
    Auto,
    /// UCX only (a failed read falls back to computing the prompt here).
    Ucx,
    /// The gRPC stream (`KvTransfer/ReadBlocks`).
    Tcp,
}

/// KV bytes per token the mocker models: Llama-3-8B in f16 (32 layers,
/// keys and values, 8 KV heads of 128), the class of model its timing
/// polynomials describe.
pub const MOCK_KV_BYTES_PER_TOKEN: usize = 32 * 2 * 8 * 128 * 2;

/// Transfer bandwidth the mocker models, GB/s: what `turbine bench
/// transfer` measured for UCX gets between processes here (the sweep in
/// docs/benchmarks.md ran at it; reads of a shared pool now measure 11-12).
pub const MOCK_TRANSFER_GBPS: f64 = 8.0;

/// Host-tier onboard bandwidth the mocker models, GB/s: what `cargo bench
/// -p turbine-engine --bench tiers` measured for onboarding 2 MiB blocks
/// from the host tier here (look up, check, copy into the pool): 6.72 GiB/s.
pub const MOCK_HOST_GBPS: f64 = 7.2;

/// Disk-tier onboard bandwidth the mocker models, GB/s: the same bench's
/// disk figure (block files in the page cache): 1.44 GiB/s.
pub const MOCK_DISK_GBPS: f64 = 1.55;

/// Shared-tier (kv-store) onboard bandwidth the mocker models, GB/s: the
/// kv-store's Get is a gRPC stream of blocks, and the gRPC stream of
/// `turbine bench transfer --transport tcp` moved 0.64-0.95 GB/s here.
pub const MOCK_REMOTE_GBPS: f64 = 0.8;

/// Where a worker listens by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerPorts {}

impl ServiceDefaults for WorkerPorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:50061";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_WORKER_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = Some("0.0.0.0:9091");
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_WORKER_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "30";
}

/// The worker's configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct WorkerConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub server: ServerConfig<WorkerPorts>,
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: ClusterConfig,
    /// Endpoint published in the registry, e.g. http://worker-0:50061
    /// [default: the gRPC address, or the host name when bound to all
    /// interfaces].
    #[arg(long, env = "TURBINE_WORKER_ADVERTISE")]
    pub advertise: Option<String>,
    /// Stable worker id [default: a random one].
    #[arg(long, env = "TURBINE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Registry lease in seconds: a worker that stops heartbeating leaves
    /// the registry this long after its last heartbeat.
    #[arg(long, env = "TURBINE_WORKER_LEASE_TTL_SECS", default_value_t = 5.0)]
    pub lease_ttl_secs: f64,
    /// Part in disaggregated serving: aggregated (whole requests), prefill
    /// (prompts, handed to decode workers) or decode.
    #[arg(long, value_enum, env = "TURBINE_WORKER_ROLE", default_value_t = WorkerRole::Aggregated)]
    pub role: WorkerRole,
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineConfig,
    #[command(flatten)]
    #[serde(flatten)]
    pub transfer: TransferConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for WorkerConfig {
    const CONFIG_ENV: &'static str = "TURBINE_WORKER_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        self.server.validate()?;
        if let Some(id) = &self.worker_id
            && (id.is_empty() || id.starts_with(turbine_kv::STORE_PREFIX))
        {
            return Err(InvalidSetting::new(
                "worker_id",
                format!("{id:?} must not be empty or start with {:?} (the index's names for kv-stores)", turbine_kv::STORE_PREFIX),
            ));
        }
        if !(self.lease_ttl_secs.is_finite() && self.lease_ttl_secs >= 0.1) {
            return Err(InvalidSetting::new("lease_ttl_secs", "must be at least 0.1"));
        }
        self.engine.validate()?;
        if self.engine.engine == EngineKind::External && self.role != WorkerRole::Aggregated {
            return Err(InvalidSetting::new(
                "role",
                format!("a {} worker hands KV blocks over Turbine's transfer plane, which an external engine's cache is not on (docs/engines.md)", self.role),
            ));
        }
        self.transfer.validate()
    }
}

/// What runs the model and how much of the machine it takes.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Model: a catalog name (fetched if missing), the path of a GGUF file,
    /// or (with --engine external) a Hugging Face model directory whose
    /// tokenizer.json the card is read from.
    #[arg(long, env = "TURBINE_MODEL", default_value = turbine_tokens::pull::DEFAULT_MODEL)]
    pub model: String,
    /// Name clients use for the model [default: the catalog name or the
    /// file stem].
    #[arg(long, env = "TURBINE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Engine: native computes the model, mock simulates it, external
    /// fronts an engine server at --upstream (the model's card still comes
    /// from --model: it must be the model the engine serves).
    #[arg(long, value_enum, env = "TURBINE_WORKER_ENGINE", default_value_t = EngineKind::Native)]
    pub engine: EngineKind,
    /// External engine: the engine server's base URL
    /// (`http://127.0.0.1:8000`). The worker sends it prompts as token ids
    /// and streams back token ids, aborts a request whose caller went away,
    /// reports its load from its /metrics and its health from /health.
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM", value_name = "URL")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// External engine: PEM certificates of the CAs an `https://`
    /// --upstream's certificate must chain to [default: the system's
    /// roots]. The certificate must name the URL's host. Over TLS the
    /// worker presents its own --tls-cert, so an engine whose client CA is
    /// the deployment's (vLLM: `--ssl-ca-certs CA --ssl-cert-reqs 2`)
    /// serves Turbine's processes alone.
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM_CA", value_name = "FILE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_ca: Option<std::path::PathBuf>,
    /// External engine: a file whose first line is the API key the engine
    /// requires (vLLM's and llama-server's --api-key), sent with every
    /// call as `Authorization: Bearer`. A file, not the key: a process's
    /// arguments show to every local user.
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM_API_KEY_FILE", value_name = "FILE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_api_key_file: Option<std::path::PathBuf>,
    /// External engine: what serves at --upstream.
    #[arg(long, value_enum, env = "TURBINE_WORKER_UPSTREAM_KIND", default_value_t = UpstreamKind::Vllm)]
    #[serde(default)]
    pub upstream_kind: UpstreamKind,
    /// External engine: the model's name at --upstream [default: the one
    /// model it lists].
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM_MODEL")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_model: Option<String>,
    /// External engine: where the worker receives the engine's KV events
    /// (`tcp://127.0.0.1:PORT`, loopback only: whoever connects is believed).
    /// The worker binds it; start vLLM with `--kv-events-config
    /// '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    /// "tcp://127.0.0.1:PORT"}'` (a concrete host: vLLM connects). Routers
    /// then route on what the engine caches, exactly. Unset: they see
    /// nothing cached there.
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM_KV_EVENTS", value_name = "ENDPOINT")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_kv_events: Option<String>,
    /// External engine: the engine's KV event replay socket
    /// (`tcp://127.0.0.1:PORT`, loopback only), where the worker asks for
    /// the events it missed (the engine's connection dropped, messages
    /// lost) instead of forgetting what the engine caches. Start vLLM
    /// with `"replay_endpoint": "tcp://127.0.0.1:PORT"` in its
    /// --kv-events-config (vLLM binds it). Needs --upstream-kv-events.
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM_KV_REPLAY", value_name = "ENDPOINT")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_kv_replay: Option<String>,
    /// External engine: seconds to wait at start for the engine to answer
    /// (it may still be loading its model); the worker is NOT_SERVING
    /// meanwhile, and fails to start after.
    #[arg(long, env = "TURBINE_WORKER_UPSTREAM_WAIT_SECS", default_value_t = 600)]
    #[serde(default)]
    pub upstream_wait_secs: u64,
    /// Mocker: divide every simulated duration by this factor.
    #[arg(long, env = "TURBINE_WORKER_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,
    /// Tokens per KV block [default: 16 native, 64 mock].
    #[arg(long, env = "TURBINE_WORKER_BLOCK_SIZE")]
    pub block_size: Option<usize>,
    /// KV blocks in the pool; overrides --kv-cache-mib [default: from
    /// --kv-cache-mib, mock 16384].
    #[arg(long, env = "TURBINE_WORKER_NUM_BLOCKS")]
    pub num_blocks: Option<usize>,
    /// Native: KV cache pool size in MiB (when --num-blocks is unset).
    #[arg(long, env = "TURBINE_WORKER_KV_CACHE_MIB", default_value_t = 512)]
    pub kv_cache_mib: usize,
    /// Host-memory KV tier (G2) in MiB. Every full block is copied here in
    /// the background; a later prompt whose prefix left the pool gets it
    /// back from host memory instead of recomputing it. Tenants share it
    /// fairly: one above its share (the tier over the tenants holding
    /// blocks) makes room from its own blocks (so does the disk tier). 0
    /// turns the tier off. The mocker models it: each block counts as its modelled size
    /// (--mock-kv-bytes-per-token) and onboards at --mock-host-gbps.
    #[arg(long, env = "TURBINE_WORKER_HOST_CACHE_MIB", default_value_t = 0)]
    pub host_cache_mib: u64,
    /// Local-disk KV tier (G3) below the host tier: what the host tier
    /// evicts is written here (one checksummed file per block, in a
    /// subdirectory named after the worker id) and read back on a later
    /// prefix hit. Kept across restarts of a worker with the same id and
    /// model. Needs --host-cache-mib. Unset: no disk tier.
    #[arg(long, env = "TURBINE_WORKER_DISK_CACHE_DIR", value_name = "DIR")]
    pub disk_cache_dir: Option<PathBuf>,
    /// GiB of block files the disk tier may hold.
    #[arg(long, env = "TURBINE_WORKER_DISK_CACHE_GIB", default_value_t = 16.0)]
    pub disk_cache_gib: f64,
    /// Shared KV tier (G4): the kv-store at this endpoint
    /// (`http://host:port`). Every block the host tier stores is also put
    /// there (write-through, in the background), and a prompt whose prefix
    /// continues past the host and disk tiers fetches it from there, so a
    /// prefix computed on one worker is reused by the others. A store that
    /// is down or slow is a miss: the prompt is computed. Needs
    /// --host-cache-mib and the native engine.
    #[arg(long, env = "TURBINE_WORKER_KV_STORE", value_name = "URL")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_store: Option<String>,
    /// Fewest blocks of a prompt, beyond the nearer tiers, worth a round
    /// trip to the kv-store (a shorter remainder is computed).
    #[arg(long, env = "TURBINE_WORKER_KV_STORE_MIN_BLOCKS", default_value_t = 2)]
    pub kv_store_min_blocks: usize,
    /// Milliseconds a fetch from the kv-store may take before it counts as
    /// a miss.
    #[arg(long, env = "TURBINE_WORKER_KV_STORE_TIMEOUT_MS", default_value_t = 5000)]
    pub kv_store_timeout_ms: u64,
    /// Which blocks go to the kv-store. write-through: every block as the
    /// host tier stores it (a prefix is shared as soon as it is computed).
    /// on-evict: only blocks the lowest local tier evicts (the disk's, or
    /// the host tier's without a disk): fewer puts, and the store keeps
    /// what this worker can no longer hold, but others see a prefix only
    /// once it left this worker. off: nothing (read what others put).
    #[arg(long, env = "TURBINE_WORKER_KV_STORE_OFFLOAD", value_enum, default_value_t = KvStoreOffload::WriteThrough)]
    #[serde(default)]
    pub kv_store_offload: KvStoreOffload,
    /// Whether a prompt's prefix found on disk or in the kv-store is read
    /// or computed. auto: per request, from the measured time to read it
    /// (each tier's round trip and bandwidth, the reads queued ahead)
    /// against the measured time to compute it; a tier slower than
    /// computing is passed over (and measured again every 10 s). always:
    /// read whatever the tiers hold. never: compute everything below the
    /// host tier.
    #[arg(long, env = "TURBINE_WORKER_KV_FETCH", value_enum, default_value_t = KvFetch::Auto)]
    #[serde(default)]
    pub kv_fetch: KvFetch,
    /// Mocker: modelled host-tier onboard bandwidth, GB/s (divided by
    /// --speedup like every simulated time).
    #[arg(long, env = "TURBINE_WORKER_MOCK_HOST_GBPS", default_value_t = MOCK_HOST_GBPS)]
    pub mock_host_gbps: f64,
    /// Mocker: modelled kv-store onboard bandwidth, GB/s (the mocker puts
    /// stamps of its blocks to a real kv-store; what comes back takes its
    /// modelled bytes over this).
    #[arg(long, env = "TURBINE_WORKER_MOCK_REMOTE_GBPS", default_value_t = MOCK_REMOTE_GBPS)]
    pub mock_remote_gbps: f64,
    /// Mocker: modelled disk-tier onboard bandwidth, GB/s.
    #[arg(long, env = "TURBINE_WORKER_MOCK_DISK_GBPS", default_value_t = MOCK_DISK_GBPS)]
    pub mock_disk_gbps: f64,
    /// Native: kernel threads [default: the cores available to the process].
    #[arg(long, env = "TURBINE_WORKER_THREADS")]
    pub threads: Option<usize>,
    /// Native: device to run on: cpu, cuda or cuda:N.
    #[arg(long, env = "TURBINE_WORKER_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Sequences running at once.
    #[arg(long, visible_alias = "max-seqs", env = "TURBINE_WORKER_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Tokens computed per engine step.
    #[arg(long, env = "TURBINE_WORKER_MAX_BATCHED_TOKENS", default_value_t = 8192)]
    pub max_batched_tokens: usize,
    /// Requests allowed to queue before new ones are refused.
    #[arg(long, env = "TURBINE_WORKER_MAX_WAITING", default_value_t = 4096)]
    pub max_waiting: usize,
    /// Overrides the model's context length, in tokens.
    #[arg(long, env = "TURBINE_WORKER_CONTEXT_LENGTH")]
    pub context_length: Option<u32>,
    /// Model cache directory [default: $TURBINE_CACHE_DIR or ~/.cache/turbine].
    #[arg(long, env = "TURBINE_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        defaults()
    }
}

impl EngineConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let positive = [
            ("block_size", self.block_size()),
            ("num_blocks", self.num_blocks.unwrap_or(1)),
            ("kv_cache_mib", self.kv_cache_mib),
            ("threads", self.threads.unwrap_or(1)),
            ("max_num_seqs", self.max_num_seqs),
            ("max_batched_tokens", self.max_batched_tokens),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(InvalidSetting::new(name, "must be positive"));
            }
        }
        self.device.parse::<turbine_native::Device>().map_err(|error| InvalidSetting::new("device", error.to_string()))?;
        if self.disk_cache_dir.is_some() && self.host_cache_mib == 0 {
            return Err(InvalidSetting::new("disk_cache_dir", "needs a host tier above it: set host_cache_mib too"));
        }
        if self.kv_store.is_some() && self.host_cache_mib == 0 {
            return Err(InvalidSetting::new("kv_store", "needs a host tier above it (blocks reach the store through it): set host_cache_mib too"));
        }
        match (self.engine, &self.upstream) {
            (EngineKind::External, None) => return Err(InvalidSetting::new("upstream", "an external engine needs the URL of its server")),
            (EngineKind::External, Some(_)) if self.host_cache_mib > 0 || self.kv_store.is_some() => {
                return Err(InvalidSetting::new(
                    "host_cache_mib and kv_store",
                    "Turbine's KV tiers hold the native engine's blocks; an external engine keeps its own (docs/engines.md)",
                ));
            }
            (EngineKind::External, Some(url)) if !(url.starts_with("http://") || url.starts_with("https://")) => {
                return Err(InvalidSetting::new("upstream", format!("{url:?} is not an http:// or https:// URL")));
            }
            (EngineKind::Native | EngineKind::Mock, Some(_)) => {
                return Err(InvalidSetting::new("upstream", "is the external engine's server: set engine = external too"));
            }
            _ => {}
        }
        if self.upstream_ca.is_some() && !self.upstream.as_deref().is_some_and(|url| url.starts_with("https://")) {
            return Err(InvalidSetting::new("upstream_ca", "vouches for an https:// engine: give --upstream https://..."));
        }
        if self.upstream_api_key_file.is_some() && self.engine != EngineKind::External {
            return Err(InvalidSetting::new("upstream_api_key_file", "is the external engine's key: set engine = external too"));
        }
        if let Some(endpoint) = &self.upstream_kv_events {
            if self.engine != EngineKind::External {
                return Err(InvalidSetting::new("upstream_kv_events", "are an external engine's: set engine = external too"));
            }
            match self.upstream_kind {
                UpstreamKind::Vllm => {}
                UpstreamKind::LlamaCpp => {
                    return Err(InvalidSetting::new(
                        "upstream_kv_events",
                        "llama.cpp's server publishes no KV events: leave them unset and run the router with --kv-approximate (docs/engines.md)",
                    ));
                }
                UpstreamKind::Openai => {
                    return Err(InvalidSetting::new(
                        "upstream_kv_events",
                        "the OpenAI API has no KV events: leave them unset and run the router with --kv-approximate (docs/engines.md)",
                    ));
                }
            }
            self.upstream_kv_events_addr().map_err(|message| InvalidSetting::new("upstream_kv_events", format!("{endpoint:?}: {message}")))?;
        }
        if let Some(endpoint) = &self.upstream_kv_replay {
            if self.upstream_kv_events.is_none() {
                return Err(InvalidSetting::new("upstream_kv_replay", "replays the engine's KV events: set upstream_kv_events too"));
            }
            self.upstream_kv_replay_addr().map_err(|message| InvalidSetting::new("upstream_kv_replay", format!("{endpoint:?}: {message}")))?;
        }
        if self.kv_store_min_blocks == 0 || self.kv_store_timeout_ms == 0 {
            return Err(InvalidSetting::new("kv_store_min_blocks and kv_store_timeout_ms", "must be positive"));
        }
        if !(self.disk_cache_gib.is_finite() && self.disk_cache_gib > 0.0) {
            return Err(InvalidSetting::new("disk_cache_gib", format!("must be a positive number, got {}", self.disk_cache_gib)));
        }
        for (name, value) in [
            ("speedup", self.speedup),
            ("mock_host_gbps", self.mock_host_gbps),
            ("mock_disk_gbps", self.mock_disk_gbps),
            ("mock_remote_gbps", self.mock_remote_gbps),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(InvalidSetting::new(name, format!("must be a positive number, got {value}")));
            }
        }
        Ok(())
    }

    /// The loopback address `upstream_kv_events` names, if set.
    pub fn upstream_kv_events_addr(&self) -> Result<Option<std::net::SocketAddr>, String> {
        self.upstream_kv_events.as_deref().map(loopback_endpoint).transpose()
    }

    /// The loopback address `upstream_kv_replay` names, if set.
    pub fn upstream_kv_replay_addr(&self) -> Result<Option<std::net::SocketAddr>, String> {
        self.upstream_kv_replay.as_deref().map(loopback_endpoint).transpose()
    }

    /// Tokens per KV block: configured, or the engine's default.
    pub fn block_size(&self) -> usize {
        self.block_size.unwrap_or_else(|| self.engine.default_block_size())
    }

    /// Kernel threads: configured, or the cores available to the process.
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
    }
}

/// The address of a `tcp://IP:PORT` endpoint of the engine's KV events,
/// which must be on loopback: they are not authenticated, whoever connects
/// (or answers) is believed.
fn loopback_endpoint(endpoint: &str) -> Result<std::net::SocketAddr, String> {
    let address = endpoint.strip_prefix("tcp://").ok_or("must be tcp://IP:PORT")?;
    let address: std::net::SocketAddr = address.parse().map_err(|_| "must be tcp://IP:PORT with an IP address".to_owned())?;
    if !address.ip().is_loopback() {
        return Err("must be a loopback address: the events are not authenticated, whoever connects is believed".into());
    }
    Ok(address)
}

/// How KV blocks move between prefill and decode workers.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct TransferConfig {
    /// Prefill workers: milliseconds pinned blocks wait for their decode
    /// worker before they are freed; also the longest a caller's Prefill
    /// may ask for (a longer lease_ms is cut to it: pinned blocks are
    /// memory other requests cannot use).
    #[arg(long, env = "TURBINE_WORKER_KV_LEASE_MS", default_value_t = 30_000)]
    pub kv_lease_ms: u64,
    /// Prefill workers: the most of the KV pool that handles waiting for
    /// their decode workers may pin at once (0 to 1). A prefill past it
    /// hands over no blocks (its decode worker computes the prompt), so
    /// pinned blocks never starve the requests this worker computes.
    #[arg(long, env = "TURBINE_WORKER_KV_PINNED_SHARE", default_value_t = 0.5)]
    pub kv_pinned_share: f64,
    /// Prefill workers: the most of the KV pool one requester's handles
    /// may pin at once (0 to 1, at most --kv-pinned-share). A requester is
    /// the Prefill caller's certificate (every caller without one counts
    /// as one requester).
    #[arg(long, env = "TURBINE_WORKER_KV_PINNED_SHARE_PER_REQUESTER", default_value_t = 0.25)]
    pub kv_pinned_share_per_requester: f64,
    /// Decode workers: how to read prefill workers' KV blocks: auto (UCX
    /// when both sides have it, else TCP), ucx or tcp.
    #[arg(long, value_enum, env = "TURBINE_WORKER_KV_TRANSPORT", default_value_t = KvTransport::Auto)]
    pub kv_transport: KvTransport,
    /// Network devices UCX may use for KV blocks, in UCX's syntax (`eth1`,
    /// `mlx5_0:1`; `all`: every device UCX finds). UCX checks no
    /// certificate: a host that reaches a UCX device may read and write
    /// this process's memory (on RDMA, with certificates, only a handle's
    /// blocks, through keys issued per handle and revoked at its release),
    /// so name only a fabric reserved to Turbine's services. Unset: none
    /// with certificates (workers on this machine
    /// use shared memory, others KvTransfer over mutual TLS), loopback for
    /// a plaintext worker on loopback, every device for a plaintext worker
    /// beyond it.
    #[arg(long, env = "TURBINE_WORKER_KV_UCX_DEVICES")]
    pub kv_ucx_devices: Option<String>,
    /// Decode workers: MiB of KV blocks in flight from prefill workers;
    /// requests beyond it compute their prompt here.
    #[arg(long, env = "TURBINE_WORKER_KV_TRANSFER_MIB", default_value_t = 1024)]
    pub kv_transfer_mib: usize,
    /// Mocker: modelled KV bytes per token (Llama-3-8B in f16), for
    /// hand-offs and KV tiers.
    #[arg(long, env = "TURBINE_WORKER_MOCK_KV_BYTES_PER_TOKEN", default_value_t = MOCK_KV_BYTES_PER_TOKEN)]
    pub mock_kv_bytes_per_token: usize,
    /// Mocker as prefill/decode: modelled KV transfer bandwidth in GB/s.
    #[arg(long, env = "TURBINE_WORKER_MOCK_TRANSFER_GBPS", default_value_t = MOCK_TRANSFER_GBPS)]
    pub mock_transfer_gbps: f64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        defaults()
    }
}

impl TransferConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.kv_lease_ms == 0 {
            return Err(InvalidSetting::new("kv_lease_ms", "must be positive"));
        }
        if self.kv_transfer_mib == 0 {
            return Err(InvalidSetting::new("kv_transfer_mib", "must be positive"));
        }
        if !(self.kv_pinned_share > 0.0 && self.kv_pinned_share <= 1.0) {
            return Err(InvalidSetting::new("kv_pinned_share", format!("must be above 0 and at most 1, got {}", self.kv_pinned_share)));
        }
        if !(self.kv_pinned_share_per_requester > 0.0 && self.kv_pinned_share_per_requester <= self.kv_pinned_share) {
            return Err(InvalidSetting::new(
                "kv_pinned_share_per_requester",
                format!("must be above 0 and at most kv_pinned_share ({}), got {}", self.kv_pinned_share, self.kv_pinned_share_per_requester),
            ));
        }
        if !(self.mock_transfer_gbps.is_finite() && self.mock_transfer_gbps > 0.0) {
            return Err(InvalidSetting::new("mock_transfer_gbps", "must be positive"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use turbine_runtime::config::Layered;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        config: Layered<WorkerConfig>,
    }

    fn parse(args: &[&str]) -> Result<WorkerConfig, String> {
        Cli::try_parse_from(std::iter::once("turbine-worker").chain(args.iter().copied())).map(|cli| cli.config.0).map_err(|error| error.to_string())
    }

    #[test]
    fn flags_reach_every_section() {
        let config = parse(&[
            "--grpc-addr",
            "127.0.0.1:1",
            "--redis",
            "redis://r/",
            "--namespace",
            "ns",
            "--worker-id",
            "w",
            "--role",
            "decode",
            "--engine",
            "mock",
            "--max-seqs",
            "4",
            "--threads",
            "2",
            "--context-length",
            "100",
            "--kv-transport",
            "tcp",
        ])
        .unwrap();
        assert_eq!(config.server.grpc_addr, "127.0.0.1:1".parse().unwrap());
        assert_eq!((config.cluster.redis.as_deref(), config.cluster.namespace.as_str()), (Some("redis://r/"), "ns"));
        assert_eq!((config.worker_id.as_deref(), config.role), (Some("w"), WorkerRole::Decode));
        assert_eq!(
            (config.engine.engine, config.engine.max_num_seqs, config.engine.threads(), config.engine.context_length),
            (EngineKind::Mock, 4, 2, Some(100))
        );
        assert_eq!(config.engine.block_size(), 64, "the mocker's block size");
        assert_eq!(config.transfer.kv_transport, KvTransport::Tcp);
        assert_eq!(parse(&[]).unwrap(), WorkerConfig::default());
        assert_eq!(WorkerConfig::default().server.admin_addr, Some("0.0.0.0:9091".parse().unwrap()));
    }

    #[test]
    fn a_flat_file_configures_every_section() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), "engine = \"mock\"\nspeedup = 10.0\nnum_blocks = 4096\nredis = \"redis://redis:6379/\"\nkv_lease_ms = 5\n").unwrap();
        let config = parse(&["--config", file.path().to_str().unwrap(), "--speedup", "2"]).unwrap();
        assert_eq!((config.engine.engine, config.engine.speedup, config.engine.num_blocks), (EngineKind::Mock, 2.0, Some(4096)));
        assert_eq!((config.cluster.redis.as_deref(), config.transfer.kv_lease_ms), (Some("redis://redis:6379/"), 5));
    }

    #[test]
    fn nonsense_values_are_refused() {
        assert!(parse(&["--speedup", "0"]).unwrap_err().contains("speedup"));
        assert!(parse(&["--block-size", "0"]).unwrap_err().contains("block_size"));
        assert!(parse(&["--device", "tpu"]).unwrap_err().contains("unknown device"));
        assert!(parse(&["--lease-ttl-secs", "0"]).unwrap_err().contains("lease_ttl_secs"));
        assert!(parse(&["--disk-cache-dir", "/tmp/kv"]).unwrap_err().contains("host_cache_mib"));
        assert!(parse(&["--kv-store", "http://127.0.0.1:50053"]).unwrap_err().contains("host_cache_mib"));
        assert!(parse(&["--kv-store", "http://127.0.0.1:50053", "--host-cache-mib", "64", "--engine", "mock"]).is_ok(), "the mocker models the shared tier");
        assert!(parse(&["--mock-remote-gbps", "0"]).unwrap_err().contains("mock_remote_gbps"));
        assert!(parse(&["--host-cache-mib", "64", "--disk-cache-dir", "/tmp/kv", "--disk-cache-gib", "0"]).unwrap_err().contains("disk_cache_gib"));
        assert!(parse(&["--host-cache-mib", "64", "--disk-cache-dir", "/tmp/kv"]).is_ok());
        assert!(parse(&["--kv-fetch", "sometimes"]).is_err());
        assert_eq!(parse(&["--kv-fetch", "never"]).unwrap().engine.kv_fetch, KvFetch::Never);
        assert_eq!(parse(&["--kv-store-offload", "on-evict"]).unwrap().engine.kv_store_offload, KvStoreOffload::OnEvict);
        assert!(parse(&["--kv-store-offload", "sometimes"]).is_err());
        assert!(parse(&["--kv-pinned-share", "0"]).unwrap_err().contains("kv_pinned_share"));
        assert!(parse(&["--kv-pinned-share", "1.5"]).unwrap_err().contains("kv_pinned_share"));
        assert!(parse(&["--kv-pinned-share", "0.2"]).unwrap_err().contains("kv_pinned_share_per_requester"), "the default 0.25 per requester is above it");
        assert!(parse(&["--kv-pinned-share", "0.2", "--kv-pinned-share-per-requester", "0.1"]).is_ok());
    }

    #[test]
    fn an_external_engine_needs_its_url_and_refuses_what_it_cannot_do() {
        let external = ["--engine", "external", "--upstream", "http://127.0.0.1:8000"];
        let config = parse(&external).unwrap();
        assert_eq!((config.engine.upstream.as_deref(), config.engine.upstream_kind), (Some("http://127.0.0.1:8000"), UpstreamKind::Vllm));
        assert!(parse(&["--engine", "external"]).unwrap_err().contains("upstream"));
        assert!(parse(&["--upstream", "http://127.0.0.1:8000"]).unwrap_err().contains("engine = external"));
        assert!(parse(&["--engine", "external", "--upstream", "127.0.0.1:8000"]).unwrap_err().contains("URL"));
        assert!(parse(&[&external[..], &["--role", "prefill"]].concat()).unwrap_err().contains("transfer plane"));
        assert!(parse(&[&external[..], &["--host-cache-mib", "64"]].concat()).unwrap_err().contains("keeps its own"));
        assert!(parse(&[&external[..], &["--upstream-kind", "tgi"]].concat()).is_err(), "a kind the adapter does not speak is refused");
        let secure = ["--engine", "external", "--upstream", "https://engine.internal:8000", "--upstream-ca", "engine-ca.crt"];
        assert_eq!(parse(&secure).unwrap().engine.upstream_ca.as_deref(), Some(std::path::Path::new("engine-ca.crt")));
        assert!(parse(&[&external[..], &["--upstream-ca", "engine-ca.crt"]].concat()).unwrap_err().contains("https://"), "a CA for a plaintext engine");
        assert!(parse(&[&external[..], &["--upstream-api-key-file", "key"]].concat()).is_ok());
        assert!(parse(&["--upstream-api-key-file", "key"]).unwrap_err().contains("engine = external"));
        let events = parse(&[&external[..], &["--upstream-kv-events", "tcp://127.0.0.1:5557"]].concat()).unwrap();
        assert_eq!(events.engine.upstream_kv_events_addr(), Ok(Some("127.0.0.1:5557".parse().unwrap())));
        assert!(parse(&[&external[..], &["--upstream-kv-events", "tcp://0.0.0.0:5557"]].concat()).unwrap_err().contains("loopback"));
        assert!(parse(&[&external[..], &["--upstream-kv-events", "ipc:///tmp/x"]].concat()).unwrap_err().contains("tcp://"));
        assert!(parse(&["--upstream-kv-events", "tcp://127.0.0.1:5557"]).unwrap_err().contains("engine = external"));
        let replay = parse(&[&external[..], &["--upstream-kv-events", "tcp://127.0.0.1:5557", "--upstream-kv-replay", "tcp://[::1]:5558"]].concat()).unwrap();
        assert_eq!(replay.engine.upstream_kv_replay_addr(), Ok(Some("[::1]:5558".parse().unwrap())));
        assert!(parse(&[&external[..], &["--upstream-kv-replay", "tcp://127.0.0.1:5558"]].concat()).unwrap_err().contains("upstream_kv_events too"));
        assert!(
            parse(&[&external[..], &["--upstream-kv-events", "tcp://127.0.0.1:5557", "--upstream-kv-replay", "tcp://10.0.0.2:5558"]].concat())
                .unwrap_err()
                .contains("loopback")
        );
        let llama = [&external[..], &["--upstream-kind", "llama-cpp"]].concat();
        assert_eq!(parse(&llama).unwrap().engine.upstream_kind, UpstreamKind::LlamaCpp);
        assert!(parse(&[&llama[..], &["--upstream-kv-events", "tcp://127.0.0.1:5557"]].concat()).unwrap_err().contains("--kv-approximate"));
        let openai = [&external[..], &["--upstream-kind", "openai"]].concat();
        assert_eq!(parse(&openai).unwrap().engine.upstream_kind, UpstreamKind::Openai);
        assert!(parse(&[&openai[..], &["--upstream-kv-events", "tcp://127.0.0.1:5557"]].concat()).unwrap_err().contains("--kv-approximate"));
    }
}
