//! Configuration of the planner service: defaults < `--config` file <
//! `TURBINE_*` env < flags (see `turbine_runtime::config`).

use serde::{Deserialize, Serialize};
use turbine_runtime::config::InvalidSetting;
use turbine_runtime::config::{ClusterConfig, ServerConfig, ServiceDefaults, Settings};

use crate::act::connector::ConnectorKind;
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
    /// Where the planner keeps its state, what it sizes from.
    #[command(flatten)]
    #[serde(flatten)]
    pub planning: PlanningConfig,
    /// The gateways' metrics pages (`http://gateway:8000/metrics`, comma
    /// separated or repeated): every interval the planner reads the
    /// requests, tokens and latencies of the interval from them, and the
    /// workers of each pool from the registry (--redis). Without them the
    /// planner keeps and serves its state but observes nothing.
    #[arg(long, env = "TURBINE_PLANNER_GATEWAY_METRICS", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gateway_metrics: Vec<String>,
    /// Who carries out the decisions' actions: `virtual` publishes them
    /// (WatchPlan) for an external system, which reports each outcome with
    /// CompleteAction; `local` starts and drains turbine-worker processes
    /// on this machine (needs --redis: the workers join its registry);
    /// `kubernetes` sets the replicas of each pool's Deployment (builds
    /// with the kubernetes feature).
    #[arg(long, env = "TURBINE_PLANNER_CONNECTOR", value_enum, default_value_t)]
    #[serde(default)]
    pub connector: ConnectorKind,
    /// The kubernetes connector's namespace; by default the planner's own
    /// (its service account's in a pod, else the kubeconfig context's).
    #[arg(long, env = "TURBINE_PLANNER_KUBERNETES_NAMESPACE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_namespace: Option<String>,
    /// Each pool's Deployment as pool=deployment (comma separated or
    /// repeated); a pool not listed is the Deployment turbine-worker-<pool>.
    #[arg(long, env = "TURBINE_PLANNER_KUBERNETES_DEPLOYMENTS", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kubernetes_deployments: Vec<String>,
    /// The local connector's worker executable; by default turbine-worker
    /// beside the planner's own (or `turbine worker` when the planner runs
    /// as `turbine planner serve`), else on PATH.
    #[arg(long, env = "TURBINE_PLANNER_LOCAL_WORKER_BINARY")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_worker_binary: Option<std::path::PathBuf>,
    /// Flags every local worker gets, separated by spaces (engine, model,
    /// cache sizes: `--engine mock --speedup 10`); the connector sets the
    /// role, registry, namespace, worker id and ports itself.
    #[arg(long, env = "TURBINE_PLANNER_LOCAL_WORKER_ARGS", default_value = "", allow_hyphen_values = true)]
    #[serde(default)]
    pub local_worker_args: String,
    /// Where the local connector keeps each worker's record, log and
    /// addresses; a planner restarted on the same folder adopts the workers
    /// still running. Default: turbine-planner-<namespace> in the system's
    /// temporary folder.
    #[arg(long, env = "TURBINE_PLANNER_LOCAL_STATE_DIR")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_state_dir: Option<std::path::PathBuf>,
    /// Seconds a started local worker has to serve (load its model and
    /// register) before the action fails.
    #[arg(long, env = "TURBINE_PLANNER_LOCAL_READY_TIMEOUT_SECS", default_value_t = 300)]
    pub local_ready_timeout_secs: u64,
    /// Seconds a draining local worker has to finish its streams and exit
    /// before it is killed.
    #[arg(long, env = "TURBINE_PLANNER_LOCAL_DRAIN_TIMEOUT_SECS", default_value_t = 900)]
    pub local_drain_timeout_secs: u64,
}

/// What a planner keeps its state in and sizes from, wherever it runs
/// (`turbine planner serve`, `turbine run --planner`).
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct PlanningConfig {
    /// Where the planner keeps its targets, decisions and actions:
    /// postgres://user:password@host:port/database, or sqlite:path (a file,
    /// created if missing) on one machine. The schema is migrated at start.
    #[arg(long, env = "TURBINE_PLANNER_DATABASE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<String>,
    /// The profile of the pools' workers (`turbine profile --output`): the
    /// planner sizes pools from it. Needed to observe and decide.
    #[arg(long, env = "TURBINE_PLANNER_PROFILE")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<std::path::PathBuf>,
    /// Intervals per season of the seasonal predictor (a daily cycle at
    /// 30-second intervals: 2880); it forecasts by the moving average until
    /// it has seen two seasons.
    #[arg(long, env = "TURBINE_PLANNER_SEASON_INTERVALS", default_value_t = SEASON_INTERVALS)]
    pub season_intervals: usize,
}

