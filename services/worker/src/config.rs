//! Worker configuration: defaults < `--config` file < `TURBINE_*` env < flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
pub use turbine_registry::WorkerRole;

/// Which engine runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Turbine's own engine: the model computed on this machine.
    Native,
    /// Simulated timing with the real scheduler and block manager; emits
    /// synthetic tokens.
    Mock,
}

impl EngineKind {
    /// Tokens per KV block unless configured: 16 for the native engine,
    /// 64 for the mocker (DESIGN §5).
    pub fn default_block_size(self) -> usize {
        match self {
            EngineKind::Native => 16,
            EngineKind::Mock => 64,
        }
    }
}

/// The worker's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Address of the gRPC server (turbine.worker.v1, health, reflection).
    pub grpc_addr: SocketAddr,
    /// Address of the admin HTTP server (/metrics, /livez, /readyz).
    pub admin_addr: SocketAddr,
    /// Endpoint other services use to reach this worker; derived from the
    /// gRPC address (or the host name when bound to all interfaces) if unset.
    pub advertise: Option<String>,
    /// Stable worker id; a random one if unset.
    pub worker_id: Option<String>,
    /// Model: a catalog name (fetched if missing) or a path to a GGUF file.
    pub model: String,
    /// Name clients use for the model; defaults to the catalog name or the
    /// file stem.
    pub served_model_name: Option<String>,
    /// Engine kind.
    pub engine: EngineKind,
    /// Mocker only: divides every simulated duration.
    pub speedup: f64,
    /// Tokens per KV block; unset: the engine's default (native 16, mock 64).
    pub block_size: Option<usize>,
    /// KV blocks in the pool; unset: sized from `kv_cache_mib` (native) or
    /// 16,384 (mock).
    pub num_blocks: Option<usize>,
    /// Native: KV pool size in MiB (when `num_blocks` is unset).
    pub kv_cache_mib: usize,
    /// Native: kernel threads; unset: the cores available to the process.
    pub threads: Option<usize>,
    /// Native: where the model runs (`cpu`, `cuda`, `cuda:N`).
    pub device: String,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens computed per engine step.
    pub max_batched_tokens: usize,
    /// Requests allowed to wait in the engine queue.
    pub max_waiting: usize,
    /// Overrides the model's context length (tokens).
    pub context_length: Option<u32>,
    /// Redis URL of the worker registry; without it the worker does not
    /// register (reach it directly).
    pub redis: Option<String>,
    /// Registry namespace (separates clusters sharing a Redis).
    pub namespace: String,
    /// Registry lease TTL in seconds; a worker that stops heartbeating
    /// leaves the registry this long after its last heartbeat.
    pub lease_ttl_secs: f64,
    /// Seconds in-flight streams get to finish after SIGTERM.
    pub shutdown_grace_secs: f64,
    /// Model cache directory.
    pub cache_dir: Option<PathBuf>,
    /// The worker's part in disaggregated serving.
    pub role: WorkerRole,
    /// Milliseconds a prefill's blocks stay pinned for a decode worker that
    /// does not release them.
    pub kv_lease_ms: u64,
    /// How this worker reads other workers' KV blocks.
    pub kv_transport: KvTransport,
    /// MiB of KV blocks this worker holds in flight while reading them from
    /// other workers; requests beyond it compute their prompt here.
    pub kv_transfer_mib: usize,
    /// Mocker in a prefill or decode role: KV bytes per token of the
    /// modelled model (a hand-off's transfer time is its bytes over
    /// `mock_transfer_gbps`).
    pub mock_kv_bytes_per_token: usize,
    /// Mocker in a prefill or decode role: modelled transfer bandwidth in
    /// GB/s.
    pub mock_transfer_gbps: f64,
}

/// KV bytes per token the mocker models: Llama-3-8B in f16 (32 layers,
/// keys and values, 8 KV heads of 128), the class of model its timing
/// polynomials describe.
pub const MOCK_KV_BYTES_PER_TOKEN: usize = 32 * 2 * 8 * 128 * 2;

/// Transfer bandwidth the mocker models, GB/s: what `turbine bench
/// transfer` measured for UCX gets between processes here (the sweep in
/// docs/benchmarks.md ran at it; reads of a shared pool now measure 11-12).
pub const MOCK_TRANSFER_GBPS: f64 = 8.0;

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

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            grpc_addr: ([0, 0, 0, 0], 50061).into(),
            admin_addr: ([0, 0, 0, 0], 9091).into(),
            advertise: None,
            worker_id: None,
            model: turbine_tokens::pull::DEFAULT_MODEL.to_owned(),
            served_model_name: None,
            engine: EngineKind::Native,
            speedup: 1.0,
            block_size: None,
            num_blocks: None,
            kv_cache_mib: 512,
            threads: None,
            device: "cpu".to_owned(),
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            max_waiting: 4096,
            context_length: None,
            redis: None,
            namespace: "default".to_owned(),
            lease_ttl_secs: 5.0,
            shutdown_grace_secs: 30.0,
            cache_dir: None,
            role: WorkerRole::Aggregated,
            kv_lease_ms: 30_000,
            kv_transport: KvTransport::Auto,
            kv_transfer_mib: 1024,
            mock_kv_bytes_per_token: MOCK_KV_BYTES_PER_TOKEN,
            mock_transfer_gbps: MOCK_TRANSFER_GBPS,
        }
    }
}

