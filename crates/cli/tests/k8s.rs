//! `infra/k8s` held to the trust model without a cluster: every Deployment's
//! container speaks mutual TLS with the certificate of its own role from
//! its own Secret (`<deployment>-tls`, made from `turbine certs` output as
//! the manifests' comments say), reaches Redis over TLS, and none runs
//! with `TURBINE_INSECURE`. A worker pool's pods share their pool's
//! certificate and take their pod name as their worker id: the certificate
//! admits any pod name of its Deployment and no other pool's.

mod common;

use std::path::Path;
use std::process::Command;

use common::role_of;
use serde::Deserialize;
use serde_yaml::Value;
use turbine_runtime::trust::TlsConfig;
use turbine_testkit::workspace_binary;

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
        .args(["--worker-pool", "turbine-worker-prefill", "--worker-pool", "turbine-worker-decode", "--redis", "turbine-redis"])
        .output()
        .unwrap();
    assert!(made.status.success(), "turbine certs: {}", String::from_utf8_lossy(&made.stderr));

    let mut deployments = Vec::new();
    for file in std::fs::read_dir(&dir).unwrap() {
        let file = file.unwrap().path();
        for document in serde_yaml::Deserializer::from_str(&std::fs::read_to_string(&file).unwrap()) {
            let document = Value::deserialize(document).unwrap();
            if document["kind"] == "Deployment" {
                deployments.push(document);
            }
        }
    }
    let names: Vec<&str> = deployments.iter().map(|deployment| text(&deployment["metadata"]["name"])).collect();
    for service in ["turbine-redis", "turbine-kv-index", "turbine-kv-store", "turbine-router", "turbine-gateway", "turbine-planner"] {
        assert!(names.contains(&service), "infra/k8s runs no {service}");
    }
    for deployment in &deployments {
        let name = text(&deployment["metadata"]["name"]);
        let pod = &deployment["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let args: Vec<&str> = container["args"].as_sequence().unwrap().iter().map(text).collect();
        if name == "turbine-redis" {
            // Redis takes only TLS, and only clients with a certificate of
            // the CA; its own is the one `turbine certs --redis` made.
            let flag = |key: &str| args.iter().position(|arg| *arg == key).map(|at| args[at + 1]);
            assert_eq!((flag("--port"), flag("--tls-auth-clients")), (Some("0"), Some("yes")), "Redis takes TLS clients of the CA only");
            let volume = pod["volumes"].as_sequence().unwrap().iter().find(|volume| volume["name"] == "tls").expect("a tls volume");
            assert_eq!(text(&volume["secret"]["secretName"]), "turbine-redis-tls");
            continue;
        }
        let env: Vec<(&str, &Value)> = container["env"].as_sequence().unwrap().iter().map(|var| (text(&var["name"]), var)).collect();
        let value = |key: &str| env.iter().find(|(name, _)| *name == key).map(|(_, var)| text(&var["value"]).to_owned());
        assert!(value("TURBINE_INSECURE").is_none(), "{name} runs with TURBINE_INSECURE");
        if args[0] == "gateway" {
            // The gateway reaches only routers; its clients need API keys.
            let keys = args.iter().position(|arg| *arg == "--api-keys").map(|at| args[at + 1]).expect("the gateway takes API keys");
            let mount = container["volumeMounts"].as_sequence().unwrap().iter().find(|mount| mount["name"] == "keys").expect("a keys mount");
            assert!(keys.starts_with(&format!("{}/", text(&mount["mountPath"]))), "the keys file is in its Secret");
            assert!(args.contains(&"--admin-addr"), "metrics and probes off the API's port");
        } else {
            assert!(value("TURBINE_REDIS_URL").is_some_and(|url| url.starts_with("rediss://turbine-redis:")), "{name} reaches Redis over TLS");
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
