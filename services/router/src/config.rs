//! Router configuration: defaults < `--config` file < `TURBINE_*` env < flags.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::router::DisaggPolicy;
use crate::kv::{KvConfig, KvWeights};
use crate::policy::Policy;

/// The router's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Address of the gRPC server (turbine.router.v1, health, reflection).
    pub grpc_addr: SocketAddr,
    /// Address of the admin HTTP server (/metrics, /livez, /readyz).
    pub admin_addr: SocketAddr,
    /// Redis URL of the worker registry (required for a standalone router).
    pub redis: Option<String>,
    /// Registry namespace.
    pub namespace: String,
    /// Default worker selection policy.
    pub policy: Policy,
    /// How often the registry is read, in milliseconds.
    pub poll_interval_ms: u64,
    /// A booking never released (lost RequestFinished) is dropped after this
    /// many seconds.
    pub booking_ttl_secs: f64,
    /// Seconds in-flight calls get to finish after SIGTERM.
    pub shutdown_grace_secs: f64,
    /// kv policy: weight of prefill work against decode load.
    pub kv_prefill_load_scale: f64,
    /// kv policy: prefill blocks one cached device block is worth.
    pub kv_device_credit: f64,
    /// kv policy: 0 picks the cheapest worker; above 0 samples.
    pub kv_temperature: f64,
    /// kv policy: index the router's own decisions (for engines that
    /// publish no KV events).
    pub kv_approximate: bool,
    /// Approximate mode: seconds a decision is remembered.
    pub kv_approx_ttl_secs: f64,
    /// kv policy: ask this kv-index service instead of following the event
    /// log into the router's own replica.
    pub kv_index: Option<String>,
    /// kv policy: milliseconds a kv-index lookup may take before the
    /// request is routed by load.
    pub kv_index_timeout_ms: u64,
    /// Disaggregated serving: prompts with more uncached tokens than this
    /// on their decode worker are computed on a prefill worker.
    pub disagg_threshold_tokens: u32,
    /// Disaggregated serving: prompts are computed on their decode worker
    /// while every prefill worker has this many prefills booked or queued.
    pub prefill_max_queue: u32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            grpc_addr: ([0, 0, 0, 0], 50051).into(),
            admin_addr: ([0, 0, 0, 0], 9092).into(),
            redis: None,
            namespace: "default".to_owned(),
            policy: Policy::LeastLoaded,
            poll_interval_ms: 250,
            booking_ttl_secs: 600.0,
            shutdown_grace_secs: 30.0,
            kv_prefill_load_scale: KvWeights::default().prefill_load_scale,
            kv_device_credit: KvWeights::default().device_credit,
            kv_temperature: 0.0,
            kv_approximate: false,
            kv_approx_ttl_secs: 120.0,
            kv_index: None,
            kv_index_timeout_ms: 100,
            disagg_threshold_tokens: DisaggPolicy::default().threshold_tokens,
            prefill_max_queue: DisaggPolicy::default().max_prefill_queue,
        }
    }
}

impl RouterConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), String> {
        if self.poll_interval_ms == 0 || self.poll_interval_ms > 60_000 {
            return Err("poll_interval_ms must be between 1 and 60000".into());
        }
        if !(self.booking_ttl_secs.is_finite() && self.booking_ttl_secs > 0.0) {
            return Err("booking_ttl_secs must be positive".into());
        }
        if !(self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0) {
            return Err("shutdown_grace_secs must be non-negative".into());
        }
        if self.kv_index.is_some() && self.kv_approximate {
            return Err("kv_index and kv_approximate exclude each other: the kv-index follows the workers' events".into());
        }
        if self.kv_index_timeout_ms == 0 || self.kv_index_timeout_ms > 10_000 {
            return Err("kv_index_timeout_ms must be between 1 and 10000".into());
        }
        if self.prefill_max_queue == 0 {
            return Err("prefill_max_queue must be positive".into());
        }
        self.kv().validate()
    }

    /// When prompts go to prefill workers.
    pub fn disagg(&self) -> DisaggPolicy {
        DisaggPolicy { threshold_tokens: self.disagg_threshold_tokens, max_prefill_queue: self.prefill_max_queue }
    }

    /// The KV routing configuration.
    pub fn kv(&self) -> KvConfig {
        let defaults = KvConfig::default();
        KvConfig {
            weights: KvWeights { prefill_load_scale: self.kv_prefill_load_scale, temperature: self.kv_temperature, ..defaults.weights }
                .with_device_credit(self.kv_device_credit),
            approximate: self.kv_approximate,
            approx_ttl_secs: self.kv_approx_ttl_secs,
            ..defaults
        }
    }
}

