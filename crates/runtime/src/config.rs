//! Layered configuration: defaults in code < a TOML file < `TURBINE_*`
//! environment variables < command-line flags.
//!
//! Each setting is declared once, as a field of a struct that is at the
//! same time the clap arguments and the serde configuration: its doc comment
//! is the help, its `#[arg]` names the flag, the environment variable and
//! the default (which `--help` shows). A service's configuration is such a
//! struct, made of sections: the settings every service shares
//! ([`ServerConfig`], [`ClusterConfig`]) are flattened into each, and a
//! service's own groups (`[kv]` in the router's file) are nested or
//! flattened as the file should read.
//!
//! [`Layered<C>`] parses it: clap reads defaults, environment and flags and
//! says which value came from where; the `--config` file is laid over the
//! defaults and under what the environment and the flags set explicitly;
//! keys the configuration does not know are refused with the file's name.

use std::collections::HashSet;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, Command, FromArgMatches};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A top-level configuration: a service's, or `turbine run`'s.
pub trait Settings: clap::Args + FromArgMatches + Serialize + DeserializeOwned {
    /// The environment variable that names the config file.
    const CONFIG_ENV: &'static str;

    /// Checks what types alone do not constrain.
    fn validate(&self) -> Result<(), InvalidSetting> {
        Ok(())
    }

    /// Changes the parsed command, for a configuration that composes other
    /// services' sections under defaults of its own (`turbine run` routes by
    /// KV overlap by default, a standalone router by load).
    fn adjust(command: Command) -> Command {
        command
    }
}

/// The defaults of a section: what parsing no arguments gives, with the
/// environment ignored.
pub fn defaults<C: clap::Args + FromArgMatches>() -> C {
    defaults_of(C::augment_args(Command::new("defaults")))
}

/// The defaults of a top-level configuration, its own adjustments included.
pub fn settings_defaults<C: Settings>() -> C {
    defaults_of(C::adjust(C::augment_args(Command::new("defaults"))))
}

fn defaults_of<C: FromArgMatches>(command: Command) -> C {
    let matches = command.no_binary_name(true).mut_args(|arg| arg.env(None)).try_get_matches_from(std::iter::empty::<String>());
    let matches = matches.expect("every setting has a default or is optional");
    C::from_arg_matches(&matches).expect("defaults parse into the configuration")
}

/// A configuration parsed with every layer applied (see the module docs):
/// flatten it into a clap command, and parsing yields the final value.
#[derive(Debug, Clone, PartialEq)]
pub struct Layered<C>(pub C);

impl<C> Layered<C> {
    /// The configuration.
    pub fn into_inner(self) -> C {
        self.0
    }
}

/// Id of the `--config` argument.
const CONFIG_ARG: &str = "config";

impl<C: Settings> clap::Args for Layered<C> {
    fn augment_args(command: Command) -> Command {
        C::adjust(C::augment_args(command)).arg(
            clap::Arg::new(CONFIG_ARG)
                .long(CONFIG_ARG)
                .env(C::CONFIG_ENV)
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("TOML config file: keys as the long flags with underscores, a section per [table]; env and flags override it"),
        )
    }

    fn augment_args_for_update(command: Command) -> Command {
        Self::augment_args(command)
    }
}

