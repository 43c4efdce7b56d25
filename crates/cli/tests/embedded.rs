//! `turbine run` as a real process: it starts on the ports it is given,
//! reports where it listens in its addresses file, reads a per-service
//! config file, and on SIGTERM completes every stream in flight, then exits
//! 0. (What the embedded cluster serves is tested in this process, in
//! `turbine-cluster`'s tests.)

mod common;

use std::process::Command;

use common::{EXIT_TIMEOUT, MODEL, read_events, until_listed};
use serde_json::json;
use turbine_testkit::{ServiceProcess, addresses_file};

/// `turbine run` with `args` on free loopback ports.
async fn start_turbine(args: &[&str]) -> ServiceProcess {
    let (dir, file) = addresses_file().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine"));
    command.args(["run", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--addresses-file"]).arg(&file).args(args);
    let turbine = ServiceProcess::spawn_with_addresses_file("turbine run", command, dir, file).await.unwrap();
    until_listed(&turbine.http_url()).await;
    turbine
}

#[tokio::test]
async fn sigterm_during_32_streams_completes_them_all_then_exits_zero() {
    let config = tempfile::NamedTempFile::new().unwrap();
    // The engine from the file's worker section; the speed from a flag.
    std::fs::write(config.path(), "[worker]\nengine = \"mock\"\nspeedup = 1000.0\n[gateway]\nmax_concurrent_requests = 64\n").unwrap();
    let mut turbine = start_turbine(&["--config", config.path().to_str().unwrap(), "--speedup", "1"]).await;
    let base = turbine.http_url();
    let url = format!("{base}/v1/chat/completions");
    let client = reqwest::Client::new();
    let mut responses = Vec::new();
    for i in 0..32 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("request {i}")}], "max_tokens": 150,
                          "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
        let response = client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        responses.push(response);
    }
    // Every stream is open (headers received); generation is under way.
    turbine.terminate();
    let results = futures::future::join_all(responses.into_iter().map(read_events)).await;
    for events in &results {
        let usage: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 150, "a stream was cut short: {:?}", &events[events.len().saturating_sub(3)..]);
    }
    assert_eq!(results.len(), 32);
    let status = turbine.wait(EXIT_TIMEOUT).expect("turbine did not exit after draining");
    assert!(status.success(), "exit status {status}");
    // New connections are refused once it has exited.
    assert!(reqwest::get(format!("{base}/health")).await.is_err());
}

#[test]
fn bad_configuration_is_refused_naming_the_problem() {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "[worker]\nspeeed = 2.0\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_turbine")).args(["run", "--config", config.path().to_str().unwrap()]).output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unknown key `worker.speeed`") && stderr.contains(&config.path().display().to_string()), "{stderr}");
}

#[tokio::test]
async fn turbine_keys_new_makes_keys_that_turbine_run_requires_on_every_host() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys.toml");
    let new_key = |name: &str, tenant: &str| {
        Command::new(env!("CARGO_BIN_EXE_turbine")).args(["keys", "new", "--name", name, "--tenant", tenant, "--file"]).arg(&file).output().unwrap()
    };
    let made = new_key("alice", "a");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let key = String::from_utf8(made.stdout).unwrap().trim().to_owned();
    assert!(key.starts_with("tk_"), "{key}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(!text.contains(&key), "the file holds the digest, not the key");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    let limited = Command::new(env!("CARGO_BIN_EXE_turbine"))
        .args(["keys", "new", "--name", "bob", "--tenant", "b", "--requests-per-minute", "60", "--max-concurrent", "2", "--file"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(limited.status.success(), "{}", String::from_utf8_lossy(&limited.stderr));
    assert!(std::fs::read_to_string(&file).unwrap().contains("requests_per_minute = 60\nmax_concurrent = 2"));
    let again = new_key("alice", "c");
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("another key has this name"));
    assert_eq!(std::fs::read_to_string(&file).unwrap().matches("[[keys]]").count(), 2, "a refused key is not written");

    // Keys authenticate callers, so turbine run may listen beyond loopback
    // without --insecure.
    let (addresses_dir, addresses) = addresses_file().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine"));
    command
        .args(["run", "--engine", "mock", "--speedup", "1000", "--host", "0.0.0.0", "--http-port", "0", "--grpc-port", "0", "--api-keys"])
        .arg(&file)
        .arg("--addresses-file")
        .arg(&addresses);
    let turbine = ServiceProcess::spawn_with_addresses_file("turbine run", command, addresses_dir, addresses).await.unwrap();
    let base = turbine.http_url();
    let client = reqwest::Client::new();
    turbine_testkit::wait_until("the gateway lists the model to a key holder", turbine_testkit::STARTUP_TIMEOUT, async || {
        let Ok(response) = client.get(format!("{base}/v1/models")).bearer_auth(&key).send().await else { return false };
        response.json::<serde_json::Value>().await.is_ok_and(|body| body["data"].as_array().is_some_and(|data| !data.is_empty()))
    })
    .await;
    let refused = client.get(format!("{base}/v1/models")).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 3});
    let answered = client.post(format!("{base}/v1/completions")).bearer_auth(&key).json(&body).send().await.unwrap();
    assert_eq!(answered.status(), 200);
    drop(turbine);

    // A keys file the gateway cannot use stops it at start, naming it.
    std::fs::write(&file, "[[keys]]\nname = \"x\"\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_turbine"))
        .args(["run", "--engine", "mock", "--http-port", "0", "--grpc-port", "0", "--api-keys"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("keys.toml"), "{stderr}");
}

