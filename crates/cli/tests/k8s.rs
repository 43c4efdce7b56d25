//! `infra/k8s` held to the trust model without a cluster: every Deployment's
//! container speaks mutual TLS with the certificate of its own role from
//! its own Secret (`<deployment>-tls`, made from `turbine certs` output as
//! the manifests' comments say), reaches Redis over TLS, and none runs
//! with `TURBINE_INSECURE`. A worker pool's pods share their pool's
//! certificate and take their pod name as their worker id: the certificate
//! admits any pod name of its Deployment and no other pool's. And the
//! manifests run for real as processes, serving the real model (see
//! `infra_k8s_serves_the_real_model_with_mutual_tls_on_every_hop`).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::role_of;
use serde::Deserialize;
use serde_json::json;
use serde_yaml::Value;
use turbine_runtime::trust::TlsConfig;
use turbine_testkit::{STARTUP_TIMEOUT, VllmInstall, VllmServer, free_port, wait_until, workspace_binary};

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or_else(|| panic!("a string, got {value:?}"))
}

#[test]
fn every_pod_speaks_mutual_tls_with_its_own_certificate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra/k8s");
    let certs = tempfile::tempdir().unwrap();
    // The command infra/k8s/workers.yaml gives.
    let made = Command::new(workspace_binary("turbine"))
        .args(["certs", "--out"])
        .arg(certs.path())
        .args(["--worker-pool", "turbine-worker-prefill", "--worker-pool", "turbine-worker-decode", "--worker-pool", "turbine-worker-vllm"])
        .args(["--redis", "turbine-redis"])
        .output()
        .unwrap();
    assert!(made.status.success(), "turbine certs: {}", String::from_utf8_lossy(&made.stderr));

    let deployments: Vec<Value> = manifests(&dir).into_iter().filter(|document| document["kind"] == "Deployment").collect();
    let names: Vec<&str> = deployments.iter().map(|deployment| text(&deployment["metadata"]["name"])).collect();
    for service in ["turbine-redis", "turbine-kv-index", "turbine-kv-store", "turbine-router", "turbine-gateway", "turbine-planner"] {
        assert!(names.contains(&service), "infra/k8s runs no {service}");
    }
    for deployment in &deployments {
        let name = text(&deployment["metadata"]["name"]);
        let pod = &deployment["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let args: Vec<&str> = container["args"].as_sequence().unwrap().iter().map(text).collect();
        if name == "turbine-envoy" {
            // Not a Turbine service (no role, no Redis): it serves the
            // API's certificate and checks the gateways' against its CA
            // (its configuration: scripts/check-manifests.py and e2e.py).
            let secrets: Vec<&str> = pod["volumes"].as_sequence().unwrap().iter().filter_map(|volume| volume["secret"]["secretName"].as_str()).collect();
            assert_eq!(secrets, ["turbine-gateway-public-tls", "turbine-gateway-public-ca"], "Envoy holds the API's certificate and its CA only");
            continue;
        }
        if name == "turbine-redis" {
            // Redis takes only TLS, and only clients with a certificate of
            // the CA; its own is the one `turbine certs --redis` made.
            let flag = |key: &str| args.iter().position(|arg| *arg == key).map(|at| args[at + 1]);
            assert_eq!((flag("--port"), flag("--tls-auth-clients")), (Some("0"), Some("yes")), "Redis takes TLS clients of the CA only");
            let volume = pod["volumes"].as_sequence().unwrap().iter().find(|volume| volume["name"] == "tls").expect("a tls volume");
            assert_eq!(text(&volume["secret"]["secretName"]), "turbine-redis-tls");
            continue;
        }
        for engine in pod["containers"].as_sequence().unwrap().iter().skip(1) {
            // The one kind of second container: an engine beside its
            // worker (infra/k8s/vllm), holding none of the deployment's
            // secrets (its one client is the worker, on the pod's loopback).
            assert!(text(&engine["image"]).starts_with("turbine-vllm:"), "{name} runs {:?} beside its first container", engine["image"]);
            for mount in engine["volumeMounts"].as_sequence().cloned().unwrap_or_default() {
                let volume = pod["volumes"].as_sequence().unwrap().iter().find(|volume| volume["name"] == mount["name"]).unwrap();
                assert!(volume["secret"].is_null(), "{name}'s engine mounts the Secret {:?}", volume["secret"]["secretName"]);
            }
        }
        let env: Vec<(&str, &Value)> = container["env"].as_sequence().unwrap().iter().map(|var| (text(&var["name"]), var)).collect();
        let value = |key: &str| env.iter().find(|(name, _)| *name == key).map(|(_, var)| text(&var["value"]).to_owned());
        assert!(value("TURBINE_INSECURE").is_none(), "{name} runs with TURBINE_INSECURE");
        assert!(value("TURBINE_REDIS_URL").is_some_and(|url| url.starts_with("rediss://turbine-redis:")), "{name} reaches Redis over TLS");
        if args[0] == "gateway" {
            // Its clients need API keys.
            let keys = args.iter().position(|arg| *arg == "--api-keys").map(|at| args[at + 1]).expect("the gateway takes API keys");
            let mount = container["volumeMounts"].as_sequence().unwrap().iter().find(|mount| mount["name"] == "keys").expect("a keys mount");
            assert!(keys.starts_with(&format!("{}/", text(&mount["mountPath"]))), "the keys file is in its Secret");
            assert!(args.contains(&"--admin-addr"), "metrics and probes off the API's port");
            // Its API over TLS, with the API's own certificate.
            let mount = container["volumeMounts"].as_sequence().unwrap().iter().find(|mount| mount["name"] == "public-tls").expect("a public-tls mount");
            let volume = pod["volumes"].as_sequence().unwrap().iter().find(|volume| volume["name"] == "public-tls").expect("a public-tls volume");
            assert_eq!(text(&volume["secret"]["secretName"]), "turbine-gateway-public-tls");
            for (variable, file) in [("TURBINE_GATEWAY_PUBLIC_TLS_CERT", "tls.crt"), ("TURBINE_GATEWAY_PUBLIC_TLS_KEY", "tls.key")] {
                assert_eq!(value(variable), Some(format!("{}/{file}", text(&mount["mountPath"]))), "the API's certificate from its Secret");
            }
        }

        // The three files come from one Secret volume, named after the
        // Deployment, holding what `kubectl create secret` puts there.
        let mount = container["volumeMounts"].as_sequence().unwrap().iter().find(|mount| mount["name"] == "tls").expect("a tls mount");
        let at = text(&mount["mountPath"]);
        let volume = pod["volumes"].as_sequence().unwrap().iter().find(|volume| volume["name"] == "tls").expect("a tls volume");
        assert_eq!(text(&volume["secret"]["secretName"]), format!("{name}-tls"), "{name}'s own Secret");
        let stem = match name.strip_prefix("turbine-") {
            Some(pool) if pool.starts_with("worker-") => certs.path().join("workers").join(name),
            Some(role) => certs.path().join(role),
            None => panic!("{name} is not a turbine- Deployment"),
        };
        let secret = |key: &str| match key {
            "tls.crt" => stem.with_extension("crt"),
            "tls.key" => stem.with_extension("key"),
            "ca.crt" => certs.path().join("ca.crt"),
            other => panic!("{other} is not a key of the Secret"),
        };
        let file = |variable: &str| {
            let path = value(variable).unwrap_or_else(|| panic!("{name} sets no {variable}"));
            secret(path.strip_prefix(&format!("{at}/")).unwrap_or_else(|| panic!("{name}'s {variable} is not in its Secret")))
        };
        let tls = TlsConfig { tls_cert: Some(file("TURBINE_TLS_CERT")), tls_key: Some(file("TURBINE_TLS_KEY")), tls_ca: Some(file("TURBINE_TLS_CA")) };
        let peer = tls.load().unwrap().expect("certificates").peer().clone();
        assert_eq!(peer.role, role_of(args[0]), "{name} holds the certificate of its role");

        if args[0] == "worker" {
            // Its worker id is its pod name, which its pool's certificate admits.
            let id = args.iter().position(|arg| *arg == "--worker-id").map(|at| args[at + 1]);
            assert_eq!(id, Some("$(POD_NAME)"), "{name}'s worker id is its pod name");
            let pod_name = env.iter().find(|(var, _)| *var == "POD_NAME").map(|(_, var)| text(&var["valueFrom"]["fieldRef"]["fieldPath"]));
            assert_eq!(pod_name, Some("metadata.name"));
            assert!(peer.is_worker(&format!("{name}-7c9d5b8f6-x2k4q")), "{name}'s certificate admits its pods");
            for other in &deployments {
                let other = text(&other["metadata"]["name"]);
                if other != name {
                    assert!(!peer.is_worker(&format!("{other}-7c9d5b8f6-x2k4q")), "{name}'s certificate admits no pod of {other}");
                }
            }
        }
    }
}

