//! Configuration of the kv-index service: defaults < `--config` file <
//! `TURBINE_*` env < flags (see `turbine_runtime::config`).

use serde::{Deserialize, Serialize};
use turbine_runtime::config::InvalidSetting;
use turbine_runtime::config::{ClusterConfig, ServerConfig, ServiceDefaults, Settings};

/// Where a kv-index listens by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvIndexPorts {}

impl ServiceDefaults for KvIndexPorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:50052";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_KV_INDEX_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = Some("0.0.0.0:9093");
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_KV_INDEX_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "10";
}

/// The kv-index's configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct KvIndexConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub server: ServerConfig<KvIndexPorts>,
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: ClusterConfig,
    /// Seconds between index snapshots written to Redis; 0 turns them off.
    #[arg(long, env = "TURBINE_KV_INDEX_SNAPSHOT_INTERVAL_SECS", default_value_t = 30.0)]
    pub snapshot_interval_secs: f64,
    /// Registry poll interval in milliseconds.
    #[arg(long, env = "TURBINE_KV_INDEX_REGISTRY_POLL_MS", default_value_t = 1000)]
    pub registry_poll_ms: u64,
    /// Seconds a worker may be missing from the registry (its lease expired)
    /// before its blocks leave the index.
    #[arg(long, env = "TURBINE_KV_INDEX_LEASE_GRACE_SECS", default_value_t = 5.0)]
    pub lease_grace_secs: f64,
}

impl Default for KvIndexConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for KvIndexConfig {
    const CONFIG_ENV: &'static str = "TURBINE_KV_INDEX_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        self.server.validate()?;
        if !(self.snapshot_interval_secs.is_finite() && self.snapshot_interval_secs >= 0.0) {
            return Err(InvalidSetting::new("snapshot_interval_secs", "must be non-negative (0 turns snapshots off)"));
        }
        if self.registry_poll_ms == 0 || self.registry_poll_ms > 60_000 {
            return Err(InvalidSetting::new("registry_poll_ms", "must be between 1 and 60000"));
        }
        if !(self.lease_grace_secs.is_finite() && self.lease_grace_secs >= 0.0) {
            return Err(InvalidSetting::new("lease_grace_secs", "must be non-negative"));
        }
        Ok(())
    }
}
