#!/usr/bin/env python3
"""llama.cpp baseline for `turbine bench engine`: prompt processing and
single-stream decode speed on a GGUF file, through llama-cpp-python.

Prints one JSON object: {"prefill_tokens_per_s", "decode_tokens_per_s",
"greedy_tokens", ...}. Install llama-cpp-python without AMX (see
docs/benchmarks.md); the AMX build dies with SIGILL on these machines.
"""

import argparse
import json
import time

from llama_cpp import Llama


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-ids", help="comma-separated token ids (else a synthetic prompt)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    llm = Llama(model_path=args.model, n_ctx=max(2048, args.prompt_tokens + args.decode_tokens + 8), n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, verbose=False, logits_all=False)
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    else:
        prompt = (llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 200, add_bos=False))[: args.prompt_tokens]

    best_prefill, best_decode, greedy = 0.0, 0.0, []
    for _ in range(args.repeats):
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        prefill = len(prompt) / (time.perf_counter() - started)
        tokens = []
        started = time.perf_counter()
        for _ in range(args.decode_tokens):
            token = llm.sample(temp=0.0)
            tokens.append(int(token))
            llm.eval([token])
        decode = args.decode_tokens / (time.perf_counter() - started)
        best_prefill, best_decode, greedy = max(best_prefill, prefill), max(best_decode, decode), tokens
    print(json.dumps({"engine": "llama.cpp (llama-cpp-python)", "threads": args.threads, "prompt_tokens": len(prompt),
                      "decode_tokens": args.decode_tokens, "prefill_tokens_per_s": best_prefill,
                      "decode_tokens_per_s": best_decode, "greedy_tokens": greedy}))


if __name__ == "__main__":
    main()
