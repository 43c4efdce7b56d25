#!/usr/bin/env python3
"""Regenerates crates/native/tests/fixtures/llama_cpp_chat_greedy.json: for a
few chat questions, the prompt ids llama.cpp gets from the GGUF's own chat
template and tokenizer, and its greedy answer (up to 16 tokens, ending with
end-of-sequence if it comes first), through llama-cpp-python (built without AMX, see
docs/benchmarks.md).

    python3 scripts/llama_cpp_chat_fixture.py --model ~/.cache/turbine/models/smollm2-135m/*.gguf > fixture.json
"""

import argparse
import json

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three colors of the rainbow.",
    "What is 2 + 2?",
    "Give me a tip for learning to code.",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    eos = llm.token_eos()
    formatter = Jinja2ChatFormatter(template=template, eos_token=llm.detokenize([eos]).decode(), bos_token="",
                                    add_generation_prompt=True)
    cases = []
    for question in QUESTIONS:
        rendered = formatter(messages=[{"role": "user", "content": question}]).prompt
        prompt = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(prompt)
        greedy = []
        for _ in range(args.max_tokens):
            token = int(llm.sample(temp=0.0))
            greedy.append(token)
            if token == eos:
                break
            llm.eval([token])
        text = llm.detokenize([t for t in greedy if t != eos]).decode("utf-8", errors="replace")
        cases.append({"question": question, "prompt_ids": prompt, "greedy": greedy, "text": text})
    generator = f"llama-cpp-python {llama_cpp.__version__}, greedy (temp 0), n_threads {args.threads}"
    print(json.dumps({"generator": generator, "cases": cases}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
