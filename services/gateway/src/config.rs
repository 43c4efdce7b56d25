//! Gateway configuration: defaults < `--config` file < `TURBINE_*` env <
//! flags (see `turbine_runtime::config`). The admission section is shared
//! with `turbine run`.

use std::net::SocketAddr;
use turbine_runtime::config::InvalidSetting;

use serde::{Deserialize, Serialize};
use turbine_runtime::config::{ServerConfig, ServiceDefaults, Settings, defaults};

/// Where a gateway listens by default (its admin routes are on the REST
/// port unless `--admin-addr` gives them a port of their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayPorts {}

impl ServiceDefaults for GatewayPorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:50050";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_GATEWAY_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = None;
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_GATEWAY_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "30";
}

/// The gateway's configuration.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct GatewayConfig {
    /// OpenAI REST listen address (also /metrics, /livez, /readyz, /health).
    #[arg(long, env = "TURBINE_GATEWAY_HTTP_ADDR", default_value = "0.0.0.0:8000")]
    pub http_addr: SocketAddr,
    #[command(flatten)]
    #[serde(flatten)]
    pub server: ServerConfig<GatewayPorts>,
    /// Router gRPC endpoint, e.g. http://router:50051 (required for a
    /// standalone gateway).
    #[arg(long, env = "TURBINE_ROUTER_ENDPOINT")]
    pub router: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub admission: AdmissionConfig,
    /// With --redis, the API keys' limits (per minute and concurrent) are
    /// kept in that Redis and shared by every gateway of the namespace.
    #[command(flatten)]
    #[serde(flatten)]
    pub cluster: turbine_runtime::config::ClusterConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        turbine_runtime::config::settings_defaults()
    }
}

impl Settings for GatewayConfig {
    const CONFIG_ENV: &'static str = "TURBINE_GATEWAY_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        self.server.validate()?;
        if self.admission.keys_required() && self.server.admin_addr.is_none() {
            // Else /metrics would be served on the API's port to anyone,
            // telling one tenant of the others' traffic.
            return Err(InvalidSetting::new(
                "admin_addr",
                "with --api-keys, /metrics and the probes need a port of their own, kept off the API's: give --admin-addr (e.g. 0.0.0.0:9090)",
            ));
        }
        if self.admission.public_tls_cert.is_some() && !self.admission.keys_required() && !self.server.insecure {
            // Its gRPC would then answer anyone, where under --tls-* alone
            // it answers only holders of the deployment's certificates.
            return Err(InvalidSetting::new(
                "api_keys",
                "a public certificate serves clients that hold no certificate, and without keys nothing would authenticate them: give --api-keys FILE or --api-keys-database URL (`turbine keys new` makes keys), or --insecure for an API open to anyone who reaches it",
            ));
        }
        self.admission.validate()
    }
}

