//! [`ChildProcess`]: a spawned program, its output kept.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A spawned process whose combined output is collected in the
/// background, so a failure can show it.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    output: Arc<Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl ChildProcess {
    /// Spawns `command` with stdout and stderr captured.
    pub fn spawn(name: &str, mut command: Command) -> Self {
        command.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = command.spawn().unwrap_or_else(|error| panic!("cannot spawn {name}: {error}"));
        let output = Arc::new(Mutex::new(Vec::new()));
        let echo = std::env::var_os("TURBINE_TEST_ECHO").is_some();
        let streams = [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ];
        let readers = streams
            .into_iter()
            .flatten()
            .map(|stream| {
                let (output, name) = (output.clone(), name.to_owned());
                std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines() {
                        let Ok(line) = line else { break };
                        if echo {
                            eprintln!("[{name}] {line}");
                        }
                        output.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(line);
                    }
                })
            })
            .collect();
        Self { name: name.to_owned(), child, output, readers }
    }

    /// The process's name (for messages).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Every output line read so far.
    pub fn output(&self) -> Vec<String> {
        self.output.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Whether the process has exited (with its status).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
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

    /// Waits for the process to exit, up to `timeout`; then its output has
    /// been read to the end.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                for reader in self.readers.drain(..) {
                    let _ = reader.join();
                }
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
