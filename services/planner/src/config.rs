//! Configuration of the planner service: defaults < `--config` file <
//! `TURBINE_*` env < flags (see `turbine_runtime::config`).

use serde::{Deserialize, Serialize};
use turbine_runtime::config::{ClusterConfig, ServerConfig, ServiceDefaults, Settings};

use crate::connector::ConnectorKind;
use crate::ledger::Backend;

/// Where a planner listens by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannerPorts {}

impl ServiceDefaults for PlannerPorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:50054";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_PLANNER_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = Some("0.0.0.0:9095");
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_PLANNER_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "10";
}

/// The planner's configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct PlannerConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub server: ServerConfig<PlannerPorts>,
    /// The deployment the planner sizes: its namespace names the planner's
    /// rows in the database too, so planners of several deployments can
    /// share one.
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: ClusterConfig,
    /// Where the planner keeps its targets, decisions and actions:
    /// postgres://user:password@host:port/database, or sqlite:path (a file,
    /// created if missing) on one machine. The schema is migrated at start.
    #[arg(long, env = "TURBINE_PLANNER_DATABASE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<String>,
    /// The gateways' metrics pages (`http://gateway:8000/metrics`, comma
    /// separated or repeated): every interval the planner reads the
    /// requests, tokens and latencies of the interval from them, and the
    /// workers of each pool from the registry (--redis). Without them the
    /// planner keeps and serves its state but observes nothing.
    #[arg(long, env = "TURBINE_PLANNER_GATEWAY_METRICS", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gateway_metrics: Vec<String>,
    /// The profile of the pools' workers (`turbine profile --output`): the
    /// planner sizes pools from it. Needed to observe and decide.
    #[arg(long, env = "TURBINE_PLANNER_PROFILE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<std::path::PathBuf>,
    /// Who carries out the decisions' actions: `virtual` publishes them
    /// (WatchPlan) for an external system, which reports each outcome with
    /// CompleteAction.
    #[arg(long, env = "TURBINE_PLANNER_CONNECTOR", value_enum, default_value_t)]
    #[serde(default)]
    pub connector: ConnectorKind,
    /// Intervals per season of the seasonal predictor (a daily cycle at
    /// 30-second intervals: 2880); it forecasts by the moving average until
    /// it has seen two seasons.
    #[arg(long, env = "TURBINE_PLANNER_SEASON_INTERVALS", default_value_t = 2880)]
    pub season_intervals: usize,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for PlannerConfig {
    const CONFIG_ENV: &'static str = "TURBINE_PLANNER_CONFIG";

    fn validate(&self) -> Result<(), String> {
        self.server.validate()?;
        for url in &self.gateway_metrics {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("gateway_metrics: {url:?} is not an http:// or https:// URL"));
            }
        }
        if !self.gateway_metrics.is_empty() && self.cluster.redis.is_none() {
            return Err("gateway_metrics: observing needs the worker registry too (--redis)".into());
        }
        if !self.gateway_metrics.is_empty() && self.profile.is_none() {
            return Err("gateway_metrics: deciding needs the workers' profile too (--profile, written by turbine profile)".into());
        }
        if !(2..=100_000).contains(&self.season_intervals) {
            return Err(format!("season_intervals: {}, must be 2 to 100000", self.season_intervals));
        }
        match &self.database {
            None => Err("database: required (--database or TURBINE_PLANNER_DATABASE): postgres://user@host:port/database, or sqlite:path on one machine".into()),
            Some(url) => Backend::of(url).map(|_| ()).map_err(|error| format!("database: {error}")),
        }
    }
}
