//! [`VllmServer`]: vLLM's CPU build serving a model, for the tests and
//! benches of workers in front of an external engine. The test command
//! installs it (`scripts/install-vllm.sh`) and converts the default model
//! for it (`scripts/gguf-to-hf.py`); see docs/engines.md.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{ChildProcess, free_port};

/// How long vLLM may take to load a model and answer /health (25-60 s on
/// two cores, more beside other work).
pub const VLLM_STARTUP_TIMEOUT: Duration = Duration::from_secs(240);

/// A vLLM server in a process group of its own (its engine core is a
/// child process), on a loopback port; the whole group is killed on drop.
#[derive(Debug)]
pub struct VllmServer {
    process: ChildProcess,
    port: u16,
}

/// Where the test command installs vLLM and the converted default model,
/// under the workspace's `target/engines` (overridden by
/// `$TURBINE_VLLM_PYTHON` and `$TURBINE_VLLM_MODEL`).
#[derive(Debug, Clone)]
pub struct VllmInstall {
    /// The Python of vLLM's virtual environment.
    pub python: PathBuf,
    /// The model directory (Hugging Face format).
    pub model: PathBuf,
}

impl VllmInstall {
    /// The install under `workspace`, or where the environment says;
    /// an error saying what is missing when it is not there.
    pub fn find(workspace: &Path) -> Result<Self, String> {
        let engines = workspace.join("target/engines");
        let python = std::env::var_os("TURBINE_VLLM_PYTHON").map_or_else(|| engines.join("vllm/bin/python"), PathBuf::from);
        let model = std::env::var_os("TURBINE_VLLM_MODEL").map_or_else(|| engines.join("smollm2-135m-hf"), PathBuf::from);
        for (path, what) in [(&python, "vLLM's Python"), (&model.join("config.json"), "the converted default model")] {
            if !path.exists() {
                return Err(format!("{what} is not at {} (scripts/test.sh installs it: scripts/install-vllm.sh, then scripts/gguf-to-hf.py)", path.display()));
            }
        }
        Ok(Self { python, model })
    }
}

impl VllmServer {
    /// Starts vLLM's OpenAI-compatible server on `install.model`, served
    /// as `served_name`, with `args` added; returns once /health answers
    /// 200. Settings for two cores (shared/PLATFORM.md): one OpenMP
    /// thread, 1 GiB of KV cache, blocks of 32 tokens, prefix caching.
    pub fn start(install: &VllmInstall, served_name: &str, args: &[&str]) -> Self {
        let mut server = Self::spawn(install, served_name, args);
        until_healthy(&mut server.process, "vLLM", server.port, VLLM_STARTUP_TIMEOUT, Duration::from_millis(500));
        server
    }

    /// Starts it as [`start`](Self::start) does without waiting for it:
    /// for a server /health cannot be asked of in plaintext (over TLS),
    /// whose caller waits on its own signal, bounded by
    /// [`VLLM_STARTUP_TIMEOUT`], checking [`exited`](Self::exited).
    pub fn spawn(install: &VllmInstall, served_name: &str, args: &[&str]) -> Self {
        let port = free_port();
        let mut all: Vec<String> =
            ["--host", "127.0.0.1", "--port", &port.to_string(), "--model", &install.model.display().to_string()].map(str::to_owned).into();
        all.extend(["--served-model-name", served_name, "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4"].map(str::to_owned));
        all.extend(["--enforce-eager", "--enable-prefix-caching", "--block-size", "32", "--enable-prompt-tokens-details"].map(str::to_owned));
        all.extend(args.iter().map(|arg| (*arg).to_owned()));
        Self::spawn_with(install, port, &all)
    }

    /// Starts vLLM's OpenAI-compatible server with exactly `args` (which
    /// must bind 127.0.0.1:`port`), in the environment above; returns once
    /// /health answers 200.
    pub fn start_with(install: &VllmInstall, port: u16, args: &[String]) -> Self {
        let mut server = Self::spawn_with(install, port, args);
        until_healthy(&mut server.process, "vLLM", port, VLLM_STARTUP_TIMEOUT, Duration::from_millis(500));
        server
    }

    fn spawn_with(install: &VllmInstall, port: u16, args: &[String]) -> Self {
        let mut command = Command::new(&install.python);
        command.args(["-m", "vllm.entrypoints.openai.api_server"]).args(args).envs([
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            ("OMP_NUM_THREADS", "1"),
            ("HF_HUB_OFFLINE", "1"),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("DO_NOT_TRACK", "1"),
        ]);
        {
            use std::os::unix::process::CommandExt;
            command.process_group(0);
        }
        Self { process: ChildProcess::spawn("vllm", command), port }
    }

    /// How it exited, if it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.process.exited()
    }

    /// `https://127.0.0.1:PORT`, for a server started with
    /// `--ssl-certfile`.
    pub fn https_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its process id (also its process group's: its engine core runs in
    /// the group).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// What it printed.
    pub fn output(&self) -> Vec<String> {
        self.process.output()
    }

    /// Kills the server and its engine core at once (SIGKILL to the
    /// group), as a crash would.
    pub fn kill(&mut self) {
        // SAFETY: kill(2) on the process group we created for the child; no
        // memory is involved.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(-(self.process.pid() as libc::pid_t), libc::SIGKILL);
        }
        self.process.kill();
    }
}

impl Drop for VllmServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Returns once the server `process` started answers `GET /health` on
/// the loopback `port` with 200, asking every `poll`; panics, with the end
/// of what it printed, when it exits first or has not answered within
/// `timeout`.
pub(crate) fn until_healthy(process: &mut ChildProcess, name: &str, port: u16, timeout: Duration, poll: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = process.exited() {
            panic!("{name} exited ({status}) before serving:\n{}", process.output().join("\n"));
        }
        if http_status(port, "/health") == Some(200) {
            return;
        }
        if Instant::now() >= deadline {
            let output = process.output();
            panic!("{name} did not answer /health within {timeout:?}:\n{}", output[output.len().saturating_sub(40)..].join("\n"));
        }
        std::thread::sleep(poll);
    }
}

/// The status of `GET path` on the loopback port, if it answers within a
/// second.
pub(crate) fn http_status(port: u16, path: &str) -> Option<u16> {
    let timeout = Duration::from_secs(1);
    let mut stream = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}
