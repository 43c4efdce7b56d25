//! [`PostgresServer`]: a private PostgreSQL server for one test or
//! benchmark, made with `initdb` and run from `postgres` on a free port.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{ChildProcess, STARTUP_TIMEOUT, StartFailure, free_port};

/// A private PostgreSQL server on a loopback port: a fresh cluster in a
/// temporary directory, trust authentication for the user `turbine`, no
/// fsync (a test's data need not survive a power cut, only a crash of the
/// server, which `fsync = off` still survives).
#[derive(Debug)]
pub struct PostgresServer {
    process: Option<ChildProcess>,
    port: u16,
    bin: PathBuf,
    run_as: Option<(u32, u32)>,
    dir: tempfile::TempDir,
}

/// A PostgreSQL server's TLS: its certificate and key (naming
/// `127.0.0.1`) and the CA its clients' certificates must chain to (PEM
/// files).
#[derive(Debug, Clone)]
pub struct PostgresTls {
    /// The server's certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// The CA.
    pub ca: PathBuf,
}

/// Ports tried before giving up (each may be taken by someone else
/// between choosing it and the server binding it).
const PORT_ATTEMPTS: usize = 5;

/// The database user, with trust authentication on loopback.
const USER: &str = "turbine";

impl PostgresServer {
    /// Makes a cluster with `initdb` and starts `postgres` on a free port;
    /// returns once it accepts connections (`pg_isready`). The binaries
    /// come from `$TURBINE_POSTGRES_BIN` (a directory), else from where
    /// `initdb` on PATH points, else Debian's `/usr/lib/postgresql/*/bin`.
    /// As root, the server runs as the user `postgres` (it refuses root).
    pub fn start() -> Self {
        let bin = bin_dir().unwrap_or_else(|| panic!("no PostgreSQL binaries: set TURBINE_POSTGRES_BIN or install initdb and postgres"));
        let dir = tempfile::tempdir().expect("temporary directory");
        // SAFETY: geteuid(2) reads the process's credentials; nothing else.
        #[allow(unsafe_code)]
        let root = unsafe { libc::geteuid() } == 0;
        let run_as = root.then(postgres_user);
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("hand the data directory to the postgres user");
        }
        let mut initdb = Command::new(bin.join("initdb"));
        initdb.args(["-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions", "-D"]).arg(data_dir(dir.path()));
        as_user(&mut initdb, run_as);
        let output = initdb.output().unwrap_or_else(|error| panic!("cannot run initdb: {error}"));
        assert!(output.status.success(), "initdb failed: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        let mut server = Self { process: None, port: 0, bin, run_as, dir };
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            match server.try_start_on(free_port()) {
                Ok(()) => return server,
                Err(error) => last_error = Some(error),
            }
        }
        panic!("postgres did not start: {}", last_error.expect("at least one attempt"));
    }

    fn try_start_on(&mut self, port: u16) -> Result<(), StartFailure> {
        let mut command = Command::new(self.bin.join("postgres"));
        command
            .arg("-D")
            .arg(data_dir(self.dir.path()))
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-F", "-c", "max_connections=50"])
            .arg("-k")
            .arg(self.dir.path());
        as_user(&mut command, self.run_as);
        let mut process = ChildProcess::spawn("postgres", command);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = process.exited() {
                return Err(StartFailure::exited(status, &process));
            }
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string(), "-U", USER, "-t", "1"])
                .status()
                .map_err(|error| StartFailure::setup("running pg_isready")(error.into()))?;
            if ready.success() {
                self.process = Some(process);
                self.port = port;
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(StartFailure::NoAnswer);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://turbine@127.0.0.1:<port>/<database>`; the database
    /// `postgres` always exists, others are made with [`create_database`](Self::create_database).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{database}", self.port)
    }

    /// Turns TLS on and requires it, with a client certificate of the CA
    /// in `tls`, for every connection over TCP (the local socket, which the
    /// harness itself uses, stays open); restarts the server.
    pub fn require_tls(&mut self, tls: &PostgresTls) {
        let data = data_dir(self.dir.path());
        for (from, name, mode) in [(&tls.cert, "server.crt", 0o644), (&tls.key, "server.key", 0o600), (&tls.ca, "root.crt", 0o644)] {
            let to = data.join(name);
            std::fs::copy(from, &to).unwrap_or_else(|error| panic!("cannot copy {}: {error}", from.display()));
            std::fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(mode)).expect("set the mode");
            if let Some((uid, gid)) = self.run_as {
                std::os::unix::fs::chown(&to, Some(uid), Some(gid)).expect("hand the file to the postgres user");
            }
        }
        let mut conf = std::fs::OpenOptions::new().append(true).open(data.join("postgresql.conf")).expect("postgresql.conf");
        std::io::Write::write_all(&mut conf, b"\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'root.crt'\n")
            .expect("write postgresql.conf");
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 trust clientcert=verify-ca\nhostssl all all ::1/128 trust clientcert=verify-ca\n";
        std::fs::write(data.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        self.restart();
    }

    /// [`url`](Self::url) over TLS: the server verified against the CA and
    /// this client's certificate presented (libpq's `sslmode=verify-full`
    /// parameters, which sqlx reads too).
    pub fn tls_url(&self, database: &str, ca: &Path, cert: &Path, key: &Path) -> String {
        format!("{}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}", self.url(database), ca.display(), cert.display(), key.display())
    }

    /// Creates an empty database named `name` (over the local socket).
    pub fn create_database(&self, name: &str) {
        let output = Command::new(self.bin.join("createdb"))
            .arg("-h")
            .arg(self.dir.path())
            .args(["-p", &self.port.to_string(), "-U", USER, name])
            .output()
            .unwrap_or_else(|error| panic!("cannot run createdb: {error}"));
        assert!(output.status.success(), "createdb {name} failed: {}", String::from_utf8_lossy(&output.stderr));
    }

    /// Runs `sql` in `database` as the superuser (over the local socket):
    /// roles and grants a test sets up as an operator would.
    pub fn psql(&self, database: &str, sql: &str) {
        let output = Command::new(self.bin.join("psql"))
            .arg("-h")
            .arg(self.dir.path())
            .args(["-p", &self.port.to_string(), "-U", USER, "-v", "ON_ERROR_STOP=1", "-d", database, "-c", sql])
            .output()
            .unwrap_or_else(|error| panic!("cannot run psql: {error}"));
        assert!(output.status.success(), "psql {sql:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    }

    /// [`url`](Self::url) as another role (logged in without a password, as
    /// the harness's server trusts local connections).
    pub fn url_as(&self, role: &str, database: &str) -> String {
        format!("postgres://{role}@127.0.0.1:{}/{database}", self.port)
    }

    /// Kills the server (SIGKILL), as a crash would; [`restart`](Self::restart)
    /// brings it back with its data.
    pub fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }

    /// Starts the server again on the same port, with the same data
    /// (after [`kill`](Self::kill)); returns once it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.port;
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            match self.try_start_on(port) {
                Ok(()) => return,
                Err(error) => last_error = Some(error),
            }
        }
        panic!("postgres did not restart on port {port}: {}", last_error.expect("at least one attempt"));
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn data_dir(dir: &Path) -> PathBuf {
    dir.join("data")
}

fn as_user(command: &mut Command, run_as: Option<(u32, u32)>) {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid);
    }
}

/// The uid and gid of the user `postgres`, for running the server as root.
fn postgres_user() -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let output = Command::new("id").args([flag, "postgres"]).output().expect("run id");
        assert!(output.status.success(), "running as root needs a user named postgres to run the server: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().parse().expect("a numeric id")
    };
    (id("-u"), id("-g"))
}

fn bin_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TURBINE_POSTGRES_BIN") {
        return Some(PathBuf::from(dir));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("initdb"))
        .find(|initdb| initdb.is_file());
    if let Some(dir) = on_path.and_then(|initdb| std::fs::canonicalize(initdb).ok()).and_then(|initdb| initdb.parent().map(Path::to_path_buf))
        && dir.join("postgres").is_file()
        && dir.join("pg_isready").is_file()
    {
        return Some(dir);
    }
    let mut versions: Vec<PathBuf> =
        std::fs::read_dir("/usr/lib/postgresql").ok()?.flatten().map(|entry| entry.path().join("bin")).filter(|bin| bin.join("initdb").is_file()).collect();
    versions.sort();
    versions.pop()
}
