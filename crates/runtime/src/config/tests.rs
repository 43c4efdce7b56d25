use clap::Parser;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TestPorts {}

impl ServiceDefaults for TestPorts {
    const GRPC_ADDR: &'static str = "0.0.0.0:7001";
    const GRPC_ADDR_ENV: &'static str = "TURBINE_CONFIG_TEST_GRPC_ADDR";
    const ADMIN_ADDR: Option<&'static str> = Some("0.0.0.0:7002");
    const ADMIN_ADDR_ENV: &'static str = "TURBINE_CONFIG_TEST_ADMIN_ADDR";
    const SHUTDOWN_GRACE_SECS: &'static str = "3";
}

/// A nested `[tuning]` section.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
struct Tuning {
    /// A ratio.
    #[arg(long = "tuning-ratio", default_value_t = 0.5)]
    ratio: f64,
    /// A switch.
    #[arg(long = "tuning-enabled", num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    enabled: bool,
}

#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
struct TestConfig {
    #[command(flatten)]
    #[serde(flatten)]
    server: ServerConfig<TestPorts>,
    /// A port.
    #[arg(long, env = "TURBINE_CONFIG_TEST_PORT", default_value_t = 1)]
    port: u16,
    /// A name.
    #[arg(long, env = "TURBINE_CONFIG_TEST_NAME", default_value = "default")]
    name: String,
    /// An optional URL.
    #[arg(long)]
    url: Option<String>,
    #[command(flatten)]
    tuning: Tuning,
}

impl Settings for TestConfig {
    const CONFIG_ENV: &'static str = "TURBINE_CONFIG_TEST_CONFIG";

    fn validate(&self) -> Result<(), InvalidSetting> {
        if self.port == 0 { Err(InvalidSetting::new("port", "must be positive")) } else { self.server.validate() }
    }
}

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    config: Layered<TestConfig>,
}

fn parse(args: &[&str]) -> Result<TestConfig, String> {
    Cli::try_parse_from(std::iter::once("test").chain(args.iter().copied())).map(|cli| cli.config.0).map_err(|error| error.to_string())
}

fn file(contents: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), contents).unwrap();
    file
}

#[test]
fn defaults_come_from_the_declarations() {
    let config = parse(&[]).unwrap();
    assert_eq!(config, defaults::<TestConfig>());
    assert_eq!(config.server.grpc_addr, "0.0.0.0:7001".parse().unwrap(), "the service's own default");
    assert_eq!(config.server.admin_addr, Some("0.0.0.0:7002".parse().unwrap()));
    assert_eq!(config.server.shutdown_grace_secs, 3.0);
    assert_eq!((config.port, config.name.as_str(), config.url.as_deref()), (1, "default", None));
    assert_eq!(config.tuning, Tuning { ratio: 0.5, enabled: false });
}

#[test]
fn precedence_is_defaults_then_file_then_flags() {
    let config_file = file("port = 2\nname = \"file\"\ngrpc_addr = \"127.0.0.1:9\"\n[tuning]\nratio = 0.25\n");
    let path = config_file.path().to_str().unwrap();
    let from_file = parse(&["--config", path]).unwrap();
    assert_eq!((from_file.port, from_file.name.as_str()), (2, "file"));
    assert_eq!(from_file.server.grpc_addr, "127.0.0.1:9".parse().unwrap(), "a flattened section's key sits at the top");
    assert_eq!(from_file.tuning.ratio, 0.25, "a nested section is a table");

    let merged = parse(&["--config", path, "--port", "4", "--tuning-enabled"]).unwrap();
    assert_eq!((merged.port, merged.name.as_str(), merged.tuning.ratio, merged.tuning.enabled), (4, "file", 0.25, true));
    // A flag set to its default still beats the file.
    assert_eq!(parse(&["--config", path, "--port", "1"]).unwrap().port, 1);
}

