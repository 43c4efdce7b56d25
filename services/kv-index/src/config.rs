//! Configuration of the kv-index service.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Resolved configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvIndexConfig {
    /// gRPC listen address (turbine.kvindex.v1.KvIndex, health, reflection).
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address (/metrics, /livez, /readyz).
    pub admin_addr: SocketAddr,
    /// Redis URL: event log, snapshots and worker registry.
    pub redis: Option<String>,
    /// Registry and event-log namespace.
    pub namespace: String,
    /// Seconds between snapshots written to Redis (0: never).
    pub snapshot_interval_secs: f64,
    /// Milliseconds between reads of the worker registry.
    pub registry_poll_ms: u64,
    /// A worker missing from the registry (lease expired) this many seconds
    /// loses its blocks from the index.
    pub lease_grace_secs: f64,
    /// Seconds in-flight calls get to finish after SIGTERM.
    pub shutdown_grace_secs: f64,
}

impl Default for KvIndexConfig {
    fn default() -> Self {
        Self {
            grpc_addr: ([0, 0, 0, 0], 50052).into(),
            admin_addr: ([0, 0, 0, 0], 9093).into(),
            redis: None,
            namespace: "default".to_owned(),
            snapshot_interval_secs: 30.0,
            registry_poll_ms: 1000,
            lease_grace_secs: 5.0,
            shutdown_grace_secs: 10.0,
        }
    }
}

impl KvIndexConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.snapshot_interval_secs.is_finite() && self.snapshot_interval_secs >= 0.0) {
            return Err("snapshot_interval_secs must be non-negative (0 turns snapshots off)".into());
        }
        if self.registry_poll_ms == 0 || self.registry_poll_ms > 60_000 {
            return Err("registry_poll_ms must be between 1 and 60000".into());
        }
        if !(self.lease_grace_secs.is_finite() && self.lease_grace_secs >= 0.0) {
            return Err("lease_grace_secs must be non-negative".into());
        }
        if !(self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0) {
            return Err("shutdown_grace_secs must be non-negative".into());
        }
        Ok(())
    }
}

/// Command-line flags of `turbine-kv-index`.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct KvIndexArgs {
    /// TOML config file (keys as the long flags, with underscores).
    #[arg(long, env = "TURBINE_KV_INDEX_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:50052].
    #[arg(long, env = "TURBINE_KV_INDEX_GRPC_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_addr: Option<SocketAddr>,
    /// Admin HTTP listen address for /metrics, /livez, /readyz [default: 0.0.0.0:9093].
    #[arg(long, env = "TURBINE_KV_INDEX_ADMIN_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_addr: Option<SocketAddr>,
    /// Redis URL holding the event log, snapshots and registry, e.g. redis://redis:6379/ (required).
    #[arg(long, env = "TURBINE_REDIS_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<String>,
    /// Namespace [default: default].
    #[arg(long, env = "TURBINE_NAMESPACE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Seconds between index snapshots written to Redis; 0 turns them off [default: 30].
    #[arg(long, env = "TURBINE_KV_INDEX_SNAPSHOT_INTERVAL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_interval_secs: Option<f64>,
    /// Registry poll interval in milliseconds [default: 1000].
    #[arg(long, env = "TURBINE_KV_INDEX_REGISTRY_POLL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry_poll_ms: Option<u64>,
    /// Seconds a worker may be missing from the registry before its blocks
    /// leave the index [default: 5].
    #[arg(long, env = "TURBINE_KV_INDEX_LEASE_GRACE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_grace_secs: Option<f64>,
    /// Seconds in-flight calls get to finish after SIGTERM [default: 10].
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_secs: Option<f64>,
}

impl KvIndexArgs {
    /// Resolves the full configuration.
    pub fn load(&self) -> anyhow::Result<KvIndexConfig> {
        let config: KvIndexConfig = turbine_runtime::config::load(self.config.as_deref(), self)?;
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}
