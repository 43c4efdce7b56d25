#!/usr/bin/env python3
"""Checks the Kubernetes manifests in infra/k8s offline: each resource
against the Kubernetes schemas (kubernetes-validate, strict), and what the
planner's kubernetes connector relies on: every worker pool a Deployment
named turbine-worker-<pool> with a readiness probe and a grace period for
its streams, and the planner's service account allowed get and patch on
deployments/scale and nothing else. And that the manifests hang
together: every Deployment has a readiness probe, and every address a
container names (`scheme://turbine-NAME:PORT`) is a port of a Service
whose pods listen on it."""
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "infra" / "k8s"


def check(condition, message):
    if not condition:
        sys.exit(f"infra/k8s: {message}")


def main():
    files = sorted(K8S.glob("*.yaml"))
    check(files, "no manifests")
    subprocess.run(["kubernetes-validate", "--strict", "--quiet", *map(str, files)], check=True)
    resources = [doc for path in files for doc in yaml.safe_load_all(path.read_text()) if doc]
    by_kind = {}
    for resource in resources:
        by_kind.setdefault(resource["kind"], []).append(resource)

    workers = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"].startswith("turbine-worker-")]
    check(workers, "no worker Deployments (turbine-worker-<pool>)")
    for deployment in workers:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        check(container["args"][0] == "worker", f"{name} does not run a worker")
        pool = name.removeprefix("turbine-worker-")
        check(["--role", pool] == container["args"][1:3], f"{name} runs another role than its pool {pool}")
        check("readinessProbe" in container, f"{name} has no readiness probe")
        check(pod.get("terminationGracePeriodSeconds", 30) >= 300, f"{name} gives its streams under 300 s to finish")

    roles = {r["metadata"]["name"]: r for r in by_kind.get("Role", [])}
    check("turbine-planner" in roles, "no Role for the planner")
    check(roles["turbine-planner"]["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]}],
          "the planner's Role must allow get and patch on deployments/scale, and nothing else")
    planner = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == "turbine-planner")
    spec = planner["spec"]["template"]["spec"]
    check(spec["serviceAccountName"] == "turbine-planner", "the planner runs as another service account")
    args = spec["containers"][0]["args"]
    check(args[:2] == ["planner", "serve"] and "--connector" in args and args[args.index("--connector") + 1] == "kubernetes",
          "the planner does not use the kubernetes connector")
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    deployments = by_kind["Deployment"]
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        check("readinessProbe" in container, f"{name} has no readiness probe")
        named = list(container.get("args", [])) + [var.get("value", "") for var in container.get("env", [])]
        for host, port in re.findall(r"://(turbine-[a-z0-9-]+):(\d+)", " ".join(named)):
            service = services.get(host)
            check(service is not None, f"{name} names {host}, which is no Service")
            ports = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
            check(ports, f"{name} names {host}:{port}, a port the Service does not have")
            selector = service["spec"]["selector"]
            backends = [d for d in deployments if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]
            check(backends, f"the Service {host} selects no Deployment")
            for backend in backends:
                listening = {p["name"] for p in backend["spec"]["template"]["spec"]["containers"][0]["ports"]}
                check(ports[0]["targetPort"] in listening, f"{host}:{port} leads to a port {backend['metadata']['name']} does not name")
    print(f"infra/k8s: {len(resources)} resources in {len(files)} files valid")


if __name__ == "__main__":
    main()
