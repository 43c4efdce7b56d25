#!/usr/bin/env python3
"""Converts a GGUF model to a Hugging Face directory (safetensors weights,
config.json, tokenizer.json, tokenizer_config.json, generation_config.json)
for engines that do not load GGUF (vLLM). Offline: reads only the file.

    gguf-to-hf.py MODEL.gguf OUT_DIR

Runs with the Python of an engine's environment (scripts/install-vllm.sh
puts transformers, gguf and accelerate there). The weights are
de-quantised to float32; the tokenizer and chat template are the file's
own, as transformers converts them.
"""

import json
import os
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    gguf, out = sys.argv[1], sys.argv[2]
    if os.path.exists(os.path.join(out, "config.json")):
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf))
    partial = out + ".partial"
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype="float32")
    # save_pretrained refuses a model loaded from GGUF (it thinks it
    # quantised); the weights are de-quantised floats by now: write them
    # and the configuration directly.
    from safetensors.torch import save_file

    os.makedirs(partial, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    with open(os.path.join(partial, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    weights = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    save_file(weights, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(partial)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.save_pretrained(partial)
    os.rename(partial, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
