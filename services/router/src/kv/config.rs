//! The `[kv]` section: how the `kv` policy weighs overlap against load and
//! where it looks blocks up.

use serde::{Deserialize, Serialize};
use turbine_runtime::config::InvalidSetting;
use turbine_runtime::config::defaults;

use super::KvWeights;

/// The cost function's tuning (also what `turbine bench replay` varies).
#[derive(Debug, Clone, Copy, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct KvTuning {
    /// kv policy: weight of prefill work against decode load.
    #[arg(long = "kv-prefill-load-scale", env = "TURBINE_ROUTER_KV_PREFILL_LOAD_SCALE", default_value_t = KvWeights::default().prefill_load_scale)]
    pub prefill_load_scale: f64,
    /// kv policy: prefill blocks one cached device block is worth (above 1
    /// keeps a conversation on the worker holding its prefix under load);
    /// host, disk and remote blocks are worth 0.75, 0.25 and 0.1 of it.
    #[arg(long = "kv-device-credit", env = "TURBINE_ROUTER_KV_DEVICE_CREDIT", default_value_t = KvWeights::default().device_credit)]
    pub device_credit: f64,
    /// kv policy: 0 picks the cheapest worker, above 0 samples by cost.
    #[arg(long = "kv-temperature", env = "TURBINE_ROUTER_KV_TEMPERATURE", default_value_t = KvWeights::default().temperature)]
    pub temperature: f64,
}

impl Default for KvTuning {
    fn default() -> Self {
        defaults()
    }
}

impl KvTuning {
    /// The weights these settings give.
    pub fn weights(&self) -> KvWeights {
        KvWeights { prefill_load_scale: self.prefill_load_scale, temperature: self.temperature, ..KvWeights::default() }.with_device_credit(self.device_credit)
    }
}

/// KV-aware routing's settings: the router's `[kv]` section.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct KvConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub tuning: KvTuning,
    /// kv policy: index the router's own decisions instead of the workers'
    /// KV events (for engines that publish none).
    #[arg(long = "kv-approximate", env = "TURBINE_ROUTER_KV_APPROXIMATE", num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub approximate: bool,
    /// Approximate mode: seconds a routing decision is remembered.
    #[arg(long = "kv-approx-ttl-secs", env = "TURBINE_ROUTER_KV_APPROX_TTL_SECS", default_value_t = 120.0)]
    pub approx_ttl_secs: f64,
    /// Approximate mode: (worker, block) entries remembered at most.
    #[arg(skip = 4_000_000_usize)]
    pub approx_max_blocks: usize,
    /// kv policy: ask the kv-index service at this URL (e.g.
    /// http://kv-index:50052) for each decision instead of keeping an index
    /// replica in the router; while it cannot answer, kv requests are routed
    /// by load.
    #[arg(long = "kv-index", env = "TURBINE_ROUTER_KV_INDEX")]
    pub index: Option<String>,
    /// Milliseconds a kv-index lookup may take before the request is
    /// routed by load.
    #[arg(long = "kv-index-timeout-ms", env = "TURBINE_ROUTER_KV_INDEX_TIMEOUT_MS", default_value_t = 100)]
    pub index_timeout_ms: u64,
}

impl Default for KvConfig {
    fn default() -> Self {
        defaults()
    }
}

impl KvConfig {
    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        self.tuning.weights().validate()?;
        if !(self.approx_ttl_secs.is_finite() && self.approx_ttl_secs > 0.0) {
            return Err(InvalidSetting::new("kv.approx_ttl_secs", "must be positive"));
        }
        if self.approx_max_blocks == 0 {
            return Err(InvalidSetting::new("kv.approx_max_blocks", "must be positive"));
        }
        if self.index.is_some() && self.approximate {
            return Err(InvalidSetting::new("kv.index and kv.approximate", "exclude each other: the kv-index follows the workers' events"));
        }
        if self.index_timeout_ms == 0 || self.index_timeout_ms > 10_000 {
            return Err(InvalidSetting::new("kv.index_timeout_ms", "must be between 1 and 10000"));
        }
        Ok(())
    }

    /// The default weights.
    pub fn weights(&self) -> KvWeights {
        self.tuning.weights()
    }
}
