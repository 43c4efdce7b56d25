//! `turbine run`'s configuration: the embedded cluster's own settings (how
//! many workers, where the gateway listens) and each service's sections,
//! composed from the services' own declarations. In a `--config` file the
//! sections are tables: `[gateway]`, `[router]` (with `[router.kv]`),
//! `[worker]`, `[planner]`.

use std::net::IpAddr;
use std::path::PathBuf;
use turbine_runtime::config::InvalidSetting;

use clap::Command;
use serde::{Deserialize, Serialize};
use turbine_gateway::AdmissionConfig;
use turbine_planner::config::PlanningConfig;
use turbine_router::RoutingConfig;
use turbine_runtime::config::{ClientLimits, Settings, settings_defaults};
use turbine_worker::{EngineConfig, TransferConfig};

/// The host-memory KV tier of each worker of `turbine run`, MiB: 46,000
/// tokens of the default model (360 KiB per 16-token block); a bound, not
/// an allocation.
pub const RUN_HOST_CACHE_MIB: &str = "1024";

/// The planner's database under `turbine run` unless given: a SQLite file
/// in the model cache folder.
pub const RUN_PLANNER_DATABASE: &str = "planner.db";

/// `turbine run`'s configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct RunConfig {
    /// Address to listen on: loopback (this machine only) by default;
    /// 0.0.0.0 or another host's address exposes the API and gRPC to the
    /// network and needs API keys (--api-keys; keys travel in plaintext
    /// unless TLS terminates in front) or --insecure.
    #[arg(long, env = "TURBINE_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Listen on a --host other machines reach although nothing
    /// authenticates callers there: any host that reaches it may generate
    /// and call every rpc. For a network you trust entirely.
    #[arg(long, env = "TURBINE_INSECURE")]
    #[serde(default)]
    pub insecure: bool,
    /// OpenAI REST port (0: a free one).
    #[arg(long, env = "TURBINE_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,
    /// gRPC port of turbine.gateway.v1.Inference (0: a free one).
    #[arg(long, env = "TURBINE_GRPC_PORT", default_value_t = 50050)]
    pub grpc_port: u16,
    /// Also serve the kv-index's API (turbine.kvindex.v1) on this port,
    /// answering from the cluster's index (0: a free one).
    #[arg(long, env = "TURBINE_KV_INDEX_PORT")]
    pub kv_index_port: Option<u16>,
    /// Also run a kv-store (shared KV blocks, turbine.kvstore.v1) on this
    /// port (0: a free one); the workers put their blocks there and fetch
    /// prefixes other workers computed (unless --kv-store names another
    /// store). Needs the host tier (on by default here).
    #[arg(long, env = "TURBINE_KV_STORE_PORT")]
    pub kv_store_port: Option<u16>,
    /// Also run a planner, on PORT (turbine.planner.v1; 50054, the
    /// planner's own default, when none is given; 0: a free one): it sizes
    /// the workers to the targets an operator sets with SetTargets
    /// (grpcurl), starting and draining workers in this process, and keeps
    /// its state in --planner-database. Needs --planner-profile.
    #[arg(long = "planner", value_name = "PORT", env = "TURBINE_PLANNER_PORT", num_args = 0..=1, default_missing_value = "50054")]
    pub planner_port: Option<u16>,
    /// Number of workers (engines) in the process.
    #[arg(long, env = "TURBINE_WORKERS", default_value_t = 1)]
    pub workers: usize,
    /// Disaggregated serving: prefill workers (with --decode-workers; the
    /// two replace --workers). Long prompts are computed on a prefill worker
    /// and their KV blocks read by a decode worker over loopback sockets.
    #[arg(long, env = "TURBINE_PREFILL_WORKERS", default_value_t = 0, requires = "decode_workers")]
    pub prefill_workers: usize,
    /// Disaggregated serving: decode workers (see --prefill-workers).
    #[arg(long, env = "TURBINE_DECODE_WORKERS", default_value_t = 0, requires = "prefill_workers")]
    pub decode_workers: usize,
    /// Seconds in-flight streams get to finish after SIGTERM.
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS", default_value_t = 30.0)]
    pub shutdown_grace_secs: f64,
    /// Once listening, write the gateway's bound addresses here as JSON.
    #[arg(long, value_name = "FILE")]
    pub addresses_file: Option<PathBuf>,
    #[command(flatten, next_help_heading = "Client connections at the gateways")]
    #[serde(flatten)]
    pub clients: ClientLimits,
    #[command(flatten, next_help_heading = "Gateway ([gateway] in the config file)")]
    pub gateway: AdmissionConfig,
    #[command(flatten, next_help_heading = "Router ([router], [router.kv])")]
    pub router: RoutingConfig,
    #[command(flatten, next_help_heading = "Workers ([worker])")]
    pub worker: RunWorkerConfig,
    #[command(flatten, next_help_heading = "Planner ([planner]; with --planner)")]
    pub planner: PlanningConfig,
}

