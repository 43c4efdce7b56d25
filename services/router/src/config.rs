//! Router configuration: defaults < `--config` file < `TURBINE_*` env <
//! flags (see `turbine_runtime::config`). The routing section is shared
//! with `turbine run`.

use serde::{Deserialize, Serialize};
use turbine_runtime::config::InvalidSetting;
use turbine_runtime::config::{ClusterConfig, ServerConfig, ServiceDefaults, Settings, defaults};

use crate::kv::KvConfig;
use crate::policy::Policy;
use crate::router::DisaggPolicy;

/// Where a router listens by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterPorts {}

impl ServiceDefaults for RouterPorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:50051";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_ROUTER_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = Some("0.0.0.0:9092");
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_ROUTER_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "30";
}

/// The router's configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct RouterConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub server: ServerConfig<RouterPorts>,
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: ClusterConfig,
    #[command(flatten)]
    #[serde(flatten)]
    pub routing: RoutingConfig,
    /// Registry poll interval in milliseconds.
    #[arg(long, env = "TURBINE_ROUTER_POLL_INTERVAL_MS", default_value_t = 250)]
    pub poll_interval_ms: u64,
    /// Seconds after which a booking never released (a lost
    /// RequestFinished) is dropped.
    #[arg(long, env = "TURBINE_ROUTER_BOOKING_TTL_SECS", default_value_t = 600.0)]
    pub booking_ttl_secs: f64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for RouterConfig {
    const CONFIG_ENV: &'static str = "TURBINE_ROUTER_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        self.server.validate()?;
        if self.poll_interval_ms == 0 || self.poll_interval_ms > 60_000 {
            return Err(InvalidSetting::new("poll_interval_ms", "must be between 1 and 60000"));
        }
        if !(self.booking_ttl_secs.is_finite() && self.booking_ttl_secs > 0.0) {
            return Err(InvalidSetting::new("booking_ttl_secs", "must be positive"));
        }
        self.routing.validate()
    }
}

/// How workers are chosen: the policy, KV-aware routing's `[kv]` section,
/// and when prompts go to prefill workers.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct RoutingConfig {
    /// Default worker selection policy (kv: cache overlap against load,
    /// fed by the workers' KV events).
    #[arg(long, value_enum, env = "TURBINE_ROUTER_POLICY", default_value_t = Policy::LeastLoaded)]
    pub policy: Policy,
    #[command(flatten)]
    pub kv: KvConfig,
    /// With prefill workers: prompts with more uncached tokens than this on
    /// their decode worker are computed on a prefill worker.
    #[arg(long, env = "TURBINE_ROUTER_DISAGG_THRESHOLD_TOKENS", default_value_t = DisaggPolicy::default().threshold_tokens)]
    pub disagg_threshold_tokens: u32,
    /// With prefill workers: compute prompts on the decode worker while
    /// every prefill worker has this many prefills booked or queued.
    #[arg(long, env = "TURBINE_ROUTER_PREFILL_MAX_QUEUE", default_value_t = DisaggPolicy::default().max_prefill_queue)]
    pub prefill_max_queue: u32,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        defaults()
    }
}

impl RoutingConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.prefill_max_queue == 0 {
            return Err(InvalidSetting::new("prefill_max_queue", "must be positive"));
        }
        self.kv.validate()
    }

    /// When prompts go to prefill workers.
    pub fn disagg(&self) -> DisaggPolicy {
        DisaggPolicy { threshold_tokens: self.disagg_threshold_tokens, max_prefill_queue: self.prefill_max_queue }
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
        config: Layered<RouterConfig>,
    }

    fn parse(args: &[&str]) -> Result<RouterConfig, String> {
        Cli::try_parse_from(std::iter::once("turbine-router").chain(args.iter().copied())).map(|cli| cli.config.0).map_err(|error| error.to_string())
    }

    #[test]
    fn the_kv_settings_are_a_typed_section() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), "policy = \"kv\"\nprefill_max_queue = 3\n[kv]\ndevice_credit = 1.0\nprefill_load_scale = 1.0\napproximate = true\n")
            .unwrap();
        let config = parse(&["--config", file.path().to_str().unwrap(), "--kv-temperature", "0.5"]).unwrap();
        assert_eq!(config.routing.policy, Policy::Kv);
        assert_eq!(config.routing.disagg().max_prefill_queue, 3);
        let weights = config.routing.kv.weights();
        assert_eq!((weights.device_credit, weights.host_credit, weights.prefill_load_scale, weights.temperature), (1.0, 0.75, 1.0, 0.5));
        assert!(config.routing.kv.approximate);
        let misplaced = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(misplaced.path(), "kv_device_credit = 1.0\n").unwrap();
        assert!(parse(&["--config", misplaced.path().to_str().unwrap()]).unwrap_err().contains("unknown key `kv_device_credit`"));
    }

    #[test]
    fn flags_keep_their_names_and_defaults() {
        let config = parse(&["--kv-device-credit", "2", "--kv-approximate", "--policy", "round-robin", "--redis", "redis://r/"]).unwrap();
        assert_eq!((config.routing.kv.tuning.device_credit, config.routing.kv.approximate, config.routing.policy), (2.0, true, Policy::RoundRobin));
        assert_eq!(config.cluster.redis.as_deref(), Some("redis://r/"));
        let defaults = RouterConfig::default();
        assert_eq!((defaults.routing.policy, defaults.poll_interval_ms, defaults.server.grpc_addr.port()), (Policy::LeastLoaded, 250, 50051));
        assert_eq!(defaults.routing.kv.weights(), crate::KvWeights::default());
    }

    #[test]
    fn conflicting_settings_are_refused() {
        assert!(parse(&["--kv-index", "http://x:1", "--kv-approximate"]).unwrap_err().contains("exclude each other"));
        assert!(parse(&["--kv-device-credit=-1"]).unwrap_err().contains("device_credit"));
        assert!(parse(&["--poll-interval-ms", "0"]).unwrap_err().contains("poll_interval_ms"));
    }
}