#[test]
fn environment_lies_between_file_and_flags() {
    // The variable names are unique to this test, so no other test sees them.
    in_child_with_env("config::tests::environment_lies_between_file_and_flags", || {
        let config_file = file("port = 2\nname = \"file\"\n");
        let path = config_file.path().to_str().unwrap();
        assert_eq!(parse(&["--config", path]).unwrap().name, "env", "env beats the file");
        assert_eq!(parse(&["--config", path, "--name", "flag"]).unwrap().name, "flag", "flags beat env");
        assert_eq!(defaults::<TestConfig>().name, "default", "defaults ignore the environment");
    });
}

/// Runs `f` where TURBINE_CONFIG_TEST_NAME=env. Setting a variable
/// in-process races other test threads (and is `unsafe` in edition 2024),
/// so this re-runs the test binary, filtered to the calling test, with the
/// variable set.
fn in_child_with_env(test: &str, f: impl FnOnce()) {
    if std::env::var("TURBINE_CONFIG_TEST_NAME").as_deref() == Ok("env") {
        f();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let status = std::process::Command::new(exe).args(["--exact", test, "--nocapture"]).env("TURBINE_CONFIG_TEST_NAME", "env").status().unwrap();
    assert!(status.success(), "child run failed");
}

#[test]
fn unknown_and_mistyped_keys_are_refused_naming_the_file() {
    let unknown = file("prot = 2\n");
    let error = parse(&["--config", unknown.path().to_str().unwrap()]).unwrap_err();
    assert!(error.contains("unknown key `prot`") && error.contains(&unknown.path().display().to_string()), "{error}");
    let nested = file("[tuning]\nratoi = 1.0\n");
    let error = parse(&["--config", nested.path().to_str().unwrap()]).unwrap_err();
    assert!(error.contains("unknown key `tuning.ratoi`"), "{error}");
    let mistyped = file("port = \"eighty\"\n");
    let error = parse(&["--config", mistyped.path().to_str().unwrap()]).unwrap_err();
    assert!(error.contains(&mistyped.path().display().to_string()), "{error}");
    let missing = parse(&["--config", "/nonexistent/turbine.toml"]).unwrap_err();
    assert!(missing.contains("cannot read config file /nonexistent/turbine.toml"), "{missing}");
}

#[test]
fn values_are_validated_after_layering() {
    assert!(parse(&["--port", "0"]).unwrap_err().contains("port: must be positive"));
    assert!(parse(&["--shutdown-grace-secs=-1"]).unwrap_err().contains("shutdown_grace_secs"));
    for refused in ["-1", "301", "NaN", "inf"] {
        let error = parse(&[&format!("--drain-delay-secs={refused}")]).unwrap_err();
        assert!(error.contains("drain_delay_secs: must be between 0 and 300 seconds"), "{refused}: {error}");
    }
    assert_eq!(parse(&["--drain-delay-secs", "5"]).unwrap().server.drain_delay(), std::time::Duration::from_secs(5));
    assert_eq!(parse(&[]).unwrap().server.drain_delay(), std::time::Duration::ZERO, "no delay unless asked");
}

#[test]
fn the_tls_settings_come_together() {
    let config = parse(&["--tls-cert", "a.crt", "--tls-key", "a.key", "--tls-ca", "ca.crt"]).unwrap();
    assert_eq!(config.server.tls.tls_ca, Some(PathBuf::from("ca.crt")));
    assert_eq!(parse(&[]).unwrap().server.tls, crate::trust::TlsConfig::default(), "plaintext unless set");
    assert!(parse(&["--tls-cert", "a.crt"]).unwrap_err().contains("--tls-key"));
    // A file that sets only some of them.
    let partial = file("tls_cert = \"a.crt\"\n");
    let error = parse(&["--config", partial.path().to_str().unwrap()]).unwrap_err();
    assert!(error.contains("tls_cert, tls_key, tls_ca: go together"), "{error}");
}