/// A container port of a pod, here: its name in the manifest, the port
/// inside the pod, and the loopback port it listens on.
struct PodPort {
    name: String,
    inside: u16,
    here: u16,
}

/// One pod of a Deployment, as the replay runs it: its containers share
/// its ports and its loopback.
struct Pod {
    deployment: String,
    name: String,
    containers: Vec<Value>,
    volumes: Vec<Value>,
    ports: Vec<PodPort>,
    /// The pod's own loopback: each port its containers name at
    /// 127.0.0.1 that no container declares (an engine only the pod's
    /// worker reaches), and the free one standing for it here.
    loopback: Vec<(u16, u16)>,
}

impl Pod {
    fn port(&self, name: &str) -> &PodPort {
        self.ports.iter().find(|port| port.name == name).unwrap_or_else(|| panic!("{} names no port {name}", self.name))
    }

    /// The free port standing for `inside` on the pod's loopback.
    fn loopback(&self, inside: u16) -> u16 {
        self.loopback.iter().find(|(port, _)| *port == inside).unwrap_or_else(|| panic!("{} names nothing at 127.0.0.1:{inside}", self.name)).1
    }

    /// `text` with each `127.0.0.1:PORT` of the pod's loopback at the free
    /// port standing for it (whole port numbers: 5557 is not 55571's start).
    fn on_loopback(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find("127.0.0.1:") {
            let (before, after) = rest.split_at(at + "127.0.0.1:".len());
            out.push_str(before);
            let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let port = &after[..digits];
            match port.parse::<u16>().ok().and_then(|inside| self.loopback.iter().find(|(port, _)| *port == inside)) {
                Some((_, here)) => out.push_str(&here.to_string()),
                None => out.push_str(port),
            }
            rest = &after[digits..];
        }
        out.push_str(rest);
        out
    }
}