/// Intervals per season by default: a day of 30-second intervals.
pub const SEASON_INTERVALS: usize = 2880;

impl Default for PlanningConfig {
    fn default() -> Self {
        Self { database: None, profile: None, season_intervals: SEASON_INTERVALS }
    }
}

impl PlanningConfig {
    /// Checks the settings (the database is optional here: where it is
    /// required is the caller's to say).
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(2..=100_000).contains(&self.season_intervals) {
            return Err(InvalidSetting::new("season_intervals", format!("{}, must be 2 to 100000", self.season_intervals)));
        }
        match &self.database {
            Some(url) => Backend::of(url).map(|_| ()).map_err(|error| InvalidSetting::new("database", error.to_string())),
            None => Ok(()),
        }
    }
}

impl Default for PlannerConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for PlannerConfig {
    const CONFIG_ENV: &'static str = "TURBINE_PLANNER_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        self.server.validate()?;
        for url in &self.gateway_metrics {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(InvalidSetting::new("gateway_metrics", format!("{url:?} is not an http:// or https:// URL")));
            }
        }
        if !self.gateway_metrics.is_empty() && self.cluster.redis.is_none() {
            return Err(InvalidSetting::new("gateway_metrics", "observing needs the worker registry too (--redis)"));
        }
        if !self.gateway_metrics.is_empty() && self.planning.profile.is_none() {
            return Err(InvalidSetting::new("gateway_metrics", "deciding needs the workers' profile too (--profile, written by turbine profile)"));
        }
        if self.connector == ConnectorKind::Local && self.cluster.redis.is_none() {
            return Err(InvalidSetting::new("connector", "local workers join the registry; give it (--redis)"));
        }
        if self.connector == ConnectorKind::Kubernetes && !cfg!(feature = "kubernetes") {
            return Err(InvalidSetting::new("connector", "this build has no kubernetes connector (build turbine with --features kubernetes)"));
        }
        if self.connector == ConnectorKind::Hosted {
            return Err(InvalidSetting::new("connector", "hosted workers run inside turbine run (--planner)"));
        }
        crate::act::kubernetes::parse_mapping(&self.kubernetes_deployments)
            .map_err(|problem| InvalidSetting::new("kubernetes_deployments", problem.to_string()))?;
        for (field, seconds) in [("local_ready_timeout_secs", self.local_ready_timeout_secs), ("local_drain_timeout_secs", self.local_drain_timeout_secs)] {
            if !(1..=86_400).contains(&seconds) {
                return Err(InvalidSetting::new(field, format!("{seconds}, must be 1 to 86400")));
            }
        }
        self.planning.validate()?;
        match &self.planning.database {
            None => Err(InvalidSetting::new(
                "database",
                "required (--database or TURBINE_PLANNER_DATABASE): postgres://user@host:port/database, or sqlite:path on one machine",
            )),
            Some(_) => Ok(()),
        }
    }
}

impl PlannerConfig {
    /// The local connector's settings (meaningful with `--connector
    /// local`, which requires `--redis`).
    pub fn local_settings(&self) -> crate::act::local::LocalSettings {
        let namespace = self.cluster.namespace.clone();
        let (worker_binary, worker_subcommand) = match &self.local_worker_binary {
            Some(binary) => (binary.clone(), None),
            None => default_worker_command(),
        };
        crate::act::local::LocalSettings {
            worker_binary,
            worker_subcommand,
            worker_args: self.local_worker_args.split_whitespace().map(str::to_owned).collect(),
            state_dir: self.local_state_dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("turbine-planner-{namespace}"))),
            redis: self.cluster.redis.clone().unwrap_or_default(),
            namespace,
            ready_timeout: std::time::Duration::from_secs(self.local_ready_timeout_secs),
            drain_timeout: std::time::Duration::from_secs(self.local_drain_timeout_secs),
        }
    }
}

/// turbine-worker beside this executable; `turbine worker` when this is
/// `turbine`; else turbine-worker on PATH.
fn default_worker_command() -> (std::path::PathBuf, Option<String>) {
    let exe = std::env::current_exe().ok();
    if let Some(exe) = &exe {
        if exe.file_stem().is_some_and(|stem| stem == "turbine") {
            return (exe.clone(), Some("worker".to_owned()));
        }
        if let Some(beside) = exe.parent().map(|dir| dir.join("turbine-worker")).filter(|path| path.is_file()) {
            return (beside, None);
        }
    }
    ("turbine-worker".into(), None)
}
