//! Configuration of the kv-store service: defaults < `--config` file <
//! `TURBINE_*` env < flags (see `turbine_runtime::config`).

use serde::{Deserialize, Serialize};
use turbine_runtime::config::InvalidSetting;
use turbine_runtime::config::{ClusterConfig, ServerConfig, ServiceDefaults, Settings};

/// Where a kv-store listens by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvStorePorts {}

impl ServiceDefaults for KvStorePorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:50053";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_KV_STORE_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = Some("0.0.0.0:9094");
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_KV_STORE_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "10";
}

/// The kv-store's configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct KvStoreConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub server: ServerConfig<KvStorePorts>,
    /// With --redis, the store announces the blocks it holds in the
    /// namespace's KV event log, so routers credit them to every worker
    /// that reads from this store.
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: ClusterConfig,
    /// This store's name in the KV index (`kv-store/<id>/<fingerprint>`);
    /// stores announcing in one namespace need different ids. Letters,
    /// digits, `.`, `_` and `-`.
    #[arg(long, env = "TURBINE_KV_STORE_ID", default_value = "kv-store")]
    pub store_id: String,
    /// MiB of block bytes the store keeps in memory; the least recently
    /// used blocks are evicted beyond it. Each block also costs ~200 bytes
    /// of bookkeeping, counted against the same bound.
    #[arg(long, env = "TURBINE_KV_STORE_MEMORY_MIB", default_value_t = 4096)]
    pub memory_mib: u64,
    /// Directory of the disk tier (one file per block; it survives a
    /// restart). Every block put is written to it too; without it the
    /// store keeps blocks in memory only.
    #[arg(long, env = "TURBINE_KV_STORE_DISK_DIR")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_dir: Option<std::path::PathBuf>,
    /// GiB of block files the disk tier keeps; the least recently used are
    /// deleted beyond it.
    #[arg(long, env = "TURBINE_KV_STORE_DISK_GIB", default_value_t = 64)]
    pub disk_gib: u64,
    /// Serve the memory tier over UCX too (`Lease`: readers with UCX copy
    /// blocks out of the store's registered memory, one-sided) when this
    /// build has UCX; `false`: readers use the gRPC stream (`Get`).
    #[arg(long, env = "TURBINE_KV_STORE_UCX", default_value_t = true, action = clap::ArgAction::Set)]
    pub ucx: bool,
    /// Network devices UCX may use, in UCX's syntax (`eth1`, `mlx5_0:1`;
    /// `all`: every device UCX finds). UCX checks no certificate: a host
    /// that reaches a UCX device may read and write this process's
    /// memory, so name only a fabric reserved to Turbine's services.
    /// Unset: none with certificates (readers on this machine use shared
    /// memory, others Get over mutual TLS), loopback for a plaintext store
    /// on loopback, every device for a plaintext store beyond it.
    #[arg(long, env = "TURBINE_KV_STORE_UCX_DEVICES")]
    pub ucx_devices: Option<String>,
    /// Most blocks one Get or Lookup may name.
    #[arg(long, env = "TURBINE_KV_STORE_MAX_BLOCKS_PER_CALL", default_value_t = 8192)]
    pub max_blocks_per_call: usize,
}

impl Default for KvStoreConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for KvStoreConfig {
    const CONFIG_ENV: &'static str = "TURBINE_KV_STORE_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        self.server.validate()?;
        if self.store_id.is_empty() || !self.store_id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
            return Err(InvalidSetting::new("store_id", format!("{:?} must be letters, digits, '.', '_' or '-'", self.store_id)));
        }
        if self.memory_mib == 0 {
            return Err(InvalidSetting::new("memory_mib", "must be positive"));
        }
        if self.disk_dir.is_some() && self.disk_gib == 0 {
            return Err(InvalidSetting::new("disk_gib", "must be positive with a disk_dir"));
        }
        if self.max_blocks_per_call == 0 {
            return Err(InvalidSetting::new("max_blocks_per_call", "must be positive"));
        }
        Ok(())
    }
}
