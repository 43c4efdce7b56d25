#!/usr/bin/env python3
"""Checks the Kubernetes manifests in infra/k8s (and its opt-in vllm
folder, the pool in front of vLLM) offline: each resource
against the Kubernetes schemas (kubernetes-validate, strict), and what the
planner's kubernetes connector relies on: every worker pool a Deployment
named turbine-worker-<pool> with a readiness probe and a grace period for
its streams (an external engine's pool aggregated, its engine on the
pod's loopback with probes from inside the pod), and the planner's service account allowed get and patch on
deployments/scale and nothing else. And that the manifests hang
together: every Deployment has a readiness probe, and every address a
container names (`scheme://turbine-NAME:PORT`) is a port of a Service
whose pods listen on it; and that a Deployment trusting proxies
(--trusted-proxies) is reachable on its API's ports from Envoy's pods
alone; and that a drain fits: the gateways Envoy sends to serve on after
SIGTERM for longer than Envoy's health checks take to mark one down
(TURBINE_DRAIN_DELAY_SECS), and every pod with a drain delay is given
the delay and its streams' grace before it is killed."""
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "infra" / "k8s"
ENVOY = ROOT / "infra" / "envoy" / "envoy.yaml"
PROMETHEUS = ROOT / "infra" / "prometheus"


def check(condition, message):
    if not condition:
        sys.exit(f"infra/k8s: {message}")


def main():
    files = sorted(K8S.glob("*.yaml")) + sorted((K8S / "vllm").glob("*.yaml"))
    check(files, "no manifests")
    check(K8S / "vllm" / "worker-vllm.yaml" in files, "no vllm/worker-vllm.yaml")
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
        args = container["args"]
        if "--engine" in args and args[args.index("--engine") + 1] == "external":
            # An external engine's worker computes whole requests (no P/D,
            # docs/engines.md); its engine beside it, on the pod's loopback.
            check("--role" not in args, f"{name} fronts an external engine: it takes no --role")
            upstream = args[args.index("--upstream") + 1]
            check(upstream.startswith("http://127.0.0.1:"), f"{name}'s engine is not on its pod's loopback: {upstream}")
            engines = pod["containers"][1:]
            check(len(engines) == 1, f"{name} runs no engine beside its worker")
            engine = engines[0]
            engine_args = engine["args"]
            check(engine_args[engine_args.index("--host") + 1] == "127.0.0.1" and "ports" not in engine,
                  f"{name}'s engine listens beyond its pod's loopback")
            check(upstream == f"http://127.0.0.1:{engine_args[engine_args.index('--port') + 1]}", f"{name}'s worker names another port than its engine's")
            for probe in ["startupProbe", "livenessProbe"]:
                command = " ".join(engine.get(probe, {}).get("exec", {}).get("command", []))
                check(f"{upstream}/health" in command, f"{name}'s engine has no {probe} asking its /health from inside the pod")
            check(not any("secret" in v for v in pod["volumes"] if v["name"] in {m["name"] for m in engine.get("volumeMounts", [])}),
                  f"{name}'s engine mounts a Secret")
        else:
            check(["--role", pool] == args[1:3], f"{name} runs another role than its pool {pool}")
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
        containers = deployment["spec"]["template"]["spec"]["containers"]
        check("readinessProbe" in containers[0], f"{name} has no readiness probe")
        named = [text for container in containers for text in list(container.get("args", [])) + [var.get("value", "") for var in container.get("env", [])]]
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
    check_envoy(deployments, services)
    check_trusted_proxies(deployments, by_kind.get("NetworkPolicy", []))
    check_drain(deployments)
    check_prometheus(deployments)
    print(f"infra/k8s: {len(resources)} resources in {len(files)} files valid; infra/envoy/envoy.yaml and infra/prometheus fit them")


