//! [`LlamaCppServer`]: llama.cpp's own server (`llama-server`) serving a
//! GGUF model, for the tests of workers in front of an external engine
//! that publishes no KV events. The test command builds it
//! (`scripts/install-llama-cpp.sh`); see docs/engines.md.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::vllm_server::until_healthy;
use crate::{ChildProcess, free_port};

/// How long llama-server may take to load a model and answer /health
/// (half a second for the default model; more beside other work).
pub const LLAMA_CPP_STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the test command builds llama-server: `target/engines/llama-cpp`
/// under the workspace (overridden by `$TURBINE_LLAMA_SERVER`).
#[derive(Debug, Clone)]
pub struct LlamaCppInstall {
    /// The `llama-server` binary.
    pub server: PathBuf,
}

impl LlamaCppInstall {
    /// The build under `workspace`, or where the environment says; an
    /// error saying what is missing when it is not there.
    pub fn find(workspace: &Path) -> Result<Self, String> {
        let server = std::env::var_os("TURBINE_LLAMA_SERVER").map_or_else(|| workspace.join("target/engines/llama-cpp/bin/llama-server"), PathBuf::from);
        match server.exists() {
            true => Ok(Self { server }),
            false => Err(format!("llama-server is not at {} (scripts/test.sh builds it: scripts/install-llama-cpp.sh)", server.display())),
        }
    }
}

/// A llama-server on a loopback port, killed on drop.
#[derive(Debug)]
pub struct LlamaCppServer {
    process: ChildProcess,
    port: u16,
}

impl LlamaCppServer {
    /// Starts llama-server on the GGUF at `model`, served as `served_name`,
    /// with its metrics on, two slots of 2,048 tokens, one thread, and
    /// `args` added; returns once /health answers 200.
    pub fn start(install: &LlamaCppInstall, model: &Path, served_name: &str, args: &[&str]) -> Self {
        let port = free_port();
        let mut command = Command::new(&install.server);
        command
            .arg("--model")
            .arg(model)
            .args(["--alias", served_name, "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--metrics", "--parallel", "2", "--ctx-size", "4096", "--threads", "1", "--no-webui"])
            .args(args);
        let mut process = ChildProcess::spawn("llama-server", command);
        until_healthy(&mut process, "llama-server", port, LLAMA_CPP_STARTUP_TIMEOUT, Duration::from_millis(100));
        Self { process, port }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// What it printed.
    pub fn output(&self) -> Vec<String> {
        self.process.output()
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}