/// Command-line flags of `turbine-router`.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct RouterArgs {
    /// TOML config file (keys as the long flags, with underscores).
    #[arg(long, env = "TURBINE_ROUTER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:50051].
    #[arg(long, env = "TURBINE_ROUTER_GRPC_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grpc_addr: Option<SocketAddr>,
    /// Admin HTTP listen address for /metrics, /livez, /readyz [default: 0.0.0.0:9092].
    #[arg(long, env = "TURBINE_ROUTER_ADMIN_ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_addr: Option<SocketAddr>,
    /// Redis URL of the worker registry, e.g. redis://redis:6379/ (required).
    #[arg(long, env = "TURBINE_REDIS_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<String>,
    /// Registry namespace [default: default].
    #[arg(long, env = "TURBINE_NAMESPACE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Default policy [default: least-loaded].
    #[arg(long, value_enum, env = "TURBINE_ROUTER_POLICY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
    /// Registry poll interval in milliseconds [default: 250].
    #[arg(long, env = "TURBINE_ROUTER_POLL_INTERVAL_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poll_interval_ms: Option<u64>,
    /// Seconds after which an unreleased booking is dropped [default: 600].
    #[arg(long, env = "TURBINE_ROUTER_BOOKING_TTL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub booking_ttl_secs: Option<f64>,
    /// Seconds in-flight calls get to finish after SIGTERM [default: 30].
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_secs: Option<f64>,
    /// kv policy: weight of prefill work against decode load [default: 100].
    #[arg(long, env = "TURBINE_ROUTER_KV_PREFILL_LOAD_SCALE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_prefill_load_scale: Option<f64>,
    /// kv policy: prefill blocks one cached device block is worth; host,
    /// disk and remote blocks are worth 0.75, 0.25 and 0.1 of it [default: 8].
    #[arg(long, env = "TURBINE_ROUTER_KV_DEVICE_CREDIT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_device_credit: Option<f64>,
    /// kv policy: 0 picks the cheapest worker, above 0 samples by cost [default: 0].
    #[arg(long, env = "TURBINE_ROUTER_KV_TEMPERATURE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_temperature: Option<f64>,
    /// kv policy: index the router's own decisions instead of worker KV events
    /// (for engines that publish none).
    #[arg(long, env = "TURBINE_ROUTER_KV_APPROXIMATE", num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_approximate: Option<bool>,
    /// Approximate mode: seconds a routing decision is remembered [default: 120].
    #[arg(long, env = "TURBINE_ROUTER_KV_APPROX_TTL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_approx_ttl_secs: Option<f64>,
    /// kv policy: ask the kv-index service at this URL (e.g.
    /// http://kv-index:50052) for each decision instead of keeping an index
    /// replica in the router; while it cannot answer, kv requests are routed
    /// by load.
    #[arg(long, env = "TURBINE_ROUTER_KV_INDEX")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_index: Option<String>,
    /// Milliseconds a kv-index lookup may take [default: 100].
    #[arg(long, env = "TURBINE_ROUTER_KV_INDEX_TIMEOUT_MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_index_timeout_ms: Option<u64>,
    /// With prefill workers: prompts with more uncached tokens than this on
    /// their decode worker are computed on a prefill worker [default: 256].
    #[arg(long, env = "TURBINE_ROUTER_DISAGG_THRESHOLD_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disagg_threshold_tokens: Option<u32>,
    /// With prefill workers: compute prompts on the decode worker while every
    /// prefill worker has this many prefills booked or queued [default: 8].
    #[arg(long, env = "TURBINE_ROUTER_PREFILL_MAX_QUEUE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_max_queue: Option<u32>,
}

impl RouterArgs {
    /// Resolves the full configuration.
    pub fn load(&self) -> anyhow::Result<RouterConfig> {
        let config: RouterConfig = turbine_runtime::config::load(self.config.as_deref(), self)?;
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}