def check_prometheus(deployments):
    """infra/prometheus: the rules load and pass their promtool tests, and
    the scrape jobs' relabelling keeps every Turbine pod's admin port and
    Envoy's stats port as the manifests name them. (Debian's Prometheus is
    built without Kubernetes discovery, so `promtool check config` cannot
    read prometheus.yml here; scripts/e2e.py runs it with the discovery
    replaced by its processes.)"""
    subprocess.run(["promtool", "check", "rules", str(PROMETHEUS / "turbine-rules.yml")], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["promtool", "test", "rules", "turbine-rules.test.yml"], check=True, cwd=PROMETHEUS, stdout=subprocess.DEVNULL)
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    check(set(jobs) == {"turbine", "envoy"}, f"infra/prometheus/prometheus.yml scrapes {sorted(jobs)}")

    def kept(job, deployment):
        """Whether the job's keep rules keep the deployment's pod, on the port they keep."""
        pod = deployment["spec"]["template"]
        container = pod["spec"]["containers"][0]
        meta = {f"__meta_kubernetes_pod_label_{re.sub('[^a-zA-Z0-9_]', '_', k)}": v for k, v in pod["metadata"]["labels"].items()}
        meta["__meta_kubernetes_pod_phase"] = "Running"
        for port in container.get("ports", []):
            labels = dict(meta, __meta_kubernetes_pod_container_port_name=port["name"])
            if all(re.fullmatch(rule["regex"], ";".join(labels.get(l, "") for l in rule["source_labels"]))
                   for rule in job["relabel_configs"] if rule.get("action") == "keep"):
                return port
        return None

    for deployment in deployments:
        name = deployment["metadata"]["name"]
        if name == "turbine-envoy":
            check(kept(jobs["envoy"], deployment)["name"] == "stats" and kept(jobs["turbine"], deployment) is None,
                  "prometheus.yml does not scrape Envoy's stats port alone")
        elif name == "turbine-redis":
            # No /metrics of its own (an exporter beside it would have one).
            check(kept(jobs["turbine"], deployment) is None, "prometheus.yml scrapes Redis as a Turbine service")
        elif name.startswith("turbine-"):
            port = kept(jobs["turbine"], deployment)
            check(port is not None and port["name"] == "admin", f"prometheus.yml does not scrape {name}'s admin port")