/// What the gateway admits, and how it learns the served models.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct AdmissionConfig {
    /// Largest request body accepted, in bytes (413 beyond it).
    #[arg(long, env = "TURBINE_GATEWAY_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a request's body may take to arrive once its headers have
    /// (408 after): a client sending it slowly holds one of the requests
    /// admitted (--max-concurrent-requests) while it does.
    #[arg(long, env = "TURBINE_GATEWAY_BODY_TIMEOUT_SECS", default_value_t = 30.0)]
    pub body_timeout_secs: f64,
    /// Seconds a gRPC Generate stream's client may read nothing of it
    /// (its window and the gateway's queue full) before its request is
    /// ended as on a disconnect, giving back its place. (A REST client
    /// that does so loses its connection after --http-idle-timeout-secs.)
    #[arg(long, env = "TURBINE_GATEWAY_STREAM_STALL_SECS", default_value_t = 30.0)]
    pub stream_stall_secs: f64,
    /// Requests served at once; more get 429 with Retry-After.
    #[arg(long, env = "TURBINE_GATEWAY_MAX_CONCURRENT_REQUESTS", default_value_t = 4096)]
    pub max_concurrent_requests: usize,
    /// How often the served models are refreshed from the router, in
    /// milliseconds.
    #[arg(long, env = "TURBINE_GATEWAY_MODEL_REFRESH_MS", default_value_t = 1000)]
    pub model_refresh_ms: u64,
    /// What control-token texts (`<|im_start|>`, `<|im_end|>`, ...) in a
    /// chat message become: `text` (ordinary text; only the chat template
    /// writes control tokens, so no user can end their turn or open a
    /// system one) or `parse` (control tokens, as llama.cpp and vLLM do:
    /// only for clients trusted to write whole prompts).
    #[arg(long, env = "TURBINE_GATEWAY_CONTENT_CONTROL_TOKENS", value_enum, default_value_t = ContentControlTokens::Text)]
    pub content_control_tokens: ContentControlTokens,
    /// A TOML file of API keys (their SHA-256 digests, each with a name and
    /// a tenant; `turbine keys new` prints entries). Given, every REST and
    /// gRPC call needs `Authorization: Bearer KEY` (401 / UNAUTHENTICATED
    /// without a known one), and each tenant's requests use a prompt cache
    /// of their own. Unset: no keys, one open namespace (for loopback).
    #[arg(long, env = "TURBINE_GATEWAY_API_KEYS", value_name = "FILE", conflicts_with = "api_keys_database")]
    pub api_keys: Option<std::path::PathBuf>,
    /// The API keys in a database instead of a file: postgres://… (every
    /// gateway of the namespace reads the same keys; the planner's
    /// database will do) or sqlite:FILE. `turbine keys new|revoke|list
    /// --database URL` manages them (and makes their table); the gateway
    /// only reads them, over read-only sessions, so its role needs no more
    /// than SELECT on gateway_api_keys (it makes the table only where it is
    /// missing and its role may). Unreachable at start, the
    /// gateway does not start; unreachable later, the keys last read stay
    /// in force. An empty table refuses every call.
    #[arg(long, env = "TURBINE_GATEWAY_API_KEYS_DATABASE", value_name = "URL")]
    pub api_keys_database: Option<String>,
    /// How often the API keys (file or database) are read again, in
    /// seconds: keys changed are in force from then on (added keys answer,
    /// removed or revoked ones are refused; a file that does not parse
    /// changes nothing and is logged); a PostgreSQL table is also read
    /// as soon as a change to it is announced. 0: read once, at start.
    #[arg(long, env = "TURBINE_GATEWAY_API_KEYS_RELOAD_SECS", default_value_t = 5)]
    pub api_keys_reload_secs: u64,
    /// A certificate chain (PEM, the gateway's first) its clients verify:
    /// with --public-tls-key, the REST API is served over HTTPS and gRPC
    /// Inference over TLS, neither asking clients for a certificate (they
    /// authenticate with API keys, which then never cross the network in
    /// the clear). From a CA the clients trust, not the deployment's
    /// (whose certificates name roles). Unset: the REST API is plaintext
    /// (terminate TLS in front) and a gateway's gRPC follows --tls-cert.
    #[arg(long, env = "TURBINE_GATEWAY_PUBLIC_TLS_CERT", value_name = "FILE")]
    pub public_tls_cert: Option<std::path::PathBuf>,
    /// The private key of --public-tls-cert (PEM).
    #[arg(long, env = "TURBINE_GATEWAY_PUBLIC_TLS_KEY", value_name = "FILE")]
    pub public_tls_key: Option<std::path::PathBuf>,
}

/// What control-token texts in chat messages become (see
/// [`AdmissionConfig::content_control_tokens`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentControlTokens {
    /// Ordinary text.
    #[default]
    Text,
    /// Control tokens.
    Parse,
}