impl WorkerConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_size", self.block_size()),
            ("num_blocks", self.num_blocks.unwrap_or(1)),
            ("kv_cache_mib", self.kv_cache_mib),
            ("threads", self.threads.unwrap_or(1)),
            ("max_num_seqs", self.max_num_seqs),
            ("max_batched_tokens", self.max_batched_tokens),
            ("kv_lease_ms", self.kv_lease_ms as usize),
            ("kv_transfer_mib", self.kv_transfer_mib),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        self.device.parse::<turbine_native::Device>()?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(format!("speedup must be a positive number, got {}", self.speedup));
        }
        if !(self.lease_ttl_secs.is_finite() && self.lease_ttl_secs >= 0.1) {
            return Err("lease_ttl_secs must be at least 0.1".to_owned());
        }
        if !(self.mock_transfer_gbps.is_finite() && self.mock_transfer_gbps > 0.0) {
            return Err("mock_transfer_gbps must be positive".to_owned());
        }
        if !(self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0) {
            return Err("shutdown_grace_secs must be non-negative".to_owned());
        }
        Ok(())
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

/// Command-line flags of `turbine-worker` (each overrides the config file
/// and its `TURBINE_*` variable).
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct WorkerArgs {
    /// TOML config file (keys as the long flags, with underscores).
    #[arg(long, env = "TURBINE_WORKER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:50061].
    #[arg(long, env = "TURBINE_WORKER_GRPC_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_addr: Option<SocketAddr>,
    /// Admin HTTP listen address for /metrics, /livez, /readyz [default: 0.0.0.0:9091].
    #[arg(long, env = "TURBINE_WORKER_ADMIN_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_addr: Option<SocketAddr>,
    /// Endpoint published in the registry, e.g. http://worker-0:50061 [default: derived].
    #[arg(long, env = "TURBINE_WORKER_ADVERTISE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Stable worker id [default: random].
    #[arg(long, env = "TURBINE_WORKER_ID")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    /// Model: catalog name (fetched if missing) or GGUF path [default: smollm2-135m].
    #[arg(long, env = "TURBINE_MODEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Name clients use for the model [default: catalog name or file stem].
    #[arg(long, env = "TURBINE_SERVED_MODEL_NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// Engine: native computes the model, mock simulates it [default: native].
    #[arg(long, value_enum, env = "TURBINE_WORKER_ENGINE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineKind>,
    /// Mocker: divide simulated durations by this factor [default: 1].
    #[arg(long, env = "TURBINE_WORKER_SPEEDUP")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speedup: Option<f64>,
    /// Tokens per KV block [default: 16 native, 64 mock].
    #[arg(long, env = "TURBINE_WORKER_BLOCK_SIZE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// KV blocks in the pool; overrides --kv-cache-mib [default: from --kv-cache-mib, mock 16384].
    #[arg(long, env = "TURBINE_WORKER_NUM_BLOCKS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_blocks: Option<usize>,
    /// Native: KV cache pool size in MiB [default: 512].
    #[arg(long, env = "TURBINE_WORKER_KV_CACHE_MIB")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_mib: Option<usize>,
    /// Native: kernel threads [default: the cores available].
    #[arg(long, env = "TURBINE_WORKER_THREADS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// Native: device to run on: cpu, cuda or cuda:N [default: cpu].
    #[arg(long, env = "TURBINE_WORKER_DEVICE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Sequences running at once [default: 256].
    #[arg(long, visible_alias = "max-seqs", env = "TURBINE_WORKER_MAX_NUM_SEQS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<usize>,
    /// Tokens computed per engine step [default: 8192].
    #[arg(long, env = "TURBINE_WORKER_MAX_BATCHED_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batched_tokens: Option<usize>,
    /// Requests allowed to queue before new ones are refused [default: 4096].
    #[arg(long, env = "TURBINE_WORKER_MAX_WAITING")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<usize>,
    /// Override the model's context length in tokens.
    #[arg(long, env = "TURBINE_WORKER_CONTEXT_LENGTH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u32>,
    /// Redis URL of the registry, e.g. redis://redis:6379/ [default: no registration].
    #[arg(long, env = "TURBINE_REDIS_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<String>,
    /// Registry namespace [default: default].
    #[arg(long, env = "TURBINE_NAMESPACE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Registry lease TTL in seconds [default: 5].
    #[arg(long, env = "TURBINE_WORKER_LEASE_TTL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ttl_secs: Option<f64>,
    /// Seconds in-flight streams get to finish after SIGTERM [default: 30].
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_secs: Option<f64>,
    /// Model cache directory [default: $TURBINE_CACHE_DIR or ~/.cache/turbine].
    #[arg(long, env = "TURBINE_CACHE_DIR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// Part in disaggregated serving: aggregated (whole requests), prefill
    /// (prompts, handed to decode workers) or decode [default: aggregated].
    #[arg(long, value_enum, env = "TURBINE_WORKER_ROLE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<WorkerRole>,
    /// Prefill workers: milliseconds pinned blocks wait for their decode
    /// worker before they are freed [default: 30000].
    #[arg(long, env = "TURBINE_WORKER_KV_LEASE_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_lease_ms: Option<u64>,
    /// Decode workers: how to read prefill workers' KV blocks: auto (UCX
    /// when both sides have it, else TCP), ucx or tcp [default: auto].
    #[arg(long, value_enum, env = "TURBINE_WORKER_KV_TRANSPORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transport: Option<KvTransport>,
    /// Decode workers: MiB of KV blocks in flight from prefill workers;
    /// requests beyond it compute their prompt locally [default: 1024].
    #[arg(long, env = "TURBINE_WORKER_KV_TRANSFER_MIB")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_mib: Option<usize>,
    /// Mocker as prefill/decode: modelled KV bytes per token [default: 131072, Llama-3-8B f16].
    #[arg(long, env = "TURBINE_WORKER_MOCK_KV_BYTES_PER_TOKEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mock_kv_bytes_per_token: Option<usize>,
    /// Mocker as prefill/decode: modelled KV transfer bandwidth in GB/s [default: 8].
    #[arg(long, env = "TURBINE_WORKER_MOCK_TRANSFER_GBPS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mock_transfer_gbps: Option<f64>,
}

