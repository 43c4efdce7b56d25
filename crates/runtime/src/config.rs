//! Layered configuration: defaults in code < a TOML file < `TURBINE_*`
//! environment variables < command-line flags.
//!
//! A service declares two structs with the same field names: its config
//! (`Deserialize + Serialize + Default`, `deny_unknown_fields`) and its clap
//! arguments (every field an `Option`, `#[arg(long, env = "TURBINE_...")]`,
//! serialized with `skip_serializing_if = "Option::is_none"`). clap already
//! gives flags precedence over the environment; [`load`] lays the result
//! over the file, which lies over the defaults, then deserializes and
//! refuses unknown keys.

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The config file is not valid TOML or has unknown or mistyped keys.
    #[error("invalid configuration{origin}: {message}")]
    Invalid {
        /// Where the bad value came from (file name), if known.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

/// Loads a configuration: defaults, then `file` (if any), then the
/// command-line/environment `overrides`.
pub fn load<C, O>(file: Option<&Path>, overrides: &O) -> Result<C, ConfigError>
where
    C: DeserializeOwned + Serialize + Default,
    O: Serialize,
{
    let mut merged = to_table(&C::default(), "")?;
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        let origin = format!(" in {}", path.display());
        let table: toml::Table =
            text.parse().map_err(|error: toml::de::Error| ConfigError::Invalid { origin: origin.clone(), message: error.to_string() })?;
        // Check the file alone for unknown keys, so the error names the file.
        let _: C = toml::Value::Table(merge(to_table(&C::default(), "")?, table.clone()))
            .try_into()
            .map_err(|error: toml::de::Error| ConfigError::Invalid { origin, message: error.message().to_owned() })?;
        merged = merge(merged, table);
    }
    merged = merge(merged, to_table(overrides, " from flags or environment")?);
    toml::Value::Table(merged)
        .try_into()
        .map_err(|error: toml::de::Error| ConfigError::Invalid { origin: String::new(), message: error.message().to_owned() })
}

fn to_table<T: Serialize>(value: &T, origin: &str) -> Result<toml::Table, ConfigError> {
    match toml::Value::try_from(value) {
        Ok(toml::Value::Table(table)) => Ok(table),
        Ok(other) => Err(ConfigError::Invalid { origin: origin.to_owned(), message: format!("expected a table, got {other}") }),
        Err(error) => Err(ConfigError::Invalid { origin: origin.to_owned(), message: error.to_string() }),
    }
}

/// Lays `over` onto `base`: tables merge key by key, anything else replaces.
fn merge(mut base: toml::Table, over: toml::Table) -> toml::Table {
    for (key, value) in over {
        match (base.remove(&key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(over_inner)) => {
                base.insert(key, toml::Value::Table(merge(inner, over_inner)));
            }
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
    base
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Config {
        port: u16,
        name: String,
        ratio: f64,
    }

    impl Default for Config {
        fn default() -> Self {
            Self { port: 1, name: "default".into(), ratio: 0.5 }
        }
    }

    #[derive(Debug, Parser, Serialize)]
    struct Args {
        #[arg(long, env = "TURBINE_CONFIG_TEST_PORT")]
        #[serde(skip_serializing_if = "Option::is_none")]
        port: Option<u16>,
        #[arg(long, env = "TURBINE_CONFIG_TEST_NAME")]
        #[serde(skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        #[arg(long)]
        #[serde(skip_serializing_if = "Option::is_none")]
        ratio: Option<f64>,
    }

    fn file(contents: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), contents).unwrap();
        file
    }

    #[test]
    fn precedence_is_defaults_then_file_then_env_then_flags() {
        let none = Args { port: None, name: None, ratio: None };
        assert_eq!(load::<Config, _>(None, &none).unwrap(), Config::default());

        let config_file = file("port = 2\nname = \"file\"\nratio = 0.25\n");
        let from_file: Config = load(Some(config_file.path()), &none).unwrap();
        assert_eq!(from_file, Config { port: 2, name: "file".into(), ratio: 0.25 });

        let args = Args::try_parse_from(["test", "--port", "4"]).unwrap();
        let merged: Config = load(Some(config_file.path()), &args).unwrap();
        assert_eq!(merged, Config { port: 4, name: "file".into(), ratio: 0.25 });
    }

    #[test]
    fn environment_lies_between_file_and_flags() {
        // The variable names are unique to this test, so no other test sees them.
        in_child_with_env(|| {
            let config_file = file("port = 2\nname = \"file\"\n");
            let from_env = Args::try_parse_from(["test"]).unwrap();
            let config: Config = load(Some(config_file.path()), &from_env).unwrap();
            assert_eq!(config.name, "env", "env beats the file");
            let from_flag = Args::try_parse_from(["test", "--name", "flag"]).unwrap();
            let config: Config = load(Some(config_file.path()), &from_flag).unwrap();
            assert_eq!(config.name, "flag", "flags beat env");
        });
    }

    /// Runs `f` where TURBINE_CONFIG_TEST_NAME=env. Setting a variable
    /// in-process races other test threads (and is `unsafe` in edition 2024),
    /// so this re-runs the test binary, filtered to the calling test, with
    /// the variable set.
    fn in_child_with_env(f: impl FnOnce()) {
        if std::env::var("TURBINE_CONFIG_TEST_NAME").as_deref() == Ok("env") {
            f();
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let status = std::process::Command::new(exe)
            .args(["--exact", "config::tests::environment_lies_between_file_and_flags", "--nocapture"])
            .env("TURBINE_CONFIG_TEST_NAME", "env")
            .status()
            .unwrap();
        assert!(status.success(), "child run failed");
    }

    #[test]
    fn unknown_and_mistyped_keys_are_refused_naming_the_file() {
        let none = Args { port: None, name: None, ratio: None };
        let unknown = file("prot = 2\n");
        let error = load::<Config, _>(Some(unknown.path()), &none).unwrap_err().to_string();
        assert!(error.contains("prot") && error.contains(&unknown.path().display().to_string()), "{error}");
        let mistyped = file("port = \"eighty\"\n");
        assert!(load::<Config, _>(Some(mistyped.path()), &none).is_err());
    }
}