impl<C: Settings> FromArgMatches for Layered<C> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let parsed = C::from_arg_matches(matches)?;
        let explicit: HashSet<String> = matches
            .ids()
            .map(|id| id.as_str())
            .filter(|&id| id != CONFIG_ARG && matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable)))
            .map(str::to_owned)
            .collect();
        let file = matches.get_one::<PathBuf>(CONFIG_ARG);
        let config = layer(parsed, &explicit, file.map(PathBuf::as_path))
            .map_err(|error| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{error}\n")))?;
        Ok(Self(config))
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The config file is not valid TOML or has unknown or mistyped keys,
    /// or a value is out of its range.
    #[error("invalid configuration{origin}: {message}")]
    Invalid {
        /// Where the bad value came from (` in FILE`), if known.
        origin: String,
        /// What is wrong.
        message: String,
    },
    /// A value is refused for what types alone do not constrain.
    #[error("invalid configuration: {0}")]
    Setting(#[from] InvalidSetting),
}

/// A value the configuration refuses for what types alone do not
/// constrain: the setting, as the config file spells it, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {problem}")]
pub struct InvalidSetting {
    /// The setting (`max_body_bytes`, `kv.index`), or the settings that
    /// conflict, as the config file spells them.
    pub setting: String,
    /// What is wrong with its value.
    pub problem: String,
}

impl InvalidSetting {
    /// `setting`'s value is refused for `problem`.
    pub fn new(setting: impl Into<String>, problem: impl Into<String>) -> Self {
        Self { setting: setting.into(), problem: problem.into() }
    }

    /// The same refusal for a section composed into another under a prefix
    /// (the planner's settings in `turbine run`, `planner.`).
    pub fn within(self, prefix: &str) -> Self {
        Self { setting: format!("{prefix}{}", self.setting), problem: self.problem }
    }
}

/// Lays `file` over `parsed` (defaults, environment and flags, as clap
/// parsed them), then what `explicit` names (set in the environment or on
/// the command line) over the file, and validates.
fn layer<C: Settings>(parsed: C, explicit: &HashSet<String>, file: Option<&Path>) -> Result<C, ConfigError> {
    let parsed = to_table(&parsed)?;
    let config: C = match file {
        None => from_table(parsed, "")?,
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
            let origin = format!(" in {}", path.display());
            let table: toml::Table =
                text.parse().map_err(|error: toml::de::Error| ConfigError::Invalid { origin: origin.clone(), message: error.to_string() })?;
            // The file over the defaults first, alone, so that a mistyped or
            // unknown key is reported with the file's name.
            let merged = merge(parsed.clone(), table.clone());
            let with_file: C = from_table(merged.clone(), &origin)?;
            if let Some(key) = unknown_key(&table, &to_table(&with_file)?, "") {
                return Err(ConfigError::Invalid { origin, message: format!("unknown key `{key}`") });
            }
            from_table(merge(merged, only_explicit(parsed, explicit)), "")?
        }
    };
    config.validate()?;
    Ok(config)
}

fn to_table<T: Serialize>(value: &T) -> Result<toml::Table, ConfigError> {
    match toml::Value::try_from(value) {
        Ok(toml::Value::Table(table)) => Ok(table),
        Ok(other) => Err(ConfigError::Invalid { origin: String::new(), message: format!("expected a table, got {other}") }),
        Err(error) => Err(ConfigError::Invalid { origin: String::new(), message: error.to_string() }),
    }
}

fn from_table<C: DeserializeOwned>(table: toml::Table, origin: &str) -> Result<C, ConfigError> {
    toml::Value::Table(table)
        .try_into()
        .map_err(|error: toml::de::Error| ConfigError::Invalid { origin: origin.to_owned(), message: error.message().to_owned() })
}

