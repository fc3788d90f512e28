"""The CPU kernels in ``csrc/`` (paged decode and prefill attention; fresh prefill chunks on AMX
tiles; the page copy of the shm KV transport; the call of splitserve/engine/cpu_linear.py's packed linears; the int8-weight linears of
splitserve/engine/quantization.py; the LoRA updates of splitserve/engine/lora/layers.py; the
OpenMP thread binding of splitserve/engine/openmp.py), compiled for this machine on first use and cached.
Beside them, and built apart (``matmul_available()``), the linears on oneDNN's matmul primitive
(``csrc/onednn_matmul_cpu.cpp``, cpu_linear.py's ``onednn-matmul``): they link the oneDNN of the
``onednn-cpu-gomp`` wheel, and a machine without it still has every other kernel.

``torch.utils.cpp_extension`` builds the sources with ``-O3 -march=native`` into
``cache_dir()/torch_extensions/<key>``, where the key covers the sources (and where they are), torch's
version and the CPU's instruction sets, so a changed kernel, torch or machine builds afresh and an unchanged
one loads in milliseconds. ``make install`` builds it once (``python -m
splitserve.engine.attention.cpu_kernels``) so a server's first request does not wait for the compiler.
The ops register under ``torch.ops.splitserve_cpu``; ``available()`` says whether they loaded
(no compiler, no ninja: the torch path serves instead, with a warning).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention_cpu.cpp", "prefill_attention_cpu.cpp",
                                                                   "copy_pages_cpu.cpp", "onednn_linear_cpu.cpp",
                                                                   "linear_quantized_cpu.cpp", "lora_cpu.cpp",
                                                                   "fresh_prefill_amx_cpu.cpp", "thread_binding_cpu.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build_key(sources: list[Path] | None = None, flags: list[str] = CFLAGS) -> str:
    sources = _SOURCES if sources is None else sources
    h = hashlib.sha256()
    # The checkout too: torch's build file names the sources by path, so two checkouts sharing one
    # build directory rebuilt it in turn, each start of one after the other's waiting ~80 s for it.
    h.update(str(sources[0].parent.resolve()).encode())
    for source in [*sources, *sorted(sources[0].parent.glob("*.h"))]:  # the headers they include too
        h.update(source.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _build_dir(sources: list[Path], ldflags: list[str]) -> Path:
    from splitserve.engine.model_files import cache_dir
    return cache_dir() / "torch_extensions" / _build_key(sources, CFLAGS + ldflags)


def _build(prefix: str, sources: list[Path], ldflags: list[str], include: list[str] = ()) -> None:
    from torch.utils import cpp_extension

    build_dir = _build_dir(sources, ldflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch takes a lock file (``lock``, its FileBaton) around every load, built or not, and waits
    # while it exists: one left by a process killed mid-build (a worker stopped during its first
    # start) made every later start wait forever. An flock is released with its process, so whoever
    # holds it is the only one here alive, and a ``lock`` file found then is stale.
    with open(build_dir / "splitserve.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        cpp_extension.load(name=f"{prefix}_{build_dir.name}", sources=[str(s) for s in sources], extra_cflags=CFLAGS,
                           extra_ldflags=ldflags, extra_include_paths=list(include), build_directory=str(build_dir),
                           is_python_module=False, verbose=False)


def load() -> None:
    """Build (if needed) and load the ops; raises if the toolchain cannot build them."""
    with _lock:
        if _state.get("loaded"):
            return
        _build("splitserve_cpu", _SOURCES, ["-fopenmp"])
        _state["loaded"] = True


_MATMUL_SOURCES = [Path(__file__).parent / "csrc" / "onednn_matmul_cpu.cpp"]


def onednn_root() -> Path | None:
    """Where the ``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp`` wheels put oneDNN (their data
    files go under the environment's prefix: ``include/dnnl.hpp``, ``lib/libdnnl.so.3``), if they did.
    That build's OpenMP runtime is ``libgomp.so.1``, the one torch loads, so its threads are torch's."""
    root = Path(sys.prefix)
    return root if (root / "include" / "dnnl.hpp").is_file() and (root / "lib" / "libdnnl.so.3").is_file() else None


def matmul_available() -> bool:
    """Whether the ops of ``torch.ops.splitserve_dnnl`` (oneDNN's matmul primitive) are loaded; builds
    them the first time, and remembers why not (``matmul_error()``)."""
    with _lock:
        if "matmul" in _state:
            return _state["matmul"] is True
        root = onednn_root()
        try:
            if root is None:
                raise RuntimeError(f"no oneDNN under {sys.prefix} (pip install onednn-cpu-gomp onednn-devel-cpu-gomp)")
            lib = root / "lib"
            _build("splitserve_dnnl", _MATMUL_SOURCES, ["-fopenmp", f"-L{lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib}"],
                   [str(root / "include")])
            _state["matmul"] = True
        except Exception as e:  # no wheel, a failed build: the inner product serves
            _state["matmul"] = e
            log.info("oneDNN matmul linears unavailable (%s)", e)
        return _state["matmul"] is True


def matmul_error() -> BaseException | None:
    error = _state.get("matmul")
    return error if isinstance(error, BaseException) else None


# Head sizes the kernel is instantiated for (csrc/paged_attention_cpu.cpp, dispatch_head_dim).
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)


def load_error() -> BaseException | None:
    """Why the ops could not be built, if they could not."""
    return _state.get("error")  # type: ignore[return-value]


def available() -> bool:
    """True once the ops are loaded; tries to load them the first time and remembers a failure."""
    if _state.get("loaded"):
        return True
    if "error" in _state:
        return False
    try:
        load()
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        _state["error"] = e
        log.warning("CPU attention kernels unavailable (%s); decode attention falls back to the slower "
                    "torch path", e)
        return False


if __name__ == "__main__":
    import time

    start = time.perf_counter()
    load()
    print(f"CPU attention kernels ready ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    if matmul_available():
        print(f"oneDNN matmul linears ready ({time.perf_counter() - start:.1f} s)")
    else:
        print(f"oneDNN matmul linears unavailable: {matmul_error()}")
