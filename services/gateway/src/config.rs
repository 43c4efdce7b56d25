//! Gateway configuration: defaults < `--config` file < `TURBINE_*` env < flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The gateway's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// OpenAI REST (plus /metrics, /livez, /readyz, /health).
    pub http_addr: SocketAddr,
    /// gRPC (turbine.gateway.v1.Inference, health, reflection).
    pub grpc_addr: SocketAddr,
    /// gRPC endpoint of the router (required for a standalone gateway).
    pub router: Option<String>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Requests served at once; more get 429 with Retry-After.
    pub max_concurrent_requests: usize,
    /// How often the served models are refreshed, in milliseconds.
    pub model_refresh_ms: u64,
    /// Seconds in-flight streams get to finish after SIGTERM.
    pub shutdown_grace_secs: f64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            http_addr: ([0, 0, 0, 0], 8000).into(),
            grpc_addr: ([0, 0, 0, 0], 50050).into(),
            router: None,
            max_body_bytes: 4 << 20,
            max_concurrent_requests: 4096,
            model_refresh_ms: 1000,
            shutdown_grace_secs: 30.0,
        }
    }
}

impl GatewayConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_body_bytes < 1024 {
            return Err("max_body_bytes must be at least 1024".into());
        }
        if self.max_concurrent_requests == 0 {
            return Err("max_concurrent_requests must be positive".into());
        }
        if self.model_refresh_ms == 0 {
            return Err("model_refresh_ms must be positive".into());
        }
        if !(self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0) {
            return Err("shutdown_grace_secs must be non-negative".into());
        }
        Ok(())
    }
}

/// Command-line flags of `turbine-gateway`.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct GatewayArgs {
    /// TOML config file (keys as the long flags, with underscores).
    #[arg(long, env = "TURBINE_GATEWAY_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// OpenAI REST listen address [default: 0.0.0.0:8000].
    #[arg(long, env = "TURBINE_GATEWAY_HTTP_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_addr: Option<SocketAddr>,
    /// gRPC listen address [default: 0.0.0.0:50050].
    #[arg(long, env = "TURBINE_GATEWAY_GRPC_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_addr: Option<SocketAddr>,
    /// Router gRPC endpoint, e.g. http://router:50051 (required).
    #[arg(long, env = "TURBINE_ROUTER_ENDPOINT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<String>,
    /// Largest request body in bytes [default: 4194304].
    #[arg(long, env = "TURBINE_GATEWAY_MAX_BODY_BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<usize>,
    /// Requests served at once before 429 [default: 4096].
    #[arg(long, env = "TURBINE_GATEWAY_MAX_CONCURRENT_REQUESTS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent_requests: Option<usize>,
    /// Model list refresh interval in milliseconds [default: 1000].
    #[arg(long, env = "TURBINE_GATEWAY_MODEL_REFRESH_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_refresh_ms: Option<u64>,
    /// Seconds in-flight streams get to finish after SIGTERM [default: 30].
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_secs: Option<f64>,
}

impl GatewayArgs {
    /// Resolves the full configuration.
    pub fn load(&self) -> anyhow::Result<GatewayConfig> {
        let config: GatewayConfig = turbine_runtime::config::load(self.config.as_deref(), self)?;
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}
