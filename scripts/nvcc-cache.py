#!/usr/bin/env python3
"""A compile cache in front of nvcc, for the CUDA check (scripts/check-cuda.sh).

candle compiles its CUDA kernels with nvcc in its build script: about seven
minutes of one core here, on every fresh target directory, for sources that
change only when candle's version does. This stands in for nvcc: a compile
(`-c -o OBJ ... FILE` or `--ptx --output-directory DIR ... FILE`) whose
inputs it has seen before is answered from the cache; any other call (and a
compile it has not seen) runs the real nvcc, whose output is then kept.

The key is everything the output depends on: the real nvcc's `--version`,
the arguments (the output's own path left out), and the contents of every
file of the crate the source belongs to (the source and the headers it
includes from its crate; a registry crate's files are fixed by its version).
Headers outside the crate come from the toolkit, named by its version.

Environment:
  TURBINE_NVCC        the real nvcc (required)
  TURBINE_NVCC_CACHE  the cache directory (required); entries unused for
                      30 days are removed
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

KEEP_DAYS = 30


def crate_root(source):
    directory = os.path.dirname(os.path.abspath(source))
    while directory != os.path.dirname(directory):
        if os.path.exists(os.path.join(directory, "Cargo.toml")):
            return directory
        directory = os.path.dirname(directory)
    return None


def tree_digest(root, digest):
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        subdirs[:] = [d for d in subdirs if d not in ("target", ".git")]
        for name in sorted(files):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as file:
                digest.update(hashlib.sha256(file.read()).digest())


def parse(args):
    """(source, output file, output directory, the other arguments) of a
    compile this cache can answer, or None."""
    if "--lib" in args or not args or not args[-1].endswith(".cu"):
        return None
    source, rest, output, output_dir, i = args[-1], [], None, None, 0
    while i < len(args) - 1:
        if args[i] == "-o" and i + 1 < len(args) - 1:
            output, i = args[i + 1], i + 2
        elif args[i] == "--output-directory" and i + 1 < len(args) - 1:
            output_dir, i = args[i + 1], i + 2
        else:
            rest.append(args[i])
            i += 1
    if "--ptx" in rest and output_dir and not output:
        output = os.path.join(output_dir, os.path.splitext(os.path.basename(source))[0] + ".ptx")
    elif "-c" not in rest or not output or output_dir:
        return None
    return source, output, rest


def prune(cache):
    cutoff = time.time() - KEEP_DAYS * 86400
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        try:
            if os.path.getmtime(path) < cutoff:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        except OSError:
            pass


def main():
    real, cache, args = os.environ["TURBINE_NVCC"], os.environ["TURBINE_NVCC_CACHE"], sys.argv[1:]
    compile_ = parse(args)
    root = crate_root(compile_[0]) if compile_ else None
    if not compile_ or not root:
        os.execv(real, [real] + args)
    source, output, rest = compile_

    digest = hashlib.sha256()
    digest.update(subprocess.run([real, "--version"], check=True, capture_output=True).stdout)
    digest.update("\0".join(rest).encode() + b"\0")
    digest.update(os.path.relpath(os.path.abspath(source), root).encode() + b"\0")
    tree_digest(root, digest)
    entry = os.path.join(cache, digest.hexdigest() + ".out")

    if os.path.exists(entry):
        os.utime(entry)
        shutil.copyfile(entry, output)
        return 0

    status = subprocess.run([real] + args).returncode
    if status == 0 and os.path.exists(output):
        os.makedirs(cache, exist_ok=True)
        prune(cache)
        # Written aside and renamed: a concurrent compile of the same
        # source never sees half an entry.
        fd, partial = tempfile.mkstemp(dir=cache, suffix=".partial")
        os.close(fd)
        shutil.copyfile(output, partial)
        os.replace(partial, entry)
    return status


if __name__ == "__main__":
    sys.exit(main())
