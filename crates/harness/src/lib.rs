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
//! - [`LlamaCppServer`]: llama.cpp's server on a GGUF (an external engine
//!   without KV events), ready when its /health answers.

mod llama_cpp_server;
mod postgres_server;
mod process;
mod redis_server;
mod service;
mod sockets;
mod vllm_server;

pub use llama_cpp_server::{LLAMA_CPP_STARTUP_TIMEOUT, LlamaCppInstall, LlamaCppServer};
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

/// A loopback port no other test on this machine holds, for programs that
/// cannot be handed a bound listener (`ucx_perftest`, `redis-server`, a
/// replayed manifest's listeners). Drawn below the kernel's ephemeral range
/// (`ip_local_port_range`), so no outgoing connection and no bind to port
/// 0 takes it meanwhile; reserved, until this process exits, by a lock on
/// a file named for it under the temporary directory, so no other test
/// process draws it. (A port bound to 0 and released, as before, was taken
/// by another test's listener now and then once more tests ran at once.)
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    static HELD: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next().and_then(|low| low.parse::<u16>().ok()))
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.min(60_000));
    let dir = std::env::temp_dir().join("turbine-test-ports");
    if high > low + 1_000 && std::fs::create_dir_all(&dir).is_ok() {
        for _ in 0..2_000 {
            let draw = std::collections::hash_map::RandomState::new().build_hasher().finish();
            let port = low + (draw % u64::from(high - low)) as u16;
            let Ok(file) = std::fs::File::create(dir.join(port.to_string())) else { continue };
            if file.try_lock().is_err() {
                continue;
            }
            if std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)).is_err() {
                continue;
            }
            HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(file);
            return port;
        }
    }
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).and_then(|listener| listener.local_addr()).expect("bind port 0").port()
}