/// Lays `over` onto `base`: tables merge key by key, anything else replaces.
fn merge(mut base: toml::Table, over: toml::Table) -> toml::Table {
    for (key, value) in over {
        match (base.remove(&key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(over_inner)) => {
                base.insert(key, toml::Value::Table(merge(inner, over_inner)));
            }
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
    base
}

/// The values of `table` (at any depth) whose key is in `explicit`: a
/// setting's key is its field name, which is also its clap id.
fn only_explicit(table: toml::Table, explicit: &HashSet<String>) -> toml::Table {
    table
        .into_iter()
        .filter_map(|(key, value)| match value {
            toml::Value::Table(inner) => {
                let inner = only_explicit(inner, explicit);
                (!inner.is_empty()).then_some((key, toml::Value::Table(inner)))
            }
            value => explicit.contains(&key).then_some((key, value)),
        })
        .collect()
}

/// A key of `file` the configuration dropped when it read the file: the
/// configuration has no such setting. (serde's `deny_unknown_fields` cannot
/// see through flattened sections, so the check is made here.)
fn unknown_key(file: &toml::Table, known: &toml::Table, prefix: &str) -> Option<String> {
    file.iter().find_map(|(key, value)| match (value, known.get(key)) {
        (_, None) => Some(format!("{prefix}{key}")),
        (toml::Value::Table(inner), Some(toml::Value::Table(known_inner))) => unknown_key(inner, known_inner, &format!("{prefix}{key}.")),
        _ => None,
    })
}

/// Where a service listens by default and what its variables are called.
/// Implemented by a marker type per service, so that the shared
/// [`ServerConfig`] shows each service's own defaults.
pub trait ServiceDefaults: std::fmt::Debug + Clone + PartialEq + Send + Sync + 'static {
    /// gRPC listen address.
    const GRPC_ADDR: &'static str;
    /// Environment variable of the gRPC listen address.
    const GRPC_ADDR_ENV: &'static str;
    /// Admin HTTP listen address (`None`: admin routes only where the
    /// service mounts them itself, e.g. on the gateway's REST port).
    const ADMIN_ADDR: Option<&'static str>;
    /// Environment variable of the admin listen address.
    const ADMIN_ADDR_ENV: &'static str;
    /// Seconds in-flight calls get to finish after SIGTERM.
    const SHUTDOWN_GRACE_SECS: &'static str;
}

/// The longest drain delay: past it, a balancer that has not seen a
/// service leave will not.
pub const MAX_DRAIN_DELAY_SECS: f64 = 300.0;

/// How a service is served: the settings every service shares.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct ServerConfig<S: ServiceDefaults> {
    /// gRPC listen address: the service, health and reflection.
    #[arg(long, env = S::GRPC_ADDR_ENV, default_value = S::GRPC_ADDR)]
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address: /metrics, /livez, /readyz.
    #[arg(long, env = S::ADMIN_ADDR_ENV, default_value = S::ADMIN_ADDR)]
    pub admin_addr: Option<SocketAddr>,
    /// Seconds in-flight calls and streams get to finish after SIGTERM.
    #[arg(long, env = "TURBINE_SHUTDOWN_GRACE_SECS", default_value = S::SHUTDOWN_GRACE_SECS)]
    pub shutdown_grace_secs: f64,
    /// Seconds the service goes on serving after SIGTERM, reporting
    /// NOT_SERVING (health, /readyz), before it stops accepting: for the
    /// load balancers and proxies in front of it (Envoy, a Kubernetes
    /// Service) to see it leave, so no request is sent on a connection it
    /// is closing. Longer than their health checks take to mark it down;
    /// a second SIGTERM or SIGINT ends it, and a process never SERVING
    /// (still loading its model, say) has none. 0: stop accepting at once.
    #[arg(long, env = "TURBINE_DRAIN_DELAY_SECS", default_value_t = 0.0)]
    #[serde(default)]
    pub drain_delay_secs: f64,
    /// Once listening, write the bound addresses here as JSON (for
    /// supervisors and tests that listen on port 0).
    #[arg(long, value_name = "FILE")]
    pub addresses_file: Option<PathBuf>,
    /// Mutual TLS: the process's certificate, key and CA.
    #[command(flatten)]
    #[serde(flatten)]
    pub tls: crate::trust::TlsConfig,
    /// Serve gRPC in plaintext on an address other hosts reach (without
    /// it, a service with no --tls-* settings refuses to bind one: every
    /// caller could call every rpc). For a network you trust entirely.
    #[arg(long, env = "TURBINE_INSECURE")]
    #[serde(default)]
    pub insecure: bool,
    /// What the service's ports allow a client.
    #[command(flatten)]
    #[serde(flatten)]
    pub clients: ClientLimits,
    #[arg(skip)]
    #[serde(skip)]
    service: PhantomData<S>,
}

/// What a service's ports allow one client, and all of them: new
/// connections a second, connections open, and how long an HTTP connection
/// may sit idle.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct ClientLimits {
    /// New gRPC connections one address may open a second (a second's
    /// worth at once); more are closed as accepted, before TLS, and
    /// counted. Services and clients keep their connections, so only a
    /// caller connecting again and again meets it. On HTTP ports, only
    /// an address whose connection was closed for its 401s in the last
    /// minute. 0: no limit.
    #[arg(long, env = "TURBINE_CONNECTION_RATE_PER_IP", default_value_t = 100)]
    #[serde(default = "default_connection_rate")]
    pub connection_rate_per_ip: u32,
    /// Seconds an HTTP connection (the REST API, the admin port) may take
    /// to send a request's headers, may stay open with no request in
    /// flight (between kept-alive requests, say), and may leave its answer
    /// unread; then it is closed. A response being streamed to a client
    /// reading it is a request in flight however long it lasts.
    #[arg(long, env = "TURBINE_HTTP_IDLE_TIMEOUT_SECS", default_value_t = 30.0)]
    #[serde(default = "default_http_idle_timeout")]
    pub http_idle_timeout_secs: f64,
    /// Connections open at once on each of the service's ports (gRPC, the
    /// HTTP API, admin); more are closed as accepted and counted.
    /// Lowered to a quarter of the open-files limit where that is less.
    #[arg(long, env = "TURBINE_MAX_CONNECTIONS", default_value_t = 10_000)]
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections one client (an IPv4 address, an IPv6 /64) may hold
    /// open at once on each of the service's ports; more are closed as
    /// accepted and counted. Raise it behind a proxy that opens many
    /// connections from one address. 0: no limit.
    #[arg(long, env = "TURBINE_CONNECTIONS_PER_IP", default_value_t = 1_000)]
    #[serde(default = "default_connections_per_ip")]
    pub connections_per_ip: usize,
    /// Proxies in front of the service (Envoy at the edge), as addresses
    /// or ranges (10.0.0.0/8, fd00::/8), comma-separated. A connection
    /// from one carries many clients' calls: its refusals never close it,
    /// and the gateway counts each request against the client the proxy
    /// appended to X-Forwarded-For (read from the right past trusted
    /// proxies) rather than against the proxy. Anyone else's
    /// X-Forwarded-For is ignored. Trust only addresses no client can
    /// connect from. None by default.
    #[arg(long, env = "TURBINE_TRUSTED_PROXIES", value_delimiter = ',', value_name = "RANGES")]
    #[serde(default)]
    pub trusted_proxies: Vec<crate::proxies::AddressRange>,
}