/// The manifests of `infra/k8s` and of its opt-in `vllm` folder (the pool
/// in front of vLLM), each file's documents.
fn manifests(dir: &Path) -> Vec<Value> {
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for folder in [dir.to_owned(), dir.join("vllm")] {
        for file in std::fs::read_dir(&folder).unwrap() {
            let file = file.unwrap().path();
            if file.extension().is_some_and(|extension| extension == "yaml") {
                files.push(file);
            }
        }
    }
    files.sort();
    assert!(files.iter().any(|file| file.ends_with("vllm/worker-vllm.yaml")), "the vLLM pool's manifest");
    files
        .iter()
        .flat_map(|file| {
            serde_yaml::Deserializer::from_str(&std::fs::read_to_string(file).unwrap())
                .map(|document| Value::deserialize(document).unwrap())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `infra/k8s` run for real, without a cluster: each Deployment's pods
/// started as processes on this machine (as many as its replicas) with
/// the args, environment and Secrets their manifest gives them (each
/// Secret made as the manifests' comments and docs/operations.md say,
/// from `turbine certs` and `turbine keys new`), in the order the
/// addresses they name imply, each waited on with its own readiness
/// probe. A Service's name becomes the loopback address of its first pod
/// (Redis's `localhost`, the name its certificate carries here) and each
/// container port a free one. Then the OpenAI API serves the real model
/// through the gateway with an API key, disaggregated over the prefill and
/// decode pools, every hop over mutual TLS; a call without a key is
/// refused; the workers' blocks reach the kv-store. The opt-in vLLM pool
/// (`infra/k8s/vllm`) runs too: its pod's engine (the test command's
/// install of vLLM's CPU build standing in for its image) on a loopback of
/// the pod's own, probed from inside as the kubelet would, serves through
/// the same gateway, and its KV events reach the global index. The planner's and
/// Envoy's Deployments are not run: the planner's connector is a
/// Kubernetes API server (`scripts/check-manifests.py` holds its
/// manifest), and Envoy's configuration is run by `scripts/e2e.py`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infra_k8s_serves_the_real_model_with_mutual_tls_on_every_hop() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra/k8s");
    let root = tempfile::tempdir().unwrap();
    let mut deployments = Vec::new();
    let mut services: BTreeMap<String, Value> = BTreeMap::new();
    for document in manifests(&dir) {
        match document["kind"].as_str() {
            // Envoy's pods are not replayed: scripts/e2e.py runs its
            // configuration in front of a deployment's gateways.
            Some("Deployment") if !["turbine-planner", "turbine-envoy"].contains(&text(&document["metadata"]["name"])) => deployments.push(document),
            Some("Service") => _ = services.insert(text(&document["metadata"]["name"]).to_owned(), document),
            _ => {}
        }
    }

    // The Secrets, as docs/operations.md makes them (Redis's certificate
    // names `localhost` too, for the replay's loopback).
    let certs = root.path().join("certs");
    let made = Command::new(workspace_binary("turbine"))
        .args(["certs", "--out"])
        .arg(&certs)
        .args(["--worker-pool", "turbine-worker-prefill", "--worker-pool", "turbine-worker-decode", "--worker-pool", "turbine-worker-vllm"])
        .args(["--redis", "turbine-redis", "--redis", "localhost"])
        .args(["--public-host", "localhost"])
        .output()
        .unwrap();
    assert!(made.status.success(), "turbine certs: {}", String::from_utf8_lossy(&made.stderr));
    let secrets = root.path().join("secrets");
    let keys_dir = secrets.join("turbine-gateway-keys");
    std::fs::create_dir_all(&keys_dir).unwrap();
    let made = Command::new(workspace_binary("turbine"))
        .args(["keys", "new", "--name", "replay", "--tenant", "acme", "--file"])
        .arg(keys_dir.join("keys.toml"))
        .output()
        .unwrap();
    assert!(made.status.success(), "turbine keys new: {}", String::from_utf8_lossy(&made.stderr));
    let key = String::from_utf8(made.stdout).unwrap().trim().to_owned();
    let secret_file = |secret: &str, key: &str| -> std::path::PathBuf {
        let stem = match secret.strip_suffix("-tls").and_then(|name| name.strip_prefix("turbine-")) {
            Some("redis") => certs.join("redis"),
            Some("gateway-public") => certs.join("public"),
            Some(pool) if pool.starts_with("worker-") => certs.join("workers").join(format!("turbine-{pool}")),
            Some(role) => certs.join(role),
            None => panic!("a Secret the docs do not make: {secret}"),
        };
        match key {
            "tls.crt" => stem.with_extension("crt"),
            "tls.key" => stem.with_extension("key"),
            "ca.crt" => certs.join("ca.crt"),
            other => panic!("{secret} has no key {other}"),
        }
    };
    TlsConfig { tls_cert: Some(certs.join("operator.crt")), tls_key: Some(certs.join("operator.key")), tls_ca: Some(certs.join("ca.crt")) }
        .establish()
        .unwrap()
        .expect("the test is the operator");

    // The pods, each port a free one.
    let mut pods: Vec<Pod> = Vec::new();
    for deployment in &deployments {
        let name = text(&deployment["metadata"]["name"]);
        let spec = &deployment["spec"]["template"]["spec"];
        for replica in 0..deployment["spec"]["replicas"].as_u64().unwrap() {
            let containers = spec["containers"].as_sequence().unwrap().clone();
            let ports: Vec<PodPort> = containers
                .iter()
                .flat_map(|container| container["ports"].as_sequence().cloned().unwrap_or_default())
                .map(|port| PodPort { name: text(&port["name"]).to_owned(), inside: port["containerPort"].as_u64().unwrap() as u16, here: free_port() })
                .collect();
            let mut loopback: Vec<(u16, u16)> = Vec::new();
            let named = serde_yaml::to_string(&containers).unwrap();
            for (at, _) in named.match_indices("127.0.0.1:") {
                let digits: String = named[at + "127.0.0.1:".len()..].chars().take_while(char::is_ascii_digit).collect();
                let Ok(inside) = digits.parse::<u16>() else { continue };
                if !ports.iter().any(|port| port.inside == inside) && !loopback.iter().any(|(port, _)| *port == inside) {
                    loopback.push((inside, free_port()));
                }
            }
            let volumes = spec["volumes"].as_sequence().cloned().unwrap_or_default();
            pods.push(Pod { deployment: name.to_owned(), name: format!("{name}-{replica}"), containers, volumes, ports, loopback });
        }
    }
    // A Service's address → its first pod's loopback one.
    let first_pod = |deployment: &str| pods.iter().find(|pod| pod.deployment == deployment).unwrap();
    let mut network: Vec<(String, String, String)> = Vec::new();
    for (name, service) in &services {
        let selector = service["spec"]["selector"]["app.kubernetes.io/name"].as_str().unwrap();
        let backend = deployments
            .iter()
            .find(|deployment| deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == selector)
            .map(|deployment| text(&deployment["metadata"]["name"]));
        let Some(backend) = backend else { continue };
        for port in service["spec"]["ports"].as_sequence().unwrap() {
            let here = first_pod(backend).port(text(&port["targetPort"])).here;
            let host = if name == "turbine-redis" { "localhost" } else { "127.0.0.1" };
            network.push((name.clone(), format!("{name}:{}", port["port"].as_u64().unwrap()), format!("{host}:{here}")));
        }
    }

    // Start them in the order the Services they name imply.
    let mut running: BTreeMap<String, Vec<turbine_testkit::ChildProcess>> = BTreeMap::new();
    let mut started: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    let mut gateway_http = None;
    let mut router_endpoint = None;
    let mut store_endpoint = None;
    let mut prefill_admin = None;
    let mut index_endpoint = None;
    let mut vllm_admin = None;
    let mut engines: Vec<VllmServer> = Vec::new();
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    while started.len() < pods.len() {
        // A pod starts once every Service it names (but its own) has a pod.
        let ready = |pod: &&Pod| {
            let named = serde_yaml::to_string(&pod.containers).unwrap();
            !started.contains(&pod.name)
                && network
                    .iter()
                    .filter(|(service, from, _)| named.contains(from.as_str()) && *service != pod.deployment)
                    .all(|(service, _, _)| running.contains_key(service))
        };
        let pod = pods.iter().find(ready).unwrap_or_else(|| panic!("infra/k8s's Deployments name each other in a circle"));
        // Its containers all start (as the kubelet starts them, none
        // waiting for another), then each is waited on with its probe.
        let mut children: Vec<(&Value, turbine_testkit::ChildProcess)> = Vec::new();
        for container in &pod.containers {
            // What the pod's environment gives, and where its volumes are here.
            let mut vars: Vec<(String, String)> = Vec::new();
            for var in container["env"].as_sequence().cloned().unwrap_or_default() {
                let value = match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                    Some("metadata.name") => pod.name.clone(),
                    Some("status.podIP") => "127.0.0.1".to_owned(),
                    Some(other) => panic!("a field this replay does not know: {other}"),
                    None if var["valueFrom"].is_mapping() => panic!("{}: a value from elsewhere", pod.name),
                    None => text(&var["value"]).to_owned(),
                };
                vars.push((text(&var["name"]).to_owned(), value));
            }
            let mut mounts: Vec<(String, String)> = Vec::new();
            for mount in container["volumeMounts"].as_sequence().cloned().unwrap_or_default() {
                let volume = pod.volumes.iter().find(|volume| volume["name"] == mount["name"]).unwrap();
                let inside = text(&mount["mountPath"]).to_owned();
                if let Some(secret) = volume["secret"]["secretName"].as_str() {
                    if secret == "turbine-gateway-keys" {
                        mounts.push((inside, keys_dir.display().to_string()));
                        continue;
                    }
                    let here = secrets.join(&pod.name).join(secret);
                    std::fs::create_dir_all(&here).unwrap();
                    // A kubernetes.io/tls Secret (the API's) holds no ca.crt.
                    let keys: &[&str] = if secret == "turbine-gateway-public-tls" { &["tls.crt", "tls.key"] } else { &["tls.crt", "tls.key", "ca.crt"] };
                    for key in keys {
                        std::fs::copy(secret_file(secret, key), here.join(key)).unwrap();
                    }
                    mounts.push((inside, here.display().to_string()));
                } else if volume["persistentVolumeClaim"].is_mapping() {
                    let here = root.path().join("volumes").join(&pod.name);
                    std::fs::create_dir_all(&here).unwrap();
                    mounts.push((inside, here.display().to_string()));
                } else {
                    // A memory-backed /dev/shm: the machine's own.
                    assert_eq!(
                        (inside.as_str(), volume["emptyDir"]["medium"].as_str()),
                        ("/dev/shm", Some("Memory")),
                        "{}: a volume this replay does not know",
                        pod.name
                    );
                }
            }
            let here = |text: &str| -> String {
                let mut text = text.to_owned();
                for (name, value) in &vars {
                    text = text.replace(&format!("$({name})"), value);
                }
                for (inside, here) in &mounts {
                    text = text.replace(inside.as_str(), here);
                }
                for (_, from, to) in &network {
                    text = text.replace(from.as_str(), to);
                }
                // The pod's own ports, whatever address names them, and its
                // loopback's.
                for port in &pod.ports {
                    for host in ["0.0.0.0", "127.0.0.1"] {
                        text = text.replace(&format!("{host}:{}", port.inside), &format!("127.0.0.1:{}", port.here));
                    }
                }
                pod.on_loopback(&text)
            };
            let mut args: Vec<String> = container["args"].as_sequence().unwrap().iter().map(|arg| here(text(arg))).collect();
            let image = text(&container["image"]);
            let child = if image.starts_with("turbine-vllm:") {
                // The image's entrypoint (vLLM's API server) with the
                // manifest's args: the test command's install and
                // conversion of the model in place of the image's, on the
                // free port standing for the pod's loopback one.
                let dockerfile = std::fs::read_to_string(workspace.join("infra/vllm/Dockerfile")).unwrap();
                assert!(container["command"].is_null(), "{}: the image's entrypoint", pod.name);
                let install = VllmInstall::find(&workspace).unwrap_or_else(|missing| panic!("{missing}"));
                let flag = |args: &[String], flag: &str| args.iter().position(|arg| arg == flag).unwrap_or_else(|| panic!("the engine's {flag}")) + 1;
                let model = flag(&args, "--model");
                assert!(dockerfile.contains(&args[model]), "the image's model is the one served");
                args[model] = install.model.display().to_string();
                assert_eq!(args[flag(&args, "--host")], "127.0.0.1", "the engine listens on the pod's loopback only");
                assert!(container["ports"].is_null(), "the engine declares no port: nothing outside its pod reaches it");
                let at = flag(&args, "--port");
                let port = pod.loopback(args[at].parse().unwrap());
                args[at] = port.to_string();
                let python = install.python.clone();
                engines.push(tokio::task::spawn_blocking(move || VllmServer::start_with(&install, port, &args)).await.unwrap());
                // Its probes, run as the kubelet runs them: inside the pod.
                for kind in ["startupProbe", "livenessProbe"] {
                    let command: Vec<String> = container[kind]["exec"]["command"].as_sequence().unwrap().iter().map(|arg| here(text(arg))).collect();
                    assert_eq!(command[0], "python", "the image's Python");
                    let python = python.clone();
                    let probed = tokio::task::spawn_blocking(move || Command::new(python).args(&command[1..]).output().unwrap());
                    let probed = probed.await.unwrap();
                    assert!(probed.status.success(), "{}'s {kind} fails on a healthy engine: {}", pod.name, String::from_utf8_lossy(&probed.stderr));
                }
                continue;
            } else if image.starts_with("redis:") {
                let port = pod.port("redis").here;
                let at = args.iter().position(|arg| arg == "--tls-port").expect("Redis serves TLS") + 1;
                args[at] = port.to_string();
                let data = root.path().join("redis");
                std::fs::create_dir_all(&data).unwrap();
                let binary = std::env::var("TURBINE_REDIS_SERVER").unwrap_or_else(|_| text(&container["command"][0]).to_owned());
                let mut command = Command::new(binary);
                command.args(&args).args(["--bind", "127.0.0.1", "--dir"]).arg(&data);
                turbine_testkit::ChildProcess::spawn(&pod.name, command)
            } else {
                assert_eq!(image, "turbine:dev");
                let mut command = Command::new(workspace_binary("turbine"));
                command.args(&args);
                for port in &pod.ports {
                    let flag = format!("--{}-addr", port.name);
                    if !args.contains(&flag) {
                        command.args([flag, format!("127.0.0.1:{}", port.here)]);
                    }
                }
                for (name, value) in &vars {
                    command.env(name, here(value));
                }
                turbine_testkit::ChildProcess::spawn(&pod.name, command)
            };
            children.push((container, child));
        }
        for (container, child) in &mut children {
            // Its readiness probe, as the kubelet would run it.
            let probe = &container["readinessProbe"];
            if let Some(path) = probe["httpGet"]["path"].as_str() {
                let url = format!("http://127.0.0.1:{}{path}", pod.port(text(&probe["httpGet"]["port"])).here);
                let client = reqwest::Client::new();
                wait_until(&format!("{} ready", pod.name), STARTUP_TIMEOUT, async || {
                    assert!(child.exited().is_none(), "{} exited: {}", pod.name, child.output().join("\n"));
                    client.get(&url).send().await.is_ok_and(|response| response.status().is_success())
                })
                .await;
            } else {
                let port = pod.port(text(&probe["tcpSocket"]["port"])).here;
                wait_until(&format!("{} ready", pod.name), STARTUP_TIMEOUT, async || tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()).await;
            }
        }
        match pod.deployment.as_str() {
            "turbine-gateway" => gateway_http = Some(std::net::SocketAddr::from(([127, 0, 0, 1], pod.port("http").here))),
            "turbine-router" => _ = router_endpoint.get_or_insert(format!("http://127.0.0.1:{}", pod.port("grpc").here)),
            "turbine-kv-store" => store_endpoint = Some(format!("http://127.0.0.1:{}", pod.port("grpc").here)),
            "turbine-worker-prefill" => prefill_admin = Some(format!("http://127.0.0.1:{}", pod.port("admin").here)),
            "turbine-kv-index" => index_endpoint = Some(format!("http://127.0.0.1:{}", pod.port("grpc").here)),
            "turbine-worker-vllm" => vllm_admin = Some(format!("http://127.0.0.1:{}", pod.port("admin").here)),
            _ => {}
        }
        running.entry(pod.deployment.clone()).or_default().extend(children.into_iter().map(|(_, child)| child));
        started.insert(pod.name.clone());
    }

    // The three pools registered with the routers; the model listed to a key.
    let routers = turbine_api::router::RouterClient::connect(&router_endpoint.unwrap()).unwrap();
    wait_until("the prefill, decode and vLLM workers registered", STARTUP_TIMEOUT, async || routers.workers(None).await.is_ok_and(|listed| listed.len() == 3))
        .await;
    // The API over HTTPS, its certificate from `turbine certs --public-host`.
    let gateway = gateway_http.unwrap();
    let ca = std::fs::read_to_string(certs.join("ca.crt")).unwrap();
    // Above the router's 256 uncached tokens: computed on the prefill
    // pool, decoded on the decode pool.
    let prompt = "Turbine serves language models across many machines. ".repeat(40);
    let post = async |key: Option<&str>, model: &str| {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0});
        let answer = common::https_post(gateway, &ca, "/v1/completions", key, &body).await;
        let status = answer.get(9..12).and_then(|code| code.parse::<u16>().ok()).unwrap_or(0);
        let json = answer.split_once("\r\n\r\n").and_then(|(_, body)| serde_json::from_str(body).ok()).unwrap_or(serde_json::Value::Null);
        (status, json)
    };
    assert_eq!(post(None, common::MODEL).await.0, 401, "no key, no answer");
    let complete = async || post(Some(&key), common::MODEL).await;
    wait_until("the gateway serves the model", STARTUP_TIMEOUT, async || complete().await.0 == 200).await;
    let (status, first) = complete().await;
    assert_eq!(status, 200, "{first}");
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty(), "{first}");
    let (_, second) = complete().await;
    assert_eq!(second["choices"][0]["text"], first["choices"][0]["text"], "greedy text is the same");
    println!(
        "infra/k8s's stack said {:?}; the repeat had {} cached tokens",
        second["choices"][0]["text"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
    );

    let prefilled = turbine_testkit::metric(&prefill_admin.unwrap(), "turbine_worker_prefill_tokens_total").await;
    assert!(prefilled >= 256.0, "the prefill pool computed the prompt: {prefilled} tokens");

    // The vLLM pool (infra/k8s/vllm): its model through the same gateway
    // and key, from the engine behind the worker on its pod's loopback.
    // The repeat hits the engine's own prefix cache, and the engine's KV
    // events, mirrored by its worker in Turbine's hashes, are in the
    // global index under the pod's name: every block the engine hit, none
    // it could not hash, no event lost.
    let (status, first) = post(Some(&key), "smollm2-135m-vllm").await;
    assert_eq!(status, 200, "{first}");
    assert!(!first["choices"][0]["text"].as_str().unwrap().is_empty(), "{first}");
    let (status, second) = post(Some(&key), "smollm2-135m-vllm").await;
    assert_eq!(status, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 256, "the repeat hits in vLLM: {second}");
    let index = turbine_api::kv_index::KvIndexClient::connect(&index_endpoint.unwrap()).unwrap();
    wait_until("the engine's blocks in the global index", Duration::from_secs(30), async || {
        index
            .dump(Some("turbine-worker-vllm-0".into()))
            .await
            .is_ok_and(|dumps| dumps.iter().map(|dump| dump.dump.blocks.len() as u64).sum::<u64>() >= cached / 32)
    })
    .await;
    let vllm_admin = vllm_admin.unwrap();
    for counter in ["turbine_worker_upstream_kv_blocks_unmapped_total", "turbine_worker_upstream_kv_event_gaps_total"] {
        assert_eq!(turbine_testkit::metric(&vllm_admin, counter).await, 0.0, "{counter}");
    }
    println!("infra/k8s's vLLM pool said {:?}; the repeat had {cached} cached tokens, all in the index", second["choices"][0]["text"]);

    // The workers' blocks reach the kv-store over mutual TLS.
    let operator = TlsConfig { tls_cert: Some(certs.join("operator.crt")), tls_key: Some(certs.join("operator.key")), tls_ca: Some(certs.join("ca.crt")) };
    let operator = operator.load().unwrap().unwrap();
    let channel = turbine_runtime::grpc::tls_channel(&store_endpoint.unwrap(), &operator, turbine_runtime::host::Role::KvStore).unwrap();
    let mut store = turbine_proto::kvstore::v1::kv_store_client::KvStoreClient::new(channel);
    wait_until("the workers' blocks in the kv-store", Duration::from_secs(60), async || {
        store.stats(turbine_proto::kvstore::v1::StatsRequest {}).await.is_ok_and(|stats| stats.into_inner().put_blocks > 0)
    })
    .await;
    drop((running, engines));
}