impl From<ContentControlTokens> for turbine_tokens::ContentControlTokens {
    fn from(value: ContentControlTokens) -> Self {
        match value {
            ContentControlTokens::Text => Self::Text,
            ContentControlTokens::Parse => Self::Parse,
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        defaults()
    }
}

impl AdmissionConfig {
    /// Whether callers need API keys (from a file or a database).
    pub fn keys_required(&self) -> bool {
        self.api_keys.is_some() || self.api_keys_database.is_some()
    }

    /// Checks values that types alone do not constrain.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.api_keys.is_some() && self.api_keys_database.is_some() {
            return Err(InvalidSetting::new("api_keys_database", "the keys come from a file (--api-keys) or a database (--api-keys-database), not both"));
        }
        if let Some(url) = &self.api_keys_database
            && !["postgres://", "postgresql://", "sqlite:"].iter().any(|scheme| url.starts_with(scheme))
        {
            return Err(InvalidSetting::new("api_keys_database", "must start with postgres://, postgresql:// or sqlite:"));
        }
        if self.max_body_bytes < 1024 {
            return Err(InvalidSetting::new("max_body_bytes", "must be at least 1024"));
        }
        if !(self.body_timeout_secs.is_finite() && self.body_timeout_secs > 0.0) {
            return Err(InvalidSetting::new("body_timeout_secs", "must be positive"));
        }
        if !(self.stream_stall_secs.is_finite() && self.stream_stall_secs > 0.0) {
            return Err(InvalidSetting::new("stream_stall_secs", "must be positive"));
        }
        if self.max_concurrent_requests == 0 {
            return Err(InvalidSetting::new("max_concurrent_requests", "must be positive"));
        }
        if self.model_refresh_ms == 0 {
            return Err(InvalidSetting::new("model_refresh_ms", "must be positive"));
        }
        if self.public_tls_cert.is_some() != self.public_tls_key.is_some() {
            return Err(InvalidSetting::new("public_tls_cert", "--public-tls-cert and --public-tls-key go together: give both or neither"));
        }
        Ok(())
    }

    /// The public certificate, if one is configured.
    pub fn public_tls(&self) -> anyhow::Result<Option<turbine_runtime::public_tls::PublicTls>> {
        match (&self.public_tls_cert, &self.public_tls_key) {
            (Some(cert), Some(key)) => Ok(Some(turbine_runtime::public_tls::PublicTls::from_files(cert, key)?)),
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_public_certificate_goes_with_its_own_key() {
        let mut config = AdmissionConfig { public_tls_cert: Some("api.crt".into()), ..AdmissionConfig::default() };
        let refused = config.validate().unwrap_err().to_string();
        assert!(refused.contains("--public-tls-key"), "{refused}");
        let dir = tempfile::tempdir().unwrap();
        let ca = turbine_testkit::tls::TestCa::new("public");
        let (one, other) =
            (ca.issue_names(&["localhost".into()], "api").write(dir.path(), "one"), ca.issue_names(&["localhost".into()], "api").write(dir.path(), "other"));
        config.public_tls_cert = one.tls_cert.clone();
        config.public_tls_key = one.tls_key.clone();
        config.validate().unwrap();
        assert!(config.public_tls().unwrap().is_some());
        config.public_tls_key = other.tls_key;
        let mismatched = format!("{:#}", config.public_tls().unwrap_err());
        assert!(mismatched.contains("does not suit the certificate"), "{mismatched}");
    }

    #[test]
    fn a_public_certificate_wants_api_keys_or_insecure() {
        let mut config = GatewayConfig::default();
        config.admission.public_tls_cert = Some("api.crt".into());
        config.admission.public_tls_key = Some("api.key".into());
        let refused = config.validate().unwrap_err().to_string();
        assert!(refused.contains("--api-keys") && refused.contains("--insecure"), "{refused}");
        config.server.insecure = true;
        config.validate().expect("an open API, asked for");
        config.server.insecure = false;
        config.admission.api_keys = Some("keys.toml".into());
        config.server.admin_addr = Some("127.0.0.1:9090".parse().unwrap());
        config.validate().expect("keys authenticate the callers");
    }
}