impl Default for ClientLimits {
    fn default() -> Self {
        defaults()
    }
}

impl ClientLimits {
    /// Checks the limits.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(self.http_idle_timeout_secs.is_finite() && self.http_idle_timeout_secs > 0.0) {
            return Err(InvalidSetting::new("http_idle_timeout_secs", "must be positive"));
        }
        if self.max_connections == 0 {
            return Err(InvalidSetting::new("max_connections", "must be positive"));
        }
        Ok(())
    }

    /// How many connections each listener keeps open, as configured.
    pub fn connection_limits(&self) -> crate::connections::ConnectionLimits {
        crate::connections::ConnectionLimits { max_connections: self.max_connections, connections_per_ip: self.connections_per_ip }
    }

    /// The proxies trusted to name their clients, as configured.
    pub fn trusted_proxies(&self) -> crate::proxies::TrustedProxies {
        crate::proxies::TrustedProxies::new(&self.trusted_proxies)
    }

    /// What each HTTP listener allows a client, as configured (the gate of
    /// addresses struck off is the listener's own: [`crate::host::Host`]
    /// adds it).
    pub fn http_limits(&self) -> crate::http_server::HttpLimits {
        crate::http_server::HttpLimits {
            idle_timeout: std::time::Duration::from_secs_f64(self.http_idle_timeout_secs),
            connections: self.connection_limits(),
            struck_off: None,
            gated_by_listener: false,
            proxies: self.trusted_proxies(),
        }
    }
}

fn default_connection_rate() -> u32 {
    100
}

fn default_http_idle_timeout() -> f64 {
    30.0
}

fn default_max_connections() -> usize {
    10_000
}

fn default_connections_per_ip() -> usize {
    1_000
}

impl<S: ServiceDefaults> Default for ServerConfig<S> {
    fn default() -> Self {
        defaults()
    }
}

impl<S: ServiceDefaults> ServerConfig<S> {
    /// Checks the shared settings.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(self.shutdown_grace_secs.is_finite() && self.shutdown_grace_secs >= 0.0) {
            return Err(InvalidSetting::new("shutdown_grace_secs", "must be non-negative"));
        }
        if !(self.drain_delay_secs.is_finite() && (0.0..=MAX_DRAIN_DELAY_SECS).contains(&self.drain_delay_secs)) {
            return Err(InvalidSetting::new("drain_delay_secs", format!("must be between 0 and {MAX_DRAIN_DELAY_SECS} seconds")));
        }
        self.clients.validate()?;
        self.tls.validate()
    }

    /// The drain's grace period.
    pub fn grace(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.shutdown_grace_secs)
    }

    /// How long the service serves on, NOT_SERVING, after SIGTERM.
    pub fn drain_delay(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.drain_delay_secs)
    }
}

/// Which cluster a service joins: the settings of every service that reads
/// or writes the shared state in Redis.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct ClusterConfig {
    /// Redis URL of the cluster's shared state, e.g. redis://redis:6379/
    /// (rediss:// for TLS): the worker registry and the KV event log, and
    /// at a gateway the API keys' limits shared by every gateway.
    #[arg(long, env = "TURBINE_REDIS_URL")]
    pub redis: Option<String>,
    /// Namespace: separates clusters that share one Redis.
    #[arg(long, env = "TURBINE_NAMESPACE", default_value = "default")]
    pub namespace: String,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        defaults()
    }
}

#[cfg(test)]
mod tests;