def check_envoy(deployments, services):
    """infra/envoy/envoy.yaml as infra/k8s/envoy.yaml runs it: every file
    it reads lies in a volume the container mounts, every gateway address
    it names is a port of a Service, and the readiness probe's path is one
    its stats listener serves. (scripts/e2e.py runs the file itself.)"""
    config = yaml.safe_load(ENVOY.read_text())
    envoy = next((d for d in deployments if d["metadata"]["name"] == "turbine-envoy"), None)
    check(envoy is not None, "no Deployment turbine-envoy")
    container = envoy["spec"]["template"]["spec"]["containers"][0]
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    args = container["args"]
    check(args[args.index("-c") + 1] in mounts, "turbine-envoy's -c is not the mounted configuration")
    files = re.findall(r"filename: ([^}\s]+)", ENVOY.read_text())
    check(files, "infra/envoy/envoy.yaml reads no file")
    for path in files:
        check(any(path.startswith(m.rstrip("/") + "/") for m in mounts), f"infra/envoy/envoy.yaml reads {path}, which turbine-envoy does not mount")
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name in ["gateway_http", "gateway_grpc"]:
        for group in clusters[name]["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                address = endpoint["endpoint"]["address"]["socket_address"]
                service = services.get(address["address"].split(".")[0])
                check(service is not None and address["address"].endswith(".turbine.svc.cluster.local"),
                      f"{name} names {address['address']}, which is no Service of the namespace")
                check(service["spec"].get("clusterIP") == "None", f"{name} names {address['address']}, not a headless Service (one address per pod)")
                check(any(p["port"] == address["port_value"] for p in service["spec"]["ports"]), f"{name} names port {address['port_value']}, which its Service does not have")
    listeners = {listener["name"]: listener for listener in config["static_resources"]["listeners"]}
    stats_port = listeners["stats"]["address"]["socket_address"]["port_value"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    check(ports.get("stats") == stats_port and ports.get("https") == listeners["api"]["address"]["socket_address"]["port_value"],
          "turbine-envoy's ports are not its listeners'")
    probe = container["readinessProbe"]["httpGet"]
    routes = listeners["stats"]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    check(probe["port"] == "stats" and any(r["match"].get("path") == probe["path"] and "route" in r for r in routes),
          "turbine-envoy's readiness probe asks for a path its stats listener does not serve")


def seconds(duration):
    """An Envoy duration ("2s", "0.5s") in seconds."""
    check(isinstance(duration, str) and duration.endswith("s"), f"infra/envoy/envoy.yaml: {duration!r} is not a duration in seconds")
    return float(duration[:-1])


def check_drain(deployments):
    """A service serves on, NOT_SERVING, for its drain delay after SIGTERM,
    then gives its streams the grace (TURBINE_SHUTDOWN_GRACE_SECS, 30 s by
    default for the gateway and routers) to finish: the pod's
    terminationGracePeriodSeconds must hold both. The gateways' delay
    must outlast the longest an Envoy health check takes to mark one
    down (interval plus timeout, one failure enough), or Envoy sends new
    requests to a gateway that no longer takes them."""
    def env(container, name):
        return next((v.get("value") for v in container.get("env", []) if v["name"] == name), None)

    for deployment in deployments:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        delay = float(env(container, "TURBINE_DRAIN_DELAY_SECS") or 0)
        grace = float(env(container, "TURBINE_SHUTDOWN_GRACE_SECS") or 30)
        if delay:
            check(pod.get("terminationGracePeriodSeconds", 30) >= delay + grace,
                  f"{name} is killed before its drain delay ({delay:g} s) and grace ({grace:g} s) are over")
    clusters = {c["name"]: c for c in yaml.safe_load(ENVOY.read_text())["static_resources"]["clusters"]}
    gateway = next(d for d in deployments if d["metadata"]["name"] == "turbine-gateway")
    delay = float(env(gateway["spec"]["template"]["spec"]["containers"][0], "TURBINE_DRAIN_DELAY_SECS") or 0)
    for cluster in ["gateway_http", "gateway_grpc"]:
        for health in clusters[cluster]["health_checks"]:
            marked_down = seconds(health["interval"]) * health["unhealthy_threshold"] + seconds(health["timeout"])
            check(delay > marked_down, f"turbine-gateway's drain delay ({delay:g} s) is over before Envoy's {cluster} health checks mark it down ({marked_down:g} s)")


def check_trusted_proxies(deployments, policies):
    """A Deployment that trusts proxies to name its clients
    (--trusted-proxies) takes connections on every port but its admin
    port from Envoy's pods alone: NetworkPolicies are a union, so every
    rule of every policy selecting its pods that admits such a port must
    admit Envoy's pods only (no address blocks, no other namespace), and
    one must admit them."""
    envoy = next(d for d in deployments if d["metadata"]["name"] == "turbine-envoy")
    envoy_labels = envoy["spec"]["template"]["metadata"]["labels"]
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        trusting = "--trusted-proxies" in container.get("args", []) or any(v["name"] == "TURBINE_TRUSTED_PROXIES" for v in container.get("env", []))
        if not trusting:
            continue
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies
                     if p["metadata"].get("namespace") == deployment["metadata"].get("namespace")
                     and all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
                     and not p["spec"]["podSelector"].get("matchExpressions")]
        ingress = [p for p in selecting if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        check(ingress, f"{name} trusts proxies but no NetworkPolicy limits who connects to it")
        rules = [rule for p in ingress for rule in p["spec"].get("ingress", [])]
        for port in container["ports"]:
            if port["name"] == "admin":
                continue
            admitting = [rule for rule in rules
                         if not rule.get("ports") or any(p.get("port") in (port["name"], port["containerPort"]) for p in rule["ports"])]
            check(admitting, f"no NetworkPolicy lets Envoy reach {name}'s port {port['name']}")
            for rule in admitting:
                peers = rule.get("from", [])
                check(peers and all(set(peer) == {"podSelector"} and not peer["podSelector"].get("matchExpressions")
                                    and peer["podSelector"].get("matchLabels") and all(envoy_labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
                                    for peer in peers),
                      f"{name} trusts proxies, but a NetworkPolicy lets others than Envoy's pods reach its port {port['name']}")


if __name__ == "__main__":
    main()
