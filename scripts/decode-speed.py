#!/usr/bin/env python3
"""Decode speed of an OpenAI-compatible server: one greedy stream of
--tokens tokens (end of generation ignored), timed from its first token to
its last; prints `tokens/s`. The same client measures Turbine and vLLM in
scripts/gpu-check.sh. Standard library only.

    decode-speed.py BASE_URL MODEL [--tokens N] [--rounds R]
"""

import argparse
import json
import statistics
import sys
import time
import urllib.request


def one_stream(base, model, tokens):
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"content-type": "application/json"})
    first, last, chunks = None, None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                now = time.monotonic()
                first = first or now
                last = now
                chunks += 1
    if first is None or last == first:
        raise SystemExit(f"the stream from {base} carried no tokens")
    return (tokens - 1) / (last - first)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    one_stream(args.base, args.model, 16)  # warm-up
    speeds = [one_stream(args.base, args.model, args.tokens) for _ in range(args.rounds)]
    print(f"{statistics.median(speeds):.1f}")


if __name__ == "__main__":
    sys.exit(main())