/// What every worker of the embedded cluster runs.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct RunWorkerConfig {
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineConfig,
    #[command(flatten)]
    #[serde(flatten)]
    pub transfer: TransferConfig,
}

impl Default for RunConfig {
    fn default() -> Self {
        settings_defaults()
    }
}

impl Settings for RunConfig {
    const CONFIG_ENV: &'static str = "TURBINE_RUN_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        if self.workers == 0 {
            return Err(InvalidSetting::new("workers", "must be at least 1"));
        }
        if !self.host.is_loopback() && !self.insecure && !self.gateway.keys_required() {
            return Err(InvalidSetting::new(
                "host",
                format!(
                    "{} exposes the API and gRPC to other machines with nothing authenticating callers: keep the default loopback (127.0.0.1), require API keys (--api-keys FILE or --api-keys-database URL; `turbine keys new` makes them), or pass --insecure on a network you trust entirely",
                    self.host
                ),
            ));
        }
        let disaggregated = self.prefill_workers + self.decode_workers > 0;
        if disaggregated && (self.prefill_workers == 0 || self.decode_workers == 0) {
            return Err(InvalidSetting::new("prefill_workers and decode_workers", "disaggregated serving needs at least one prefill and one decode worker"));
        }
        if !(self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0) {
            return Err(InvalidSetting::new("shutdown_grace_secs", "must be non-negative"));
        }
        self.clients.validate()?;
        self.gateway.validate()?;
        self.router.validate()?;
        self.worker.engine.validate()?;
        self.worker.transfer.validate()?;
        self.planner.validate().map_err(|error| error.within("planner."))?;
        if self.planner_port.is_some() && self.planner.profile.is_none() {
            return Err(InvalidSetting::new(
                "planner.profile",
                "the planner sizes the workers from their profile: give --planner-profile (written by turbine profile)",
            ));
        }
        Ok(())
    }

    /// One process on one machine: requests are routed by KV overlap (the
    /// workers' events reach the router's index directly), the gateway
    /// learns new workers within half a second, and every worker keeps a
    /// host-memory KV tier (G2) of `RUN_HOST_CACHE_MIB`.
    fn adjust(command: Command) -> Command {
        command
            .mut_arg("policy", |arg| arg.default_value("kv"))
            .mut_arg("model_refresh_ms", |arg| arg.default_value("500"))
            .mut_arg("host_cache_mib", |arg| arg.default_value(RUN_HOST_CACHE_MIB))
            // The planner's own flags, named for what they are here.
            .mut_arg("database", |arg| {
                arg.long("planner-database")
                    .help("Where the planner keeps its targets, decisions and actions (default: sqlite:planner.db in the model cache folder, kept across restarts); postgres://user:password@host:port/database also works")
            })
            .mut_arg("profile", |arg| arg.long("planner-profile"))
            .mut_arg("season_intervals", |arg| arg.long("planner-season-intervals"))
    }
}