/// `turbine run --api-keys` on a public certificate (`--public-tls-cert`,
/// `--public-tls-key`) serves its API over HTTPS to a client that trusts
/// the certificate's CA and holds a key (it checks its own gateway through
/// a channel pinned to that certificate: `crates/runtime/tests/public_tls.rs`).
#[tokio::test]
async fn turbine_run_serves_its_api_over_tls_with_a_public_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys.toml");
    let made = Command::new(env!("CARGO_BIN_EXE_turbine")).args(["keys", "new", "--name", "app", "--tenant", "a", "--file"]).arg(&file).output().unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let key = String::from_utf8(made.stdout).unwrap().trim().to_owned();
    let ca = turbine_testkit::tls::TestCa::new("public");
    let public = ca.issue_names(&["localhost".to_owned()], "api").write(dir.path(), "public");
    let path = |path: &Option<std::path::PathBuf>| path.as_deref().unwrap().to_str().unwrap().to_owned();
    let (cert, private) = (path(&public.tls_cert), path(&public.tls_key));
    let keys = file.to_str().unwrap().to_owned();
    let (addresses_dir, addresses) = addresses_file().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine"));
    command.args(["run", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--engine", "mock", "--speedup", "1000", "--api-keys", &keys]);
    command.args(["--public-tls-cert", &cert, "--public-tls-key", &private, "--addresses-file"]).arg(&addresses);
    let turbine = ServiceProcess::spawn_with_addresses_file("turbine run", command, addresses_dir, addresses).await.unwrap();
    let http = turbine.addresses().http.expect("an HTTP port");
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": true});
    let mut served = String::new();
    turbine_testkit::wait_until("served over https", turbine_testkit::STARTUP_TIMEOUT, async || {
        served = common::https_post(http, ca.pem(), "/v1/completions", Some(&key), &body).await;
        served.starts_with("HTTP/1.1 200")
    })
    .await;
    assert!(served.contains("\"completion_tokens\":3"), "{served}");
    let refused = common::https_post(http, ca.pem(), "/v1/completions", None, &body).await;
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
    let plaintext = reqwest::Client::new().post(format!("http://{http}/v1/completions")).bearer_auth(&key).json(&body).send().await;
    assert!(plaintext.is_err(), "a plaintext request was answered: {plaintext:?}");
    drop(turbine);
}

/// API keys in Postgres: `turbine keys new --database` adds a key once and
/// both `turbine run`s reading the database accept it, one of them as a
/// role that may only read the table; `turbine keys revoke` has both
/// refuse it without a restart, and the other key answers on, as does a
/// row edited by hand: each change announced by the table's trigger and
/// heard at once (the gateways read it on their own only hourly), the
/// read-only one following only once the other has made the trigger a
/// table made before it lacked; the planner's ledger shares the database either side of the gateways'
/// table; with Postgres gone the keys last read stay in force.
#[tokio::test]
async fn keys_in_postgres_are_added_and_revoked_once_for_every_gateway() {
    let mut postgres = turbine_testkit::PostgresServer::start();
    postgres.create_database("turbine");
    let url = postgres.url("turbine");
    // The planner's state first: the two share one database.
    turbine_planner::ledger::Ledger::open(&url, "default").await.expect("the planner's schema");
    // A gateway's role: it may read the table, nothing more (no table may
    // it make, no row write).
    postgres.psql("turbine", "CREATE ROLE gateway LOGIN");
    let reader = postgres.url_as("gateway", "turbine");
    let unmade = turbine_gateway::keys::KeyTable::open_to_read(&reader, "default").await.expect_err("no table to read, none it may make");
    assert!(unmade.to_string().contains("turbine keys list --database"), "{unmade}");
    let keys = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_turbine")).arg("keys").args(args).args(["--database", &url]).output().unwrap();
    let made = |output: std::process::Output| {
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    };
    let alice = made(keys(&["new", "--name", "alice", "--tenant", "a"]));
    let bob = made(keys(&["new", "--name", "bob", "--tenant", "b", "--requests-per-minute", "600"]));
    assert!(alice.starts_with("tk_") && alice != bob, "{alice} {bob}");
    let carol = made(keys(&["new", "--name", "carol", "--tenant", "c", "--expires-at", "2099-01-01T00:00:00Z"]));
    let past = keys(&["new", "--name", "dave", "--tenant", "d", "--expires-at", "2020-01-01T00:00:00+01:00"]);
    assert!(!past.status.success() && String::from_utf8_lossy(&past.stderr).contains("is past"), "{past:?}");
    let again = keys(&["new", "--name", "alice", "--tenant", "c"]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already has a key named \"alice\""), "{again:?}");

    postgres.psql("turbine", "GRANT SELECT ON gateway_api_keys TO gateway");

    // A table made before its trigger (by an older `turbine keys`): the
    // reading role may not make it, so its gateway cannot listen yet, and
    // says so.
    postgres.psql("turbine", "DROP FUNCTION gateway_api_keys_announce() CASCADE; DELETE FROM _sqlx_migrations WHERE version = 1101");
    let gateway = async |database: &str| {
        let (addresses_dir, addresses) = addresses_file().unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_turbine"));
        command
            .args([
                "run",
                "--engine",
                "mock",
                "--speedup",
                "1000",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                // Hourly: every change below reaches them announced.
                "--api-keys-reload-secs",
                "3600",
                "--api-keys-database",
                database,
            ])
            .arg("--addresses-file")
            .arg(&addresses);
        ServiceProcess::spawn_with_addresses_file("turbine run", command, addresses_dir, addresses).await.unwrap()
    };
    let following = async |admin: &str| turbine_testkit::metric_lines(admin, "turbine_gateway_api_keys_following").await;
    let mut gateways = vec![gateway(&reader).await];
    let admin = gateways[0].admin_url();
    turbine_testkit::wait_until("the gateway tells it has no trigger to hear", std::time::Duration::from_secs(30), async || {
        following(&admin).await == ["turbine_gateway_api_keys_following 0"]
    })
    .await;
    // The other may make it: the first then follows too (tried again
    // within a minute), and both hear every change below.
    gateways.push(gateway(&url).await);
    for gateway in &gateways {
        let admin = gateway.admin_url();
        turbine_testkit::wait_until("the gateway hears the table's changes", std::time::Duration::from_secs(90), async || {
            following(&admin).await == ["turbine_gateway_api_keys_following 1"]
        })
        .await;
    }
    let client = reqwest::Client::builder().timeout(std::time::Duration::from_secs(30)).build().unwrap();
    let status = async |base: &str, key: Option<&str>| {
        let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 3});
        let request = client.post(format!("{base}/v1/completions")).json(&body);
        let request = match key {
            Some(key) => request.bearer_auth(key),
            None => request,
        };
        request.send().await.unwrap().status().as_u16()
    };
    for gateway in &gateways {
        let base = gateway.http_url();
        turbine_testkit::wait_until("the gateway serves a key holder", turbine_testkit::STARTUP_TIMEOUT, async || status(&base, Some(&alice)).await == 200)
            .await;
        assert_eq!(
            (status(&base, Some(&bob)).await, status(&base, Some(&carol)).await, status(&base, None).await, status(&base, Some("tk_guess")).await),
            (200, 200, 401, 401)
        );
        // For the alert before a key expires: carol's (2099-01-01), no other.
        let expiry = async |key: &str| turbine_testkit::metric_where(&gateway.admin_url(), "turbine_gateway_api_key_expires_at_seconds", &[("key", key)]).await;
        assert_eq!((expiry("carol").await, expiry("bob").await), (4_070_908_800.0, 0.0));
    }

    // Revoked once, refused by both.
    made(keys(&["revoke", "--name", "alice"]));
    for gateway in &gateways {
        let base = gateway.http_url();
        // Four times a second: 401s past 16 at once, then one a second, on
        // one connection lose it.
        turbine_testkit::poll_until("the revoked key is refused", std::time::Duration::from_secs(30), std::time::Duration::from_millis(250), async || {
            status(&base, Some(&alice)).await == 401
        })
        .await;
        assert_eq!(status(&base, Some(&bob)).await, 200, "the other key answers on");
    }
    // carol's expiry passed (set back by hand, as time would move it): its
    // holder is told so, the others answer on.
    postgres.psql("turbine", "UPDATE gateway_api_keys SET expires_at_unix_ms = 1000 WHERE name = 'carol'");
    for gateway in &gateways {
        let base = gateway.http_url();
        turbine_testkit::poll_until("the expired key is refused", std::time::Duration::from_secs(30), std::time::Duration::from_millis(250), async || {
            status(&base, Some(&carol)).await == 401
        })
        .await;
        let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 3});
        let refused: serde_json::Value =
            client.post(format!("{base}/v1/completions")).bearer_auth(&carol).json(&body).send().await.unwrap().json().await.unwrap();
        assert!(refused["error"]["message"].as_str().is_some_and(|message| message.contains("expired")), "{refused}");
        let expiry = turbine_testkit::metric_where(&gateway.admin_url(), "turbine_gateway_api_key_expires_at_seconds", &[("key", "carol")]).await;
        assert_eq!(expiry, 1.0, "the expiry read again");
        assert_eq!(status(&base, Some(&bob)).await, 200);
    }
    let listed = made(keys(&["list"]));
    let line = |name: &str| listed.lines().find(|line| line.starts_with(name)).unwrap_or_else(|| panic!("{name} listed: {listed}")).to_owned();
    assert!(!line("alice").ends_with(" -") && line("bob").ends_with(" -"), "alice revoked, bob in force:\n{listed}");
    assert!(line("bob").contains("600"), "its limit: {listed}");
    assert!(line("carol").contains("1970-01-01T00:00:01Z"), "its expiry: {listed}");
    assert!(!listed.contains(&alice) && !listed.contains(&bob), "never a key: {listed}");
    let twice = keys(&["revoke", "--name", "alice"]);
    assert!(!twice.status.success() && String::from_utf8_lossy(&twice.stderr).contains("no key in force named \"alice\""), "{twice:?}");
    // The planner opens the database the gateways migrated too.
    turbine_planner::ledger::Ledger::open(&url, "default").await.expect("the planner beside the keys table");

    // Postgres gone: the keys last read stay in force.
    postgres.kill();
    for gateway in &gateways {
        let admin = gateway.admin_url();
        turbine_testkit::wait_until("a reload finds the database gone", std::time::Duration::from_secs(30), async || {
            turbine_testkit::metric_where(&admin, "turbine_gateway_api_key_reloads_total", &[("outcome", "unreadable")]).await >= 1.0
        })
        .await;
        turbine_testkit::wait_until("the gateway tells it no longer hears the table", std::time::Duration::from_secs(30), async || {
            following(&admin).await == ["turbine_gateway_api_keys_following 0"]
        })
        .await;
        let base = gateway.http_url();
        assert_eq!((status(&base, Some(&bob)).await, status(&base, Some(&alice)).await), (200, 401));
    }
}
