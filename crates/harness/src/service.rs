//! [`ServiceProcess`]: a Turbine service binary on port 0.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::Context;
use turbine_runtime::host::BoundAddrs;

use crate::{ChildProcess, STARTUP_TIMEOUT};

/// A Turbine service started as its own process, listening on free loopback
/// ports: it writes where it bound to its `--addresses-file`, and says
/// when it is ready through gRPC health.
#[derive(Debug)]
pub struct ServiceProcess {
    process: ChildProcess,
    addresses: BoundAddrs,
    _dir: tempfile::TempDir,
}

impl ServiceProcess {
    /// Spawns `command` (a service binary with its own flags) with an
    /// addresses file and, for each of `--grpc-addr`, `--admin-addr` (and
    /// `--http-addr` when `http`: the gateway) the command does not set
    /// itself, a free loopback port; returns once the file names the bound
    /// addresses.
    pub async fn spawn(name: &str, mut command: Command, http: bool) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("addresses.json");
        let given: Vec<String> = command.get_args().map(|arg| arg.to_string_lossy().into_owned()).collect();
        let listeners = [("--grpc-addr", true), ("--admin-addr", true), ("--http-addr", http)];
        for (flag, wanted) in listeners {
            if wanted && !given.iter().any(|arg| arg == flag) {
                command.args([flag, "127.0.0.1:0"]);
            }
        }
        command.arg("--addresses-file").arg(&file);
        Self::spawn_reporting(name, command, dir, file).await
    }

    /// Spawns `command`, which already names `file` as its addresses file
    /// and chooses its own listeners (e.g. `turbine run --addresses-file`).
    pub async fn spawn_with_addresses_file(name: &str, command: Command, dir: tempfile::TempDir, file: PathBuf) -> anyhow::Result<Self> {
        Self::spawn_reporting(name, command, dir, file).await
    }

    async fn spawn_reporting(name: &str, command: Command, dir: tempfile::TempDir, file: PathBuf) -> anyhow::Result<Self> {
        let mut process = ChildProcess::spawn(name, command);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(addresses) = read_addresses(&file) {
                return Ok(Self { process, addresses, _dir: dir });
            }
            if let Some(status) = process.exited() {
                anyhow::bail!("{name} exited ({status}) before listening; output:\n{}", process.output().join("\n"));
            }
            anyhow::ensure!(Instant::now() < deadline, "{name} wrote no addresses within {STARTUP_TIMEOUT:?}; output:\n{}", process.output().join("\n"));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `service` (`""`: the whole server) reports SERVING, or
    /// fails when the process exits or `timeout` passes first. `role` is
    /// the server's (over mutual TLS its certificate must name it).
    pub async fn until_serving(&mut self, role: turbine_runtime::host::Role, service: &str, timeout: Duration) -> anyhow::Result<()> {
        let endpoint = self.addresses.grpc_endpoint();
        let serving = turbine_runtime::health::until_serving(&endpoint, role, service);
        tokio::pin!(serving);
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                () = &mut serving => return Ok(()),
                () = &mut deadline => anyhow::bail!("{} was not SERVING within {timeout:?}; output:\n{}", self.process.name(), self.output().join("\n")),
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    if let Some(status) = self.process.exited() {
                        anyhow::bail!("{} exited ({status}) before it was ready; output:\n{}", self.process.name(), self.output().join("\n"));
                    }
                }
            }
        }
    }

    /// Where it listens.
    pub fn addresses(&self) -> BoundAddrs {
        self.addresses
    }

    /// Its gRPC endpoint (`http://127.0.0.1:PORT`).
    pub fn grpc_endpoint(&self) -> String {
        self.addresses.grpc_endpoint()
    }

    /// Its admin base URL (`/metrics`, `/readyz`).
    pub fn admin_url(&self) -> String {
        self.addresses.admin_url().expect("Turbine services serve admin routes")
    }

    /// Its REST base URL (the gateway's).
    pub fn http_url(&self) -> String {
        format!("http://{}", self.addresses.http.expect("an HTTP listener"))
    }

    /// Output lines so far.
    pub fn output(&self) -> Vec<String> {
        self.process.output()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.process.terminate();
    }

    /// Sends SIGKILL.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Waits for the process to exit, up to `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.process.wait(timeout)
    }
}

fn read_addresses(file: &Path) -> Option<BoundAddrs> {
    serde_json::from_slice(&std::fs::read(file).ok()?).ok()
}

/// The `--addresses-file` of a command started by a caller that picks its
/// own flags: a fresh temporary folder and the file's path in it.
pub fn addresses_file() -> anyhow::Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().context("a temporary folder for the addresses file")?;
    let file = dir.path().join("addresses.json");
    Ok((dir, file))
}