impl RunConfig {
    /// The workers to start, by id and role.
    pub fn roles(&self) -> Vec<(String, turbine_worker::WorkerRole)> {
        use turbine_worker::WorkerRole;
        if self.prefill_workers + self.decode_workers > 0 {
            (0..self.prefill_workers)
                .map(|i| (format!("prefill-{i}"), WorkerRole::Prefill))
                .chain((0..self.decode_workers).map(|i| (format!("decode-{i}"), WorkerRole::Decode)))
                .collect()
        } else {
            (0..self.workers).map(|i| (format!("worker-{i}"), WorkerRole::Aggregated)).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use turbine_router::Policy;
    use turbine_runtime::config::Layered;
    use turbine_worker::{EngineKind, KvTransport};

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        config: Layered<RunConfig>,
    }

    fn parse(args: &[&str]) -> Result<RunConfig, String> {
        Cli::try_parse_from(std::iter::once("turbine-run").chain(args.iter().copied())).map(|cli| cli.config.0).map_err(|error| error.to_string())
    }

    #[test]
    fn it_listens_on_loopback_unless_exposed_with_insecure() {
        assert!(parse(&[]).unwrap().host.is_loopback());
        let refused = parse(&["--host", "0.0.0.0"]).unwrap_err();
        assert!(refused.contains("host: 0.0.0.0") && refused.contains("--insecure"), "{refused}");
        let exposed = parse(&["--host", "0.0.0.0", "--insecure"]).unwrap();
        assert!(exposed.host.is_unspecified() && exposed.insecure);
        assert!(refused.contains("--api-keys"), "{refused}");
        let keyed = parse(&["--host", "0.0.0.0", "--api-keys", "/etc/turbine/keys.toml"]).unwrap();
        assert!(keyed.host.is_unspecified() && !keyed.insecure, "API keys authenticate every caller");
    }

    #[test]
    fn the_services_own_defaults_apply_except_where_one_process_differs() {
        let config = parse(&[]).unwrap();
        assert_eq!(config, RunConfig::default());
        assert_eq!(config.router.policy, Policy::Kv, "turbine run routes by KV overlap");
        assert_eq!(config.gateway.model_refresh_ms, 500);
        assert_eq!(config.worker.engine.host_cache_mib, 1024, "turbine run keeps a host tier");
        assert_eq!(EngineConfig::default().host_cache_mib, 0, "a worker of its own does not");
        assert_eq!(config.worker.engine, EngineConfig { host_cache_mib: 1024, ..EngineConfig::default() }, "the worker's own defaults otherwise");
        assert_eq!(config.router.kv, turbine_router::KvConfig::default());
        assert_eq!(config.gateway.max_concurrent_requests, AdmissionConfig::default().max_concurrent_requests);
        assert_eq!(config.clients, ClientLimits::default());
    }

    #[test]
    fn flags_and_per_service_sections_reach_the_services() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            file.path(),
            "workers = 3\nmax_connections = 64\n[gateway]\nmax_concurrent_requests = 7\n[router]\npolicy = \"round-robin\"\n[router.kv]\ndevice_credit = 2.0\n[worker]\nengine = \"mock\"\nspeedup = 4.0\nkv_transport = \"tcp\"\n",
        )
        .unwrap();
        let config =
            parse(&["--config", file.path().to_str().unwrap(), "--speedup", "8", "--max-seqs", "5", "--policy", "least-loaded", "--connections-per-ip", "16"])
                .unwrap();
        assert_eq!(config.workers, 3);
        assert_eq!((config.clients.max_connections, config.clients.connections_per_ip), (64, 16), "the gateways' client limits");
        assert_eq!(config.gateway.max_concurrent_requests, 7);
        assert_eq!((config.router.policy, config.router.kv.tuning.device_credit), (Policy::LeastLoaded, 2.0), "the flag beats the file");
        assert_eq!((config.worker.engine.engine, config.worker.engine.speedup, config.worker.engine.max_num_seqs), (EngineKind::Mock, 8.0, 5));
        assert_eq!(config.worker.transfer.kv_transport, KvTransport::Tcp);
        let misplaced = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(misplaced.path(), "speedup = 2.0\n").unwrap();
        assert!(parse(&["--config", misplaced.path().to_str().unwrap()]).unwrap_err().contains("unknown key `speedup`"), "worker settings belong in [worker]");
    }

    #[test]
    fn the_planner_flag_takes_a_port_or_the_planners_own() {
        assert_eq!(parse(&["--planner", "--planner-profile", "p.json"]).unwrap().planner_port, Some(50054));
        assert_eq!(parse(&["--planner", "0", "--planner-profile", "p.json"]).unwrap().planner_port, Some(0));
        assert_eq!(parse(&[]).unwrap().planner_port, None);
        assert!(parse(&["--planner"]).unwrap_err().contains("--planner-profile"));
    }

    #[test]
    fn impossible_clusters_are_refused() {
        assert!(parse(&["--workers", "0"]).unwrap_err().contains("workers"));
        assert!(parse(&["--prefill-workers", "1"]).is_err(), "decode workers are required with prefill workers");
        assert!(parse(&["--prefill-workers", "1", "--decode-workers", "0"]).unwrap_err().contains("disaggregated"));
    }
}