impl WorkerArgs {
    /// Resolves the full configuration (file, env and flags over defaults).
    pub fn load(&self) -> anyhow::Result<WorkerConfig> {
        let config: WorkerConfig = turbine_runtime::config::load(self.config.as_deref(), self)?;
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_is_a_config_key() {
        // deny_unknown_fields makes a flag without a config field fail here.
        let args = WorkerArgs {
            grpc_addr: Some(([127, 0, 0, 1], 1).into()),
            admin_addr: Some(([127, 0, 0, 1], 2).into()),
            advertise: Some("http://x:1".into()),
            worker_id: Some("w".into()),
            model: Some("m".into()),
            served_model_name: Some("n".into()),
            engine: Some(EngineKind::Mock),
            speedup: Some(2.0),
            block_size: Some(16),
            num_blocks: Some(8),
            kv_cache_mib: Some(64),
            threads: Some(2),
            device: Some("cpu".into()),
            max_num_seqs: Some(4),
            max_batched_tokens: Some(64),
            max_waiting: Some(3),
            context_length: Some(100),
            redis: Some("redis://r/".into()),
            namespace: Some("ns".into()),
            lease_ttl_secs: Some(1.0),
            shutdown_grace_secs: Some(2.0),
            cache_dir: Some("/tmp/c".into()),
            role: Some(WorkerRole::Decode),
            kv_lease_ms: Some(1000),
            kv_transport: Some(KvTransport::Tcp),
            kv_transfer_mib: Some(64),
            mock_kv_bytes_per_token: Some(1024),
            mock_transfer_gbps: Some(2.0),
            config: None,
        };
        let config = args.load().unwrap();
        assert_eq!(config.block_size(), 16);
        assert_eq!(config.threads(), 2);
        assert_eq!(config.namespace, "ns");
        assert_eq!(config.context_length, Some(100));
    }

    #[test]
    fn nonsense_values_are_refused() {
        let args = WorkerArgs { speedup: Some(0.0), ..Default::default() };
        assert!(args.load().unwrap_err().to_string().contains("speedup"));
        let args = WorkerArgs { block_size: Some(0), ..Default::default() };
        assert!(args.load().is_err());
        let args = WorkerArgs { device: Some("tpu".into()), ..Default::default() };
        assert!(args.load().unwrap_err().to_string().contains("unknown device"));
    }

    #[test]
    fn block_size_defaults_per_engine() {
        let native = WorkerConfig::default();
        assert_eq!(native.block_size(), 16);
        let mock = WorkerConfig { engine: EngineKind::Mock, ..WorkerConfig::default() };
        assert_eq!(mock.block_size(), 64);
    }
}
