//! Local servers for `turbine bench` and for process tests: real processes
//! on free ports, ready when they say so (never when a log line appears).
//!
//! - [`ChildProcess`]: a spawned program whose output is kept for
//!   diagnostics, signalled with SIGTERM, killed on drop.
//! - [`ServiceProcess`]: a Turbine service binary listening on port 0: its
//!   bound addresses come from `--addresses-file`, its readiness from gRPC
//!   health.
//! - [`RedisServer`]: a private `redis-server`, ready when it answers PING.
//! - [`PostgresServer`]: a private PostgreSQL cluster (`initdb`, `postgres`),
//!   ready when `pg_isready` says so.
//! - [`VllmServer`]: vLLM's CPU build serving a model (an external engine
//!   for workers to front), ready when its /health answers.

mod postgres_server;
mod process;
mod redis_server;
mod service;
mod sockets;
mod vllm_server;

pub use postgres_server::{PostgresServer, PostgresTls};
pub use process::ChildProcess;
pub use redis_server::{RedisServer, RedisTls};
pub use service::{ServiceProcess, addresses_file};
pub use sockets::listening_sockets;
pub use vllm_server::{VLLM_STARTUP_TIMEOUT, VllmInstall, VllmServer};

use std::time::Duration;

/// How long a server may take to start before the caller gives up.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a server did not come up on a port (the next port is tried).
#[derive(Debug, thiserror::Error)]
enum StartFailure {
    /// Its directory, client or readiness probe could not be made or run.
    #[error("{what}: {source}")]
    Setup {
        /// What was being made or run.
        what: &'static str,
        /// The cause.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The server exited (the port taken, a bad option).
    #[error("exited ({status}): {output}")]
    Exited {
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed.
        output: String,
    },
    /// It did not answer within [`STARTUP_TIMEOUT`].
    #[error("no answer within {STARTUP_TIMEOUT:?}")]
    NoAnswer,
}

impl StartFailure {
    fn setup(what: &'static str) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> Self {
        move |source| StartFailure::Setup { what, source }
    }

    fn exited(status: std::process::ExitStatus, process: &ChildProcess) -> Self {
        StartFailure::Exited { status, output: process.output().join("\n") }
    }
}

/// A port that was free a moment ago (bound to port 0 and released), for
/// programs that cannot be handed a bound listener (`ucx_perftest`,
/// `redis-server`): the caller must cope with it being taken meanwhile.
/// Turbine's own services take pre-bound listeners and need none.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).and_then(|listener| listener.local_addr()).expect("bind port 0").port()
}
