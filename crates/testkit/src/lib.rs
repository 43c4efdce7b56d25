//! Test harness for integration tests: real servers and real Turbine
//! processes on free ports, with readiness read from the processes
//! themselves rather than guessed with sleeps.
//!
//! - [`RedisServer`]: a private `redis-server` (from the machine's PATH) on a
//!   free loopback port, killed on drop.
//! - [`ChildProcess`]: a spawned binary whose log lines can be awaited,
//!   signalled with SIGTERM, and killed on drop.
//! - [`free_port`], [`workspace_binary`].

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a server may take to start before the test fails.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// A port that was free a moment ago (bound to port 0 and released).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|listener| listener.local_addr()).expect("bind port 0").port()
}

/// Path of a binary built from this workspace (`turbine`, `turbine-worker`,
/// ...), next to the running test's target directory.
pub fn workspace_binary(name: &str) -> PathBuf {
    let test_exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let profile_dir = test_exe.parent().and_then(|deps| deps.parent()).expect("target layout");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built; run the tests with `cargo test --workspace` (which builds every binary)",
        path.display()
    );
    path
}

/// A spawned process whose combined output is read line by line.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl ChildProcess {
    /// Spawns `command` with stdout and stderr captured.
    pub fn spawn(name: &str, mut command: Command) -> Self {
        command.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = command.spawn().unwrap_or_else(|error| panic!("cannot spawn {name}: {error}"));
        let (sender, lines) = mpsc::channel();
        for stream in [child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>)]
            .into_iter()
            .flatten()
        {
            let sender = sender.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if sender.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Self { name: name.to_owned(), child, lines, seen: Vec::new() }
    }

    /// Waits until an output line contains `needle` and returns that line.
    /// Panics, printing the output so far, if the process exits or the
    /// timeout passes first.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(remaining.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if std::env::var_os("TURBINE_TEST_ECHO").is_some() {
                        eprintln!("[{}] {line}", self.name);
                    }
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = self.child.try_wait() {
                        panic!("{} exited ({status}) before printing {needle:?}; output:\n{}", self.name, self.seen.join("\n"));
                    }
                    if Instant::now() >= deadline {
                        panic!("{} did not print {needle:?} within {timeout:?}; output:\n{}", self.name, self.seen.join("\n"));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().ok();
                    panic!("{} closed its output ({status:?}) before printing {needle:?}; output:\n{}", self.name, self.seen.join("\n"));
                }
            }
        }
    }

    /// Reads the lines printed so far without waiting; returns every line
    /// read (for a test that reports a process's log when it fails).
    pub fn drain(&mut self) -> &[String] {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        &self.seen
    }

    /// Every output line read so far.
    pub fn output(&self) -> &[String] {
        &self.seen
    }

    /// Collects the output still buffered, after the process exited: waits
    /// (briefly) for the readers to reach the end of the pipes.
    fn drain_output(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            self.seen.push(line);
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        // SAFETY: kill(2) with a pid we spawned and own; no memory is involved.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit, up to `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.drain_output();
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            // Exit is not observable as an event without a reaper thread; poll briefly.
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// A private Redis server on a free loopback port, with no persistence.
#[derive(Debug)]
pub struct RedisServer {
    process: ChildProcess,
    port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts `redis-server` and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    /// Starts `redis-server` on `port` (e.g. to restart one at the same address).
    pub fn start_on(port: u16) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let binary = std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned());
        let mut command = Command::new(&binary);
        command
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(dir.path());
        let mut process = ChildProcess::spawn("redis-server", command);
        process.wait_for_line("Ready to accept connections", STARTUP_TIMEOUT);
        Self { process, port, _dir: dir }
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

/// Polls `condition` every 20 ms until it holds and returns how long that
/// took; panics naming `what` if it does not hold within `deadline`.
pub async fn wait_until(what: &str, deadline: Duration, mut condition: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !condition().await {
        assert!(started.elapsed() < deadline, "{what}: not within {deadline:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// Reads one metric's value (summing its series) from the `/metrics` page
/// at `base` (e.g. `http://127.0.0.1:9092`).
pub async fn metric(base: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every series of one metric on the `/metrics` page at `base`, as
/// exposition lines (for diagnostics).
pub async fn metric_lines(base: &str, name: &str) -> Vec<String> {
    let text = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    text.lines().filter(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{'])).map(str::to_owned).collect()
}

/// Like [`metric`], summing only the series that carry every given
/// `label="value"` pair.
pub async fn metric_where(base: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{']))
        .filter(|line| labels.iter().all(|(label, value)| line.contains(&format!("{label}=\"{value}\""))))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
