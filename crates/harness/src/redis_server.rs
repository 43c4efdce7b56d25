//! [`RedisServer`]: a private `redis-server` for one test or benchmark.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::{ChildProcess, STARTUP_TIMEOUT, StartFailure, free_port};

/// A private Redis server on a loopback port, with no persistence.
#[derive(Debug)]
pub struct RedisServer {
    process: ChildProcess,
    port: u16,
    /// Serves TLS only (on `port`), at `localhost`.
    tls: bool,
    _dir: tempfile::TempDir,
}

/// A Redis server's TLS: its certificate and key (for the name
/// `localhost`), the CA its clients' certificates must chain to, and a
/// client certificate the harness checks readiness with (PEM files).
#[derive(Debug, Clone)]
pub struct RedisTls {
    /// The server's certificate.
    pub cert: std::path::PathBuf,
    /// Its key.
    pub key: std::path::PathBuf,
    /// The CA (of the server's and the clients' certificates).
    pub ca: std::path::PathBuf,
    /// A client's certificate.
    pub client_cert: std::path::PathBuf,
    /// Its key.
    pub client_key: std::path::PathBuf,
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

    /// Starts `redis-server` serving only TLS (clients must present a
    /// certificate of `tls.ca`), with `args` added (e.g. ACL users:
    /// `--user alice on >secret ~* +@all`); returns once it answers PING
    /// over TLS with the client certificate of `tls`.
    pub fn start_tls(tls: &RedisTls, args: &[&str]) -> Self {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            match Self::try_start(free_port(), Some(tls), args) {
                Ok(server) => return server,
                Err(error) => last_error = Some(error),
            }
        }
        panic!("redis-server (TLS) did not start: {}", last_error.expect("at least one attempt"));
    }

    fn try_start_on(port: u16) -> Result<Self, StartFailure> {
        Self::try_start(port, None, &[])
    }

    fn try_start(port: u16, tls: Option<&RedisTls>, args: &[&str]) -> Result<Self, StartFailure> {
        let dir = tempfile::tempdir().map_err(|error| StartFailure::setup("a temporary directory")(error.into()))?;
        let binary = std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned());
        let mut command = Command::new(&binary);
        match tls {
            None => {
                command.arg("--port").arg(port.to_string());
            }
            Some(tls) => {
                command.args(["--port", "0", "--tls-port"]).arg(port.to_string());
                command.arg("--tls-cert-file").arg(&tls.cert).arg("--tls-key-file").arg(&tls.key).arg("--tls-ca-cert-file").arg(&tls.ca);
                command.args(["--tls-auth-clients", "yes"]);
            }
        }
        command
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(args);
        let mut process = ChildProcess::spawn("redis-server", command);
        let read = |path: &std::path::Path| std::fs::read(path).map_err(|error| StartFailure::setup("the TLS files")(error.into()));
        let client = match tls {
            None => redis::Client::open(format!("redis://127.0.0.1:{port}/")),
            Some(tls) => redis::Client::build_with_tls(
                format!("rediss://localhost:{port}/"),
                redis::TlsCertificates {
                    client_tls: Some(redis::ClientTlsConfig { client_cert: read(&tls.client_cert)?, client_key: read(&tls.client_key)? }),
                    root_cert: Some(read(&tls.ca)?),
                },
            ),
        }
        .map_err(|error| StartFailure::setup("a redis client")(error.into()))?;
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = process.exited() {
                return Err(StartFailure::exited(status, &process));
            }
            let pong =
                client.get_connection_with_timeout(Duration::from_millis(200)).and_then(|mut connection| redis::cmd("PING").query::<String>(&mut connection));
            // An ACL that turns the default user off answers NOAUTH: up.
            if pong.as_ref().is_ok() || pong.as_ref().is_err_and(|error| error.to_string().contains("NOAUTH")) {
                return Ok(Self { process, port, tls: tls.is_some(), _dir: dir });
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

    /// `redis://127.0.0.1:<port>/`, or `rediss://localhost:<port>/` for a
    /// TLS server.
    pub fn url(&self) -> String {
        if self.tls { format!("rediss://localhost:{}/", self.port) } else { format!("redis://127.0.0.1:{}/", self.port) }
    }

    /// Kills the server (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}
