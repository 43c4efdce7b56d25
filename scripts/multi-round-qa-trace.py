#!/usr/bin/env python3
"""Writes a multi-round QA workload as a Mooncake-format trace (JSONL) for
`turbine bench replay`.

Each user has a long context of its own (a document) and asks questions
about it in rounds; every round's prompt is the whole conversation so far
(context, earlier questions and answers) plus the new question, so it
extends the previous round's prompt and only its tail is new. Users start
staggered and come back every --think-secs, so the prefixes worth keeping
add up to users x (context + rounds x (question + answer)) tokens: pick
--users to make that several times what the workers' pools hold.

    scripts/multi-round-qa-trace.py --users 200 --rounds 6 > qa.jsonl
    turbine bench replay --trace qa.jsonl --host-cache-mib 0,262144 ...
"""

import argparse
import json
import math
import sys

BLOCK = 512  # tokens per hash id in Mooncake traces


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--context-tokens", type=int, default=6000)
    parser.add_argument("--question-tokens", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=100)
    parser.add_argument("--think-secs", type=float, default=60.0, help="time between a user's rounds")
    args = parser.parse_args()
    if min(args.users, args.rounds, args.context_tokens, args.question_tokens, args.answer_tokens) <= 0 or args.think_secs <= 0:
        parser.error("every count and --think-secs must be positive")

    turn = args.question_tokens + args.answer_tokens
    ids_per_user = math.ceil((args.context_tokens + args.rounds * turn) / BLOCK)
    requests = []
    for user in range(args.users):
        start = user * args.think_secs / args.users
        for round_ in range(args.rounds):
            length = args.context_tokens + round_ * turn + args.question_tokens
            requests.append({
                "timestamp": round((start + round_ * args.think_secs) * 1000),
                "input_length": length,
                "output_length": args.answer_tokens,
                "hash_ids": [user * ids_per_user + i for i in range(math.ceil(length / BLOCK))],
            })
    requests.sort(key=lambda r: r["timestamp"])
    for request in requests:
        sys.stdout.write(json.dumps(request) + "\n")


if __name__ == "__main__":
    main()
