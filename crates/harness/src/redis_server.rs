//! [`RedisServer`]: a private `redis-server` for one test or benchmark.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::{ChildProcess, STARTUP_TIMEOUT, StartFailure, free_port};

/// A private Redis server on a loopback port, with no persistence.
#[derive(Debug)]
pub struct RedisServer {
    process: ChildProcess,
    port: u16,
    _dir: tempfile::TempDir,
}

/// Ports tried before giving up (each may be taken by someone else
/// between choosing it and Redis binding it).
const PORT_ATTEMPTS: usize = 5;

impl RedisServer {
    /// Starts `redis-server` (`$TURBINE_REDIS_SERVER`, else from PATH) and
    /// returns once it answers PING.
    pub fn start() -> Self {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            match Self::try_start_on(free_port()) {
                Ok(server) => return server,
                Err(error) => last_error = Some(error),
            }
        }
        panic!("redis-server did not start: {}", last_error.expect("at least one attempt"));
    }

    /// Starts `redis-server` on `port` (to restart one at the same address).
    pub fn start_on(port: u16) -> Self {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            match Self::try_start_on(port) {
                Ok(server) => return server,
                Err(error) => last_error = Some(error),
            }
        }
        panic!("redis-server did not start on port {port}: {}", last_error.expect("at least one attempt"));
    }

    fn try_start_on(port: u16) -> Result<Self, StartFailure> {
        let dir = tempfile::tempdir().map_err(|error| StartFailure::setup("a temporary directory")(error.into()))?;
        let binary = std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned());
        let mut command = Command::new(&binary);
        command
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(dir.path());
        let mut process = ChildProcess::spawn("redis-server", command);
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).map_err(|error| StartFailure::setup("a redis client")(error.into()))?;
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = process.exited() {
                return Err(StartFailure::exited(status, &process));
            }
            let pong =
                client.get_connection_with_timeout(Duration::from_millis(200)).and_then(|mut connection| redis::cmd("PING").query::<String>(&mut connection));
            if pong.is_ok() {
                return Ok(Self { process, port, _dir: dir });
            }
            if Instant::now() >= deadline {
                return Err(StartFailure::NoAnswer);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}
