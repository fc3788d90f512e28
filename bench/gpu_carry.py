"""Collect what ``make gpu-check`` needs and the GPU machine lacks into ``.gpu-carry/`` (git-ignored).

Run it here, where the package registries are reachable; the GPU machine has no network, only
Python 3.12 with torch, triton, transformers, grpcio and prometheus-client. Everything travels
with the checkout (at most 64 MiB in all), so no model weights do:

* ``site/``: wheels for CPython 3.12 on x86-64 Linux, unpacked (``pip install --target``, no
  dependencies pulled in), put first on PYTHONPATH by ``make gpu-check``: the gRPC health and
  reflection services, the protobuf runtime the committed stubs need, a grpcio at least as new as
  the one that generated them, the Redis client, pytest.
* ``bin/redis-server`` with ``redis/``: this machine's redis-server and the shared libraries it
  links beyond glibc, started through a wrapper that points the loader at them.
* ``smollm2/``: the default model's config, tokenizer and chat template (no weights): the check
  builds a model of that shape with random weights on the GPU machine.

    python -m bench.gpu_carry            # or: make gpu-carry
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Installed here at the versions the suite runs with; the GPU machine gets the same ones.
PACKAGES = ["grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "redis", "pytest", "pluggy",
            "iniconfig", "pygments", "pytest-timeout",
            # Quantized checkpoints: read (gguf, accelerate's empty model) and written by the tests
            # (compressed-tensors and what it needs).
            "gguf", "accelerate", "psutil", "compressed-tensors", "loguru", "pydantic", "pydantic-core",
            "annotated-types", "typing-inspection"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
MODEL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json"]
# Always on the GPU machine's own system: the wrapper must not replace them.
SYSTEM_LIBS = ("linux-vdso", "libc.so", "libm.so", "ld-linux", "libpthread", "libdl.so", "librt.so")
LIMIT_BYTES = 56 << 20  # leaves room for the checkout inside the 64 MiB that travels


def site_packages(out: Path, python_version: str) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    target = out / "site"
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
           "--target", str(target), "--python-version", python_version, "--implementation", "cp",
           *[f"--platform={p}" for p in PLATFORMS], *pins]
    subprocess.run(cmd, check=True)
    for junk in list(target.glob("bin")) + list(target.rglob("__pycache__")):
        shutil.rmtree(junk, ignore_errors=True)


def redis_server(out: Path) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found here: make redis first")
    lib_dir, bin_dir = out / "redis", out / "bin"
    shutil.rmtree(lib_dir, ignore_errors=True)
    lib_dir.mkdir(parents=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(binary), lib_dir / "redis-server")
    for line in subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if "=>" in parts and not parts[0].startswith(SYSTEM_LIBS) and len(parts) > 2 and parts[2].startswith("/"):
            shutil.copy2(os.path.realpath(parts[2]), lib_dir / parts[0])
    wrapper = bin_dir / "redis-server"
    wrapper.write_text('#!/bin/sh\n# The carried redis-server, with the libraries it was linked against here.\n'
                       'here="$(dirname "$(readlink -f "$0")")/../redis"\n'
                       'LD_LIBRARY_PATH="$here${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def model_files(out: Path, model: str) -> None:
    from splitserve.engine.model_loader import resolve_model
    source = resolve_model(model)
    target = out / "smollm2"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in MODEL_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, target / name)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / ".gpu-carry"))
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    site_packages(out, args.python_version)
    redis_server(out)
    model_files(out, args.model)
    total = size_of(out)
    print(f"{out}: {total / 2**20:.1f} MiB (site {size_of(out / 'site') / 2**20:.1f}, redis "
          f"{size_of(out / 'redis') / 2**20:.1f}, model files {size_of(out / 'smollm2') / 2**20:.1f})")
    if total > LIMIT_BYTES:
        raise SystemExit(f"{total / 2**20:.1f} MiB is more than the {LIMIT_BYTES >> 20} MiB that can travel")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
